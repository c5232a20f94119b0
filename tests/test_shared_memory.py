"""Shared memory (/dev/shm): what the loaders keep there, and one line when a node has too little.

The cases that need a small /dev/shm run in a child process with a mount namespace of its own and a real
tmpfs of the given size on /dev/shm (root, Linux; skipped with the reason elsewhere): as a container
without `--shm-size` has (64 MiB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dmltrain.data.errors import SharedMemoryError
from dmltrain.data.shared_memory import (
    eval_loader_bytes,
    explain_shared_memory_error,
    shared_memory_problem,
    shared_memory_size,
    train_loader_bytes,
)
from dmltrain.service.errors import FATAL_IN_LOOP, FATAL_IN_SETUP

REPO = Path(__file__).parents[1]


def _namespace_problem() -> str | None:
    if sys.platform != "linux":
        return "needs Linux mount namespaces"
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs on /dev/shm in a mount namespace"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    return None


needs_namespace = pytest.mark.skipif(_namespace_problem() is not None, reason=str(_namespace_problem()))


def with_small_shm(size_mb: int, code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run Python `code` (argv: `args`) in a mount namespace whose /dev/shm is a tmpfs of `size_mb`."""
    python = [sys.executable, "-c", textwrap.dedent(code), *args]
    script = f'mount -t tmpfs -o size={size_mb}m dmltrain-test-shm /dev/shm && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *python],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )


def test_the_estimates_follow_the_batch_not_the_loader_workers() -> None:
    """A rank's training loader keeps prefetch_factor + 1 local batches whatever its number of workers
    (their parts add up to the batch); an evaluation's loader keeps a batch per worker and prefetch."""
    side = 3 * 224 * 224
    assert train_loader_bytes(4096, 10, 224) == train_loader_bytes(4096, 2, 224) == 3 * 4096 * (side + 16)
    assert train_loader_bytes(4096, 0, 224) == 0 and eval_loader_bytes(128, 0, 224) == 0
    assert train_loader_bytes(4096, 10, 224, prefetch_factor=3) == 4 * 4096 * (side + 16)
    encoded = train_loader_bytes(4096, 10, 224, decode="gpu", encoded_bytes_per_image=50_000)
    assert encoded < train_loader_bytes(4096, 10, 224) / 2
    shared = train_loader_bytes(
        4096, 10, 224, decode="gpu", host_decode_share=0.5, encoded_bytes_per_image=50e3
    )
    assert encoded < shared < train_loader_bytes(4096, 10, 224)
    assert eval_loader_bytes(128, 10, 224) == 21 * 128 * (side + 16)


def test_this_machines_shared_memory_is_read_and_compared() -> None:
    size = shared_memory_size()
    if size is None:
        pytest.skip("no /dev/shm here")
    capacity, free = size
    assert 0 <= free <= capacity
    assert shared_memory_problem(capacity, "the loaders") is None
    problem = shared_memory_problem(capacity + 2**30, "the loaders")
    assert problem is not None and problem.startswith("the loaders would keep about")
    assert "/dev/shm holds" in problem and "--shm-size" in problem and "\n" not in problem


def test_a_shared_memory_without_a_size_limit_refuses_nothing(tmp_path: Path) -> None:
    """A tmpfs mounted with size=0 (no limit) reports 0 blocks: it was read as holding 0 MiB, and every run
    with loader workers was refused. Mounted in a private mount namespace (root and unshare needed)."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a tmpfs in a private namespace")
    folder = tmp_path / "shm"
    folder.mkdir()
    code = (
        "from dmltrain.data.shared_memory import shared_memory_problem, shared_memory_size; "
        f"print(shared_memory_size({str(folder)!r}), shared_memory_problem(2**40, 'x', path={str(folder)!r}))"
    )
    script = f'mount -t tmpfs -o size=0 tmpfs {folder} && exec {sys.executable} -c "{code}"'
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "None"]


def test_only_running_out_of_shared_memory_is_explained() -> None:
    """torch's two messages (no room for a new segment; a worker killed by SIGBUS) become one line; any
    other loader failure stays as it was. The error ends a run without a retry, set up or in the loop."""
    fallocate = RuntimeError(
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        "RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on "
        "device (28)"
    )
    bus = RuntimeError(
        "DataLoader worker (pid 123) is killed by signal: Bus error. It is possible that dataloader's "
        "workers are out of shared memory. Please try to raise your shared memory limit."
    )
    for exc in (fallocate, bus):
        error = explain_shared_memory_error(exc, 3 * 2**30, "this rank's training loader")
        assert isinstance(error, SharedMemoryError)
        assert "keeps about 3.0 GiB" in str(error) and "\n" not in str(error)
    assert explain_shared_memory_error(RuntimeError("CUDA out of memory"), 1, "x") is None
    assert issubclass(SharedMemoryError, FATAL_IN_SETUP) and issubclass(SharedMemoryError, FATAL_IN_LOOP)


@needs_namespace
def test_the_loaders_keep_what_they_estimate(glyphs_root: Path) -> None:
    """Measured on a /dev/shm of its own, with 2 worker processes each: the file system's peak use while a
    training loader runs, and, once that loader has released its buffers, while an evaluation's reader
    holds a batch for 10 s (its workers' prefetch queue fills, however slow the machine), against the
    estimates."""
    proc = with_small_shm(
        256,
        """
        import sys, time
        from dmltrain.data import EvalLoader, SamplerSpec, TrainLoader
        from dmltrain.data.shared_memory import eval_loader_bytes, shared_memory_size

        def used():
            return before - shared_memory_size()[1]

        layout = dict(rank=0, world_size=1, num_workers=2, image_size=64)
        before = shared_memory_size()[1]
        loader, peak = TrainLoader(sys.argv[1], 64, SamplerSpec(), **layout), 0
        for _ in range(8):
            loader.next_batch()
            peak = max(peak, used())
        print("train", peak, loader.shared_memory_bytes())
        loader.close()
        del loader
        # Its workers let go of their buffers as they exit: measured from the same baseline only once
        # they have (else what they free while the evaluation runs hides what the evaluation takes).
        deadline = time.monotonic() + 60
        while used() > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        print("released", used())
        peak = 0
        for i, _ in enumerate(EvalLoader(sys.argv[1], "test", 64, **layout)):
            if i == 2:  # a slow reader: the workers fill their prefetch queue while it holds a batch
                for _ in range(100):
                    time.sleep(0.1)
                    peak = max(peak, used())
                break
        print("eval", peak, eval_loader_bytes(64, 2, 64))
        """,
        str(glyphs_root),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in proc.stdout.splitlines():
        if line.startswith(("train ", "eval ")):
            name, used, estimate = line.split()
            print(f"{name}: shared memory in use {used} bytes, estimated {estimate}")
            assert 0.75 * int(estimate) <= int(used) <= 1.5 * int(estimate), line
    assert "train " in proc.stdout and "eval " in proc.stdout, proc.stdout
    assert "released 0" in proc.stdout, proc.stdout  # the training loader's buffers all went back


@needs_namespace
def test_loaders_out_of_shared_memory_fail_in_one_line(glyphs_root: Path) -> None:
    """A 16 MiB /dev/shm: the training loader's second step and an evaluation's first batch do not fit."""
    proc = with_small_shm(
        16,
        """
        import sys
        from dmltrain.data import EvalLoader, SamplerSpec, TrainLoader
        from dmltrain.data.errors import SharedMemoryError

        layout = dict(rank=0, world_size=1, num_workers=2)
        loader = TrainLoader(sys.argv[1], 64, SamplerSpec(), image_size=224, **layout)
        try:
            for _ in range(4):
                loader.next_batch()
            print("train: no error")
        except SharedMemoryError as error:
            print("train:", error)
        finally:
            loader.close()
        try:
            for _ in EvalLoader(sys.argv[1], "test", 128, **layout):
                pass
            print("eval: no error")
        except SharedMemoryError as error:
            print("eval:", error)
        """,
        str(glyphs_root),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    train = next(line for line in lines if line.startswith("train:"))
    assert "ran out of shared memory (/dev/shm holds 16 MiB" in train, proc.stdout
    assert "this rank's training loader keeps about 28 MiB" in train and "--shm-size" in train
    evaluation = next(line for line in lines if line.startswith("eval:"))
    assert "this rank's test loader keeps about 92 MiB" in evaluation, proc.stdout


@needs_namespace
def test_the_driver_refuses_a_run_whose_loaders_overflow_shm_before_ray_starts(
    glyphs_root: Path, tmp_path: Path
) -> None:
    """The quickstart at 224 px in a container's default 64 MiB of /dev/shm: one line naming the keys,
    exit 2, before Ray starts."""
    run = [sys.executable, "-m", "dmltrain.run", "configs/quickstart.yaml", f"data.root={glyphs_root}"]
    run += ["data.prepare=null", "data.loader_workers=2", "data.image_size=224", "data.resize=256"]
    run += [f"run.storage_path={tmp_path}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    code = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    proc = with_small_shm(64, code, *run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert "the loaders of 1 rank(s) (128 images a rank at 224 px: train.global_batch_size=128" in error
    assert "data.loader_workers=2, data.decode=cpu, eval.batch_size=256)" in error
    assert "but /dev/shm holds 64 MiB on this node" in error and "--shm-size" in error
    assert "Started a local Ray instance" not in proc.stderr and "Traceback" not in proc.stderr


@needs_namespace
def test_a_sweep_whose_trial_overflows_shm_is_refused_before_ray_starts(
    glyphs_root: Path, tmp_path: Path
) -> None:
    """`dmltrain sweep` checks every trial's loaders against this node's /dev/shm as a run's driver does,
    naming the trial: before, the sweep started Ray and the parent run, and the trial failed inside Tune."""
    import yaml

    sweep = tmp_path / "sweep.yaml"
    overrides = {"data.root": str(glyphs_root), "data.prepare": None, "data.loader_workers": 2}
    overrides |= {"run.storage_path": str(tmp_path), "mlflow.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    variants = [
        {"name": "64px", "overrides": {"data.image_size": 64, "data.resize": 64}},
        {"name": "224px", "overrides": {"data.image_size": 224, "data.resize": 256}},
    ]
    base = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    spec = {"name": "shm", "base": str(base), "overrides": overrides}
    sweep.write_text(yaml.safe_dump({**spec, "variants": variants}))
    code = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    proc = with_small_shm(64, code, sys.executable, "-m", "dmltrain.service.cli", "sweep", str(sweep))
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert "sweep shm, trial '224px': the loaders of 1 rank(s) (128 images a rank at 224 px" in error, error
    assert "but /dev/shm holds 64 MiB on this node" in error
    assert "Started a local Ray instance" not in proc.stderr and "Traceback" not in proc.stderr
    if (tmp_path / "mlflow.db").exists():  # the store may have been probed; no parent run was started
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        experiments = [e.experiment_id for e in client.search_experiments()]
        assert client.search_runs(experiments) == []


@needs_namespace
def test_a_worker_checks_its_own_node_for_all_of_its_ranks(glyphs_root: Path, tmp_path: Path) -> None:
    """On a multi-node cluster the driver cannot see a node's /dev/shm: each worker's setup checks it for
    the ranks Ray placed there (Ray Train's local world size), before its loader starts."""
    code = """
        import sys, torch
        from dmltrain.data.errors import SharedMemoryError
        from dmltrain.service.config import flatten, load_config, to_yaml
        from dmltrain.service.tracking import start_or_resume_run
        from dmltrain.service.train import WorkerLoop

        class Context:  # Ray Train's worker context, as the loop uses it during setup
            rank, world_size, device = 0, 1, torch.device("cpu")
            def __init__(self, local): self.local_world_size = local
            def prepare_model(self, model): return model
            def get_checkpoint(self): return None

        root, store = sys.argv[1], sys.argv[2]
        overrides = [f"data.root={root}", "data.prepare=null", "data.loader_workers=1", "data.image_size=64",
                     "data.resize=64", "train.global_batch_size=16", "train.chunk_size=16"]
        overrides.append(f"run.storage_path={store}")
        config = load_config("configs/quickstart.yaml", overrides)
        uri = f"sqlite:///{store}/mlflow.db"
        run_id, _ = start_or_resume_run(uri, "shm", store, "shm", flatten(config), to_yaml(config))
        for local in (1, 4):
            try:
                WorkerLoop(config, run_id, uri, Context(local))
                print(local, "ranks: set up")
            except SharedMemoryError as error:
                print(local, "ranks:", error)
        """
    proc = with_small_shm(24, code, str(glyphs_root), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 ranks: set up" in proc.stdout, proc.stdout
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("4 ranks:"))
    assert "the loaders of 4 rank(s) (16 images a rank at 64 px" in refused
    assert "but /dev/shm holds 24 MiB on this node" in refused
