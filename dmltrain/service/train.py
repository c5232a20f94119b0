"""The per-worker training loop that Ray Train runs on every worker (``train_loop_per_worker``).

Each worker streams its own shards, the engine turns the local batches into one exact global-batch step,
rank 0 evaluates and talks to MLflow, and every rank reports to Ray at checkpoints so a failed worker
group restarts from the last one. Nothing here depends on Ray beyond the small ``_RayContext`` shim.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dmltrain.data import SamplerSpec, TrainLoader, load_dataset_info
from dmltrain.distributed import all_gather_objects, broadcast_object
from dmltrain.engine import default_autocast_dtype, global_batch_step
from dmltrain.models import EmbeddingNet, build_model, normalize_images
from dmltrain.service.best import SCORE_KEY, BestTracker, resolve_best_metric, worst_score
from dmltrain.service.builders import (
    build_loss,
    build_optimizer,
    build_scheduler,
    build_tn_schedule,
    load_optimizer_state,
)
from dmltrain.service.checkpoints import (
    TrainingState,
    load_state,
    load_stream_state,
    save_state,
    save_stream_state,
)
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.distributed_eval import evaluate
from dmltrain.service.errors import FATAL_IN_LOOP, FATAL_IN_SETUP, as_fatal
from dmltrain.service.tracking import CHECKPOINT_STEP_TAG, RunLogger

log = logging.getLogger("dmltrain.service.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps produced a NaN/inf loss or gradient: the run is diverging."""


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
        }


@dataclass
class _Counters:
    """Run totals that survive a restart (checkpointed), plus the current run of skipped steps."""

    skipped_steps: int = 0
    empty_batches: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, float]:
        return {"skipped_steps": self.skipped_steps, "empty_batches": self.empty_batches}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.empty_batches = int(state.get("empty_batches", 0))


class _PhaseTimes:
    """Where this launch's wall time went on this rank, by phase (cumulative seconds).

    Logged by rank 0 as ``time/<phase>_seconds`` with every training log line, so the split between
    stepping, data, collectives, logging, checkpoints and evaluation can be read back from MLflow
    (bench/service.py does). ``comm`` is part of ``engine``; ``step`` holds data, engine and update plus
    the step's own bookkeeping; ``loop`` is the wall time since the loop started.
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


def _unwrap(model: nn.Module) -> EmbeddingNet:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # type: ignore[return-value]


def _grad_norm(parameters: list[nn.Parameter], clip: float | None) -> float:
    """Global gradient norm (clipping to ``clip`` if set); inf/NaN when a gradient is not finite."""
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if clip is not None:
        return float(torch.nn.utils.clip_grad_norm_(grads, clip, error_if_nonfinite=False))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


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
        model = build_model(config.model.backbone, config.model.embedding_dim, config.model.weights)
        self.model = ray_ctx.prepare_model(model)
        self.net = _unwrap(self.model)
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.net, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, config.train.steps)
        self.loss_fn = build_loss(config.loss).to(self.device)
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
            image_size=config.data.image_size,
            crop_scale=config.data.crop_scale,
            info=self.info,
        )
        self.autocast = (
            default_autocast_dtype(self.device)
            if config.train.precision == "auto"
            else (torch.bfloat16 if config.train.precision == "bf16" else None)
        )
        self.counters = _Counters()
        best_metric = resolve_best_metric(
            config.train.best_metric, [e.name for e in self.info.evaluations], config.eval.ks
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
        self.times = _PhaseTimes()
        # Metrics go to MLflow from a background thread: a step never waits for the tracking store.
        self.logger = RunLogger(tracking_uri, run_id, asynchronous=True) if self.rank == 0 else None
        self._restore()

    # ------------------------------------------------------------------ resume / checkpoint
    def _restore(self) -> None:
        """Continue from Ray's latest checkpoint (after a failure or a relaunch), if there is one."""
        checkpoint = self.ray.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            state = load_state(directory)
            stream_state = load_stream_state(directory, self.rank)
        self.net.load_state_dict(state.model)
        load_optimizer_state(self.optimizer, state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.step = state.step
        self.counters.load_state_dict(state.counters)
        if self.tn_schedule is not None:
            self.tn_schedule.load_state_dict(state.extra["tn_schedule"])
        if self.best is not None:
            self.best.load_state_dict(state.extra.get("best"))
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

        The report carries ``checkpoint_score`` (the best metric if this step was evaluated, else the worst
        value) for Ray's best-checkpoint bookkeeping. With asynchronous upload Ray copies the directory to
        storage in the background and then deletes it, so MLflow's optional copy is taken first."""
        streams = all_gather_objects(self.stream.state_dict())
        upload = self.config.run.checkpoint_upload
        report = {"step": self.step, **metrics}
        if self.best is not None:
            report[SCORE_KEY] = float(metrics.get(self.best.metric, worst_score(self.best.mode)))
        if self.rank != 0:
            self.ray.report(report, None, upload)
            return
        directory = tempfile.mkdtemp(prefix="dmltrain-ckpt-")
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
                        "tn_schedule": self.tn_schedule.state_dict() if self.tn_schedule else None,
                        "best": self.best.state_dict() if self.best else None,
                    },
                ),
            )
            if self.logger is not None and self.config.mlflow.log_checkpoints:
                self.logger.log_directory(directory, "checkpoints/latest")
            self.ray.report(report, directory, upload)
            if self.logger is not None:  # the Ray checkpoint's step, whether or not MLflow has a copy
                self.logger.set_tag(CHECKPOINT_STEP_TAG, str(self.step))
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
                    self.logger.set_tag("dmltrain.early_stopped_at_step", str(self.step))
        return bool(broadcast_object(stop))

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> dict[str, float]:
        return evaluate(
            self.net,
            self.config,
            self.info,
            self.device,
            self.rank,
            self.world,
            self.logger,
            self.step,
            self.autocast,
        )

    # ------------------------------------------------------------------ training
    def _train_step(self) -> _StepStats:
        cfg = self.config
        t0 = time.perf_counter()
        images, labels, _categories = self.stream.next_batch()
        data_seconds = time.perf_counter() - t0
        self.model.train()  # the engine keeps BatchNorm frozen during the step when model.freeze_bn is set
        self.optimizer.zero_grad(set_to_none=True)
        # Training-mode BatchNorm updates running statistics in the forward pass: keep a copy so a skipped
        # (non-finite) step leaves the model exactly as it was.
        buffers = None if cfg.model.freeze_bn else [b.detach().clone() for b in self.net.buffers()]
        result = global_batch_step(
            self.model,
            images,
            labels,
            self.loss_fn,
            cfg.train.chunk_size,
            preprocess=normalize_images,
            freeze_bn=cfg.model.freeze_bn,
            autocast_dtype=self.autocast,
            skip_nonfinite=True,
        )
        t_update = time.perf_counter()
        loss = float(result.loss)
        norm = _grad_norm(self.params, cfg.optim.grad_clip)
        if math.isfinite(loss) and math.isfinite(norm):
            self.optimizer.step()
            self.counters.consecutive_skips = 0
        else:
            # Identical decision on every rank: the loss and the synced gradients are global.
            self.optimizer.zero_grad(set_to_none=True)
            if buffers is not None:
                with torch.no_grad():
                    for live, saved in zip(self.net.buffers(), buffers, strict=True):
                        live.copy_(saved)
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
        if self.logger is not None:
            self.logger.close()  # the queued metrics are stored before the worker reports completion

    def _run(self) -> None:
        cfg = self.config.train
        if self.logger is not None:  # what the workers actually run with (Ray and the env can differ)
            self.logger.set_tag("dmltrain.torch_threads", str(torch.get_num_threads()))
            self.logger.set_tag("dmltrain.omp_wait_policy", os.environ.get("OMP_WAIT_POLICY", "unset"))
        if self.step == 0 and cfg.eval_at_start:
            with self.times.phase("eval"):
                evaluated = self._evaluate()
            self._log(evaluated)
        window = _Window()
        while self.step < cfg.steps:
            stats = self._train_step()
            self.times.add_step(stats)
            if math.isfinite(stats.loss):
                window.add(stats)
            last = self.step == cfg.steps
            log_now = last or self.step % cfg.log_every == 0
            if log_now:
                metrics = window.metrics() if window.steps else {}
                metrics.update(
                    {
                        "train/lr": self.optimizer.param_groups[0]["lr"],
                        "train/grad_norm": stats.grad_norm,
                        "train/skipped_steps": self.counters.skipped_steps,
                        "train/empty_batches": self.counters.empty_batches,
                    }
                )
                if self.tn_schedule is not None:
                    metrics["train/rll_tn"] = float(self.loss_fn.tn)
                self._log(metrics)
                if self.rank == 0 and window.steps:
                    log.info(
                        "step %d/%d loss %.4f %.1f img/s",
                        self.step,
                        cfg.steps,
                        metrics["train/loss"],
                        metrics["train/images_per_second"],
                    )
                window = _Window()
            evaluate_now = last or self.step % cfg.eval_every == 0
            evaluated: dict[str, float] = {}
            if evaluate_now:
                with self.times.phase("eval"):
                    evaluated = self._evaluate()  # metrics on rank 0 only
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

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def get_checkpoint(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def report(self, metrics: dict[str, float], directory: str | None, upload: str = "sync") -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(directory) if directory else None
        mode = (
            ray.train.CheckpointUploadMode.ASYNC if upload == "async" else ray.train.CheckpointUploadMode.SYNC
        )
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=mode)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Entry point Ray Train runs on every worker (see dmltrain.service.run.launch)."""
    import ray.train
    import ray.train.torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    context = ray.train.get_context()
    ray_ctx = _RayContext(context.get_world_rank(), context.get_world_size(), ray.train.torch.get_device())
    config = ExperimentConfig.model_validate(loop_config["config"])
    # Errors no restart can fix end the run at once (dmltrain.service.errors); anything else, e.g. a peer
    # lost mid-collective, propagates as is and Ray restarts the group from the last checkpoint.
    try:
        loop = WorkerLoop(config, loop_config["mlflow_run_id"], loop_config["tracking_uri"], ray_ctx)
    except FATAL_IN_SETUP as exc:
        raise as_fatal(exc, ray_ctx.rank, "setup") from exc
    try:
        loop.run()
    except (*FATAL_IN_LOOP, NonFiniteLossError) as exc:
        raise as_fatal(exc, ray_ctx.rank, f"step {loop.step + 1}") from exc
