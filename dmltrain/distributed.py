"""Collectives the engine needs, usable whether or not torch.distributed is initialised.

Without an initialised process group every helper degrades to the single-process answer (rank 0 of a
world of 1, gathers return their input, reductions are no-ops), so library code can call them
unconditionally. Local batches may differ in size between ranks: gathers exchange sizes first and pad.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "all_gather_objects",
    "all_gather_sizes",
    "all_gather_uneven",
    "all_reduce_max_",
    "all_reduce_sum_",
    "broadcast_buffers_",
    "broadcast_object",
    "communication_device",
    "gather_uneven",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "sum_gradients_",
]

_BUCKET_BYTES = 32 * 1024 * 1024


def is_distributed() -> bool:
    """True when a default process group exists, i.e. collectives would actually communicate."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the default group, 0 when torch.distributed is not initialised."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes in the default group, 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if is_distributed() else 1


def communication_device(device: torch.device) -> torch.device:
    """Where a tensor living on `device` must be for the current backend's collectives.

    NCCL only moves CUDA tensors; gloo is only dependable for CPU tensors. Under NCCL a CUDA tensor stays
    where it is and anything else travels through host memory if the group has a CPU backend too
    ("cpu:gloo,cuda:nccl"), else (a pure NCCL group, as Ray Train's ``TorchConfig(backend="nccl")`` makes)
    through this process's current GPU.
    """
    backend = str(dist.get_backend()).lower() if is_distributed() else ""
    if "nccl" not in backend or (device.type != "cuda" and "gloo" in backend):
        return torch.device("cpu")
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def all_gather_sizes(size: int, device: torch.device | None = None) -> list[int]:
    """Every rank's value of `size` (typically its local batch size), in rank order.

    Doubles as a cheap barrier that lets all ranks agree on per-rank facts before larger collectives.
    """
    if get_world_size() == 1:
        return [int(size)]
    comm = communication_device(device or torch.device("cpu"))
    mine = torch.tensor([int(size)], dtype=torch.int64, device=comm)
    out = [torch.empty_like(mine) for _ in range(get_world_size())]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def all_gather_uneven(tensor: Tensor, sizes: Sequence[int] | None = None) -> Tensor:
    """Concatenate every rank's `tensor` along dim 0 in rank order; ranks may hold different row counts.

    Exact (a copy, no arithmetic) and not differentiable: the engine handles the backward explicitly.
    `sizes` (from `all_gather_sizes`) saves one collective when the caller already knows them. Rows are
    padded to the largest rank's count for the transfer and the padding is dropped again.
    """
    if get_world_size() == 1:
        return tensor
    if sizes is None:
        sizes = all_gather_sizes(tensor.shape[0], tensor.device)
    gathered = _gather_padded(tensor, sizes, dst=None)
    assert gathered is not None
    return gathered


def gather_uneven(tensor: Tensor, sizes: Sequence[int], dst: int = 0) -> Tensor:
    """`all_gather_uneven` for one receiver: rank ``dst`` gets every rank's rows in rank order, the others
    an empty tensor. Where only one rank uses the result (evaluation scores on rank 0), the others need not
    hold ``world`` copies of it (a 1M x 512 gallery is 2 GB on each GPU, then again in host memory)."""
    if get_world_size() == 1:
        return tensor
    gathered = _gather_padded(tensor, sizes, dst=dst)
    return tensor.new_empty((0, *tensor.shape[1:])) if gathered is None else gathered


def _gather_padded(tensor: Tensor, sizes: Sequence[int], dst: int | None) -> Tensor | None:
    """Every rank's rows in rank order, on every rank (``dst`` None) or on rank ``dst`` only (None
    elsewhere): padded to the largest rank's count for the transfer, the padding dropped again."""
    world, rank = get_world_size(), get_rank()
    if len(sizes) != world:
        raise ValueError(f"sizes has {len(sizes)} entries for a world of {world}")
    if tensor.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank}: tensor has {tensor.shape[0]} rows but sizes[{rank}] = {sizes[rank]}")
    comm = communication_device(tensor.device)
    padded = torch.zeros((max(sizes), *tensor.shape[1:]), dtype=tensor.dtype, device=comm)
    padded[: tensor.shape[0]] = tensor.to(comm)
    if dst is None:
        parts: list[Tensor] | None = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
    else:
        parts = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
        dist.gather(padded, parts, dst=dst)
    if parts is None:
        return None
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).to(tensor.device)


def all_reduce_sum_(tensor: Tensor) -> Tensor:
    """Sum `tensor` over ranks in place (a no-op in a world of 1) and return it."""
    return _all_reduce_(tensor, dist.ReduceOp.SUM)


def all_reduce_max_(tensor: Tensor) -> Tensor:
    """Element-wise maximum of `tensor` over ranks in place (a no-op in a world of 1) and return it: a
    resource figure (peak memory) must show the rank nearest its limit, not whichever rank logs it."""
    return _all_reduce_(tensor, dist.ReduceOp.MAX)


def _all_reduce_(tensor: Tensor, op: Any) -> Tensor:
    if get_world_size() == 1:
        return tensor
    comm = communication_device(tensor.device)
    if comm == tensor.device:
        dist.all_reduce(tensor, op=op)
    else:
        staged = tensor.to(comm)
        dist.all_reduce(staged, op=op)
        tensor.copy_(staged)
    return tensor


def sum_gradients_(parameters: Iterable[nn.Parameter], bucket_bytes: int = _BUCKET_BYTES) -> None:
    """Replace every parameter's `.grad` by its SUM over ranks, in a few coalesced all-reduces.

    Summing (not averaging) is what makes a row-split loss reproduce the single-process gradient. A
    parameter that got no gradient on some rank counts as zero there; one that got none on any rank keeps
    `.grad = None`, as a single process would leave it. Every rank must call this with the same
    parameters in the same order.
    """
    params = [p for p in parameters if p.requires_grad]
    if get_world_size() == 1 or not params:
        return
    used = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float32)
    all_reduce_sum_(used)
    bucket: list[nn.Parameter] = []
    bucket_size = 0
    for p, n in zip(params, used.tolist(), strict=True):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if bucket and (p.grad.dtype != bucket[0].grad.dtype or p.grad.device != bucket[0].grad.device):
            _reduce_bucket(bucket)
            bucket, bucket_size = [], 0
        bucket.append(p)
        bucket_size += p.grad.numel() * p.grad.element_size()
        if bucket_size >= bucket_bytes:
            _reduce_bucket(bucket)
            bucket, bucket_size = [], 0
    if bucket:
        _reduce_bucket(bucket)


def _reduce_bucket(bucket: list[nn.Parameter]) -> None:
    grads = [p.grad for p in bucket]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum_(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def broadcast_buffers_(module: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s buffers (e.g. BatchNorm running statistics) to every rank, in place.

    DDP's rule for buffers is "rank 0's copy wins"; the engine calls this when it had to restore buffers
    behind DDP's back.
    """
    if get_world_size() == 1:
        return
    for buf in module.buffers():
        comm = communication_device(buf.device)
        staged = buf.detach().to(comm)
        dist.broadcast(staged, src=src)
        if staged is not buf:
            with torch.no_grad():
                buf.copy_(staged)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (for small metadata such as stream positions)."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `obj` on every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
