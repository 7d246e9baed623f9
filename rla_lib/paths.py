"""Where the project's files live (resolved from the package, so notebooks can run from anywhere).

Run from the repository (a checkout, `make setup`'s editable install), everything is in it: data/, results/,
tables/, figures/, .cache/. Installed from a wheel into another environment (a trainer's), the shipped data (the
embedded models, the task's splits, the example prompts) comes with the package (`rla_lib/_data`) and what rla
writes (caches, results, tables, figures) goes to `RLA_HOME`, by default the user's cache folder
(`$XDG_CACHE_HOME/rla`, else `~/.cache/rla`), never into site-packages.

`RLA_FIGURES_DIR` and `RLA_RESULTS_DIR` redirect outputs (the tests send them to a temporary folder
so a quick test run never overwrites the figures of a full `make run-all`).
"""

import os
from pathlib import Path

from .settings import setting

PACKAGE_DIR = Path(__file__).resolve().parent
IN_CHECKOUT = (PACKAGE_DIR.parent / "pyproject.toml").is_file() and (PACKAGE_DIR.parent / "data").is_dir()
USER_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rla"
ROOT = PACKAGE_DIR.parent if IN_CHECKOUT else Path(setting("RLA_HOME") or USER_HOME)
DATA_DIR = ROOT / "data" if IN_CHECKOUT else PACKAGE_DIR / "_data"
MODELS_DIR = DATA_DIR / "models"
FIGURES_DIR = Path(setting("RLA_FIGURES_DIR") or ROOT / "figures")
RESULTS_DIR = Path(setting("RLA_RESULTS_DIR") or ROOT / "results")
CHAPTERS = "[0-9][0-9]*_*.ipynb"  # the notebooks, in reading order when sorted: 00_tour, 01_..., 02_..., 03a_..., 03b_...


def slug(name: str) -> str:
    """A display name as a folder name: "default BF16 + TIS" -> "default_BF16_plus_TIS" (no commas either)."""
    return name.replace("+", "plus").replace(",", "").replace(" ", "_")


def atomic_write(path, write) -> Path:
    """Write `path` through `write(tmp)` on a sibling temporary, then rename: a crash never leaves half a file.

    The temporary keeps the extension, so writers that infer the format from it (savefig, pandas
    compression, numpy's .npz) behave as for `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
