"""The worker loop's background batch reader: same batches, exact resume state, failures surface; and the
loader's own pinned join, which replaces it when the loader reads ahead itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmltrain.data import SamplerSpec, TrainLoader
from dmltrain.service.prefetch import BatchPrefetcher


def _loader(root: Path, workers: int = 0, **options) -> TrainLoader:
    spec = SamplerSpec(name="pk", samples_per_class=4, seed=5)
    return TrainLoader(root, 16, spec, rank=0, world_size=1, num_workers=workers, image_size=16, **options)


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("workers", [0, 1])
def test_prefetched_batches_and_resume_state_match_the_plain_loader(glyphs_root: Path, workers: int) -> None:
    plain = _loader(glyphs_root, workers)
    expected = [plain.next_batch() for _ in range(5)]
    state_after_3 = None
    prefetcher = BatchPrefetcher(_loader(glyphs_root, workers), pin=False)
    try:
        assert prefetcher.state_dict()["step"] == 0  # nothing drawn yet
        for i in range(3):
            assert _same(prefetcher.next_batch(), expected[i])
        state_after_3 = prefetcher.state_dict()
    finally:
        prefetcher.close()
    # The thread has read ahead, but the state handed out is the one after the third batch.
    assert state_after_3["step"] == 3
    resumed = _loader(glyphs_root, workers)
    resumed.load_state_dict(state_after_3)
    assert _same(resumed.next_batch(), expected[3])
    assert _same(resumed.next_batch(), expected[4])


class _Broken:
    """A loader whose third batch fails, as a bad shard would."""

    def __init__(self) -> None:
        self.n = 0

    def next_batch(self) -> tuple:
        self.n += 1
        if self.n == 3:
            raise OSError("shard train-000007.tar: truncated")
        return (torch.full((2,), self.n),)

    def state_dict(self) -> dict:
        return {"step": self.n}


def test_a_reading_failure_surfaces_in_the_training_thread() -> None:
    prefetcher = BatchPrefetcher(_Broken(), pin=False)
    try:
        assert prefetcher.next_batch()[0].tolist() == [1, 1]
        assert prefetcher.next_batch()[0].tolist() == [2, 2]
        assert prefetcher.state_dict() == {"step": 2}
        with pytest.raises(OSError, match="train-000007.tar: truncated"):
            prefetcher.next_batch()
    finally:
        prefetcher.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory)")
def test_batches_are_pinned_on_cuda(glyphs_root: Path) -> None:
    prefetcher = BatchPrefetcher(_loader(glyphs_root), pin=True)
    try:
        images, labels, _ = prefetcher.next_batch()
        assert images.is_pinned() and labels.is_pinned()
    finally:
        prefetcher.close()


def test_the_loader_reads_ahead_itself_only_with_several_workers(glyphs_root: Path) -> None:
    # The service adds its prefetch thread exactly when the loader has no join thread of its own.
    assert [_loader(glyphs_root, n).joins_ahead for n in (0, 1, 2)] == [False, False, True]


def test_pinning_without_cuda_is_refused_naming_the_option(glyphs_root: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: pinning works here (test_the_loader_joins_into_pinned_memory_on_cuda)")
    with pytest.raises(ValueError, match="pin_memory=True .* needs CUDA"):
        _loader(glyphs_root, 2, pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory)")
@pytest.mark.parametrize("workers", [1, 2])
def test_the_loader_joins_into_pinned_memory_on_cuda(glyphs_root: Path, workers: int) -> None:
    plain, pinned = _loader(glyphs_root, workers), _loader(glyphs_root, workers, pin_memory=True)
    for _ in range(3):
        batch = pinned.next_batch()
        assert all(t.is_pinned() for t in batch)
        assert _same(batch, plain.next_batch())
    assert pinned.state_dict()["workers"] == plain.state_dict()["workers"]
