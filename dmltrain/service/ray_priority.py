"""Ray's own processes out of the training threads' way on a single CPU node (``scaling.ray_priority``).

A CPU training step wants both of a small node's cores in short bursts (OpenMP regions, one barrier after
another). Ray's bookkeeping processes (GCS, dashboard, log monitor, the node's agents, Ray Train's controller
and helper actors) take little CPU, but each wakes about 100 times a second, and a waking process at normal
priority preempts a compute thread while the other waits at the next barrier. Under Linux ``SCHED_IDLE`` they
run only in the cycles the training leaves idle and never preempt it (bench/ray_priority.py).

The driver's threads that only wait on Ray go too, but not its main thread or the one that started the run.
Left alone: raylet, because it starts the worker processes and a process started under ``SCHED_IDLE`` cannot
leave it without privileges; every worker process that is not a known bookkeeping actor (training workers
and their loaders, Ray's pool of idle workers that may become training workers, user actors).
Linux only; elsewhere, and for processes of another user, nothing changes (one log line).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dmltrain.service.processes import children_by_parent, subtree

log = logging.getLogger(__name__)

# Actor classes (the process title Ray gives their worker process, "ray::<Class>[.<method>]") that only
# keep Ray's and Ray Train's books: never a training step, never a user's work.
BOOKKEEPING_ACTORS = frozenset(
    {
        "DashboardAgent",
        "RuntimeEnvAgent",
        "JobSupervisor",
        "TrainController",
        "TrainStateActor",
        "SynchronizationActor",
        "PlacementGroupCleaner",
        "PreemptionWatcher",
        "DatasetManager",
        "_AutoscalingCoordinatorActor",
    }
)
RAYLET = "raylet"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # exited meanwhile
        return ""


def actor_class(cmdline: str) -> str | None:
    """``"ray::TrainController.run"`` -> ``"TrainController"``; None for a process that is not an actor."""
    if not cmdline.startswith("ray::"):
        return None
    return cmdline[len("ray::") :].split(" ", 1)[0].split(".", 1)[0] or None


def _is_raylet(cmdline: str) -> bool:
    return Path(cmdline.split(" ", 1)[0]).name == RAYLET


def bookkeeping_processes(session_name: str) -> list[int]:
    """This Ray session's bookkeeping processes on this machine: the session's daemons (the processes whose
    command line names the session, but raylet and the workers it starts) with the processes below them,
    and raylet's children that are bookkeeping actors, with theirs."""
    children = children_by_parent()
    parents = {pid: parent for parent, pids in children.items() for pid in pids}
    commands = {pid: _cmdline(pid) for pid in parents}
    session = {pid for pid, command in commands.items() if session_name in command}
    raylets = {pid for pid in session if _is_raylet(commands[pid])}
    chosen: list[int] = []
    for raylet in raylets:
        for child in children.get(raylet, []):
            if actor_class(commands.get(child, "")) in BOOKKEEPING_ACTORS:
                chosen += subtree(child, children)
    # A worker that has not yet set its title still names the session (and raylet is its parent).
    for pid in session - raylets:
        if parents[pid] not in raylets:
            chosen += subtree(pid, children)
    return sorted(set(chosen))


@dataclass
class Demotions:
    """What `keep_ray_in_background` did: processes put under SCHED_IDLE, processes it was not allowed to."""

    processes: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)


def demote(pids: list[int], done: Demotions, spare: frozenset[int] = frozenset()) -> None:
    """Every thread of ``pids`` but those in ``spare`` under SCHED_IDLE (the threads a demoted thread starts
    inherit it)."""
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # exited meanwhile
            continue
        for tid in threads:
            if tid in spare:
                continue
            try:
                if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:
                continue
            except PermissionError:
                done.refused.add(pid)
                break
        else:
            done.processes.add(pid)


@contextmanager
def keep_ray_in_background(
    session_name: str, every_s: float = 1.0, max_every_s: float = 30.0
) -> Iterator[Demotions]:
    """While the block runs, put the session's bookkeeping processes under SCHED_IDLE, looking again after
    ``every_s`` seconds, then twice as long each time up to ``max_every_s`` (Ray Train starts its controller
    and helpers after the block starts; a look costs about 15 ms of a core). Lowering a priority needs no
    privilege; Ray's processes stay demoted after the block (raising it back would)."""
    done = Demotions()
    if not hasattr(os, "SCHED_IDLE"):
        log.info("scaling.ray_priority=idle: this OS has no SCHED_IDLE; Ray's processes keep their priority")
        yield done
        return
    stop = threading.Event()
    # This process (the driver) waits on Ray in threads of Ray's and its own: those go too (this one as
    # well), but not the main thread and the caller's, which go on after the block (publishing the models,
    # a sweep's next step) and whose later threads inherit their priority.
    spare = frozenset({threading.main_thread().native_id or 0, threading.get_native_id()})

    def keep() -> None:
        wait = every_s
        while True:
            try:
                demote(bookkeeping_processes(session_name), done)
                demote([os.getpid()], done, spare=spare)
            except Exception as exc:  # a priority is never worth a run: say so once and stop looking
                log.warning("scaling.ray_priority=idle: stopped lowering Ray's priority: %r", exc)
                return
            if stop.wait(wait):
                return
            wait = min(2 * wait, max_every_s)

    thread = threading.Thread(target=keep, name="dmltrain-ray-priority", daemon=True)
    thread.start()
    try:
        yield done
    finally:
        stop.set()
        thread.join(timeout=10)
        if done.refused:
            log.info(
                "scaling.ray_priority=idle: %d of Ray's processes belong to another user and kept their "
                "priority",
                len(done.refused),
            )
