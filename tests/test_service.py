"""The training service end to end: real local Ray cluster, real MLflow sqlite store, real glyph shards.

One config drives every test here, the quickstart shrunk to a few steps: a run logs metrics, plots and
checkpoints; relaunching it resumes into the same MLflow run; a killed worker is replaced and the run
finishes without logging any step twice.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from dmltrain.service.checkpoints import remove_stale_staging
from dmltrain.service.config import ConfigError, ExperimentConfig, load_config
from dmltrain.service.run import launch

pytestmark = pytest.mark.service

REPO = Path(__file__).parents[1]
# The quickstart runs one worker with 2 threads; these tests keep 2 ranks so the all-gather, the gradient
# all-reduce and rank 0's duties run through Ray for real.
TWO_WORKERS = (
    "scaling.num_workers=2",
    "scaling.torch_threads=1",
    "scaling.cpus_per_worker=1",
    "data.loader_workers=0",
)


def _config(tmp_path: Path, glyphs: Path, name: str, *overrides: str) -> ExperimentConfig:
    return load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs}",
            "data.prepare=null",
            f"run.name={name}",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            *TWO_WORKERS,
            "train.global_batch_size=32",
            "train.chunk_size=8",
            "train.log_every=2",
            "eval.max_images=1200",
            "eval.batch_size=200",
            "eval.grid_queries=4",
            *overrides,
        ],
    )


def _history(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found: set[str] = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_config_typo_fails_before_ray_starts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dmltrain.run", "configs/quickstart.yaml", "optim.lr_rate=0.1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"},  # would fail loudly if Ray were contacted
    )
    assert proc.returncode == 2, proc.stderr
    assert "optim.lr_rate: unknown key" in proc.stderr and "configs/quickstart.yaml" in proc.stderr
    assert "ray" not in proc.stderr.lower().replace("ray_results", "")


def test_run_logs_then_resumes_into_the_same_mlflow_run(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    config = _config(
        tmp_path,
        glyphs_root,
        "e2e",
        "train.steps=6",
        "train.checkpoint_every=4",
        "train.eval_every=3",
        "mlflow.log_checkpoints=true",
        "train.profile_start=2",  # steps 2-3 recorded by torch.profiler on rank 0 (step 1: warm-up)
        "train.profile_steps=2",
    )  # evaluations off the checkpoint cadence: every rank must still checkpoint at the same steps
    outcome = launch(config)
    client = MlflowClient(outcome.tracking_uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED" and not outcome.resumed
    assert run.data.params["loss.name"] == "smoothap" and run.data.params["train.steps"] == "6"
    assert _history(client, outcome.mlflow_run_id, "train/loss") == [2, 4, 6]
    assert _history(client, outcome.mlflow_run_id, "eval/test/recall_at_1") == [0, 3, 6]
    for key in ("train/images_per_second", "train/data_wait_share", "train/lr", "eval/test/map_at_r"):
        assert key in run.data.metrics, key
    assert run.data.metrics["train/peak_rss_mb"] > 100  # the larger of the two ranks' peaks (a collective)
    assert 0.0 <= run.data.metrics["eval/test/recall_at_1"] <= 1.0
    files = _artifacts(client, outcome.mlflow_run_id)
    assert {"config.yaml", "plots/training_curves.png"} <= files
    assert set(outcome.models) == {"model", "best_model"}  # MLflow models (see test_serving_service.py)
    checkpoint = {"state.pt", "stream_rank0000.pt", "stream_rank0001.pt"}  # every rank's stream position
    assert {f"checkpoints/latest/{name}" for name in checkpoint} <= files
    assert {"plots/recall_at_k/step_0000006.png", "plots/retrievals/step_0000006.png"} <= files
    assert {"profile/ops_steps_2-3.txt", "profile/trace_steps_2-3.json.gz"} <= files
    ops = client.download_artifacts(outcome.mlflow_run_id, "profile/ops_steps_2-3.txt", str(tmp_path))
    assert "aten::convolution" in Path(ops).read_text()  # the backbone's operators, by CPU time
    assert run.data.tags["dmltrain.checkpoint_step"] == "6"
    assert re.fullmatch(r"[\d.]+ \S+ pid \d+", run.data.tags["dmltrain.driver_heartbeat"])  # see test_resume
    # Ray started the workers with the config's OpenMP policy, thread count and niceness (0: added to this
    # process's own, not Ray's 15), and the CPU workers' loaders yield to the step (data.loader_priority).
    assert run.data.tags["dmltrain.omp_wait_policy"].endswith("(GOMP_SPINCOUNT=10000)")  # brief
    assert run.data.tags["dmltrain.torch_threads"] == "1"
    assert run.data.tags["dmltrain.worker_niceness"] == str(os.nice(0))
    assert run.data.tags["dmltrain.loader_priority"] == "idle"
    # Ray's bookkeeping processes ran under SCHED_IDLE (scaling.ray_priority: auto): GCS, the agents, the
    # Train controller and its helpers, the driver's Ray threads; none refused.
    demoted = re.fullmatch(r"idle \((\d+) processes\)", run.data.tags["dmltrain.ray_priority"])
    assert demoted and int(demoted.group(1)) >= 5, run.data.tags["dmltrain.ray_priority"]
    assert run.data.tags["dmltrain.malloc"].startswith("MALLOC_ARENA_MAX=1 ")  # keep_freed_memory: auto
    times = {k for k in run.data.metrics if k.startswith("time/")}
    assert {"time/step_seconds", "time/eval_seconds", "time/checkpoint_seconds", "time/loop_seconds"} <= times

    # The same launch again: the run is finished at train.steps, so nothing trains and nothing changes.
    same = launch(config)
    assert same.resumed and same.mlflow_run_id == outcome.mlflow_run_id
    assert same.metrics["eval/test/recall_at_1"] == run.data.metrics["eval/test/recall_at_1"]
    # A changed recipe is refused before anything starts (run.resume=auto), as is any relaunch with never.
    lr = config.model_copy(update={"optim": config.optim.model_copy(update={"lr": 1e-4})})
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.001 -> 0\.0001.*run\.resume=must"):
        launch(lr)
    never = config.model_copy(update={"run": config.run.model_copy(update={"resume": "never"})})
    with pytest.raises(ConfigError, match=r"run\.resume=never: .* already exists .*new run\.name"):
        launch(never)
    assert client.get_run(outcome.mlflow_run_id).info.status == "FINISHED"

    # Relaunch with more steps: Ray restores the last checkpoint, MLflow continues the same run.
    # The profile window may change on a resumed run (an execution setting): step 8 this time.
    more = config.model_copy(
        update={"train": config.train.model_copy(update={"steps": 9, "profile_start": 8, "profile_steps": 1})}
    )
    again = launch(more)
    assert again.resumed and again.mlflow_run_id == outcome.mlflow_run_id
    assert _history(client, outcome.mlflow_run_id, "train/loss") == [2, 4, 6, 8, 9]
    assert _history(client, outcome.mlflow_run_id, "eval/test/recall_at_1") == [0, 3, 6, 9]
    tags = client.get_run(outcome.mlflow_run_id).data.tags
    assert tags["dmltrain.checkpoint_step"] == "9"
    changes = "train.profile_start: 2 -> 8, train.profile_steps: 2 -> 1, train.steps: 6 -> 9"
    assert tags["dmltrain.segments"] == f"1@0; 2@6 ({changes})"
    assert "profile/ops_steps_8-8.txt" in _artifacts(client, outcome.mlflow_run_id, "profile")

    # On purpose: a new learning rate for one more step, recorded as segment 3 of the same run.
    onward = more.model_copy(
        update={
            "optim": more.optim.model_copy(update={"lr": 1e-4}),
            "train": more.train.model_copy(update={"steps": 10}),
            "run": more.run.model_copy(update={"resume": "must"}),
        }
    )
    last = launch(onward)
    assert last.mlflow_run_id == outcome.mlflow_run_id
    final = client.get_run(outcome.mlflow_run_id)
    assert final.info.status == "FINISHED" and final.data.tags["dmltrain.segment"] == "3"
    assert _history(client, outcome.mlflow_run_id, "train/loss") == [2, 4, 6, 8, 9, 10]
    segments = {m.step: m.value for m in client.get_metric_history(outcome.mlflow_run_id, "run/segment")}
    assert segments == {0: 1.0, 6: 2.0, 9: 3.0}
    files = _artifacts(client, outcome.mlflow_run_id)
    assert {f"segments/segment_0{n}.yaml" for n in (1, 2, 3)} <= files
    record = yaml.safe_load(
        Path(
            client.download_artifacts(outcome.mlflow_run_id, "segments/segment_03.yaml", str(tmp_path))
        ).read_text()
    )
    assert record["start_step"] == 9 and record["resume"] == "must"
    assert record["changed"]["optim.lr"] == {"from": "0.001", "to": "0.0001"}
    assert record["config"]["optim"]["lr"] == 1e-4


def _train_worker_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::RayTrainWorker"):
                pids.append(int(entry.name))
    return pids


def test_killed_worker_is_replaced_and_no_step_is_logged_twice(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    config = _config(
        tmp_path,
        glyphs_root,
        "fault",
        "train.steps=24",
        "train.checkpoint_every=4",
        "train.eval_every=24",
        "train.eval_at_start=false",
        "train.log_every=1",
    )
    storage = Path(config.run.storage_path) / "fault"
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("outcome", launch(config)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not list(storage.glob("checkpoint_*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    victims = _train_worker_pids()
    assert victims, "no Ray Train worker process found to kill"
    os.kill(victims[-1], signal.SIGKILL)
    thread.join(timeout=600)
    assert "outcome" in result, "the run did not finish after a worker was killed"
    outcome = result["outcome"]
    client = MlflowClient(outcome.tracking_uri)
    steps = _history(client, outcome.mlflow_run_id, "train/loss")
    assert steps == list(range(1, 25)), steps  # every step exactly once despite the restart
    assert client.get_run(outcome.mlflow_run_id).info.status == "FINISHED"


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_sigterm_marks_the_run_killed_and_a_relaunch_resumes_it(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    """The real driver (`python -m dmltrain.run`) on this session's cluster, stopped as `ray job stop` or
    Kubernetes stop it; the relaunch continues the same MLflow run from the last checkpoint."""
    overrides = [
        f"data.root={glyphs_root}",
        "data.prepare=null",
        "run.name=stopped",
        f"run.storage_path={tmp_path / 'ray_results'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "train.steps=400",
        "train.global_batch_size=32",
        "train.chunk_size=16",
        "train.log_every=1",
        "train.checkpoint_every=2",
        "train.eval_every=400",
        "train.eval_at_start=false",
        "eval.max_images=400",
        "eval.grid_queries=0",
        # The driver joins this session's cluster through RAY_ADDRESS, i.e. an existing cluster, which
        # counts as multi-node unless declared to be one machine.
        "scaling.topology=single-node",
    ]
    address = ray_cluster.get_runtime_context().gcs_address
    driver = subprocess.Popen(
        [sys.executable, "-m", "dmltrain.run", "configs/quickstart.yaml", *overrides],
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": address},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def checkpointed() -> bool:
        if driver.poll() is not None:
            raise AssertionError(f"driver exited early:\n{driver.stdout.read()[-4000:]}")
        experiment = (
            client.get_experiment_by_name("dmltrain-quickstart")
            if (tmp_path / "mlflow.db").exists()
            else None
        )
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        return bool(runs) and "dmltrain.checkpoint_step" in runs[0].data.tags

    try:
        _wait_for(checkpointed, 300, "the first checkpoint")
        driver.send_signal(signal.SIGTERM)
        output, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "marked KILLED" in output
    (run,) = client.search_runs([client.get_experiment_by_name("dmltrain-quickstart").experiment_id])
    assert run.info.status == "KILLED"
    step = int(client.get_run(run.info.run_id).data.tags["dmltrain.checkpoint_step"])

    # Relaunch in this process with the length cut to two steps past the checkpoint (a cadence change).
    config = load_config(
        REPO / "configs" / "quickstart.yaml", [*overrides[:5], *overrides[6:], f"train.steps={step + 2}"]
    )
    outcome = launch(config)
    assert outcome.resumed and outcome.mlflow_run_id == run.info.run_id
    resumed = client.get_run(run.info.run_id)
    assert resumed.info.status == "FINISHED"
    # It resumes from Ray's newest checkpoint. The tag names the newest one rank 0 saw stored, and a stop
    # that lands between Ray persisting a checkpoint and rank 0 tagging it leaves the tag one behind.
    segments = resumed.data.tags["dmltrain.segments"]
    assert segments in {f"1@0; 2@{s} (train.steps: 400 -> {step + 2})" for s in (step, step + 2)}, segments
    steps = _history(client, run.info.run_id, "train/loss")
    # Nothing lost, nothing logged twice. The stopped driver may have logged steps past its last complete
    # checkpoint (the relaunch re-runs them and skips their stored metrics), so the history can end after
    # the relaunch's last step.
    assert steps == list(range(1, max(steps) + 1)) and max(steps) >= step + 2, (step, steps)
    # A checkpoint whose upload the stop cut short leaves its staging directory; the relaunch's checkpoints
    # removed it and left none of their own.
    assert remove_stale_staging() == []


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_job_submit_runs_the_module(glyphs_root: Path, tmp_path: Path) -> None:
    """`ray start --head` + `ray job submit -- python -m dmltrain.run ...`, as a user does on a cluster."""
    bin_dir = Path(sys.executable).parent
    ray_cli = str(bin_dir / "ray")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # the head's workers use this venv
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "1",
        "RAY_AUTH_MODE": "token",  # the head enables token auth; the CLI reads ~/.ray/auth_token
    }
    env.pop("RAY_ADDRESS", None)
    # A short path: Ray puts Unix sockets under it (108-byte limit); it also names this head's processes.
    temp_dir = tempfile.mkdtemp(prefix="dmlray", dir="/tmp")
    dashboard = _free_port()
    # Every listener on a free port: the session's in-process cluster already holds Ray's default ports.
    ports = {
        "--port": _free_port(),
        "--ray-client-server-port": _free_port(),
        "--dashboard-agent-listen-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
        "--metrics-export-port": _free_port(),
        "--node-manager-port": _free_port(),
        "--object-manager-port": _free_port(),
    }
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=2",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            *(f"{flag}={port}" for flag, port in ports.items()),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def ray_job(command: str, *args: str) -> subprocess.CompletedProcess[str]:
        cli = [ray_cli, "job", command, "--address", f"http://127.0.0.1:{dashboard}", *args]
        return subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)

    try:
        config = _config(tmp_path, glyphs_root, "submitted")
        overrides = [
            f"data.root={config.data.root}",
            "data.prepare=null",
            "run.name=submitted",
            f"run.storage_path={config.run.storage_path}",
            f"mlflow.tracking_uri={config.mlflow.tracking_uri}",
            "train.steps=2",
            "train.global_batch_size=32",
            "train.chunk_size=16",
            "train.eval_every=2",
            "eval.max_images=400",
            "eval.grid_queries=0",
            # A submitted job joins an existing cluster, which dmltrain treats as multi-node (no sqlite);
            # this head is one machine, so say so.
            "scaling.topology=single-node",
        ]
        job_id = f"dmltrain-test-{os.getpid()}"
        submitted = None
        for _ in range(60):  # the dashboard and then the job agent come up a while after `ray start`
            submitted = ray_job(
                "submit",
                "--no-wait",
                f"--submission-id={job_id}",
                "--working-dir",
                str(REPO),
                "--",
                "python",
                "-m",
                "dmltrain.run",
                "configs/quickstart.yaml",
                *overrides,
            )
            if submitted.returncode == 0:
                break
            time.sleep(2)
        assert submitted is not None and submitted.returncode == 0, submitted.stdout + submitted.stderr
        status = ""
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            status = ray_job("status", job_id).stdout.lower()  # "... job '<id>' succeeded" etc.
            if any(word in status for word in ("succeeded", "failed", "stopped")):
                break
            time.sleep(3)
        logs = ray_job("logs", job_id).stdout
        assert "succeeded" in status, f"job status: {status[-500:]}\njob logs:\n{logs[-4000:]}"
        assert "run finished: MLflow run" in logs
        client = MlflowClient(config.mlflow.tracking_uri)
        runs = client.search_runs(
            [client.get_experiment_by_name(config.mlflow.experiment).experiment_id],
            filter_string="tags.`dmltrain.run_key` LIKE '%submitted'",
        )
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
