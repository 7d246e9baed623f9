"""Where the project's files live (resolved from the package, so notebooks can run from anywhere).

`RLA_FIGURES_DIR` and `RLA_RESULTS_DIR` redirect outputs (the tests send them to a temporary folder
so a quick test run never overwrites the figures of a full `make run-all`).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
MODELS_DIR = DATA_DIR / "models"
FIGURES_DIR = Path(os.environ.get("RLA_FIGURES_DIR", ROOT / "figures"))
RESULTS_DIR = Path(os.environ.get("RLA_RESULTS_DIR", ROOT / "results"))


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
