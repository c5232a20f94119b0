"""Benchmark: exact leave-one-out retrieval metrics next to a raw faiss search and pytorch-metric-learning.

    python bench/evaluation.py            # 60,000 x 512, SOP-like classes (about 5 images each)
    python bench/evaluation.py --quick    # 8,000 x 512, for a smoke run

For each embedding scenario it times, in one process and on the same data:
  - raw faiss: IndexFlatIP on normalised vectors, k = the largest cut-off the metrics need
    (max(Recall@K cut-offs, largest class - 1) + 1 for the query itself): the cost of the search alone;
  - torch matmul only: every similarity once, in the same blocks (the floor under any exact method);
  - dmltrain: `retrieval_metrics` (Recall@1/2/4/8, full-ranking mAP, MAP@R, R-precision);
  - PML: pytorch-metric-learning's AccuracyCalculator (precision_at_1, r_precision, MAP@R, k=max_bin_count).
Scenarios: "trained" (class centres plus noise, Recall@1 around 0.7, like a fine-tuned model) and "random"
(i.i.d. vectors, like an untrained model: positives sit deep in the ranking, the hard case for counting).
Goals: dmltrain within 1.2x the raw faiss search and faster than PML. Other processes may share the cores:
compare the ratios, which are measured back to back in this run.
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np
import torch

from dmltrain.evaluation import retrieval_metrics

KS = (1, 2, 4, 8)


def sop_like_labels(n: int, rng: np.random.Generator) -> np.ndarray:
    """Class sizes 2..12 with mean about 5.3, as in Stanford Online Products' test split."""
    sizes = np.clip(2 + rng.poisson(3.3, size=n), 2, 12)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), n)) + 1]
    sizes[-1] -= int(sizes.sum() - n)
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return labels[rng.permutation(n)]


def embeddings(labels: np.ndarray, dim: int, scenario: str, rng: np.random.Generator) -> np.ndarray:
    if scenario == "random":
        x = rng.standard_normal((len(labels), dim), dtype=np.float32)
    else:
        centres = rng.standard_normal((int(labels.max()) + 1, dim), dtype=np.float32)
        x = centres[labels] + 2.2 * rng.standard_normal((len(labels), dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class Clock:
    """Wall and process CPU seconds of a block: CPU time shows how much of the wall time was ours when
    other processes share the cores (OpenMP spin-waiting counts as CPU, so it is only a hint)."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def run_faiss(x: np.ndarray, k: int) -> None:
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    index.search(x, k)


def run_matmul(x: np.ndarray) -> None:
    """The floor under any exact method: every similarity once, in the blocks retrieval_metrics uses."""
    t = torch.from_numpy(x)
    rows = max(1, min(4096, (1 << 26) // len(t)))
    out = torch.empty((rows, len(t)))
    for lo in range(0, len(t), rows):
        torch.mm(t[lo : lo + rows], t.T, out=out[: len(t[lo : lo + rows])])


def run_pml(x: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calc = AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
        k="max_bin_count",
        device=torch.device("cpu"),
    )
    return calc.get_accuracy(torch.from_numpy(x), torch.from_numpy(labels))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8,000 rows instead of 60,000")
    ap.add_argument("--n", type=int, default=None, help="number of rows (overrides --quick)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--scenario", choices=("trained", "random", "both"), default="both")
    ap.add_argument("--skip-pml", action="store_true", help="leave out pytorch-metric-learning")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.n or (8_000 if args.quick else 60_000)
    rng = np.random.default_rng(args.seed)
    labels = sop_like_labels(n, rng)
    sizes = np.bincount(labels)
    k_needed = max(max(KS), int(sizes.max()) - 1) + 1
    print(
        f"N={n} dim={args.dim} classes={len(sizes)} images/class mean={sizes.mean():.2f} max={sizes.max()} "
        f"torch_threads={torch.get_num_threads()} faiss_threads={faiss.omp_get_max_threads()} "
        f"faiss={faiss.__version__} torch={torch.__version__}"
    )
    scenarios = ("trained", "random") if args.scenario == "both" else (args.scenario,)
    rows = []
    for scenario in scenarios:
        x = embeddings(labels, args.dim, scenario, rng)
        with Clock() as c_faiss:
            run_faiss(x, k_needed)
        with Clock() as c_mm:
            run_matmul(x)
        with Clock() as c_ours:
            ours = retrieval_metrics(x, labels, ks=KS)
        pml: dict[str, float] = {}
        with Clock() as c_pml:
            if not args.skip_pml:
                pml = run_pml(x, labels)
        t_faiss, t_ours = c_faiss.wall, c_ours.wall
        t_pml = c_pml.wall if pml else float("nan")
        rows.append((scenario, t_faiss, c_mm.wall, t_ours, t_pml))
        print(
            f"[{scenario}] wall s (cpu s): faiss {t_faiss:.1f} ({c_faiss.cpu:.1f}), "
            f"matmul {c_mm.wall:.1f} ({c_mm.cpu:.1f}), dmltrain {t_ours:.1f} "
            f"({c_ours.cpu:.1f}), PML {t_pml:.1f} ({c_pml.cpu:.1f}) | "
            f"recall@1={ours['recall@1']:.4f} map@r={ours['map@r']:.4f} map={ours['map']:.4f} "
            f"r_precision={ours['r_precision']:.4f}"
            + (
                f" | PML precision_at_1={pml['precision_at_1']:.4f} "
                f"map@r={pml['mean_average_precision_at_r']:.4f} r_precision={pml['r_precision']:.4f}"
                if pml
                else ""
            ),
            flush=True,
        )

    print()
    print(
        f"| scenario | raw faiss k={k_needed} (s) | torch matmul only (s) | dmltrain all metrics (s) "
        "| PML (s) | dmltrain / faiss | dmltrain / matmul | dmltrain / PML |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for scenario, t_faiss, t_mm, t_ours, t_pml in rows:
        r_faiss, r_pml = t_ours / t_faiss, t_ours / t_pml
        ok &= r_faiss <= 1.2 and (args.skip_pml or r_pml < 1.0)
        print(
            f"| {scenario} | {t_faiss:.1f} | {t_mm:.1f} | {t_ours:.1f} | {t_pml:.1f} | {r_faiss:.2f}x "
            f"| {t_ours / t_mm:.2f}x | {r_pml:.2f}x |"
        )
    print()
    print(f"goals (dmltrain <= 1.2x raw faiss, faster than PML): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
