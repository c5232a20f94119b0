"""The device decode path's crop loop (`dmltrain.data.crops`): compiled by TorchScript (so that it does not
trade the GIL with the training thread per torch call; `bench/decode_thread.py` measures that), with the
same pixels as the Python loop."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dmltrain.data import crops as crops_module
from dmltrain.data import train_transform
from dmltrain.data.crops import crops, crops_resampled, scripted_crops


def _images_and_boxes(count: int, seed: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    rng = np.random.default_rng(seed)
    images, boxes = [], []
    for _ in range(count):
        rows, cols = (int(v) for v in rng.integers(20, 90, size=2))
        images.append(torch.from_numpy(rng.integers(0, 256, (3, rows, cols), dtype=np.uint8)))
        height, width = int(rng.integers(5, rows + 1)), int(rng.integers(5, cols + 1))
        boxes.append(
            [int(rng.integers(0, rows - height + 1)), int(rng.integers(0, cols - width + 1)), height, width]
        )
    return images, boxes


@pytest.mark.parametrize("warp", [0, 48])
@pytest.mark.parametrize(
    ("mode", "align_corners", "antialias"), [("bilinear", False, True), ("nearest", None, False)]
)
def test_the_compiled_loop_gives_the_python_loops_pixels(
    warp: int, mode: str, align_corners: bool | None, antialias: bool
) -> None:
    compiled = scripted_crops()
    assert isinstance(compiled, torch.jit.ScriptFunction), "TorchScript did not compile the crop loop"
    images, boxes = _images_and_boxes(12)
    boxes[0] = [-3, -2, 30, 28]  # past the edge: zero-padded in both
    want = crops_resampled(images, boxes, 24, warp, mode, align_corners, antialias)
    got = compiled(images, boxes, 24, warp, mode, align_corners, antialias)
    assert got.shape == (12, 3, 24, 24) and torch.equal(got, want)


def test_resample_batch_is_the_same_on_and_off_the_gil() -> None:
    augment = train_transform(24, resize_mode="warp", resize=40)
    images, _ = _images_and_boxes(10, seed=1)
    torch.manual_seed(0)
    params = [augment.draw(*image.shape[-2:]) for image in images]
    assert torch.equal(
        augment.resample_batch(images, params), augment.resample_batch(images, params, off_the_gil=False)
    )


def test_a_compiled_loop_that_fails_gives_way_to_python_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(*args: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("unsupported in this build\nmore detail")

    monkeypatch.setattr(crops_module, "scripted_crops", lambda: broken)
    monkeypatch.setattr(crops_module, "_SCRIPT_FAILED", [])
    images, boxes = _images_and_boxes(5)
    want = crops_resampled(images, boxes, 24, 0, "bilinear", False, True)
    with caplog.at_level(logging.WARNING, logger="dmltrain.data.crops"):
        for _ in range(3):
            assert torch.equal(crops(images, boxes, 24, 0, "bilinear", False, True), want)
    assert len(calls) == 1, "the compiled loop is tried once, then the process crops in Python"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "the TorchScript crop loop failed (unsupported in this build); cropping in Python from now on"
    ]


def test_an_error_the_inputs_cause_is_raised_and_keeps_the_compiled_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(crops_module, "_SCRIPT_FAILED", [])
    # nothing to concatenate: TorchScript's RuntimeError gives way to the error Python's loop raises
    with pytest.raises(ValueError, match="non-empty list of Tensors"):
        crops([], [], 24, 0, "bilinear", False, True)
    assert crops_module._SCRIPT_FAILED == []


def test_a_full_gpu_inside_the_compiled_loop_is_an_out_of_memory_error_and_keeps_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The TorchScript interpreter re-raises torch's out-of-memory error as a plain RuntimeError; taken for a
    TorchScript gap, it cropped the batch again in Python and switched the compiled loop off for good."""
    calls = []

    def out_of_memory(*args: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError(
            "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript "
            "(most recent call last):\nRuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB."
        )

    monkeypatch.setattr(crops_module, "scripted_crops", lambda: out_of_memory)
    monkeypatch.setattr(crops_module, "crops_resampled", lambda *args: pytest.fail("cropped in Python"))
    monkeypatch.setattr(crops_module, "_SCRIPT_FAILED", [])
    images, boxes = _images_and_boxes(3)
    with pytest.raises(
        torch.cuda.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 GiB"
    ):
        crops(images, boxes, 24, 0, "bilinear", False, True)
    assert calls == [1] and crops_module._SCRIPT_FAILED == []
