"""How the network runs fast on its device: precision, memory format and compilation, chosen once.

Measured on one H100 (ResNet-50, 224 px, bf16, ../shared/ENVIRONMENT.md): the chunked engine ran at 1,982
img/s NCHW eager, 2,238 channels_last eager and 4,178 channels_last + ``torch.compile``. ``auto`` turns on
what pays off where it works: bf16 autocast on CUDA GPUs with bf16 (fp16 with loss scaling on older ones,
full precision on CPU), channels_last for convolutional networks on CUDA, compilation on CUDA. Everything
here changes how the network computes, never what the engine computes with its outputs, so the chunked
step stays exact for whatever the network is.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "Precision",
    "compile_network",
    "compile_state",
    "is_convolutional",
    "resolve_channels_last",
    "resolve_compile",
    "resolve_precision",
    "resolve_small_conv_matmul",
]

log = logging.getLogger("dmltrain.acceleration")

Setting = bool | Literal["auto"]
PrecisionName = Literal["auto", "fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Precision:
    """A resolved precision: the autocast dtype (None = the model's own) and whether gradients need scaling.

    fp16 has a narrow exponent range, so its backward needs a loss scale (`torch.amp.GradScaler`) to keep
    small gradients from flushing to zero; bf16 has float32's range and needs none.
    """

    name: Literal["fp32", "bf16", "fp16"]
    autocast_dtype: torch.dtype | None

    @property
    def grad_scaling(self) -> bool:
        return self.name == "fp16"


def cuda_has_bf16(device: torch.device) -> bool:
    """Native bf16 (Ampere and newer); emulated bf16 on older GPUs is slower than fp16."""
    with torch.cuda.device(device):
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # a torch without the argument, whose answer may count emulation: ask the hardware
            return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(name: PrecisionName, device: torch.device) -> Precision:
    """``auto``: bf16 on CUDA GPUs with native bf16, fp16 (with loss scaling) on older CUDA GPUs, fp32 else.

    Explicit names are honoured on any device (CPU autocast supports bf16 and fp16, which tests use).
    """
    if name == "auto" and device.type != "cuda":
        name = "fp32"
    elif name == "auto":
        name = "bf16" if cuda_has_bf16(device) else "fp16"
    if name == "fp32":
        return Precision("fp32", None)
    if name == "bf16":
        return Precision("bf16", torch.bfloat16)
    if name == "fp16":
        return Precision("fp16", torch.float16)
    raise ValueError(f"precision must be one of auto, fp32, bf16, fp16; got {name!r}")


def is_convolutional(model: nn.Module) -> bool:
    """A CNN (ResNet, ConvNeXt, EfficientNet...) rather than a transformer with a patch-embedding conv."""
    return sum(isinstance(m, nn.Conv2d) for m in model.modules()) >= 3


def resolve_channels_last(setting: Setting, device: torch.device, model: nn.Module) -> bool:
    """``auto``: channels_last for convolutional networks on CUDA (tensor-core convolutions want NHWC)."""
    if setting == "auto":
        return device.type == "cuda" and is_convolutional(model)
    return bool(setting)


def resolve_compile(setting: Setting, device: torch.device) -> bool:
    """``auto``: compile on CUDA, where it doubled the chunked step's speed; eager on CPU (compile time)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def resolve_small_conv_matmul(setting: Setting, device: torch.device) -> bool:
    """``auto``: on CPU, where oneDNN is slow on convolutions with tiny outputs (see dmltrain.small_convs)."""
    if setting == "auto":
        return device.type == "cpu"
    return bool(setting)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this could not be compiled" rather than "the model failed"."""
    found: list[type[BaseException]] = []
    for module, name in (
        ("torch._dynamo.exc", "TorchDynamoException"),
        ("torch._inductor.exc", "InductorError"),
        ("torch._inductor.exc", "CppCompileError"),
        ("torch._inductor.exc", "CUDACompileError"),
    ):
        try:
            found.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


class _CompiledForward:
    """A module's ``forward``, compiled; where compilation fails, eager from then on (one warning).

    When the compiled call raises, the same call is retried eagerly: if eager fails too, the inputs or the
    model are at fault and that error propagates (nothing changes); if eager works, compilation is what
    failed and the module stays eager. After the first success only compiler errors are retried, so a
    runtime error such as out-of-memory is not run a second time. The RNG state is put back before the
    eager retry, so a partly run compiled forward cannot shift the dropout masks the engine replays.
    """

    def __init__(self, eager: Any, options: dict[str, Any], state: str = "untried") -> None:
        self.eager = eager
        self.options = options
        self.compiled = torch.compile(eager, **options)
        self.state = state  # untried | works | eager
        self._errors = _compile_errors()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.state == "eager":
            return self.eager(*args, **kwargs)
        rng = rng_state()
        try:
            with _backward_compiled_with_forward():
                out = self.compiled(*args, **kwargs)
        except Exception as error:
            if self.state == "works" and not isinstance(error, self._errors):
                raise
            restore_rng_state(rng)
            out = self.eager(*args, **kwargs)  # raises the real error if the call itself is at fault
            self.state = "eager"
            message = f"torch.compile failed ({_describe(error)}); running the network eagerly"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log.warning("%s", message)
            return out
        self.state = "works"
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> _CompiledForward:
        # The eager forward is a bound method: deep-copying rebinds it to the copied module, and the copy
        # gets its own compiled function instead of one that would run the original's weights.
        eager = copy.deepcopy(self.eager, memo)
        return _CompiledForward(eager, self.options, "eager" if self.state == "eager" else "untried")


def _backward_compiled_with_forward() -> Any:
    """AOTAutograd compiles the backward graph at the first backward (lazily) unless told otherwise; a
    compiler that fails there raised outside this wrapper, in the engine's backward, and the run was
    retried into the same failure. Compiled with the forward, its failure falls back like any other."""
    try:
        from torch._functorch import config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "force_non_lazy_backward_lowering"):  # a torch without the switch
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def _describe(error: BaseException) -> str:
    """One line: the compiler's own error where dynamo wraps it (BackendCompilerFailed)."""
    inner = getattr(error, "inner_exception", None) or error
    first = next((line for line in str(inner).strip().splitlines() if line.strip()), "")
    return f"{type(inner).__name__}: {first[:300]}"


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU and (when initialised) every CUDA generator's state, for `restore_rng_state`."""
    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return torch.get_rng_state(), cuda


def restore_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def compile_network(model: nn.Module, **options: Any) -> nn.Module:
    """Compile ``model.forward`` in place (same module, parameters and state_dict keys) and return it.

    In place, so a DDP wrapper made afterwards wraps the compiled module: the engine's no_sync, RNG replay
    and gradient hooks all stay on the uncompiled wrapper, exactly as in eager mode. ``options`` go to
    ``torch.compile`` (e.g. ``backend="aot_eager"``, ``mode="max-autotune"``). Falls back to eager with one
    warning when compilation fails. Compiling twice is a no-op.
    """
    if isinstance(model.__dict__.get("forward"), _CompiledForward):
        return model
    model.forward = _CompiledForward(model.forward, dict(options))  # type: ignore[method-assign]
    return model


def compiled_forwards(model: nn.Module) -> list[_CompiledForward]:
    """Every compiled forward in ``model`` (`compile_network`), whatever its state."""
    return [
        forward
        for module in model.modules()
        if isinstance(forward := module.__dict__.get("forward"), _CompiledForward)
    ]


def compile_state(model: nn.Module) -> str:
    """``eager`` (never compiled or fallen back), ``untried`` (compiled, not yet called) or ``works``."""
    forward = model.__dict__.get("forward")
    return forward.state if isinstance(forward, _CompiledForward) else "eager"
