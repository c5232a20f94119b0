"""MLflow tracking: one MLflow run per dmltrain run, resumed (not duplicated) when the run is relaunched.

Only the driver creates or finds the run (keyed by storage path + run name, the same key Ray Train uses to
resume), and only rank 0 writes to it. Metrics go out as they are produced, so the MLflow UI is live. After
a restart Ray replays the steps since the last checkpoint (from the same data stream position); the logger
starts from the steps already stored for each metric and skips those, so no step appears twice.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from dmltrain.data.urls import is_local, local_path
from dmltrain.service.mlflow_scope import no_artifact_bars

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("dmltrain.service.tracking")

RUN_KEY_TAG = "dmltrain.run_key"
CHECKPOINT_STEP_TAG = "dmltrain.checkpoint_step"
SEGMENT_TAG = "dmltrain.segment"  # number of the latest launch
SEGMENTS_TAG = "dmltrain.segments"  # "1@0; 2@300 (train.steps: 300 -> 600)": every launch, its first step
SEGMENT_METRIC = "run/segment"  # N logged at the first step of launch N
DATA_TAG = "dmltrain.data_fingerprint"  # dataset.json's fingerprint of the latest launch's data
EARLY_STOP_TAG = "dmltrain.early_stopped_at_step"  # the step early stopping ended the run at
HEARTBEAT_TAG = "dmltrain.driver_heartbeat"  # "<unix seconds> <host> pid <pid>" of the driver training it
HEARTBEAT_SECONDS = 30.0  # how often a live driver renews it
HEARTBEAT_STALE_SECONDS = 120.0  # older than this, the driver that wrote it is taken to be gone
_MAX_TAG_LENGTH = 5000
_MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
_BATCH = 100  # params or metrics per log_batch call, well under MLflow's limits


def metric_name(key: str) -> str:
    """MLflow forbids ``@`` in metric names: ``eval/test/recall@1`` is logged as ``eval/test/recall_at_1``."""
    return key.replace("@", "_at_")


def resolve_tracking_uri(configured: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else an absolute sqlite store in the working directory.

    The default is made absolute on the driver because Ray workers run in other working directories.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def sqlite_store_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` tracking URI (None for other stores), to tell a missing store from an
    empty one: MLflow creates the file on first contact."""
    prefix = "sqlite:///"  # then a relative path, or an absolute one with its own slash (SQLAlchemy)
    path = uri[len(prefix) :].split("?", 1)[0] if uri.startswith(prefix) else ""
    return Path(path) if path and path != ":memory:" else None


def run_key(storage_path: str, name: str) -> str:
    """Identity of a run across relaunches: where Ray keeps its checkpoints."""
    return f"{storage_path.rstrip('/')}/{name}"


@dataclass(frozen=True)
class ExistingRun:
    """The MLflow run a relaunch would continue, with what resume decisions need to know about it."""

    run_id: str
    status: str  # RUNNING, FINISHED, FAILED, KILLED
    checkpoint_step: int | None  # last checkpoint rank 0 recorded (tag dmltrain.checkpoint_step)
    segments: int  # launches so far
    config: dict[str, Any] | None  # the latest launch's resolved config; None when it cannot be read
    data_fingerprint: str | None = None  # the latest launch's dataset.json fingerprint (tag; None: unknown)
    early_stopped_at: int | None = None  # the step early stopping ended the run at (tag), if it did
    heartbeat: tuple[float, str] | None = None  # (unix time, "host pid N") of the driver's last heartbeat


@dataclass(frozen=True)
class Segment:
    """One launch of a run: what it trained with and from which step (MLflow: segments/segment_NN.yaml,
    metric ``run/segment`` = N at its first step, tags ``dmltrain.segment`` and ``dmltrain.segments``)."""

    number: int
    start_step: int
    resume: str  # run.resume of this launch
    changed: dict[str, tuple[str | None, str | None]]  # flattened key -> (previous, this launch)
    config: dict[str, Any]
    data_fingerprint: str | None = None  # dataset.json's fingerprint: the data this launch trains on

    def artifact_name(self) -> str:
        return f"segments/segment_{self.number:02d}.yaml"

    def to_yaml(self) -> str:
        """The record of this launch for MLflow, passwords in URIs masked (`redact_credentials`)."""
        record = {
            "segment": self.number,
            "start_step": self.start_step,
            "launched": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "resume": self.resume,
            "changed": {key: {"from": old, "to": new} for key, (old, new) in sorted(self.changed.items())},
            "data_fingerprint": self.data_fingerprint,
            "config": self.config,
        }
        return redact_credentials(yaml.safe_dump(record, sort_keys=False))

    def summary(self) -> str:
        changes = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(self.changed.items()))
        return redact_credentials(f"{self.number}@{self.start_step}" + (f" ({changes})" if changes else ""))


_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^:/@\s]*):[^@/\s]*@")


def redact_credentials(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` masked: a database tracking URI
    (``postgresql://user:password@host/db``) went into the run's params, config.yaml and segment records in
    clear, for everyone who can read the run."""
    return _URI_PASSWORD.sub(r"\g<head>:***@", text)


# SQLAlchemy back ends MLflow keeps runs in ("postgresql+psycopg2" counts as "postgresql"); sqlite apart.
_DATABASE_SCHEMES = {"postgresql", "mysql", "mssql"}


def artifact_location(tracking_uri: str, experiment: str, storage_path: str | None = None) -> str | None:
    """Where a new experiment keeps its artifacts when the tracking store is a database MLflow reads itself.

    MLflow's own default there is ``./mlruns`` of whichever directory the creating process runs in, which
    scatters checkpoints and models (a benchmark launched from the repository with its store elsewhere left
    2.2 GB there) and, on a multi-node cluster, puts them on the disk of whichever node rank 0 runs on. So:
    a sqlite file keeps them beside the database, in ``mlruns/<experiment>``; another database under the
    run's ``storage_path`` (the place every node already shares), in ``mlruns/<experiment>``. None: the store
    or server decides (a file store keeps artifacts inside itself, a server has its own artifact root)."""
    folder = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    database = sqlite_store_path(tracking_uri)
    if database is not None:
        return str(database.resolve().parent / "mlruns" / folder)
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in _DATABASE_SCHEMES or not storage_path:
        return None
    if is_local(storage_path):
        return str(Path(local_path(storage_path)).expanduser().resolve() / "mlruns" / folder)
    if "?" in storage_path:  # s3://b/p?endpoint_override=...: pyarrow's options, not MLflow's
        return None
    return f"{storage_path.rstrip('/')}/mlruns/{folder}"


def ensure_experiment(
    client: MlflowClient, tracking_uri: str, experiment: str, storage_path: str | None = None
) -> str:
    """The id of ``experiment``, created (artifacts per `artifact_location`) if it does not exist yet."""
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return str(found.experiment_id)
    location = artifact_location(tracking_uri, experiment, storage_path)
    return client.create_experiment(experiment, artifact_location=location)


def experiment_artifact_root(tracking_uri: str, experiment: str, storage_path: str | None = None) -> str:
    """Where ``experiment`` keeps its runs' artifacts, creating the experiment first if it does not exist (a
    server decides that place only then); the multi-node checks test it is shared."""
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, tracking_uri, experiment, storage_path)
    return str(client.get_experiment(experiment_id).artifact_location)


def find_run(tracking_uri: str, experiment: str, key: str) -> ExistingRun | None:
    """The MLflow run of ``key`` (storage path + run name) in ``experiment``, or None."""
    client = MlflowClient(tracking_uri)
    known = client.get_experiment_by_name(experiment)
    if known is None:
        return None
    found = client.search_runs(
        [known.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{_quote(key)}'", max_results=1
    )
    if not found:
        return None
    run = found[0]
    tags = run.data.tags
    step = tags.get(CHECKPOINT_STEP_TAG)
    return ExistingRun(
        run_id=run.info.run_id,
        status=run.info.status,
        checkpoint_step=int(step) if step is not None and step.isdigit() else None,
        segments=int(tags.get(SEGMENT_TAG, "1")),
        config=_latest_config(client, run.info.run_id),
        data_fingerprint=tags.get(DATA_TAG),
        early_stopped_at=int(stopped) if (stopped := tags.get(EARLY_STOP_TAG, "")).isdigit() else None,
        heartbeat=_parse_heartbeat(tags.get(HEARTBEAT_TAG, "")),
    )


def _parse_heartbeat(value: str) -> tuple[float, str] | None:
    when, _, who = value.partition(" ")
    try:
        return float(when), who
    except ValueError:
        return None


def wait_out_a_silent_driver(
    tracking_uri: str,
    experiment: str,
    key: str,
    existing: ExistingRun | None,
    stale_after: float = HEARTBEAT_STALE_SECONDS,
    poll: float = 5.0,
) -> ExistingRun | None:
    """A RUNNING run with a fresh heartbeat: is its driver alive (a job submitted twice), or was it killed
    outright a moment ago (an OOM-killed driver pod that Kubernetes retries at once)? Wait and see: the
    record comes back as soon as the heartbeat is renewed (alive: the launch is refused), goes stale (gone:
    the launch resumes), or the run ends."""
    if existing is None or existing.status != "RUNNING" or existing.heartbeat is None:
        return existing
    first = existing.heartbeat
    if time.time() - first[0] >= stale_after:
        return existing
    log.warning(
        "run %s shows a live driver (%s, %.0f s ago): waiting up to %.0f s for it to renew its heartbeat "
        "(alive: this launch is refused) or fall silent (gone: this launch resumes the run)",
        existing.run_id,
        first[1],
        time.time() - first[0],
        stale_after - (time.time() - first[0]),
    )
    client = MlflowClient(tracking_uri)
    while True:  # polled by the run's status and tags alone; the whole record (its config) once, at the end
        time.sleep(poll)
        run = client.get_run(existing.run_id)
        beat = _parse_heartbeat(run.data.tags.get(HEARTBEAT_TAG, ""))
        if run.info.status != "RUNNING" or beat != first or time.time() - first[0] >= stale_after:
            return find_run(tracking_uri, experiment, key)


class DriverHeartbeat:
    """While a driver trains a run, a tag renewed every ``HEARTBEAT_SECONDS`` says so: a second launch of the
    same ``run.name`` (a job submitted twice) would otherwise resume the RUNNING run beside it, both writing
    checkpoints to one directory and metrics to one MLflow run. A driver killed outright stops renewing it."""

    def __init__(self, tracking_uri: str, run_id: str, interval: float = HEARTBEAT_SECONDS) -> None:
        self.tracking_uri, self.run_id, self.interval = tracking_uri, run_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dmltrain-heartbeat", daemon=True)

    def __enter__(self) -> DriverHeartbeat:
        self._renew()  # before any worker starts: a second launch from now on sees it
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._renew()
            except Exception as error:  # a tracking server hiccup is no reason to stop training
                log.warning("could not renew the driver heartbeat in MLflow: %s", error)

    def _renew(self) -> None:
        value = f"{time.time():.3f} {os.uname().nodename} pid {os.getpid()}"
        MlflowClient(self.tracking_uri).set_tag(self.run_id, HEARTBEAT_TAG, value)


def _latest_config(client: MlflowClient, run_id: str) -> dict[str, Any] | None:
    """The config of the run's latest launch: its newest segment record, else (runs logged before segments
    existed) the newest ``config_relaunch_*.yaml``, else ``config.yaml``."""
    try:
        segments = sorted(a.path for a in client.list_artifacts(run_id, "segments") if not a.is_dir)
        if segments:
            return _read_yaml(client, run_id, segments[-1]).get("config")
        root = sorted(a.path for a in client.list_artifacts(run_id) if not a.is_dir)
        legacy = [p for p in root if p.startswith("config_relaunch_")] or [
            p for p in root if p == "config.yaml"
        ]
        return _read_yaml(client, run_id, legacy[-1]) if legacy else None
    except Exception as exc:  # unreadable artifact store: the caller treats the config as unknown
        log.warning("cannot read the stored config of MLflow run %s: %s", run_id, exc)
        return None


def _read_yaml(client: MlflowClient, run_id: str, path: str) -> dict[str, Any]:
    # One small file: MLflow's download bar for it only cluttered a relaunch's first lines.
    with tempfile.TemporaryDirectory() as directory, no_artifact_bars():
        local = client.download_artifacts(run_id, path, directory)
        data = yaml.safe_load(Path(local).read_text())
    return data if isinstance(data, dict) else {}


def source_tags() -> dict[str, str]:
    """MLflow's own context tags (user, source, its git commit), which ``mlflow.start_run`` adds and
    ``MlflowClient.create_run`` does not: the UI's User, Source and Version columns were empty. The commit
    is dmltrain's checkout's when the entry point is not in a repository (the ``dmltrain`` console script)."""
    try:
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.git_utils import get_git_branch, get_git_commit
        from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT

        tags = dict(resolve_tags())
        if MLFLOW_GIT_COMMIT not in tags:
            package = str(Path(__file__).parents[1])
            commit = get_git_commit(package)
            if commit:
                tags[MLFLOW_GIT_COMMIT] = commit
                tags[MLFLOW_GIT_BRANCH] = get_git_branch(package) or ""
        return {k: str(v) for k, v in tags.items() if v}
    except Exception as error:  # context providers are best effort: a run never fails on them
        log.debug("no MLflow context tags: %s", error)
        return {}


def create_run(
    tracking_uri: str,
    experiment: str,
    key: str,
    run_name: str,
    params: Mapping[str, str],
    segment: Segment,
    tags: Mapping[str, str] | None = None,
    storage_path: str | None = None,
) -> str:
    """A new MLflow run for ``key``: the flattened config as params, the resolved YAML as ``config.yaml``
    and the first segment record; ``tags`` are added (``mlflow.parentRunId`` nests it under a sweep). A new
    experiment's artifacts go where `artifact_location` says (``storage_path``: the run's)."""
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, tracking_uri, experiment, storage_path)
    tags = {**source_tags(), **(tags or {}), RUN_KEY_TAG: key}
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    run_id = run.info.run_id
    items = [Param(k, redact_credentials(v)[:_MAX_PARAM_LENGTH]) for k, v in params.items()]
    for start in range(0, len(items), _BATCH):
        client.log_batch(run_id, params=items[start : start + _BATCH])
    client.log_text(
        run_id, redact_credentials(yaml.safe_dump(segment.config, sort_keys=False)), "config.yaml"
    )
    _record_segment(client, run_id, segment, previous="")
    return run_id


def continue_run(tracking_uri: str, run_id: str, segment: Segment) -> None:
    """Mark a resumed run RUNNING again and record this launch as a new segment. MLflow params are
    immutable, so they keep the first launch's config; each segment's config is its own artifact."""
    client = MlflowClient(tracking_uri)
    client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
    previous = client.get_run(run_id).data.tags.get(SEGMENTS_TAG, "")
    _record_segment(client, run_id, segment, previous)


def _record_segment(client: MlflowClient, run_id: str, segment: Segment, previous: str) -> None:
    client.log_text(run_id, segment.to_yaml(), segment.artifact_name())
    history = f"{previous}; {segment.summary()}" if previous else segment.summary()
    if len(history) > _MAX_TAG_LENGTH:
        history = "..." + history[-(_MAX_TAG_LENGTH - 3) :]
    client.log_batch(
        run_id,
        metrics=[Metric(SEGMENT_METRIC, float(segment.number), int(time.time() * 1000), segment.start_step)],
        tags=[
            RunTag(SEGMENT_TAG, str(segment.number)),
            RunTag(SEGMENTS_TAG, history),
            *([RunTag(DATA_TAG, segment.data_fingerprint)] if segment.data_fingerprint else []),
        ],
    )


def start_or_resume_run(
    tracking_uri: str,
    experiment: str,
    key: str,
    run_name: str,
    params: Mapping[str, str],
    config_yaml: str,
) -> tuple[str, bool]:
    """Find the MLflow run for ``key`` or create it; return ``(run_id, resumed)``. No resume policy: the
    driver uses :func:`find_run`, :func:`create_run` and :func:`continue_run` with its run.resume."""
    existing = find_run(tracking_uri, experiment, key)
    config = yaml.safe_load(config_yaml) or {}
    if existing is not None:
        number = existing.segments + 1
        continue_run(
            tracking_uri, existing.run_id, Segment(number, existing.checkpoint_step or 0, "must", {}, config)
        )
        return existing.run_id, True
    return create_run(
        tracking_uri, experiment, key, run_name, params, Segment(1, 0, "auto", {}, config)
    ), False


def _quote(value: str) -> str:
    return value.replace("'", "\\'")


def set_run_status(tracking_uri: str, run_id: str, status: str) -> None:
    """End the run as FINISHED, FAILED or KILLED (KILLED: the driver was stopped; a relaunch resumes it)."""
    MlflowClient(tracking_uri).set_terminated(run_id, status=status)


def set_run_tag(tracking_uri: str, run_id: str, key: str, value: str) -> None:
    MlflowClient(tracking_uri).set_tag(run_id, key, value)


def finish_run(tracking_uri: str, run_id: str, success: bool) -> None:
    set_run_status(tracking_uri, run_id, "FINISHED" if success else "FAILED")


class RunLogger:
    """Rank 0's handle on the MLflow run: metrics, figures, checkpoints and the final model.

    With ``asynchronous=True`` metrics are written by one background thread, so a training step never
    waits for the tracking store (a sqlite write or an HTTP round trip: ~50 ms per call measured here).
    Every other call first waits for the queued metrics, so writes reach the store one at a time and in
    order; a failed write is raised by the next call (or by ``flush``/``close``), never dropped.
    """

    def __init__(self, tracking_uri: str, run_id: str, asynchronous: bool = False) -> None:
        self.client = MlflowClient(tracking_uri)
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._lock = threading.Lock()
        run = self.client.get_run(run_id)
        # Highest step already stored per metric: replayed steps at or below it are not logged again.
        self._logged_through = {
            key: max(m.step for m in self.client.get_metric_history(run_id, key)) for key in run.data.metrics
        }
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlflow-log") if asynchronous else None
        self._pending: list[Future[None]] = []
        step = run.data.tags.get(CHECKPOINT_STEP_TAG, "")
        # The newest checkpoint known to be complete in Ray's storage (record_checkpoint).
        self.checkpoint_step: int | None = int(step) if step.isdigit() else None

    def record_checkpoint(self, step: int) -> None:
        """Tag ``step`` as the newest checkpoint complete in storage. Called from Ray's upload thread when
        uploads are asynchronous (hence its own client and the lock); an older step never overwrites a
        newer one, whatever order uploads finish in. The tag is a hint (a restart otherwise resumes from
        Ray's newest registered checkpoint): a tracking server that fails here is a warning, not a failed
        checkpoint, which Ray would answer by restarting the workers from the one before."""
        with self._lock:
            if self.checkpoint_step is not None and step <= self.checkpoint_step:
                return
            try:
                MlflowClient(self.tracking_uri).set_tag(self.run_id, CHECKPOINT_STEP_TAG, str(step))
            except Exception as exc:  # MLflow raises its own and requests' errors after its retries
                log.warning("checkpoint at step %d stored, but not tagged in MLflow: %s", step, exc)
                return
            self.checkpoint_step = step

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` unless this step of that metric is already stored (a replay)."""
        now = int(time.time() * 1000)
        fresh = []
        for key, value in metrics.items():
            name = metric_name(key)
            if step > self._logged_through.get(name, -1):
                fresh.append(Metric(name, float(value), now, step))
                self._logged_through[name] = step
        if not fresh:
            return
        if self._executor is None:
            self._write_metrics(fresh)
            return
        self._raise_failed()
        self._pending.append(self._executor.submit(self._write_metrics, fresh))

    def _write_metrics(self, metrics: list[Metric]) -> None:
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + _BATCH])

    def _raise_failed(self) -> None:
        """Re-raise the error of a finished background write, if any, and forget the finished ones."""
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()

    def flush(self) -> None:
        """Wait until every queued metric is stored; raises the first write error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Flush and stop the background writer (the logger still works synchronously afterwards)."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def history(self, key: str) -> dict[int, float]:
        """``step -> value`` of a metric as stored, across every attempt of a resumed run."""
        self.flush()
        return {m.step: m.value for m in self.client.get_metric_history(self.run_id, metric_name(key))}

    def log_figure(self, figure: Figure, artifact_file: str) -> None:
        self.flush()
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_directory(self, local_dir: str | os.PathLike[str], artifact_path: str) -> None:
        self.flush()
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_file(self, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.flush()
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        self.flush()
        self.client.set_tag(self.run_id, key, value)
