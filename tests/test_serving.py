"""Serving without Ray: the model as an MLflow pyfunc (fresh process, runs:/ and models:/), the registry,
`dmltrain evaluate` on every kind of model reference, `dmltrain index` + `dmltrain search`, approximate
evaluation against exact, and the best-checkpoint bookkeeping. Real MLflow sqlite store, real faiss, real
glyph shards; one tiny model (resnet18 at 32 px) logged once per module.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

import dmltrain.index as index_module
from dmltrain.data import EvalLoader, load_dataset_info, prepare
from dmltrain.data.shards import read_shard
from dmltrain.evaluation import retrieval_metrics
from dmltrain.index import (
    IdMap,
    approximate_retrieval_metrics,
    build_index,
    choose_spec,
    load_index,
    neighbour_recall,
    save_index,
)
from dmltrain.inference import embed_batch, embed_images, image_tensor
from dmltrain.service.best import BestMetricError, BestTracker, resolve_best_metric, worst_score
from dmltrain.service.builders import build_network, build_test_transform
from dmltrain.service.cli import main as cli
from dmltrain.service.config import load_config
from dmltrain.service.errors import FATAL_IN_LOOP
from dmltrain.service.serving.publish import register
from dmltrain.service.serving.pyfunc import BadRequestError, log_embedding_model, request_param
from dmltrain.service.serving.weights import save_weights
from dmltrain.service.tracking import ensure_experiment

REPO = Path(__file__).parents[1]
REGISTERED = "glyph-embedder"


@dataclass
class Served:
    tracking_uri: str
    run_id: str
    weights: Path
    net: torch.nn.Module
    transform: object
    glyphs: Path


@pytest.fixture(scope="module")
def served(glyphs_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """A quickstart-shaped model (seeded random weights) logged as runs:/<id>/model and registered."""
    tmp = tmp_path_factory.mktemp("served")
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [f"data.root={glyphs_root}", "data.prepare=null", "model.embedding_dim=32"],
    )
    torch.manual_seed(0)
    net = build_network(config).eval()
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(ensure_experiment(client, uri, "serving"))  # artifacts beside the store
    weights = save_weights(tmp / "model.pt", net.state_dict(), config.model_dump(mode="json"), step=3)
    log_embedding_model(uri, run.info.run_id, "model", weights, step=3)
    assert register(uri, run.info.run_id, REGISTERED) == f"models:/{REGISTERED}/1"
    return Served(uri, run.info.run_id, weights, net, build_test_transform(config), glyphs_root)


def _test_samples(glyphs: Path, count: int) -> list[tuple[str, bytes, int]]:
    info = load_dataset_info(glyphs)
    url = info.shard_urls(glyphs, "test")[0]
    out = []
    for sample in read_shard(url, shard=0):
        out.append((sample.key, sample.data, sample.cls))
        if len(out) == count:
            break
    return out


def test_pyfunc_round_trip_in_a_fresh_process(served: Served, tmp_path: Path) -> None:
    samples = _test_samples(served.glyphs, 6)
    payload = tmp_path / "images.npz"
    arrays = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for _, data, _ in samples]
    np.savez(payload, *[np.frombuffer(d, dtype=np.uint8) for _, d, _ in samples])
    script = textwrap.dedent(
        f"""
        import io, json, sys
        import numpy as np, pandas as pd, mlflow
        from PIL import Image
        mlflow.set_tracking_uri({served.tracking_uri!r})
        raw = np.load({str(payload)!r})
        data = [raw[k].tobytes() for k in sorted(raw.files, key=lambda k: int(k.split("_")[1]))]
        arrays = [np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in data]
        out = {{}}
        for uri in ("runs:/{served.run_id}/model", "models:/{REGISTERED}/1"):
            model = mlflow.pyfunc.load_model(uri)
            out[uri] = {{
                "bytes": model.predict(pd.DataFrame({{"image": data}})).tolist(),
                "arrays": model.predict(pd.DataFrame({{"image": arrays}})).tolist(),
                "dict": model.predict({{"image": data}}).tolist(),
                "signature": str(model.metadata.signature.inputs),
            }}
        json.dump(out, sys.stdout)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["TMPDIR"] = str(tmp_path)  # mlflow.pyfunc.load_model's downloads are never removed
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    device = torch.device("cpu")
    expected = embed_images(served.net, [d for _, d, _ in samples], served.transform, device)
    # The evaluation path: the same images through EvalLoader + the run's test transform.
    loader = EvalLoader(served.glyphs, "test", 6, rank=0, world_size=1, transform=served.transform)
    images, _labels, _cats, keys = next(iter(loader))
    assert keys == [k for k, _, _ in samples]
    evaluated = embed_batch(served.net.eval(), images, device).numpy()
    np.testing.assert_allclose(expected, evaluated, atol=1e-5)
    for uri, out in result.items():
        assert "'image': binary" in out["signature"], uri
        for form in ("bytes", "arrays", "dict"):
            got = np.asarray(out[form], dtype=np.float32)
            assert got.shape == (6, 32), (uri, form)
            np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
            np.testing.assert_allclose(got, expected, atol=1e-4, err_msg=f"{uri} {form}")
    assert len(arrays) == 6


def test_model_downloads_are_removed_when_the_process_exits(served: Served, tmp_path: Path) -> None:
    """Loading a runs:/ or models:/ model downloads its weights; nothing of them stays in the temp dir
    after the process (a CLI call, a server) exits, and a model loaded into memory (`located`,
    `load_embedding_model`) keeps no files even while the process runs."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from dmltrain.service.serving.loading import load_embedding_model, locate, located
        ref = "runs:/{served.run_id}/model"
        with located(ref, {served.tracking_uri!r}) as (weights, run_id):
            assert weights.is_file() and run_id == {served.run_id!r}, (weights, run_id)
            assert len(list(Path({str(tmp)!r}).iterdir())) == 1
        assert load_embedding_model(ref, {served.tracking_uri!r}).run_id == {served.run_id!r}
        print(sorted(p.name for p in Path({str(tmp)!r}).iterdir()))
        for _ in range(2):
            weights, run_id = locate(ref, {served.tracking_uri!r})
            assert weights.is_file() and run_id == {served.run_id!r}, (weights, run_id)
        print(sorted(p.name for p in Path({str(tmp)!r}).iterdir()))
        """
    )
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "TMPDIR": str(tmp)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, located = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", loaded  # models read into memory left nothing behind
    assert located.count("dmltrain-model-") == 2, located  # one download folder per locate while it ran
    assert sorted(p.name for p in tmp.iterdir()) == []  # and none left after exit


def test_registry_holds_the_runs_model(served: Served) -> None:
    client = MlflowClient(served.tracking_uri)
    version = client.get_model_version(REGISTERED, "1")
    assert version.run_id == served.run_id
    assert version.source.startswith("models:/m-")  # the run's logged model, not a copy
    # Registering again makes version 2 of the same name.
    assert register(served.tracking_uri, served.run_id, REGISTERED) == f"models:/{REGISTERED}/2"


def test_evaluate_takes_local_runs_and_models_references(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every kind of model reference gives the same metrics, and so do 2 decoding processes."""
    results = {}
    refs = [(str(served.weights), []), (f"runs:/{served.run_id}/model", ["--workers", "2"])]
    for ref, workers in [*refs, (f"models:/{REGISTERED}/1", [])]:
        options = ["--max-images", "300", "--batch-size", "100", "--tracking-uri", served.tracking_uri]
        code = cli(["evaluate", ref, str(served.glyphs), *options, *workers])
        assert code == 0, ref
        results[ref] = json.loads(capsys.readouterr().out)
    first, *others = results.values()
    assert 0.0 <= first["eval/test/recall@1"] <= 1.0 and first["eval/test/num_queries"] > 0
    for other in others:
        assert other == pytest.approx(first, abs=1e-6)
    code = cli(
        [
            "evaluate",
            "runs:/0123456789abcdef/model",
            str(served.glyphs),
            "--tracking-uri",
            served.tracking_uri,
        ]
    )
    assert code == 2 and "error" in capsys.readouterr().err


def test_decoding_processes_default_to_none_on_a_cpu_and_what_the_host_allows_on_a_gpu(
    served: Served,
) -> None:
    """On a GPU: the host cores but one, at most 8, and no more than the free /dev/shm holds."""
    import dataclasses

    from dmltrain.data.pools import available_cpus
    from dmltrain.data.shared_memory import eval_loader_bytes, shared_memory_size
    from dmltrain.service.serving.loading import default_decode_workers, load_embedding_model

    model = load_embedding_model(str(served.weights), device=torch.device("cpu"))
    assert default_decode_workers(model, 128) == 0
    on_gpu = dataclasses.replace(model, device=torch.device("cuda", 0))  # the choice only reads the type
    cores = min(8, available_cpus(64) - 1)
    side = model.preprocessing.resolution
    free = shared_memory_size()[1]  # type: ignore[index]
    assert eval_loader_bytes(128, cores, side) <= free  # so the cores decide at this batch
    assert default_decode_workers(on_gpu, 128) == cores
    huge = next(b for b in range(128, 1 << 40, 1 << 14) if eval_loader_bytes(b, 1, side) > free)
    assert default_decode_workers(on_gpu, huge) == 0  # a batch /dev/shm cannot hold: none


def test_index_and_search_cli(served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "idx"
    model = f"runs:/{served.run_id}/model"
    code = cli(["index", model, str(served.glyphs), "--out", str(out), "--tracking-uri", served.tracking_uri])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "flat (exact inner product)" in printed and f"runs:/{served.run_id}/indexes/glyphs_test" in printed
    stored = load_index(out)
    info = load_dataset_info(served.glyphs)
    assert stored.index.ntotal == info.split("test").num_samples == len(stored.ids)
    assert stored.meta["split"] == "test" and stored.meta["model"] == model
    client = MlflowClient(served.tracking_uri)
    logged = {a.path for a in client.list_artifacts(served.run_id, "indexes/glyphs_test")}
    assert {f"indexes/glyphs_test/{n}" for n in ("index.faiss", "ids.npz", "index.json")} <= logged

    # Query with two gallery images: each finds itself first; the id map names its shard, key and class.
    samples = _test_samples(served.glyphs, 2)
    files = []
    for i, (_key, data, _cls) in enumerate(samples):
        files.append(tmp_path / f"q{i}.png")
        files[-1].write_bytes(data)
    grid = tmp_path / "grid.png"
    args = ["search", str(out), *map(str, files), "-k", "5", "--json", "--grid", str(grid)]
    code = cli([*args, "--tracking-uri", served.tracking_uri])
    assert code == 0, capsys.readouterr().err
    results = json.loads(capsys.readouterr().out)
    for (key, _data, cls), result in zip(samples, results, strict=True):
        top = result["neighbours"][0]
        assert (top["key"], top["shard"], top["class"]) == (key, 0, cls)
        assert top["score"] == pytest.approx(1.0, abs=1e-4)
        assert len(result["neighbours"]) == 5
        scores = [n["score"] for n in result["neighbours"]]
        assert scores == sorted(scores, reverse=True)
    image = np.asarray(Image.open(grid))
    assert image.ndim == 3 and image.shape[0] > image.shape[1] / 6 * 2 * 0.9  # 2 rows of 6 cells
    # Plain table output too, and a clear error for a missing image.
    assert cli(["search", str(out), str(files[0]), "-k", "3", "--tracking-uri", served.tracking_uri]) == 0
    assert samples[0][0] in capsys.readouterr().out
    assert (
        cli(["search", str(out), str(tmp_path / "missing.png"), "--tracking-uri", served.tracking_uri]) == 2
    )
    assert "image not found" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not an image")
    assert cli(["search", str(out), str(files[0]), str(corrupt), "--tracking-uri", served.tracking_uri]) == 2
    err = capsys.readouterr().err
    assert f"{corrupt}: cannot decode the image bytes" in err and "object at 0x" not in err, err

    # The index's model must still be the one it was built with (runs:/<id>/model names the newest).
    meta = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**meta, "model_step": meta["model_step"] + 100}))
    assert cli(["search", str(out), str(files[0]), "--tracking-uri", served.tracking_uri]) == 2
    err = capsys.readouterr().err
    assert f"the index was built with the step-{meta['model_step'] + 100} model of {model}" in err, err
    (out / "index.json").write_text(json.dumps(meta))
    # ... and the same file: another model of the same step (a rerun of the same length) embedded the
    # queries for the gallery of the first, with nothing to show for it.
    assert len(meta["model_sha256"]) == 64
    (out / "index.json").write_text(json.dumps({**meta, "model_sha256": "0" * 64}))
    assert cli(["search", str(out), str(files[0]), "--tracking-uri", served.tracking_uri]) == 2
    err = capsys.readouterr().err
    assert f"whose weights have sha256 000000000000..., but {model} is now another file (" in err, err
    (out / "index.json").write_text(json.dumps(meta))
    # --grid against other shards than the index's: one line, not an IndexError
    for i in range(4):
        (tmp_path / "other" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 12), (i * 40, 0, 0)).save(tmp_path / "other" / f"c{i % 2}" / f"{i}.png")
    prepare("folder", str(tmp_path / "other"), tmp_path / "other_shards", progress=False)
    grid_args = ["--grid", str(tmp_path / "g.png"), "--data-root", str(tmp_path / "other_shards")]
    assert cli(["search", str(out), str(files[0]), *grid_args, "--tracking-uri", served.tracking_uri]) == 2
    assert "is not the data the index was built from" in capsys.readouterr().err
    # --out: a folder with other files is refused before any embedding; bad numbers at parsing
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    started = time.monotonic()
    code = cli(
        [
            "index",
            model,
            str(served.glyphs),
            "--out",
            str(tmp_path / "busy"),
            "--tracking-uri",
            served.tracking_uri,
        ]
    )
    assert code == 2 and time.monotonic() - started < 30
    assert (
        "--out " + str(tmp_path / "busy") + ": a folder with other files (notes.txt)"
        in capsys.readouterr().err
    )
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]
    for bad in (
        ["index", model, str(served.glyphs), "--batch-size", "0"],
        ["serve", str(out), "--port", "70000"],
    ):
        with pytest.raises(SystemExit) as parsed:
            cli(bad)
        assert parsed.value.code == 2
    assert "must be a TCP port, 1 to 65535, got 70000" in capsys.readouterr().err


def test_search_an_index_logged_to_a_run(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """runs:/<id>/indexes/<name>: downloaded, read into memory and removed at once (one search used to
    leave a copy of the whole index in the temp dir); a wrong run or index name is one line, status 2.
    With --no-search-model the index is logged without the search model beside it."""
    model = f"runs:/{served.run_id}/model"
    client = MlflowClient(served.tracking_uri)
    experiment = client.get_run(served.run_id).info.experiment_id

    def search_models() -> int:
        return len(client.search_logged_models([experiment], filter_string="name = 'search_glyphs_test'"))

    before = search_models()
    args = ["index", model, str(served.glyphs), "--out", str(tmp_path / "idx"), "--no-search-model"]
    code = cli([*args, "--tracking-uri", served.tracking_uri])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"logged to runs:/{served.run_id}/indexes/glyphs_test" in printed and "search model" not in printed
    assert search_models() == before
    key, data, cls = _test_samples(served.glyphs, 1)[0]
    query = tmp_path / "q.png"
    query.write_bytes(data)
    downloads = tmp_path / "tmp"
    downloads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(downloads))
    logged = f"runs:/{served.run_id}/indexes/glyphs_test"
    assert (
        cli(["search", logged, str(query), "-k", "2", "--json", "--tracking-uri", served.tracking_uri]) == 0
    )
    top = json.loads(capsys.readouterr().out)[0]["neighbours"][0]
    assert (top["key"], top["class"]) == (key, cls)
    assert list(downloads.iterdir()) == []
    for wrong in (f"runs:/{served.run_id}/indexes/nope", "runs:/0123456789abcdef0123456789abcdef/indexes/x"):
        assert cli(["search", wrong, str(query), "--tracking-uri", served.tracking_uri]) == 2, wrong
        err = capsys.readouterr().err
        assert err.startswith(f"dmltrain search: error: {wrong}: not found in the MLflow store"), err
        assert len(err.strip().splitlines()) == 1, err
    # From a folder without the store (the default sqlite:///<cwd>/mlflow.db): MLflow created an empty
    # mlflow.db there and reported the run as unknown.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli(["search", logged, str(query)]) == 2
    err = capsys.readouterr().err
    assert f"{logged}: no MLflow store at {elsewhere / 'mlflow.db'} (run from the folder" in err, err
    assert list(elsewhere.iterdir()) == []
    # A tracking server that is down: MLflow's client retried the refused connection for 4 minutes.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert cli(["search", logged, str(query), "--tracking-uri", down]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"dmltrain search: error: {logged}: the MLflow store at {down} cannot be used: cannot connect to "
        f"127.0.0.1:{down.rsplit(':', 1)[1]} (Connection refused)"
    ), err


def test_a_file_that_is_not_a_model_is_one_line(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truncated = tmp_path / "model.pt"
    truncated.write_bytes(served.weights.read_bytes()[:1000])
    for bad in (REPO / "README.md", truncated):
        assert cli(["evaluate", str(bad), str(served.glyphs), "--max-images", "10"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dmltrain evaluate: error: {bad} is not a readable dmltrain model file"), err
        assert len(err.strip().splitlines()) == 1, err


def _clustered(
    n: int, dim: int, classes: int, seed: int, noise: float = 0.9
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).standard_normal((classes, dim)).astype(np.float32)
    labels = rng.integers(0, classes, n)
    x = centres[labels] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), labels


def test_flat_knn_metrics_equal_exact_ranking() -> None:
    x, y = _clustered(3000, 16, 300, seed=1)
    exact = retrieval_metrics(x, y, ks=(1, 2, 4, 8))
    knn = approximate_retrieval_metrics(x, y, ks=(1, 2, 4, 8), kind="flat", recall_queries=200)
    for key in ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision", "num_queries"):
        assert knn[key] == pytest.approx(exact[key], abs=1e-9), key
    assert knn["index_recall@10"] == 1.0
    assert knn["num_queries_deeper_than_search"] == 0 and knn["search_depth"] >= 10


def test_knn_metrics_say_when_a_class_is_deeper_than_the_search(caplog: pytest.LogCaptureFixture) -> None:
    """MAP@R of a class larger than the search depth is scored on its first max_k ranks: it came out low
    under the same key, with no word."""
    x, y = _clustered(400, 16, 4, seed=4)  # classes of about 100
    exact = retrieval_metrics(x, y, ks=(1,))
    with caplog.at_level("WARNING", logger="dmltrain.index"):
        knn = approximate_retrieval_metrics(x, y, ks=(1,), kind="flat", max_k=32, recall_queries=50)
    assert knn["search_depth"] == 32 and knn["num_queries_deeper_than_search"] == knn["num_queries"] == 400
    assert knn["map@r"] < exact["map@r"]
    assert "search depth 32: MAP@R and R-precision of 400 of 400 queries" in caplog.text


@pytest.mark.parametrize("kind", ["ivfpq", "hnsw"])
def test_approximate_metrics_report_recall_against_exact(kind: str) -> None:
    q, q_lab = _clustered(500, 32, 400, seed=2, noise=0.5)
    g, g_lab = _clustered(20000, 32, 400, seed=3, noise=0.5)
    exact = retrieval_metrics(q, q_lab, g, g_lab, ks=(1, 10))
    approx = approximate_retrieval_metrics(q, q_lab, g, g_lab, ks=(1, 10), kind=kind, recall_queries=500)  # type: ignore[arg-type]
    # The reported recall is the index's top 10 against exact search, here on every query.
    direct = neighbour_recall(build_index(g, kind).search(q, 10)[1], build_index(g, "flat").search(q, 10)[1])  # type: ignore[arg-type]
    assert approx["index_recall@10"] == pytest.approx(direct, abs=1e-9)
    assert 0.5 <= approx["index_recall@10"] <= 1.0
    # Class-level metrics barely move even where single neighbours are missed.
    assert abs(approx["recall@1"] - exact["recall@1"]) <= 0.05
    assert abs(approx["recall@10"] - exact["recall@10"]) <= 0.05
    assert "map" not in approx  # full-ranking mAP needs every rank: only the exact path reports it


def test_index_spec_choice_and_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_spec(10_000, 128).kind == "flat"
    big = choose_spec(1_000_000, 128)
    assert (big.kind, big.nlist, big.nprobe, big.refine) == ("ivfpq", 1024, 128, 4) and 128 % big.m == 0
    assert "IVF1024" in big.describe() and "nprobe 128" in big.describe()
    with pytest.raises(ValueError, match="unknown index kind"):
        choose_spec(10, 4, "lsh")  # type: ignore[arg-type]
    x, y = _clustered(5000, 32, 100, seed=4)
    for kind in ("flat", "ivfpq", "hnsw"):
        built = build_index(x, kind)  # type: ignore[arg-type]
        ids = IdMap(np.arange(len(x)) % 7, [f"k{i}" for i in range(len(x))], y)
        save_index(tmp_path / kind, built, ids, {"note": kind})
        loaded = load_index(tmp_path / kind)
        assert loaded.meta["note"] == kind and loaded.index.spec == built.spec
        before, after = built.search(x[:50], 10)[1], loaded.search(x[:50], 10)[1]
        np.testing.assert_array_equal(before, after)
        assert loaded.ids.row(7) == {"id": 7, "shard": 0, "key": "k7", "class": int(y[7])}
        exact = build_index(x, "flat").search(x[:200], 10)[1]
        assert neighbour_recall(loaded.search(x[:200], 10)[1], exact) >= 0.8
    # k past the index's size: what exists, without faiss allocating for all of k
    assert [len(hits) for hits in load_index(tmp_path / "flat").neighbours(x[:2], 2**31)] == [5000, 5000]
    (tmp_path / "hnsw" / "index.faiss").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"hnsw/index.faiss: faiss cannot read it"):
        load_index(tmp_path / "hnsw")
    # A damaged index.json or ids.npz is one line naming the file (a traceback, 'spec', or numpy's
    # "pickled data" before).
    ivfpq = tmp_path / "ivfpq"
    ids_bytes, meta_text = (ivfpq / "ids.npz").read_bytes(), (ivfpq / "index.json").read_text()
    for name, content, fault in (
        ("ids.npz", ids_bytes[:300], r"ids.npz: not a readable id map \(BadZipFile"),
        ("ids.npz", b"hello", r"ids.npz: not a readable id map \(not an .npz archive\)"),
        ("index.json", b"{bad", r"index.json: not valid JSON"),
        ("index.json", json.dumps({"format_version": 1, "dim": 32}).encode(), r"index.json: no spec"),
        # files of two builds: every search failed inside faiss with a bare AssertionError
        (
            "index.json",
            json.dumps({**json.loads(meta_text), "dim": 16}).encode(),
            r"ivfpq: index.faiss holds \d+-d vectors but index.json says dim 16",
        ),
    ):
        (ivfpq / name).write_bytes(content)
        with pytest.raises(ValueError, match=fault):
            load_index(ivfpq)
        (ivfpq / "ids.npz").write_bytes(ids_bytes)
        (ivfpq / "index.json").write_text(meta_text)
    assert len(load_index(ivfpq).ids) == 5000
    # A rebuild over the same images (another model of the same width) renames its files in one by one: a
    # reader in between paired one build's vectors with the other's ids and model digest, silently.
    flat, again = tmp_path / "flat", tmp_path / "flat_again"
    renamed: list[str] = []  # the order save_index renames its files in
    real_replace = index_module._replace_file

    def recording(path: Path, write) -> None:
        renamed.append(path.name)
        real_replace(path, write)

    monkeypatch.setattr(index_module, "_replace_file", recording)
    save_index(again, build_index(x[::-1].copy(), "flat"), IdMap(np.zeros(len(x)), ["r"] * len(x), y), {})
    monkeypatch.undo()
    # Every read that overlaps the rebuild (load_index reads index.json, then index.faiss, then ids.npz; each
    # file as the rebuild had left it by then) gives one build or a refusal. Renamed faiss-first, a reader
    # could take the new vectors with the old ids: same size, same build id.
    order = ["index.json", "index.faiss", "ids.npz"]
    for seen in itertools.combinations_with_replacement(range(4), 3):  # files renamed when each is read
        torn = tmp_path / "torn"
        shutil.rmtree(torn, ignore_errors=True)
        shutil.copytree(flat, torn)
        for name, done in zip(order, seen, strict=True):
            if name in renamed[:done]:
                shutil.copy(again / name, torn / name)
        try:
            loaded = load_index(torn)
        except ValueError as refused:
            assert "files of two builds" in str(refused)
            continue
        rebuilt_ids = {str(k) for k in loaded.ids.key[:3]} == {"r"}
        rebuilt_vectors = np.allclose(loaded.index.index.reconstruct(0), x[-1])
        assert rebuilt_ids == rebuilt_vectors, (seen, rebuilt_ids, rebuilt_vectors)
    for name in ("ids.npz", "index.json"):
        mixed = tmp_path / f"mixed_{name}"
        shutil.copytree(flat, mixed)
        shutil.copy(again / name, mixed / name)
        with pytest.raises(ValueError, match=r"ids.npz and index.json are files of two builds"):
            load_index(mixed)
    meta = json.loads((again / "index.json").read_text())
    (again / "index.json").write_text(json.dumps({**meta, "index_bytes": meta["index_bytes"] + 8}))
    with pytest.raises(ValueError, match=r"index.faiss and index.json are files of two builds"):
        load_index(again)
    # an index written before builds were recorded loads as it did
    del meta["build"], meta["index_bytes"]
    (again / "index.json").write_text(json.dumps(meta))
    with np.load(again / "ids.npz") as data:
        np.savez(again / "ids.npz", **{k: data[k] for k in ("shard", "key", "label")})
    assert load_index(again).ids.row(0)["key"] == "r"
    (tmp_path / "flat" / "ids.npz").unlink()
    with pytest.raises(FileNotFoundError, match="ids.npz is missing"):
        load_index(tmp_path / "flat")


def test_image_inputs_of_every_form() -> None:
    rgb = np.random.default_rng(0).integers(0, 255, (9, 7, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    assert torch.equal(image_tensor(buf.getvalue()), torch.from_numpy(rgb).permute(2, 0, 1))
    opaque = np.concatenate([rgb, np.full((9, 7, 1), 255, np.uint8)], axis=2)
    assert torch.equal(image_tensor(opaque), image_tensor(rgb))
    # An RGBA array is the image its PNG bytes are: composited onto white (it dropped alpha, so a cut-out on
    # a transparent background embedded differently as an array and as a file).
    rgba = np.concatenate([rgb, np.full((9, 7, 1), 9, np.uint8)], axis=2)
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    assert torch.equal(image_tensor(rgba), image_tensor(buf.getvalue()))
    assert not torch.equal(image_tensor(rgba), image_tensor(rgb))
    assert image_tensor(rgb[:, :, 0]).shape == (3, 9, 7)
    with pytest.raises(ValueError, match="uint8"):
        image_tensor(rgb.astype(np.float32))
    with pytest.raises(ValueError, match="cannot decode"):
        image_tensor(b"not an image")
    # base64 text as bytes (MLflow's `inputs` / `instances` requests hand it over undecoded) and with the
    # line breaks `base64.encodebytes` and the base64 tool write
    png = buf.getvalue()
    assert torch.equal(image_tensor(base64.b64encode(png)), image_tensor(png))
    assert torch.equal(image_tensor(base64.encodebytes(png).decode()), image_tensor(png))
    # a server's pixel limit, read from the header before decoding (and for arrays)
    with pytest.raises(ValueError, match=r"image: 7x9 pixels, over the limit of 62"):
        image_tensor(png, max_pixels=62)
    with pytest.raises(ValueError, match=r"q: 7x9 pixels, over the limit of 62"):
        image_tensor(rgb, "q", max_pixels=62)
    assert image_tensor(png, max_pixels=63).shape == (3, 9, 7)


def test_a_long_thin_image_is_refused_before_its_resize() -> None:
    """The pixel limit held for the image as sent; its shorter-side resize then multiplied it by the aspect
    ratio (a 563-byte 500,000 x 1 PNG took a server from 1.1 to 3.4 GB at 32 px)."""
    from dmltrain.data.transforms import resized_pixels, test_transform
    from dmltrain.inference import embed_images

    transform = test_transform(32, 36)
    assert resized_pixels(transform, 9, 7) == 36 * 47  # 7 -> 36, 9 -> 46.3
    assert resized_pixels(test_transform(32, 36, resize_mode="warp"), 1, 5000) == 36 * 36
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(4))
    thin = np.zeros((1, 3000, 3), np.uint8)
    with pytest.raises(
        ValueError, match=r"^t: 3000x1 pixels; resized for the model that is 3,888,000 pixels"
    ):
        embed_images(net, [thin], transform, torch.device("cpu"), names=["t"], max_pixels=1_000_000)
    square = np.zeros((40, 40, 3), np.uint8)
    assert embed_images(net, [square], transform, torch.device("cpu"), max_pixels=2000).shape == (1, 4)
    assert embed_images(net, [thin], transform, torch.device("cpu")).shape == (1, 4)  # no limit: a CLI's


def test_request_params_are_bounded_integers() -> None:
    """A k of 2**31 made faiss allocate for it and killed the server; null, 1e20 and 2.5 gave MLflow's
    generic error with a stack trace."""
    assert request_param(None, "k", 10, 100) == 10 and request_param({"k": None}, "k", 10, 100) == 10
    assert request_param({"k": "7"}, "k", 10, 100) == 7 and request_param({"k": 3.0}, "k", 10, 100) == 3
    for bad, fault in (
        (0, "k must be from 1 to 100, got 0"),
        (2**31, "k must be from 1 to 100, got 2147483648"),
        (1e20, "k must be from 1 to 100"),
        (2.5, "k must be an integer, got 2.5"),
        ("many", "k must be an integer, got 'many'"),
        (float("inf"), "k must be an integer, got inf"),
        (True, "k must be an integer, got True"),
    ):
        with pytest.raises(BadRequestError, match=re.escape(fault)):
            request_param({"k": bad}, "k", 10, 100)


def test_best_tracker_patience_and_state() -> None:
    tracker = BestTracker("eval/test/recall@1", "max", min_delta=0.01, patience=2)
    assert tracker.update({"eval/test/recall@1": 0.5}, 10)
    assert not tracker.update({"eval/test/recall@1": 0.505}, 20)  # below min_delta
    assert not tracker.should_stop
    restored = BestTracker("eval/test/recall@1", "max", 0.01, 2)
    restored.load_state_dict(tracker.state_dict())
    assert not restored.update({"eval/test/recall@1": 0.4}, 30) and restored.should_stop
    assert (restored.score, restored.step) == (0.5, 10)
    # A resume that ranks another metric (train.best_metric changed under run.resume=must) compared MAP@R
    # with the Recall@1 best and ran out of patience on improvements it could not see.
    other = BestTracker("eval/test/map@r", "max", 0.01, 2)
    other.load_state_dict(tracker.state_dict())
    assert (other.score, other.step, other.stale) == (None, -1, 0)
    assert other.update({"eval/test/map@r": 0.2}, 30) and other.update({"eval/test/map@r": 0.3}, 40)
    legacy = BestTracker("eval/test/recall@1", "max", 0.01, 2)  # a checkpoint of before: no metric saved
    legacy.load_state_dict({"score": 0.5, "step": 10, "stale": 1})
    assert (legacy.score, legacy.step, legacy.stale) == (0.5, 10, 1)
    low = BestTracker("eval/test/map@r", "min")
    assert low.update({"eval/test/map@r": 0.3}, 1) and low.update({"eval/test/map@r": 0.2}, 2)
    assert not low.update({"eval/test/map@r": 0.25}, 3) and low.step == 2
    assert resolve_best_metric("auto", ["small", "large"], (1, 5)) == "eval/small/recall@1"
    assert resolve_best_metric("eval/large/map@r", ["small", "large"], (1, 5)) == "eval/large/map@r"
    with pytest.raises(ValueError, match="train.best_metric='eval/test/recall@3'"):
        resolve_best_metric("eval/test/recall@3", ["test"], (1, 2))
    # A NaN metric (no test query with a positive) evaluates the same after a restart: never retried.
    with pytest.raises(BestMetricError, match="is NaN at step 40"):
        restored.update({"eval/test/recall@1": float("nan")}, 40)
    assert BestMetricError in FATAL_IN_LOOP


def test_checkpoint_scores_rank_checkpoints_as_the_tracker_does() -> None:
    """Ray keeps and publishes the checkpoint with the best checkpoint_score. A later evaluation that beats
    the best by less than min_delta is not the tracker's best, so its score must not outrank the best's."""
    key = "eval/test/recall@1"
    tracker = BestTracker(key, "max", min_delta=0.01)
    scores = {}
    for step, value in [(100, 0.60), (200, 0.70), (300, 0.705), (400, 0.65), (500, 0.72)]:
        tracker.update({key: value}, step)
        scores[step] = tracker.checkpoint_score({key: value}, step)
    assert scores[100] == 0.60 and scores[200] == 0.70 and scores[500] == 0.72  # each the best when reached
    assert scores[300] < 0.70 < 0.705 and scores[400] == 0.65  # higher by < min_delta: ranked below the best
    assert max(scores, key=scores.__getitem__) == tracker.step == 500
    assert max((s for s in scores if s < 500), key=scores.__getitem__) == 200  # Ray's pick before step 500
    assert tracker.checkpoint_score({}, 600) == worst_score("max")  # not evaluated: ranks last
    low = BestTracker("eval/test/map@r", "min", min_delta=0.01)
    low.update({"eval/test/map@r": 0.30}, 1)
    low.update({"eval/test/map@r": 0.295}, 2)
    assert low.checkpoint_score({"eval/test/map@r": 0.295}, 2) > 0.30  # lower by < min_delta: not better


def test_logging_a_model_draws_no_download_bars(served: Served, tmp_path: Path) -> None:
    # MLflow loads a logged model back to check its input example: a local "download" that drew two bars
    # per model in every run's output (seen in a fresh process and store, as a run's driver has them);
    # every `dmltrain index/search/serve` of a runs:/ model drew them too, and every relaunch one.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = textwrap.dedent(
        f"""
        import os
        from mlflow.tracking import MlflowClient
        from dmltrain.service.serving.pyfunc import log_embedding_model
        from dmltrain.service.tracking import ensure_experiment
        client = MlflowClient({uri!r})
        run = client.create_run(ensure_experiment(client, {uri!r}, "quiet"))
        log_embedding_model({uri!r}, run.info.run_id, "model", {str(served.weights)!r}, step=3)
        assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ  # the process's setting is restored
        # Loading it back from the local store (dmltrain evaluate/index/search/serve): no bars either.
        from dmltrain.service.serving.loading import load_embedding_model
        load_embedding_model("runs:/" + run.info.run_id + "/model", {uri!r})
        assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
        # A relaunch reads the run's stored config (one small YAML file) to compare it: no bar.
        from dmltrain.service.tracking import find_run, start_or_resume_run
        start_or_resume_run({uri!r}, "quiet", "key", "name", {{}}, "train: {{steps: 5}}")
        assert find_run({uri!r}, "quiet", "key").config == {{"train": {{"steps": 5}}}}
        """
    )
    drawn = ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "TQDM_DISABLE")  # conftest turns tqdm off for the suite
    env = {k: v for k, v in os.environ.items() if k not in drawn}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Validating input example" in done.stderr  # the step that drew them ran
    assert "Downloading artifacts" not in done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_an_index_served_over_http_returns_what_search_prints(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dmltrain index` logs the search model (index + model, one download of the model for both) to the
    run; `mlflow.pyfunc.load_model` on it,
    `dmltrain serve` (MLflow's scoring server, a real HTTP server) and `dmltrain serve --save` all return
    the neighbours `dmltrain search` prints. SIGTERM stops the server's processes and removes its copy."""
    import signal
    import urllib.error
    import urllib.request

    import mlflow
    import pandas as pd

    index_dir = tmp_path / "idx"
    model = f"runs:/{served.run_id}/model"
    tracking = ["--tracking-uri", served.tracking_uri]
    refused = ["index", model, str(served.glyphs), "--register", "glyph-search", "--no-search-model"]
    assert cli([*refused, *tracking]) == 2
    assert "registering the search model needs it logged to the model's run" in capsys.readouterr().err
    args = ["index", model, str(served.glyphs), "--out", str(index_dir), "--register", "glyph-search"]
    from dmltrain.service.serving import loading

    downloads: list[str] = []
    download = loading._download
    monkeypatch.setattr(loading, "_download", lambda *a: downloads.append(a[0]) or download(*a))
    assert cli([*args, *tracking]) == 0
    assert downloads == [model]  # it was downloaded twice: to embed, then to log the search model
    monkeypatch.setattr(loading, "_download", download)
    search_model = f"runs:/{served.run_id}/search_glyphs_test"
    printed = capsys.readouterr().out
    assert f"search model: {search_model} (serve it: mlflow models serve -m {search_model}" in printed
    assert "registered as models:/glyph-search/1" in printed
    samples = _test_samples(served.glyphs, 3)
    files = []
    for i, (_key, data, _cls) in enumerate(samples):
        files.append(tmp_path / f"q{i}.png")
        files[-1].write_bytes(data)
    assert cli(["search", str(index_dir), *map(str, files), "-k", "4", "--json", *tracking]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = [
        (query, rank, hit["id"], hit["key"], hit["class"], hit["class_name"], hit["score"])
        for query, result in enumerate(printed)
        for rank, hit in enumerate(result["neighbours"], 1)
    ]
    assert len(expected) == 12 and [e[3] for e in expected[::4]] == [key for key, _, _ in samples]

    def rows(table: pd.DataFrame | list[dict]) -> list[tuple]:
        records = table.to_dict("records") if isinstance(table, pd.DataFrame) else table
        return [
            (r["query"], r["rank"], r["id"], r["key"], r["class"], r["class_name"], r["score"])
            for r in records
        ]

    def assert_same(got: list[tuple]) -> None:
        assert [g[:6] for g in got] == [e[:6] for e in expected]
        np.testing.assert_allclose([g[6] for g in got], [e[6] for e in expected], atol=1e-5)

    images = pd.DataFrame({"image": [data for _, data, _ in samples]})
    mlflow.set_tracking_uri(served.tracking_uri)
    try:
        for uri, where in ((search_model, "download"), ("models:/glyph-search/1", "registered")):
            (tmp_path / where).mkdir()
            logged = mlflow.pyfunc.load_model(uri, dst_path=str(tmp_path / where))
            assert_same(rows(logged.predict(images, params={"k": 4})))
            assert "k" in str(logged.metadata.signature.params)
    finally:
        mlflow.set_tracking_uri(None)

    saved = tmp_path / "saved_search_model"
    assert cli(["serve", str(index_dir), "--save", str(saved), *tracking]) == 0
    count = load_dataset_info(served.glyphs).split("test").num_samples
    assert capsys.readouterr().out == f"{saved}: search model of {count} images, glyphs/test\n"
    assert_same(rows(mlflow.pyfunc.load_model(str(saved)).predict(images, params={"k": 4})))
    assert cli(["serve", str(index_dir), "--save", str(saved), *tracking]) == 2
    assert f"{saved} exists" in capsys.readouterr().err
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [f"data.root={served.glyphs}", "data.prepare=null", "model.embedding_dim=16"],
    )
    other = save_weights(tmp_path / "other.pt", build_network(config).state_dict(), config.model_dump(), 1)
    args = ["serve", str(index_dir), "--save", str(tmp_path / "mismatch"), "--model", str(other)]
    assert cli([*args, *tracking]) == 2
    assert capsys.readouterr().err == (
        f"dmltrain serve: error: {index_dir} holds 32-d embeddings but the model {other} makes 16-d ones: "
        "give the model the index was built with\n"
    )

    port = _free_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "MLFLOW_TRACKING_URI": served.tracking_uri}

    def start_server() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "dmltrain.service.cli", "serve", str(index_dir), "--port", str(port)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def copies() -> list[Path]:
        return [d for d in scratch.iterdir() if d.name.startswith("dmltrain-serve-")]

    # SIGTERM while the model is being copied (before the server starts) killed the process outright and
    # left the copy in the temporary folder.
    early = start_server()
    deadline = time.monotonic() + 120
    while not copies():
        assert early.poll() is None and time.monotonic() < deadline, early.communicate()[0][-3000:]
        time.sleep(0.02)
    early.send_signal(signal.SIGTERM)
    output = early.communicate(timeout=60)[0]
    assert early.returncode == 0 and "POST http" not in output, output[-3000:]  # stopped before serving
    assert not copies()
    server = start_server()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the server did not answer /ping in 180 s"
                time.sleep(0.5)
        payload = [base64.b64encode(data).decode() for _, data, _ in samples]
        answer = _post(
            f"http://127.0.0.1:{port}/invocations",
            {"dataframe_split": {"columns": ["image"], "data": [[p] for p in payload]}, "params": {"k": 4}},
        )
        assert_same(rows(answer["predictions"]))
        # A request the model cannot answer is a 400 whose message names the input at fault (MLflow's
        # generic message said only that evaluating the model failed; ours was the trace's last line).
        bad = {"dataframe_split": {"columns": ["image"], "data": [[payload[0]], ["bm90IGFuIGltYWdl"]]}}
        zero = {"dataframe_split": {"columns": ["image"], "data": [[payload[0]]]}, "params": {"k": 0}}
        huge = {"dataframe_split": {"columns": ["image"], "data": [[payload[0]]]}, "params": {"k": 2**31}}
        empty = {"dataframe_split": {"columns": ["image"], "data": []}}
        blank = io.BytesIO()
        Image.new("L", (8000, 7000)).save(blank, format="PNG")  # 56 MP in a small file
        bomb = {
            "dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(blank.getvalue()).decode()]]}
        }
        thin = io.BytesIO()
        Image.new("L", (500_000, 1)).save(thin, format="PNG")  # 1 pixel high, its resize 2 GB and more
        sliver = {
            "dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(thin.getvalue()).decode()]]}
        }
        # MLflow's other request format hands base64 text over undecoded: answered, not refused
        inputs = _post(f"http://127.0.0.1:{port}/invocations", {"inputs": [payload[0]], "params": {"k": 4}})
        assert [p["key"] for p in inputs["predictions"]] == [e[3] for e in expected[:4]]
        for request, fault in (
            (bad, "image 1: cannot decode the image bytes"),
            (zero, "k must be from 1 to 10,000, got 0"),
            (huge, "k must be from 1 to 10,000, got 2147483648"),
            (empty, "no images to embed"),
            (bomb, "image 0: 8000x7000 pixels, over the limit of 50,000,000"),
            (sliver, "image 0: 500000x1 pixels; resized for the model that is "),
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _post(f"http://127.0.0.1:{port}/invocations", request)
            assert refused.value.code == 400
            answer = json.loads(refused.value.read())
            assert answer["error_code"] == "BAD_REQUEST" and fault in answer["message"], answer
            assert "unexpected error" not in answer["message"] and len(answer["message"]) < 2000, answer
        assert [d.name for d in scratch.iterdir() if d.name.startswith("dmltrain-serve-")]  # its model copy
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output[-3000:]
    assert f"POST http://127.0.0.1:{port}/invocations" in output
    assert not [d for d in scratch.iterdir() if d.name.startswith("dmltrain-serve-")]
    # Nothing of the server is left: uvicorn is a child of MLflow's process, not of dmltrain's.
    leftover = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout
    assert leftover == "", leftover


def test_the_server_finds_uvicorn_and_shares_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow starts `uvicorn` through a shell: a venv's dmltrain run by its full path (venv not activated)
    failed with status 127 before this Python's scripts went first on PATH."""
    from dmltrain.service.serving.serve import server_environment

    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    import dmltrain.data.pools as pools

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setattr(pools, "cgroup_cpu_quota", lambda: None)
    env = server_environment(workers=4)
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    assert env["OMP_NUM_THREADS"] == "4" and server_environment(workers=32)["OMP_NUM_THREADS"] == "1"
    assert env["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "false"
    # A pod's CPU limit, not the node's cores (4 CPUs on a 64-core node: 32 threads per server process)
    monkeypatch.setattr(pools, "cgroup_cpu_quota", lambda: 4)
    assert server_environment(workers=2)["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert server_environment(workers=4)["OMP_NUM_THREADS"] == "3"  # the user's setting is kept


def test_a_containers_cpu_quota_is_read_from_either_cgroup_version(tmp_path: Path) -> None:
    from dmltrain.data.pools import cgroup_cpu_quota

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    (v1 / "cpu").mkdir(parents=True)
    for text, cpus in (("400000 100000\n", 4), ("150000 100000\n", 2), ("max 100000\n", None)):
        (v2 / "cpu.max").write_text(text)
        assert cgroup_cpu_quota(str(v2)) == cpus, text
    for quota, cpus in (("250000", 3), ("-1", None)):
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
        (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        assert cgroup_cpu_quota(str(v1)) == cpus, quota
    assert cgroup_cpu_quota(str(tmp_path / "none")) is None


def test_serve_refuses_an_address_it_cannot_listen_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port in use was MLflow's traceback once uvicorn had started; now one line before anything loads."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli(["serve", str(tmp_path / "index"), "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dmltrain serve: error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"
    )


def test_a_loaded_index_is_mapped_and_outlives_a_rebuild_into_its_directory(tmp_path: Path) -> None:
    """Server processes share a mapped index instead of each holding a copy; rewriting the mapped file in
    place would kill them (SIGBUS), so a rebuild renames new files in. In a child process: a regression
    would crash it, not pytest."""
    script = textwrap.dedent(
        """
        import sys
        import faiss
        import numpy as np
        from dmltrain.index import IdMap, build_index, load_index, save_index

        directory = sys.argv[1]
        x = np.random.default_rng(0).standard_normal((3000, 64)).astype("float32")
        x /= np.linalg.norm(x, axis=1, keepdims=True)

        def ids(n):
            return IdMap(np.zeros(n, np.int64), [f"k{i}" for i in range(n)], np.arange(n) % 30)

        save_index(directory, build_index(x, "flat"), ids(3000), {})
        loaded = load_index(directory)
        maps = open("/proc/self/maps").read()
        mapped = f"{directory}/index.faiss" in maps
        assert mapped == hasattr(faiss, "IO_FLAG_MMAP_IFC"), mapped
        assert f"{directory}/ids.npz" in maps  # the id map too: one copy for every server process
        before = loaded.search(x[:20], 5)[1]
        save_index(directory, build_index(x[:100], "flat"), ids(100), {})  # a much shorter file
        assert (loaded.search(x[:20], 5)[1] == before).all()
        assert loaded.ids.row(2999) == {"id": 2999, "shard": 0, "key": "k2999", "class": 2999 % 30}
        assert load_index(directory).index.ntotal == 100
        print("mapped" if mapped else "read")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "index")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() in ("mapped", "read")
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["ids.npz", "index.faiss", "index.json"]


def test_an_index_target_is_new_empty_or_an_index_directory(tmp_path: Path) -> None:
    """`dmltrain index --out`: a folder that merely holds an index.json (a web project's) is not an index
    directory to overwrite."""
    from dmltrain.service.serving.indexing import check_index_target

    check_index_target(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_index_target(tmp_path / "empty")
    web = tmp_path / "web"
    web.mkdir()
    (web / "index.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"a folder with other files \(index.json\)"):
        check_index_target(web)
    (web / "index.faiss").write_bytes(b"")
    check_index_target(web)  # an index directory: rebuilt in place
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        check_index_target(tmp_path / "file")
