"""Multi-node rules: when a cluster counts as multi-node, and which settings are refused there, in one line.

The decision functions take what the driver sees (``ray.nodes()`` output, RAY_ADDRESS); here they get that
output from this session's real Ray cluster and from the shape a 2-node cluster with a 0-CPU head reports.
The 2-node end-to-end refusal runs in the multi-node test bed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmltrain.service.cluster import (
    ClusterView,
    Topology,
    check_shared_paths,
    decide_topology,
    joins_existing_cluster,
    local_capacity_problem,
    placement_shortfall,
    resolve_use_gpu,
    storage_problems,
)
from dmltrain.service.config import ConfigError, load_config

REPO = Path(__file__).parents[1]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _node(node_id: str, address: str, cpus: float, gpus: float = 0.0, alive: bool = True) -> dict:
    """One entry as ``ray.nodes()`` returns it (the keys dmltrain reads, plus some it ignores)."""
    resources = {"CPU": cpus, "memory": 1e9, f"node:{address}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": address, "Resources": resources}


TWO_NODES = [_node("head", "10.99.0.1", 0.0), _node("w1", "10.99.0.2", 4.0)]


def test_view_from_the_session_clusters_real_nodes(ray_cluster) -> None:
    view = ClusterView.from_ray_nodes(ray_cluster.nodes(), attached=False)
    assert len(view.nodes) == 1 and view.nodes[0].cpus == 4.0 and view.gpus == 0.0
    assert decide_topology("auto", view) == Topology(False, "one local Ray node")


def test_topology_decisions() -> None:
    dead = _node("gone", "10.99.0.3", 4.0, alive=False)
    view = ClusterView.from_ray_nodes([*TWO_NODES, dead], attached=True, driver_node_id="head")
    assert [n.node_id for n in view.nodes] == ["head", "w1"]  # a lost node is not counted
    assert decide_topology("auto", view) == Topology(True, "2 alive Ray nodes")
    with pytest.raises(ConfigError, match=r"scaling.topology=single-node, but Ray reports 2 alive nodes"):
        decide_topology("single-node", view)

    head_only = ClusterView.from_ray_nodes(TWO_NODES[:1], attached=True)  # autoscaler adds workers later
    assert decide_topology("auto", head_only).multi_node
    assert "no CPUs" in decide_topology("auto", head_only).reason

    one = ClusterView.from_ray_nodes([_node("n", "127.0.0.1", 2.0)], attached=True)  # RAY_ADDRESS / job
    assert decide_topology("auto", one).multi_node and "RAY_ADDRESS" in decide_topology("auto", one).reason
    assert not decide_topology("single-node", one).multi_node
    local = ClusterView((), attached=False)  # no Ray yet: the driver will start one on this machine
    assert not decide_topology("auto", local).multi_node
    assert decide_topology("multi-node", local).multi_node
    assert joins_existing_cluster({"RAY_ADDRESS": "10.0.0.1:6379"})
    assert not joins_existing_cluster({"RAY_ADDRESS": ""}) and not joins_existing_cluster({})


MULTI = Topology(True, "2 alive Ray nodes")


def test_workers_that_a_single_node_cannot_hold_are_refused_with_the_numbers() -> None:
    """Ray would wait forever for CPUs a local cluster does not have; an attached cluster may autoscale."""
    quickstart = load_config(QUICKSTART)  # 1 worker x 2 CPUs
    local = ClusterView((), attached=False)  # the cluster this driver is about to start
    assert local_capacity_problem(quickstart, local, machine_cpus=2) is None
    line = local_capacity_problem(quickstart, local, machine_cpus=1)
    assert line == (
        "scaling.num_workers=1 x scaling.cpus_per_worker=2 = 2 CPUs, but the single-node Ray cluster of this "
        "run has 1: lower scaling.cpus_per_worker (torch threads follow it unless scaling.torch_threads is "
        "set) or scaling.num_workers"
    )
    four = load_config(QUICKSTART, ["scaling.num_workers=4", "scaling.cpus_per_worker=1"])
    in_process = ClusterView.from_ray_nodes([_node("n", "127.0.0.1", 3.0)], attached=False)
    assert "= 4 CPUs, but the single-node Ray cluster of this run has 3" in local_capacity_problem(
        four, in_process, machine_cpus=64
    )
    attached = ClusterView.from_ray_nodes([_node("n", "127.0.0.1", 3.0)], attached=True)
    assert local_capacity_problem(four, attached, machine_cpus=1) is None
    # scaling.use_gpu=true on a machine without GPUs: Ray waited for a GPU forever ("No available node
    # types can fulfill resource request"), as a large-batch config did when tried on a CPU machine.
    gpu = load_config(
        QUICKSTART, ["scaling.use_gpu=true", "scaling.num_workers=2", "scaling.cpus_per_worker=1"]
    )
    assert local_capacity_problem(gpu, local, machine_cpus=2, machine_gpus=2) is None
    assert local_capacity_problem(gpu, local, machine_cpus=2, machine_gpus=1) == (
        "scaling.use_gpu=true gives each of scaling.num_workers=2 a GPU, but the single-node Ray cluster of "
        "this run has 1: set scaling.num_workers=1 (the global batch stays train.global_batch_size) or "
        "scaling.use_gpu=false"
    )
    assert "has 0: set scaling.use_gpu=auto (CPU where there is no GPU)" in local_capacity_problem(
        gpu, local, machine_cpus=2, machine_gpus=0
    )
    auto = load_config(QUICKSTART, ["scaling.use_gpu=auto"])
    assert local_capacity_problem(auto, local, machine_cpus=2, machine_gpus=0) is None
    # auto on a machine with fewer GPUs than workers trains on GPUs: Ray waited for the missing one until
    # the worker group's start timed out
    two_auto = load_config(
        QUICKSTART, ["scaling.use_gpu=auto", "scaling.num_workers=2", "scaling.cpus_per_worker=1"]
    )
    assert local_capacity_problem(two_auto, local, machine_cpus=2, machine_gpus=2) is None
    assert local_capacity_problem(two_auto, local, machine_cpus=2, machine_gpus=1) == (
        "scaling.use_gpu=auto gives each of scaling.num_workers=2 a GPU, but the single-node Ray cluster of "
        "this run has 1: set scaling.num_workers=1 (the global batch stays train.global_batch_size) or "
        "scaling.use_gpu=false"
    )
    assert local_capacity_problem(gpu, attached, machine_cpus=2, machine_gpus=0) is None
    two_cpus = ClusterView.from_ray_nodes([_node("n", "127.0.0.1", 2.0)], attached=False)
    assert "of this run has 0: set" in local_capacity_problem(gpu, two_cpus, machine_cpus=2, machine_gpus=2)
    # GPU decoding without a GPU was refused only after the local Ray instance had started
    decode = load_config(QUICKSTART, ["data.decode=gpu"])
    assert local_capacity_problem(decode, local, machine_cpus=2, machine_gpus=0) == (
        "data.decode=gpu decodes on the training workers' GPUs, but the single-node Ray cluster of this run "
        "has none: set data.decode=auto or cpu"
    )
    assert local_capacity_problem(decode, local, machine_cpus=2, machine_gpus=1) is None


@pytest.mark.service
def test_the_capacity_check_counts_cpus_as_the_local_ray_node_will(tmp_path: Path) -> None:
    """A fresh local Ray node, started the way the driver starts one, has as many CPUs as the check counts,
    also for a process pinned to one CPU (Ray ignores the affinity mask; it follows a container's quota)."""
    code = (
        "import os, ray\n"
        "from dmltrain.service.run import local_node_cpus\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "counted = local_node_cpus()\n"
        "ray.init(include_dashboard=False, log_to_driver=False)\n"
        "print(counted, int(ray.cluster_resources()['CPU']))\n"
        "ray.shutdown()\n"
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    counted, ray_cpus = map(int, proc.stdout.split()[-2:])
    assert counted == ray_cpus


def test_default_config_on_a_multi_node_cluster_is_refused_one_line_per_setting() -> None:
    config = load_config(QUICKSTART)  # data/glyphs, ray_results, no tracking URI: the laptop defaults
    problems = storage_problems(config, "sqlite:////home/u/mlflow.db", True, MULTI)
    assert len(problems) == 3 and all("\n" not in p for p in problems)
    tracking, storage, data = problems
    assert tracking.startswith("mlflow.tracking_uri=sqlite:////home/u/mlflow.db (the default")
    assert "MLFLOW_TRACKING_URI" in tracking and "http(s)://" in tracking and "postgresql://" in tracking
    assert storage.startswith("run.storage_path=ray_results is relative") and "s3://" in storage
    assert data.startswith("data.root=data/glyphs is relative") and "shared" in data
    assert all("(2 alive Ray nodes)" in p for p in problems)
    assert storage_problems(config, "sqlite:////home/u/mlflow.db", True, Topology(False, "one")) == []


@pytest.mark.parametrize(
    ("uri", "refused"),
    [
        ("sqlite:///mlflow.db", True),
        ("file:///mnt/shared/mlruns", True),
        ("/mnt/shared/mlruns", True),
        ("mlruns", True),
        ("http://127.0.0.1:5000", True),
        ("http://localhost:5000", True),
        ("postgresql://u:p@localhost:5432/mlflow", True),
        ("http://127.0.1.1:5000", True),  # Debian's hostname alias: still this machine
        ("http://[0:0:0:0:0:0:0:1]:5000", True),
        ("http://localhost.:5000", True),
        ("http://127.1:5000", True),  # short IPv4 forms the resolver takes (inet_aton): still 127.0.0.1
        ("http://2130706433:5000", True),
        ("http://0x7f.1:5000", True),
        ("http://[::ffff:127.0.0.1]:5000", True),  # IPv4-mapped IPv6 loopback
        ("http://0:5000", True),  # 0.0.0.0: connecting to it reaches this machine
        ("http://localhost.localdomain:5000", True),
        ("http://mlflow.localhost:5000", True),  # *.localhost resolves to loopback (RFC 6761)
        ("postgresql:///mlflow?host=/var/run/postgresql", True),  # a socket on the driver's node
        ("http://mlflow.dmltrain.svc.cluster.local:5000", False),
        ("https://mlflow.example.com", False),
        ("postgresql://u:p@10.0.0.5:5432/mlflow", False),
        ("http://10.1:5000", False),  # a short form that is not loopback (10.0.0.1)
        ("http://[::ffff:10.0.0.5]:5000", False),
        ("http://localhostmlflow:5000", False),
        ("databricks", False),
    ],
)
def test_tracking_uris_on_a_multi_node_cluster(uri: str, refused: bool) -> None:
    config = load_config(
        QUICKSTART, ["data.root=s3://bucket/glyphs", "run.storage_path=/mnt/shared/ray", "data.prepare=null"]
    )
    problems = storage_problems(config, uri, False, MULTI)
    assert bool(problems) == refused, problems
    if refused:
        assert problems[0].startswith(f"mlflow.tracking_uri={uri} ") and "(the default" not in problems[0]


def test_paths_absolute_or_remote_pass_the_rules_and_relative_weights_do_not(tmp_path: Path) -> None:
    ok = load_config(
        QUICKSTART,
        [
            "data.root=/mnt/shared/shards/glyphs",
            "run.storage_path=s3://bucket/ray",
            "model.weights=IMAGENET1K_V1",
        ],
    )
    assert storage_problems(ok, "http://mlflow:5000", False, MULTI) == []
    weights = load_config(
        QUICKSTART,
        ["data.root=gs://b/x", "data.prepare=null", "run.storage_path=/mnt/r", "model.weights=w/r18.pt"],
    )
    (problem,) = storage_problems(weights, "http://mlflow:5000", False, MULTI)
    assert problem.startswith("model.weights=w/r18.pt is relative")


def test_paths_under_home_are_named_as_such_not_as_relative() -> None:
    """The rules see the config as written; resolve_paths (after them) expands ~ as a shell would, so a ~
    path is the driver's home directory, not the working directory."""
    config = load_config(
        QUICKSTART, ["data.root=~/shards/glyphs", "run.storage_path=file:~/ray", "data.prepare=null"]
    )
    storage, data = storage_problems(config, "http://mlflow:5000", False, MULTI)
    for problem, key in ((storage, "run.storage_path=file:~/ray"), (data, "data.root=~/shards/glyphs")):
        assert problem.startswith(f"{key} is under the driver's home directory (~)"), problem
        assert "working directory" not in problem


def test_use_gpu_auto_is_loud_when_it_means_cpu_on_a_cluster() -> None:
    assert resolve_use_gpu("auto", 8.0, MULTI) == (True, None)
    use_gpu, warning = resolve_use_gpu("auto", 0.0, MULTI)
    assert use_gpu is False and warning is not None and "scaling.use_gpu=true" in warning
    assert resolve_use_gpu("auto", 0.0, Topology(False, "one local Ray node")) == (False, None)
    assert resolve_use_gpu(True, 0.0, MULTI) == (True, None)  # waits for GPU nodes instead


def test_shared_path_check_with_the_driver_as_the_only_node_writes_nothing_behind(
    ray_cluster, tmp_path: Path
) -> None:
    """On one node there is nobody else to ask; the probe's token file must not stay in the storage."""
    config = load_config(QUICKSTART, [f"data.root={tmp_path}", f"run.storage_path={tmp_path / 'ray'}"])
    node_id = ray_cluster.get_runtime_context().get_node_id()
    view = ClusterView.from_ray_nodes(ray_cluster.nodes(), attached=False, driver_node_id=node_id)
    assert check_shared_paths(config, view) == []
    assert list((tmp_path / "ray").iterdir()) == []


def test_shared_path_check_names_what_another_node_sees_differently(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs as a Ray task pinned to each other node. Here the session's only node plays 'another
    node' while the driver's own view is replaced, so the node's real answers differ from it."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "dataset.json").write_text("{}")
    config = load_config(
        QUICKSTART,
        [f"data.root={shards}", f"run.storage_path={tmp_path / 'ray'}", "model.weights=/nonexistent/w.pt"],
    )
    view = ClusterView.from_ray_nodes(ray_cluster.nodes(), attached=False, driver_node_id="the-driver")
    monkeypatch.setattr("dmltrain.service.cluster.file_fingerprint", lambda path: "as the driver sees it")
    problems = check_shared_paths(config, view)
    address = view.nodes[0].address
    assert len(problems) == 3, problems
    storage, data, weights = problems
    assert storage.startswith(f"run.storage_path={tmp_path / 'ray'} is not shared: on node {address} ")
    assert "differs from the driver's" in storage and "s3://" in storage
    assert data.startswith(f"data.root={shards} is not shared") and "dataset.json differs" in data
    assert weights.startswith("model.weights=/nonexistent/w.pt is not shared") and "does not exist" in weights
    assert list((tmp_path / "ray").iterdir()) == []  # the token file is removed


def test_shared_path_check_names_an_experiment_whose_artifacts_stay_on_the_driver(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A database tracking store passed the checks while the experiment's artifact location was a path on
    the driver's disk: rank 0 on another node wrote plots, checkpoints and models to its own disk."""
    config = load_config(
        QUICKSTART,
        [
            "data.root=s3://bucket/data",
            "data.prepare=null",
            "run.storage_path=s3://bucket/runs",
            "mlflow.experiment=e1",
        ],
    )
    view = ClusterView.from_ray_nodes(ray_cluster.nodes(), attached=False, driver_node_id="the-driver")
    monkeypatch.setattr("dmltrain.service.cluster.file_fingerprint", lambda path: "as the driver sees it")
    artifacts = tmp_path / "mlruns" / "1"
    (problem,) = check_shared_paths(config, view, f"file://{artifacts}")
    assert problem.startswith(
        f"mlflow.experiment=e1 (artifacts at file://{artifacts}) is not shared: on node "
    )
    assert problem.endswith("(mlflow server --serve-artifacts)")
    assert list(artifacts.iterdir()) == []  # the token file is removed
    assert check_shared_paths(config, view, "mlflow-artifacts:/1") == []  # proxied by the server
    assert check_shared_paths(config, view, "s3://bucket/mlruns/1") == []


def test_cli_refuses_the_default_config_on_an_existing_cluster_before_any_worker(
    ray_cluster, tmp_path: Path
) -> None:
    """`python -m dmltrain.run configs/quickstart.yaml` joining a running cluster (RAY_ADDRESS, as under
    `ray job submit`): exit 2, one line per setting, no worker started, no MLflow store created."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "dmltrain.run", str(QUICKSTART)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "is relative" in line or "is a file" in line]
    assert len(errors) == 3, proc.stderr[-3000:]
    assert errors[0].startswith("error: mlflow.tracking_uri=sqlite:///")
    assert "RayTrainWorker" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "data").exists()


def test_workers_the_attached_cluster_cannot_host_now_are_named_once() -> None:
    """sop_smoothap_b16k.yaml asks for 8 workers of 12 CPUs; the shipped KubeRay pods have 32 CPUs and 4 GPUs,
    so two of them host 4. Ray Train waited for the rest and retried the worker group without end, with no
    word from dmltrain; an autoscaler may still add nodes, so it is a warning, not a refusal."""
    config = load_config(REPO / "configs" / "sop_smoothap_b16k.yaml")
    nodes = [_node("h", "10.0.0.1", 0), _node("a", "10.0.0.2", 32, 4), _node("b", "10.0.0.3", 32, 4)]
    view = ClusterView.from_ray_nodes(nodes, attached=True)
    assert placement_shortfall(config, view) == (
        "the cluster's 3 nodes now fit 4 of scaling.num_workers=8 workers of 12 CPUs + 1 GPU each (its "
        "largest node: 32 CPUs, 4 GPUs): Ray Train waits for nodes to join, and retries without end on a "
        "cluster that does not grow; lower scaling.cpus_per_worker or scaling.num_workers to fit it"
    )
    eight = load_config(REPO / "configs" / "sop_smoothap_b16k.yaml", ["scaling.cpus_per_worker=8"])
    assert placement_shortfall(eight, view) is None
    # GPUs bound it too; a local cluster is checked by local_capacity_problem instead
    few_gpus = ClusterView.from_ray_nodes([_node("a", "10.0.0.2", 96, 4)], attached=True)
    assert "fit 4 of scaling.num_workers=8" in (placement_shortfall(eight, few_gpus) or "")
    assert placement_shortfall(config, ClusterView.from_ray_nodes(nodes, attached=False)) is None
