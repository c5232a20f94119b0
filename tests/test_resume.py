"""run.resume: what a relaunch of an existing run.name does, decided before anything starts.

The decision is a pure function of the config, the run's MLflow record and the checkpoints on storage;
the MLflow side (segments, status) runs against a real sqlite store. The same paths through the real
driver and Ray are in test_service.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from dmltrain.service.checkpoints import count_ray_checkpoints
from dmltrain.service.config import ConfigError, ExperimentConfig, flatten, load_config
from dmltrain.service.resume import DATA_CHANGE, RESUMABLE_KEYS, config_changes, plan_launch
from dmltrain.service.tracking import (
    HEARTBEAT_STALE_SECONDS,
    DriverHeartbeat,
    ExistingRun,
    Segment,
    continue_run,
    create_run,
    find_run,
    run_key,
    set_run_status,
    wait_out_a_silent_driver,
)

REPO = Path(__file__).parents[1]
URI = "sqlite:///unused.db"


def _config(*overrides: str) -> ExperimentConfig:
    return load_config(
        REPO / "configs" / "quickstart.yaml", ["run.storage_path=/runs", "train.steps=300", *overrides]
    )


def _existing(config: ExperimentConfig, status: str = "FINISHED", step: int | None = 300) -> ExistingRun:
    return ExistingRun("abc123", status, step, 1, config.model_dump(mode="json"))


def test_a_new_name_starts_and_must_refuses_it() -> None:
    assert plan_launch(_config(), None, 0, URI).action == "new"
    assert plan_launch(_config("run.resume=never"), None, None, URI).action == "new"
    with pytest.raises(ConfigError, match=r"run\.resume=must: run\.name=quickstart .* has no checkpoint"):
        plan_launch(_config("run.resume=must"), None, 0, URI)


def test_auto_resumes_length_and_cadence_changes_only() -> None:
    old = _config()
    longer = _config("train.steps=600", "train.eval_every=50", "run.max_failures=5", "train.chunk_size=32")
    plan = plan_launch(longer, _existing(old), 2, URI)
    assert plan.action == "resume"
    assert set(plan.changed) == {"train.steps", "train.eval_every", "run.max_failures", "train.chunk_size"}
    assert plan.changed["train.steps"] == ("300", "600")
    # The finding that started this: a new learning rate used to "resume at step 300" of a finished run.
    with pytest.raises(ConfigError) as refused:
        plan_launch(_config("optim.lr=1e-4", "train.steps=600"), _existing(old), 2, URI)
    message = str(refused.value)
    assert "\n" not in message
    assert "optim.lr: 0.001 -> 0.0001" in message and "train.steps" not in message
    assert "new run.name" in message and "run.resume=must" in message


def test_must_resumes_any_change_and_never_refuses_an_existing_run() -> None:
    old = _config()
    plan = plan_launch(_config("optim.lr=1e-4", "train.steps=600", "run.resume=must"), _existing(old), 2, URI)
    assert plan.action == "resume" and plan.changed["optim.lr"] == ("0.001", "0.0001")
    with pytest.raises(ConfigError, match=r"run\.resume=never: .* already exists \(MLflow run abc123"):
        plan_launch(_config("run.resume=never"), _existing(old), 2, URI)
    with pytest.raises(ConfigError, match=r"already exists \(3 Ray checkpoint\(s\) but no MLflow run"):
        plan_launch(_config("run.resume=never"), None, 3, URI)


def test_finished_runs_are_left_alone_until_they_are_made_longer() -> None:
    old = _config()
    done = plan_launch(old, _existing(old), 2, URI)
    assert done.action == "done" and "already finished at step 300" in done.message
    assert plan_launch(old, _existing(old, status="KILLED", step=250), 2, URI).action == "resume"
    assert plan_launch(_config("train.steps=400"), _existing(old), 2, URI).action == "resume"
    # An unfinished run relaunched shorter than its checkpoint trained nothing, skipped the last
    # evaluation, ended FINISHED and published its step-250 model as a 200-step run's.
    with pytest.raises(
        ConfigError, match=r"checkpoint at step 250 .*past train.steps=200: .*set train.steps"
    ):
        plan_launch(_config("train.steps=200"), _existing(old, status="KILLED", step=250), 2, URI)


def test_a_run_that_stopped_early_is_left_alone_unless_its_patience_changes() -> None:
    """A run early-stopped at step 200 of 300 and relaunched as it was trained again (FINISHED counted as
    done only at train.steps): each relaunch trained eval_every more steps and published its models again."""
    old = _config("train.early_stopping_patience=2")
    stopped = ExistingRun("abc123", "FINISHED", 200, 1, old.model_dump(mode="json"), early_stopped_at=200)
    done = plan_launch(old, stopped, 2, URI)
    assert done.action == "done" and "stopped early at step 200" in done.message
    # The tag stays after a later launch trained on (patience raised): a run that ended elsewhere goes on
    trained_on = ExistingRun("abc123", "FINISHED", 300, 2, old.model_dump(mode="json"), early_stopped_at=200)
    assert (
        plan_launch(_config("train.early_stopping_patience=2", "train.steps=600"), trained_on, 2, URI).action
        == "resume"
    )
    assert (
        plan_launch(_config("train.early_stopping_patience=2", "train.steps=600"), stopped, 2, URI).action
        == "done"
    )
    patient = _config("train.early_stopping_patience=5", "run.resume=must")
    assert plan_launch(patient, stopped, 2, URI).action == "resume"


def test_auto_refuses_a_new_chunk_size_with_live_batchnorm() -> None:
    """Chunks are exact with frozen BatchNorm only: live BatchNorm normalises each chunk by itself, so the
    chunk size is part of the recipe (RLL's SOP/In-Shop configs; the out-of-memory advice lowers it)."""
    live = _config("model.freeze_bn=false")
    with pytest.raises(ConfigError, match=r"changes train\.chunk_size: 128 -> 32"):
        plan_launch(_config("model.freeze_bn=false", "train.chunk_size=32"), _existing(live), 2, URI)
    assert plan_launch(_config("train.chunk_size=32"), _existing(_config()), 2, URI).changed


def test_checkpoints_and_mlflow_must_agree() -> None:
    old = _config()
    with pytest.raises(
        ConfigError, match=r"holds no checkpoint of run\.name=quickstart \(moved or deleted\?\)"
    ):
        plan_launch(old, _existing(old, status="KILLED", step=200), 0, URI)
    # Unknown storage (None: could not be listed) trusts MLflow's record.
    assert plan_launch(old, _existing(old, status="KILLED", step=200), None, URI).action == "resume"
    # Checkpoints without an MLflow run (another tracking URI?): auto refuses, must continues.
    with pytest.raises(ConfigError, match=r"no MLflow run in sqlite:///unused\.db"):
        plan_launch(old, None, 2, URI)
    assert plan_launch(_config("run.resume=must"), None, 2, URI).action == "resume"
    # A killed run that never reached a checkpoint restarts from step 0 into the same MLflow run.
    assert plan_launch(old, _existing(old, status="KILLED", step=None), 0, URI).action == "resume"


def test_stored_configs_are_compared_key_by_key() -> None:
    new = _config("optim.lr=1e-4")
    stored = new.model_dump(mode="json")
    assert config_changes(stored, new) == {}
    stored["optim"]["lr"] = 0.001
    stored["sampler"]["removed_key"] = 1  # a stored config this version no longer accepts
    changes = config_changes(stored, new)
    assert changes["optim.lr"] == ("0.001", "0.0001") and changes["sampler.removed_key"] == ("1", None)
    assert "<stored config>" in changes
    # The stored config has passwords in URIs masked: the same URI is no change (it was, and auto refused).
    secret = _config("data.root=https://alice:s3cret@host/shards", "data.prepare=null")
    masked = secret.model_dump(mode="json")
    masked["data"]["root"] = "https://alice:***@host/shards"
    assert config_changes(masked, secret) == {}
    assert {"train.steps", "run.resume", "train.checkpoint_every", "eval.ks"} <= RESUMABLE_KEYS
    assert not {"optim.lr", "loss.name", "data.root", "train.global_batch_size"} & RESUMABLE_KEYS


def test_data_prepared_again_differently_is_a_change(tmp_path: Path) -> None:
    """`dmltrain prepare` again with another --test-fraction (or resize, seed) under the same data.root:
    no config key changes, but the run would train on former test classes and mix two test sets. The
    fingerprint in dataset.json tells; the run's MLflow record keeps the one it trained on."""
    old = _config()
    was, now = "a1" * 32, "b2" * 32  # sha256 hex digests
    recorded = ExistingRun("abc123", "KILLED", 200, 1, old.model_dump(mode="json"), data_fingerprint=was)
    assert plan_launch(old, recorded, 2, URI, was).action == "resume"
    with pytest.raises(ConfigError) as refused:
        plan_launch(old, recorded, 2, URI, now)
    message = str(refused.value)
    assert f"changes {DATA_CHANGE}: {was[:12]} -> {now[:12]}" in message and "\n" not in message
    plan = plan_launch(_config("run.resume=must"), recorded, 2, URI, now)
    assert plan.action == "resume" and plan.changed[DATA_CHANGE] == (was[:12], now[:12])
    # was run recorded before fingerprints were kept, or a launch that does not know its data: no verdict.
    assert plan_launch(old, _existing(old, status="KILLED", step=200), 2, URI, now).action == "resume"
    assert plan_launch(old, recorded, 2, URI, None).action == "resume"

    # The record itself: each launch's segment sets the run's tag, which find_run reads back.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    key = run_key(old.run.storage_path, old.run.name)
    segment = Segment(1, 0, "auto", {}, old.model_dump(mode="json"), "aaa")
    run_id = create_run(uri, "exp", key, "quickstart", flatten(old), segment)
    found = find_run(uri, "exp", key)
    assert found is not None and found.data_fingerprint == "aaa"
    continue_run(uri, run_id, Segment(2, 0, "must", {DATA_CHANGE: ("aaa", "bbb")}, segment.config, "bbb"))
    found = find_run(uri, "exp", key)
    assert found is not None and found.data_fingerprint == "bbb"


def test_segments_and_status_in_mlflow(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _config()
    key = run_key(first.run.storage_path, first.run.name)
    assert find_run(uri, "exp", key) is None
    run_id = create_run(
        uri,
        "exp",
        key,
        "quickstart",
        flatten(first),
        Segment(1, 0, "auto", {}, first.model_dump(mode="json")),
    )
    client = MlflowClient(uri)
    client.set_tag(run_id, "dmltrain.checkpoint_step", "300")
    set_run_status(uri, run_id, "KILLED")
    found = find_run(uri, "exp", key)
    assert found is not None and (found.status, found.checkpoint_step, found.segments) == ("KILLED", 300, 1)
    assert found.config == first.model_dump(mode="json")

    second = _config("optim.lr=1e-4", "train.steps=600", "run.resume=must")
    plan = plan_launch(second, found, 1, uri)
    continue_run(uri, run_id, Segment(2, 300, "must", plan.changed, second.model_dump(mode="json")))
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"  # a resume makes the run live again
    assert run.data.params["optim.lr"] == "0.001"  # params stay the first launch's (MLflow keeps them)
    assert run.data.tags["dmltrain.segments"] == (
        "1@0; 2@300 (optim.lr: 0.001 -> 0.0001, run.resume: auto -> must, train.steps: 300 -> 600)"
    )
    history = {m.step: m.value for m in client.get_metric_history(run_id, "run/segment")}
    assert history == {0: 1.0, 300: 2.0}
    record = yaml.safe_load(
        Path(client.download_artifacts(run_id, "segments/segment_02.yaml", str(tmp_path))).read_text()
    )
    assert record["changed"]["optim.lr"] == {"from": "0.001", "to": "0.0001"}
    again = find_run(uri, "exp", key)
    assert again is not None and again.segments == 2 and again.config == second.model_dump(mode="json")

    # While its driver lives, the run is refused to a second launch of the same name, whatever run.resume
    # says (a job submitted twice trained beside the first into one checkpoint directory and MLflow run).
    with DriverHeartbeat(uri, run_id, interval=0.2):
        first_beat = find_run(uri, "exp", key)
        assert first_beat is not None and first_beat.heartbeat is not None
        assert first_beat.heartbeat[1] == f"{os.uname().nodename} pid {os.getpid()}"
        for mode in ("auto", "must"):
            with pytest.raises(ConfigError, match=r"is being trained by another driver \(.* pid \d+, alive"):
                plan_launch(_config(f"run.resume={mode}", "train.steps=600"), first_beat, 1, uri)
        time.sleep(1.5)  # renewed meanwhile
        renewed = find_run(uri, "exp", key)
        assert renewed is not None and renewed.heartbeat is not None
        assert renewed.heartbeat[0] > first_beat.heartbeat[0]
        # A launch that finds a fresh heartbeat waits to see it renewed (alive: refused) ...
        started = time.monotonic()
        seen = wait_out_a_silent_driver(uri, "exp", key, find_run(uri, "exp", key), stale_after=30, poll=0.05)
        assert time.monotonic() - started < 5 and seen is not None and seen.heartbeat is not None
        with pytest.raises(ConfigError, match="is being trained by another driver"):
            plan_launch(second, seen, 1, uri)
    # ... or go stale: a driver killed outright (an OOM-killed pod retried at once) leaves the run RUNNING
    # with a heartbeat that is never renewed; it counts as gone once the heartbeat is stale.
    started = time.monotonic()
    silent = wait_out_a_silent_driver(uri, "exp", key, find_run(uri, "exp", key), stale_after=2, poll=0.05)
    assert silent is not None and silent.heartbeat is not None and time.monotonic() - started < 10
    assert time.time() - silent.heartbeat[0] >= 2  # it waited until the heartbeat was stale
    assert silent.heartbeat == find_run(uri, "exp", key).heartbeat  # never renewed
    later = silent.heartbeat[0] + HEARTBEAT_STALE_SECONDS + 1
    assert plan_launch(second, silent, 1, uri, now=later).action == "resume"


def test_checkpoint_count_on_local_storage(tmp_path: Path) -> None:
    assert count_ray_checkpoints(str(tmp_path), "run") == 0
    for name in ("checkpoint_2026-01-01_00-00-00.000000", "checkpoint_2026-01-01_00-01-00.000000"):
        (tmp_path / "run" / name).mkdir(parents=True)
    (tmp_path / "run" / "checkpoint_manager_snapshot.json").write_text("{}")
    assert count_ray_checkpoints(str(tmp_path), "run") == 2
    assert count_ray_checkpoints(f"file://{tmp_path}", "run") == 2
    assert count_ray_checkpoints("nosuchscheme://bucket/x", "run") is None


def test_only_the_checkpoints_to_keep_stay(tmp_path: Path) -> None:
    """A checkpoint stored while the driver was gone is never registered with Ray, which then never
    deletes it: the end of a run removes those (steps 10, 12 of a run that keeps 20 and 30)."""
    from dmltrain.service.checkpoints import checkpoint_dir_name, remove_checkpoints_except

    for step in (10, 12, 20, 30):
        (tmp_path / "run" / checkpoint_dir_name(step)).mkdir(parents=True)
        (tmp_path / "run" / checkpoint_dir_name(step) / "state.pt").write_bytes(b"x")
    (tmp_path / "run" / "checkpoint_manager_snapshot.json").write_text("{}")
    (tmp_path / "other" / checkpoint_dir_name(10)).mkdir(parents=True)  # another run: untouched
    assert remove_checkpoints_except(str(tmp_path), "run", {20, 30}) == [10, 12]
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == [checkpoint_dir_name(20), checkpoint_dir_name(30), "checkpoint_manager_snapshot.json"]
    assert (tmp_path / "other" / checkpoint_dir_name(10)).is_dir()
    assert remove_checkpoints_except("nosuchscheme://bucket/x", "run", set()) == []
