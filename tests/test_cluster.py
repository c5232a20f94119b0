"""The cluster path on a real multi-node deployment built on this machine (dmltrain.service.testbed).

One bed per module: a 0-CPU head hosting MLflow (PostgreSQL, proxied artifacts) and an S3 endpoint, two
1-CPU worker nodes, each node in its own network and mount namespace with its own disk, one shared
directory. Every job goes in from the root namespace through `ray job submit` with token auth, as README
documents, so rank 0 always runs on a worker node, never beside the driver.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dmltrain.service.testbed import TestBed, bed_requirements

pytestmark = pytest.mark.cluster

REPO = Path(__file__).parents[1]
BUCKET = "dmltrain-bed"
# The quickstart shrunk to seconds per step: 32 px glyphs, batch 32 over 2 workers (one per 1-CPU node),
# few evaluation images.
SMALL = [
    "data.prepare=null",
    "scaling.num_workers=2",
    "scaling.cpus_per_worker=1",
    "scaling.torch_threads=1",
    "data.loader_workers=0",
    "train.global_batch_size=32",
    "train.chunk_size=16",
    "train.eval_at_start=false",
    "eval.max_images=400",
    "eval.batch_size=200",
    "eval.grid_queries=4",
]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestBed]:
    why = bed_requirements()
    if why:
        pytest.skip(f"CLUSTER TEST BED NOT RUN: {why}")
    # Logs of every node, service and job driver outlive the bed (in pytest's temp directory by default).
    logs = os.environ.get("DMLTRAIN_TESTBED_LOGS")
    archive = Path(logs) if logs else tmp_path_factory.mktemp("testbed-logs")
    testbed = TestBed(worker_nodes=2, cpus_per_node=1, archive=archive)
    try:
        testbed.start()
        yield testbed
    finally:
        try:
            testbed.stop()
        finally:
            left = testbed.leftovers()
        assert not left, f"the test bed left {left} behind"


@pytest.fixture(scope="module")
def shared_glyphs(bed: TestBed, glyphs_root: Path) -> Path:
    """The glyph shards on the shared volume (copied in once, as a user would put data on a PVC)."""
    target = bed.shared / "glyphs"
    shutil.copytree(glyphs_root, target)
    return target


@pytest.fixture(scope="module")
def s3_glyphs(bed: TestBed, glyphs_root: Path) -> str:
    """The glyph shards in the bed's S3 bucket."""
    import s3fs

    env = bed.s3_env
    fs = s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=env["AWS_ENDPOINT_URL"],
    )
    fs.mkdir(BUCKET)
    fs.put(str(glyphs_root), f"{BUCKET}/glyphs", recursive=True)
    return f"s3://{BUCKET}/glyphs"


def _entrypoint(*overrides: str) -> list[str]:
    return ["python", "-m", "dmltrain.run", "configs/quickstart.yaml", *overrides]


def _submit(bed: TestBed, job_id: str, entrypoint: list[str], env_vars: dict[str, str] | None) -> None:
    done = bed.submit(entrypoint, REPO, job_id, env_vars)
    assert done.returncode == 0, f"ray job submit failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def _finish(bed: TestBed, job_id: str, timeout: float, expect: str = "SUCCEEDED") -> str:
    status = bed.wait_job(job_id, timeout)
    logs = bed.job_logs(job_id)
    assert status == expect, f"job {job_id}: {status}, expected {expect}\njob logs:\n{logs[-6000:]}"
    return logs


def worker_groups(logs: str) -> list[dict[int, str]]:
    """Each worker group Ray Train started, as ``world_rank -> node IP`` (from the controller's log)."""
    groups: list[dict[int, str]] = []
    for line in logs.splitlines():
        if "Started training worker group" in line:
            groups.append({})
        found = re.search(r"\(ip=([\d.]+), pid=\d+\) world_rank=(\d+)", line)
        if found and groups:
            groups[-1][int(found.group(2))] = found.group(1)
    return groups


def _run(client: MlflowClient, name: str):
    experiment = client.get_experiment_by_name("dmltrain-quickstart")
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    assert len(runs) <= 1, f"{len(runs)} MLflow runs named {name}: a relaunch must resume, not duplicate"
    return runs[0] if runs else None


def _steps(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found: set[str] = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def _model_artifacts(client: MlflowClient, model_id: str, path: str | None = None) -> set[str]:
    found: set[str] = set()
    for item in client.list_logged_model_artifacts(model_id, path):
        found |= _model_artifacts(client, model_id, item.path) if item.is_dir else {item.path}
    return found


def _wait_checkpoint(client: MlflowClient, name: str, step: int, job: str, bed: TestBed) -> tuple[str, int]:
    """Wait until rank 0 has recorded a stored checkpoint at ``step`` or later (MLflow tag, set as soon as
    Ray's report returns, possibly before Ray's controller registers it); returns (run id, step)."""
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        run = _run(client, name)
        recorded = int(run.data.tags.get("dmltrain.checkpoint_step", 0)) if run is not None else 0
        if run is not None and recorded >= step:
            return run.info.run_id, recorded
        status = bed.job(job)["status"]
        assert status in ("PENDING", "RUNNING"), f"job {status} early:\n{bed.job_logs(job)[-6000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint at step {step} in time:\n{bed.job_logs(job)[-6000:]}")


def test_default_config_is_refused_before_any_worker_starts(bed: TestBed) -> None:
    """(d) The quickstart as shipped (sqlite next to the driver, relative paths) cannot work here: the driver
    says so, one line per setting with what to use instead, and no worker ever starts."""
    started = time.monotonic()
    _submit(bed, "scenario-d", _entrypoint(), None)  # no MLFLOW_TRACKING_URI, no overrides
    logs = _finish(bed, "scenario-d", 300, expect="FAILED")
    elapsed = time.monotonic() - started
    problems = [line.removeprefix("error: ") for line in logs.splitlines() if line.startswith("error: ")]
    assert problems and all("multi-node cluster" in p and " set " in p for p in problems), logs[-3000:]
    named = {line.split("=", 1)[0] for line in problems}
    assert named == {"mlflow.tracking_uri", "run.storage_path", "data.root"}, problems
    tracking = next(line for line in problems if line.startswith("mlflow.tracking_uri="))
    assert "sqlite:///" in tracking and "MLFLOW_TRACKING_URI" in tracking, tracking
    assert "Traceback" not in logs, logs[-3000:]
    # Nothing reached the workers: no controller, no training worker, no data built on the head's disk.
    assert not bed.actors("TrainController") and not bed.actors("RayTrainWorker")
    assert not list((bed.base / "nodes" / "head").rglob("dataset.json"))
    print(f"scenario d: {elapsed:.0f} s from submission to the refusal")


def test_quickstart_over_two_worker_nodes(bed: TestBed, shared_glyphs: Path) -> None:
    """(a) Rank 0 on a worker node logs everything through the MLflow server; checkpoints on shared disk."""
    started = time.monotonic()
    storage = bed.shared / "ray_results"
    _submit(
        bed,
        "scenario-a",
        _entrypoint(
            *SMALL,
            f"data.root={shared_glyphs}",
            f"run.storage_path={storage}",
            "run.name=scenario-a",
            "train.steps=4",
            "train.log_every=2",
            "train.checkpoint_every=4",
            "train.eval_every=4",
            "mlflow.log_checkpoints=true",
        ),
        {"MLFLOW_TRACKING_URI": bed.mlflow_url},
    )
    logs = _finish(bed, "scenario-a", 480)
    groups = worker_groups(logs)
    workers = {n.address for n in bed.nodes.values() if n.name != "head"}
    assert len(groups) == 1 and set(groups[0]) == {0, 1}, logs[-4000:]
    assert groups[0][0] in workers and groups[0][0] != bed.head.address  # rank 0 away from the driver
    assert set(groups[0].values()) == workers  # one worker per worker node

    client = MlflowClient(bed.mlflow_url)
    run = _run(client, "scenario-a")
    assert run is not None and run.info.status == "FINISHED"
    assert run.data.params["loss.name"] == "smoothap" and run.data.params["train.steps"] == "4"
    assert run.data.params["data.root"] == str(shared_glyphs)
    assert _steps(client, run.info.run_id) == [2, 4]
    assert _steps(client, run.info.run_id, "eval/test/recall_at_1") == [4]
    files = _artifacts(client, run.info.run_id)
    expected = {
        "config.yaml",
        "plots/training_curves.png",
        "plots/recall_at_k/step_0000004.png",
        "plots/retrievals/step_0000004.png",
        "checkpoints/latest/state.pt",
        "checkpoints/latest/stream_rank0000.pt",
        "checkpoints/latest/stream_rank0001.pt",
    }
    assert expected <= files, expected - files
    # The final model, logged by the driver from Ray's checkpoint on the shared volume (an MLflow model).
    models = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'"
    )
    final = [m for m in models if m.name == "model"]
    assert len(final) == 1, [m.name for m in models]
    model_files = _model_artifacts(client, final[0].model_id)
    assert "MLmodel" in model_files and any(f.endswith("/model.pt") for f in model_files), model_files
    # All of it went through the server: the files sit on the head's disk, which no worker node can see.
    stored = bed.base / "nodes" / "head" / "mlartifacts"
    assert list(stored.glob(f"*/{run.info.run_id}/artifacts/checkpoints/latest/state.pt")), sorted(
        stored.rglob("*")
    )
    assert list(stored.glob(f"*/models/{final[0].model_id}/artifacts/**/model.pt")), sorted(stored.rglob("*"))
    # Ray's checkpoints on the shared volume, each complete.
    checkpoints = sorted((storage / "scenario-a").glob("checkpoint_0*"))
    assert [c.name for c in checkpoints] == ["checkpoint_000000004"], checkpoints
    assert all((c / "state.pt").is_file() and (c / "stream_rank0001.pt").is_file() for c in checkpoints)
    print(f"scenario a: {time.monotonic() - started:.0f} s")


def test_node_loss_resumes_from_the_last_checkpoint(bed: TestBed, s3_glyphs: str) -> None:
    """(b) The node running rank 0 dies mid-run; a new node joins; every step is logged exactly once."""
    started = time.monotonic()
    steps = 15
    _submit(
        bed,
        "scenario-b",
        _entrypoint(
            *SMALL,
            f"data.root={s3_glyphs}",
            f"run.storage_path=s3://{BUCKET}/ray_results",
            "run.name=scenario-b",
            "model.backbone=mobilenet_v3_small",  # 20 MB checkpoints instead of resnet18's 135 MB
            f"train.steps={steps}",
            "train.log_every=1",
            "train.checkpoint_every=5",
            f"train.eval_every={steps}",
        ),
        {"MLFLOW_TRACKING_URI": bed.mlflow_url, **bed.s3_env},
    )
    client = MlflowClient(bed.mlflow_url)
    run_id, stored = _wait_checkpoint(client, "scenario-b", 5, "scenario-b", bed)
    first = worker_groups(bed.job_logs("scenario-b"))[0]
    victim = next(n for n in bed.nodes.values() if n.address == first[0])
    bed.kill_node(victim.name)
    assert len(_steps(client, run_id)) < steps, "the node was killed too late to test a resume"
    assert not [x for x in bed.leftovers() if victim.namespace in x or victim.name in x]
    replacement = bed.add_worker()
    killed_at = time.monotonic()

    logs = _finish(bed, "scenario-b", 540)
    groups = worker_groups(logs)
    assert len(groups) >= 2, logs[-4000:]
    assert victim.address not in groups[-1].values() and replacement.address in groups[-1].values()
    resumed = [int(s) for s in re.findall(r"rank \d+ resumed at step (\d+)", logs)]
    assert resumed and min(resumed) >= stored and resumed[-1] % 5 == 0, (stored, resumed)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _steps(client, run_id) == list(range(1, steps + 1))  # every step exactly once
    assert run.data.tags["dmltrain.checkpoint_step"] == str(steps)
    after_kill = time.monotonic() - killed_at
    print(f"scenario b: {time.monotonic() - started:.0f} s, {after_kill:.0f} s after kill; resumed {resumed}")


def test_driver_loss_then_resubmission_resumes_the_same_mlflow_run(bed: TestBed, shared_glyphs: Path) -> None:
    """(c) The driver is stopped mid-run (as by `ray job stop`: SIGTERM, then SIGKILL): the MLflow run shows
    KILLED, and the same job submitted again resumes from the newest stored checkpoint into the same run."""
    started = time.monotonic()
    steps = 20
    entrypoint = _entrypoint(
        *SMALL,
        f"data.root={shared_glyphs}",
        f"run.storage_path={bed.shared / 'ray_results'}",
        "run.name=scenario-c",
        "model.backbone=mobilenet_v3_small",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_every=5",
        f"train.eval_every={steps}",
    )
    env = {"MLFLOW_TRACKING_URI": bed.mlflow_url}
    client = MlflowClient(bed.mlflow_url)

    _submit(bed, "scenario-c-1", entrypoint, env)
    run_id, stored = _wait_checkpoint(client, "scenario-c", 5, "scenario-c-1", bed)
    bed.stop_job("scenario-c-1")  # what `ray job stop` asks the head for
    first = _finish(bed, "scenario-c-1", 120, expect="STOPPED")
    assert client.get_run(run_id).info.status == "KILLED", first[-3000:]
    assert len(_steps(client, run_id)) < steps, "the driver was stopped too late to test a resume"

    _submit(bed, "scenario-c-2", entrypoint, env)
    second = _finish(bed, "scenario-c-2", 480)
    run = _run(client, "scenario-c")
    assert run is not None and run.info.run_id == run_id and run.info.status == "FINISHED"
    assert _steps(client, run_id) == list(range(1, steps + 1))  # every step once over both launches
    # It continues from the newest checkpoint stored before the stop, even one that Ray's controller had
    # not registered yet (the controller died with the driver).
    resumed = [int(s) for s in re.findall(r"rank \d+ resumed at step (\d+)", second)]
    assert resumed and min(resumed) >= stored and resumed[0] % 5 == 0, (stored, resumed)
    assert run.data.tags["dmltrain.segment"] == "2", run.data.tags
    print(f"scenario c: {time.monotonic() - started:.0f} s for both launches")
