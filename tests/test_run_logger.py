"""RunLogger's background metric writer against a real MLflow sqlite store: order, replay rule, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dmltrain.service.tracking import RunLogger, Segment, artifact_location, create_run, ensure_experiment


def _run(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = ensure_experiment(client, uri, "logger")  # artifacts beside the store
    return uri, client.create_run(experiment).info.run_id


def test_queued_metrics_are_stored_in_order_and_replays_skipped(tmp_path: Path) -> None:
    uri, run_id = _run(tmp_path)
    logger = RunLogger(uri, run_id, asynchronous=True)
    for step in range(1, 6):
        logger.log_metrics({"train/loss": 1.0 / step, "eval/test/recall@1": step / 10}, step)
    logger.log_metrics({"train/loss": 99.0}, 3)  # a replayed step after a restart: not logged again
    assert logger.history("train/loss") == {s: 1.0 / s for s in range(1, 6)}  # history waits for the queue
    logger.close()
    stored = MlflowClient(uri).get_metric_history(run_id, "eval/test/recall_at_1")
    assert [(m.step, m.value) for m in stored] == [(s, s / 10) for s in range(1, 6)]
    # A fresh logger (a relaunch) starts from what is stored, so the replay rule survives restarts.
    again = RunLogger(uri, run_id, asynchronous=True)
    again.log_metrics({"train/loss": 7.0}, 5)
    again.log_metrics({"train/loss": 6.0}, 6)
    again.close()
    assert [m.value for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")][-2:] == [0.2, 6.0]


def test_a_failed_background_write_is_raised_not_dropped(tmp_path: Path) -> None:
    uri, run_id = _run(tmp_path)
    logger = RunLogger(uri, run_id, asynchronous=True)
    MlflowClient(uri).delete_run(run_id)  # the store now refuses writes to this run
    logger.log_metrics({"train/loss": 1.0}, 1)  # queued: the step does not wait
    with pytest.raises(MlflowException):
        logger.flush()
    logger.close()


def test_a_checkpoint_the_store_cannot_tag_is_a_warning_not_a_failed_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Called inside Ray's checkpoint upload: raising there failed a checkpoint complete in storage, and
    Ray restarted the workers from the one before."""
    uri, run_id = _run(tmp_path)
    logger = RunLogger(uri, run_id)
    logger.record_checkpoint(2)
    MlflowClient(uri).delete_run(run_id)  # the store now refuses writes to this run
    logger.record_checkpoint(4)
    assert logger.checkpoint_step == 2
    assert "checkpoint at step 4 stored, but not tagged in MLflow" in caplog.text
    logger.close()


def test_artifacts_of_a_sqlite_store_stay_beside_it_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # MLflow's default would put the artifacts in ./mlruns here
    uri = f"sqlite:///{store / 'mlflow.db'}"
    segment = Segment(1, 0, "auto", {}, {"train": {"steps": 1}})
    run_id = create_run(uri, "my experiment/1", "store/run", "run", {"train.steps": "1"}, segment)
    logger = RunLogger(uri, run_id)
    note = tmp_path / "hello.txt"
    note.write_text("hello")
    logger.log_file(note, "notes")
    logger.close()
    assert list(elsewhere.iterdir()) == []
    saved = store / "mlruns" / "my_experiment_1" / run_id / "artifacts"
    assert (saved / "notes" / "hello.txt").read_text() == "hello"
    assert (saved / "config.yaml").is_file()
    # An existing experiment keeps where it was created; a server or file store decides for itself.
    assert create_run(uri, "my experiment/1", "store/run2", "run2", {}, segment)
    assert artifact_location("http://127.0.0.1:5000", "x") is None
    assert artifact_location("sqlite:///:memory:", "x") is None
    # A database MLflow reads itself put artifacts in ./mlruns of the creating process, on a cluster the
    # disk of whichever node rank 0 ran on; they go under the run's storage path, which every node shares.
    db = "postgresql+psycopg2://u:p@db.internal/mlflow"
    assert (
        artifact_location(db, "my experiment/1", "s3://bucket/runs/")
        == "s3://bucket/runs/mlruns/my_experiment_1"
    )
    assert artifact_location(db, "x", str(tmp_path / "runs")) == str(tmp_path / "runs" / "mlruns" / "x")
    assert artifact_location("mysql://u@db/mlflow", "x", f"file://{tmp_path}") == str(
        tmp_path / "mlruns" / "x"
    )
    assert artifact_location(db, "x") is None
    assert artifact_location(db, "x", "s3://bucket/runs?endpoint_override=minio:9000") is None
    assert artifact_location(db, "x", str(tmp_path / "a?b")) == str(tmp_path / "a?b" / "mlruns" / "x")
    from dmltrain.data.urls import join_url

    assert (
        join_url("s3://b/runs?endpoint_override=m:9000", "name")
        == "s3://b/runs/name?endpoint_override=m:9000"
    )
    assert artifact_location("http://127.0.0.1:5000", "x", "s3://bucket/runs") is None  # the server's root


def test_a_run_records_who_ran_it_and_from_which_commit(tmp_path: Path) -> None:
    """MlflowClient.create_run adds none of the context tags mlflow.start_run does: the UI's User, Source
    and Version columns were empty, and a run did not say which code trained it."""
    import getpass

    from mlflow.utils.git_utils import get_git_commit

    import dmltrain

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    segment = Segment(1, 0, "auto", {}, {"train": {"steps": 1}})
    run_id = create_run(uri, "exp", "store/run", "run", {}, segment, tags={"mlflow.source.name": "mine"})
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert tags["mlflow.user"] == getpass.getuser() and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"] == "mine"  # the caller's tags win
    commit = get_git_commit(str(Path(dmltrain.__file__).parent))
    if commit is not None:  # an installed copy outside a checkout has none to record
        assert tags["mlflow.source.git.commit"] == commit


def test_passwords_in_uris_do_not_reach_the_run(tmp_path: Path) -> None:
    """A database tracking URI (postgresql://user:password@host/db) was stored in clear in the run's params,
    config.yaml and segment records, readable by everyone who can read the run."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    secret = "postgresql://dml:s3cr3t@db:5432/mlflow"
    config = {"mlflow": {"tracking_uri": secret}}
    segment = Segment(2, 4, "must", {"mlflow.tracking_uri": ("http://a:old@x", secret)}, config)
    run_id = create_run(uri, "exp", "store/run", "run", {"mlflow.tracking_uri": secret}, segment)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.data.params["mlflow.tracking_uri"] == "postgresql://dml:***@db:5432/mlflow"
    texts = [
        Path(client.download_artifacts(run_id, name, str(tmp_path))).read_text()
        for name in ("config.yaml", segment.artifact_name())
    ]
    assert all("s3cr3t" not in t and "old@" not in t and "dml:***@db" in t for t in texts), texts
    assert (
        "s3cr3t" not in run.data.tags["dmltrain.segments"] and "a:***@x" in run.data.tags["dmltrain.segments"]
    )
