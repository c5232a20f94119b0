"""Validate, prepare, and run one experiment on Ray (``python -m dmltrain.run``; its command line is
:mod:`dmltrain.service.entry`).

The driver does everything that must happen once and before any worker starts, so that a mistake costs
seconds and one line instead of a worker group failing (and being retried) on every rank:

1. the config and the model (dmltrain.service.preflight): a typo fails before Ray is contacted;
2. the cluster (dmltrain.service.cluster): joins the cluster in RAY_ADDRESS (which ``ray job submit`` sets)
   and, when the run spans several machines, refuses a file-based tracking store and paths other nodes
   cannot see;
3. the data: relative paths are made absolute, the embedded set is built on first use, ``dataset.json``
   and the sampler's plan for every rank are checked, shared paths are probed on the other nodes;
4. the relaunch policy (dmltrain.service.resume, ``run.resume``) against the MLflow run of the same
   ``run.name`` and ``run.storage_path``;
5. only then the MLflow run is created or continued and ``ray.train.torch.TorchTrainer`` runs; its status
   follows the driver (FINISHED, FAILED, KILLED on SIGTERM/SIGINT).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.data import DatasetInfo
from dmltrain.data.plan import TrainPlan
from dmltrain.service.checkpoints import count_ray_checkpoints
from dmltrain.service.cluster import (
    ClusterView,
    check_shared_paths,
    decide_topology,
    joins_existing_cluster,
    local_capacity_problem,
    placement_shortfall,
    resolve_use_gpu,
    storage_problems,
)
from dmltrain.service.config import (
    KEEP_FREED_MEMORY_ENV,
    LOADER_PRIORITY_ENV,
    ConfigError,
    ExperimentConfig,
    flatten,
    recall_ks,
    with_recall_ks,
)
from dmltrain.service.errors import FatalRunError, fatal_cause
from dmltrain.service.logs import full_tracebacks, print_problems
from dmltrain.service.preflight import (
    check_config,
    check_data,
    check_outputs,
    evaluated_train_split_note,
    expected_decode,
    load_data,
    shared_memory_config_problem,
    short_pieces_note,
)
from dmltrain.service.ray_priority import keep_ray_in_background
from dmltrain.service.resume import plan_launch
from dmltrain.service.tracking import (
    DriverHeartbeat,
    Segment,
    continue_run,
    create_run,
    experiment_artifact_root,
    find_run,
    metric_name,
    resolve_tracking_uri,
    run_key,
    set_run_status,
    set_run_tag,
    wait_out_a_silent_driver,
)

log = logging.getLogger("dmltrain.service.run")

RAY_PRIORITY_TAG = "dmltrain.ray_priority"  # what scaling.ray_priority did (the driver sets it)

# Loopback-only, no telemetry: sensible on a laptop and harmless on a cluster (setdefault keeps user values).
_RAY_ENV_DEFAULTS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0"}


@dataclass(frozen=True)
class RunOutcome:
    """What a finished launch reports back to the caller (CLI, tests); metrics under their MLflow names."""

    mlflow_run_id: str
    tracking_uri: str
    resumed: bool
    checkpoint_path: str | None
    metrics: dict[str, float]
    models: dict[str, str] = field(default_factory=dict)  # MLflow artifact name -> model URI
    registered: str | None = None  # models:/<name>/<version> when mlflow.register_as is set


def resolve_paths(config: ExperimentConfig, base: Path | None = None) -> ExperimentConfig:
    """Make local relative paths absolute against the launch directory; URLs are left untouched."""
    from dmltrain.data.urls import is_local, local_path

    base = base or Path.cwd()
    updates: dict[str, dict[str, str]] = {}
    for section, key, value in (
        ("data", "root", config.data.root),
        ("run", "storage_path", config.run.storage_path),
    ):
        # ~ as a shell would expand it: the storage checks probed the home folder while Ray wrote to ./~
        if is_local(value) and not Path(local_path(value)).is_absolute():
            updates[section] = {key: str((base / Path(local_path(value)).expanduser()).resolve())}
    weights = config.model.weights
    if weights and (base / weights).is_file() and not Path(weights).is_absolute():
        updates["model"] = {"weights": str((base / weights).resolve())}
    if not updates:
        return config
    data = config.model_dump()
    for section, values in updates.items():
        data[section].update(values)
    return ExperimentConfig.model_validate(data)


# scaling.omp_wait_policy as environment. "brief": GNU OpenMP spins GOMP_SPINCOUNT times (about 100,000 a
# millisecond) before it sleeps. In GNU OpenMP the count overrides OMP_WAIT_POLICY, so every policy sets it:
# an inherited count (Ray's workers inherit the environment its local processes start in) cannot undo it.
# passive and active give the counts GNU OpenMP derives from the policy itself (0; 3e10, about 5 minutes).
OMP_WAIT_ENV: dict[str | None, dict[str, str]] = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
    "brief": {"GOMP_SPINCOUNT": "10000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000000000"},
}
OMP_WAIT_KEYS = frozenset(key for env in OMP_WAIT_ENV.values() for key in env)


def _single_cpu_node(multi_node: bool, use_gpu: bool) -> bool:
    """The case the `auto` priority settings were measured in (bench/service.py): CPU training, one node."""
    return not (multi_node or use_gpu)


def resolve_ray_priority(config: ExperimentConfig, multi_node: bool, use_gpu: bool) -> str:
    """scaling.ray_priority as the driver applies it: idle or normal."""
    setting = config.scaling.ray_priority
    if setting == "auto":
        return "idle" if _single_cpu_node(multi_node, use_gpu) else "normal"
    return setting


@contextlib.contextmanager
def _ray_priority(priority: str, tracking_uri: str, run_id: str) -> Iterator[None]:
    """Ray's bookkeeping processes under SCHED_IDLE while the run trains (dmltrain.service.ray_priority);
    the MLflow tag ``dmltrain.ray_priority`` says what was done, whatever the run's outcome."""
    done = None
    try:
        if priority == "idle":
            import ray

            with keep_ray_in_background(ray.get_runtime_context().get_session_name()) as done:
                yield
        else:
            yield
    finally:
        value = priority
        if done is not None:
            refused = f", {len(done.refused)} refused" if done.refused else ""
            value = f"idle ({len(done.processes)} processes{refused})"
        try:
            set_run_tag(tracking_uri, run_id, RAY_PRIORITY_TAG, value)
        except Exception as exc:  # never hide the run's own outcome behind the tracking store's
            log.warning("could not tag MLflow run %s with %s: %s", run_id, RAY_PRIORITY_TAG, exc)


COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"


def worker_env_vars(
    config: ExperimentConfig, multi_node: bool = False, use_gpu: bool = False
) -> dict[str, str]:
    """Environment the training workers start with. OpenMP reads its wait settings and glibc its malloc
    settings once, when the process starts, and Ray's core worker applies RAY_worker_niceness once, when it
    starts, so all have to be in the worker's environment from the start (Ray's worker runtime env)."""
    env = dict(OMP_WAIT_ENV.get(config.scaling.omp_wait_policy, {}))
    keep_freed = config.scaling.keep_freed_memory
    if keep_freed is True or (keep_freed == "auto" and not use_gpu):
        env.update(KEEP_FREED_MEMORY_ENV)
    # The measured case: CPU training beside its loaders on one node. SCHED_IDLE loaders pay only with the
    # workers at niceness 0 (bench/service.py); elsewhere both stay as Ray and the OS have them (with idle
    # loaders on the 2-core multi-node test bed, two of four CI runs had a run outpace its node-loss test).
    single_cpu_node = _single_cpu_node(multi_node, use_gpu)
    niceness = config.scaling.worker_niceness
    if niceness == "auto":
        niceness = 0 if single_cpu_node else None
    if niceness is not None:
        env["RAY_worker_niceness"] = str(niceness)
    priority = config.data.loader_priority
    if priority == "auto":
        priority = "idle" if single_cpu_node else "normal"
    env[LOADER_PRIORITY_ENV] = priority
    compiles = config.train.compile is True or (config.train.compile == "auto" and use_gpu)
    if compiles and COMPILE_THREADS_ENV not in os.environ:
        # torch.compile starts min(32, cores) compiler processes in every worker (each imports torch); eight
        # GPU workers on a node would start eight times the node's cores. Unmeasured on a multi-GPU node.
        env[COMPILE_THREADS_ENV] = str(max(1, int(config.scaling.cpus_per_worker)))
    return env


def prepare_data(config: ExperimentConfig) -> tuple[DatasetInfo, TrainPlan]:
    """Build the embedded data set if asked, then check the shards' metadata before any worker starts;
    returns it with the sampler's batch plan."""
    info = load_data(config)
    return info, check_data(config, info)


def batchnorm_note(config: ExperimentConfig) -> str | None:
    """One line for the start of a run whose BatchNorm breaks the exact global-batch gradient, else None.

    With ``model.freeze_bn: false`` training-mode BatchNorm normalises each forward chunk with that chunk's
    statistics; that is the global batch's only when it is embedded in one chunk on one worker.
    """
    chunk = min(config.train.chunk_size, config.local_batch_size)
    if config.model.freeze_bn or (config.scaling.num_workers == 1 and chunk == config.local_batch_size):
        return None
    return (
        f"model.freeze_bn=false: BatchNorm normalises chunks of <= {chunk} images on each of "
        f"{config.scaling.num_workers} worker(s) with their own statistics, so a step is not the exact "
        f"gradient of the global batch of {config.train.global_batch_size} (it depends on "
        "train.chunk_size and scaling.num_workers); set model.freeze_bn=true for the exact global-batch step"
    )


def connect_ray() -> None:
    """Join the cluster in RAY_ADDRESS (or the one ``ray job submit`` runs in), else start a local one."""
    import ray

    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not ray.is_initialized():
        # Joins the cluster in RAY_ADDRESS (or the one `ray job submit` runs in); else starts a local one.
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)


def _cluster_view(connect: bool) -> ClusterView:
    """The alive nodes; without ``connect`` (and no Ray yet) the local node Ray is about to start."""
    import ray

    if connect:
        connect_ray()
    if not ray.is_initialized():
        return ClusterView((), attached=False)
    return ClusterView.from_ray_nodes(
        ray.nodes(), joins_existing_cluster(), ray.get_runtime_context().get_node_id()
    )


def local_node_cpus() -> int:
    """The CPUs Ray gives the local node it starts: the machine's count, lowered by a container's CPU quota
    or cpuset (cgroups), as Ray counts them. Counting them differently (the affinity mask, or the host's
    CPUs inside a container limited to fewer) would let a config through whose workers Ray then waits for
    forever, or refuse one Ray can place. Ray's count is not public API, hence the fallback."""
    try:
        from ray._private.utils import get_num_cpus

        return max(1, int(get_num_cpus(override_docker_cpu_warning=True)))
    except Exception:  # a Ray without this helper: the machine's count, as Ray counts outside containers
        return os.cpu_count() or 1


def local_node_gpus() -> int:
    """The GPUs the local Ray node will have: those CUDA shows this process (CUDA_VISIBLE_DEVICES applies to
    both); Ray counts them through the driver, and torch is what the workers train with."""
    import torch

    return torch.cuda.device_count()


def check_cluster(config: ExperimentConfig, tracking_uri: str, tracking_is_default: bool) -> ClusterView:
    """Connect to an existing cluster (or not yet, for a local one) and refuse settings that cannot work
    on it: one line per setting (dmltrain.service.cluster). ``config`` is as written (paths unresolved)."""
    import ray

    view = _cluster_view(connect=joins_existing_cluster() or ray.is_initialized())
    topology = decide_topology(config.scaling.topology, view)
    problems = storage_problems(config, tracking_uri, tracking_is_default, topology)
    capacity = local_capacity_problem(config, view, local_node_cpus(), local_node_gpus())
    if capacity and not topology.multi_node:
        problems.append(capacity)
    if problems:
        raise ConfigError("\n".join(problems))
    shortfall = placement_shortfall(config, view)
    if shortfall:
        log.warning(shortfall)
    log.info("Ray cluster: %s (%s)", "multi-node" if topology.multi_node else "single node", topology.reason)
    return view


class _Terminated(BaseException):
    """SIGTERM (``ray job stop``, Kubernetes) turned into an exception so the run is marked KILLED."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _fit(trainer: Any) -> Any:
    """``trainer.fit()`` in a helper thread while this thread waits in short joins.

    The main thread blocked inside Ray's ``ray.get`` does not run Python signal handlers, so SIGTERM from
    ``ray job stop`` or Kubernetes would go unnoticed; waiting in ``join(timeout)`` lets the handler run.
    (Ray Train only installs its own SIGINT handler on the main thread, so Ctrl-C lands here as well.)
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=target, name="dmltrain-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@contextlib.contextmanager
def _run_status(tracking_uri: str, run_id: str) -> Iterator[None]:
    """MLflow status follows the driver: KILLED on SIGTERM/SIGINT, FAILED on an error; the caller sets
    FINISHED. A relaunch sets the run RUNNING again."""

    def on_sigterm(signum: int, _frame: object) -> None:
        raise _Terminated(signum)

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except (KeyboardInterrupt, _Terminated):
        _set_status_quietly(tracking_uri, run_id, "KILLED")
        raise
    except BaseException:
        _set_status_quietly(tracking_uri, run_id, "FAILED")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _set_status_quietly(tracking_uri: str, run_id: str, status: str) -> None:
    try:
        set_run_status(tracking_uri, run_id, status)
    except Exception as exc:  # the original error matters more than an unreachable tracking server
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, exc)


def _finished_outcome(tracking_uri: str, run_id: str) -> RunOutcome:
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(tracking_uri).get_run(run_id).data.metrics
    return RunOutcome(run_id, tracking_uri, True, None, {k: float(v) for k, v in metrics.items()})


def launch(
    config: ExperimentConfig,
    *,
    tags: Mapping[str, str] | None = None,
    callbacks: Sequence[Any] = (),
) -> RunOutcome:
    """Run (or resume) one experiment to completion on the Ray cluster; returns the outcome.

    Order matters: everything that can be checked without workers is checked before any worker starts
    (config and model, cluster storage rules, data plan, shared paths, resume policy), and the MLflow run
    is only created or continued once the launch is known to be valid. ``tags`` go on a new MLflow run (a
    sweep makes its trials nested child runs this way); ``callbacks`` are extra Ray Train callbacks (a
    sweep's ``TuneReportCallback``).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dmltrain.service.best import SCORE_KEY, resolve_best_metric
    from dmltrain.service.callbacks import StopOnFatalError
    from dmltrain.service.serving.publish import publish_run_models
    from dmltrain.service.train import train_loop_per_worker

    check_config(config)
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    tracking_is_default = not (config.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    view = check_cluster(config, tracking_uri, tracking_is_default)
    topology = decide_topology(config.scaling.topology, view)
    config = resolve_paths(config)
    check_outputs(config, tracking_uri)
    info, batch_plan = prepare_data(config)
    config = with_recall_ks(config, info.recall_ks)  # eval.ks unset: the data set's, recorded as such
    if topology.multi_node:
        artifacts = experiment_artifact_root(tracking_uri, config.mlflow.experiment, config.run.storage_path)
        problems = check_shared_paths(config, view, artifacts)
        if problems:
            raise ConfigError("\n".join(problems))
    else:  # every rank on this node; on a multi-node cluster each worker checks its own (WorkerLoop)
        problem = shared_memory_config_problem(
            config, info, expected_decode(config), config.scaling.num_workers
        )
        if problem:
            raise ConfigError(problem)

    notes = (
        batchnorm_note(config),
        short_pieces_note(config, batch_plan),
        evaluated_train_split_note(config, info),
    )
    for note in notes:
        if note:
            log.warning(note)

    key = run_key(config.run.storage_path, config.run.name)
    existing = wait_out_a_silent_driver(
        tracking_uri, config.mlflow.experiment, key, find_run(tracking_uri, config.mlflow.experiment, key)
    )
    checkpoints = count_ray_checkpoints(config.run.storage_path, config.run.name)
    plan = plan_launch(config, existing, checkpoints, tracking_uri, info.fingerprint)
    if plan.message:
        log.info("%s", plan.message)
    if plan.action == "done":
        assert existing is not None
        return _finished_outcome(tracking_uri, existing.run_id)

    connect_ray()
    import ray

    use_gpu, warning = resolve_use_gpu(
        config.scaling.use_gpu, ray.cluster_resources().get("GPU", 0), topology
    )
    if warning:
        log.warning("!!! %s !!!", warning)
    if config.data.decode == "gpu" and not use_gpu:
        raise ConfigError(
            "data.decode=gpu decodes on the training workers' GPUs, but scaling.use_gpu=auto found no GPU "
            "in the cluster: set data.decode=auto or cpu"
        )
    config_dump = config.model_dump(mode="json")
    keep_tracebacks = full_tracebacks()  # the driver's environment decides, for workers and controller
    if existing is None:
        run_id = create_run(
            tracking_uri,
            config.mlflow.experiment,
            key,
            config.run.name,
            flatten(config),
            Segment(1, 0, config.run.resume, {}, config_dump, info.fingerprint),
            tags=tags,
            storage_path=config.run.storage_path,
        )
    else:
        run_id = existing.run_id
        segment = Segment(
            existing.segments + 1,
            existing.checkpoint_step or 0,
            config.run.resume,
            plan.changed,
            config_dump,
            info.fingerprint,
        )
        continue_run(tracking_uri, run_id, segment)
    log.info("MLflow run %s (%s) at %s", run_id, "resumed" if existing else "new", tracking_uri)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config_dump,
            "mlflow_run_id": run_id,
            "tracking_uri": tracking_uri,
            "full_tracebacks": keep_tracebacks,
        },
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=config.scaling.num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": config.scaling.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=config.run.storage_path,
            # Ray keeps the keep_checkpoints best by the reported score, plus always the latest.
            checkpoint_config=CheckpointConfig(
                num_to_keep=config.run.keep_checkpoints,
                checkpoint_score_attribute=SCORE_KEY if config.train.best_metric else None,
                checkpoint_score_order=config.train.best_mode,
            ),
            failure_config=FailureConfig(max_failures=config.run.max_failures),
            callbacks=[StopOnFatalError(keep_tracebacks), *callbacks],
            worker_runtime_env={"env_vars": worker_env_vars(config, topology.multi_node, use_gpu)},
        ),
    )
    ray_priority = resolve_ray_priority(config, topology.multi_node, use_gpu)
    with _run_status(tracking_uri, run_id), DriverHeartbeat(tracking_uri, run_id):
        try:
            with _ray_priority(ray_priority, tracking_uri, run_id):
                result = _fit(trainer)
        except Exception as error:
            fatal = fatal_cause(error)
            if fatal is not None:  # a config or data error a restart cannot fix: not retried, one line
                raise fatal from None
            raise
        if result.error is not None:
            raise result.error
        best_metric = resolve_best_metric(
            config.train.best_metric, [e.name for e in info.evaluations], recall_ks(config, info.recall_ks)
        )
        published = publish_run_models(result, config, tracking_uri, run_id, best_metric)
        _remove_unregistered_checkpoints(result, config, published)
    set_run_status(tracking_uri, run_id, "FINISHED")
    metrics = {
        metric_name(k): float(v) for k, v in (result.metrics or {}).items() if isinstance(v, int | float)
    }
    checkpoint = result.checkpoint.path if result.checkpoint else None
    models = {name: uri for name, (uri, _step) in published.models.items()}
    return RunOutcome(
        run_id, tracking_uri, existing is not None, checkpoint, metrics, models, published.registered
    )


def _remove_unregistered_checkpoints(result: Any, config: ExperimentConfig, published: Any) -> None:
    """Keep what Ray keeps (its best and latest) and the checkpoints of the published models; remove the
    rest, which Ray never registered (stored while a driver was gone) and so would never delete."""
    from dmltrain.service.checkpoints import checkpoint_dir_step, remove_checkpoints_except

    paths = [str(c.path) for c, _ in result.best_checkpoints or []]
    if result.checkpoint is not None:
        paths.append(str(result.checkpoint.path))
    keep = {step for step in map(checkpoint_dir_step, paths) if step is not None}
    keep |= {step for _uri, step in published.models.values()}
    if not keep:  # nothing known to keep: nothing is removed on a guess
        return
    removed = remove_checkpoints_except(config.run.storage_path, config.run.name, keep)
    if removed:
        log.info(
            "removed checkpoints Ray never registered (stored while a driver was gone): steps %s", removed
        )


def run_and_report(config: ExperimentConfig) -> int:
    """Launch a validated config and report as the command line does; returns the exit status
    (``dmltrain.service.entry`` reads and validates the config before importing this module)."""
    try:
        outcome = launch(config)
    except (ConfigError, FatalRunError) as error:
        print_problems(error)
        return 2
    except _Terminated as stop:
        print(f"stopped: {stop}; the MLflow run is marked KILLED and a relaunch resumes it", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        print(
            "stopped: interrupted; the MLflow run is marked KILLED and a relaunch resumes it", file=sys.stderr
        )
        return 130
    summary = ", ".join(f"{k}={v:.4f}" for k, v in sorted(outcome.metrics.items()) if k.startswith("eval/"))
    print(f"run finished: MLflow run {outcome.mlflow_run_id} in {outcome.tracking_uri}; {summary}")
    for name in outcome.models:
        print(f"  {name}: runs:/{outcome.mlflow_run_id}/{name}")
    if outcome.registered:
        print(f"  registered: {outcome.registered}")
    return 0
