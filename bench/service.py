"""Benchmark: the training service against a bare PyTorch loop on the same cores and the same decoded data.

    python bench/service.py            # quickstart scale: runs of train.steps (600), 5 rounds of steps
    python bench/service.py --quick    # 3 rounds, 30-step service runs with a small evaluation (smoke)

The model, loss, optimizer, image size and global batch come from the config (default
configs/quickstart.yaml: resnet18 from scratch, 32 px glyphs, Smooth-AP, Adam, global batch 128).

Part 1, steps side by side. Two groups of long-lived processes share the cores: "1x2" (one process, 2 torch
threads, as Ray runs the quickstart) and "2x1" (two gloo processes, 1 thread each). Every variant below is
built once in its group and fed the same decoded batches (real glyph shards through the real TrainLoader,
decoded once up front); the groups take turns, variant by variant, in rounds (the order rotates every
round), so load changes hit all variants alike. A block is S steps between two barriers; a variant's figure
is the median over rounds of its seconds per step. Every process gets the OpenMP wait policy and the malloc
settings that Ray gives the service's workers (scaling.omp_wait_policy, scaling.keep_freed_memory: auto = on
for CPU workers) and runs at the benchmark's niceness, as the service's workers do (scaling.worker_niceness:
auto = 0 on one CPU node adds nothing to it); "+ data" loaders run under the config's loader priority
(data.loader_priority: auto = SCHED_IDLE for CPU training).
  bare loop           model(normalize(x)) -> loss -> backward -> Adam(fused=True) on the global batch, with
                      2 threads and with 1: the faster is the baseline (on a loaded machine a 2-thread
                      step waits for its slower thread); also with torch's default Adam, for reference.
                      Its network computes as the service's does: with train.small_conv_matmul
                      resolved the same way (auto: on CPU), so the ratio measures the service's overhead;
                      "PyTorch's own small convs" is the same loop without that rewrite, what a plain
                      loop gets (the service's ratio to it includes the rewrite's gain)
  bare, no sync       each of 2 processes the same on its half batch, no communication: the layout alone
  bare DDP            the same under DistributedDataParallel (local loss, gradient all-reduce over gloo)
  service step        the real WorkerLoop._train_step (engine: exact global-batch loss and gradient, DDP as
                      Ray wraps it, update, schedule) on replayed batches; "+ data" with its live TrainLoader
                      (after the pass that fills its shard cache, data.cache_mb), and (1x2) once more with
                      the loader at normal priority
Part 2, the real service: `python -m dmltrain.run CONFIG` with the same settings (Ray workers, MLflow in a
sqlite store under the work dir, evaluation and checkpoints on the config's cadence), per layout. Read
back from MLflow: train/images_per_second (steady state: every log window after the first), the loop's
time/<phase>_seconds (step, data, engine, comm, update, log, checkpoint, eval, loop); the driver's wall time.
The bare loop is timed again right before and right after every service run, the way the service's steady
state is: total step time over a run of 150 steps (slow moments included, as they are in the service's
figure); the ratio uses the mean of the two. Until 2026-11-23 the brackets were the best of four 5-step
blocks, the machine's fastest moment against the service's average; that ratio is printed beside it.
Interleaved (since 2026-11-27; the goal's figure in a full run, --quick uses the brackets): on a machine
whose speed drifts by 10-30% within minutes, brackets a few minutes apart can disagree by more than the gap
being measured. So during the service run, every 12 s the whole service (the driver and every process
below it: Ray's daemons, the Train actors, the workers and their loader processes) is frozen with SIGSTOP
while the bare loop runs one untimed step and a block of 8 steps, then let go (SIGCONT; 2-3 s frozen, well
inside Ray's health-check timeouts). The service's rate is that of its log windows that no freeze touched
(with 0.5 s of margin; steady state: not the first window), the bare loop's that of the blocks run between
the service's first and last log: both sample the same minutes. Frozen time is taken out of the wall and
loop times.

Part 3, Ray's own share: the baseline bare loop run as a Ray Train worker (TorchTrainer, 1 worker x 2
CPUs, a local Ray cluster with its daemons and Train actors, at the priority the service gives them:
scaling.ray_priority, auto = SCHED_IDLE on one CPU node), against the same loop in a plain process
timed right before and after; and (a full run) interleaved as in part 2: the loop in Ray for as many steps
as the service ran, in its own process tree, timed in 8-step blocks, frozen every 12 s for a plain block.

The breakdown then explains the service's time per step against the bare loop: process layout and gradient
all-reduce from Part 1, engine collectives, data and the remaining per-step overhead from the service's own
timers, and the time outside steps (evaluation, checkpoints, MLflow calls). Goal (issue 11 section 4): the
service's steady-state images/s >= 0.85x the bare loop's at the quickstart's scale.
On a shared machine absolute figures move with the load: read the ratios, and the load averages printed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# bracket: steps of the bare loop run right before and right after each service run (part 2)
# interleave: seconds of service run between two frozen bare blocks (part 2), and the block's steps
# (a 30-step quick run has too few log windows to leave some untouched: it is compared with its brackets)
QUICK = {"rounds": 3, "steps": 3, "service_steps": 30, "batches": 4, "bracket": 10, "interleave": None}
FULL = {  # service_steps None: train.steps
    "rounds": 5,
    "steps": 5,
    "service_steps": None,
    "batches": 8,
    "bracket": 150,
    "interleave": (12, 8),
}

LAYOUTS = {  # Ray workers x torch threads on the 2 cores, and the overrides that select it
    "2x1": {"workers": 2, "threads": 1},
    "1x2": {"workers": 1, "threads": 2},
}
GROUP_VARIANTS = {
    "1x2": [
        "bare",
        "bare_1thread",
        "bare_default_adam",
        "bare_onednn",
        "service",
        "service_data",
        "service_data_normal",
    ],
    "2x1": ["bare_nosync", "bare_ddp", "service", "service_data"],
}
LABELS = {
    "bare": "bare loop, Adam(fused=True)",
    "bare_1thread": "bare loop, Adam(fused=True), 1 thread",
    "bare_default_adam": "bare loop, torch's default Adam",
    "bare_onednn": "bare loop, PyTorch's own small convs",
    "bare_nosync": "bare loop per half batch, no sync",
    "bare_ddp": "bare DDP loop (local loss)",
    "service": "service step, replayed batches",
    "service_data": "service step + live data",
    "service_data_normal": "service step + live data, normal loader",
}
VARIANT_THREADS = {"bare_1thread": 1}  # torch threads for a block of this variant (else the group's)
BASELINES = ("bare", "bare_1thread")  # the baseline is the faster single-process bare loop


def layout_overrides(layout: str, global_batch: int) -> list[str]:
    """Config overrides for a layout; one chunk per worker, so no chunk is embedded twice."""
    workers, threads = LAYOUTS[layout]["workers"], LAYOUTS[layout]["threads"]
    return [
        f"scaling.num_workers={workers}",
        f"scaling.torch_threads={threads}",
        f"scaling.cpus_per_worker={threads}",
        f"train.chunk_size={global_batch // workers}",
    ]


# ----------------------------------------------------------------------------------------------------
# Part 1: variants inside the process groups


@dataclass
class _Context:
    """Stands in for Ray Train's worker context: DDP around the model when there are 2 ranks, as
    ray.train.torch.prepare_model does on CPU."""

    rank: int
    world_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def local_world_size(self) -> int:  # every rank on this machine
        return self.world_size

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world_size > 1:
            return torch.nn.parallel.DistributedDataParallel(model)
        return model

    def get_checkpoint(self) -> None:
        return None

    def report(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the benchmark never checkpoints in part 1")


class _Replay:
    """A TrainLoader stand-in that hands out the pre-decoded batches in turn."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.i = batches, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = self.batches[self.i % len(self.batches)]
        self.i += 1
        return images, labels, torch.zeros_like(labels)

    def state_dict(self) -> dict[str, Any]:
        return {}


def _bare_optimizer(name: str, params: Any, lr: float, fused: bool) -> torch.optim.Optimizer:
    kind = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    extra = {"momentum": 0.9} if name == "sgd" else {}
    return kind(params, lr=lr, fused=fused or None, **extra)


def _bare_step(
    config: Any, batches: list, ddp: bool, fused: bool, service_convs: bool = True
) -> Callable[[int], dict[str, float]]:
    """What a user writes without dmltrain: forward, loss, backward, optimizer step. ``service_convs``: the
    network's convolutions compute as in the service (train.small_conv_matmul), else PyTorch's own."""
    from dmltrain.acceleration import resolve_small_conv_matmul
    from dmltrain.models import freeze_batchnorm
    from dmltrain.service.builders import build_loss, build_network, resolve_preprocessing
    from dmltrain.small_convs import use_matmul_for_small_convs

    torch.manual_seed(config.train.seed)
    preprocessing = resolve_preprocessing(config)  # as the worker loop builds it
    net = build_network(config, preprocessing)
    cpu = torch.device("cpu")
    if service_convs and resolve_small_conv_matmul(config.train.small_conv_matmul, cpu):
        use_matmul_for_small_convs(net)
    normalize = preprocessing.normalizer()
    net.train()
    if config.model.freeze_bn:
        freeze_batchnorm(net)
    model = torch.nn.parallel.DistributedDataParallel(net) if ddp else net
    optimizer = _bare_optimizer(config.optim.name, net.parameters(), config.optim.lr, fused)
    loss_fn = build_loss(config.loss)

    def step(i: int) -> dict[str, float]:
        images, labels = batches[i % len(batches)]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(normalize(images)), labels).backward()
        t1 = time.perf_counter()
        optimizer.step()
        return {"engine": t1 - t0, "update": time.perf_counter() - t1}

    return step


def _service_step(
    config: Any, batches: list, live: bool, rank: int, world: int, run_id: str, uri: str
) -> Callable[[int], dict[str, float]]:
    """The real worker loop's step; the stream is replayed (or the loop's own live TrainLoader)."""
    from dmltrain.service.train import WorkerLoop

    loop = WorkerLoop(config, run_id, uri, _Context(rank, world))
    if loop.logger is not None:  # part 1 times steps; MLflow is timed in part 2
        getattr(loop.logger, "close", lambda: None)()
        loop.logger = None
    if not live:
        loop.stream = _Replay(batches)
    elif config.data.cache_mb:
        # The pass that fills the loader's shard cache, as the service's first pass does: the blocks then
        # time the steady state of the rest of a run (part 2's runs include their first pass).
        for _ in range(loop.stream.steps_per_epoch):
            loop.stream.next_batch()

    def step(i: int) -> dict[str, float]:
        s = loop._train_step()
        return {
            "data": s.data_seconds,
            "engine": getattr(s, "engine_seconds", float("nan")),
            "comm": s.comm_seconds,
            "update": getattr(s, "update_seconds", float("nan")),
        }

    return step


def _group_worker(rank: int, world: int, port: int, conn: Connection, spec: dict[str, Any]) -> None:
    """One process of a group: build every variant, then time blocks on command until told to stop."""
    import torch.distributed as dist

    from dmltrain.service.config import load_config

    threads = spec["threads"]
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = load_config(spec["config"], spec["overrides"])
        local = [(x.chunk(world)[rank].clone(), y.chunk(world)[rank].clone()) for x, y in spec["batches"]]
        builders = {
            "bare": lambda: _bare_step(config, local, ddp=False, fused=True),
            "bare_1thread": lambda: _bare_step(config, local, ddp=False, fused=True),
            "bare_default_adam": lambda: _bare_step(config, local, ddp=False, fused=False),
            "bare_onednn": lambda: _bare_step(config, local, ddp=False, fused=True, service_convs=False),
            "bare_nosync": lambda: _bare_step(config, local, ddp=False, fused=True),
            "bare_ddp": lambda: _bare_step(config, local, ddp=True, fused=True),
            "service": lambda: _service_step(config, local, False, rank, world, spec["run_id"], spec["uri"]),
            "service_data": lambda: _service_step(
                config, local, True, rank, world, spec["run_id"], spec["uri"]
            ),
            # what data.loader_priority=idle saves: the same, its loader competing like any process
            "service_data_normal": lambda: _service_step(
                load_config(spec["config"], [*spec["overrides"], "data.loader_priority=normal"]),
                local,
                True,
                rank,
                world,
                spec["run_id"],
                spec["uri"],
            ),
        }
        steps = {name: builders[name]() for name in spec["variants"]}
        torch.set_num_threads(threads)  # the worker loop sets it from the config too; same value
        conn.send(("ready", torch.get_num_threads()))
        counter = itertools.count()
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            _, name, n = command
            torch.set_num_threads(VARIANT_THREADS.get(name, threads))
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            parts: dict[str, float] = defaultdict(float)
            for _ in range(n):
                for key, value in steps[name](next(counter)).items():
                    parts[key] += value
            if world > 1:
                dist.barrier()
            seconds = (time.perf_counter() - t0) / n
            conn.send(("ok", {"seconds": seconds, **{k: v / n for k, v in parts.items()}}))
    except BaseException as exc:
        import traceback

        conn.send(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        raise
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _terminate(proc: Any) -> None:
    """At exit (also after an error): no group process outlives the benchmark."""
    if proc.is_alive():
        proc.terminate()


class _Group:
    """A layout's processes (1 x 2 threads, or 2 gloo processes x 1 thread) with their variants."""

    def __init__(self, layout: str, spec: dict[str, Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world = LAYOUTS[layout]["workers"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            # Not daemonic: the live-data variant's TrainLoader may start loader processes of its own.
            proc = ctx.Process(target=_group_worker, args=(rank, self.world, port, child, spec))
            proc.start()
            atexit.register(_terminate, proc)
            self.conns.append(parent)
            self.procs.append(proc)
        self.threads = [self._receive(c) for c in self.conns]

    @staticmethod
    def _receive(conn: Connection) -> Any:
        kind, payload = conn.recv()
        if kind == "error":
            raise RuntimeError(payload)
        return payload

    def run(self, variant: str, steps: int) -> dict[str, float]:
        """Seconds per step of the slowest rank; the step's parts as rank 0 timed them."""
        for conn in self.conns:
            conn.send(("run", variant, steps))
        results = [self._receive(c) for c in self.conns]
        return {**results[0], "seconds": max(r["seconds"] for r in results)}

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


# ----------------------------------------------------------------------------------------------------
# Part 2: the real service


def _bare_in_ray_train(spec: dict[str, Any]) -> None:
    """Ray Train worker function: the baseline bare loop, timed in blocks of ``spec["block"]`` steps."""
    from dmltrain.service.config import load_config

    torch.set_num_threads(spec["threads"])
    step = _bare_step(load_config(spec["config"], spec["overrides"]), spec["batches"], ddp=False, fused=True)
    for i in range(3):  # warm-up, as the group processes had
        step(i)
    blocks = []
    for _ in range(max(1, spec["steps"] // spec["block"])):
        start, t0 = time.time(), time.perf_counter()
        for i in range(spec["block"]):
            step(i)
        blocks.append((start, time.time(), (time.perf_counter() - t0) / spec["block"]))
    # Ray Train reports metrics back only with a checkpoint: the figures go through a file (same machine).
    Path(spec["out"]).write_text(json.dumps(blocks))


def bare_in_ray_worker(
    spec: dict[str, Any], workdir: Path, env: dict[str, str]
) -> list[tuple[float, float, float]]:
    """Blocks (from, to, seconds per step) of the bare loop as a Ray Train worker (TorchTrainer, 1 worker x
    2 CPUs) on a local Ray cluster started the way the service starts one: what Ray's processes alone cost
    the step."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = workdir / f"bare-in-ray-{os.getpid()}.json"
    out.unlink(missing_ok=True)
    spec = {**spec, "out": str(out)}
    from dmltrain.service.config import load_config
    from dmltrain.service.ray_priority import keep_ray_in_background
    from dmltrain.service.run import resolve_ray_priority

    ray.init(log_to_driver=False)
    # Ray's bookkeeping processes at the priority the service gives them (scaling.ray_priority).
    idle = resolve_ray_priority(load_config(spec["config"], spec["overrides"]), False, False) == "idle"
    background = keep_ray_in_background(ray.get_runtime_context().get_session_name()) if idle else None
    try:
        trainer = TorchTrainer(
            _bare_in_ray_train,
            train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": spec["threads"]}),
            run_config=RunConfig(
                storage_path=str(workdir / "ray_results"),
                name=f"bare-{int(time.time())}",
                worker_runtime_env={"env_vars": env},  # as the service gives it (dmltrain.service.run)
            ),
        )
        with background or contextlib.nullcontext():
            trainer.fit()
        return [tuple(b) for b in json.loads(out.read_text())]
    finally:
        ray.shutdown()
        time.sleep(5)  # Ray's processes take a moment to exit; the bracket after must not time them


def bare_in_ray_interleaved(
    spec: dict[str, Any], workdir: Path, env: dict[str, str], interleave: Interleave
) -> dict[str, float]:
    """`bare_in_ray_worker` in a process of its own (the driver too is frozen with the rest), with plain
    bare-loop blocks interleaved: Ray's blocks that no freeze touched against the plain blocks run between
    its first and last block."""
    from dmltrain.service.config import KEEP_FREED_MEMORY_ENV

    spec_path = workdir / f"bare-in-ray-spec-{os.getpid()}.pt"
    out = workdir / f"bare-in-ray-blocks-{os.getpid()}.json"
    torch.save({"spec": spec, "workdir": str(workdir), "env": env, "out": str(out)}, spec_path)
    command = [sys.executable, str(Path(__file__).resolve()), "--ray-part3", str(spec_path)]
    child_env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED_MEMORY_ENV}
    log_path = workdir / f"bare-in-ray-{os.getpid()}.log"
    returncode = _run_logged(command, log_path, child_env, interleave)
    if returncode != 0:
        raise RuntimeError(f"part 3 in Ray failed ({returncode}):\n{log_path.read_text()[-4000:]}")
    blocks = [tuple(b) for b in json.loads(out.read_text())]
    (workdir / f"bare-in-ray-plain-blocks-{os.getpid()}.json").write_text(json.dumps(interleave.blocks))
    kept, plain = _split_by_freezes(blocks, interleave.blocks)
    return {
        "ray_s": statistics.mean(kept) if kept else float("nan"),
        "plain_s": statistics.mean(plain) if plain else float("nan"),
        "kept": len(kept),
        "of": len(blocks),
        "plain_blocks": len(plain),
    }


def _ray_part3_main(spec_path: str) -> None:
    """``--ray-part3 SPEC``: `bare_in_ray_worker` for `bare_in_ray_interleaved`, in this process."""
    saved = torch.load(spec_path, weights_only=False)
    blocks = bare_in_ray_worker(saved["spec"], Path(saved["workdir"]), saved["env"])
    Path(saved["out"]).write_text(json.dumps(blocks))


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Ray's daemons, workers and loader processes of a service run)."""
    from dmltrain.service.processes import children_by_parent, subtree

    return subtree(pid, children_by_parent())


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Interleave:
    """Bare-loop blocks run while the service is frozen (SIGSTOP to its whole process tree), every
    ``every`` seconds of its run: the two then sample the same minutes of a machine whose speed drifts."""

    block: Callable[[], float]  # runs one block of the bare loop, returns its seconds per step
    every: float
    blocks: list[tuple[float, float, float]] = field(default_factory=list)  # (frozen from, to, s/step)

    def run_beside(self, proc: subprocess.Popen) -> None:
        next_at = time.time() + self.every
        while proc.poll() is None:
            time.sleep(0.2)
            if time.time() < next_at:
                continue
            pids = _descendants(proc.pid)
            _signal_all(pids, signal.SIGSTOP)
            start = time.time()
            try:
                seconds = self.block()
            finally:
                end = time.time()
                _signal_all(_descendants(proc.pid) + pids, signal.SIGCONT)
            self.blocks.append((start, end, seconds))
            next_at = time.time() + self.every


def run_service(
    config_path: Path,
    overrides: list[str],
    workdir: Path,
    name: str,
    uri: str,
    interleave: Interleave | None = None,
) -> dict[str, Any]:
    """`python -m dmltrain.run` in a fresh process; its figures as MLflow recorded them. With
    ``interleave``, also the interleaved comparison: the service's log windows that no freeze touched
    against the bare blocks run within its training span."""
    from mlflow.tracking import MlflowClient

    from dmltrain.service.config import KEEP_FREED_MEMORY_ENV

    env = {
        # the workers get the malloc settings from the service (scaling.keep_freed_memory), Ray's daemons not
        **{key: value for key, value in os.environ.items() if key not in KEEP_FREED_MEMORY_ENV},
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback only, single node
        "RAY_USAGE_STATS_ENABLED": "0",
        "TQDM_DISABLE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "dmltrain.run",
        str(config_path),
        *overrides,
        f"run.name={name}",
        f"run.storage_path={workdir / 'ray_results'}",
        f"mlflow.tracking_uri={uri}",
        "run.resume=never",
        "scaling.topology=single-node",
    ]
    log_path = workdir / f"{name}.log"
    t0 = time.perf_counter()
    returncode = _run_logged(command, log_path, env, interleave, cwd=workdir)
    wall = time.perf_counter() - t0
    output = log_path.read_text()
    found = re.search(r"MLflow run (\w+)", output)
    if returncode != 0 or not found:
        raise RuntimeError(f"service run {name} failed ({returncode}):\n{output[-4000:]}")
    client = MlflowClient(uri)
    run_id = found.group(1)
    metrics = client.get_run(run_id).data.metrics
    windows = sorted(client.get_metric_history(run_id, "train/images_per_second"), key=lambda m: m.step)
    steady = [m.value for m in windows[1:]] or [m.value for m in windows]
    shares = {
        key: statistics.mean(m.value for m in client.get_metric_history(run_id, key)[1:] or [metrics[key]])
        for key in ("train/data_wait_share", "train/comm_share")
        if key in metrics
    }
    times = {
        k.removeprefix("time/").removesuffix("_seconds"): v for k, v in metrics.items() if k[:5] == "time/"
    }
    result = {
        "wall": wall,
        # every window holds log_every steps of the same batch: the overall rate is the harmonic mean
        "steady_ips": len(steady) / sum(1.0 / v for v in steady),
        "shares": shares,
        "times": times,
        "recall": metrics.get("eval/test/recall_at_1", float("nan")),
    }
    if interleave is not None:
        # kept beside the MLflow store, for reading a run window by window afterwards
        (workdir / f"{name}-bare-blocks.json").write_text(json.dumps(interleave.blocks))
        result["interleaved"] = _interleaved(windows, interleave.blocks)
        # The windows a freeze touched count the frozen seconds as step time, and the wall and loop times
        # hold them too: the steady rate is the untouched windows', and the frozen time comes out.
        result["steady_ips"] = result["interleaved"]["service_ips"]
        result["wall"] -= sum(end - start for start, end, _ in interleave.blocks)
        if windows and "loop" in times:
            first, last = windows[0].timestamp / 1000, windows[-1].timestamp / 1000
            times["loop"] -= sum(end - start for start, end, _ in interleave.blocks if first <= start <= last)
    return result


def _run_logged(
    command: list[str],
    log_path: Path,
    env: dict[str, str],
    interleave: Interleave | None,
    cwd: Path | None = None,
) -> int:
    """Run ``command`` with its output in ``log_path`` (and ``interleave`` beside it); its exit status.
    Whatever happens here, no process of it is left frozen or running."""
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            if interleave is not None:
                interleave.run_beside(proc)
            return proc.wait()
        finally:
            if proc.poll() is None:
                _signal_all(_descendants(proc.pid), signal.SIGCONT)
                proc.kill()


def _split_by_freezes(
    spans: list[tuple[float, float, float]], freezes: list[tuple[float, float, float]]
) -> tuple[list[float], list[float]]:
    """(values of the spans no freeze touched, values of the freezes' blocks that lie within the spans'
    first start and last end): the two sides of an interleaved comparison."""
    if not spans:
        return [], []
    kept = [value for start, end, value in spans if not _touched(start, end, freezes)]
    first, last = spans[0][0], spans[-1][1]
    inside = [value for start, end, value in freezes if first <= start and end <= last]
    return kept, inside


def _touched(
    start: float, end: float, freezes: list[tuple[float, float, float]], margin: float = 0.5
) -> bool:
    """Whether [start, end] (wall-clock seconds) overlaps a freeze, give or take ``margin``."""
    return any(start - margin < f_end and f_start < end + margin for f_start, f_end, _ in freezes)


def _interleaved(windows: list[Any], blocks: list[tuple[float, float, float]]) -> dict[str, float]:
    """Service windows (each from the previous window's log time to its own, steady state: not the first)
    that no freeze overlapped, with a margin, against the bare blocks run between its first and last log."""
    ends = [m.timestamp / 1000 for m in windows]
    spans = [(start, end, m.value) for m, start, end in zip(windows[1:], ends, ends[1:], strict=False)]
    kept, inside = _split_by_freezes(spans, blocks)
    service_ips = len(kept) / sum(1.0 / v for v in kept) if kept else float("nan")
    bare_s = statistics.mean(inside) if inside else float("nan")
    return {
        "service_ips": service_ips,
        "bare_s": bare_s,
        "windows": len(kept),
        "of_windows": max(0, len(windows) - 1),
        "blocks": len(inside),
    }


# ----------------------------------------------------------------------------------------------------
# driver


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min)"


def decode_batches(config: Any, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches in the 2-worker layout: rank 0's local batch then rank 1's, from the real loader."""
    from dmltrain.data import SamplerSpec, TrainLoader
    from dmltrain.service.builders import resolve_preprocessing

    world = 2
    local = config.train.global_batch_size // world
    loaders = [
        TrainLoader(
            config.data.root,
            local,
            SamplerSpec.from_config(config.sampler),
            split=config.data.train_split,
            rank=rank,
            world_size=world,
            num_workers=0,
            image_size=config.data.image_size,
            transform=resolve_preprocessing(config).train_transform(config.data.crop_scale),
        )
        for rank in range(world)
    ]
    batches = []
    for _ in range(count):
        parts = [loader.next_batch() for loader in loaders]
        batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return batches


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--ray-part3":  # part 3's own process (interleaved)
        _ray_part3_main(sys.argv[2])
        return
    args = _parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dmltrain-bench-service-")).resolve()
    _bench(args, workdir)
    if not args.workdir:  # kept after a failure, for the runs' logs
        shutil.rmtree(workdir, ignore_errors=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, short service runs (smoke)")
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--data", help="prepared glyph shards (default: built under the work dir)")
    parser.add_argument(
        "--workdir",
        help="where data, MLflow store, Ray results, run logs and the interleaved blocks (JSON) go, kept "
        "(default: a temporary folder, removed after a run that completes: 350-440 MB)",
    )
    parser.add_argument(
        "--service-layouts", default="2x1,1x2", help="layouts for part 2, comma-separated ('' = skip)"
    )
    parser.add_argument("--skip-steps", action="store_true", help="skip part 1 (except the bare loop)")
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for every run, e.g. data.loader_workers=1"
    )
    return parser.parse_args()


def _bench(args: argparse.Namespace, workdir: Path) -> None:
    plan = QUICK if args.quick else FULL
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    from dmltrain.data import ensure_glyphs
    from dmltrain.service.config import KEEP_FREED_MEMORY_ENV, flatten, load_config, to_yaml
    from dmltrain.service.run import OMP_WAIT_KEYS, worker_env_vars
    from dmltrain.service.tracking import start_or_resume_run

    workdir.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else Path(ensure_glyphs(workdir / "glyphs"))
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    base = [f"data.root={data}", "data.prepare=null", *args.overrides]
    config = load_config(args.config, base)
    batch = config.train.global_batch_size
    service_steps = plan["service_steps"] or config.train.steps
    started = time.strftime("%Y-%m-%d %H:%M")
    print(
        f"dmltrain service benchmark ({'quick' if args.quick else 'full'}), {started}, load average "
        f"{_load()} at start; torch {torch.__version__}, {os.cpu_count()} cores"
    )
    print(
        f"config {Path(args.config).name} {' '.join(args.overrides)}: {config.model.backbone} @ "
        f"{config.data.image_size} px, {config.loss.name}, {config.optim.name}, global batch {batch}, "
        f"loader_workers {config.data.loader_workers}, freeze_bn {config.model.freeze_bn}; work dir {workdir}"
    )
    worker_env = worker_env_vars(config)
    print(f"worker environment (bare loops and service alike): {worker_env or 'inherited'}")
    quickstart_layout = f"{config.scaling.num_workers}x{config.scaling.torch_threads or 1}"

    # ---------------------------------------------------------------- part 1
    batches = decode_batches(config, plan["batches"])
    groups: dict[str, _Group] = {}
    results: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)

    def med(layout: str, variant: str, key: str = "seconds") -> float:
        """A variant's part-1 figure: the median over rounds."""
        return _median([r.get(key, float("nan")) for r in results.get((layout, variant), [])])

    group_variants = {"1x2": list(BASELINES)} if args.skip_steps else GROUP_VARIANTS
    # The bare loops and the service steps run under the OpenMP and malloc settings Ray gives the service's
    # workers. Only those: RAY_worker_niceness in this environment would reach every Ray process of part 2
    # through the driver, where the service gives it to its training workers alone (and run_service takes
    # the malloc settings out of the driver's environment for the same reason).
    process_keys = OMP_WAIT_KEYS | KEEP_FREED_MEMORY_ENV.keys()
    os.environ.update({key: value for key, value in worker_env.items() if key in process_keys})
    jobs = [(layout, v) for layout, variants in group_variants.items() for v in variants]
    try:
        for layout, variants in group_variants.items():
            overrides = [*base, *layout_overrides(layout, batch)]
            layout_config = load_config(args.config, overrides)
            run_id, _ = start_or_resume_run(
                uri,
                "bench-steps",
                f"{workdir}/steps-{layout}",
                layout,
                flatten(layout_config),
                to_yaml(layout_config),
            )
            spec = {
                "config": args.config,
                "overrides": overrides,
                "batches": batches,
                "variants": variants,
                "threads": LAYOUTS[layout]["threads"],
                "run_id": run_id,
                "uri": uri,
            }
            groups[layout] = _Group(layout, spec)
        for job in jobs:  # warm-up block: first-touch allocations, lazy inits
            groups[job[0]].run(job[1], 1)
        for r in range(plan["rounds"]):
            for layout, variant in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
                results[(layout, variant)].append(groups[layout].run(variant, plan["steps"]))

        part1_baseline = min(BASELINES, key=lambda v: med("1x2", v))

        def bare_run() -> float:
            """The baseline timed as the service's steady state is: step time over a whole run of steps
            (the mean, slow moments included), not the best of a few short blocks."""
            return groups["1x2"].run(part1_baseline, plan["bracket"])["seconds"]

        def warm_block(steps: int) -> float:
            """An interleaved block: one untimed step first. The bare loop's process sat idle while the
            service ran (its caches cold, its pages perhaps reclaimed), as the service's windows right
            after a freeze are, and those are left out."""
            groups["1x2"].run(part1_baseline, 1)
            return groups["1x2"].run(part1_baseline, steps)["seconds"]

        def best_block() -> float:
            """The brackets' earlier statistic, kept for comparison: the best of four short blocks."""
            return min(groups["1x2"].run(part1_baseline, plan["steps"])["seconds"] for _ in range(4))

        # ------------------------------------------------------------ part 2
        service: dict[str, dict[str, Any]] = {}
        brackets: dict[str, tuple[float, float]] = {}
        ray_only: tuple[float, float, float] | None = None
        ray_interleaved: dict[str, float] | None = None
        best_blocks: dict[str, float] = {}
        layouts = [s for s in args.service_layouts.split(",") if s]
        for layout in layouts:
            overrides = [*base, *layout_overrides(layout, batch), f"train.steps={service_steps}"]
            if args.quick:
                overrides += [
                    f"train.eval_every={service_steps}",
                    "eval.max_images=2000",
                    "eval.grid_queries=2",
                ]
            best = best_block()
            before = bare_run()
            interleave = None
            if plan["interleave"]:
                every, block_steps = plan["interleave"]
                interleave = Interleave(functools.partial(warm_block, block_steps), every)
            service[layout] = run_service(
                Path(args.config),
                overrides,
                workdir,
                f"service-{layout}-{int(time.time())}",
                uri,
                interleave,
            )
            after = bare_run()
            brackets[layout] = (before, after)
            best_blocks[layout] = min(best, best_block())
        # ------------------------------------------------------------ part 3
        if layouts:
            ray_spec = {
                "config": args.config,
                "overrides": [*base, *layout_overrides("1x2", batch)],
                "batches": batches,
                "threads": LAYOUTS["1x2"]["threads"],
                "steps": plan["bracket"],
                "block": plan["bracket"],
            }
            plain_before = bare_run()
            in_ray = statistics.mean(b[2] for b in bare_in_ray_worker(ray_spec, workdir, worker_env))
            ray_only = (plain_before, in_ray, bare_run())
            if plan["interleave"]:
                every, block_steps = plan["interleave"]
                ray_interleaved = bare_in_ray_interleaved(
                    {**ray_spec, "steps": service_steps, "block": block_steps},
                    workdir,
                    worker_env,
                    Interleave(functools.partial(warm_block, block_steps), every),
                )
    finally:
        for g in groups.values():
            g.close()

    # ---------------------------------------------------------------- report
    baseline = part1_baseline
    bare_s = med("1x2", baseline)
    LABELS[baseline] += "  [baseline]"
    print(
        f"\nPart 1: seconds per step (median of {plan['rounds']} interleaved rounds of {plan['steps']} "
        f"steps; same {len(batches)} decoded batches)"
    )
    print(
        f"{'layout':<7}{'variant':<42}{'s/step':>8}{'img/s':>8}{'vs bare':>9}{'data':>7}{'engine':>8}"
        f"{'comm':>7}{'update':>8}"
    )
    for layout, variant in jobs:
        s = med(layout, variant)
        cells = "".join(
            f"{med(layout, variant, k):>{w}.3f}"
            if results[(layout, variant)][0].get(k) is not None
            else f"{'':>{w}}"
            for k, w in (("data", 7), ("engine", 8), ("comm", 7), ("update", 8))
        )
        print(f"{layout:<7}{LABELS[variant]:<42}{s:>8.3f}{batch / s:>8.0f}{bare_s / s:>8.2f}x{cells}")
    print(
        "engine = forward + loss + backward (+ the engine's collectives: comm); "
        "update = norm + optimizer step"
    )

    if service:
        print(f"\nPart 2: the service, {service_steps} steps (python -m dmltrain.run; figures from MLflow)")
        print(
            f"{'layout':<7}{'wall s':>8}{'loop s':>8}{'steady img/s':>13}{'vs bare':>9}"
            f"{'incl. eval+ckpt':>16}{'vs bare':>9}{'data':>7}{'comm':>7}{'eval s':>8}{'ckpt s':>8}"
            f"{'log s':>7}{'R@1':>7}"
        )
        for layout, r in service.items():
            bare_ips = 2 * batch / sum(brackets[layout])
            t = r["times"]
            loop_s = t.get("loop", float("nan"))
            incl = service_steps * batch / loop_s if loop_s == loop_s else float("nan")
            mark = " (config)" if layout == quickstart_layout else ""
            print(
                f"{layout + mark:<7}{r['wall']:>8.0f}{loop_s:>8.0f}{r['steady_ips']:>13.0f}"
                f"{r['steady_ips'] / bare_ips:>8.2f}x{incl:>16.0f}{incl / bare_ips:>8.2f}x"
                f"{r['shares'].get('train/data_wait_share', float('nan')):>7.1%}"
                f"{r['shares'].get('train/comm_share', float('nan')):>7.1%}"
                f"{t.get('eval', float('nan')):>8.1f}{t.get('checkpoint', float('nan')):>8.1f}"
                f"{t.get('log', float('nan')):>7.1f}{r['recall']:>7.3f}"
            )
        for layout, (before, after) in brackets.items():
            best_ips = batch / best_blocks[layout]
            print(
                f"  bare loop around the {layout} run: {batch / before:.0f} img/s before, "
                f"{batch / after:.0f} after ({plan['bracket']}-step runs); the best "
                f"{plan['steps']}-step block around it {best_ips:.0f} img/s, against which the service's "
                f"steady state is {service[layout]['steady_ips'] / best_ips:.2f}x"
            )
            i = service[layout].get("interleaved")
            if i is None:
                continue
            print(
                f"  interleaved in the {layout} run: {i['blocks']} bare blocks of {plan['interleave'][1]} "
                f"steps, each while the service was frozen (every {plan['interleave'][0]} s of its run), "
                f"{batch / i['bare_s']:.0f} img/s; the service {i['service_ips']:.0f} img/s over the "
                f"{i['windows']} of its {i['of_windows']} steady windows that no freeze touched: "
                f"**{goal_ratio(service[layout], brackets[layout], batch):.2f}x**"
            )
        if ray_only is not None:
            plain_before, in_ray, plain_after = ray_only
            plain = (plain_before + plain_after) / 2
            print(
                f"\nPart 3: the bare loop as a Ray Train worker (1 x 2 CPUs, a local Ray cluster started "
                f"as the service starts it), {plan['bracket']} steps: {batch / in_ray:.0f} img/s against "
                f"{batch / plain_before:.0f} / {batch / plain_after:.0f} in a plain process before / after: "
                f"{plain / in_ray:.2f}x, Ray's processes alone"
            )
        if ray_interleaved is not None:
            r3 = ray_interleaved
            print(
                f"  interleaved, {service_steps} steps in Ray in blocks of {plan['interleave'][1]}: "
                f"{batch / r3['ray_s']:.0f} img/s over the {r3['kept']} of its {r3['of']} blocks no freeze "
                f"touched, against {batch / r3['plain_s']:.0f} img/s in {r3['plain_blocks']} plain blocks "
                f"run while it was frozen: **{r3['plain_s'] / r3['ray_s']:.2f}x**"
            )
        how = "interleaved" if plan["interleave"] else "bracketed"
        print(f"\nBreakdown: the service's time per step against the bare loop's ({how})")
        for layout, r in service.items():
            bare = r["interleaved"]["bare_s"] if "interleaved" in r else sum(brackets[layout]) / 2
            _breakdown(layout, r, service_steps, batch, bare, med)

    print(f"\nload average at the end: {_load()}")
    if service:
        bracketed = {k: r["steady_ips"] * sum(brackets[k]) / (2 * batch) for k, r in service.items()}
        goal = {k: goal_ratio(r, brackets[k], batch) for k, r in service.items()}
        best = max(service, key=lambda k: goal[k])
        verdict = "met" if goal[best] >= 0.85 else "NOT met"
        print(
            f"goal (>= 0.85x the bare loop, steady state, {how}): {verdict} - best layout {best}: "
            f"{goal[best]:.2f}x (bracketed {bracketed[best]:.2f}x)"
            + (
                f"; the config's layout {quickstart_layout}: {goal[quickstart_layout]:.2f}x "
                f"(bracketed {bracketed[quickstart_layout]:.2f}x)"
                if quickstart_layout in service
                else ""
            )
        )
    print(json.dumps({"part1": {f"{k[0]}/{k[1]}": med(*k) for k in jobs}}, sort_keys=True))


def goal_ratio(result: dict[str, Any], bracket: tuple[float, float], batch: int) -> float:
    """The service's steady img/s over the bare loop's: both from the interleaved samples, or (a run
    without them) against the mean of the brackets."""
    i = result.get("interleaved")
    if i is None:
        return result["steady_ips"] * sum(bracket) / (2 * batch)
    return i["service_ips"] * i["bare_s"] / batch


def _breakdown(
    layout: str, r: dict[str, Any], steps: int, batch: int, bare: float, med: Callable[..., float]
) -> None:
    """Seconds per step the service adds to the bare loop, by cause (part 1 supplies what timers cannot)."""
    t = r["times"]
    if "step" not in t:
        print(f"  {layout}: this version of the service logs no time/* metrics; no breakdown")
        return
    per = {k: v / steps for k, v in t.items()}
    service_step = batch / r["steady_ips"]
    rows: list[tuple[str, float]] = []
    if layout == "2x1":
        nosync, ddp = med("2x1", "bare_nosync"), med("2x1", "bare_ddp")
        if math.isnan(nosync) or math.isnan(ddp):  # --skip-steps: part 1 ran the bare loop only
            print(f"  {layout}: part 1 skipped: the process layout and the all-reduce are in 'other' below")
        else:
            rows += [("process layout (2 x 1 thread vs 1 x 2), part 1", nosync - bare)]
            rows += [("gradient all-reduce (DDP over gloo), part 1", ddp - nosync)]
    rows += [("engine collectives (sizes, all-gather, stats, dL/dE)", per["comm"])]
    rows += [("data (sampling + decode + augment)", per["data"])]
    explained = sum(v for _, v in rows)
    rows += [("other per-step overhead (rest of the step)", service_step - bare - explained)]
    rows += [
        ("evaluation (outside steps)", per.get("eval", 0.0)),
        ("checkpoints (outside steps)", per.get("checkpoint", 0.0)),
        ("MLflow calls (outside steps)", per.get("log", 0.0)),
    ]
    loop_per_step = per["loop"]
    print(
        f"  {layout}: service {service_step:.3f} s per step in steady state, "
        f"{loop_per_step:.3f} with everything; the bare loop {bare:.3f}"
    )
    for label, value in rows:
        print(f"    {label:<56}{value:>+8.3f} s{value / loop_per_step:>8.1%} of the loop")


if __name__ == "__main__":
    main()
