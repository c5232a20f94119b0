"""Why a loss collapses on held-out glyph classes (triplet, FastAP), and what makes it learn: small runs.

A plain single-process loop over the library (TrainLoader + global_batch_step, no Ray, no MLflow), so each
variant takes a few minutes on 2 CPU cores: resnet18 from scratch at 32 px on the bundled glyphs, trained
on the train classes and evaluated (Recall@1, MAP@R) on the disjoint test classes. Besides the loss it logs
what tells a collapse apart from slow learning: the share of active sampled triplets, the mean squared
distances d(a,p) and d(a,n) in the batch, and the mean cosine similarity between test embeddings (1.0 when
every image maps to the same point).

    PYTHONPATH=. python bench/triplet_diagnosis.py --triplets all --lr 1e-3 --steps 300
    PYTHONPATH=. python bench/triplet_diagnosis.py --triplets sampled --lr 1e-4 --steps 300
    PYTHONPATH=. python bench/triplet_diagnosis.py --loss fastap --sampler pk --batch 128 --no-flip \
        --freeze-bn --steps 100    # frozen BatchNorm from scratch: FastAP collapses (mean cosine -> 1)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dmltrain.data import EvalLoader, SamplerSpec, TrainLoader, ensure_glyphs
from dmltrain.data.transforms import train_transform
from dmltrain.engine import global_batch_step
from dmltrain.evaluation import retrieval_metrics
from dmltrain.losses import FastAPLoss, RankedListLoss, RankingLoss, SmoothAPLoss, TripletLoss
from dmltrain.models import EmbeddingNet, build_model, normalize_images, parameter_groups


def embed_test(model: EmbeddingNet, root: Path, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    loader = EvalLoader(root, "test", 512, rank=0, world_size=1, image_size=image_size, resize=image_size)
    model.eval()
    out, labels = [], []
    with torch.no_grad():
        for images, y, _categories, _keys in loader:
            out.append(model(normalize_images(images)))
            labels.append(y)
    model.train()
    return torch.cat(out), torch.cat(labels)


def evaluate(model: EmbeddingNet, root: Path, image_size: int) -> dict[str, float]:
    emb, labels = embed_test(model, root, image_size)
    metrics = retrieval_metrics(emb, labels, ks=(1,))
    n = min(2000, emb.shape[0])
    sims = emb[:n] @ emb[:n].T
    off_diagonal = (sims.sum() - sims.diagonal().sum()) / (n * (n - 1))
    return {
        "recall@1": float(metrics["recall@1"]),
        "map@r": float(metrics["map@r"]),
        "mean_cosine": float(off_diagonal),
    }


def batch_stats(model: EmbeddingNet, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Sampled-triplet statistics of the batch (rows [q, p, n, ...]) with the current weights, in eval mode
    (so BatchNorm's running statistics are left alone)."""
    model.eval()
    with torch.no_grad():
        emb = model(normalize_images(images))
    model.train()
    a, p, n = emb[0::3], emb[1::3], emb[2::3]
    d_ap, d_an = (a - p).pow(2).sum(1), (a - n).pow(2).sum(1)
    return {"d_ap": float(d_ap.mean()), "d_an": float(d_an.mean())}


def build_loss(args: argparse.Namespace) -> RankingLoss:
    if args.loss == "smoothap":
        return SmoothAPLoss(temperature=0.01)
    if args.loss == "rll":
        return RankedListLoss(gradient=args.rll_gradient)
    if args.loss == "fastap":
        return FastAPLoss(num_bins=args.num_bins)
    return TripletLoss(margin=args.margin, triplets=args.triplets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/tmp/dmltrain-glyphs")
    parser.add_argument("--loss", choices=["triplet", "smoothap", "rll", "fastap"], default="triplet")
    parser.add_argument("--rll-gradient", choices=["both", "query"], default="both")
    parser.add_argument("--num-bins", type=int, default=10, help="FastAP histogram bins")
    parser.add_argument("--no-flip", action="store_true", help="no horizontal flips (data.flip: false)")
    parser.add_argument("--samples-per-class", type=int, default=4, help="pk sampler K")
    parser.add_argument("--triplets", choices=["sampled", "all"], default="sampled")
    parser.add_argument("--sampler", choices=["triplet", "pk"], default="triplet")
    parser.add_argument("--in-category-negatives", type=float, default=0.5)
    parser.add_argument("--margin", type=float, default=0.2)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--embedding-lr-mult", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=126)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--freeze-bn", action="store_true")
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the run's summary as one JSON line here")
    parser.add_argument("--save", default=None, help="save the final model's state_dict here")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = ensure_glyphs(args.data)
    model = build_model("resnet18", args.embedding_dim, None)
    groups = parameter_groups(model, args.lr, args.embedding_lr_mult)
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(groups, lr=args.lr)
    loss_fn = build_loss(args)
    spec = SamplerSpec(
        name=args.sampler,
        samples_per_class=args.samples_per_class if args.sampler == "pk" else 2,
        in_category_negatives=args.in_category_negatives,
        seed=args.seed,
    )
    loader = TrainLoader(
        root,
        args.batch,
        spec,
        rank=0,
        world_size=1,
        num_workers=0,
        transform=train_transform(args.image_size, scale=(0.5, 1.0), flip=not args.no_flip),
    )
    history = [{"step": 0, **evaluate(model, root, args.image_size)}]
    print(json.dumps(history[-1]), flush=True)
    t0 = time.perf_counter()
    window: list[tuple[float, int, int]] = []
    for step in range(1, args.steps + 1):
        images, labels, _ = loader.next_batch()
        optimizer.zero_grad(set_to_none=True)
        result = global_batch_step(
            model, images, labels, loss_fn, args.batch, preprocess=normalize_images, freeze_bn=args.freeze_bn
        )
        optimizer.step()
        window.append((float(result.loss), result.num_valid, result.num_queries))
        if step % 25 == 0:
            row = {
                "step": step,
                "loss": sum(w[0] for w in window) / len(window),
                "valid_share": sum(w[1] for w in window) / max(1, sum(w[2] for w in window)),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            if args.sampler == "triplet":
                row.update(batch_stats(model, images, labels))
            if step % args.eval_every == 0 or step == args.steps:
                row.update(evaluate(model, root, args.image_size))
            history.append(row)
            print(json.dumps(row), flush=True)
            window = []
    if args.save:
        torch.save(model.state_dict(), args.save)
    summary = {"args": vars(args), "start": history[0], "end": history[-1]}
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
