"""Rules of `dmltrain.index` and `dmltrain.distributed` that matter on GPUs, checked on the CPU with stand-ins
for the GPU objects (faiss-gpu and NCCL are not here): which PQ code sizes faiss-gpu accepts, which searches
go to the CPU copy, one search at a time on a GPU index, and where NCCL collectives move host tensors."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import dmltrain.distributed as distributed
from dmltrain.index import _GPU_PQ_BYTES, GPU_MAX_K, _as_float32, _gpu_device, _pq_subquantizers, build_index


@pytest.mark.parametrize("dim", [32, 64, 100, 128, 200, 256, 300, 384, 512, 768, 1024])
def test_8_bit_codes_have_a_size_faiss_gpu_supports_and_4_bit_codes_pair_up(dim: int) -> None:
    """faiss-gpu's IVF-PQ refuses other code sizes: 512-d embeddings got 64 (fine), 100-d got 25, 300-d 60."""
    m8, m4 = _pq_subquantizers(dim, 8), _pq_subquantizers(dim, 4)
    assert m8 in _GPU_PQ_BYTES and dim % m8 == 0 and m8 <= dim // 4
    assert m4 % 2 == 0 and dim % m4 == 0 and m4 <= 64
    assert (
        _pq_subquantizers(512, 8) == 64
        and _pq_subquantizers(100, 8) == 20
        and _pq_subquantizers(300, 8) == 20
    )


class _StandIn:
    """A GPU index stand-in: searches the CPU index, slowly, and records whether two searches overlapped."""

    def __init__(self, index: Any) -> None:
        self.index, self.calls, self.active, self.overlapped = index, 0, 0, False
        self._count = threading.Lock()

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        with self._count:
            self.calls += 1
            self.active += 1
            self.overlapped |= self.active > 1
        time.sleep(0.02)
        try:
            return self.index.search(q, k)
        finally:
            with self._count:
                self.active -= 1


def _built(n: int = 3000, dim: int = 16) -> tuple[Any, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return build_index(x, "flat"), x


def test_a_gpu_index_is_searched_by_one_thread_at_a_time() -> None:
    """A scoring server answers requests in threads; a faiss GPU index must not be searched concurrently."""
    built, x = _built()
    stand_in = _StandIn(built.index)
    built._device_index = stand_in
    expected = built.index.search(x[:8], 5)[1]
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(built.search(x[:8], 5)[1])) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stand_in.calls == 6 and not stand_in.overlapped
    assert all((r == expected).all() for r in results)


def test_more_neighbours_than_faiss_gpu_returns_are_found_on_the_cpu_copy() -> None:
    built, x = _built()
    stand_in = _StandIn(built.index)
    built._device_index = stand_in
    sims, ids = built.search(x[:3], GPU_MAX_K + 1)
    assert stand_in.calls == 0 and ids.shape == (3, GPU_MAX_K + 1) and (ids >= 0).all()
    assert (ids[:, 0] == np.arange(3)).all() and np.allclose(sims[:, 0], 1, atol=1e-5)
    built.search(x[:3], GPU_MAX_K)
    assert stand_in.calls == 1


def test_bfloat16_embeddings_are_accepted() -> None:
    """CUDA autocast gives bfloat16, which has no numpy type."""
    x = torch.randn(4, 8)
    assert np.array_equal(_as_float32(x.bfloat16(), "x"), x.bfloat16().float().numpy())


def test_faiss_takes_device_0_until_torch_has_set_up_cuda() -> None:
    assert _gpu_device() == 0


@pytest.mark.parametrize(
    ("backend", "tensor_on", "travels_on"),
    [
        ("nccl", "cuda:1", "cuda:1"),
        ("nccl", "cpu", "cuda:3"),  # a pure NCCL group cannot move host tensors: via this process's GPU
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
        ("gloo", "cpu", "cpu"),
        ("gloo", "cuda:1", "cpu"),
    ],
)
def test_collectives_move_tensors_where_the_backend_can_carry_them(
    monkeypatch: pytest.MonkeyPatch, backend: str, tensor_on: str, travels_on: str
) -> None:
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.communication_device(torch.device(tensor_on)) == torch.device(travels_on)


@pytest.mark.parametrize(
    ("installed", "pinned"),
    [
        ({"faiss-cpu": "1.15.1"}, "faiss-cpu==1.15.1"),
        ({"faiss-gpu-cu12": "1.11.0.1"}, "faiss-cpu~=1.11.0"),  # a GPU build: the CPU one of its release
        ({"faiss-gpu": "1.7.2"}, "faiss-cpu~=1.7.2"),
        ({}, "faiss-cpu"),
    ],
)
def test_a_search_model_logged_on_a_gpu_host_installs_on_any_host(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], pinned: str
) -> None:
    """Logged with faiss-gpu, a search model pinned faiss-gpu-cu12: CUDA libraries on CPU hosts, no macOS."""
    from importlib import metadata

    from dmltrain.service.serving import search_model

    def version(name: str) -> str:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(search_model.metadata, "version", version)
    assert search_model._faiss_requirement() == pinned
