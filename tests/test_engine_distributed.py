"""2 and 3 real gloo processes with uneven local batches: every rank must end up with the gradient one
process computes on the whole global batch, with a plain module and with DDP, chunked or not."""

from __future__ import annotations

import copy
import math
import os
import re
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

from dmltrain.acceleration import compile_network
from dmltrain.distributed import (
    all_gather_sizes,
    all_gather_uneven,
    all_reduce_max_,
    gather_uneven,
    get_rank,
    get_world_size,
)
from dmltrain.engine import global_batch_step
from dmltrain.losses import SmoothAPLoss

# name -> (wrap in DDP, chunk size, freeze_bn, model with a parameter no forward uses)
SCENARIOS: dict[str, tuple[bool, int, bool, bool]] = {
    "plain-chunked": (False, 4, True, False),
    "plain-one-pass": (False, 16, True, False),
    "ddp-chunked": (True, 4, True, False),
    "ddp-one-pass": (True, 16, True, False),
    "ddp-chunked-unused-param": (True, 4, True, True),
    "ddp-chunked-bn-training": (True, 4, False, False),
    "ddp-one-pass-bn-training": (True, 16, False, False),  # the ranks' running statistics stayed apart
    "ddp-chunked-compiled": (True, 4, True, False),
}
# The network compiled in place before DDP wraps it (as the service does). aot_eager runs dynamo's capture
# and AOTAutograd's compiled backward, the parts that meet DDP's hooks, no_sync and the RNG replay, without
# inductor's C++ code generation (about 30 s per process here; inductor is checked in test_acceleration.py).
COMPILED = {"ddp-chunked-compiled"}
BATCH_SEED = 21
# Every loss in the chunked scenarios (the LossParts normalisation is per loss); one loss elsewhere.
ALL_LOSSES = {"plain-chunked", "ddp-chunked"}


def _losses_for(scenario: str) -> dict:
    return LOSSES if scenario in ALL_LOSSES else {"smoothap": LOSSES["smoothap"]}


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
            "labels_at_1": gather_uneven(labels.float().unsqueeze(1), sizes, dst=1),  # rows of any width
            "max_over_ranks": all_reduce_max_(torch.tensor([float(rank), -2.0 * rank], dtype=torch.float64)),
        }
        for scenario, (use_ddp, chunk, freeze_bn, unused) in SCENARIOS.items():
            for loss_name, (make_loss, _) in _losses_for(scenario).items():
                model = make_model(seed=2, unused=unused)
                if scenario in COMPILED:
                    compile_network(model, backend="aot_eager")
                wrapped = DistributedDataParallel(model, find_unused_parameters=unused) if use_ddp else model
                steps = []
                for _ in range(2):  # the second step accumulates, as a plain backward would
                    r = global_batch_step(
                        wrapped,
                        images,
                        labels,
                        make_loss(),
                        chunk,
                        preprocess=preprocess,
                        freeze_bn=freeze_bn,
                    )
                    steps.append({"result": r, "grads": grads_of(model)})
                bn = {k: v.clone() for k, v in model.bn.state_dict().items()}
                out[(scenario, loss_name)] = {"steps": steps, "bn": bn}
        out["failures"] = _failure_modes(rank, images, labels)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _failure_modes(rank: int, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Bad data on rank 1 only: every rank must fail (or skip) together instead of hanging."""

    def poisoned(x: torch.Tensor) -> torch.Tensor:  # rank 1's images turn into NaN embeddings
        y = preprocess(x)
        return y * float("nan") if rank == 1 else y

    loss_fn = SmoothAPLoss()
    found: dict = {}
    bad_labels = labels[:-1] if rank == 1 else labels
    try:
        global_batch_step(make_model(), images, bad_labels, loss_fn, 4, preprocess=preprocess)
    except ValueError as e:
        found["bad_labels"] = str(e)
    for chunk, unused in ((4, False), (16, False), (16, True)):  # chunked, and one synced DDP forward
        model = make_model(seed=2, unused=unused)
        ddp = DistributedDataParallel(model, find_unused_parameters=unused)
        try:
            global_batch_step(ddp, images, labels, loss_fn, chunk, preprocess=poisoned)
        except FloatingPointError as e:
            found[f"nan_raise_{chunk}_{unused}"] = str(e)
        r = global_batch_step(ddp, images, labels, loss_fn, chunk, preprocess=poisoned, skip_nonfinite=True)
        skipped_grads = grads_of(model)
        model.zero_grad(set_to_none=True)
        # DDP must still be in step: a clean step afterwards gives the global-batch gradient.
        after = global_batch_step(ddp, images, labels, loss_fn, chunk, preprocess=preprocess)
        found[f"nan_skip_{chunk}_{unused}"] = {
            "loss": r.loss.item(),
            "grad_abs_sum": sum(float(g.abs().sum()) for g in skipped_grads.values()),
            "after_loss": after.loss.item(),
            "after_grads": grads_of(model),
        }
    return found


def _expected(scenario: str, loss_name: str, sizes: list[int]) -> dict:
    _, chunk, freeze_bn, unused = SCENARIOS[scenario]
    make_loss, _ = LOSSES[loss_name]
    images, labels = make_batch(sum(sizes), seed=BATCH_SEED)
    model = make_model(seed=2, unused=unused)
    if freeze_bn:
        loss, grads = reference_step(frozen_bn(model), make_loss(), images, labels)
        return {"loss": loss, "grads": grads, "bn": model.bn.state_dict()}
    # Training-mode BatchNorm: every rank's chunks normalised with their own statistics.
    bounds, offset = [], 0
    for n in sizes:
        bounds += [(offset + s, offset + e) for s, e in bounds_of(n, chunk)]
        offset += n
    loss, grads = reference_step(model, make_loss(), images, labels, bounds)
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
        want_at_1 = all_labels.float().unsqueeze(1) if rank == 1 else torch.empty(0, 1)
        assert torch.equal(out["labels_at_1"], want_at_1), rank  # only rank 1 receives
        assert out["max_over_ranks"].tolist() == [world - 1.0, 0.0], rank  # element-wise, on every rank

    for scenario, (_, chunk, _, _) in SCENARIOS.items():
        for loss_name, (_, rtol) in _losses_for(scenario).items():
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

    # Failure on one rank: all ranks fail (or skip) together, and DDP stays usable afterwards.
    images, labels = make_batch(sum(sizes), seed=BATCH_SEED)
    models = {u: frozen_bn(make_model(seed=2, unused=u)) for u in (False, True)}
    want = {u: reference_step(m, SmoothAPLoss(), images, labels)[1] for u, m in models.items()}
    for rank, out in enumerate(outs):
        f = out["failures"]
        expected_message = "labels has" if rank == 1 else r"ranks \[1\] have an invalid"
        assert re.search(expected_message, f["bad_labels"]), f["bad_labels"]
        for chunk, unused in ((4, False), (16, False), (16, True)):
            case = f"{chunk}_{unused}"
            assert "rank(s) [1]" in f[f"nan_raise_{case}"]
            skip = f[f"nan_skip_{case}"]
            assert math.isnan(skip["loss"]) and skip["grad_abs_sum"] == 0.0, case
            assert math.isfinite(skip["after_loss"]), case
            assert_grads_close(skip["after_grads"], want[unused], 1e-8)
