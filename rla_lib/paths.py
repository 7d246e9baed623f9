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
