"""faiss index build and query throughput against exact search, with recall@10.

Synthetic but clustered data, so that nearest neighbours are meaningful: ``--clusters`` random unit centres,
each gallery vector a centre plus Gaussian noise, renormalised (about 50 vectors per cluster at 1M), queries
drawn the same way. Every index kind dmltrain builds (``dmltrain.index``) is timed in this one process
against an exact ``IndexFlatIP`` scan of the same gallery; recall@10 is the share of each query's exact top 10
that the index returns in its top 10.

    python bench/index.py            # 1M x 128, 2,000 queries (a few minutes on 2 cores)
    python bench/index.py --quick    # 100k x 128, 500 queries (seconds)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def clustered(n: int, dim: int, centres: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` unit vectors around random ``centres`` (cosine to the centre about 1/sqrt(1+noise^2))."""
    out = np.empty((n, dim), dtype=np.float32)
    step = 1 << 17
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        which = rng.integers(0, len(centres), hi - lo)
        x = centres[which] + rng.standard_normal((hi - lo, dim), dtype=np.float32) * (noise / np.sqrt(dim))
        out[lo:hi] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100k gallery, 500 queries")
    parser.add_argument("--n", type=int, default=None, help="gallery size (default 1,000,000; quick 100,000)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=None, help="default 2,000 (quick 500)")
    parser.add_argument("--clusters", type=int, default=None, help="default n / 50")
    parser.add_argument("--noise", type=float, default=1.0, help="noise norm relative to the unit centre")
    parser.add_argument("--kinds", default="ivfpq,ivfpq-norefine,hnsw", help="comma-separated index kinds")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import faiss

    from dmltrain.index import build_index, choose_spec, neighbour_recall

    n = args.n or (100_000 if args.quick else 1_000_000)
    nq = args.queries or (500 if args.quick else 2_000)
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((args.clusters or max(1, n // 50), args.dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    t0 = time.perf_counter()
    gallery = clustered(n, args.dim, centres, args.noise, rng)
    queries = clustered(nq, args.dim, centres, args.noise, rng)
    print(
        f"gallery {n:,} x {args.dim} in {len(centres):,} clusters (noise {args.noise}), {nq:,} queries, "
        f"k={args.k}; faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads, "
        f"{faiss.get_num_gpus() if hasattr(faiss, 'get_num_gpus') else 0} GPUs, {os.cpu_count()} cores; "
        f"data generated in {time.perf_counter() - t0:.1f} s"
    )

    def measure(label: str, spec: object) -> dict[str, object]:
        built = build_index(gallery, spec)  # type: ignore[arg-type]
        built.search(queries[:10], args.k)  # warm-up (GPU copy, page-in)
        started = time.perf_counter()
        _, ids = built.search(queries, args.k)
        seconds = time.perf_counter() - started
        return {
            "label": label,
            "spec": built.spec.describe(),
            "build": built.build_seconds,
            "qps": nq / seconds,
            "ids": ids,
            "bytes": faiss.serialize_index(built.index).nbytes,
        }

    rows = [measure("exact (flat)", choose_spec(n, args.dim, "flat"))]
    exact_ids = rows[0]["ids"]
    for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
        if kind == "ivfpq-norefine":
            rows.append(measure("IVF-PQ, no re-rank", choose_spec(n, args.dim, "ivfpq", refine=0)))
        else:
            rows.append(measure(kind, choose_spec(n, args.dim, kind)))  # type: ignore[arg-type]
    base_qps = float(rows[0]["qps"])  # type: ignore[arg-type]
    print()
    print(f"| index | parameters | build s | queries/s | vs exact | recall@{args.k} | size MB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        recall = neighbour_recall(row["ids"], exact_ids)  # type: ignore[arg-type]
        print(
            f"| {row['label']} | {row['spec']} | {row['build']:.1f} | {row['qps']:,.0f} | "
            f"{float(row['qps']) / base_qps:.1f}x | {recall:.3f} | {int(row['bytes']) / 2**20:,.0f} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
