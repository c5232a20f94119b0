"""2 and 3 real gloo processes with uneven local batches: every rank must end up with the gradient one
process computes on the whole global batch, with a plain module and with DDP, chunked or not."""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_engine import (
    LOSSES,
    assert_grads_close,
    bounds_of,
    frozen_bn,
    grads_of,
    make_batch,
    make_model,
    preprocess,
    reference_step,
)
from torch.nn.parallel import DistributedDataParallel

from dmltrain.distributed import all_gather_sizes, all_gather_uneven, get_rank, get_world_size
from dmltrain.engine import global_batch_step

# name -> (wrap in DDP, chunk size, freeze_bn, model with a parameter no forward uses)
SCENARIOS: dict[str, tuple[bool, int, bool, bool]] = {
    "plain-chunked": (False, 4, True, False),
    "plain-one-pass": (False, 16, True, False),
    "ddp-chunked": (True, 4, True, False),
    "ddp-one-pass": (True, 16, True, False),
    "ddp-chunked-unused-param": (True, 4, True, True),
    "ddp-chunked-bn-training": (True, 4, False, False),
}
BATCH_SEED = 21


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        offset = sum(sizes[:rank])
        images, labels = make_batch(sum(sizes), seed=BATCH_SEED)
        images, labels = images[offset : offset + sizes[rank]], labels[offset : offset + sizes[rank]]
        out: dict = {
            "rank": get_rank(),
            "world": get_world_size(),
            "gathered_sizes": all_gather_sizes(sizes[rank]),
            "gathered_labels": all_gather_uneven(labels),
        }
        for scenario, (use_ddp, chunk, freeze_bn, unused) in SCENARIOS.items():
            for loss_name, (loss_cls, _) in LOSSES.items():
                model = make_model(seed=2, unused=unused)
                wrapped = DistributedDataParallel(model, find_unused_parameters=unused) if use_ddp else model
                steps = []
                for _ in range(2):  # the second step accumulates, as a plain backward would
                    r = global_batch_step(
                        wrapped, images, labels, loss_cls(), chunk, preprocess=preprocess, freeze_bn=freeze_bn
                    )
                    steps.append({"result": r, "grads": grads_of(model)})
                bn = {k: v.clone() for k, v in model.bn.state_dict().items()}
                out[(scenario, loss_name)] = {"steps": steps, "bn": bn}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _expected(scenario: str, loss_name: str, sizes: list[int]) -> dict:
    _, chunk, freeze_bn, unused = SCENARIOS[scenario]
    loss_cls, _ = LOSSES[loss_name]
    images, labels = make_batch(sum(sizes), seed=BATCH_SEED)
    model = make_model(seed=2, unused=unused)
    if freeze_bn:
        loss, grads = reference_step(frozen_bn(model), loss_cls(), images, labels)
        return {"loss": loss, "grads": grads, "bn": model.bn.state_dict()}
    # Training-mode BatchNorm: every rank's chunks normalised with their own statistics.
    bounds, offset = [], 0
    for n in sizes:
        bounds += [(offset + s, offset + e) for s, e in bounds_of(n, chunk)]
        offset += n
    loss, grads = reference_step(model, loss_cls(), images, labels, bounds)
    rank0 = copy.deepcopy(model)  # DDP's rule: rank 0's running statistics win
    with torch.no_grad():
        for _ in range(2):
            for s, e in bounds_of(sizes[0], chunk):
                rank0(preprocess(images[s:e]))
    return {"loss": loss, "grads": grads, "bn": rank0.bn.state_dict()}


@pytest.mark.parametrize("sizes", [[7, 11], [3, 9, 6]], ids=["2-ranks", "3-ranks"])
def test_every_rank_gets_the_global_batch_gradient(sizes: list[int], tmp_path: Path) -> None:
    world = len(sizes)
    mp.spawn(_worker, args=(world, _free_port(), sizes, str(tmp_path)), nprocs=world, join=True)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    _, all_labels = make_batch(sum(sizes), seed=BATCH_SEED)

    for rank, out in enumerate(outs):
        assert (out["rank"], out["world"]) == (rank, world)
        assert out["gathered_sizes"] == sizes
        assert torch.equal(out["gathered_labels"], all_labels)

    for scenario, (_, chunk, _, _) in SCENARIOS.items():
        for loss_name, (_, rtol) in LOSSES.items():
            want = _expected(scenario, loss_name, sizes)
            for rank, out in enumerate(outs):
                got = out[(scenario, loss_name)]
                where = f"{scenario}/{loss_name}/rank {rank}"
                first, second = got["steps"]
                r = first["result"]
                sizes_seen = (r.world_size, r.global_batch_size, r.local_batch_size)
                assert sizes_seen == (world, sum(sizes), sizes[rank]), where
                assert r.num_chunks == -(-sizes[rank] // chunk), where
                assert r.num_queries == sum(sizes), where
                assert abs(r.loss.item() - want["loss"].item()) <= 1e-6 * abs(want["loss"].item()), where
                try:
                    assert_grads_close(first["grads"], want["grads"], rtol)
                    assert_grads_close(second["grads"], {k: 2 * v for k, v in want["grads"].items()}, rtol)
                except AssertionError as e:
                    raise AssertionError(f"{where}: {e}") from None
                for k, v in want["bn"].items():
                    assert torch.allclose(got["bn"][k], v, rtol=1e-12, atol=1e-12), f"{where}: bn.{k}"
            # Every rank reports the same step.
            firsts = [out[(scenario, loss_name)]["steps"][0]["result"] for out in outs]
            assert len({(f.loss.item(), f.num_valid, f.count) for f in firsts}) == 1, scenario
