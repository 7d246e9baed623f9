"""Every benchmark's quickest documented form runs, prints its figures and writes no table (issue 70: `align` began to
refuse a second alignment, `benchmarks/align_overhead.py` switched configurations that way, and nothing ran it).

The forms are read from each benchmark's docstring, the line that ends `# quickest`, so the command a reader is shown
is the one tested. Each is marked `bench` (`make test-fast` skips them); `, starts vLLM` in its note marks it `engine`
too, and `make test-bench` there `slow_bench` (too slow for `make test`). Nothing about speed is asserted."""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rla_lib.paths import ROOT
from rla_lib.report import TABLES_DIR

BENCHMARKS = ROOT / "benchmarks"
QUICKEST = re.compile(r"^\s+\.venv/bin/python benchmarks/(\S+\.py)(.*?)\s+# quickest\b(.*)$", re.M)
NUMBER = r"[+-]?\d+(?:\.\d+)?"
OVERHEAD_ROW = (rf"\s+\d+ ms\s+{NUMBER}%\s+\d+ ms\s+{NUMBER}%\s+{{}}\s+\d+ ms\s+{NUMBER}%"
                rf"\s+{NUMBER} MiB\s+{NUMBER}%$")  # align_overhead's row of a configuration: wall, CPU, CI, best, memory
# One line of figures each benchmark prints (numbers where numbers belong: a NaN or an empty table does not match)
FIGURES = {
    "adamw_step.py": rf"^AdamW step, qwen3-tiny \(\d+ M parameters\), median of \d+: torch for-loop {NUMBER} s, "
                     rf"foreach {NUMBER} s, rla_lib\.native {NUMBER} s .*same bits: True$",
    # stock's row (the reference) and an aligned one's, its CI an interval of nonzero width (its quickest form runs
    # two pairs of rounds)
    "align_overhead.py": (rf"^stock{OVERHEAD_ROW.format('reference')}\n[a-z].*?"
                          + OVERHEAD_ROW.format(rf"\[(?!(?P<low>{NUMBER})%, (?P=low)%\]){NUMBER}%, {NUMBER}%\]")),
    "bf16_matmul.py": rf"^\s*\w+\s+\w+\s+\w+\s+float32(\s+{NUMBER}){{6}}$",
    "engine_start.py": rf"^alone\s+eager\s+start\s+{NUMBER} s\s+sample\s+{NUMBER} s\s+close\s+{NUMBER} s$",
    "exactness.py": rf"^\s*qwen3-tiny\s+eager\s+engine-aligned\s+\d+\s+\d+\s+{NUMBER}\s+{NUMBER}\s",
    "engine_settings.py": rf"^\s*chunked prefill\s+qwen3-tiny\s+compiled\s+\d+\s+.*\s+{NUMBER}\s",
    "fresh_clone_test.py": r"^dry run at [0-9a-f]{7,}: cloned and checked out; its README blocks match its tables\. "
                           r"A run would take `make setup`, then `make test`",
    "grpo_step.py": rf"^\s+total: {NUMBER} s\s+\(mean response length {NUMBER} tokens; \d+ real tokens per step",
    "scoring_memory.py": rf"^chunked / naive peak, grad=True: {NUMBER} \(target .*this run is below where it holds",
    "split_kv.py": rf"^\s*Qwen3-0\.6B\s+8\s+128\s+\d+\s+\d+\s+\d+\s+{NUMBER}(?:e-\d+)?\s",  # parts, draws, ...
}


def quickest_forms(path: Path) -> list[tuple[str, list[str], str]]:
    """(script, arguments, note) of each `# quickest` line of the benchmark's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [(script, shlex.split(args), note) for script, args, note in QUICKEST.findall(doc)]


def smoke_params() -> list:
    params = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        forms = quickest_forms(path)
        for k, (_, args, note) in enumerate(forms, 1):
            marks = ([pytest.mark.bench] + [pytest.mark.engine] * ("starts vLLM" in note)
                     + [pytest.mark.slow_bench] * ("make test-bench" in note))
            params.append(pytest.param(path, args, marks=marks, id=path.stem + (f"-{k}" if len(forms) > 1 else "")))
    return params


def tables_state() -> dict[str, tuple[int, int]]:
    """Every file under tables/ with its modification time and size (any write changes the time)."""
    return {str(p.relative_to(TABLES_DIR)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(TABLES_DIR.rglob("*")) if p.is_file()}


def test_every_benchmark_documents_a_quickest_form_that_saves_nothing():
    benchmarks = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert benchmarks and set(FIGURES) == set(benchmarks), "FIGURES names a line of figures for each benchmark"
    for path in BENCHMARKS.glob("*.py"):
        forms = quickest_forms(path)
        assert forms, f"{path.name}: no `.venv/bin/python benchmarks/{path.name} ...   # quickest` line in its docstring"
        for script, args, _ in forms:
            assert script == path.name, f"{path.name}'s docstring shows another script's quickest form: {script}"
            assert {"--no-save", "--dry-run"} & set(args), f"{path.name} {shlex.join(args)}: would write its tables"


@pytest.mark.parametrize("path, args", smoke_params())
def test_quickest_form_runs_prints_its_figures_and_writes_no_table(path, args, tmp_path):
    """Run as from a shell: this checkout's rla_lib, without the test processes' engine core binding (engine_start
    sets its own and refuses one it did not); what it caches goes to a folder of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env |= {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "RLA_RESULTS_DIR": str(tmp_path / "results")}
    before = tables_state()
    run = subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stderr[-3000:]}"
    assert re.search(FIGURES[path.name], run.stdout, re.M), f"no line of figures in its output:\n{run.stdout[-3000:]}"
    assert tables_state() == before, "it wrote under tables/"
