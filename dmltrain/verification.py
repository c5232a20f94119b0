"""IJB-C-style 1:1 template verification: template features and TAR at FAR (Smooth-AP Sec. 5.4).

A *template* is a set of images of one subject (stills and video frames); each image belongs to one *media*
(a still is its own media, a video's frames share one). As in the IJB-C benchmark and its reference code,
a template's feature is the average over its media of each media's mean image feature, L2-normalised, and a
pair of templates is scored by the cosine of their features. The protocol lists template pairs labelled
genuine (same subject) or impostor; TAR@FAR=f is the share of genuine pairs accepted at the strictest
threshold that accepts at most a share f of the impostor pairs.

Files (whitespace- or comma-separated, `#` starts a comment, an optional header line is skipped):
- templates: ``IMAGE TEMPLATE_ID [MEDIA_ID]`` per line — IJB-C's ``ijbc_face_tid_mid.txt`` as published;
  without MEDIA_ID every image is its own media.
- pairs: ``TEMPLATE_ID TEMPLATE_ID LABEL`` per line, LABEL 1 genuine / 0 impostor — IJB-C's
  ``ijbc_template_pair_label.txt``.
Ids are compared as strings. Library code: no Ray, no MLflow; embeddings come from any model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_FARS = (1e-3, 1e-4)
_HEADER_WORDS = {"image", "img", "filename", "file", "path", "template", "template_id", "tid", "media", "mid"}
_PAIR_HEADER = {"template1", "template2", "t1", "t2", "label", "template_id1", "template_id2"}


class ProtocolFileError(ValueError):
    """A malformed template or pair file; the message names the file and line."""


@dataclass(frozen=True)
class VerificationProtocol:
    """Parsed protocol: one row per image line of the template file, and the labelled template pairs."""

    images: list[str]
    templates: np.ndarray  # (N,) template id per image row (str)
    media: np.ndarray  # (N,) media id per image row (str)
    pairs: np.ndarray  # (P, 2) template ids (str)
    genuine: np.ndarray  # (P,) bool


def _rows(path: Path, header_words: set[str]) -> list[tuple[int, list[str]]]:
    if not path.is_file():
        raise ProtocolFileError(f"protocol file not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        fields = [f for f in re.split(r"[,\s]+", text) if f]
        if not rows and {f.lower() for f in fields} <= header_words:
            continue  # a header line
        rows.append((number, fields))
    if not rows:
        raise ProtocolFileError(f"{path}: no entries")
    return rows


def load_verification_protocol(template_file: str | Path, pair_file: str | Path) -> VerificationProtocol:
    """Read a template file and a pair file (formats in the module docstring)."""
    template_path, pair_path = Path(template_file), Path(pair_file)
    images, templates, media = [], [], []
    for number, fields in _rows(template_path, _HEADER_WORDS):
        if len(fields) not in (2, 3):
            raise ProtocolFileError(
                f"{template_path}:{number}: expected 'IMAGE TEMPLATE_ID [MEDIA_ID]', got {len(fields)} fields"
            )
        images.append(fields[0])
        templates.append(fields[1])
        media.append(fields[2] if len(fields) == 3 else f"image:{fields[0]}")
    known = set(templates)
    pairs, genuine = [], []
    for number, fields in _rows(pair_path, _PAIR_HEADER):
        if len(fields) != 3 or fields[2] not in ("0", "1"):
            raise ProtocolFileError(
                f"{pair_path}:{number}: expected 'TEMPLATE_ID TEMPLATE_ID 0|1', got {fields}"
            )
        missing = [t for t in fields[:2] if t not in known]
        if missing:
            raise ProtocolFileError(
                f"{pair_path}:{number}: template(s) {missing} have no image in {template_path}"
            )
        pairs.append(fields[:2])
        genuine.append(fields[2] == "1")
    return VerificationProtocol(
        images=images,
        templates=np.asarray(templates, dtype=object),
        media=np.asarray(media, dtype=object),
        pairs=np.asarray(pairs, dtype=object).reshape(-1, 2),
        genuine=np.asarray(genuine, dtype=bool),
    )


def template_features(
    embeddings: torch.Tensor | np.ndarray,
    templates: Sequence[str] | np.ndarray,
    media: Sequence[str] | np.ndarray,
) -> tuple[list[str], torch.Tensor]:
    """Per template: the mean over its media of each media's mean image embedding, L2-normalised.

    Returns the template ids (sorted) and a (T, D) float32 tensor in that order.
    """
    if isinstance(embeddings, torch.Tensor):  # numpy has no bf16 and refuses tensors on a GPU or in a graph
        x = embeddings.detach().to("cpu", torch.float32)
    else:
        x = torch.as_tensor(np.asarray(embeddings), dtype=torch.float32)
    templates, media = np.asarray(templates, dtype=object), np.asarray(media, dtype=object)
    if x.dim() != 2 or not len(x) == len(templates) == len(media):
        raise ValueError(
            f"embeddings {tuple(x.shape)} must be (N, D) with one row per template-file line "
            f"({len(templates)} templates, {len(media)} media ids)"
        )
    if not torch.isfinite(x).all():
        raise ValueError("embeddings contain NaN or Inf")
    template_ids, template_index = np.unique(templates.astype(str), return_inverse=True)
    keys = np.char.add(np.char.add(templates.astype(str), "\x00"), media.astype(str))
    _, media_index = np.unique(keys, return_inverse=True)
    media_index_t = torch.as_tensor(media_index, dtype=torch.int64)
    n_media = int(media_index.max()) + 1
    media_sum = torch.zeros(n_media, x.shape[1]).index_add_(0, media_index_t, x)
    media_count = torch.bincount(media_index_t, minlength=n_media).unsqueeze(1)
    media_mean = media_sum / media_count
    media_template = np.zeros(n_media, dtype=np.int64)
    media_template[media_index] = template_index
    owner = torch.as_tensor(media_template)
    template_sum = torch.zeros(len(template_ids), x.shape[1]).index_add_(0, owner, media_mean)
    template_mean = template_sum / torch.bincount(owner, minlength=len(template_ids)).unsqueeze(1)
    return [str(t) for t in template_ids], torch.nn.functional.normalize(template_mean, dim=1)


def tar_at_far(
    scores: torch.Tensor | np.ndarray,
    genuine: torch.Tensor | np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
) -> dict[float, tuple[float, float]]:
    """``{far: (tar, threshold)}``; a pair is accepted when its score is strictly above ``threshold``.

    The threshold is the (floor(far x impostors) + 1)-th highest impostor score, so at most that share of
    impostors is accepted and as many genuine pairs as possible are (the exact optimum over thresholds).
    With fewer than 1/far impostor pairs the constraint means "no impostor accepted".
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    g = np.asarray(genuine, dtype=bool).ravel()
    if len(s) != len(g):
        raise ValueError(f"{len(s)} scores but {len(g)} labels")
    impostor, positive = np.sort(s[~g])[::-1], s[g]
    if not len(impostor) or not len(positive):
        raise ValueError("TAR at FAR needs both genuine and impostor pairs")
    out = {}
    for far in fars:
        if not 0 <= far <= 1:
            raise ValueError(f"FAR must lie in [0, 1], got {far}")
        allowed = int(np.floor(far * len(impostor) + 1e-9))
        if allowed >= len(impostor):
            out[far] = (1.0, float("-inf"))
            continue
        threshold = float(impostor[allowed])
        out[far] = (float(np.mean(positive > threshold)), threshold)
    return out


def verification_metrics(
    embeddings: torch.Tensor | np.ndarray,
    protocol: VerificationProtocol,
    fars: Sequence[float] = DEFAULT_FARS,
) -> dict[str, float]:
    """TAR at each FAR of the protocol's pairs from per-image embeddings (rows in template-file order).

    Keys: ``tar@far=<far>`` and ``threshold@far=<far>`` for each FAR, ``num_genuine``, ``num_impostor``,
    ``num_templates``.
    """
    ids, features = template_features(embeddings, protocol.templates, protocol.media)
    position = {t: i for i, t in enumerate(ids)}
    left = torch.as_tensor([position[t] for t in protocol.pairs[:, 0]], dtype=torch.int64)
    right = torch.as_tensor([position[t] for t in protocol.pairs[:, 1]], dtype=torch.int64)
    scores = (features[left] * features[right]).sum(dim=1)
    out: dict[str, float] = {
        "num_genuine": float(protocol.genuine.sum()),
        "num_impostor": float((~protocol.genuine).sum()),
        "num_templates": float(len(ids)),
    }
    for far, (tar, threshold) in tar_at_far(scores, protocol.genuine, fars).items():
        out[f"tar@far={far:g}"] = tar
        out[f"threshold@far={far:g}"] = threshold
    return out
