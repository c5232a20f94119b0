"""Evaluation during training keeps each worker's decoded test images after the first pass (eval.cache_mb).

Real glyph shards, the real loader (in a loader process where it matters) and the service's embed_split in
one process (world of 1); the shards are deleted between evaluations to show the second one reads none.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from dmltrain.data import EvalLoader, prepare
from dmltrain.data.metadata import DatasetInfo
from dmltrain.service.builders import build_network
from dmltrain.service.config import ExperimentConfig, load_config
from dmltrain.service.distributed_eval import EmbeddedSplit, EvalImageCache, embed_split

REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def small_glyphs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DatasetInfo]:
    root = tmp_path_factory.mktemp("glyphs40")
    info = prepare("glyphs", "-", root, min_faces=12, image_size=32, max_classes=40, progress=False)
    return root, info


def _embed(
    root: Path, info: DatasetInfo, cache: EvalImageCache | None, *overrides: str
) -> tuple[ExperimentConfig, EmbeddedSplit]:
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [f"data.root={root}", "data.prepare=null", "eval.batch_size=64", *overrides],
    )
    torch.manual_seed(0)
    net = build_network(config)
    cpu = torch.device("cpu")
    return config, embed_split(net, config, info, "test", cpu, 0, 1, True, cache=cache)


def _copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to)
    return to


@pytest.mark.parametrize("loader_workers", [0, 1])
def test_second_evaluation_reads_no_shard_and_embeds_the_same(
    small_glyphs: tuple[Path, DatasetInfo], tmp_path: Path, loader_workers: int
) -> None:
    source, info = small_glyphs
    root = _copy(source, tmp_path / "glyphs")
    overrides = (f"data.loader_workers={loader_workers}",)
    _, plain = _embed(root, info, None, *overrides)
    cache = EvalImageCache(64 << 20)
    _, first = _embed(root, info, cache, *overrides)
    kept = cache.batches("test")
    assert kept is not None and sum(len(labels) for _, labels, _ in kept) == len(plain.labels) > 400
    assert cache.used_bytes == sum(i.nbytes + labels.nbytes + s.nbytes for i, labels, s in kept)
    for path in root.glob("test-*.tar"):  # a streamed evaluation would now fail on a missing shard
        path.unlink()
    _, second = _embed(root, info, cache, *overrides)
    for result in (first, second):
        assert torch.equal(result.embeddings, plain.embeddings)
        assert torch.equal(result.labels, plain.labels)
        assert result.thumbnails.keys() == plain.thumbnails.keys()
        assert all((result.thumbnails[i] == plain.thumbnails[i]).all() for i in plain.thumbnails)


def test_split_over_the_budget_is_streamed_every_time(
    small_glyphs: tuple[Path, DatasetInfo], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, info = small_glyphs
    root = _copy(source, tmp_path / "glyphs")
    cache = EvalImageCache(100_000)  # about 30 images of 32 x 32 x 3
    with caplog.at_level(logging.INFO, logger="dmltrain.service.distributed_eval"):
        _, first = _embed(root, info, cache)
    assert cache.batches("test") is None and cache.used_bytes == 0
    assert "take more than eval.cache_mb" in caplog.text
    _, second = _embed(root, info, cache)
    assert torch.equal(first.embeddings, second.embeddings)
    for path in root.glob("test-*.tar"):
        path.unlink()
    with pytest.raises(Exception, match="test-"):  # streamed again: the missing shard is named
        _embed(root, info, cache)


def test_capped_evaluation_keeps_the_capped_images(small_glyphs: tuple[Path, DatasetInfo]) -> None:
    root, info = small_glyphs
    cache = EvalImageCache(64 << 20)
    _, plain = _embed(root, info, None, "eval.max_images=100")
    _, first = _embed(root, info, cache, "eval.max_images=100")
    _, second = _embed(root, info, cache, "eval.max_images=100")
    kept = cache.batches("test")
    assert (
        kept is not None and sum(len(labels) for _, labels, _ in kept) == len(plain.labels) == 100
    )  # 64 + 36
    assert torch.equal(first.embeddings, plain.embeddings)
    assert torch.equal(second.embeddings, plain.embeddings)


def test_cache_mb_zero_turns_it_off(small_glyphs: tuple[Path, DatasetInfo]) -> None:
    root, info = small_glyphs
    config, _ = _embed(root, info, None, "eval.cache_mb=0")
    cache = EvalImageCache(config.eval.cache_mb << 20)
    _embed(root, info, cache)
    assert cache.batches("test") is None


def test_rows_come_in_shard_order_whatever_the_number_of_loader_workers(tmp_path: Path) -> None:
    """Two loader workers interleave their batches; the embedded split (and so the retrieval grid's
    queries, chosen by position) must not depend on that."""
    root = tmp_path / "glyphs"
    info = prepare(
        "glyphs", "-", root, min_faces=12, image_size=32, max_classes=40, shard_size=60, progress=False
    )
    assert len(info.split("test").shards) >= 4
    results = [_embed(root, info, None, f"data.loader_workers={n}", "eval.batch_size=16")[1] for n in (0, 2)]
    plain, interleaved = results
    assert torch.equal(interleaved.labels, plain.labels)
    # other batch compositions: the same rows to float rounding
    torch.testing.assert_close(interleaved.embeddings, plain.embeddings, rtol=0, atol=1e-5)
    assert all((interleaved.thumbnails[i] == plain.thumbnails[i]).all() for i in plain.thumbnails)
    reader = EvalLoader(root, "test", 1000, info=info, with_shards=True)
    labels = torch.cat([batch[1] for batch in reader])  # one process reads its shards front to back
    assert torch.equal(plain.labels, labels)


def test_embeddings_that_are_not_finite_end_the_run_without_a_retry(
    small_glyphs: tuple[Path, DatasetInfo],
) -> None:
    """data.std of 1e-300 (or diverged weights) made every embedding NaN: the evaluation's ValueError was
    retried from the checkpoint run.max_failures times, each failing alike, and ended in a traceback."""
    from dmltrain.service.errors import FATAL_IN_LOOP, NonFiniteEmbeddingsError

    root, info = small_glyphs
    with pytest.raises(
        NonFiniteEmbeddingsError, match=r"embeds (\d+) of \1 images of split 'test' as NaN or inf"
    ):
        _embed(root, info, None, "data.std=[1e-300,1e-300,1e-300]")
    assert issubclass(NonFiniteEmbeddingsError, FATAL_IN_LOOP)


class _NaNOnRank(torch.nn.Module):
    """The service's network, whose embeddings turn NaN on one rank only."""

    def __init__(self, net: torch.nn.Module, rank: int, bad_rank: int) -> None:
        super().__init__()
        self.net, self.poison = net, rank == bad_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * float("nan") if self.poison else out


def _embed_on_rank(rank: int, port: int, root: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dmltrain.data.metadata import load_dataset_info
    from dmltrain.service.errors import NonFiniteEmbeddingsError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        config = load_config(
            REPO / "configs" / "quickstart.yaml",
            [f"data.root={root}", "data.prepare=null", "data.loader_workers=0", "eval.batch_size=64"],
        )
        torch.manual_seed(0)
        net = _NaNOnRank(build_network(config), rank, bad_rank=1)
        try:
            embed_split(net, config, load_dataset_info(root), "test", torch.device("cpu"), rank, 2, False)
            outcome = "returned"
        except NonFiniteEmbeddingsError as error:
            outcome = str(error)
        (Path(out_dir) / f"rank{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_embeddings_broken_on_one_rank_stop_every_rank(
    small_glyphs: tuple[Path, DatasetInfo], tmp_path: Path
) -> None:
    """Only rank 0 receives the gathered rows; it alone stopped, and the other ranks went on into the next
    collective, to wait there until Ray tore the group down (then reported as a retryable error)."""
    import socket

    import torch.multiprocessing as mp

    root, info = small_glyphs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_embed_on_rank, args=(port, str(root), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    total = info.split("test").num_samples
    for outcome in outcomes:
        assert outcome.startswith("the network embeds "), outcomes
        assert f" of {total} images of split 'test' as NaN or inf" in outcome, outcomes
    assert outcomes[0] == outcomes[1]
