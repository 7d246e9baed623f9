"""Figures: one style, saved as PNG and SVG under figures/ (atomically, so a crash leaves no half file), refused where
tick labels overlap at the size they are saved."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .paths import FIGURES_DIR, atomic_write

TOUCHING_PX = 0.5  # labels closer than this are not counted as overlapping (antialiasing, not ink on ink)


def save_figure(fig, name: str, directory: Path | str = FIGURES_DIR) -> list[Path]:
    """Write `fig` as `<name>.png` and `.svg`; a figure whose tick labels overlap is refused, naming them."""
    if overlaps := overlapping_tick_labels(fig):
        raise ValueError(f"figure {name}: tick labels overlap at the saved size ({'; '.join(overlaps[:5])}): rotate "
                         "them, show fewer ticks or widen the figure")
    return [atomic_write(Path(directory) / f"{name}.{ext}", lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight"))
            for ext in ("png", "svg")]


def overlapping_tick_labels(fig) -> list[str]:
    """Pairs of drawn tick labels of one axis whose ink boxes (rotated with the text) overlap, as they render."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for axis, along in ((ax.xaxis, 0), (ax.yaxis, 1)):
            low, high = sorted(axis.get_view_interval())
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text().strip()
                      and low <= t.get_position()[along] <= high]  # ticks outside the view are not drawn
            boxes = [_corners(t, renderer) for t in labels]
            for i in range(len(labels)):
                for j in range(i + 1, len(labels)):
                    if _overlap(boxes[i], boxes[j]):
                        found.append(f"{ax.get_title() or 'an axes'}: {axis.axis_name} labels "
                                     f"{labels[i].get_text()!r} and {labels[j].get_text()!r}")
    return found


def _corners(text, renderer) -> np.ndarray:
    """The four corners (pixels) of a text's box rotated with it. Matplotlib aligns the rotated text by its upright
    bounding box, so each corner of the w x h box touches one side of that box."""
    box = text.get_window_extent(renderer)
    angle = text.get_rotation() % 180
    rotation = text.get_rotation()
    text.set_rotation(0)
    upright = text.get_window_extent(renderer)
    text.set_rotation(rotation)
    w, h = upright.width, upright.height
    theta = math.radians(angle if angle <= 90 else 180 - angle)
    c, s = math.cos(theta), math.sin(theta)
    corners = np.array([(h * s, 0.0), (h * s + w * c, w * s), (w * c, w * s + h * c), (0.0, h * c)])
    if angle > 90:  # the mirror image of the (180 - angle) box
        corners[:, 0] = box.width - corners[:, 0]
    return corners + (box.x0, box.y0)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Two convex quadrilaterals overlap by more than TOUCHING_PX unless some edge normal separates them."""
    for poly in (a, b):
        for k in range(4):
            edge = poly[(k + 1) % 4] - poly[k]
            length = math.hypot(*edge)
            if length == 0:
                continue
            normal = np.array([-edge[1], edge[0]]) / length
            pa, pb = a @ normal, b @ normal
            if min(pa.max(), pb.max()) - max(pa.min(), pb.min()) <= TOUCHING_PX:
                return False
    return True
