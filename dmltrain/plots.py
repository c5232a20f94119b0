"""Figures for a training run: Recall@K curves, training curves and a retrieval grid (queries with their
top retrievals, bordered green when right and red when wrong).

Everything renders with the Agg canvas on `matplotlib.figure.Figure` objects, never through pyplot: no
global figure state, no display needed, safe in Ray workers and threads. Functions return the Figure (which
``mlflow.log_figure`` accepts) and write a PNG when given a path; nothing here imports MLflow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = [
    "CORRECT_RGB",
    "QUERY_RGB",
    "WRONG_RGB",
    "comparison_curves",
    "recall_at_k_curve",
    "retrieval_grid",
    "retrieval_grid_image",
    "save_png",
    "training_curves",
]

CORRECT_RGB = (0, 190, 0)
WRONG_RGB = (230, 0, 0)
QUERY_RGB = (40, 90, 230)
_BACKGROUND = 255

PathLike = str | os.PathLike[str]


def _new_figure(width_in: float, height_in: float, dpi: int) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: PathLike) -> None:
    """Write the figure as a PNG of exactly figsize x dpi pixels (no tight cropping, so sizes are known)."""
    FigureCanvasAgg(fig)
    fig.savefig(os.fspath(path), format="png", dpi=fig.dpi)


# ------------------------------------------------------------------------------------------ Recall@K
def recall_at_k_curve(
    results: Mapping[str, Mapping[str, float]],
    *,
    prefix: str = "",
    path: PathLike | None = None,
    title: str = "Recall@K",
    figsize: tuple[float, float] = (6.4, 4.0),
    dpi: int = 100,
) -> Figure:
    """Recall against K, one line per entry of ``results`` (a run, a step, a test set...).

    Each value is a metrics dict as `retrieval_metrics` returns it; keys ``{prefix}recall@K`` are used,
    the rest ignored. K goes on a log axis when the cut-offs span a factor 4 or more (1, 2, 4, 8 evenly)."""
    if not results:
        raise ValueError("results is empty: nothing to plot")
    pattern = re.compile(re.escape(prefix) + r"recall@(\d+)$")
    fig = _new_figure(*figsize, dpi)
    ax = fig.add_subplot()
    all_k: set[int] = set()
    for name, metrics in results.items():
        pts = sorted((int(m.group(1)), float(v)) for key, v in metrics.items() if (m := pattern.match(key)))
        if not pts:
            raise ValueError(f"results[{name!r}] has no '{prefix}recall@K' key")
        ks, vals = zip(*pts, strict=True)
        all_k.update(ks)
        ax.plot(ks, vals, marker="o", label=str(name))
    if max(all_k) / min(all_k) >= 4:
        ax.set_xscale("log")
    ax.set_xticks(sorted(all_k), [str(k) for k in sorted(all_k)])
    ax.minorticks_off()
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("K")
    ax.set_ylabel("Recall@K")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")  # low recall (step 0, large K) sits in the lower right
    fig.tight_layout()
    if path is not None:
        save_png(fig, path)
    return fig


# ---------------------------------------------------------------------------------- training curves
def training_curves(
    steps: Sequence[int] | np.ndarray,
    series: Mapping[str, Sequence[float] | np.ndarray],
    *,
    log_y: Sequence[str] = ("lr",),
    path: PathLike | None = None,
    title: str | None = None,
    panel_size: tuple[float, float] = (6.4, 2.0),
    dpi: int = 100,
) -> Figure:
    """One panel per series (e.g. ``loss``, ``lr``, ``images_per_second``) against the training step.

    NaN entries (e.g. a skipped step) leave gaps rather than breaking the line. Series named in ``log_y``
    get a log y axis when all their values are positive."""
    if not series:
        raise ValueError("series is empty: nothing to plot")
    x = np.asarray(steps, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"steps must be 1-D, got shape {x.shape}")
    fig = _new_figure(panel_size[0], panel_size[1] * len(series), dpi)
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        y = np.asarray(values, dtype=np.float64)
        if y.shape != x.shape:
            raise ValueError(f"series {name!r} has {y.shape[0] if y.ndim else 0} values for {len(x)} steps")
        # markers on short series: one logged point (train.steps <= train.log_every) drew nothing
        ax.plot(x, y, linewidth=1.2, marker="." if len(x) <= 100 else None)
        finite = y[np.isfinite(y)]
        if name in log_y and finite.size and (finite > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path)
    return fig


# ------------------------------------------------------------------------------ comparing runs
def comparison_curves(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    baselines: Mapping[str, float] | None = None,
    log_x: bool = False,
    path: PathLike | None = None,
    title: str | None = None,
    figsize: tuple[float, float] = (7.2, 4.4),
    dpi: int = 100,
) -> Figure:
    """One line per run (``label -> (x, y)``, e.g. Recall@1 against the step or the images seen), with
    dashed horizontal lines for reference values that do not change with x (an untrained network, raw
    pixels): the sweep's comparison plots."""
    if not curves and not baselines:
        raise ValueError("nothing to plot: no curves and no baselines")
    fig = _new_figure(figsize[0], figsize[1], dpi)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, (x, y)) in enumerate(curves.items()):
        xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if xs.shape != ys.shape:
            raise ValueError(f"curve {label!r}: {xs.shape[0]} x values for {ys.shape[0]} y values")
        # past the 10 colours, another marker and line style: trial 11 was trial 1's twin
        style = {"marker": "osv^D"[(i // 10) % 5], "linestyle": ("-", "-.", ":")[(i // 10) % 3]}
        ax.plot(xs, ys, markersize=3, linewidth=1.3, color=f"C{i % 10}", label=label, **style)
    for i, (label, value) in enumerate((baselines or {}).items()):  # grey, dashed: never a trial's colour
        dashes = ((5, 3), (1, 2), (3, 2, 1, 2))[i % 3]
        ax.axhline(value, linewidth=1.0, color=str(0.15 + 0.2 * (i % 3)), dashes=dashes, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    entries = len(curves) + len(baselines or {})
    if entries > 6:  # beside the axes: inside, many or long labels hid half the curves
        fig.set_size_inches(figsize[0] + 2.6, figsize[1])
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize=7, loc="best")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path)
    return fig


# ----------------------------------------------------------------------------------- retrieval grid
def _numpy(x: Any) -> np.ndarray:
    """numpy view of an array or a torch tensor (duck-typed: this module does not import torch)."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)


def _to_hwc(img: Any, what: str) -> np.ndarray:
    """One uint8 image as (H, W, 3); accepts (C, H, W) as the data pipeline yields, (H, W, C) or (H, W)."""
    a = _numpy(img)
    if a.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8, got {a.dtype}")
    if a.ndim == 2:
        a = a[:, :, None]
    elif a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[2] not in (1, 3):
        a = a.transpose(1, 2, 0)
    elif not (a.ndim == 3 and a.shape[2] in (1, 3)):
        raise ValueError(
            f"{what} has shape {a.shape}; expected (C, H, W), (H, W, C) with C in (1, 3), or (H, W)"
        )
    return np.repeat(a, 3, axis=2) if a.shape[2] == 1 else a


def retrieval_grid_image(
    query_images: Any,
    query_labels: Any,
    neighbor_indices: Any,
    gallery_images: Any,
    gallery_labels: Any,
    *,
    border: int = 3,
    gap: int = 4,
) -> np.ndarray:
    """The retrieval grid as an (H, W, 3) uint8 array: one row per query, the query first (blue border), then
    its retrievals in rank order, each bordered green (same label as the query) or red.

    ``neighbor_indices`` (num_queries, k) index ``gallery_images`` / ``gallery_labels``; -1 leaves a blank
    cell. ``gallery_images`` may be an array or a mapping from index to image, so a caller can pass only the
    images the grid shows. Images are uint8 (C, H, W), (H, W, C) or (H, W), all of one size."""
    nbr = _numpy(neighbor_indices)
    if nbr.ndim != 2 or nbr.shape[0] == 0 or nbr.shape[1] == 0 or nbr.dtype.kind not in "iu":
        raise ValueError(f"neighbor_indices must be a non-empty 2-D integer array, got shape {nbr.shape}")
    nq, k = nbr.shape
    q_lab, g_lab = _numpy(query_labels), _numpy(gallery_labels)
    if len(q_lab) != nq or len(query_images) != nq:
        raise ValueError(
            f"neighbor_indices has {nq} rows but there are {len(query_images)} query images and "
            f"{len(q_lab)} query labels"
        )
    if border < 1 or gap < 0:
        raise ValueError("border must be >= 1 and gap >= 0")
    queries = [_to_hwc(query_images[i], f"query_images[{i}]") for i in range(nq)]
    h, w = queries[0].shape[:2]
    cell_h, cell_w = h + 2 * border, w + 2 * border
    sep = 3 * gap + border  # wider space between the query column and its retrievals
    height = nq * cell_h + (nq + 1) * gap
    width = (k + 1) * cell_w + (k + 1) * gap + sep
    canvas = np.full((height, width, 3), _BACKGROUND, dtype=np.uint8)

    def put(img: np.ndarray, row: int, col: int, rgb: tuple[int, int, int], what: str) -> None:
        if img.shape[:2] != (h, w):
            raise ValueError(f"{what} is {img.shape[0]}x{img.shape[1]} but the first query is {h}x{w}")
        y = gap + row * (cell_h + gap)
        x = gap + col * (cell_w + gap) + (sep if col > 0 else 0)
        canvas[y : y + cell_h, x : x + cell_w] = rgb
        canvas[y + border : y + border + h, x + border : x + border + w] = img

    for i in range(nq):
        put(queries[i], i, 0, QUERY_RGB, f"query_images[{i}]")
        for j in range(k):
            gi = int(nbr[i, j])
            if gi < 0:
                continue
            if gi >= len(g_lab):
                raise ValueError(
                    f"neighbor_indices[{i}, {j}] = {gi} is outside the {len(g_lab)} gallery labels"
                )
            rgb = CORRECT_RGB if g_lab[gi] == q_lab[i] else WRONG_RGB
            put(_to_hwc(gallery_images[gi], f"gallery_images[{gi}]"), i, j + 1, rgb, f"gallery_images[{gi}]")
    return canvas


def retrieval_grid(
    query_images: Any,
    query_labels: Any,
    neighbor_indices: Any,
    gallery_images: Any,
    gallery_labels: Any,
    *,
    border: int = 3,
    gap: int = 4,
    scale: int = 1,
    path: PathLike | None = None,
    dpi: int = 100,
) -> Figure:
    """`retrieval_grid_image` as a Figure showing it pixel for pixel (``scale`` repeats each pixel, for
    tiny 32 px images); with ``path``, that exact image is also written as a PNG."""
    img = retrieval_grid_image(
        query_images, query_labels, neighbor_indices, gallery_images, gallery_labels, border=border, gap=gap
    )
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if scale > 1:
        img = img.repeat(scale, axis=0).repeat(scale, axis=1)
    h, w = img.shape[:2]
    fig = _new_figure(w / dpi, h / dpi, dpi)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.imshow(img, interpolation="nearest", aspect="auto")
    ax.set_axis_off()
    if path is not None:
        from PIL import Image

        Image.fromarray(img).save(os.fspath(path), format="PNG")
    return fig
