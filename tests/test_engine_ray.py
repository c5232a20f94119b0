"""The engine inside Ray Train: 2 CPU workers, prepare_model's DDP wrapper, uneven local batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_engine import (
    LOSSES,
    assert_grads_close,
    frozen_bn,
    grads_of,
    make_batch,
    make_model,
    preprocess,
    reference_step,
)

pytestmark = pytest.mark.service

SIZES = [7, 11]
CHUNK = 4
BATCH_SEED = 31


def _train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch

    from dmltrain.engine import global_batch_step

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    sizes = config["sizes"]
    offset = sum(sizes[:rank])
    images, labels = make_batch(sum(sizes), seed=BATCH_SEED)
    images, labels = images[offset : offset + sizes[rank]], labels[offset : offset + sizes[rank]]
    out: dict = {"world": world}
    for loss_name, (make_loss, _) in LOSSES.items():
        model = make_model(seed=2)
        wrapped = ray.train.torch.prepare_model(model)
        result = global_batch_step(
            wrapped, images, labels, make_loss(), config["chunk"], preprocess=preprocess
        )
        out[loss_name] = {"result": result, "grads": grads_of(model), "ddp": type(wrapped).__name__}
    # Workers share the driver's machine here: a file is the simplest way back.
    torch.save(out, Path(config["out_dir"]) / f"rank{rank}.pt")


def test_ray_torchtrainer_workers_get_the_global_batch_gradient(ray_cluster, tmp_path: Path) -> None:
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The workers cannot import the test modules: ship their functions by value.
    for name in (__name__, "test_engine"):
        ray.cloudpickle.register_pickle_by_value(sys.modules[name])

    out_dir = tmp_path / "grads"
    out_dir.mkdir()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"sizes": SIZES, "chunk": CHUNK, "out_dir": str(out_dir)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="engine-equivalence", storage_path=str(tmp_path / "ray")),
    )
    result = trainer.fit()
    assert result.error is None

    images, labels = make_batch(sum(SIZES), seed=BATCH_SEED)
    outs = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for loss_name, (make_loss, rtol) in LOSSES.items():
        want_loss, want = reference_step(frozen_bn(make_model(seed=2)), make_loss(), images, labels)
        for out in outs:
            got = out[loss_name]
            assert out["world"] == 2
            assert got["ddp"] == "DistributedDataParallel", "prepare_model should have wrapped DDP"
            assert got["result"].global_batch_size == sum(SIZES)
            assert abs(got["result"].loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
            assert_grads_close(got["grads"], want, rtol)
