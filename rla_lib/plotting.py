"""Figures: one style, saved as PNG and SVG under figures/ (atomically, so a crash leaves no half file)."""

from __future__ import annotations

import os
from pathlib import Path

from .paths import FIGURES_DIR


def save_figure(fig, name: str, directory: Path | str = FIGURES_DIR) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = directory / f"{name}.{ext}"
        tmp = directory / f".{name}.tmp.{ext}"
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        os.replace(tmp, path)
        paths.append(path)
    return paths
