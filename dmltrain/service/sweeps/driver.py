"""``dmltrain sweep SWEEP.yaml``: a grid of experiments as one Ray Tune run with one MLflow parent run.

The sweep driver does once what every trial's driver would otherwise repeat, and everything before Ray
starts that can fail on a typo:

1. every trial's config and model (one line naming the trial and the key);
2. the cluster and its storage rules (as ``python -m dmltrain.run``), decided once for all trials;
3. the data: built once per ``data.root`` if the config asks, each trial's batch plan checked;
4. the MLflow parent run (found again by the sweep's name and storage path, so a relaunch continues it and
   the finished trials, resumed by their own ``run.name``, are not trained again);
5. the baselines (raw pixels), then the trials: ``ray.tune.Tuner`` runs
   :func:`dmltrain.service.sweeps.trial.run_trial` once per trial, each a full service launch whose Ray Train
   workers request their own resources; the trial itself holds no CPU (``trial_resources``), and at most as
   many trials run at once as the cluster's CPUs (and GPUs) hold (one on a 2-core machine), and on one
   node as many as its /dev/shm holds;
6. the summary (table, JSON, comparison plots) on the parent run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from dmltrain.data.shared_memory import amount, shared_memory_problem, shared_memory_size
from dmltrain.service.cluster import (
    check_shared_paths,
    decide_topology,
    local_capacity_problem,
    storage_problems,
)
from dmltrain.service.config import ConfigError, ExperimentConfig
from dmltrain.service.logs import drop_notice
from dmltrain.service.preflight import (
    check_config,
    check_data,
    check_outputs,
    expected_decode,
    load_data,
    shared_memory_config_need,
)
from dmltrain.service.run import check_cluster, connect_ray, local_node_cpus, local_node_gpus, resolve_paths
from dmltrain.service.sweeps.spec import Sweep, Trial
from dmltrain.service.sweeps.summary import TrialResult, collect, log_summary, order, summary_markdown
from dmltrain.service.sweeps.trial import BASELINE_TAG, SWEEP_KEY_TAG, SWEEP_TAG, child_tags, run_trial
from dmltrain.service.tracking import (
    RunLogger,
    ensure_experiment,
    experiment_artifact_root,
    redact_credentials,
    resolve_tracking_uri,
    set_run_status,
)

log = logging.getLogger("dmltrain.service.sweeps")

PIXELS_LABEL = "raw pixels"


@dataclass(frozen=True)
class SweepOutcome:
    parent_run_id: str
    tracking_uri: str
    results: list[TrialResult]  # baselines first, then trials in the sweep file's order
    failed: dict[str, str]  # trial label -> error
    unfinished: dict[str, str]  # trial label -> MLflow status, for trials a stopped sweep did not finish
    summary: str  # the markdown table logged as summary.md


@dataclass(frozen=True)
class CheckedSweep:
    trials: list[Trial]  # with resolved paths, the tracking URI and the topology every trial gets
    tracking_uri: str
    setting: str  # "single-node" or "multi-node"
    view: Any  # the cluster as check_cluster saw it
    shared_memory: dict[str, int]  # single-node: trial label -> what its ranks keep in /dev/shm at most


def _check_trials(sweep: Sweep) -> CheckedSweep:
    """Config, cluster and data checks of every trial, and on a single node its shared memory (each trial
    alone must fit /dev/shm; how many fit together bounds the concurrency, `concurrent_trials`)."""
    trials = list(sweep.trials)
    if not trials:
        raise ConfigError(f"sweep {sweep.spec.name}: no trials")
    uris = {t.config.mlflow.tracking_uri for t in trials}
    if len(uris) > 1:
        raise ConfigError(
            f"sweep {sweep.spec.name}: trials must share mlflow.tracking_uri, got {sorted(map(str, uris))}"
        )
    for trial in trials:
        try:
            check_config(trial.config)
        except ConfigError as error:
            raise ConfigError(f"sweep {sweep.spec.name}, trial {trial.label!r}: {error}") from None
    tracking_uri = resolve_tracking_uri(trials[0].config.mlflow.tracking_uri)
    is_default = not (trials[0].config.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
    view = check_cluster(trials[0].config, tracking_uri, is_default)
    driver_cpus = sweep.spec.trial_resources.get("CPU", sweep.spec.trial_resources.get("cpu", 0.0))
    for trial in trials:
        # Each trial alone must fit a cluster that cannot grow, its driver's trial_resources included: a
        # trial's own launch refuses it too, but only after Ray, the baselines and the trials before it ran,
        # and without the CPUs its Tune trial holds.
        topology = decide_topology(trial.config.scaling.topology, view)
        problems = storage_problems(trial.config, tracking_uri, is_default, topology)
        capacity = local_capacity_problem(
            trial.config, view, local_node_cpus(), local_node_gpus(), driver_cpus=driver_cpus
        )
        if capacity and not topology.multi_node:
            problems.append(capacity)
        if problems:
            raise ConfigError(
                "\n".join(f"sweep {sweep.spec.name}, trial {trial.label!r}: {p}" for p in problems)
            )
    topology = decide_topology(trials[0].config.scaling.topology, view)
    setting = "multi-node" if topology.multi_node else "single-node"
    resolved, infos, shared = [], {}, {}
    for trial in trials:
        config = resolve_paths(trial.config)
        key = (config.data.root, config.data.prepare)
        try:
            if not resolved:  # the trials share the tracking store and write under one storage path
                check_outputs(config, tracking_uri)
            if key not in infos:
                infos[key] = load_data(config)  # builds the embedded set once, before any trial runs
            check_data(config, infos[key])
            if topology.multi_node:
                artifacts = experiment_artifact_root(
                    tracking_uri, config.mlflow.experiment, config.run.storage_path
                )
                problems = check_shared_paths(config, view, artifacts)
                if problems:
                    raise ConfigError("\n".join(problems))
            else:  # every rank of every trial on this node (each trial's launch checks itself again)
                need, what = shared_memory_config_need(
                    config, infos[key], expected_decode(config), config.scaling.num_workers
                )
                problem = shared_memory_problem(need, what)
                if problem:
                    raise ConfigError(problem)
                shared[trial.label] = need
        except ConfigError as error:
            raise ConfigError(f"sweep {sweep.spec.name}, trial {trial.label!r}: {error}") from None
        raw = config.model_dump(mode="json")
        raw["mlflow"]["tracking_uri"] = tracking_uri  # the trials run in other working directories
        raw["scaling"]["topology"] = setting
        resolved.append(Trial(trial.label, trial.overrides, ExperimentConfig.model_validate(raw)))
    return CheckedSweep(resolved, tracking_uri, setting, view, shared)


def _parent_run(sweep: Sweep, trials: Sequence[Trial], tracking_uri: str, key: str) -> tuple[str, bool]:
    """Find the sweep's MLflow parent run by its key, or create it with the sweep file and trial list."""
    from mlflow.entities import RunStatus
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = trials[0].config.mlflow.experiment
    experiment_id = ensure_experiment(client, tracking_uri, experiment, trials[0].config.run.storage_path)
    quoted = key.replace("'", "\\'")
    existing = client.search_runs(
        [experiment_id], filter_string=f"tags.`{SWEEP_KEY_TAG}` = '{quoted}'", max_results=1
    )
    if existing:
        run_id = existing[0].info.run_id
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        _record_launch(client, run_id, sweep, trials)
        return run_id, True
    run = client.create_run(
        experiment_id,
        run_name=sweep.spec.name,
        tags={SWEEP_KEY_TAG: key, SWEEP_TAG: sweep.spec.name, "mlflow.note.content": sweep.spec.description},
    )
    run_id = run.info.run_id
    client.log_param(run_id, "sweep.file", str(sweep.source))
    client.log_param(run_id, "sweep.base", sweep.spec.base)
    client.log_param(run_id, "sweep.trials", len(trials))
    _record_launch(client, run_id, sweep, trials)
    return run_id, False


def _record_launch(client: Any, run_id: str, sweep: Sweep, trials: Sequence[Trial]) -> None:
    """The sweep file, trial list and command-line overrides of this launch on the parent run (a relaunch
    of an edited sweep kept the first launch's; params cannot change, so the count is also a tag)."""
    client.log_text(run_id, redact_credentials(sweep.source.read_text()), "sweep.yaml")
    listing = [{"label": t.label, "run.name": t.config.run.name, "overrides": t.overrides} for t in trials]
    listing = json.loads(json.dumps(listing))  # trials share override values: no YAML anchors/aliases
    client.log_text(run_id, redact_credentials(yaml.safe_dump(listing, sort_keys=False)), "trials.yaml")
    client.log_text(
        run_id,
        redact_credentials(yaml.safe_dump(list(sweep.extra_overrides), sort_keys=False)),
        "command_line_overrides.yaml",
    )
    client.set_tag(run_id, "dmltrain.sweep.trials", str(len(trials)))


def _baselines(sweep: Sweep, trial: Trial, tracking_uri: str, parent_run_id: str, key: str) -> None:
    """Each baseline once per sweep, as a child run: skipped when a finished one is there, and an
    unfinished one (stopped by Ctrl-C, failed) is run again in place, not beside a new one."""
    from mlflow.tracking import MlflowClient

    from dmltrain.service.sweeps.baselines import pixel_baseline

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    for name in sweep.spec.baselines:
        label = PIXELS_LABEL if name == "pixels" else name
        tag = f"{key}/{name}"
        earlier = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{BASELINE_TAG}` = '{tag.replace(chr(39), chr(92) + chr(39))}'",
        )
        if any(r.info.status == "FINISHED" for r in earlier):
            continue
        if earlier:  # the newest unfinished one; a second run beside it showed twice in the summary
            run_id = earlier[0].info.run_id
            set_run_status(tracking_uri, run_id, "RUNNING")
        else:
            run_id = client.create_run(
                experiment_id,
                run_name=f"{sweep.spec.name}.{name}",
                tags={**child_tags(parent_run_id, sweep.spec.name, label), BASELINE_TAG: tag},
            ).info.run_id
            client.log_param(run_id, "data.root", redact_credentials(trial.config.data.root))
            client.log_param(run_id, "data.image_size", str(trial.config.data.image_size))
        try:
            metrics = pixel_baseline(trial.config, RunLogger(tracking_uri, run_id))
        except KeyboardInterrupt:
            set_run_status(tracking_uri, run_id, "KILLED")
            raise
        except BaseException:
            set_run_status(tracking_uri, run_id, "FAILED")
            raise
        set_run_status(tracking_uri, run_id, "FINISHED")
        log.info("baseline %s: %s", label, {k: round(v, 4) for k, v in metrics.items() if "@1" in k})


def concurrent_trials(
    trials: Sequence[Trial],
    resources: dict[str, float],
    cluster: dict[str, float],
    shared_memory: Sequence[int] = (),
    shared_memory_capacity: int | None = None,
) -> int:
    """How many trials fit on the cluster at once: its CPUs (and GPUs) over the largest trial's needs, and
    on a single node its /dev/shm over the most a trial's loaders keep there (Tune cannot see that, and
    trials that fit one by one can run out of it together)."""
    cpu_need = max(t.config.scaling.num_workers * t.config.scaling.cpus_per_worker for t in trials)
    cpu_need += resources.get("CPU", resources.get("cpu", 0.0))
    fits = math.floor(cluster.get("CPU", 0.0) / cpu_need) if cpu_need > 0 else len(trials)
    gpu_trials = [t for t in trials if t.config.scaling.use_gpu is not False]
    if cluster.get("GPU", 0.0) > 0 and gpu_trials:
        gpu_need = max(t.config.scaling.num_workers for t in gpu_trials)
        fits = min(fits, math.floor(cluster["GPU"] / gpu_need))
    if shared_memory_capacity and max(shared_memory, default=0) > 0:
        fits = min(fits, shared_memory_capacity // max(shared_memory))
    return max(1, min(fits, len(trials)))


def _trial_resources(resources: dict[str, float]) -> dict[str, float]:
    """Ray refuses a placement group whose only bundle is empty; a trial that asks for no CPU and no GPU
    still declares the memory its driver process takes, which keeps the bundle non-empty."""
    out = dict(resources)
    if not any(v > 0 for v in out.values()):
        out["memory"] = float(512 * 1024 * 1024)
    return out


def run_sweep(sweep: Sweep) -> SweepOutcome:
    """Check, then run every trial of ``sweep`` through Ray Tune; returns the summary read from MLflow."""
    checked = _check_trials(sweep)
    trials, tracking_uri = checked.trials, checked.tracking_uri
    storage = trials[0].config.run.storage_path
    key = f"{storage.rstrip('/')}/{sweep.spec.name}"
    parent_run_id, resumed = _parent_run(sweep, trials, tracking_uri, key)
    log.info(
        "sweep %s: %d trial(s); MLflow parent run %s (%s) at %s",
        sweep.spec.name,
        len(trials),
        parent_run_id,
        "continued" if resumed else "new",
        tracking_uri,
    )
    failed: dict[str, str] = {}
    try:
        _baselines(sweep, trials[0], tracking_uri, parent_run_id, key)
        failed = _tune(sweep, trials, tracking_uri, parent_run_id, storage, checked.shared_memory)
        results = order(collect(tracking_uri, parent_run_id), [t.label for t in trials])
        unfinished = _unfinished(results, [t.label for t in trials], failed, tracking_uri)
        title = f"sweep {sweep.spec.name}"
        log_summary(tracking_uri, parent_run_id, results, title)
    except KeyboardInterrupt:
        set_run_status(tracking_uri, parent_run_id, "KILLED")
        raise
    except BaseException:
        set_run_status(tracking_uri, parent_run_id, "FAILED")
        raise
    status = "FAILED" if failed else "KILLED" if unfinished else "FINISHED"
    set_run_status(tracking_uri, parent_run_id, status)
    return SweepOutcome(
        parent_run_id, tracking_uri, results, failed, unfinished, summary_markdown(results, title)
    )


def _unfinished(
    results: list[TrialResult], labels: Sequence[str], failed: dict[str, str], tracking_uri: str
) -> dict[str, str]:
    """Trials that neither finished nor failed: Tune was interrupted (Ctrl-C) before or while they ran.
    A child run left RUNNING by a stopped trial is marked KILLED (a relaunch resumes it)."""
    runs = {r.label: r for r in results if r.kind == "trial"}
    out = {}
    for label in labels:
        run = runs.get(label)
        # A trial that failed here left its run to whoever holds it: refused because another driver trains
        # it (the same sweep submitted twice), that run is live, not KILLED.
        if run is not None and run.status == "RUNNING" and label not in failed:
            set_run_status(tracking_uri, run.run_id, "KILLED")
            run.status = "KILLED"
        if label not in failed and (run is None or run.status != "FINISHED"):
            out[label] = run.status if run else "not started"
    return out


def _tune(
    sweep: Sweep,
    trials: Sequence[Trial],
    tracking_uri: str,
    parent_run_id: str,
    storage: str,
    shared_memory: dict[str, int],
) -> dict[str, str]:
    """Run the trials as one Tune experiment; returns the failed trials' errors by label."""
    import ray
    from ray import tune

    connect_ray()
    # A stopped sweep continues by running the same command (trials resume by run.name), not through the
    # Tuner.restore call Tune suggests on Ctrl-C.
    drop_notice("ray.tune.tune", "Experiment has been interrupted")
    resources = _trial_resources(sweep.spec.trial_resources)
    capacity = (shared_memory_size() or (0, 0))[0] if shared_memory else 0
    fitting = concurrent_trials(
        trials, sweep.spec.trial_resources, ray.cluster_resources(), list(shared_memory.values()), capacity
    )
    concurrent = sweep.spec.max_concurrent_trials or fitting
    log.info("sweep %s: up to %d trial(s) at once", sweep.spec.name, concurrent)
    most = max(shared_memory.values(), default=0)
    if capacity and most and concurrent * most > capacity:
        log.warning(
            "sweep %s: max_concurrent_trials=%d trials can keep up to %s in shared memory together, but "
            "/dev/shm holds %s on this node: a trial may run out of it (it then ends with one line)",
            sweep.spec.name,
            concurrent,
            amount(concurrent * most),
            amount(capacity),
        )
    # Tune's search space holds the labels (its tables show them); each trial's full config travels once,
    # as an object in Ray's store, through tune.with_parameters.
    payloads = {
        t.label: {
            "label": t.label,
            "config": t.config.model_dump(mode="json"),
            "parent_run_id": parent_run_id,
            "sweep": sweep.spec.name,
        }
        for t in trials
    }
    names = {t.label: t.config.run.name for t in trials}

    def trial_name(trial: Any) -> str:
        return names.get(trial.config["trial"], trial.trial_id)

    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(run_trial, payloads=payloads), resources),
        param_space={"trial": tune.grid_search([t.label for t in trials])},
        tune_config=tune.TuneConfig(
            max_concurrent_trials=concurrent,
            trial_name_creator=trial_name,
            trial_dirname_creator=trial_name,
        ),
        run_config=tune.RunConfig(name=sweep.spec.name, storage_path=storage, verbose=1),
    )
    grid = tuner.fit()
    failed = {}
    for result in grid:
        if result.error is not None:
            label = str((result.config or {}).get("trial", "?"))
            failed[label] = trial_error(result.error)
    return failed


def trial_error(error: BaseException) -> str:
    """The line that says why a trial failed. Tune hands back the worker's error wrapped (a RayTaskError
    whose text is the whole remote traceback: process title, Tune's and dmltrain's frames, the message on
    the last line), so the first 500 characters of it held no reason at all."""
    for _ in range(8):  # the innermost cause
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException) or inner is error:
            break
        error = inner
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[-1] if "Traceback" in str(error) else lines[0]
    named = (
        text
        if text.startswith(type(error).__name__) or "Traceback" in str(error)
        else f"{type(error).__name__}: {text}"
    )
    return " ".join(named.split())[:500]
