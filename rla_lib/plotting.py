"""Figures: one style, saved as PNG and SVG under figures/ (atomically, so a crash leaves no half file)."""

from __future__ import annotations

from pathlib import Path

from .paths import FIGURES_DIR, atomic_write


def save_figure(fig, name: str, directory: Path | str = FIGURES_DIR) -> list[Path]:
    return [atomic_write(Path(directory) / f"{name}.{ext}", lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight"))
            for ext in ("png", "svg")]
