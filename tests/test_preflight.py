"""Fail fast: every error a worker would raise from its config or data layout is raised by the driver first,
in one line naming the key, before Ray is contacted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dmltrain.models import build_model
from dmltrain.service.config import ConfigError, ExperimentConfig, load_config, recall_ks, with_recall_ks
from dmltrain.service.preflight import (
    check_config,
    check_data,
    evaluated_train_split_note,
    load_data,
    short_pieces_note,
)

REPO = Path(__file__).parents[1]


def _config(*overrides: str) -> ExperimentConfig:
    return load_config(REPO / "configs" / "quickstart.yaml", list(overrides))


def _one_line_error(call, *args) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_model_errors_are_caught_without_building_the_model(tmp_path: Path) -> None:
    assert "model.backbone='resnet19'" in _one_line_error(check_config, _config("model.backbone=resnet19"))
    assert "model.weights='IMAGENET9K'" in _one_line_error(check_config, _config("model.weights=IMAGENET9K"))
    missing = _one_line_error(check_config, _config(f"model.weights={tmp_path / 'none.pt'}"))
    assert missing.startswith("model.weights: file not found")
    import torch

    torch.save({"model": build_model("resnet18", 64).state_dict()}, tmp_path / "r18_64.pt")
    check_config(
        _config("model.backbone=resnet18", "model.embedding_dim=64", f"model.weights={tmp_path}/r18_64.pt")
    )
    wrong_size = _one_line_error(check_config, _config(f"model.weights={tmp_path}/r18_64.pt"))  # dim 128
    assert wrong_size.startswith(f"model.weights={tmp_path}/r18_64.pt: does not fit this model")
    unknown = _one_line_error(check_config, _config("model.backbone_kwargs={nosuch: 1}"))
    assert (
        unknown.startswith("model.backbone_kwargs={'nosuch': 1}: ") and "nosuch" in unknown.split(": ", 1)[1]
    )
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    assert "not a loadable state dict" in _one_line_error(
        check_config, _config(f"model.weights={tmp_path}/junk.pt")
    )


def test_missing_faiss_fails_at_start_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)  # how Python marks a module as not importable
    message = _one_line_error(check_config, _config())
    assert "faiss is not installed" in message and "pip install 'dmltrain[cpu]'" in message
    check_config(_config("eval.grid_queries=0"))  # the only use of faiss in training is the plot


def test_config_level_batch_rules() -> None:
    with pytest.raises(ConfigError, match=r"= 128 is not a multiple of 3"):
        load_config(REPO / "configs" / "sop_triplet.yaml", ["train.global_batch_size=1024"])
    load_config(REPO / "configs" / "sop_triplet.yaml")  # the shipped triplet config fits 8 workers
    with pytest.raises(ConfigError, match=r"samples_per_class must be >= 2 for sampler.name=pk"):
        _config("sampler.samples_per_class=1")


def test_data_errors_name_the_root_in_one_line(glyphs_root: Path, tmp_path: Path) -> None:
    missing = _one_line_error(load_data, _config(f"data.root={tmp_path / 'nowhere'}", "data.prepare=null"))
    assert missing.startswith(f"data.root={tmp_path / 'nowhere'}: ") and "prepare the data first" in missing
    base = [f"data.root={glyphs_root}", "data.prepare=null"]
    info = load_data(_config(*base))
    check_data(_config(*base), info)
    assert "data.train_split" in _one_line_error(check_data, _config(*base, "data.train_split=nope"), info)
    vehicleid = _one_line_error(check_data, _config(*base, "sampler.name=vehicleid"), info)
    # The data layer's own line (dmltrain.data.check_batch): the keys, the numbers and the data set.
    assert vehicleid == (
        f"sampler.name=vehicleid fills half of train.global_batch_size=128 = 64 images from unlabelled "
        f"vehicles (category -1), but {glyphs_root} has 0 in classes of 2+ images"
    )
    many = _one_line_error(check_data, _config(*base, "train.global_batch_size=4096"), info)
    assert many.startswith("train.global_batch_size=4096 / sampler.samples_per_class=4 = 1024 classes")
    shards = len(info.split("train").shards)
    crowded = _config(*base, "scaling.num_workers=2", f"data.loader_workers={shards}")  # 2 x shards > shards
    assert "smaller --shard-size" in _one_line_error(check_data, crowded, info)


def _note(config: ExperimentConfig, info) -> str | None:
    """The start-of-run note for `config`'s batch plan, as `launch` gets it from `check_data`."""
    return short_pieces_note(config, check_data(config, info))


def test_a_batch_in_parts_that_are_not_multiples_of_k_is_announced(glyphs_root: Path) -> None:
    base = [f"data.root={glyphs_root}", "data.prepare=null"]
    info = load_data(_config(*base))
    assert _note(_config(*base), info) is None  # the quickstart: parts of whole pieces
    note = _note(_config(*base, "train.global_batch_size=30", "data.loader_workers=2"), info)
    assert note == (
        "sampler.samples_per_class=4: train.global_batch_size=30 is read in parts of 14 and 16 images "
        "(scaling.num_workers=1 x data.loader_workers=2), not all multiples of 4, so some classes enter each "
        "batch with fewer than 4 images; a global batch that is a multiple of 4 avoids it"
    )
    two_ranks = _config(*base, "train.global_batch_size=36", "scaling.num_workers=2", "data.loader_workers=1")
    ranks_note = _note(two_ranks, info) or ""
    assert "parts of 18 images" in ranks_note and ranks_note.endswith("multiple of 8 avoids it")
    whole = _config(*base, "train.global_batch_size=36", "scaling.num_workers=1")
    assert _note(whole, info) is None
    random = _config(*base, "train.global_batch_size=30", "sampler.name=random")
    assert _note(random, info) is None
    # K above every class: pieces are whole classes, silently fewer than K images each
    largest = max(n for shard in info.split("train").shards for _, n in shard.class_counts)
    big_k = _config(*base, "train.global_batch_size=128", "sampler.samples_per_class=64")
    assert _note(big_k, info) == (
        f"sampler.samples_per_class=64, but no train class has more than {largest} images in one shard: "
        "every class enters a batch whole, with fewer than 64 images"
    )


def test_training_on_an_evaluated_split_is_announced(glyphs_root: Path) -> None:
    """`data.train_split=test` trained on the held-out classes; the metrics read as held-out figures."""
    base = [f"data.root={glyphs_root}", "data.prepare=null"]
    info = load_data(_config(*base))
    assert evaluated_train_split_note(_config(*base), info) is None
    names = [e.name for e in info.evaluations if "test" in (e.query, e.gallery)]
    assert names
    assert evaluated_train_split_note(_config(*base, "data.train_split=test"), info) == (
        f"data.train_split=test is also read by evaluation(s) {', '.join(names)}: their metrics measure "
        "images the model trains on, not held-out ones"
    )


def test_an_evaluation_no_query_can_answer_is_refused_before_any_worker(glyphs_root: Path) -> None:
    """A test split whose every file `prepare` skipped failed the step-0 evaluation on every worker, with
    an error naming no split, four times (retried)."""
    from dmltrain.data.metadata import Evaluation, SplitInfo

    base = _config(f"data.root={glyphs_root}", "data.prepare=null")
    info = load_data(base)
    empty = SplitInfo(num_samples=0, num_classes=0, num_categories=0, shards=[])
    no_test = info.model_copy(update={"splits": {**info.splits, "test": empty}})
    assert _one_line_error(check_data, base, no_test) == (
        f"data.root={glyphs_root}: evaluation 'test' reads split 'test', which has no images"
    )
    test = info.split("test")
    ones = [
        shard.model_copy(update={"class_counts": [(c, 1) for c, _ in shard.class_counts]})
        for shard in test.shards
    ]
    singles = info.model_copy(
        update={"splits": {**info.splits, "test": test.model_copy(update={"shards": ones})}}
    )
    assert "every class of split 'test' has one image" in _one_line_error(check_data, base, singles)
    # One image of each class in each of two shards (--group-size 1) is two images per class: answerable
    twin = test.shards[1].model_copy(update={"class_counts": ones[0].class_counts})
    spread = test.model_copy(update={"shards": [ones[0], twin]})
    check_data(base, info.model_copy(update={"splits": {**info.splits, "test": spread}}))
    apart = info.model_copy(update={"evaluations": [Evaluation(name="qg", query="test", gallery="train")]})
    assert _one_line_error(check_data, base, apart).endswith(
        "evaluation 'qg': no class of split 'test' has an image in split 'train'"
    )
    # a split that is its own gallery: every query found itself first (Recall@1 1.0 for any model)
    itself = info.model_copy(update={"evaluations": [Evaluation(name="qq", query="test", gallery="test")]})
    assert "evaluation 'qq' searches split 'test' with its own images as the gallery" in _one_line_error(
        check_data, base, itself
    )


def test_missing_or_cut_shards_are_found_before_any_worker(glyphs_root: Path, tmp_path: Path) -> None:
    """Were found by a worker after Ray started and the step-0 evaluation ran (45 s here, retried)."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(glyphs_root, root)
    base = [f"data.root={root}", "data.prepare=null"]
    info = load_data(_config(*base))
    check_data(_config(*base), info)
    train, test = info.split("train").shards, info.split("test").shards
    (root / test[0].name).unlink()
    message = _one_line_error(check_data, _config(*base), info)
    assert message.startswith(f"data.root={root}: shard {test[0].name} is missing (dataset.json lists them")
    shutil.copy(glyphs_root / test[0].name, root / test[0].name)
    cut = root / train[1].name
    cut.write_bytes(cut.read_bytes()[:4096])
    if train[1].size_bytes is not None:  # sizes are recorded by builds since 2026-11-27
        assert f"shard {train[1].name} has 4096 bytes" in _one_line_error(check_data, _config(*base), info)
    cut.unlink()
    assert f"shard {train[1].name} is missing" in _one_line_error(check_data, _config(*base), info)


def test_recall_cut_offs_are_checked_with_the_config() -> None:
    """eval.ks=[0] used to pass, then fail every evaluation in the workers (retried, a traceback)."""
    for bad in ("[0]", "[]", "[1,-2]"):
        with pytest.raises(ConfigError, match=r"eval\.ks"):
            _config(f"eval.ks={bad}")


def test_unset_recall_cut_offs_are_the_data_sets(glyphs_root: Path) -> None:
    """A config without eval.ks reported R@1, 2, 4, 8 on SOP (whose papers report 1, 10, 100, 1000, as its
    dataset.json says): unset, they are the data set's, resolved before the run starts."""
    unset = _config("eval.ks=null", f"data.root={glyphs_root}", "data.prepare=null")
    assert unset.eval.ks is None
    assert with_recall_ks(unset, [1, 10, 100, 1000]).eval.ks == (1, 10, 100, 1000)
    assert with_recall_ks(_config("eval.ks=[1,5]"), [1, 10]).eval.ks == (1, 5)  # set: kept
    info = load_data(unset)
    assert recall_ks(unset, info.recall_ks) == (1, 2, 4, 8)  # the glyphs' own
    check_data(
        _config("eval.ks=null", "train.best_metric=eval/test/recall@4", f"data.root={glyphs_root}"), info
    )
    refused = _one_line_error(
        check_data,
        _config("eval.ks=null", "train.best_metric=eval/test/recall@10", f"data.root={glyphs_root}"),
        info,
    )
    assert "train.best_metric='eval/test/recall@10'" in refused


def test_best_metric_map_needs_the_exact_evaluation(glyphs_root: Path) -> None:
    """A faiss-scored evaluation reports no full-ranking map: ranking checkpoints by it passed the checks
    and stopped the run at its first evaluation (BestMetricError)."""
    base = _config(f"data.root={glyphs_root}", "train.best_metric=eval/test/map")
    info = load_data(base)
    check_data(base, info)  # exact: map is reported
    check_data(
        _config(f"data.root={glyphs_root}", "train.best_metric=eval/test/map@r", "eval.index=hnsw"), info
    )
    faiss = _one_line_error(
        check_data,
        _config(f"data.root={glyphs_root}", "train.best_metric=eval/test/map", "eval.index=hnsw"),
        info,
    )
    assert faiss == (
        "train.best_metric=eval/test/map: evaluation 'test' is scored by a faiss index (eval.index=hnsw), "
        "which reports recall@K, map@r and r_precision, not map"
    )
    large = _config(
        f"data.root={glyphs_root}",
        "train.best_metric=eval/test/map",
        "eval.index=auto",
        "eval.exact_max_gallery=10",
    )
    # eval.max_images caps the gallery the evaluation embeds: 100 images are ranked exactly
    capped = [f"data.root={glyphs_root}", "train.best_metric=eval/test/map", "eval.index=auto"]
    check_data(_config(*capped, "eval.exact_max_gallery=200", "eval.max_images=100"), info)
    size = info.split("test").num_samples
    assert f"(its gallery of {size:,} images is past eval.exact_max_gallery=10)" in _one_line_error(
        check_data, large, info
    )


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        ("configs/quickstart.yaml", ["model.backbone=resnet19"], "model.backbone='resnet19'"),
        ("configs/sop_triplet.yaml", ["train.global_batch_size=1024"], "is not a multiple of 3"),
    ],
)
def test_cli_fails_before_ray_is_contacted(config: str, overrides: list[str], expected: str) -> None:
    """The two errors measured failing only inside workers (retried 3 times each) now stop the driver."""
    proc = subprocess.run(
        [sys.executable, "-m", "dmltrain.run", config, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"},  # would hang or fail loudly if Ray were contacted
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_where_the_run_writes_is_checked_in_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracking server that is down cost ~4 minutes of MLflow's retries and then a traceback; something
    else on that port, a 404 traceback after Ray started; a storage path that is a file, a traceback from
    Ray's controller after an MLflow run had been created. Checked against a real MLflow server, a real
    web server that is not one, and a closed port."""
    import http.server
    import threading
    import time

    from dmltrain.service.preflight import check_outputs

    (tmp_path / "file").write_text("")
    ok = _config(f"run.storage_path={tmp_path / 'new' / 'ray_results'}")
    check_outputs(ok, f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}")  # both folders made on demand
    assert not (tmp_path / "new").exists() and not (tmp_path / "fresh").exists()  # nothing left behind
    file_store = f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}"
    assert _one_line_error(check_outputs, ok, file_store) == (
        f"mlflow.tracking_uri={file_store}: {tmp_path / 'file'} is a file, not a directory"
    )
    assert _one_line_error(
        check_outputs, _config(f"run.storage_path={tmp_path / 'file'}"), "sqlite:///x.db"
    ) == (f"run.storage_path={tmp_path / 'file'}: is a file, not a directory")
    # A scheme no tracking store takes: MLflow failed on it at the run lookup with a traceback about its
    # model registry.
    assert _one_line_error(check_outputs, ok, "ftp://mlflow.example/store").startswith(
        "mlflow.tracking_uri=ftp://mlflow.example/store: MLflow has no tracking store for ftp: URIs (it has "
    )
    # MLflow 3's file store is refused unless MLFLOW_ALLOW_FILE_STORE is set (a 42-line traceback before);
    # a storage scheme pyarrow has no file system for killed Ray's controller after the run was created.
    for path_store in (f"{tmp_path / 'mlruns'}", f"file://{tmp_path / 'mlruns'}"):
        assert "a file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true" in (
            _one_line_error(check_outputs, ok, path_store)
        )
    from dmltrain.service.preflight import tracking_problem

    assert tracking_problem("databricks") is None  # no scheme either, but not a file store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")  # MLflow reads true/false/1/0 only
    assert tracking_problem("./mlruns").startswith("MLFLOW_ALLOW_FILE_STORE: ")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_outputs(ok, f"file://{tmp_path / 'mlruns'}")
    for accepted in ("fsspec+memory://bucket/ray", "local:///tmp/ray", "hf://buckets/me/ray"):
        check_outputs(_config(f"run.storage_path={accepted}"), "sqlite:///x.db")
    assert "no file system for S3://" in _one_line_error(  # pyarrow's schemes are case-sensitive
        check_outputs, _config("run.storage_path=S3://bucket/ray"), "sqlite:///x.db"
    )
    assert _one_line_error(
        check_outputs, _config("run.storage_path=foo://bar/x"), "sqlite:///x.db"
    ).startswith(
        "run.storage_path=foo://bar/x: Ray stores checkpoints through pyarrow, which has no file system for foo://"
    )
    check_outputs(_config("run.storage_path=s3://bucket/ray"), "sqlite:///x.db")  # no network asked
    closed = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    assert "cannot connect to 127.0.0.1:" in _one_line_error(check_outputs, ok, closed)
    assert time.monotonic() - started < 5

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        message = _one_line_error(check_outputs, ok, f"http://127.0.0.1:{web.server_port}")
        assert message.endswith("no MLflow server answers there (HTTP 501 from its REST API)"), message
    finally:
        web.shutdown()

    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from dmltrain.service.preflight import tracking_problem

        deadline = time.monotonic() + 60
        while (problem := tracking_problem(f"http://127.0.0.1:{port}")) is not None:
            assert time.monotonic() < deadline and server.poll() is None, problem
            time.sleep(0.5)
        check_outputs(ok, f"http://127.0.0.1:{port}/")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_glyphs_of_a_file_url_root_are_built_in_its_folder(
    glyphs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.root=file:///x with data.prepare=glyphs built (or looked for) the set in ./file:/x."""
    monkeypatch.chdir(tmp_path)
    info = load_data(_config(f"data.root=file://{glyphs_root}"))
    assert info.name == "glyphs" and not (tmp_path / "file:").exists()
