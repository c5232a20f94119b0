"""Face-retrieval protocol (Smooth-AP Sec. 5.4): VGGFace2-style identity folders through `prepare folder`, and
IJB-C-style 1:1 template verification (media-averaged template features, TAR at FAR) checked against a
brute-force reference on a synthetic template/pair file, also end to end through `dmltrain verify`."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dmltrain.evaluation import load_verification_protocol, tar_at_far, verification_metrics
from dmltrain.service.cli import main as cli_main
from dmltrain.verification import ProtocolFileError

REPO = Path(__file__).parents[1]


def _synthetic_protocol(tmp_path: Path, seed: int = 0) -> tuple[Path, Path, np.ndarray, list[tuple]]:
    """40 subjects x 2-3 templates x 1-3 media x 1-3 images; embeddings = subject centre + noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(40, 16))
    rows, embeddings, template_subject = [], [], {}
    image = 0
    for subject in range(40):
        for t in range(int(rng.integers(2, 4))):
            template = f"{subject * 10 + t}"
            template_subject[template] = subject
            for m in range(int(rng.integers(1, 4))):
                for _ in range(int(rng.integers(1, 4))):
                    rows.append((f"img/{image:05d}.jpg", template, f"{template}_{m}"))
                    embeddings.append(centres[subject] + rng.normal(scale=1.6, size=16))
                    image += 1
    templates = sorted(template_subject, key=int)
    pairs = [
        (a, b, int(template_subject[a] == template_subject[b]))
        for a, b in itertools.combinations(templates, 2)
    ]
    template_file = tmp_path / "ijbc_face_tid_mid.txt"
    lines = ["# IJB-C style: IMAGE TEMPLATE_ID MEDIA_ID", "image template media"]
    lines += [f"{img},{t},{m}" if i % 2 else f"{img} {t} {m}" for i, (img, t, m) in enumerate(rows)]
    template_file.write_text("\n".join(lines) + "\n")
    pair_file = tmp_path / "ijbc_template_pair_label.txt"
    pair_file.write_text("".join(f"{a} {b} {label}\n" for a, b, label in pairs))
    return template_file, pair_file, np.asarray(embeddings, dtype=np.float32), rows


def _brute_force(embeddings: np.ndarray, rows: list[tuple], pairs: np.ndarray, fars: tuple) -> dict:
    """Plain loops: media mean, then template mean of the media means, normalised; then every threshold."""
    media: dict[tuple[str, str], list[np.ndarray]] = defaultdict(list)
    for (_, template, medium), e in zip(rows, embeddings, strict=True):
        media[(template, medium)].append(e.astype(np.float64))
    per_template: dict[str, list[np.ndarray]] = defaultdict(list)
    for (template, _), vectors in media.items():
        per_template[template].append(np.mean(vectors, axis=0))
    feature = {t: np.mean(v, axis=0) / np.linalg.norm(np.mean(v, axis=0)) for t, v in per_template.items()}
    scores = np.array([feature[a] @ feature[b] for a, b, _ in pairs])
    genuine = np.array([label == "1" or label == 1 for *_, label in pairs])
    out = {}
    for far in fars:
        best = 0.0
        for threshold in [*np.unique(scores), np.inf]:  # accept score >= threshold
            false_accepts = np.mean(scores[~genuine] >= threshold)
            if false_accepts <= far:
                best = max(best, float(np.mean(scores[genuine] >= threshold)))
        out[far] = best
    return out


def test_tar_at_far_matches_brute_force(tmp_path: Path) -> None:
    template_file, pair_file, embeddings, rows = _synthetic_protocol(tmp_path)
    protocol = load_verification_protocol(template_file, pair_file)
    assert protocol.images == [r[0] for r in rows] and len(protocol.images) == len(embeddings)
    fars = (1e-1, 1e-2, 1e-3, 1e-4)
    metrics = verification_metrics(torch.from_numpy(embeddings), protocol, fars)
    # a tensor still in the graph, or in bf16 (no numpy form): numpy refused both
    grad = verification_metrics(torch.from_numpy(embeddings).requires_grad_(), protocol, fars)
    assert grad == metrics
    bf16 = verification_metrics(torch.from_numpy(embeddings).bfloat16(), protocol, fars)
    assert bf16["num_genuine"] == metrics["num_genuine"]
    pairs = [(a, b, int(g)) for (a, b), g in zip(protocol.pairs, protocol.genuine, strict=True)]
    want = _brute_force(embeddings, rows, pairs, fars)
    assert metrics["num_impostor"] > 4000 and metrics["num_genuine"] > 40
    for far in fars:
        assert metrics[f"tar@far={far:g}"] == pytest.approx(want[far], abs=1e-12), far
    # a meaningful spread: strict FARs accept fewer genuine pairs, loose ones more
    assert 0 < metrics["tar@far=0.0001"] < metrics["tar@far=0.1"] < 1


def test_tar_at_far_with_ties_and_edges() -> None:
    scores = np.array([0.9, 0.8, 0.8, 0.8, 0.5, 0.8, 0.7, 0.1, 0.0, -0.2])
    genuine = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 0], dtype=bool)
    got = tar_at_far(scores, genuine, fars=(0.0, 1 / 6, 2 / 6, 1.0))
    # Impostors: 0.8, 0.8, 0.7, 0.1, 0.0, -0.2. One false accept allowed (1/6) cannot take a single 0.8
    # without its tie: the threshold stays above 0.8, accepting only the genuine 0.9.
    assert got[0.0] == (0.25, 0.8) and got[1 / 6][0] == 0.25
    assert got[2 / 6] == (0.75, 0.7)  # both 0.8 impostors accepted: genuine 0.9, 0.8, 0.8
    assert got[1.0][0] == 1.0
    with pytest.raises(ValueError, match="both genuine and impostor"):
        tar_at_far(scores[genuine], genuine[genuine])


def test_protocol_file_errors_name_the_line(tmp_path: Path) -> None:
    templates = tmp_path / "t.txt"
    pairs = tmp_path / "p.txt"
    templates.write_text("a.jpg 1 1\nb.jpg 2\nc.jpg\n")
    pairs.write_text("1 2 1\n")
    with pytest.raises(ProtocolFileError, match=r"t.txt:3: expected 'IMAGE TEMPLATE_ID \[MEDIA_ID\]'"):
        load_verification_protocol(templates, pairs)
    templates.write_text("a.jpg 1 1\nb.jpg 2\n")
    pairs.write_text("1 2 1\n1 7 0\n")
    with pytest.raises(ProtocolFileError, match=r"p.txt:2: template\(s\) \['7'\] have no image"):
        load_verification_protocol(templates, pairs)
    pairs.write_text("1 2 yes\n")
    with pytest.raises(ProtocolFileError, match="p.txt:1"):
        load_verification_protocol(templates, pairs)
    # Without media ids each image is its own media.
    pairs.write_text("1 2 1\n")
    protocol = load_verification_protocol(templates, pairs)
    assert len(set(protocol.media)) == 2


def _write_image(path: Path, rng: np.random.Generator, tint: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.clip(tint + rng.normal(scale=30, size=(40, 32, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)


def test_vggface2_identity_folders_prepare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """VGGFace2 as published: train/ and test/ identity folders beside list files and bb_landmark/."""
    rng = np.random.default_rng(0)
    root = tmp_path / "vggface2"
    layout = {"train": ["n000002", "n000003", "n000004"], "test": ["n000001", "n000009"]}
    for split, identities in layout.items():
        for identity in identities:
            for j in range(3):
                _write_image(root / split / identity / f"{j + 1:04d}_01.jpg", rng, rng.uniform(0, 255, 3))
        (root / f"{split}_list.txt").write_text("\n".join(f"{i}/0001_01.jpg" for i in identities) + "\n")
    (root / "identity_meta.csv").write_text("Class_ID, Name, Sample_Num, Flag, Gender\n")
    (root / "bb_landmark").mkdir()
    (root / "bb_landmark" / "loose_bb_train.csv").write_text("NAME_ID,X,Y,W,H\n")
    out = tmp_path / "shards"
    assert cli_main(["prepare", "folder", str(root), str(out), "--quiet"]) == 0
    info = json.loads((out / "dataset.json").read_text())
    assert {k: v["num_samples"] for k, v in info["splits"].items()} == {"train": 9, "test": 6}
    assert sorted(info["class_names"]) == ["n000001", "n000002", "n000003", "n000004", "n000009"]
    assert info["evaluations"] == [{"name": "test", "query": "test", "gallery": None}]
    assert any("bb_landmark" in note for note in info["notes"])
    # A folder of images beside train/ is neither dropped silently nor a reason to read train/ and test/ as
    # two classes (every training identity merged into one, as it was): the layout is refused, named.
    _write_image(root / "extra" / "x.jpg", rng, np.zeros(3))
    assert cli_main(["prepare", "folder", str(root), str(tmp_path / "other"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "has split folders (test/, train/) beside folders with images (extra/)" in err, err
    assert not (tmp_path / "other" / "dataset.json").exists()


def test_verify_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dmltrain verify` embeds the listed images with the saved model's own preprocessing."""
    from dmltrain.service.builders import build_network, resolve_preprocessing
    from dmltrain.service.config import load_config
    from dmltrain.service.serving.loading import load_embedding_model

    config = load_config(
        REPO / "configs" / "quickstart.yaml", [f"data.root={tmp_path}", "model.embedding_dim=16"]
    )
    preprocessing = resolve_preprocessing(config)
    torch.manual_seed(0)
    net = build_network(config, preprocessing)
    model_file = tmp_path / "model.pt"
    torch.save(
        {
            "model": net.state_dict(),
            "config": config.model_dump(mode="json"),
            "preprocess": preprocessing.to_dict(),
        },
        model_file,
    )
    rng = np.random.default_rng(1)
    tints = rng.uniform(0, 255, size=(6, 3))
    lines, pairs = [], []
    for template in range(12):
        subject = template // 2
        for k in range(2):
            name = f"faces/{template}_{k}.png"
            _write_image(tmp_path / name, rng, tints[subject])
            lines.append(f"{name} {template} {template}")
    for a, b in itertools.combinations(range(12), 2):
        pairs.append(f"{a} {b} {int(a // 2 == b // 2)}")
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "p.txt").write_text("\n".join(pairs) + "\n")
    args = ["verify", str(model_file), str(tmp_path / "t.txt"), str(tmp_path / "p.txt")]
    assert cli_main([*args, "--image-root", str(tmp_path), "--far", "0.01", "0.1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    model = load_embedding_model(str(model_file))
    loaded, pp = model.net, model.preprocessing
    assert pp == preprocessing
    protocol = load_verification_protocol(tmp_path / "t.txt", tmp_path / "p.txt")
    with torch.no_grad():
        images = [
            pp.test_transform()(
                torch.from_numpy(np.asarray(Image.open(tmp_path / n).convert("RGB")).copy()).permute(2, 0, 1)
            )
            for n in protocol.images
        ]
        embeddings = loaded(pp.normalizer()(torch.stack(images)))
    want = verification_metrics(embeddings, protocol, (0.01, 0.1))
    assert printed == pytest.approx(want)
    assert printed["num_genuine"] == 6 and printed["num_impostor"] == 60
    (tmp_path / "faces" / "0_0.png").write_bytes(b"not an image")
    assert cli_main([*args, "--image-root", str(tmp_path)]) == 2
    assert "faces/0_0.png (listed in" in capsys.readouterr().err
