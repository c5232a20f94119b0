"""Plots write valid PNGs of the expected pixel size, with the colours that carry their meaning."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib import colors
from PIL import Image

from dmltrain.plots import (
    CORRECT_RGB,
    QUERY_RGB,
    WRONG_RGB,
    recall_at_k_curve,
    retrieval_grid,
    retrieval_grid_image,
    training_curves,
)


def read_png(path):
    with Image.open(path) as im:
        assert im.format == "PNG"
        return np.asarray(im.convert("RGB"))


def has_colour(img, rgb, tol=12):
    return bool((np.abs(img.astype(int) - np.asarray(rgb)).max(axis=2) <= tol).any())


def rgb255(name):
    return tuple(round(c * 255) for c in colors.to_rgb(name))


def test_recall_curve_png(tmp_path):
    runs = {
        "step 0": {"recall@1": 0.3, "recall@10": 0.5, "recall@100": 0.7, "recall@1000": 0.9, "map": 0.2},
        "step 500": {"recall@1": 0.6, "recall@10": 0.8, "recall@100": 0.9, "recall@1000": 0.97},
    }
    fig = recall_at_k_curve(runs, path=tmp_path / "r.png", figsize=(5.0, 3.0), dpi=80)
    img = read_png(tmp_path / "r.png")
    assert img.shape == (240, 400, 3)
    assert has_colour(img, rgb255("C0")) and has_colour(img, rgb255("C1"))  # one line per run
    assert fig.axes[0].get_xscale() == "log"  # 1..1000 spans three decades
    recall_at_k_curve({"only": runs["step 0"]}, path=tmp_path / "one.png")
    one = read_png(tmp_path / "one.png")
    assert one.shape == (400, 640, 3) and not has_colour(one, rgb255("C1"))
    prefixed = recall_at_k_curve(
        {"a": {"val/recall@1": 0.5, "val/recall@8": 0.9, "recall@2": 0.1}}, prefix="val/"
    )
    assert list(prefixed.axes[0].lines[0].get_xdata()) == [1, 8]  # only the prefixed keys
    assert prefixed.axes[0].get_xscale() == "log"  # 1, 2, 4, 8 evenly spaced
    narrow = recall_at_k_curve({"a": {"recall@1": 0.5, "recall@2": 0.6}})
    assert narrow.axes[0].get_xscale() == "linear"
    with pytest.raises(ValueError, match="no 'recall@K' key"):
        recall_at_k_curve({"bad": {"map": 0.1}})


def test_training_curves_png(tmp_path):
    steps = np.arange(0, 200, 10)
    loss = np.linspace(2.0, 0.5, len(steps))
    loss[5] = np.nan  # a skipped step leaves a gap, not an error
    series = {
        "loss": loss,
        "lr": np.geomspace(1e-3, 1e-5, len(steps)),
        "images_per_second": np.full(len(steps), 120.0),
    }
    fig = training_curves(steps, series, path=tmp_path / "t.png", panel_size=(6.0, 1.5), dpi=100)
    img = read_png(tmp_path / "t.png")
    assert img.shape == (450, 600, 3)
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "lr", "images_per_second"]
    assert fig.axes[1].get_yscale() == "log" and fig.axes[0].get_yscale() == "linear"
    assert has_colour(img, rgb255("C0"))
    with pytest.raises(ValueError, match="series 'lr' has 3 values for 20 steps"):
        training_curves(steps, {"lr": [1, 2, 3]})


def make_images(n, h=6, w=5, start=10):
    """Solid grey images, each a distinct level, as (N, C, H, W) uint8 like the data pipeline yields."""
    return np.stack([np.full((3, h, w), start + 7 * i, dtype=np.uint8) for i in range(n)])


def test_retrieval_grid_pixels(tmp_path):
    gallery = make_images(10, start=60)
    g_labels = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    queries = make_images(2)
    q_labels = np.array([1, 3])
    nbr = np.array([[2, 0, 3], [6, 7, -1]])  # right, wrong, right / right, right, (none)
    border, gap = 2, 3
    img = retrieval_grid_image(queries, q_labels, nbr, gallery, g_labels, border=border, gap=gap)
    h, w = 6 + 2 * border, 5 + 2 * border
    sep = 3 * gap + border
    assert img.shape == (2 * h + 3 * gap, 4 * w + 4 * gap + sep, 3) and img.dtype == np.uint8

    def cell(row, col):
        y = gap + row * (h + gap)
        x = gap + col * (w + gap) + (sep if col else 0)
        return img[y : y + h, x : x + w]

    for row, expect in enumerate([[CORRECT_RGB, WRONG_RGB, CORRECT_RGB], [CORRECT_RGB, CORRECT_RGB, None]]):
        q = cell(row, 0)
        assert (
            tuple(q[0, 0]) == QUERY_RGB and (q[border:-border, border:-border] == queries[row, 0, 0, 0]).all()
        )
        for j, rgb in enumerate(expect):
            c = cell(row, j + 1)
            if rgb is None:
                assert (c == 255).all()  # -1: blank cell
                continue
            assert tuple(c[0, 0]) == rgb and tuple(c[-1, -1]) == rgb
            assert (c[border:-border, border:-border] == gallery[nbr[row, j], 0, 0, 0]).all()

    # the same grid from channels-last, grayscale and torch inputs, with only the shown gallery images
    shown = {int(i): gallery[i].transpose(1, 2, 0) for i in nbr.ravel() if i >= 0}
    alt = retrieval_grid_image(
        torch.from_numpy(queries[:, 0]),
        torch.from_numpy(q_labels),
        torch.from_numpy(nbr),
        shown,
        g_labels,
        border=border,
        gap=gap,
    )
    np.testing.assert_array_equal(alt, img)

    fig = retrieval_grid(
        queries, q_labels, nbr, gallery, g_labels, border=border, gap=gap, path=tmp_path / "g.png"
    )
    np.testing.assert_array_equal(read_png(tmp_path / "g.png"), img)
    fig.savefig(tmp_path / "fig.png", dpi=fig.dpi)
    assert read_png(tmp_path / "fig.png").shape == img.shape
    big = retrieval_grid(
        queries, q_labels, nbr, gallery, g_labels, border=border, gap=gap, scale=3, path=tmp_path / "big.png"
    )
    assert read_png(tmp_path / "big.png").shape[:2] == tuple(3 * s for s in img.shape[:2])
    assert big is not None


def test_retrieval_grid_refuses_bad_input():
    gallery, labels = make_images(4), np.arange(4)
    with pytest.raises(ValueError, match="must be uint8"):
        retrieval_grid_image(gallery.astype(np.float32), labels, [[1]] * 4, gallery, labels)
    with pytest.raises(ValueError, match="outside the 4 gallery labels"):
        retrieval_grid_image(gallery, labels, [[9]] * 4, gallery, labels)
    with pytest.raises(ValueError, match="gallery_images\\[1\\] is 3x5"):
        retrieval_grid_image(gallery, labels, [[1]] * 4, {1: np.zeros((3, 5), np.uint8)}, labels)
    with pytest.raises(ValueError, match="neighbor_indices has 2 rows"):
        retrieval_grid_image(gallery, labels, [[1], [2]], gallery, labels)


def test_plots_need_neither_pyplot_nor_mlflow():
    banned = "{'mlflow', 'matplotlib.pyplot', 'torch'}"
    code = f"import sys, dmltrain.plots; assert not {banned} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_curves_stay_readable_with_one_point_or_many_runs():
    """One logged point (train.steps <= train.log_every) drew an empty panel; an 11th sweep trial took the
    1st's colour and marker, a baseline could take a trial's, and a legend of many long labels covered
    half the curves."""
    from dmltrain.plots import comparison_curves, training_curves

    single = training_curves([10], {"loss": [0.5]})
    assert single.axes[0].lines[0].get_marker() == "."
    curves = {f"trial {i} with a long label": ([0, 100], [0.1 + i / 100, 0.2 + i / 100]) for i in range(12)}
    fig = comparison_curves(curves, xlabel="step", ylabel="R@1", baselines={"raw pixels": 0.2})
    ax = fig.axes[0]
    styles = [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.lines]
    assert len(set(styles)) == len(styles) == 13  # 12 trials and the baseline, no two alike
    assert styles[0][0] == styles[10][0] and styles[0][1:] != styles[10][1:]
    legend = ax.get_legend()
    fig.canvas.draw()
    assert legend.get_window_extent().x0 > ax.get_window_extent().x1  # beside the axes, not over them
    few = comparison_curves({"a": ([0, 1], [0.1, 0.2])}, xlabel="step", ylabel="R@1")
    few.canvas.draw()
    assert few.axes[0].get_legend().get_window_extent().x0 < few.axes[0].get_window_extent().x1
