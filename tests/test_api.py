"""The names `rla_lib` exports (its public API): each resolves to its module's object, and importing the package
alone loads none of torch, Transformers or vLLM."""

import importlib
import subprocess
import sys
from pathlib import Path

import rla_lib


def test_every_export_is_its_modules_object_and_no_export_hides_a_module():
    for name, module in rla_lib._EXPORTS.items():
        assert getattr(rla_lib, name) is getattr(importlib.import_module(f"rla_lib.{module}"), name)
    assert "aligned" in dir(rla_lib) and set(rla_lib.__all__) == set(rla_lib._EXPORTS)
    modules = {p.stem for p in Path(rla_lib.__file__).parent.iterdir() if p.suffix == ".py" or p.is_dir()}
    assert not set(rla_lib._EXPORTS) & modules  # `from rla_lib import align` stays the module
    from rla_lib import align
    assert align.__name__ == "rla_lib.align"


def test_importing_the_package_loads_no_framework():
    code = "import sys, rla_lib; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error():
    try:
        rla_lib.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("rla_lib.no_such_name resolved")
