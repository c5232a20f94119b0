"""Benchmark: what Ray's bookkeeping processes cost a CPU training step at Ray's priority and under
SCHED_IDLE (scaling.ray_priority).

    python bench/ray_priority.py               # 12 rounds of 12-step blocks (as root)
    python bench/ray_priority.py --rounds 3    # smoke

The baseline bare loop of bench/service.py (the quickstart's resnet18 at 32 px, Smooth-AP, fused Adam,
global batch 128 of decoded glyph batches, 2 torch threads, the workers' OpenMP and malloc settings) runs
as a Ray Train worker (TorchTrainer, 1 worker x 2 CPUs) on a local Ray cluster started as the service
starts one. In every round it runs one block with Ray's bookkeeping processes at the priority Ray gave
them and one with them under SCHED_IDLE (the processes and threads the service demotes:
dmltrain.service.ray_priority; the order alternates, one untimed step first), switching them back and forth
itself, so both sample the same minutes of a machine whose speed drifts. Taking a thread back out of
SCHED_IDLE needs root (CAP_SYS_NICE); the service never does. Prints the median and mean seconds per step
of each, the round-by-round ratio and how many rounds each won.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIG = ROOT / "configs" / "quickstart.yaml"
MODES = ("ray", "idle")


def _threads(pids: list[int], spare: set[int]) -> list[int]:
    found = []
    for pid in pids:
        try:
            found += [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) not in spare]
        except OSError:  # exited meanwhile
            continue
    return found


def _set_mode(mode: str, spec: dict[str, Any]) -> int:
    """Ray's bookkeeping processes and the driver's Ray threads at Ray's priority or under SCHED_IDLE;
    returns how many threads that concerned."""
    from dmltrain.service.ray_priority import bookkeeping_processes

    pids = [*bookkeeping_processes(spec["session"]), spec["driver"]]
    tids = _threads(pids, set(spec["spare"]))
    policy = os.SCHED_IDLE if mode == "idle" else os.SCHED_OTHER
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))  # keeps the thread's niceness
        except ProcessLookupError:
            continue
    return len(tids)


def _worker(spec: dict[str, Any]) -> None:
    """Ray Train worker function: the blocks, in alternating order; results through a file."""
    import torch
    from service import _bare_step

    from dmltrain.service.config import load_config

    torch.set_num_threads(2)
    step = _bare_step(load_config(CONFIG, spec["overrides"]), spec["batches"], ddp=False, fused=True)
    for i in range(3):
        step(i)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    threads = 0
    for r in range(spec["rounds"]):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            threads = max(threads, _set_mode(mode, spec))
            step(0)  # untimed: the switch itself and cold caches
            start = time.perf_counter()
            for i in range(spec["steps"]):
                step(i)
            seconds[mode].append((time.perf_counter() - start) / spec["steps"])
    _set_mode("ray", spec)
    Path(spec["out"]).write_text(json.dumps({"seconds": seconds, "threads": threads}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per block")
    parser.add_argument("--data", default=None, help="glyph shards (default: built under --workdir)")
    parser.add_argument("--workdir", default="/tmp/dmltrain-bench-ray-priority")
    args = parser.parse_args()
    if not hasattr(os, "SCHED_IDLE"):
        sys.exit("needs Linux (SCHED_IDLE)")
    if os.geteuid() != 0:
        sys.exit("needs root: taking Ray's threads back out of SCHED_IDLE between blocks needs CAP_SYS_NICE")

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from service import _load, decode_batches

    from dmltrain.data import ensure_glyphs
    from dmltrain.service.config import load_config
    from dmltrain.service.run import connect_ray, worker_env_vars

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else Path(ensure_glyphs(workdir / "glyphs"))
    overrides = [f"data.root={data}", "data.prepare=null"]
    config = load_config(CONFIG, overrides)
    print(
        f"ray_priority benchmark, {time.strftime('%Y-%m-%d %H:%M')}, load average {_load()}; "
        f"{os.cpu_count()} cores; {args.rounds} rounds of {args.steps}-step blocks per mode"
    )
    out = workdir / f"blocks-{os.getpid()}.json"
    connect_ray()  # a local cluster, as the service starts one
    try:
        spec = {
            "overrides": overrides,
            "batches": decode_batches(config, 4),
            "rounds": args.rounds,
            "steps": args.steps,
            "session": ray.get_runtime_context().get_session_name(),
            "driver": os.getpid(),
            "spare": [threading.main_thread().native_id],  # as the service spares the driver's main thread
            "out": str(out),
        }
        env = {**worker_env_vars(config), "PYTHONPATH": f"{ROOT}:{ROOT / 'bench'}"}
        TorchTrainer(
            _worker,
            train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2}),
            run_config=RunConfig(
                storage_path=str(workdir / "ray_results"),
                name=f"ray-priority-{int(time.time())}",
                worker_runtime_env={"env_vars": env},
            ),
        ).fit()
    finally:
        ray.shutdown()
    result = json.loads(out.read_text())
    seconds = result["seconds"]
    base = statistics.median(seconds["ray"])
    print(f"threads switched: {result['threads']} (Ray's bookkeeping processes and the driver's Ray threads)")
    print("| Ray's bookkeeping processes | median s/step | mean s/step | img/s (median) | vs Ray's prio. |")
    print("|---|---:|---:|---:|---:|")
    batch = config.train.global_batch_size
    for mode, label in (("ray", "at Ray's priority"), ("idle", "under SCHED_IDLE")):
        median = statistics.median(seconds[mode])
        print(
            f"| {label} | {median:.4f} | {statistics.mean(seconds[mode]):.4f} | {batch / median:.0f} | "
            f"{base / median:.3f}x |"
        )
    ratios = [r / i for r, i in zip(seconds["ray"], seconds["idle"], strict=True)]
    wins = sum(x > 1 for x in ratios)
    print(
        f"round by round, Ray's priority / SCHED_IDLE: {' '.join(f'{x:.2f}' for x in ratios)}; "
        f"SCHED_IDLE faster in {wins} of {len(ratios)} rounds (median {statistics.median(ratios):.3f}x)"
    )
    print(f"load average at the end: {_load()}")


if __name__ == "__main__":
    main()
