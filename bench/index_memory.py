"""Memory of several processes serving one stored index: mapped (what `load_index` does) vs read into memory.

A search service runs one model server per worker (`dmltrain serve --workers N`), and each loads the index.
Read into memory, every process holds its own copy; mapped (faiss's ``IO_FLAG_MMAP_IFC``), the vectors and
codes live once in the page cache and every process shares them; so do the id map's columns. This starts
``--processes`` processes per case that load the same stored index and id map, search it (touching every
page a search needs), and, all alive at once, report their memory from ``/proc/self/smaps_rollup``: private
(anonymous) memory each, and the sum of their proportional set sizes (shared pages divided among the
processes that map them).

    python bench/index_memory.py                       # 500k x 512 flat and IVF-PQ, 2 processes
    python bench/index_memory.py --n 100000 --kinds flat,hnsw
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _memory_mb() -> dict[str, float]:
    fields = {}
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                fields[name] = int(rest.split()[0]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"], "private": fields["Anonymous"]}


def _serve_once(directory: str, mapped: bool, queries: np.ndarray, barrier: Any, out: Any) -> None:
    import dmltrain.index as index_module

    if not mapped:  # the read-into-memory baseline: index and id map
        index_module._read_flags = lambda faiss: 0

        def read_instead(path: Any, member: str) -> np.ndarray:
            raise ValueError("baseline: read, not mapped")

        index_module._mapped_member = read_instead
    started = time.perf_counter()
    stored = index_module.load_index(directory)
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    stored.search(queries, 10)
    searched = time.perf_counter() - started
    barrier.wait()  # every process has loaded and searched: shared pages are shared now
    out.put({**_memory_mb(), "load_s": loaded, "qps": len(queries) / searched})
    barrier.wait()  # stay alive until every process has measured


def _run_case(directory: str, mapped: bool, queries: np.ndarray, processes: int) -> list[dict[str, float]]:
    context = mp.get_context("spawn")
    barrier, out = context.Barrier(processes), context.Queue()
    children = [
        context.Process(target=_serve_once, args=(directory, mapped, queries, barrier, out))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    results = [out.get(timeout=1800) for _ in children]
    for child in children:
        child.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=500_000, help="gallery rows (default 500,000)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--kinds", default="flat,ivfpq", help="index kinds, comma-separated")
    parser.add_argument("--processes", type=int, default=2, help="server processes per case")
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args()

    import faiss

    from dmltrain.index import IdMap, build_index, save_index

    rng = np.random.default_rng(0)
    gallery = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = gallery[rng.choice(args.n, args.queries, replace=False)]
    # Keys as long as a real data set's (SOP: "bicycle_final/111085122871_0.JPG"-like source names)
    keys = [f"product_final/{i:012d}_{i % 7}" for i in range(args.n)]
    ids = IdMap(np.zeros(args.n, np.int64), keys, np.arange(args.n, dtype=np.int64) // 5)
    mapping = "available" if hasattr(faiss, "IO_FLAG_MMAP_IFC") else "absent"
    print(
        f"gallery {args.n:,} x {args.dim}, {args.processes} processes per case, {args.queries} queries "
        f"each; faiss {faiss.__version__} (mapping {mapping})"
    )
    columns = ["index", "file MB", "loaded as", "private MB per process", "Pss MB, all processes", "load s"]
    print("| " + " | ".join([*columns, "queries/s"]) + " |")
    print("|---|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-index-memory-") as tmp:
        for kind in args.kinds.split(","):
            directory = str(Path(tmp) / kind)
            save_index(directory, build_index(gallery, kind), ids, {})  # type: ignore[arg-type]
            size = (Path(directory) / "index.faiss").stat().st_size / 2**20
            rows = {mapped: _run_case(directory, mapped, queries, args.processes) for mapped in (False, True)}
            for mapped, results in rows.items():
                private = max(r["private"] for r in results)
                pss = sum(r["pss"] for r in results)
                load = max(r["load_s"] for r in results)
                qps = min(r["qps"] for r in results)
                how = "mapped" if mapped else "read"
                cells = [
                    kind,
                    f"{size:,.0f}",
                    how,
                    f"{private:,.0f}",
                    f"{pss:,.0f}",
                    f"{load:.2f}",
                    f"{qps:,.0f}",
                ]
                print("| " + " | ".join(cells) + " |")
            ratio = sum(r["pss"] for r in rows[False]) / max(sum(r["pss"] for r in rows[True]), 1e-9)
            print(f"|  |  | read / mapped |  | {ratio:.2f}x |  |  |")


if __name__ == "__main__":
    main()
