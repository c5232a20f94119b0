"""The per-worker loop in one process (world of 1, no Ray): NaN steps, checkpoint round trip, logging.

Ray's part (worker groups, restarts, job submission) is covered end to end in test_service.py; here the
loop runs in-process against real glyph shards and a real MLflow sqlite store, so each case takes seconds.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from dmltrain.data.errors import SampleError
from dmltrain.service.best import is_scored, worst_score
from dmltrain.service.checkpoints import checkpoint_dir_name, load_state
from dmltrain.service.config import ExperimentConfig, flatten, load_config, to_yaml
from dmltrain.service.tracking import start_or_resume_run
from dmltrain.service.train import NonFiniteLossError, WorkerLoop, seed_step_randomness

REPO = Path(__file__).parents[1]


class _Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    def as_directory(self):  # same protocol as ray.train.Checkpoint
        from contextlib import nullcontext

        return nullcontext(str(self.path))


@dataclass
class LocalContext:
    """Stands in for Ray Train's worker context in a single process: checkpoints go to a folder."""

    root: Path
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_world_size: int = 1
    restore_from: Path | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def get_checkpoint(self) -> _Checkpoint | None:
        return _Checkpoint(self.restore_from) if self.restore_from else None

    def report(
        self,
        metrics: dict[str, float],
        directory: str | None,
        upload: str = "sync",
        name: str | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        self.reports.append(metrics)
        if directory:
            assert name is not None
            shutil.copytree(directory, self.root / name, dirs_exist_ok=True)  # a replay stores again
            if on_stored is not None:  # Ray calls it once the copy in storage is complete
                on_stored()
            if upload == "async":  # as Ray does once an asynchronous upload is done
                shutil.rmtree(directory)

    def checkpoint_at(self, uri: str) -> _Checkpoint:
        return _Checkpoint(Path(uri))


def _setup(tmp_path: Path, glyphs: Path, *overrides: str) -> tuple[ExperimentConfig, str, str]:
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs}",
            "data.prepare=null",
            "data.loader_workers=0",
            "scaling.num_workers=1",
            "train.global_batch_size=16",
            "train.chunk_size=8",
            "train.log_every=1",
            "train.eval_at_start=false",
            "eval.max_images=200",
            "eval.grid_queries=2",
            *overrides,
        ],
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, _ = start_or_resume_run(uri, "loop", str(tmp_path), "loop", flatten(config), to_yaml(config))
    return config, run_id, uri


def test_an_fp16_overflow_on_the_first_step_leaves_fused_sgd_sound(
    glyphs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss scale far too large overflows the first step, then backs off to a sane one. Handed the
    overflow by `GradScaler.step`, fused
    SGD created its momentum buffers (empty) and then skipped the step, so every later update added
    uninitialised memory: momentum of 1e38, NaN losses, and on 2 ranks parameters that differed."""
    real = torch.amp.GradScaler
    monkeypatch.setattr(
        torch.amp, "GradScaler", lambda device: real(device, init_scale=2.0**40, backoff_factor=2.0**-30)
    )
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "train.steps=6",
        "train.eval_every=100",
        "train.checkpoint_every=100",
        "train.precision=fp16",
        "optim.name=sgd",
    )
    loop = WorkerLoop(config, run_id, uri, LocalContext(tmp_path))
    assert loop.optimizer.param_groups[0]["fused"] and loop.scaler is not None
    before = [p.detach().clone() for p in loop.params]
    loop.run()
    assert loop.counters.overflow_steps == 1 and loop.scaler.get_scale() == 2.0**10
    momentum = [s["momentum_buffer"] for s in loop.optimizer.state.values() if "momentum_buffer" in s]
    assert momentum and all(torch.isfinite(m).all() and m.abs().max() < 1e3 for m in momentum)
    moved = max(float((p - b).abs().max()) for p, b in zip(loop.params, before, strict=True))
    assert 0 < moved < 1, moved  # it trained, by steps of the learning rate's size
    losses = [m.value for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")]
    assert losses and all(math.isfinite(v) for v in losses)


def test_gradients_that_overflow_at_any_loss_scale_end_the_run_in_one_line(
    glyphs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each overflow halves the fp16 loss scale; gradients that overflow whatever the scale never stopped the
    run (the non-finite step limit counts only non-finite losses)."""

    class Overflowing(torch.amp.GradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(math.inf)
            super().unscale_(optimizer)

    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: Overflowing(device, init_scale=4.0))
    config, run_id, uri = _setup(
        tmp_path, glyphs_root, "train.steps=6", "train.eval_every=100", "train.precision=fp16"
    )
    loop = WorkerLoop(config, run_id, uri, LocalContext(tmp_path))
    before = [p.detach().clone() for p in loop.params]
    with pytest.raises(
        NonFiniteLossError, match=r"^fp16: the gradients overflow even with a loss scale of 0\.5 \(3 "
    ):
        loop.run()
    assert all(torch.equal(p, b) for p, b in zip(loop.params, before, strict=True))


def test_checkpoint_round_trip_continues_the_run(glyphs_root: Path, tmp_path: Path) -> None:
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.eval_every=4",
        f"run.storage_path={tmp_path}",
        "run.name=loop",
    )
    storage = tmp_path / "loop"
    storage.mkdir()
    first = LocalContext(storage)
    loop = WorkerLoop(config, run_id, uri, first)
    loop.run()
    assert [r["step"] for r in first.reports] == [2, 4] and "eval/test/recall@1" in first.reports[-1]
    # Only evaluated checkpoints carry a real score for Ray's best-checkpoint ranking.
    assert first.reports[0]["checkpoint_score"] == worst_score("max") and not is_scored(worst_score("max"))
    # Ray keeps scores in a JSON snapshot for relaunches: they must survive it (an infinity becomes null).
    assert json.loads(json.dumps(first.reports[0], allow_nan=False)) == first.reports[0]
    assert first.reports[1]["checkpoint_score"] == first.reports[1]["eval/test/recall@1"]
    assert sorted(p.name for p in storage.iterdir()) == ["checkpoint_000000002", "checkpoint_000000004"]
    final_weights = {k: v.clone() for k, v in loop.net.state_dict().items()}
    # Where the time went (time/* in MLflow): the parts fit inside the loop's wall time.
    t = {k.removeprefix("time/"): v for k, v in MlflowClient(uri).get_run(run_id).data.metrics.items()}
    assert t["eval_seconds"] > 0 and t["checkpoint_seconds"] > 0 and t["log_seconds"] > 0
    assert t["comm_seconds"] <= t["engine_seconds"]
    assert t["data_seconds"] + t["engine_seconds"] + t["update_seconds"] <= t["step_seconds"]
    parts = t["step_seconds"] + t["eval_seconds"] + t["checkpoint_seconds"] + t["log_seconds"]
    assert parts <= t["loop_seconds"] <= parts + 5.0
    client = MlflowClient(uri)
    assert client.get_run(run_id).data.tags["dmltrain.checkpoint_step"] == "4"

    # A fresh loop restored from the step-2 checkpoint replays steps 3-4 from the same stream position.
    client.set_tag(run_id, "dmltrain.checkpoint_step", "2")  # as if step 4 had never been stored
    resumed = WorkerLoop(
        config, run_id, uri, LocalContext(storage, restore_from=storage / "checkpoint_000000002")
    )
    assert resumed.step == 2 and resumed.stream.step == 2
    # The time/* totals continue from the checkpoint's (they restarted at zero, the curves dropping there).
    saved = load_state(storage / "checkpoint_000000002").extra["times"]
    assert saved["step"] > 0 and resumed.times.seconds["step"] == saved["step"]
    assert resumed.times.metrics()["time/loop_seconds"] >= saved["loop"]
    resumed.run()
    for key, value in resumed.net.state_dict().items():
        torch.testing.assert_close(value, final_weights[key], msg=key)
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert steps == [1, 2, 3, 4]  # the replayed steps were not logged a second time

    # Ray hands back step 2 (it never registered step 4: its node died right after storing it), but rank 0
    # recorded step 4 in MLflow: the loop continues from step 4, not 2.
    assert client.get_run(run_id).data.tags["dmltrain.checkpoint_step"] == "4"
    latest = WorkerLoop(
        config, run_id, uri, LocalContext(storage, restore_from=storage / "checkpoint_000000002")
    )
    assert latest.step == 4 and latest.stream.step == 4
    for key, value in latest.net.state_dict().items():
        torch.testing.assert_close(value, final_weights[key], msg=key)


def test_a_resume_logs_the_window_an_uninterrupted_run_logs(glyphs_root: Path, tmp_path: Path) -> None:
    """A failure between a checkpoint (step 2) and the next log line (step 3): the resumed run's line at
    step 3 averaged step 3 alone, the uninterrupted run's steps 1-3 (the window was not checkpointed)."""
    overrides = ("train.steps=3", "train.log_every=3", "train.checkpoint_every=2", "train.eval_every=3")
    losses = []
    for name, fail in (("whole", False), ("resumed", True)):
        config, run_id, uri = _setup(
            tmp_path / name, glyphs_root, *overrides, f"run.storage_path={tmp_path / name}", "run.name=loop"
        )
        storage = tmp_path / name / "loop"
        storage.mkdir(parents=True)
        loop = WorkerLoop(config, run_id, uri, LocalContext(storage))
        if fail:

            def fail_at_step_3(loop: WorkerLoop = loop, train_step: Any = loop._train_step) -> object:
                if loop.step == 2:
                    raise RuntimeError("the node went away")
                return train_step()

            loop._train_step = fail_at_step_3  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="went away"):
                loop.run()
            restored = LocalContext(storage, restore_from=storage / "checkpoint_000000002")
            loop = WorkerLoop(config, run_id, uri, restored)
            assert loop.window.steps == 2  # steps 1-2, not yet logged
        loop.run()
        losses.append([(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")])
    whole, resumed = losses
    assert [step for step, _ in whole] == [3] and resumed == whole


def test_nan_steps_are_skipped_then_fail_clearly(glyphs_root: Path, tmp_path: Path) -> None:
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "train.steps=10",
        "train.max_skipped_steps=2",
        "train.eval_every=100",
        "data.loader_workers=1",
    )
    loop = WorkerLoop(config, run_id, uri, LocalContext(tmp_path))
    with torch.no_grad():
        loop.net.embedding.bias.fill_(float("nan"))  # every embedding becomes NaN
    before = {k: v.clone() for k, v in loop.net.state_dict().items()}
    children = set(multiprocessing.active_children())
    with pytest.raises(NonFiniteLossError, match="max_skipped_steps=2"):
        loop.run()
    # The failed loop stopped its loader process itself: killed with the Ray worker, it would leave its
    # /tmp/pymp-* folder behind.
    assert set(multiprocessing.active_children()) <= children
    assert loop.counters.skipped_steps == 3
    # checkpointed: a restart inside a run of skipped steps goes on counting it
    assert loop.counters.state_dict()["consecutive_skips"] == 3
    restored = type(loop.counters)()
    restored.load_state_dict(loop.counters.state_dict())
    assert restored.consecutive_skips == 3
    for key, value in before.items():  # no update reached the weights or the BatchNorm statistics
        torch.testing.assert_close(loop.net.state_dict()[key], value, msg=key, equal_nan=True)
    skipped = MlflowClient(uri).get_metric_history(run_id, "train/skipped_steps")
    assert [m.value for m in skipped] == [1.0, 2.0]


def test_an_error_names_the_evaluation_it_came_from(glyphs_root: Path, tmp_path: Path) -> None:
    """A bad test image failed as "step 1" when the step-0 evaluation read it, before any step ran."""
    import shutil

    from dmltrain.data import load_dataset_info
    from dmltrain.data.shards import ShardEntry, read_shard, write_shard

    root = tmp_path / "data"
    shutil.copytree(glyphs_root, root)
    url = load_dataset_info(root).shard_urls(root, "test")[0]
    write_shard(
        url, [ShardEntry(s.key, b"\x89PNG broken", "png", s.cls, s.category, {}) for s in read_shard(url)]
    )
    config, run_id, uri = _setup(tmp_path, root, "train.steps=2", "train.eval_at_start=true")
    loop = WorkerLoop(config, run_id, uri, LocalContext(tmp_path))
    assert loop.where() == "step 1"
    with pytest.raises(SampleError):
        loop.run()
    assert loop.where() == "evaluation at step 0"


def test_fp16_loop_scales_gradients_and_checkpoints_the_scaler(glyphs_root: Path, tmp_path: Path) -> None:
    """fp16 autocast with a GradScaler (CPU autocast supports fp16, so the GPU-only path runs here)."""
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "train.steps=1",
        "train.eval_every=100",
        "train.precision=fp16",
    )
    context = LocalContext(tmp_path)
    loop = WorkerLoop(config, run_id, uri, context)
    assert loop.scaler is not None and loop.autocast == torch.float16
    loop.run()
    client = MlflowClient(uri)
    losses = [m.value for m in client.get_metric_history(run_id, "train/loss")]
    assert len(losses) == 1 and all(math.isfinite(v) for v in losses)
    scales = [m.value for m in client.get_metric_history(run_id, "train/grad_scale")]
    assert scales and scales[-1] == loop.scaler.get_scale()
    tags = client.get_run(run_id).data.tags
    assert tags["dmltrain.precision"] == "fp16" and tags["dmltrain.device"].startswith("cpu")
    # the preprocessing used, data.* left unset resolved to the backbone's (params said None)
    assert json.loads(tags["dmltrain.preprocessing"]) == loop.preprocessing.to_dict()
    assert json.loads(tags["dmltrain.preprocessing"])["mean"] == [0.485, 0.456, 0.406]
    assert (
        tags["dmltrain.versions"].startswith("dmltrain 0.")
        and f"torch {torch.__version__}" in tags["dmltrain.versions"]
    )
    resumed = WorkerLoop(
        config, run_id, uri, LocalContext(tmp_path, restore_from=tmp_path / checkpoint_dir_name(1))
    )
    assert resumed.scaler is not None and resumed.scaler.state_dict() == loop.scaler.state_dict()
    assert resumed.scaler.state_dict() != torch.amp.GradScaler("cpu").state_dict()  # not a fresh scaler


def test_compiled_channels_last_loop_computes_the_eager_step(
    glyphs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.compile / train.channels_last forced on CPU: the first step's loss and gradient norm (before
    any update) equal the eager NCHW loop's. aot_eager instead of inductor keeps resnet18 quick to trace;
    inductor itself is compared with eager in test_acceleration.py. So does the loop with PyTorch's own
    convolutions instead of train.small_conv_matmul's rewrite (on by default on CPU).

    The channels_last gradient norm gets a looser bound: PyTorch's float32 channels_last convolutions on
    CPU are less exact than its NCHW ones. On this loader's first batch, outside the loop (the same weights,
    one plain forward and backward, gradient norm against float64): NCHW 4e-6 off, channels_last 1.2e-3 off
    (2026-11-28, AVX-512 CPU); the loop's channels_last step is 1.2e-4 from its NCHW step. A plumbing fault
    (a chunk replayed with other inputs or masks) is off by far more."""
    import functools

    from dmltrain.acceleration import compile_network
    from dmltrain.service import train as train_module

    monkeypatch.setattr(
        train_module, "compile_network", functools.partial(compile_network, backend="aot_eager")
    )
    first: dict[str, tuple[float, float]] = {}
    variants = {
        "eager": (),
        "compiled": ("train.compile=true",),
        "fast": ("train.compile=true", "train.channels_last=true"),
        "pytorch_convs": ("train.small_conv_matmul=false",),
    }
    for name, flags in variants.items():
        directory = tmp_path / name
        directory.mkdir()
        config, run_id, uri = _setup(directory, glyphs_root, "train.steps=1", "train.eval_every=100", *flags)
        loop = WorkerLoop(config, run_id, uri, LocalContext(directory))
        loop.run()
        client = MlflowClient(uri)
        loss = client.get_metric_history(run_id, "train/loss")[0].value
        norm = client.get_metric_history(run_id, "train/grad_norm")[0].value
        first[name] = (loss, norm)
        tags = client.get_run(run_id).data.tags
        expected = ("true" if name == "fast" else "false", "works" if "compile" in str(flags) else "eager")
        assert (tags["dmltrain.channels_last"], tags["dmltrain.compile"]) == expected
        rewritten = "off" if name == "pytorch_convs" else "20 convolutions (tap"  # resnet18's Conv2d layers
        assert tags["dmltrain.small_conv_matmul"].startswith(rewritten)
    for name in ("compiled", "fast", "pytorch_convs"):
        assert first[name][0] == pytest.approx(first["eager"][0], rel=1e-5)
        assert first[name][1] == pytest.approx(first["eager"][1], rel=2e-3 if name == "fast" else 1e-5)


def test_out_of_gpu_memory_names_the_setting_that_bounds_it() -> None:
    """A CUDA out-of-memory error is retried by Ray Train as a fault, and fails the same way at the same
    shapes: the loop ends the run on it with one line (torch's account of the allocation, then the key).
    The message is torch's own format (a real one is checked in tests/test_gpu.py on a GPU)."""
    from dmltrain.service.errors import as_fatal
    from dmltrain.service.train import DeviceMemoryError, device_memory_error

    config = load_config(REPO / "configs" / "sop_smoothap_b16k.yaml", ["model.weights=null"])
    exc = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 12.25 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.06 GiB is free. Including non-PyTorch memory, this process has 76.12 GiB memory in use. If "
        "reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    step = device_memory_error(exc, config, evaluating=False)
    assert isinstance(step, DeviceMemoryError) and str(step) == (
        "CUDA out of memory. Tried to allocate 12.25 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.06 GiB is free: lower train.chunk_size (now 256; a step's memory grows with the chunk, not with "
        "the batch)"
    )
    evaluation = device_memory_error(exc, config, evaluating=True)
    assert str(evaluation).endswith("is free: lower eval.batch_size (now 512)")
    setup = device_memory_error(exc, config, evaluating=False, setting_up=True)
    assert str(setup) == (
        "CUDA out of memory. Tried to allocate 12.25 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.06 GiB is free (setting up model.backbone=resnet50 before the first step): another process may "
        "hold this GPU (nvidia-smi), or the model does not fit it"
    )
    fatal = as_fatal(step, 3, "step 7", explained=True)
    assert str(fatal).startswith("rank 3 step 7: DeviceMemoryError: CUDA out of memory.") and fatal.explained


def test_a_set_up_out_of_gpu_memory_waits_then_ends_the_run_in_one_line() -> None:
    """Ray Train retried a set-up that ran out of GPU memory into the same failure; but just after a restart
    a process of the previous attempt may still hold the GPU. So: wait and try again, then one line."""
    from dmltrain.service.errors import FatalRunError
    from dmltrain.service.train import set_up_with_memory_waits

    config = load_config(REPO / "configs" / "sop_smoothap_b16k.yaml", ["model.weights=null"])
    full = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 98.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "12.50 MiB is free. Including non-PyTorch memory, this process has 1.2 GiB memory in use."
    )
    calls: list[int] = []

    def busy_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise full
        return "the loop"

    assert set_up_with_memory_waits(busy_once, config, 0, waits_s=(0.01,)) == "the loop"  # type: ignore[arg-type]
    assert len(calls) == 2

    def always() -> None:
        calls.append(1)
        raise full

    calls.clear()
    with pytest.raises(FatalRunError) as ended:
        set_up_with_memory_waits(always, config, 3, waits_s=(0.01, 0.01))  # type: ignore[arg-type]
    assert len(calls) == 3 and ended.value.explained
    assert str(ended.value).startswith(
        "rank 3 setup: DeviceMemoryError: CUDA out of memory. Tried to allocate 98.00 MiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 12.50 MiB is free (setting up model.backbone=resnet50 before "
        "the first step)"
    )
    with pytest.raises(FatalRunError, match=r"^rank 0 setup: KeyError"):  # a set-up error: at once
        set_up_with_memory_waits(lambda: {}["x"], config, 0, waits_s=(60,))  # type: ignore[arg-type]


def test_model_randomness_is_per_rank_and_replayed_by_a_resume(glyphs_root: Path, tmp_path: Path) -> None:
    """efficientnet_b0's stochastic depth draws from torch's generator inside the network. Seeded once at
    start-up, a resumed run drew the masks of steps 1-2 again at steps 3-4 (its weights left the
    uninterrupted run's), and every rank drew the same masks."""
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "model.backbone=efficientnet_b0",
        "model.freeze_bn=false",  # training-mode blocks: stochastic depth is live
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.eval_every=100",
        f"run.storage_path={tmp_path}",
        "run.name=loop",
    )
    storage = tmp_path / "loop"
    storage.mkdir()
    loop = WorkerLoop(config, run_id, uri, LocalContext(storage))
    loop.run()
    final = {k: v.clone() for k, v in loop.net.state_dict().items()}
    MlflowClient(uri).set_tag(run_id, "dmltrain.checkpoint_step", "2")
    resumed = WorkerLoop(
        config, run_id, uri, LocalContext(storage, restore_from=storage / "checkpoint_000000002")
    )
    assert resumed.step == 2
    resumed.run()
    for key, value in resumed.net.state_dict().items():
        torch.testing.assert_close(value, final[key], msg=key)

    def masks(rank: int, step: int) -> torch.Tensor:
        seed_step_randomness(config.train.seed, rank, step, torch.device("cpu"))
        return torch.rand(8)

    assert torch.equal(masks(0, 3), masks(0, 3))
    assert not torch.equal(masks(0, 3), masks(1, 3)) and not torch.equal(masks(0, 3), masks(0, 4))


def test_a_run_restored_after_it_stopped_early_stays_stopped(glyphs_root: Path, tmp_path: Path) -> None:
    """Restored from the checkpoint early stopping wrote (a restart after it, a relaunch with the same
    patience), the loop trained on until its patience ran out again, one more checkpoint each time. A
    relaunch with another optimizer starts that afresh instead of failing in the step (KeyError 'betas')."""
    config, run_id, uri = _setup(
        tmp_path,
        glyphs_root,
        "train.steps=6",
        "train.eval_every=1",
        "train.checkpoint_every=1",
        "train.best_metric=eval/test/recall@1",
        "train.early_stopping_patience=1",
        "train.early_stopping_min_delta=1.0",  # no evaluation after the first is better
        f"run.storage_path={tmp_path}",
        "run.name=loop",
    )
    storage = tmp_path / "loop"
    storage.mkdir()
    loop = WorkerLoop(config, run_id, uri, LocalContext(storage))
    loop.run()
    assert loop.step == 2
    again = LocalContext(storage, restore_from=storage / "checkpoint_000000002")
    restored = WorkerLoop(config, run_id, uri, again)
    restored.run()
    assert restored.step == 2 and again.reports == []

    sgd = config.model_copy(update={"optim": config.optim.model_copy(update={"name": "sgd"})})
    relaunched = WorkerLoop(
        sgd, run_id, uri, LocalContext(storage, restore_from=storage / "checkpoint_000000002")
    )
    assert relaunched.step == 2 and not relaunched.optimizer.state  # afresh, not Adam's moments
    # Another network is no fault a restart fixes (a RuntimeError was retried run.max_failures times).
    wider = config.model_copy(update={"model": config.model.model_copy(update={"embedding_dim": 64})})
    with pytest.raises(
        ValueError, match=r"step-2 checkpoint does not fit this launch's network .*size mismatch"
    ):
        WorkerLoop(wider, run_id, uri, LocalContext(storage, restore_from=storage / "checkpoint_000000002"))
