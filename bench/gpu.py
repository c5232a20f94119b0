"""GPU benchmark: losses, engine and service on one CUDA device, in one table with ratios from the same run.

    python bench/gpu.py                              # all parts, H100-sized (CUDA only; about 15 minutes)
    python bench/gpu.py --parts losses engine        # a subset (each part fits in one 10-minute call)
    python bench/gpu.py --parts service --workdir /tmp/bench-gpu   # the generated JPEG set is kept there
    python bench/gpu.py --quick                      # tiny sizes; also runs on CPU: a smoke run of the paths
    python bench/gpu.py --parts service --service-decode gpu       # the service with one data.decode
    python bench/gpu.py --parts service --service-decode gpu:0.3   # ... and data.host_decode_share=0.3

Parts:
- losses: forward+backward at B = 4,096-65,536 (D=512, 4 per class) of dmltrain's losses with the device's
  memory budgets, with the CPU default (64 MB blocks) at B=16,384 for comparison, column-streamed (forced)
  at 16,384 and 65,536, against pytorch-metric-learning 2.9.0 with defaults and the floor S = X Xᵀ forward +
  backward. Time = best of --rounds after a warm-up; memory = peak allocated above the inputs.
- engine: ResNet-50 at 224 px, bf16 autocast, Smooth-AP: a bare forward/backward of the whole batch (where it
  fits) and `global_batch_step` in chunks of 256 at B = 256-8,192, eager NCHW, channels_last, and
  channels_last + torch.compile. Pinned uint8 inputs, as the service hands them over.
- service: generates a JPEG set (thousands of classes, 256 px), prepares WebDataset shards, runs
  `python -m dmltrain.run` on one GPU worker with a generated config, and reads images/s, data wait share,
  peak GPU memory and the seconds per step of each timed phase back from MLflow; against the engine (same
  settings, plus the Adam step the service also takes) on the same images decoded once into memory, and
  (with a gpu decode run) that engine again while a thread decodes the JPEGs on the device one batch ahead,
  as the service's loader does: the cost of the device decode path alone; (with a cpu decode run) that
  engine beside as many processes decoding JPEGs with PIL as the service has loader workers: the cost of
  their CPU load alone. Each service run also records one step after the measured ones with torch.profiler
  (train.profile_start) and prints the top of its operator table; table and trace land in
  WORKDIR/profile-decode-<decode>/, and one profiled step of the engine alone and beside the decoder in
  WORKDIR/profile-engine*/. One run per --service-decode value (data.decode, with `:SHARE` its
  data.host_decode_share; default cpu then gpu on CUDA, cpu elsewhere); the goals judge the fastest run.
Ratios compare cases of the same run. GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
LOSS_NAMES = ("fastap", "smoothap", "rll", "triplet")
TITLES = {"fastap": "FastAP", "smoothap": "Smooth-AP", "rll": "Ranked List", "triplet": "triplet"}

FULL = {
    "loss_sizes": [4096, 16384, 65536],
    "loss_dim": 512,
    "compare_at": 16384,
    "stream_sizes": [16384, 65536],
    "pml_max": {"smoothap": 1024},  # PML Smooth-AP builds B^3 tensors
    "engine_model": "resnet50",
    "engine_size": 224,
    "engine_sizes": [256, 1024, 4096, 8192],
    "bare_sizes": [256, 1024],
    "chunk": 256,
    "steps": 3,
    "service_classes": 4000,  # thousands of classes; a batch of 4,096 at K=4 takes 1,024 of them
    "service_per_class": 8,
    "service_test_classes": 100,
    "service_side": 256,
    "service_batch": 4096,
    "service_steps": 30,
    "service_log_every": 10,
    "loader_workers": 10,
}
QUICK = {
    "loss_sizes": [512, 1024],
    "loss_dim": 64,
    "compare_at": 1024,
    "stream_sizes": [1024],
    "pml_max": {"smoothap": 256},
    "engine_model": "resnet18",
    "engine_size": 32,
    "engine_sizes": [64, 128],
    "bare_sizes": [64],
    "chunk": 32,
    "steps": 2,
    "service_classes": 200,
    "service_per_class": 4,
    "service_test_classes": 20,
    "service_side": 64,
    "service_batch": 64,
    "service_steps": 6,
    "service_log_every": 3,
    "loader_workers": 1,
}


@dataclass
class Row:
    part: str
    case: str
    batch: int
    seconds: float | None = None
    images_per_second: float | None = None
    peak_bytes: float | None = None
    ratio: float | None = None
    ratio_of: str = ""
    note: str = ""
    data_wait: float | None = None  # service: share of step time spent waiting for the batch


# ----------------------------------------------------------------------------------------------------
# measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(step, device: torch.device, rounds: int) -> tuple[float, float | None]:
    """(best seconds of `rounds` after one warm-up, peak bytes allocated above the state before)."""
    step()
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    best = math.inf
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    return best, peak


def _guarded(fn, device: torch.device) -> tuple[object, str]:
    """Run `fn`; an out-of-memory error becomes a note instead of ending the benchmark."""
    try:
        return fn(), ""
    except torch.OutOfMemoryError:
        return None, "out of memory"
    except RuntimeError as error:  # CPU allocators raise plain RuntimeErrors
        if "memory" in str(error).lower():
            return None, "out of memory"
        raise
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# losses


def _our_loss(name: str, **budget):
    from dmltrain.losses import FastAPLoss, RankedListLoss, SmoothAPLoss, TripletLoss

    return {
        "fastap": lambda: FastAPLoss(num_bins=10, **budget),
        "smoothap": lambda: SmoothAPLoss(temperature=0.01, **budget),
        "rll": lambda: RankedListLoss(margin=0.4, alpha=None, tn=10.0, tp=0.0, lam=0.5, **budget),
        "triplet": lambda: TripletLoss(margin=0.2, **budget),
    }[name]()


def _pml_loss(name: str):
    import warnings

    from pytorch_metric_learning import distances
    from pytorch_metric_learning import losses as pml

    warnings.filterwarnings("ignore", message="Values of Tp or Tn are too high")
    return {
        "fastap": lambda: pml.FastAPLoss(num_bins=10),
        "smoothap": lambda: pml.SmoothAPLoss(temperature=0.01),
        "rll": lambda: pml.RankedListLoss(margin=0.4, Tn=10.0, imbalance=0.5, alpha=None, Tp=0.0),
        "triplet": lambda: pml.TripletMarginLoss(margin=0.2, distance=distances.LpDistance(power=2)),
    }[name]()


def bench_losses(plan: dict, device: torch.device, rounds: int, use_pml: bool) -> list[Row]:
    rows: list[Row] = []
    for batch in plan["loss_sizes"]:
        rows += _losses_at(batch, plan, device, rounds, use_pml)
    return rows


class _LossCase:
    """One batch of unit embeddings (4 per class) and timed forward+backward calls on it."""

    def __init__(self, batch: int, dim: int, device: torch.device, rounds: int) -> None:
        torch.manual_seed(0)
        self.batch, self.device, self.rounds = batch, device, rounds
        self.labels = torch.arange(batch // 4, device=device).repeat_interleave(4)
        self.x = F.normalize(torch.randn(batch, dim, device=device), dim=1).requires_grad_(True)

    def time(self, loss_fn) -> tuple[tuple[float, float | None] | None, str]:
        def step() -> None:
            self.x.grad = None
            loss_fn(self.x, self.labels).backward()

        return _guarded(lambda: _measure(step, self.device, self.rounds), self.device)

    def time_floor(self) -> tuple[tuple[float, float | None] | None, str]:
        def measure() -> tuple[float, float | None]:
            upstream = torch.ones(self.batch, self.batch, device=self.device)  # an input, like x

            def step() -> None:
                self.x.grad = None
                (self.x @ self.x.T).backward(upstream)

            return _measure(step, self.device, self.rounds)

        return _guarded(measure, self.device)


def _losses_at(batch: int, plan: dict, device: torch.device, rounds: int, use_pml: bool) -> list[Row]:
    case = _LossCase(batch, plan["loss_dim"], device, rounds)
    result, note = case.time_floor()
    floor = result[0] if result else None
    rows = [Row("losses", "floor: X Xᵀ fwd+bwd", batch, floor, None, result and result[1], note=note)]
    variants: list[tuple[str, dict]] = [("dmltrain", {})]
    if batch == plan["compare_at"] and device.type == "cuda":
        variants.append(("dmltrain, 64 MB blocks (CPU default)", {"memory_budget_mb": 64.0}))
    if batch in plan["stream_sizes"]:
        variants.append(("dmltrain, column-streamed", {"saved_budget_mb": 1e-3}))
    for name in LOSS_NAMES:
        ours = None
        for label, budget in variants:
            result, note = case.time(_our_loss(name, **budget))
            seconds = result[0] if result else None
            ours = seconds if label == "dmltrain" else ours
            ratio = seconds / floor if seconds and floor else None
            peak = result and result[1]
            rows.append(
                Row("losses", f"{TITLES[name]}: {label}", batch, seconds, None, peak, ratio, "floor", note)
            )
        if not use_pml:
            continue
        if batch > plan["pml_max"].get(name, batch):
            rows.append(Row("losses", f"{TITLES[name]}: PML 2.9.0", batch, note="skipped (B^3 memory)"))
            continue
        result, note = case.time(_pml_loss(name))
        seconds = result[0] if result else None
        ratio = seconds / ours if seconds and ours else None
        peak = result and result[1]
        rows.append(
            Row(
                "losses",
                f"{TITLES[name]}: PML 2.9.0",
                batch,
                seconds,
                None,
                peak,
                ratio,
                "dmltrain (time)",
                note,
            )
        )
    return rows


# ----------------------------------------------------------------------------------------------------
# engine


def _engine_model(name: str, device: torch.device, channels_last: bool, compiled: bool, backend: str | None):
    from dmltrain.acceleration import compile_network
    from dmltrain.models import build_model, freeze_batchnorm

    torch.manual_seed(0)
    model = build_model(name, 512).to(device)
    model.train()
    freeze_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compiled:
        compile_network(model, **({"backend": backend} if backend else {}))
    return model


def _uint8_batch(batch: int, side: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=g)
    labels = (torch.arange(batch) // 4)[torch.randperm(batch, generator=g)]
    return (images.pin_memory() if pin else images), labels


def _engine_steps(
    model, images, labels, plan: dict, device, autocast, channels_last: bool, bare: bool, optimizer
):
    from dmltrain.engine import global_batch_step
    from dmltrain.losses import SmoothAPLoss
    from dmltrain.models import normalize_images

    loss_fn = SmoothAPLoss(temperature=0.01)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if bare:
            x = normalize_images(images.to(device, non_blocking=True))
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                emb = model(x)
            loss_fn(emb.float(), labels.to(device)).backward()
        else:
            global_batch_step(
                model,
                images,
                labels,
                loss_fn,
                plan["chunk"],
                preprocess=normalize_images,
                autocast_dtype=autocast,
                channels_last=channels_last,
            )
        if optimizer is not None:
            optimizer.step()

    return step


def bench_engine(plan: dict, device: torch.device, rounds: int, backend: str | None) -> list[Row]:
    from dmltrain.acceleration import resolve_precision

    autocast = resolve_precision("auto", device).autocast_dtype
    modes = [
        ("eager NCHW", False, False),
        ("channels_last", True, False),
        ("channels_last + compile", True, True),
    ]
    # The compiled bare step runs only at B = chunk, so it reuses the chunked step's graph: a second batch
    # shape would make dynamo recompile the module for dynamic shapes, and the chunked rows would then
    # time that graph instead of the static one the service runs.
    models = {label: _engine_model(plan["engine_model"], device, cl, c, backend) for label, cl, c in modes}
    rows: list[Row] = []
    baseline = None
    for batch in sorted(set(plan["engine_sizes"]) | set(plan["bare_sizes"])):
        images, labels = _uint8_batch(batch, plan["engine_size"], pin=device.type == "cuda")
        for bare in (True, False):
            if bare and batch not in plan["bare_sizes"]:
                continue
            if not bare and batch not in plan["engine_sizes"]:
                continue
            for label, channels_last, compiled in modes:
                if bare and compiled and batch != plan["bare_sizes"][0]:
                    continue  # one static compiled graph per model: the chunk's shape (see above)
                step = _engine_steps(
                    models[label], images, labels, plan, device, autocast, channels_last, bare, None
                )
                result, note = _guarded(lambda step=step: _measure(step, device, rounds), device)
                seconds = result[0] if result else None
                rate = batch / seconds if seconds else None
                if bare and label == "eager NCHW" and baseline is None and rate:
                    baseline = rate
                kind = "bare fwd+bwd" if bare else f"chunked ({plan['chunk']})"
                rows.append(
                    Row(
                        "engine",
                        f"{plan['engine_model']} {plan['engine_size']} px {kind}, {label}",
                        batch,
                        seconds,
                        rate,
                        result and result[1],
                        rate / baseline if rate and baseline else None,
                        f"bare eager B={plan['bare_sizes'][0]} (img/s)",
                        note,
                    )
                )
        del images, labels
    return rows


# ----------------------------------------------------------------------------------------------------
# service


def _make_jpegs(root: Path, classes: int, per_class: int, test_classes: int, side: int, workers: int) -> None:
    """Smooth random images (low-frequency colour fields with texture): JPEG sizes and decode costs
    close to photos (pure noise would be the slowest possible decode)."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [("train", c, per_class) for c in range(classes)] + [("test", c, 6) for c in range(test_classes)]
    chunks = [jobs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_write_class_images, [(str(root), side, chunk) for chunk in chunks]))


def _write_class_images(args: tuple[str, int, list[tuple[str, int, int]]]) -> None:
    import numpy as np
    from PIL import Image

    root, side, jobs = args
    for split, cls, count in jobs:
        folder = Path(root) / split / f"{split}{cls:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng([0 if split == "train" else 1, cls])  # the same set on every run
        for i in range(count):
            coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            image = Image.fromarray(coarse).resize((side, side), Image.BICUBIC)
            texture = rng.normal(0, 12, (side, side, 3))
            pixels = np.clip(np.asarray(image, dtype=np.float32) + texture, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)


def _worker_cpus() -> int:
    """CPUs of the service's one Ray worker (Ray sets its torch threads to this)."""
    return max(1, min(8, (os.cpu_count() or 2) - 2))


def _decode_setting(value: str) -> str:
    """A --service-decode value: auto, cpu, gpu, or gpu:SHARE / auto:SHARE (data.host_decode_share)."""
    mode, colon, share = value.partition(":")
    try:
        ok = mode in ("auto", "cpu", "gpu") and (not colon or (mode != "cpu" and 0 <= float(share) <= 1))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto, cpu, gpu or gpu:SHARE, 0 <= SHARE <= 1")
    return value


def _service_config(
    plan: dict, shards: Path, work: Path, use_gpu: bool, decode: str = "auto", profile: bool = False
) -> Path:
    """The run's config. With `profile`, two steps more than the measured ones: a warm-up and one step
    recorded by torch.profiler (train.profile_start), after the last measured window."""
    import yaml

    cpus = _worker_cpus()
    measured = plan["service_steps"]
    mode, _, share = decode.partition(":")
    config = {
        "data": {
            "root": str(shards),
            "image_size": plan["engine_size"],
            "resize": plan["service_side"],
            "loader_workers": plan["loader_workers"],
            "decode": mode,
            "host_decode_share": float(share or 0),
        },
        "sampler": {"name": "pk", "samples_per_class": 4},
        "model": {"backbone": plan["engine_model"], "embedding_dim": 512, "weights": None, "freeze_bn": True},
        "loss": {"name": "smoothap", "temperature": 0.01},
        "optim": {"name": "adam", "lr": 1e-5},
        "train": {
            "steps": measured + 2 if profile else measured,
            **({"profile_start": measured + 2, "profile_steps": 1} if profile else {}),
            "global_batch_size": plan["service_batch"],
            "chunk_size": plan["chunk"],
            "log_every": plan["service_log_every"],
            "checkpoint_every": 10**6,
            "eval_every": 10**6,
            "eval_at_start": False,
        },
        "eval": {"ks": [1], "batch_size": 256, "max_images": 600, "grid_queries": 0},
        "scaling": {"num_workers": 1, "use_gpu": use_gpu, "cpus_per_worker": cpus, "topology": "single-node"},
        "run": {"name": f"bench-gpu-{int(time.time())}", "storage_path": str(work / "ray_results")},
        "mlflow": {
            "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
            "experiment": "bench-gpu",
            "log_checkpoints": False,
        },
    }
    path = work / "bench_service.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _service_metrics(uri: str, run_id: str, last_step: int) -> dict[str, float]:
    """The last window logged up to `last_step` (steady state: the first window holds compilation and
    loader start-up; steps after `last_step` were profiled)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    out, windows = {}, {}
    for key in ("train/images_per_second", "train/data_wait_share", "train/gpu_peak_memory_gb"):
        windows[key] = sorted(
            (m for m in client.get_metric_history(run_id, key) if m.step <= last_step), key=lambda m: m.step
        )
        if windows[key]:
            out[key] = windows[key][-1].value
    out["windows"] = len(windows["train/images_per_second"])
    out["phases"] = _last_window_phases(client, run_id, last_step)
    tags = client.get_run(run_id).data.tags
    out["tags"] = {k: v for k, v in tags.items() if k.startswith("dmltrain.")}
    return out


def _last_window_phases(client, run_id: str, last_step: int) -> dict[str, float]:
    """Seconds per step of each phase the worker times (time/<phase>_seconds, cumulative, logged with every
    log line) over the last log window: where a step's time goes, for the gap to the engine. On CUDA the
    phases are host time: GPU work queued in one phase is waited for in the next that synchronises
    (the update reads the loss and the gradient norm)."""
    history = {
        phase: {m.step: m.value for m in client.get_metric_history(run_id, f"time/{phase}_seconds")}
        for phase in ("step", "data", "engine", "update", "eval", "checkpoint", "loop")
    }
    logged = sorted(step for step in history["step"] if step <= last_step)
    if len(logged) < 2:
        return {}
    first, last = logged[-2:]
    delta = {
        phase: (values[last] - values[first]) / (last - first)
        for phase, values in history.items()
        if first in values and last in values
    }
    out = {k: delta[k] for k in ("step", "data", "engine", "update") if k in delta}
    if {"loop", "step", "eval", "checkpoint"} <= delta.keys():  # logging and the loop's own work
        out["outside steps"] = delta["loop"] - delta["step"] - delta["eval"] - delta["checkpoint"]
    return out


def _decode_for_engine(root: Path, batch: int, side: int, crop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first batch/4 train classes x 4 images, decoded once, resized and centre-cropped."""
    import numpy as np
    from PIL import Image

    images, labels = [], []
    for cls, folder in enumerate(sorted((root / "train").iterdir())[: batch // 4]):
        for path in sorted(folder.glob("*.jpg"))[:4]:
            with Image.open(path) as im:
                im = im.convert("RGB").resize((side, side))
                left = (side - crop) // 2
                im = im.crop((left, left, left + crop, left + crop))
                images.append(torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1))
                labels.append(cls)
    return torch.stack(images), torch.tensor(labels)


def bench_service(
    plan: dict,
    device: torch.device,
    rounds: int,
    workdir: Path,
    backend: str | None,
    decodes: tuple[str, ...] = ("cpu",),
    lean: bool = False,
) -> list[Row]:
    from dmltrain.acceleration import resolve_precision
    from dmltrain.data import prepare

    jpegs, shards = workdir / "jpegs", workdir / "shards"
    workers = max(1, (os.cpu_count() or 2))
    started = time.perf_counter()
    if not (jpegs / "train").is_dir():
        _make_jpegs(
            jpegs,
            plan["service_classes"],
            plan["service_per_class"],
            plan["service_test_classes"],
            plan["service_side"],
            workers,
        )
    if not (shards / "dataset.json").is_file():
        prepare("folder", str(jpegs), shards, workers=workers, progress=False)
    prep_seconds = time.perf_counter() - started
    print(f"  service data ready in {prep_seconds:.0f} s: {jpegs}", file=sys.stderr, flush=True)

    # The engine on the same images in memory (with the Adam step the service takes too).
    batch = plan["service_batch"]
    images, labels = _decode_for_engine(jpegs, batch, plan["service_side"], plan["engine_size"])
    if device.type == "cuda":
        images = images.pin_memory()
    channels_last = device.type == "cuda"
    model = _engine_model(plan["engine_model"], device, channels_last, device.type == "cuda", backend)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    autocast = resolve_precision("auto", device).autocast_dtype
    step = _engine_steps(model, images, labels, plan, device, autocast, channels_last, False, optimizer)
    result, note = _guarded(lambda step=step: _measure(step, device, rounds), device)
    engine_rate = batch / result[0] if result else None
    rows = [
        Row(
            "service",
            f"engine on the same {plan['service_side']} px JPEGs in memory (+ Adam step)",
            batch,
            result and result[0],
            engine_rate,
            result and result[1],
            1.0 if engine_rate else None,
            "engine in memory (img/s)",
            note,
        )
    ]
    if not lean:
        _profile_steps(step, device, workdir / "profile-engine")
    modes = {decode.partition(":")[0] for decode in decodes}
    if not lean and modes & {"cpu", "auto"}:
        rows.append(_engine_beside_cpu_decoders(step, jpegs, plan, device, rounds, engine_rate))
    if not lean and modes & {"gpu", "auto"}:
        rows.append(
            _engine_beside_the_decoder(
                step, jpegs, plan, device, rounds, engine_rate, profile=workdir / "profile-engine-decoder"
            )
        )
    del model, optimizer, images, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for row in rows:  # now, in case a later run outlives the caller's time limit
        rate = _fmt(row.images_per_second, ",.0f")
        print(f"  {row.case}: {rate} img/s, {_fmt(row.ratio, '.2f')}x", file=sys.stderr, flush=True)
    for decode in decodes:
        rows.append(_service_run(plan, shards, workdir, device, decode, batch, engine_rate, profile=not lean))
        row = rows[-1]  # now, in case a later run outlives the caller's time limit
        rate = _fmt(row.images_per_second, ",.0f")
        print(f"  {row.case}: {rate} img/s; {row.note}", file=sys.stderr, flush=True)
    return rows


def _profile_steps(step, device: torch.device, out: Path) -> None:
    """One `step` recorded with torch.profiler after an unrecorded warm-up (the service's StepProfiler):
    table and trace in `out`, to set beside the service's profiled step; the table's top to stderr."""
    from dmltrain.service.profiling import StepProfiler

    profiler = StepProfiler(2, 1, device, out_dir=out, row_limit=40)
    try:
        for n in (1, 2):
            profiler.before_step(n)
            step()
            files = profiler.after_step(n)
    except Exception as exc:  # the figures stand without it
        print(f"  no profile in {out.name}: {exc}", file=sys.stderr, flush=True)
        return
    for table in files[:1]:
        top = "\n".join(table.read_text().splitlines()[:24])
        print(f"  {out.name}:\n{top}", file=sys.stderr, flush=True)


def _pil_decode_forever(paths: list[str], size: int, stop) -> None:
    """What one data.decode=cpu loader worker keeps a core busy with: the loader's own PIL decode and
    training augmentation (`decode`, `train_transform`), one torch thread as a DataLoader worker has."""
    from dmltrain.data.transforms import decode, train_transform

    torch.set_num_threads(1)
    augment = train_transform(size)
    while not stop.is_set():
        for path in paths:
            if stop.is_set():
                return
            augment(decode(Path(path).read_bytes()))


def _engine_beside_cpu_decoders(
    step, jpegs: Path, plan: dict, device: torch.device, rounds: int, engine_rate: float | None
) -> Row:
    """The in-memory engine again while data.loader_workers processes decode JPEGs with PIL flat out: what
    a data.decode=cpu loader's CPU load alone costs the training thread (an upper bound: real loader
    workers rest once they are a few batches ahead)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    files = sorted(str(p) for p in (jpegs / "train").rglob("*.jpg"))
    workers = plan["loader_workers"]
    procs = [
        context.Process(
            target=_pil_decode_forever, args=(files[i::workers], plan["engine_size"], stop), daemon=True
        )
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    try:
        time.sleep(3)  # the processes import and start decoding
        result, note = _guarded(lambda: _measure(step, device, rounds), device)
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    case = f"the same, beside {workers} processes decoding JPEGs with PIL flat out"
    case += " (data.decode=cpu's CPU load)"
    return _beside_engine_row(case, plan["service_batch"], result, note, engine_rate)


def _beside_engine_row(
    case: str, batch: int, result: tuple[float, float | None] | None, note: str, engine_rate: float | None
) -> Row:
    """A row of the in-memory engine run beside something else, against the engine alone."""
    rate = batch / result[0] if result else None
    return Row(
        "service",
        case,
        batch,
        result and result[0],
        rate,
        result and result[1],
        rate / engine_rate if rate and engine_rate else None,
        "engine in memory (img/s)",
        note,
    )


def _engine_beside_the_decoder(
    step,
    jpegs: Path,
    plan: dict,
    device: torch.device,
    rounds: int,
    engine_rate: float | None,
    profile: Path | None = None,
) -> Row:
    """The in-memory engine again, each step taking one batch from a thread that decodes the same JPEGs
    with `DeviceDecoder` one batch ahead (as the service's loader does with data.decode=gpu). The gap to
    the engine alone is what the device decode path costs the step by itself (device time and the GIL,
    plus any wait for a batch), apart from everything else the service does."""
    import queue
    import threading

    from dmltrain.data.device_decode import DeviceDecoder, encode_part
    from dmltrain.data.shards import Sample
    from dmltrain.data.transforms import train_transform

    batch = plan["service_batch"]
    paths = [
        p
        for folder in sorted((jpegs / "train").iterdir())[: batch // 4]
        for p in sorted(folder.glob("*.jpg"))[:4]
    ]
    samples = [
        Sample(f"img{i}", p.read_bytes(), i // 4, 0, shard=0, url="memory") for i, p in enumerate(paths)
    ]
    augment = train_transform(plan["engine_size"])
    torch.manual_seed(0)
    part, keys = encode_part(samples, augment), [s.key for s in samples]
    decoder = DeviceDecoder(augment, device, ["memory"])
    ready: queue.Queue[torch.Tensor] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def decode_ahead() -> None:
        while not stop.is_set():
            decoded = decoder(part, keys)
            while not stop.is_set():
                try:
                    ready.put(decoded, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def paced_step() -> None:
        ready.get()
        step()

    thread = threading.Thread(target=decode_ahead, name="decode-ahead", daemon=True)
    thread.start()
    try:
        result, note = _guarded(lambda: _measure(paced_step, device, rounds), device)
        if profile is not None:
            _profile_steps(paced_step, device, profile)
    finally:
        stop.set()
        thread.join()
    case = f"the same, one batch a step from a thread decoding the JPEGs on {device.type} (DeviceDecoder)"
    return _beside_engine_row(case, batch, result, note, engine_rate)


def _service_run(
    plan: dict,
    shards: Path,
    workdir: Path,
    device: torch.device,
    decode: str,
    batch: int,
    engine_rate: float | None,
    profile: bool = True,
) -> Row:
    """One `python -m dmltrain.run` with data.decode=`decode`; its row (or the failure's last lines). With
    `profile` the run also records one step after the measured ones with torch.profiler: its operator table
    goes to stderr, and table and trace to `workdir`/profile-decode-`decode`/."""
    config = _service_config(plan, shards, workdir, device.type == "cuda", decode, profile=profile)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dmltrain.run", str(config)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    name = decode.replace(":", "-share-")  # a file name the device tool brings back
    log = workdir / f"service-decode-{name}.log"  # for a failure or a slow window: the run's own words
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    found = re.search(r"MLflow run (\w+) in (\S+?);", proc.stdout)
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return Row(
            "service", f"dmltrain.run, data.decode={decode}", batch, note="failed: " + " | ".join(tail)[-600:]
        )
    metrics = _service_metrics(found.group(2), found.group(1), plan["service_steps"])
    if profile:
        _fetch_profile(found.group(2), found.group(1), workdir / f"profile-decode-{name}")
    rate = metrics.get("train/images_per_second")
    peak = metrics.get("train/gpu_peak_memory_gb")
    tags = metrics["tags"]
    return Row(
        "service",
        f"dmltrain.run, 1 {'GPU' if device.type == 'cuda' else 'CPU'} worker, "
        f"{plan['loader_workers']} loader workers ({tags.get('dmltrain.precision')}, "
        f"channels_last {tags.get('dmltrain.channels_last')}, compile {tags.get('dmltrain.compile')}, "
        f"data.decode={decode}: {tags.get('dmltrain.data_decode')})",
        batch,
        batch / rate if rate else None,
        rate,
        peak * GB if peak is not None else None,
        rate / engine_rate if rate and engine_rate else None,
        "engine in memory (img/s)",
        f"data wait {metrics.get('train/data_wait_share', float('nan')):.1%}, last of "
        f"{metrics['windows']} windows of {plan['service_log_every']} steps; run {wall:.0f} s; "
        "s per step in that window: "
        + ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in metrics["phases"].items()),
        metrics.get("train/data_wait_share"),
    )


def _fetch_profile(uri: str, run_id: str, into: Path) -> None:
    """The run's profile/ artifacts into `into`; the operator table's top rows to stderr."""
    from mlflow.tracking import MlflowClient

    try:
        local = Path(MlflowClient(uri).download_artifacts(run_id, "profile", str(into)))
    except Exception as exc:  # the figures stand without it
        print(f"  no profile fetched: {exc}", file=sys.stderr, flush=True)
        return
    for table in sorted(local.glob("ops_*.txt")):
        print("\n".join(table.read_text().splitlines()[:30]), file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# report


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list[Row]) -> None:
    print("| part | case | B | s | img/s | ratio | ratio of | peak GB | note |")
    print("|---|---|---:|---:|---:|---:|---|---:|---|")
    for r in rows:
        peak = None if r.peak_bytes is None else r.peak_bytes / GB
        ratio = "" if r.ratio is None else (f"{r.ratio:.1f}x" if r.ratio >= 10 else f"{r.ratio:.2f}x")
        rate = _fmt(r.images_per_second, ",.0f")
        print(
            f"| {r.part} | {r.case} | {r.batch} | {_fmt(r.seconds, '.3f')} | {rate} "
            f"| {ratio} | {r.ratio_of if ratio else ''} | {_fmt(peak, '.1f')} | {r.note} |"
        )


def print_goals(rows: list[Row], plan: dict) -> None:
    """The issue's goals (issue 14, measured on one H100 80GB), each met / NOT met / not measured."""

    def find(part: str, case: str, batch: int) -> Row | None:
        return next((r for r in rows if r.part == part and r.case == case and r.batch == batch), None)

    def verdict(ok: bool | None) -> str:
        return "not measured in this run" if ok is None else "met" if ok else "NOT met"

    print("\nGoals (issue 14):")
    runs = [
        r for r in rows if r.part == "service" and r.case.startswith("dmltrain.run") and r.images_per_second
    ]
    service = max(runs, key=lambda r: r.images_per_second or 0.0, default=None)
    if service is not None:
        print(f"(service goals judged on the fastest run: {service.case})")
    rate = service.images_per_second if service else None
    print(
        f"- service >= 3,800 img/s at B=4,096: {verdict(None if rate is None else rate >= 3800)}"
        + (f" ({rate:,.0f})" if rate else "")
    )
    ratio = service.ratio if service else None
    print(
        f"- service >= 0.9x the engine on the same images: {verdict(None if ratio is None else ratio >= 0.9)}"
        + (f" ({ratio:.2f}x)" if ratio else "")
    )
    wait = service.data_wait if service else None
    print(
        f"- data wait share <= 5%: {verdict(None if wait is None else wait <= 0.05)}"
        + (f" ({wait:.1%})" if wait is not None else "")
    )
    peak = service.peak_bytes if service else None
    print(
        f"- service peak GPU memory <= 15 GB: {verdict(None if peak is None else peak <= 15 * GB)}"
        + (f" ({peak / GB:.1f} GB)" if peak is not None else "")
    )
    at = plan["compare_at"]
    for name in LOSS_NAMES:
        ours = find("losses", f"{TITLES[name]}: dmltrain", at)
        pml = find("losses", f"{TITLES[name]}: PML 2.9.0", at)
        ok_floor = None if not (ours and ours.ratio) else ours.ratio <= 3
        ok_pml = None if not (ours and ours.seconds and pml and pml.seconds) else ours.seconds < pml.seconds
        if pml and "memory" in pml.note:
            ok_pml = True if ours and ours.seconds else None  # PML could not run at all
        print(
            f"- {TITLES[name]} B={at}: <= 3x floor {verdict(ok_floor)}"
            + (f" ({ours.ratio:.2f}x)" if ours and ours.ratio else "")
            + f"; faster than PML {verdict(ok_pml)}"
            + (f" ({pml.note or f'{pml.ratio:.1f}x'})" if pml and (pml.note or pml.ratio) else "")
        )
    big = max(plan["loss_sizes"])
    for name in LOSS_NAMES:
        ours = find("losses", f"{TITLES[name]}: dmltrain", big)
        secs = ours.seconds if ours else None
        print(
            f"- {TITLES[name]} B={big} <= 1 s: {verdict(None if secs is None else secs <= 1.0)}"
            + (f" ({secs:.2f} s)" if secs else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", default=["losses", "engine", "service"], choices=["losses", "engine", "service"]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes; runs on CPU too (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed repetitions (best is reported)")
    parser.add_argument("--no-pml", action="store_true", help="skip pytorch-metric-learning")
    parser.add_argument("--workdir", type=Path, default=None, help="where the service part's data goes")
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor; --quick on CPU uses aot_eager)",
    )
    parser.add_argument("--loss-sizes", type=int, nargs="+", help="override the loss batch sizes")
    parser.add_argument("--stream-sizes", type=int, nargs="+", help="loss sizes with a forced-streaming row")
    parser.add_argument("--loss-dim", type=int, help="embedding dimension of the loss cases")
    parser.add_argument("--engine-sizes", type=int, nargs="+", help="override the engine batch sizes")
    parser.add_argument("--loader-workers", type=int, help="data.loader_workers of the service runs")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--service-decode",
        nargs="+",
        default=None,
        type=_decode_setting,
        help="data.decode of the service runs, one run each, as auto, cpu, gpu or gpu:SHARE (with "
        "data.host_decode_share=SHARE); default: cpu then gpu on CUDA, cpu elsewhere",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="service part without profiles and without the engine-beside-decoders rows (about 100 s less a "
        "decode on an H100: both decodes fit one 10-minute call)",
    )
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print(
            "bench/gpu.py measures a CUDA device and none is visible here. Run it on a GPU machine, or use "
            "--quick for a CPU smoke run of the same code paths (tiny sizes; its figures mean nothing).",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    plan = dict(QUICK if args.quick else FULL)
    if args.loss_sizes:
        plan["loss_sizes"] = args.loss_sizes
    if args.stream_sizes:
        plan["stream_sizes"] = args.stream_sizes
    if args.loss_dim:
        plan["loss_dim"] = args.loss_dim
    if args.engine_sizes:
        plan["engine_sizes"] = args.engine_sizes
    if args.loader_workers:
        plan["loader_workers"] = args.loader_workers
    rounds = args.rounds or (1 if args.quick else plan["steps"])
    backend = args.compile_backend or (None if cuda else "aot_eager")
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({os.cpu_count()} cores)"
    print(
        f"# bench/gpu.py on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        f"{' (quick)' if args.quick else ''}; parts: {' '.join(args.parts)}; best of {rounds} after a warm-up"
    )
    if not cuda:  # as many threads as the service's CPU worker gets, so the two are comparable
        torch.set_num_threads(_worker_cpus())
    rows: list[Row] = []
    if "losses" in args.parts:
        rows += bench_losses(plan, device, rounds, use_pml=not args.no_pml)
        print("  losses done", file=sys.stderr, flush=True)
    if "engine" in args.parts:
        rows += bench_engine(plan, device, rounds, backend)
        print("  engine done", file=sys.stderr, flush=True)
    if "service" in args.parts:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
        work.mkdir(parents=True, exist_ok=True)
        decodes = args.service_decode or (["cpu", "gpu"] if cuda else ["cpu"])
        rows += bench_service(plan, device, rounds, work, backend, tuple(decodes), lean=args.lean)
    print()
    print_table(rows)
    if args.quick:
        print("\nGoals (issue 14) are judged on the full run on one H100 80GB, not in --quick.")
    else:
        print_goals(rows, plan)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
