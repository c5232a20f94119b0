"""scaling.ray_priority: which of Ray's processes go under SCHED_IDLE, on a real local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dmltrain.service.config import ConfigError, load_config
from dmltrain.service.ray_priority import BOOKKEEPING_ACTORS, actor_class
from dmltrain.service.run import resolve_ray_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def test_actor_class_from_process_title():
    assert actor_class("ray::TrainController.run") == "TrainController"
    assert actor_class("ray::_AutoscalingCoordinatorActor") == "_AutoscalingCoordinatorActor"
    assert actor_class("ray::RayTrainWorker._RayTrainWorker__execute.get_next") == "RayTrainWorker"
    assert actor_class("ray::IDLE") == "IDLE"
    assert actor_class("/usr/bin/python -m dmltrain.run configs/quickstart.yaml") is None
    assert actor_class("ray::") is None
    # The training workers and Ray's pool of idle workers (future training workers) are never demoted.
    assert not {"RayTrainWorker", "IDLE"} & BOOKKEEPING_ACTORS


def test_auto_is_idle_for_cpu_training_on_one_node():
    path = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    config = load_config(path)
    assert config.scaling.ray_priority == "auto"
    assert resolve_ray_priority(config, multi_node=False, use_gpu=False) == "idle"
    assert resolve_ray_priority(config, multi_node=True, use_gpu=False) == "normal"
    assert resolve_ray_priority(config, multi_node=False, use_gpu=True) == "normal"
    explicit = load_config(path, ["scaling.ray_priority=idle"])
    assert resolve_ray_priority(explicit, multi_node=True, use_gpu=True) == "idle"
    assert resolve_ray_priority(load_config(path, ["scaling.ray_priority=normal"]), False, False) == "normal"
    with pytest.raises(ConfigError, match=r"scaling\.ray_priority"):
        load_config(path, ["scaling.ray_priority=low"])


# Runs in a process of its own: demoting is for good (raising a priority back needs privileges), and the
# test session's own Ray cluster and this process must keep theirs.
_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import ray
    from dmltrain.service.ray_priority import bookkeeping_processes, keep_ray_in_background

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)

    @ray.remote(num_cpus=0)
    class SynchronizationActor:  # named like Ray Train's barrier actor: bookkeeping
        def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Embedder:  # a user's actor: real work, left alone
        def pid(self):
            return os.getpid()

    book, user = SynchronizationActor.remote(), Embedder.remote()
    book_pid, user_pid = ray.get([book.pid.remote(), user.pid.remote()])
    session = ray.get_runtime_context().get_session_name()

    def policies(pid):
        out = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out.append(os.sched_getscheduler(int(tid)) == os.SCHED_IDLE)
            except ProcessLookupError:
                pass
        return out

    def find(name):
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmd = open(f"/proc/{pid}/cmdline").read()
                except OSError:
                    continue
                if session in cmd and os.path.basename(cmd.split(chr(0))[0]) == name:
                    return int(pid)

    gcs, raylet = find("gcs_server"), find("raylet")
    chosen = bookkeeping_processes(session)
    with keep_ray_in_background(session, every_s=0.2, max_every_s=0.2) as done:
        time.sleep(0.5)
        inside = threading.Thread(target=time.sleep, args=(5,))  # as the driver's trainer.fit() thread
        inside.start()
        time.sleep(0.6)
    late = threading.Thread(target=time.sleep, args=(5,))
    late.start()
    me = os.getpid()
    print(json.dumps({
        "chosen": chosen, "gcs": gcs, "raylet": raylet, "book": book_pid, "user": user_pid,
        "demoted": sorted(done.processes), "refused": sorted(done.refused),
        "gcs_idle": policies(gcs), "raylet_idle": policies(raylet),
        "book_idle": policies(book_pid), "user_idle": policies(user_pid),
        "main_idle": os.sched_getscheduler(threading.main_thread().native_id) == os.SCHED_IDLE,
        "late_idle": os.sched_getscheduler(late.native_id) == os.SCHED_IDLE,
        "inside_idle": os.sched_getscheduler(inside.native_id) == os.SCHED_IDLE,
        "driver_idle": policies(me), "me": me,
    }))
    ray.shutdown()
    """
)


def test_bookkeeping_processes_go_idle_and_workers_stay(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["gcs"] and seen["raylet"], "could not find the session's gcs_server and raylet"
    assert seen["gcs"] in seen["chosen"] and seen["book"] in seen["chosen"]
    assert seen["raylet"] not in seen["chosen"] and seen["user"] not in seen["chosen"]
    assert seen["me"] not in seen["chosen"]  # the driver is handled thread by thread
    assert seen["refused"] == []
    assert {seen["gcs"], seen["book"], seen["me"]} <= set(seen["demoted"])
    assert all(seen["gcs_idle"]) and all(seen["book_idle"])  # every thread
    assert not any(seen["raylet_idle"])  # it starts the workers, which would inherit SCHED_IDLE for good
    assert not any(seen["user_idle"])
    # The driver: Ray's threads go; its main thread, the caller's (the same here), and threads it starts
    # after the block keep their priority.
    assert not seen["main_idle"] and not seen["late_idle"]
    assert seen["inside_idle"]  # one the caller starts in the block (trainer.fit()'s) goes at the next look
    assert any(seen["driver_idle"]) and not all(seen["driver_idle"])
