"""Exact global-batch gradients for non-decomposable ranking losses, in bounded memory.

A listwise loss (FastAP, Smooth-AP, RLL) scores every query against the whole batch, so the batch cannot be
split into independent pieces the way a classification loss can. The FastAP paper's large-batch
heuristic (Sec. 4.1) still gets the exact gradient, because the loss only sees the embedding matrix:

1. embed the local batch chunk by chunk without autograd, recording the RNG state of every chunk (the
   last chunk keeps its graph, so it need not be re-run);
2. all-gather embeddings and labels from every rank (local batches may differ in size);
3. score the LOCAL queries against the GLOBAL gallery, normalise by the loss's GLOBAL count and take the
   gradient with respect to the whole gathered matrix; sum that matrix gradient over ranks (every rank
   contributes to every row) and keep the local rows: this is exactly dL/dE_local of the global batch.
   A loss whose gallery is a constant for the gradient (`gallery_is_constant`, e.g. RLL's paper form)
   only moves its queries, so the local rows' gradient is complete on its own rank and the sum is skipped;
4. re-run the other chunks with autograd, replaying their RNG state, and back-propagate each chunk's
   slice of dL/dE;
5. make every rank hold the SUM of the per-rank parameter gradients, reduced exactly once per step.

Memory therefore grows with the chunk, not with the batch, apart from the B x D embedding matrices. When
every rank's batch fits in one chunk, the batch is embedded once with autograd and nothing is re-run.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.parallel import DistributedDataParallel

from dmltrain.acceleration import compiled_forwards, cuda_has_bf16, restore_rng_state, rng_state
from dmltrain.distributed import (
    all_gather_sizes,
    all_gather_uneven,
    all_reduce_max_,
    all_reduce_sum_,
    broadcast_buffers_,
    get_rank,
    get_world_size,
    sum_gradients_,
)

__all__ = ["StepResult", "chunked_backward", "default_autocast_dtype", "global_batch_step"]

Preprocess = Callable[[Tensor], Tensor]


class _PartsLoss(Protocol):
    def parts(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        query_index: Tensor | None = None,
    ) -> Any: ...


@dataclass(frozen=True)
class StepResult:
    """What one global-batch step did, for the trainer's logs.

    Global (the same on every rank): `loss`, the global-batch loss (detached 0-d float32 tensor on the
    model's device; NaN only for a step skipped with skip_nonfinite); `num_queries`; `num_valid` (queries
    that carried a signal); `count` (the loss's normaliser); `global_batch_size`; `world_size`.
    Per rank: `local_batch_size`; `num_chunks`; `comm_seconds`, wall time in the engine's own collectives
    including waiting for slower ranks (with DDP the gradient all-reduce runs inside the last backward and
    is counted in `compute_seconds`); `compute_seconds`, the rest of the step's wall time.
    """

    loss: Tensor
    num_valid: int
    num_queries: int
    count: float
    global_batch_size: int
    local_batch_size: int
    world_size: int
    num_chunks: int
    comm_seconds: float
    compute_seconds: float


def default_autocast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 autocast where it pays off (a CUDA GPU with native bf16), None (full precision) elsewhere:
    not the emulated bf16 that ``torch.cuda.is_bf16_supported()`` also counts on older GPUs."""
    if device.type == "cuda" and cuda_has_bf16(device):
        return torch.bfloat16
    return None


def chunked_backward(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: nn.Module,
    chunk_size: int,
    *,
    preprocess: Preprocess | None = None,
    freeze_bn: bool = True,
    autocast_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    channels_last: bool = False,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """Accumulate into `.grad` the exact gradient of the global-batch loss; return that loss (detached).

    Afterwards every rank's gradients equal those of one process running
    `loss_fn(model(all_inputs), all_labels).backward()` on every rank's inputs concatenated in rank order,
    whatever `chunk_size` and world size. See `global_batch_step` for the arguments.
    """
    return global_batch_step(
        model,
        inputs,
        labels,
        loss_fn,
        chunk_size,
        preprocess=preprocess,
        freeze_bn=freeze_bn,
        autocast_dtype=autocast_dtype,
        skip_nonfinite=skip_nonfinite,
        channels_last=channels_last,
        grad_scaler=grad_scaler,
    ).loss


def global_batch_step(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: nn.Module,
    chunk_size: int,
    *,
    preprocess: Preprocess | None = None,
    freeze_bn: bool = True,
    autocast_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    channels_last: bool = False,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    """One global-batch forward/backward in chunks of at most `chunk_size` local samples.

    model: a plain module or a DDP wrapper; its output must be the (L2-normalised) embeddings (B, D). Runs
        on the device of its parameters. A plain module under an initialised process group has its
        gradients summed over ranks here; a DDP module syncs once, in the last chunk's backward.
    inputs: this rank's batch (B, ...), any dtype and device (keep uint8 images on the host: each chunk
        is moved to the device only when it is processed). labels: (B,) integer class labels.
    loss_fn: a loss with `parts(...) -> LossParts` (see dmltrain.losses); in a single process any
        callable `loss_fn(embeddings, labels) -> mean loss` also works.
    preprocess: applied to every chunk on the device, e.g. uint8 -> normalised float.
    freeze_bn: keep BatchNorm layers in eval mode while chunking (the papers' fine-tuning). With False,
        training-mode BatchNorm normalises each chunk with that chunk's own statistics (so results depend
        on chunk_size) and its running statistics are updated once per chunk, by the first pass only.
    autocast_dtype: e.g. torch.bfloat16 to run the model under autocast (the loss stays in float32);
        None runs in the model's own precision. `dmltrain.acceleration.resolve_precision` picks one.
    skip_nonfinite: if the gathered embeddings or their loss gradient hold NaN/inf, return a NaN loss and
        add nothing to `.grad` on any rank (so a trainer can skip the update) instead of raising
        FloatingPointError. Either way no NaN reaches the parameter gradients.
    channels_last: hand every preprocessed 4-D chunk to the model in channels_last memory format (for a
        model converted with ``model.to(memory_format=torch.channels_last)``; same values, faster convs).
    grad_scaler: for fp16 autocast: the network's backward is fed ``scale x dL/dE``, so `.grad` holds the
        scaled gradient; the caller unscales and steps through the scaler (``unscale_``, ``step``,
        ``update``), which skips the update when the scaled gradients overflowed.

    Gradients accumulate into `.grad` as `backward()` does (existing values must agree across ranks under
    DDP, which averages them). Bad arguments on any rank make every rank raise, instead of hanging in a
    collective. Parameters of `loss_fn` itself, if it has any, receive no gradient.

    A network compiled in place (`dmltrain.acceleration.compile_network`, before any DDP wrapping) works
    unchanged: the engine only calls the module, and its RNG replay, no_sync and DDP handling act on the
    uncompiled wrapper. Where its compilation falls back to eager within a step, the step is run again
    from the start (RNG, gradients and running statistics put back), so its chunks replay one forward.
    """
    net = _unwrapped(model)
    compiled = compiled_forwards(net)
    snapshot = _StepSnapshot.take(net, compiled) if compiled else None
    run = partial(
        _global_batch_step_once,
        model,
        inputs,
        labels,
        loss_fn,
        chunk_size,
        preprocess=preprocess,
        freeze_bn=freeze_bn,
        autocast_dtype=autocast_dtype,
        skip_nonfinite=skip_nonfinite,
        channels_last=channels_last,
        grad_scaler=grad_scaler,
    )
    result = run()
    # A compiled forward that fell back to eager within the step (its grad-mode graph failed after the
    # no-grad one ran) replayed the chunks with eager's dropout masks, not the compiled pass's: that
    # step's gradient belonged to no single forward. It is run again, eagerly from the start; the ranks
    # agree on it (a flag over all of them), so they take the same collectives.
    for _ in compiled:  # each compiled forward can fall back once
        assert snapshot is not None
        fell_back = any(
            before != "eager" and forward.state == "eager"
            for before, forward in zip(snapshot.states, compiled, strict=True)
        )
        if not _any_rank(fell_back, result):
            break
        snapshot.restore()
        snapshot = _StepSnapshot.take(net, compiled)
        result = run()
    return result


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _any_rank(flag: bool, result: StepResult) -> bool:
    """``flag`` on any rank (a world of 1: this one's)."""
    if get_world_size() == 1:
        return flag
    return bool(all_reduce_max_(torch.tensor([float(flag)], device=result.loss.device)).item())


@dataclass
class _StepSnapshot:
    """What a step changes besides the optimizer's state: the RNG streams, the gradients, the norm layers'
    running statistics; enough to run the step again as if the first run never happened."""

    rng: Any
    grads: list[tuple[nn.Parameter, Tensor | None]]
    buffers: list[tuple[Tensor, Tensor]]
    states: list[str]  # of the network's compiled forwards, in `compiled_forwards` order

    @classmethod
    def take(cls, net: nn.Module, compiled: list[Any]) -> _StepSnapshot:
        grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in net.parameters()]
        buffers = _saved_buffers(m for m in net.modules() if isinstance(m, _NormBase))
        return cls(rng_state(), grads, buffers, [f.state for f in compiled])

    def restore(self) -> None:
        restore_rng_state(self.rng)
        for p, grad in self.grads:
            p.grad = grad
        _put_back(self.buffers)


def _global_batch_step_once(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: nn.Module,
    chunk_size: int,
    *,
    preprocess: Preprocess | None = None,
    freeze_bn: bool = True,
    autocast_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    channels_last: bool = False,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> StepResult:
    start = time.perf_counter()
    ddp = model if isinstance(model, DistributedDataParallel) else None
    net = ddp.module if ddp is not None else model
    device = _device_of(net)
    world, rank = get_world_size(), get_rank()
    clock = _CommClock(device, enabled=world > 1)

    problem = _check_local_inputs(inputs, labels, chunk_size)
    with clock:
        sizes = all_gather_sizes(-1 if problem else int(inputs.shape[0]), device)
    if problem:
        raise ValueError(f"rank {rank}: {problem}")
    bad = [r for r, n in enumerate(sizes) if n <= 0]
    if bad:
        raise ValueError(f"ranks {bad} have an invalid or empty local batch (sizes {sizes}); see their logs")
    local_n, global_n = sizes[rank], sum(sizes)
    offset = sum(sizes[:rank])
    bounds = [(s, min(s + chunk_size, local_n)) for s in range(0, local_n, chunk_size)]
    # Decided from the sizes every rank knows, so all ranks take the same path (and the same collectives).
    one_pass = max(sizes) <= chunk_size
    labels = labels.to(device=device, dtype=torch.int64)
    if not freeze_bn and world > 1 and not one_pass and _has_training_syncbn(net):
        raise ValueError(
            "freeze_bn=False with SyncBatchNorm needs one chunk per rank (ranks may run different numbers "
            "of chunks, which would desynchronise its collectives): raise chunk_size or freeze BatchNorm"
        )
    if freeze_bn and not one_pass and _batch_statistics_only(net):
        warnings.warn(
            "freeze_bn=True cannot freeze BatchNorm without running statistics (track_running_stats=False): "
            "it normalises every chunk by the chunk's own statistics, so the step is not the global batch's "
            "exact gradient (it depends on chunk_size)",
            RuntimeWarning,
            stacklevel=3,
        )
    reduce_manually = ddp is None and world > 1
    params = [p for p in net.parameters() if p.requires_grad]
    # DDP averages over ranks; feeding it world x the local gradient makes that average the exact sum.
    grad_scale = float(world) if ddp is not None else 1.0

    with _batchnorm_frozen(net, freeze_bn):
        load = _ChunkLoader(inputs, device, preprocess, channels_last)
        if one_pass:
            with torch.enable_grad(), _autocast(device, autocast_dtype):
                out = (ddp or net)(load(0, local_n))
            embeddings = _as_embeddings(out, local_n).detach().to(_storage_dtype(out))
        else:
            rng_states, embeddings, kept = _embed_first_pass(net, load, bounds, device, autocast_dtype)

        grad, stats, problem = _embedding_gradient(
            loss_fn, embeddings, labels, sizes, offset, clock, grad_scale=grad_scale
        )
        if problem is not None:
            if one_pass and ddp is not None:
                _complete_ddp_iteration(out, params)
            if not skip_nonfinite:
                raise FloatingPointError(problem)
        else:
            stashed = _stash_grads(params) if reduce_manually else None
            if grad_scaler is not None:
                grad = grad_scaler.scale(grad)
            if one_pass:
                out.backward(grad.to(out.dtype))
            else:
                with _running_stats_updated_once(net, sync=ddp is not None and _ddp_syncs_buffers(ddp)):
                    _backward_chunks(
                        ddp or net, ddp, load, bounds, rng_states, kept, grad, device, autocast_dtype
                    )
            if reduce_manually:
                with clock:
                    sum_gradients_(params)
                _unstash_grads(params, stashed)
        if one_pass and ddp is not None and _ddp_syncs_buffers(ddp) and _training_norms(net):
            # DDP broadcast rank 0's buffers before the forward, which each rank then updated with its own
            # rows: rank 0's rule again now, or evaluation (the bare net) and checkpoints differ by rank.
            broadcast_buffers_(net)

    elapsed = time.perf_counter() - start
    total, count, num_queries, num_valid = stats
    loss = float("nan") if grad is None else (total / count if count > 0 else 0.0)
    return StepResult(
        loss=torch.tensor(loss, dtype=torch.float32, device=device),
        num_valid=int(num_valid),
        num_queries=int(num_queries),
        count=float(count),
        global_batch_size=global_n,
        local_batch_size=local_n,
        world_size=world,
        num_chunks=len(bounds),
        comm_seconds=clock.seconds,
        compute_seconds=max(elapsed - clock.seconds, 0.0),
    )


# ----------------------------------------------------------------------------------------------------
# pass 1, loss gradient, pass 2


def _embed_first_pass(
    net: nn.Module,
    load: _ChunkLoader,
    bounds: list[tuple[int, int]],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> tuple[list[_RngState], Tensor, Tensor | None]:
    """Embed chunk by chunk, remembering each chunk's RNG state for the replay.

    All chunks but the last run under no_grad. The last one (when there are at least two) keeps its graph:
    it is back-propagated first in pass 2 instead of being re-run, which saves one chunk's forward for
    the memory of one chunk, the same peak pass 2 has anyway. It runs on the bare module, so under DDP it
    is one of the unsynchronised chunks.
    """
    states: list[_RngState] = []
    embeddings: Tensor | None = None
    kept: Tensor | None = None
    total = bounds[-1][1]
    for i, (s, e) in enumerate(bounds):
        keep = i == len(bounds) - 1 and i > 0
        states.append(_RngState.capture(device))
        with torch.set_grad_enabled(keep), _autocast(device, autocast_dtype):
            out = _as_embeddings(net(load(s, e)), e - s)
        if embeddings is None:
            embeddings = torch.empty((total, out.shape[1]), dtype=_storage_dtype(out), device=device)
        embeddings[s:e] = out.detach()
        if keep:
            kept = out
    states.append(_RngState.capture(device))  # where the stream stands after one forward of the batch
    assert embeddings is not None
    return states, embeddings, kept


def _embedding_gradient(
    loss_fn: nn.Module,
    embeddings: Tensor,
    labels: Tensor,
    sizes: list[int],
    offset: int,
    clock: _CommClock,
    *,
    grad_scale: float,
) -> tuple[Tensor | None, tuple[float, float, float, float], str | None]:
    """dL/dE for this rank's rows of the global batch, global (total, count, queries, valid), problem.

    When the embeddings or the gradient are not finite the gradient is None and `problem` says why; the
    outcome is identical on every rank (it is decided from gathered / all-reduced tensors).
    """
    n = embeddings.shape[0]
    with clock:
        gallery = all_gather_uneven(embeddings, sizes)
        gallery_labels = all_gather_uneven(labels, sizes)
    finite_rows = torch.isfinite(gallery).all(dim=1)
    if not finite_rows.all():
        owners = sorted({_owner(int(r), sizes) for r in torch.nonzero(~finite_rows).flatten()})
        problem = f"non-finite embeddings from rank(s) {owners}: the model output has NaN/inf"
        return None, (float("nan"), 0.0, float(len(gallery)), 0.0), problem

    # A loss whose gallery is constant for the gradient moves only its queries: differentiate with respect
    # to the local rows alone (no gathered-matrix gradient, no cross-rank sum of it).
    constant_gallery = bool(getattr(loss_fn, "gallery_is_constant", False))
    with torch.enable_grad():
        ref = gallery.detach()
        if constant_gallery:
            queries = ref[offset : offset + n].detach().requires_grad_(True)
            wrt = queries
        else:
            ref.requires_grad_(True)
            queries = ref[offset : offset + n]
            wrt = ref
        has_parts = callable(getattr(loss_fn, "parts", None))
        if has_parts:
            query_index = torch.arange(offset, offset + n, device=ref.device)
            parts = loss_fn.parts(
                queries, labels, ref_embeddings=ref, ref_labels=gallery_labels, query_index=query_index
            )
            total, count = parts.total, parts.count
            local_stats = [
                total.detach().double(),
                torch.as_tensor(count).detach().double().to(ref.device),
                torch.tensor(float(parts.num_queries), dtype=torch.float64, device=ref.device),
                torch.tensor(float(parts.num_valid), dtype=torch.float64, device=ref.device),
            ]
        elif len(sizes) == 1:
            total = loss_fn(queries, labels)
            count = torch.ones((), dtype=torch.float64, device=ref.device)
            local_stats = [total.detach().double(), count, count * n, count * n]
        else:
            raise TypeError(
                f"{type(loss_fn).__name__} has no parts(); across ranks the engine needs the LossParts "
                "contract (dmltrain.losses) to normalise by the global count"
            )
        stats = torch.stack(local_stats).reshape(4)
        with clock:
            all_reduce_sum_(stats)
        global_count = float(stats[1])
        objective = total / (global_count if global_count > 0 else 1.0)
        if grad_scale != 1.0:
            objective = objective * grad_scale
        grad = None
        if objective.requires_grad:
            (grad,) = torch.autograd.grad(objective, wrt, allow_unused=True)
        if grad is None:  # no term depended on the embeddings: the exact gradient is zero
            grad = torch.zeros_like(wrt)
    if constant_gallery:
        # No (B_global x D) all-reduce; one flag keeps the finiteness decision the same on every rank.
        bad = torch.tensor(0.0 if bool(torch.isfinite(grad).all()) else 1.0, device=grad.device)
        with clock:
            all_reduce_sum_(bad)
        finite, local = float(bad) == 0.0, grad
    else:
        with clock:
            all_reduce_sum_(grad)
        finite, local = bool(torch.isfinite(grad).all()), grad[offset : offset + n]
    g_total, g_count, g_queries, g_valid = (float(v) for v in stats.tolist())
    if not finite:
        problem = f"{type(loss_fn).__name__} produced a non-finite embedding gradient"
        return None, (float("nan"), g_count, g_queries, g_valid), problem
    return local, (g_total, g_count, g_queries, g_valid), None


def _backward_chunks(
    model: nn.Module,
    ddp: DistributedDataParallel | None,
    load: _ChunkLoader,
    bounds: list[tuple[int, int]],
    rng_states: list[_RngState],
    kept: Tensor | None,
    grad: Tensor,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> None:
    """Back-propagate every chunk's slice of dL/dE: the kept last chunk directly, the others re-run with
    autograd under their recorded RNG state.

    Under DDP only the final backward synchronises; ranks may run different numbers of chunks.
    """
    if kept is not None:
        s, e = bounds[-1]
        with ddp.no_sync() if ddp is not None else nullcontext():
            kept.backward(grad[s:e].to(kept.dtype))
        bounds = bounds[:-1]
    try:
        for i, (s, e) in enumerate(bounds):
            last = i == len(bounds) - 1
            rng_states[i].restore(device)
            with ddp.no_sync() if ddp is not None and not last else nullcontext():
                with torch.enable_grad(), _autocast(device, autocast_dtype):
                    out = _as_embeddings(model(load(s, e)), e - s)
                out.backward(grad[s:e].to(out.dtype))
    finally:
        rng_states[-1].restore(device)


# ----------------------------------------------------------------------------------------------------
# helpers


class _ChunkLoader:
    """Moves one chunk of the (possibly host-side, uint8) batch to the device and preprocesses it.

    From pinned host memory the copy is asynchronous: the host goes on queueing the chunk's compute.
    """

    def __init__(
        self, inputs: Tensor, device: torch.device, preprocess: Preprocess | None, channels_last: bool = False
    ) -> None:
        self.inputs, self.device, self.preprocess = inputs, device, preprocess
        self.channels_last = channels_last

    def __call__(self, start: int, end: int) -> Tensor:
        x = self.inputs[start:end].to(self.device, non_blocking=True)
        if self.preprocess is not None:
            with torch.no_grad():
                x = self.preprocess(x)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


@dataclass
class _RngState:
    cpu: Tensor
    cuda: Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> _RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)


class _CommClock:
    """Accumulates wall time spent in collectives (synchronising CUDA so queued compute is not counted)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled, self.seconds = device, enabled, 0.0
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> _CommClock:
        if self.enabled:
            self._sync()
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._sync()
            self.seconds += time.perf_counter() - self._t0


def _check_local_inputs(inputs: Tensor, labels: Tensor, chunk_size: int) -> str | None:
    """Describe what is wrong with this rank's arguments (None if nothing), without raising yet.

    The caller first tells every rank through the size gather, so all of them fail instead of hanging.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        return f"chunk_size must be a positive int, got {chunk_size!r}"
    if not isinstance(inputs, Tensor) or inputs.dim() < 1:
        return f"inputs must be a tensor with a batch dimension, got {type(inputs).__name__}"
    if not isinstance(labels, Tensor) or labels.dim() != 1:
        return f"labels must be a 1-D tensor, got shape {tuple(getattr(labels, 'shape', ()))}"
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return f"labels must be integer class ids, got dtype {labels.dtype}"
    if labels.shape[0] != inputs.shape[0]:
        return f"labels has {labels.shape[0]} entries but inputs has {inputs.shape[0]} samples"
    if inputs.shape[0] == 0:
        return "the local batch is empty"
    return None


def _as_embeddings(out: Any, rows: int) -> Tensor:
    if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != rows:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(f"the model must return embeddings of shape ({rows}, D), got {shape}")
    return out


def _storage_dtype(out: Tensor) -> torch.dtype:
    """float32 for reduced-precision outputs (the loss works in float32), the output's dtype otherwise."""
    return torch.promote_types(out.dtype, torch.float32)


def _device_of(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _owner(row: int, sizes: list[int]) -> int:
    for rank, n in enumerate(sizes):
        if row < n:
            return rank
        row -= n
    return len(sizes) - 1


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextmanager
def _batchnorm_frozen(net: nn.Module, freeze: bool) -> Iterator[None]:
    """Put training-mode BatchNorm layers in eval mode for the step and back afterwards."""
    frozen = [m for m in net.modules() if isinstance(m, _BatchNorm) and m.training] if freeze else []
    for m in frozen:
        m.train(False)
    try:
        yield
    finally:
        for m in frozen:
            m.train(True)


@contextmanager
def _running_stats_updated_once(net: nn.Module, sync: bool) -> Iterator[None]:
    """Undo the second pass's running-statistics update, so each chunk updates them once, as in pass 1.

    DDP broadcasts rank 0's buffers at the start of its first forward; restoring behind its back would let
    ranks drift apart, so under DDP rank 0's restored buffers are broadcast again (DDP's own rule).
    """
    norms = _training_norms(net)
    saved = _saved_buffers(norms)
    try:
        yield
    finally:
        _put_back(saved)
    if norms and sync:
        broadcast_buffers_(net)


def _training_norms(net: nn.Module) -> list[_NormBase]:
    """Norm layers a training-mode forward updates the running statistics of."""
    return [
        m
        for m in net.modules()
        if isinstance(m, _NormBase) and m.training and m.track_running_stats and m.running_mean is not None
    ]


def _norm_buffers(m: _NormBase) -> list[Tensor]:
    return [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


def _saved_buffers(norms: Iterable[_NormBase]) -> list[tuple[Tensor, Tensor]]:
    """Each running-statistics buffer of ``norms`` with a copy of its value, for `_put_back`."""
    return [(b, b.detach().clone()) for m in norms for b in _norm_buffers(m)]


def _put_back(saved: list[tuple[Tensor, Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in saved:
            buffer.copy_(value)


def _batch_statistics_only(net: nn.Module) -> bool:
    """BatchNorm layers that normalise by the batch even in eval mode: they keep no running statistics."""
    return any(isinstance(m, _BatchNorm) and m.running_mean is None for m in net.modules())


def _has_training_syncbn(net: nn.Module) -> bool:
    return any(isinstance(m, nn.SyncBatchNorm) and m.training for m in net.modules())


def _ddp_syncs_buffers(ddp: DistributedDataParallel) -> bool:
    return bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)))


def _complete_ddp_iteration(out: Tensor, params: list[nn.Parameter]) -> None:
    """Run the backward DDP's synced forward armed its reducer for, then put the gradients back.

    Finishing the iteration keeps every DDP mode (static_graph, find_unused_parameters) in step for the
    next one. A backward of zeros still yields NaN gradients (0 x NaN activations), hence the restore,
    in place because DDP's gradients may be views of its buckets.
    """
    saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
    out.backward(torch.zeros_like(out))
    with torch.no_grad():
        for p, old in zip(params, saved, strict=True):
            if old is None:
                p.grad = None
            elif p.grad is not None:
                p.grad.copy_(old)


def _stash_grads(params: list[nn.Parameter]) -> list[Tensor | None]:
    """Set gradients aside so the cross-rank sum covers only this step's contribution."""
    stashed = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stashed


def _unstash_grads(params: list[nn.Parameter], stashed: list[Tensor | None] | None) -> None:
    assert stashed is not None
    for p, old in zip(params, stashed, strict=True):
        if old is None:
            continue
        if p.grad is None:
            p.grad = old
        else:
            p.grad.add_(old)
