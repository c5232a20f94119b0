"""The per-worker training loop that Ray Train runs on every worker (``train_loop_per_worker``).

Each worker streams its own shards, the engine turns the local batches into one exact global-batch step,
rank 0 evaluates and talks to MLflow, and every rank reports to Ray at checkpoints so a failed worker
group restarts from the last one. Nothing here depends on Ray beyond the small ``_RayContext`` shim.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dmltrain.acceleration import (
    compile_network,
    compile_state,
    resolve_channels_last,
    resolve_compile,
    resolve_precision,
    resolve_small_conv_matmul,
)
from dmltrain.data import SamplerSpec, TrainLoader, load_dataset_info
from dmltrain.data.device_memory import DecodeMemoryError
from dmltrain.data.errors import SharedMemoryError
from dmltrain.data.loader import WorkerPriority
from dmltrain.distributed import all_gather_objects, all_reduce_max_, broadcast_object
from dmltrain.engine import global_batch_step
from dmltrain.models import EmbeddingNet
from dmltrain.service.best import SCORE_KEY, BestTracker, resolve_best_metric
from dmltrain.service.builders import (
    build_loss,
    build_network,
    build_optimizer,
    build_scheduler,
    build_tn_schedule,
    build_train_transform,
    load_optimizer_state,
    resolve_preprocessing,
    restore_schedule,
)
from dmltrain.service.checkpoints import (
    TrainingState,
    checkpoint_dir_name,
    checkpoint_dir_step,
    checkpoint_uri,
    load_state,
    load_stream_state,
    save_state,
    save_stream_state,
    staging_directory,
)
from dmltrain.service.config import KEEP_FREED_MEMORY_ENV, LOADER_PRIORITY_ENV, ExperimentConfig, recall_ks
from dmltrain.service.distributed_eval import EvalImageCache, evaluate
from dmltrain.service.errors import FATAL_IN_LOOP, FATAL_IN_SETUP, as_fatal
from dmltrain.service.logs import WORKER_LOGGERS, quiet_ray_reports, setup_logging, shorten_explained_errors
from dmltrain.service.memory import peak_rss_mb, reset_peak_rss
from dmltrain.service.prefetch import BatchPrefetcher
from dmltrain.service.preflight import shared_memory_config_problem
from dmltrain.service.profiling import StepProfiler
from dmltrain.service.tracking import EARLY_STOP_TAG, RunLogger
from dmltrain.small_convs import gemm_weight_grads_help, use_matmul_for_small_convs
from dmltrain.versions import version_line

log = logging.getLogger("dmltrain.service.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps produced a NaN/inf loss or gradient: the run is diverging."""


class DeviceMemoryError(RuntimeError):
    """A training step or an evaluation batch does not fit the GPU: the same shapes fail the same way after
    a restart, so Ray Train's retries would only repeat it (and end in a traceback)."""


_SETUP_MEMORY_WAITS_S = (10, 30)  # before each new try of a set-up that ran out of GPU memory
_MODEL_RANDOMNESS = 0x6D6F64  # "mod": keeps these seeds apart from the loader's (seed, consumer, step)


def device_memory_error(
    exc: torch.cuda.OutOfMemoryError, config: ExperimentConfig, evaluating: bool, *, setting_up: bool = False
) -> DeviceMemoryError:
    """torch's account of the failed allocation (its first sentences: what was asked, what the GPU has and
    holds) and the setting that bounds that memory."""
    account = ". ".join(str(exc).strip().splitlines()[0].split(". ")[:3]).rstrip(".")
    if setting_up:  # the weights, their optimizer state or the loader's device buffers: no step ran yet
        return DeviceMemoryError(
            f"{account} (setting up model.backbone={config.model.backbone} before the first step): another "
            "process may hold this GPU (nvidia-smi), or the model does not fit it"
        )
    chunk = min(config.train.chunk_size, config.local_batch_size)
    if isinstance(exc, DecodeMemoryError):
        return DeviceMemoryError(
            f"{account} (decoding a batch's JPEGs on the GPU, data.decode={config.data.decode}): lower "
            f"train.chunk_size (now {chunk}) to leave the decoder room beside the step, or set "
            "data.decode=cpu (the loader workers decode)"
        )
    if evaluating:
        knob = f"eval.batch_size (now {config.eval.batch_size})"
    else:
        knob = f"train.chunk_size (now {chunk}; a step's memory grows with the chunk, not with the batch)"
    return DeviceMemoryError(f"{account}: lower {knob}")


@dataclass(frozen=True)
class _StepStats:
    """What one training step reports to the log window."""

    loss: float
    grad_norm: float
    images: int
    seconds: float
    data_seconds: float
    engine_seconds: float  # global_batch_step: forward, loss, backward, collectives (comm_seconds within)
    comm_seconds: float
    update_seconds: float  # gradient norm, optimizer and schedule steps
    valid: int
    queries: int


@dataclass
class _Window:
    """Running sums over the steps since the last log line."""

    steps: int = 0
    loss: float = 0.0
    images: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0
    comm_seconds: float = 0.0
    valid: int = 0
    queries: int = 0

    def add(self, step: _StepStats) -> None:
        self.steps += 1
        self.loss += step.loss
        self.images += step.images
        self.seconds += step.seconds
        self.data_seconds += step.data_seconds
        self.comm_seconds += step.comm_seconds
        self.valid += step.valid
        self.queries += step.queries

    def metrics(self) -> dict[str, float]:
        seconds = max(self.seconds, 1e-9)
        return {
            "train/loss": self.loss / max(self.steps, 1),
            "train/images_per_second": self.images / seconds,
            "train/data_wait_share": self.data_seconds / seconds,
            "train/comm_share": self.comm_seconds / seconds,
            "train/valid_query_share": self.valid / max(self.queries, 1),
            "train/step_seconds": self.seconds / max(self.steps, 1),
        }


@dataclass
class _Counters:
    """Run totals and the current run of skipped steps: all survive a restart (checkpointed), so a restart
    inside a run of non-finite steps does not reset the count `train.max_skipped_steps` bounds."""

    skipped_steps: int = 0
    empty_batches: int = 0
    overflow_steps: int = 0  # fp16: updates the gradient scaler skipped (scaled gradients overflowed)
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, float]:
        return {
            "skipped_steps": self.skipped_steps,
            "empty_batches": self.empty_batches,
            "overflow_steps": self.overflow_steps,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.empty_batches = int(state.get("empty_batches", 0))
        self.overflow_steps = int(state.get("overflow_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))


class _PhaseTimes:
    """Where the run's wall time went on this rank, by phase (cumulative seconds).

    Logged by rank 0 as ``time/<phase>_seconds`` with every training log line, so the split between
    stepping, data, collectives, logging, checkpoints and evaluation can be read back from MLflow
    (bench/service.py does). ``comm`` is part of ``engine``; ``step`` holds data, engine and update plus
    the step's own bookkeeping; ``loop`` is the wall time of the training loop. Checkpointed: a resumed
    run continues the totals at its checkpoint's (the curves dropped to zero at every relaunch).
    """

    PHASES = ("step", "data", "engine", "comm", "update", "log", "checkpoint", "eval")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.start = time.perf_counter()

    def add_step(self, stats: _StepStats) -> None:
        for phase, value in (
            ("step", stats.seconds),
            ("data", stats.data_seconds),
            ("engine", stats.engine_seconds),
            ("comm", stats.comm_seconds),
            ("update", stats.update_seconds),
        ):
            self.seconds[phase] += value

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_seconds": v for k, v in self.seconds.items()}
        out["time/loop_seconds"] = time.perf_counter() - self.start
        return out

    def state_dict(self) -> dict[str, float]:
        return {**self.seconds, "loop": time.perf_counter() - self.start}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Totals at a checkpoint (None: written before they were kept)."""
        if state:
            self.seconds.update({k: float(v) for k, v in state.items() if k in self.seconds})
            self.start = time.perf_counter() - float(state.get("loop", 0.0))


def _unwrap(model: nn.Module) -> EmbeddingNet:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # type: ignore[return-value]


def _decode_mode(setting: str, device: torch.device) -> str:
    """``data.decode`` for this worker: gpu needs a CUDA device (the library would run the same path on
    a CPU device, which only tests want)."""
    if setting == "gpu" and device.type != "cuda":
        raise ValueError(f"data.decode=gpu but this worker's device is {device}: set data.decode=auto or cpu")
    return setting


def _loader_priority(setting: str, device: torch.device) -> WorkerPriority:
    """``data.loader_priority`` for this worker: auto is what the driver resolved from the topology
    (`run.worker_env_vars`), else, for a loop built outside a launch, idle on a CPU device: there the
    loaders share the step's cores; a GPU worker's step leaves its cores free, its loaders set the pace."""
    if setting == "auto":
        setting = os.environ.get(LOADER_PRIORITY_ENV) or ("idle" if device.type == "cpu" else "normal")
    return "idle" if setting == "idle" else "normal"  # the config allows only auto, idle, normal


def _small_conv_setting(converted: int) -> str:
    """The small-convolution rewrite as the tag shows it: it differs between AVX2 and AVX-512 CPUs."""
    if not converted:
        return "off"
    rewrites = "tap + weight-grad matmul" if gemm_weight_grads_help() else "tap only"
    return f"{converted} convolutions ({rewrites})"


def _omp_wait_settings() -> str:
    """The OpenMP wait settings this process runs with, for the run's tags: GOMP_SPINCOUNT, when set,
    overrides OMP_WAIT_POLICY in GNU OpenMP, so the tag shows both (every scaling.omp_wait_policy sets it)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    spin = os.environ.get("GOMP_SPINCOUNT")
    return f"{policy} (GOMP_SPINCOUNT={spin})" if spin else policy


def _malloc_settings() -> str:
    """glibc's malloc settings this process runs with (scaling.keep_freed_memory), for the run's tags."""
    settings = [f"{key}={os.environ[key]}" for key in KEEP_FREED_MEMORY_ENV if key in os.environ]
    return " ".join(settings) or "glibc defaults"


def _grad_norm(parameters: list[nn.Parameter], clip: float | None) -> float:
    """Global gradient norm (clipping to ``clip`` if set); inf/NaN when a gradient is not finite."""
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if clip is not None:
        return float(torch.nn.utils.clip_grad_norm_(grads, clip, error_if_nonfinite=False))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


def seed_step_randomness(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Seed torch's generators for one training step of one rank: the model's own randomness (dropout,
    drop-path, stochastic depth) then differs between ranks, whose rows would otherwise share masks in
    rank-sized groups, and depends on the step alone, so a resumed run draws what an uninterrupted one would.
    The data's augmentations have their own seeded draws (dmltrain.data)."""
    entropy = [seed % 2**64, rank, step, _MODEL_RANDOMNESS]  # SeedSequence takes no negative seed
    value = int(np.random.SeedSequence(entropy).generate_state(1)[0])
    if device.type == "cuda":
        # A network on the GPU draws its masks from the GPU's generator. The host's is left to the data
        # (an in-process loader seeds it per part) and to the engine's replay of it around each chunk.
        with torch.cuda.device(device):
            torch.cuda.manual_seed(value)
    else:  # the host's generator, which an in-process loader uses only inside this thread's own steps
        torch.default_generator.manual_seed(value)  # not torch.manual_seed: no lazy seeding of every GPU


def _restore(live: Iterable[Tensor], saved: list[Tensor] | None) -> None:
    """Put back BatchNorm's running statistics (``saved`` before the step) after a step that is not taken."""
    if saved is not None:
        with torch.no_grad():
            for buffer, copy in zip(live, saved, strict=True):
                buffer.copy_(copy)


class WorkerLoop:
    """One worker's share of a run: setup, optional resume, steps, evaluations, checkpoints."""

    def __init__(self, config: ExperimentConfig, run_id: str, tracking_uri: str, ray_ctx: Any) -> None:
        self.config = config
        self.ray = ray_ctx
        self.rank = ray_ctx.rank
        self.world = ray_ctx.world_size
        self.device = ray_ctx.device
        # Explicit, because Ray exports OMP_NUM_THREADS=<CPUs of the worker> only when it is unset.
        torch.set_num_threads(config.scaling.torch_threads or max(1, int(config.scaling.cpus_per_worker)))
        torch.manual_seed(config.train.seed)  # identical initial weights on every rank
        # The backbone's own resolution, resize rule, interpolation and mean/std (config overrides applied):
        # the same value drives the train/test transforms, the normalisation and the saved model.
        self.preprocessing = resolve_preprocessing(config)
        self.eval_images = EvalImageCache(config.eval.cache_mb << 20)
        self.normalize = self.preprocessing.normalizer()
        model = build_network(config, self.preprocessing)
        self.precision = resolve_precision(config.train.precision, self.device)
        self.channels_last = resolve_channels_last(config.train.channels_last, self.device, model)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.small_convs = (
            use_matmul_for_small_convs(model)
            if resolve_small_conv_matmul(config.train.small_conv_matmul, self.device)
            else 0
        )
        if resolve_compile(config.train.compile, self.device):
            compile_network(model)  # in place, before DDP wraps it (see dmltrain.acceleration)
        self.model = ray_ctx.prepare_model(model)
        self.net = _unwrap(self.model)
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.net, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.train.steps)
        self.loss_fn = build_loss(config.loss, self.net.levels).to(self.device)
        self.tn_schedule = build_tn_schedule(config.loss, self.loss_fn)
        self.info = load_dataset_info(config.data.root)
        self.stream = TrainLoader(
            config.data.root,
            config.local_batch_size,
            SamplerSpec.from_config(config.sampler),
            split=config.data.train_split,
            rank=self.rank,
            world_size=self.world,
            num_workers=config.data.loader_workers,
            transform=build_train_transform(config, self.preprocessing),
            info=self.info,
            decode=_decode_mode(config.data.decode, self.device),
            device=self.device,
            worker_priority=_loader_priority(config.data.loader_priority, self.device),
            cache_mb=config.data.cache_mb,
            pin_memory=self.device.type == "cuda",
            host_decode_share=config.data.host_decode_share,
        )
        problem = shared_memory_config_problem(
            config, self.info, self.stream.decode, ray_ctx.local_world_size
        )
        if problem:  # the driver checked a single node; here every node checks itself
            raise SharedMemoryError(problem)
        log.info(
            "rank %d: training images decoded on %s, loader priority %s, loader cache %d MB",
            self.rank,
            self.stream.decode_device or "the CPU",
            self.stream.worker_priority,
            self.stream.cache_mb,
        )
        # On CUDA the next batch is read (into pinned memory: asynchronous chunk copies) while the step runs:
        # by the loader's own join thread when it has one (several loader workers, or data.decode=gpu, which
        # decodes on the device one step ahead), else by a prefetch thread here. Not with no loader process:
        # the stream then draws its crops from torch's host generator in this process, which the engine
        # saves and restores around every chunk (dropout replay) from this thread: a thread beside it would
        # get crops that depend on timing (data.loader_workers=0 is for debugging; it loads in the step).
        prefetch = self.device.type == "cuda" and not self.stream.joins_ahead and self.stream.num_workers > 0
        self.batches = BatchPrefetcher(self.stream, pin=True) if prefetch else None
        self.autocast = self.precision.autocast_dtype
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.grad_scaling else None
        self.counters = _Counters()
        best_metric = resolve_best_metric(
            config.train.best_metric,
            [e.name for e in self.info.evaluations],
            recall_ks(config, self.info.recall_ks),
        )
        self.best = (
            BestTracker(
                best_metric,
                config.train.best_mode,
                config.train.early_stopping_min_delta,
                config.train.early_stopping_patience,
            )
            if best_metric
            else None
        )
        self.step = 0
        self.evaluating = False  # set while an evaluation runs (errors name it, not the next step)
        self.times = _PhaseTimes()
        # steps since the last log line; checkpointed, so a resume's first line averages what an
        # uninterrupted run's would (it covered only the steps after the checkpoint)
        self.window = _Window()
        first = config.train.profile_start
        self.profiler = (
            StepProfiler(first, config.train.profile_steps, self.device)
            if self.rank == 0 and first is not None
            else None
        )
        # Metrics go to MLflow from a background thread: a step never waits for the tracking store.
        self.logger = RunLogger(tracking_uri, run_id, asynchronous=True) if self.rank == 0 else None
        if self.logger is not None:  # what data.decode resolved to (auto picks per worker)
            device, share = self.stream.decode_device, self.stream.host_decode_share
            where = f"gpu ({device})" if device else "cpu"
            if device and share:
                where += f", {share:g} of the images in the loader workers"
            self.logger.set_tag("dmltrain.data_decode", where)
        self._restore()

    # ------------------------------------------------------------------ resume / checkpoint
    def _checkpoint_to_restore(self) -> Any:
        """Ray's latest checkpoint, or a newer one rank 0 recorded in MLflow that Ray never registered.

        The Ray Train controller learns of a stored checkpoint only when it next polls the workers (every
        couple of seconds). If the node of rank 0 (or the driver, with the controller) dies in between, Ray
        restarts from the checkpoint before, although the newer one is complete in storage; rank 0 tags
        each checkpoint in MLflow as soon as its copy in storage is complete, so take that one.
        """
        checkpoint = self.ray.get_checkpoint()
        recorded = broadcast_object(self.logger.checkpoint_step if self.logger is not None else None)
        registered = checkpoint_dir_step(str(checkpoint.path)) if checkpoint is not None else None
        if recorded is None or (checkpoint is not None and (registered is None or registered >= recorded)):
            return checkpoint
        uri = checkpoint_uri(self.config.run.storage_path, self.config.run.name, recorded)
        if self.rank == 0:
            log.warning(
                "resuming from the step-%d checkpoint rank 0 stored (%s); Ray registered %s before the "
                "failure",
                recorded,
                uri,
                "none" if checkpoint is None else f"step {registered}",
            )
        return self.ray.checkpoint_at(uri)

    def _restore(self) -> None:
        """Continue from the latest checkpoint (after a failure or a relaunch), if there is one."""
        checkpoint = self._checkpoint_to_restore()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            state = load_state(directory)
            stream_state = load_stream_state(directory, self.rank)
        try:
            self.net.load_state_dict(state.model)
        except RuntimeError as exc:  # a ValueError: fatal at setup, no restart fits it better
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            raise ValueError(
                f"the step-{state.step} checkpoint does not fit this launch's network (model.* changed under "
                f"run.resume=must? set a new run.name for another model): {' '.join(lines[:2])}"
            ) from exc
        # A relaunch may change settings (run.resume=must; train.steps under auto): the state carries on,
        # this launch's config says how (learning rates, schedule, Tn schedule, optimizer).
        saved_optimizer = state.extra.get("optimizer", self.config.optim.name)  # absent: written before
        if saved_optimizer == self.config.optim.name:
            load_optimizer_state(self.optimizer, state.optimizer)
        elif self.rank == 0:
            log.warning(
                "optim.name changed from %s to %s: the optimizer starts afresh (%s's moments are not "
                "carried over)",
                saved_optimizer,
                self.config.optim.name,
                saved_optimizer,
            )
        restore_schedule(self.scheduler, state.scheduler)
        self.step = state.step
        self.counters.load_state_dict(state.counters)
        if self.tn_schedule is not None:  # this launch's t1, t2 and length, at the checkpoint's iteration
            saved_tn = state.extra.get("tn_schedule") or {"cur_iter": self.step}
            self.tn_schedule.load_state_dict(
                {**self.tn_schedule.state_dict(), "cur_iter": saved_tn["cur_iter"]}
            )
        if self.best is not None:
            self.best.load_state_dict(state.extra.get("best"))
        if self.scaler is not None and state.extra.get("grad_scaler"):
            self.scaler.load_state_dict(state.extra["grad_scaler"])
        self.times.load_state_dict(state.extra.get("times"))
        self.window = _Window(**(state.extra.get("window") or {}))
        try:
            if stream_state is None:
                raise ValueError(f"the checkpoint has no stream state for rank {self.rank}")
            self.stream.load_state_dict(stream_state)
        except ValueError as why:  # e.g. relaunched with another world size, batch size or sampler
            log.warning("rank %d: data stream starts afresh (%s)", self.rank, why)
        log.info("rank %d resumed at step %d", self.rank, self.step)

    def _checkpoint(self, metrics: dict[str, float]) -> None:
        """Every rank reports (a barrier in Ray Train); rank 0 writes the whole state, including every
        rank's stream position, so the Ray checkpoint and its MLflow copy are both complete.

        The report carries ``checkpoint_score`` (`BestTracker.checkpoint_score`: the best metric if this
        step was evaluated, never above the best so far unless it is the new best; else the worst value) for
        Ray's best-checkpoint bookkeeping. With asynchronous upload Ray copies the directory to
        storage in the background and then deletes it, so MLflow's optional copy is taken first."""
        streams = all_gather_objects(self._stream_state())
        upload = self.config.run.checkpoint_upload
        report = {"step": self.step, **metrics}
        if self.best is not None:
            report[SCORE_KEY] = self.best.checkpoint_score(metrics, self.step)  # ranked as dmltrain ranks
        if self.rank != 0:
            self.ray.report(report, None, upload)
            return
        directory = staging_directory()
        try:
            for rank, stream in enumerate(streams):
                save_stream_state(directory, rank, stream)
            save_state(
                directory,
                TrainingState(
                    step=self.step,
                    model=self.net.state_dict(),
                    optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(),
                    counters=self.counters.state_dict(),
                    world_size=self.world,
                    extra={
                        "optimizer": self.config.optim.name,
                        "tn_schedule": self.tn_schedule.state_dict() if self.tn_schedule else None,
                        "best": self.best.state_dict() if self.best else None,
                        "grad_scaler": self.scaler.state_dict() if self.scaler else None,
                        "times": self.times.state_dict(),
                        "window": asdict(self.window),
                    },
                ),
            )
            if self.logger is not None and self.config.mlflow.log_checkpoints:
                self.logger.log_directory(directory, "checkpoints/latest")
            # Rank 0 tags the step in MLflow once Ray has copied the checkpoint to storage (inline when
            # synchronous, in Ray's upload thread when not): a restart resumes from it even if Ray's
            # controller never registered it (see _checkpoint_to_restore).
            on_stored = partial(self.logger.record_checkpoint, self.step) if self.logger is not None else None
            self.ray.report(report, directory, upload, checkpoint_dir_name(self.step), on_stored)
        finally:
            if upload == "sync":  # async: Ray deletes the directory once it is uploaded
                shutil.rmtree(directory, ignore_errors=True)

    def _judge(self, metrics: dict[str, float]) -> bool:
        """Rank 0 scores an evaluation against the best so far; every rank learns whether to stop."""
        stop = False
        if self.rank == 0 and self.best is not None:
            if self.best.update(metrics, self.step):
                log.info("step %d: new best %s = %.4f", self.step, self.best.metric, self.best.score)
                if self.logger is not None:
                    self.logger.set_tag("dmltrain.best_step", str(self.step))
            stop = self.best.should_stop
            if stop:
                log.info(
                    "early stopping at step %d: %d evaluations without a better %s (best %.4f at step %d)",
                    self.step,
                    self.best.stale,
                    self.best.metric,
                    self.best.score,
                    self.best.step,
                )
                if self.logger is not None:
                    self.logger.set_tag(EARLY_STOP_TAG, str(self.step))
        return bool(broadcast_object(stop))

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> dict[str, float]:
        self.evaluating = True
        metrics = evaluate(
            self.net,
            self.config,
            self.info,
            self.device,
            self.rank,
            self.world,
            self.logger,
            self.step,
            self.autocast,
            self.preprocessing,
            self.eval_images,
        )
        self.evaluating = False
        return metrics

    def where(self) -> str:
        """What the loop was doing, for an error's one line: the evaluation after step N, or step N+1."""
        return f"evaluation at step {self.step}" if self.evaluating else f"step {self.step + 1}"

    # ------------------------------------------------------------------ training
    def _stream_state(self) -> dict[str, Any]:
        """Where the data stream stands after the last step's batch (not after a prefetched one)."""
        return self.batches.state_dict() if self.batches is not None else self.stream.state_dict()

    def _train_step(self) -> _StepStats:
        cfg = self.config
        t0 = time.perf_counter()
        source = self.batches if self.batches is not None else self.stream
        images, labels, _categories = source.next_batch()
        data_seconds = time.perf_counter() - t0
        self.model.train()  # the engine keeps BatchNorm frozen during the step when model.freeze_bn is set
        self.optimizer.zero_grad(set_to_none=True)
        # Training-mode BatchNorm updates running statistics in the forward pass: keep a copy so a skipped
        # (non-finite) step leaves the model exactly as it was.
        buffers = None if cfg.model.freeze_bn else [b.detach().clone() for b in self.net.buffers()]
        seed_step_randomness(cfg.train.seed, self.rank, self.step + 1, self.device)
        result = global_batch_step(
            self.model,
            images,
            labels,
            self.loss_fn,
            cfg.train.chunk_size,
            preprocess=self.normalize,
            freeze_bn=cfg.model.freeze_bn,
            autocast_dtype=self.autocast,
            skip_nonfinite=True,
            channels_last=self.channels_last,
            grad_scaler=self.scaler,
        )
        t_update = time.perf_counter()
        loss = float(result.loss)
        if self.scaler is not None and math.isfinite(loss):
            self.scaler.unscale_(self.optimizer)  # true gradients for the norm, clipping and the update
        norm = _grad_norm(self.params, cfg.optim.grad_clip)
        if math.isfinite(loss) and math.isfinite(norm):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.counters.consecutive_skips = 0
        elif self.scaler is not None and math.isfinite(loss):
            # fp16: the scaled gradients overflowed. Not a diverging run: no update, and the scaler lowers
            # its scale (identical on every rank, the gradients are synced). Not through scaler.step: a
            # fused optimizer is handed the overflow to skip it itself, and fused SGD made its momentum
            # buffers (torch.empty_like) before skipping, so an overflow on the first step left them
            # uninitialised memory for every later step. update() reads what unscale_ found.
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            _restore(self.net.buffers(), buffers)
            self.counters.overflow_steps += 1
            # Halved at every overflow: below 1 the gradients themselves are not finite.
            if self.scaler.get_scale() < 1.0:
                raise NonFiniteLossError(
                    f"fp16: the gradients overflow even with a loss scale of {self.scaler.get_scale():g} "
                    f"({self.counters.overflow_steps} overflowing steps in all): lower optim.lr, set "
                    "optim.grad_clip, or set train.precision=bf16 or fp32"
                )
        else:
            # Identical decision on every rank: the loss and the synced gradients are global.
            self.optimizer.zero_grad(set_to_none=True)
            _restore(self.net.buffers(), buffers)
            self.counters.skipped_steps += 1
            self.counters.consecutive_skips += 1
            log.warning(
                "step %d: non-finite loss %.4g / grad norm %.4g, update skipped", self.step + 1, loss, norm
            )
            if self.counters.consecutive_skips > cfg.train.max_skipped_steps:
                raise NonFiniteLossError(
                    f"{self.counters.consecutive_skips} consecutive non-finite steps "
                    f"(train.max_skipped_steps={cfg.train.max_skipped_steps}): "
                    "lower optim.lr or set optim.grad_clip"
                )
        if result.num_valid == 0:
            self.counters.empty_batches += 1
        with warnings.catch_warnings():
            # A skipped step still advances the schedule (it is indexed by step); torch warns about that.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()
        if self.tn_schedule is not None:
            self.tn_schedule.step()
        self.step += 1
        end = time.perf_counter()
        return _StepStats(
            loss=loss,
            grad_norm=norm,
            images=cfg.train.global_batch_size,
            seconds=end - t0,
            data_seconds=data_seconds,
            engine_seconds=result.comm_seconds + result.compute_seconds,
            comm_seconds=result.comm_seconds,
            update_seconds=end - t_update,
            valid=result.num_valid,
            queries=result.num_queries,
        )

    def run(self) -> None:
        try:
            self._run()
        except BaseException:
            if self.logger is not None:  # store what was queued, but the loop's error is the one raised
                try:
                    self.logger.close()
                except Exception as exc:
                    log.warning("could not store the last queued metrics: %s", exc)
            raise
        else:
            if self.logger is not None:
                self.logger.close()  # the queued metrics are stored before the worker reports completion
        finally:
            if self.batches is not None:
                self.batches.close()
            # Loader processes stopped here exit cleanly; left to Ray's end of the worker, they are killed
            # and each leaves its multiprocessing folder (/tmp/pymp-*) behind.
            self.stream.close()

    def _describe_device(self) -> None:
        """Rank 0 tags the MLflow run with what actually ran (after the first step: compile is lazy)."""
        if self.logger is None:
            return
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        tags = {
            "dmltrain.device": f"{self.device} ({name})",
            "dmltrain.precision": self.precision.name,
            "dmltrain.channels_last": str(self.channels_last).lower(),
            "dmltrain.compile": compile_state(self.net),
            "dmltrain.small_conv_matmul": _small_conv_setting(self.small_convs),
            # what the workers actually run with (Ray and the environment can differ)
            "dmltrain.torch_threads": str(torch.get_num_threads()),
            "dmltrain.omp_wait_policy": _omp_wait_settings(),
            "dmltrain.malloc": _malloc_settings(),
            "dmltrain.worker_niceness": str(os.nice(0)),
            "dmltrain.loader_priority": self.stream.worker_priority,
            "dmltrain.versions": version_line(),  # the worker's stack, which may not be the driver's
            # data.mean/std/interpolation/resize_mode left unset are the backbone's: the values used
            "dmltrain.preprocessing": json.dumps(self.preprocessing.to_dict(), sort_keys=True),
        }
        for key, value in tags.items():
            self.logger.set_tag(key, value)

    def _run(self) -> None:
        cfg = self.config.train
        described = False
        if self.step == 0 and cfg.eval_at_start:
            with self.times.phase("eval"):
                evaluated = self._evaluate()
            self._log(evaluated)
        reset_peak_rss()  # train/peak_rss_mb: the training steps' peak, not the evaluation's
        # Restored from the checkpoint of a run that stopped early (a restart after it, or a relaunch under
        # run.resume=must with the same patience): it stays stopped. Every rank restored the same state.
        stopped = self.best is not None and self.best.should_stop
        if stopped and self.rank == 0:
            log.info(
                "the run stopped early at step %d (train.early_stopping_patience): nothing to train",
                self.step,
            )
        while not stopped and self.step < cfg.steps:
            if self.profiler is not None:
                self.profiler.before_step(self.step + 1)
            stats = self._train_step()
            if self.profiler is not None:
                self._upload_profile(self.profiler.after_step(self.step))
            self.times.add_step(stats)
            if not described:
                self._describe_device()
                described = True
            if math.isfinite(stats.loss):
                self.window.add(stats)
            last = self.step == cfg.steps
            log_now = last or self.step % cfg.log_every == 0
            if log_now:
                metrics = self.window.metrics() if self.window.steps else {}
                metrics.update(self._peak_memory())
                metrics.update(
                    {
                        "train/lr": self.optimizer.param_groups[0]["lr"],
                        "train/grad_norm": stats.grad_norm,
                        "train/skipped_steps": self.counters.skipped_steps,
                        "train/empty_batches": self.counters.empty_batches,
                    }
                )
                if self.scaler is not None:
                    metrics["train/grad_scale"] = float(self.scaler.get_scale())
                    metrics["train/overflow_steps"] = self.counters.overflow_steps
                if self.tn_schedule is not None:
                    metrics["train/rll_tn"] = float(self.tn_schedule.loss.tn)
                if self.rank == 0:  # rank 0's loader workers: images a sampler dropped, cut or repeated
                    counters = TrainLoader.sampler_counters(self._stream_state())
                    metrics.update({f"sampler/{name}": float(n) for name, n in counters.items()})
                self._log(metrics)
                if self.rank == 0 and self.window.steps:
                    log.info(
                        "step %d/%d loss %.4f %.1f img/s",
                        self.step,
                        cfg.steps,
                        metrics["train/loss"],
                        metrics["train/images_per_second"],
                    )
                self.window = _Window()
            evaluate_now = last or self.step % cfg.eval_every == 0
            evaluated: dict[str, float] = {}
            if evaluate_now:
                with self.times.phase("eval"):
                    evaluated = self._evaluate()  # metrics on rank 0 only
                reset_peak_rss()
            self._log(evaluated)
            stop = evaluate_now and self.best is not None and self._judge(evaluated)
            # Decided from the step alone, so every rank reaches Ray's report barrier at the same step.
            if evaluate_now or self.step % cfg.checkpoint_every == 0:
                with self.times.phase("checkpoint"):
                    self._checkpoint(evaluated)
            if log_now or stop:  # after this step's evaluation and checkpoint, so the last one has all
                self._log(self.times.metrics())
            if stop:
                break
        if self.logger is not None:
            self._finish()

    def _peak_memory(self) -> dict[str, float]:
        """The largest rank's peak host and GPU memory: the rank nearest its limit is the one to see, and
        ranks differ (rank 0 scores evaluations; loader parts differ in size). Every rank logs on the same
        steps, so the one small collective here is reached by all of them."""
        # host: the steps since the last evaluation; GPU (GB = 1e9 bytes): allocated since the run started
        gpu = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else 0.0
        peaks = all_reduce_max_(torch.tensor([peak_rss_mb(), gpu], dtype=torch.float64, device=self.device))
        metrics = {"train/peak_rss_mb": float(peaks[0])}
        if self.device.type == "cuda":
            metrics["train/gpu_peak_memory_gb"] = float(peaks[1])
        return metrics

    def _upload_profile(self, files: list[Path]) -> None:
        """Rank 0: the recorded steps' trace and operator table to MLflow (profile/), then off the disk."""
        if not files or self.logger is None:
            return
        with self.times.phase("log"):
            for path in files:
                self.logger.log_file(path, "profile")
        log.info(
            "profile of the recorded steps logged to MLflow: %s",
            ", ".join(f"profile/{p.name}" for p in files),
        )
        shutil.rmtree(files[0].parent, ignore_errors=True)

    def _log(self, metrics: dict[str, float]) -> None:
        if self.logger is not None and metrics:
            with self.times.phase("log"):
                self.logger.log_metrics(metrics, self.step)

    def _finish(self) -> None:
        """Rank 0: training curves from the full MLflow history (it survives restarts). The driver logs the
        final and best models from Ray's checkpoints once the run is over (dmltrain.service.serving)."""
        from dmltrain.plots import training_curves

        assert self.logger is not None
        names = {"train/loss": "loss", "train/lr": "lr", "train/images_per_second": "images/s"}
        histories = {label: self.logger.history(key) for key, label in names.items()}
        steps = sorted(histories["loss"])
        if steps:
            series = {label: [h.get(s, float("nan")) for s in steps] for label, h in histories.items()}
            self.logger.log_figure(training_curves(steps, series), "plots/training_curves.png")


@dataclass
class _RayContext:
    """The few Ray Train calls the loop needs, so the loop itself stays testable and readable."""

    rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # ranks on this worker's node

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def get_checkpoint(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def report(
        self,
        metrics: dict[str, float],
        directory: str | None,
        upload: str = "sync",
        name: str | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        """``ray.train.report``; ``name`` is the checkpoint's directory in storage, and ``on_stored`` runs
        once the checkpoint is completely there (before Ray's controller hears of it)."""
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(directory) if directory else None
        mode = (
            ray.train.CheckpointUploadMode.ASYNC if upload == "async" else ray.train.CheckpointUploadMode.SYNC
        )
        upload_fn = None
        if checkpoint is not None and on_stored is not None:

            def upload_fn(local: Any, dir_name: str) -> Any:
                # Ray's own copy (StorageContext is a DeveloperAPI; the image pins Ray), then the callback.
                stored = ray.train.get_context().get_storage().persist_current_checkpoint(local, dir_name)
                on_stored()
                return stored

        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=mode,
            checkpoint_upload_fn=upload_fn,
        )

    def checkpoint_at(self, uri: str) -> Any:
        import ray.train

        return ray.train.Checkpoint(uri)


def set_up_with_memory_waits(
    make: Callable[[], WorkerLoop],
    config: ExperimentConfig,
    rank: int,
    waits_s: Sequence[float] = _SETUP_MEMORY_WAITS_S,
) -> WorkerLoop:
    """``make()`` the worker's loop; errors no restart can fix become FatalRunError (dmltrain.service.errors).

    Out of GPU memory, it waits and tries again (``waits_s``): a process of the previous attempt may still
    hold the GPU for a moment after a restart. Still short after that, the same weights fail the same way on
    every restart, so the run ends with one line."""
    for attempt in range(len(waits_s) + 1):
        try:
            return make()
        except FATAL_IN_SETUP as exc:
            # A node short of shared memory is the whole story; a config error here (the driver checks them
            # all first) keeps its traceback.
            explained = isinstance(exc, SharedMemoryError)
            raise as_fatal(exc, rank, "setup", explained=explained) from exc
        except torch.cuda.OutOfMemoryError as exc:
            if attempt == len(waits_s):
                error = device_memory_error(exc, config, evaluating=False, setting_up=True)
                raise as_fatal(error, rank, "setup", explained=True) from exc
        # Out of the except block, so that the error's frames (and the half-built model) can be freed.
        log.warning("rank %d: out of GPU memory setting up; trying again in %g s", rank, waits_s[attempt])
        gc.collect()
        torch.cuda.empty_cache()
        time.sleep(waits_s[attempt])
    raise AssertionError("unreachable")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (see dmltrain.service.run.launch)."""
    import ray.train
    import ray.train.torch

    setup_logging()
    quiet_ray_reports()
    context = ray.train.get_context()
    ray_ctx = _RayContext(
        context.get_world_rank(),
        context.get_world_size(),
        ray.train.torch.get_device(),
        context.get_local_world_size(),
    )
    config = ExperimentConfig.model_validate(loop_config["config"])
    # Errors no restart can fix end the run at once (dmltrain.service.errors); anything else, e.g. a peer
    # lost mid-collective, propagates as is and Ray restarts the group from the last checkpoint.
    if not loop_config.get("full_tracebacks", False):
        shorten_explained_errors(WORKER_LOGGERS)
    loop = set_up_with_memory_waits(
        lambda: WorkerLoop(config, loop_config["mlflow_run_id"], loop_config["tracking_uri"], ray_ctx),
        config,
        ray_ctx.rank,
    )
    try:
        loop.run()
    except (*FATAL_IN_LOOP, NonFiniteLossError) as exc:
        # The message names the sample and shard, or the step that diverged: the traceback adds nothing.
        raise as_fatal(exc, ray_ctx.rank, loop.where(), explained=True) from exc
    except torch.cuda.OutOfMemoryError as exc:
        error = device_memory_error(exc, config, loop.evaluating)
        raise as_fatal(error, ray_ctx.rank, loop.where(), explained=True) from exc
