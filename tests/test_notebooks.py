"""Every notebook runs end to end under papermill (small parameters); a failing cell fails the test."""

import json
import os
from contextlib import contextmanager
from pathlib import Path

import papermill
import pandas as pd
import pytest

from rla_lib.paths import CHAPTERS, ROOT
from rla_lib.real_shape import REAL_SHAPE_DIR

NOTEBOOKS = sorted((ROOT / "notebooks").glob(CHAPTERS))
# Small settings so the whole suite fits CI; the defaults are for `make run-all`.
FAST = {
    "00_tour": dict(n_prompts=16, n_samples=2),
    "01_rounding_toy": dict(n_prompts=8, live_widget=False),
    "03a_where_vllm_rounds": dict(models=["qwen3-tiny"], hf_compiled=False),
    "03b_aligning_to_vllm": dict(models=["qwen3-tiny"], n_prompts=16, n_samples=2, n_boot=200, op_check_sequences=2),
    "02_kl_measurement": dict(models=["qwen3-tiny"], n_prompts=16, n_samples=2, n_boot=200),
    "04_shapley": dict(models=["qwen2-tiny"], modes=["compiled"], n_prompts=16, n_samples=2, n_boot=100),
    "05_rounding_clustering": dict(n_prompts=16),
    "06a_grpo_loop": dict(steps=3, prompts_per_step=4, group_size=4, eval_every=3,
                          configs=["default BF16", "engine schedule", "FP32 control"]),
    "06b_collapse_study": dict(),  # reads the shipped histories: nothing to make smaller
    # the uncapped level (02's measurement and captures, reused) and AVX2 (every x86 CPU this project runs on has it)
    "07_cpu_kinds": dict(models=["qwen3-tiny"], levels=["native", "avx2"], matmul_control=False,
                         n_prompts=16, n_samples=2, n_boot=200),
}


def test_every_notebook_has_a_parameters_cell_and_no_outputs():
    assert NOTEBOOKS, "no notebooks found"
    for nb_path in NOTEBOOKS:
        nb = json.loads(nb_path.read_text())
        ids = [c.get("id") for c in nb["cells"]]  # nbformat 4.5 requires them (papermill warns, later versions refuse)
        assert None not in ids and len(set(ids)) == len(ids), f"{nb_path.name}: every cell needs an id of its own"
        tags = [c.get("metadata", {}).get("tags", []) for c in nb["cells"]]
        assert sum("parameters" in t for t in tags) == 1, f"{nb_path.name}: needs exactly one cell tagged 'parameters'"
        for c in nb["cells"]:
            assert not c.get("outputs") and c.get("execution_count") is None, f"{nb_path.name}: stored with outputs"
        assert nb["metadata"]["kernelspec"]["name"] == "rla"
        assert nb_path.stem in FAST, f"{nb_path.name}: add its fast parameters to FAST"



def saved_figure_names() -> list[str]:
    """The names the notebooks save figures under (`save_figure(fig, "name")`), f-string fields as wildcards."""
    import re

    names = []
    for nb_path in NOTEBOOKS:
        code = "".join("".join(c["source"]) for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == "code")
        names += [re.sub(r"\\{[^}]*\\}", ".+", re.escape(m)) for m in re.findall(r"save_figure\([^,]+,\s*f?[\"']([^\"']+)[\"']", code)]
    return names


def test_every_committed_figure_is_one_a_notebook_writes():
    """No stray figure: each file in figures/ carries a name some notebook saves (a renamed or dropped figure's old
    file goes with it)."""
    import re

    names = saved_figure_names()
    assert len(names) >= len(NOTEBOOKS)
    stray = [f.name for f in sorted((ROOT / "figures").glob("*.*"))
             if not any(re.fullmatch(n, f.stem) for n in names)]
    assert not stray, f"figures no notebook writes (delete them, or the notebook that should write them): {stray}"

# Two test files, so `make test`'s two test processes run notebooks side by side (each file whole in one process): this
# one the notebooks that reuse another's results (03b and 06a read 03a's captures, 07's uncapped level 03b's measurement;
# 00, 02 and 03b share sampled responses and scored sides through mismatch.measure's cache), test_notebooks_apart.py
# the ones that reuse none.
APART = ("01_rounding_toy", "04_shapley", "05_rounding_clustering")


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory):
    """One results folder for all notebooks, as in `make run-all`: a measurement or capture one notebook made
    (cached, keyed by everything it depends on) is reused by the next, e.g. 07's uncapped level reuses 02's."""
    return tmp_path_factory.mktemp("results")


@pytest.mark.engine
@pytest.mark.parametrize("nb_path", [p for p in NOTEBOOKS if p.stem not in APART], ids=lambda p: p.stem)
def test_notebook_executes(nb_path, tmp_path, monkeypatch, shared_results):
    if nb_path.stem != "07_cpu_kinds":
        execute(nb_path, FAST[nb_path.stem], tmp_path, monkeypatch, shared_results)
        return
    with engine_starts_of_this_test(tmp_path, monkeypatch) as starts:
        execute(nb_path, FAST[nb_path.stem], tmp_path, monkeypatch, shared_results)
    engine_aligned_is_exact_at_every_level(pd.read_csv(tmp_path / "tables" / "07_isa_spread.csv"))
    # each level's engines make its graph captures as they measure (the eager one traced, the compiled one's output
    # code kept as it compiles): one start per mode and level at most (none where an earlier notebook's results are
    # reused), never one more for a capture alone
    for mode in ("eager", "compiled"):
        started = [start for start in starts if start["mode"] == mode]
        assert len(started) <= len(FAST[nb_path.stem]["levels"]), started


@contextmanager
def engine_starts_of_this_test(tmp_path, monkeypatch):
    """The engines started meanwhile, in any process (`rla_lib.engine.log_start`), as a list of their log lines, filled
    on exit; passed on to an outer RLA_ENGINE_LOG (benchmarks/fresh_clone_test.py's) as well."""
    outer, log, starts = os.environ.get("RLA_ENGINE_LOG"), tmp_path / "engine_starts.jsonl", []
    monkeypatch.setenv("RLA_ENGINE_LOG", str(log))
    try:
        yield starts
    finally:
        lines = log.read_text().splitlines(keepends=True) if log.exists() else []
        starts += [json.loads(line) for line in lines]
        if outer:
            monkeypatch.setenv("RLA_ENGINE_LOG", outer)
            with open(outer, "a") as out:
                out.writelines(lines)


def engine_aligned_is_exact_at_every_level(spread_table):
    """Notebook 07's table: at each level it ran (capped processes, vLLM's library of that level), both modes, the
    engine-aligned side scores every token bitwise the engine's (KL 0). AMX's kernel is reproduced op for op
    (tests/test_op_check.py) but its results depend on the engine's batch, so it is not held to this."""
    levels = spread_table[~spread_table["level"].str.endswith("+fp32 matmul") & (spread_table["engine attention"] != "vllm_cpu_amx")]
    assert set(levels["mode"]) == {"compiled", "eager"}, spread_table[["model", "mode", "level", "engine attention"]]
    inexact = levels[(levels["engine-aligned bitwise"] != 1) | (levels["engine-aligned"] != 0)]
    assert inexact.empty, inexact[["model", "mode", "level", "engine attention", "engine-aligned", "engine-aligned bitwise"]]


# The real-shape tier (`make test-real-shape`, not part of `make test`: about half an hour here): notebooks 00-06a on
# the Qwen3-0.6B-shaped checkpoint (28 layers, vocabulary 151,936; `make real-shape`), by parameters only.
REAL_SHAPE_MODEL = str(Path(os.environ.get("RLA_REAL_SHAPE_MODEL", REAL_SHAPE_DIR / "qwen3-0.6b-shape")).resolve())
SMALL = dict(n_samples=2, max_tokens=16)
REAL_SHAPE = {
    "00_tour": dict(model=REAL_SHAPE_MODEL, n_prompts=8, **SMALL),
    "01_rounding_toy": dict(model=REAL_SHAPE_MODEL, n_prompts=4, live_widget=False),
    "03a_where_vllm_rounds": dict(models=[REAL_SHAPE_MODEL], hf_compiled=False),
    # 64 prompts: the attention pick takes half, so the reported intervals rest on 32 (kl.FEW_PROMPTS: no fewer than 30)
    "03b_aligning_to_vllm": dict(models=[REAL_SHAPE_MODEL], n_prompts=64, n_boot=2000, op_check_sequences=2, **SMALL),
    "02_kl_measurement": dict(models=[REAL_SHAPE_MODEL], n_prompts=8, n_boot=200, **SMALL),
    "04_shapley": dict(models=[REAL_SHAPE_MODEL], modes=["eager"], n_prompts=8, n_boot=100, **SMALL),
    "05_rounding_clustering": dict(models=[REAL_SHAPE_MODEL], n_prompts=4),
    "06a_grpo_loop": dict(model=REAL_SHAPE_MODEL, steps=2, prompts_per_step=2, group_size=2, max_tokens=16, eval_every=2,
                          eval_prompts=8, configs=["default BF16", "engine schedule"]),
}


@pytest.mark.real_shape
@pytest.mark.parametrize("name", list(REAL_SHAPE))
def test_notebook_executes_at_real_shape(name, tmp_path, monkeypatch, shared_results):
    if not (Path(REAL_SHAPE_MODEL) / "config.json").exists():
        pytest.fail(f"{REAL_SHAPE_MODEL} is missing: `make test-real-shape` makes it first (or run `make real-shape`)")
    # `make test-real-shape` keeps the executed notebooks (RLA_EXECUTED_DIR), their times (rla_lib.report times) and
    # their result tables (RLA_REAL_SHAPE_TABLES: tables/real-shape/, which the README reads)
    executed = Path(os.environ.get("RLA_EXECUTED_DIR", tmp_path))
    tables = os.environ.get("RLA_REAL_SHAPE_TABLES")
    execute(ROOT / "notebooks" / f"{name}.ipynb", REAL_SHAPE[name], tmp_path, monkeypatch, shared_results, executed, tables)


KERNEL_START_TIMEOUT_S = 600  # a hang guard: papermill's 60 s is reached by a kernel start beside another test's engine


def execute(nb_path, parameters, tmp_path, monkeypatch, shared_results, executed_dir=None, tables_dir=None):
    """Run one notebook under papermill as `make run-all` does; check its figures, tables and quiet cells."""
    # the kernel inherits these: quick-run figures, results and tables stay out of the repository
    monkeypatch.setenv("RLA_FIGURES_DIR", str(tmp_path / "figures"))
    monkeypatch.setenv("RLA_RESULTS_DIR", str(shared_results))
    monkeypatch.setenv("RLA_TABLES_DIR", str(tables_dir or tmp_path / "tables"))
    monkeypatch.setenv("RLA_PROGRESS", "0")  # as make run-all: no frozen bars in the executed notebook
    executed = Path(executed_dir or tmp_path) / nb_path.name
    executed.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(nb_path), str(executed), parameters=parameters,
        kernel_name="rla", cwd=str(nb_path.parent), progress_bar=False,
        start_timeout=KERNEL_START_TIMEOUT_S,
    )
    assert list((tmp_path / "figures").glob("*.png")), f"{nb_path.name} saved no figure"
    stderr = [line for line in stderr_lines(executed) if line.strip()]
    assert not stderr, f"{nb_path.name}: log noise in the executed notebook's cells, e.g. {stderr[:5]}"
    if calls_save_table(nb_path):
        assert list(Path(tables_dir or tmp_path / "tables").glob(f"{nb_path.stem[:2]}_*.csv")), \
            f"{nb_path.name} calls save_table but wrote no table"


def stderr_lines(executed_path) -> list[str]:
    """What the cells wrote to stderr: engine logs and warnings land there, between a chapter's results."""
    cells = json.loads(executed_path.read_text())["cells"]
    return [line for c in cells for o in c.get("outputs", []) if o.get("name") == "stderr"
            for line in "".join(o.get("text", "")).splitlines()]


def calls_save_table(nb_path) -> bool:
    """Whether a code cell of the notebook calls `save_table` (the notebooks that write result tables)."""
    cells = json.loads(nb_path.read_text())["cells"]
    return any("save_table(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_every_figure_has_a_caption():
    """Each cell that saves a figure is followed by its caption: a markdown cell opening with "*Figure:", saying what
    the figure shows and what to look for."""
    missing = []
    for nb_path in NOTEBOOKS:
        cells = json.loads(nb_path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code" and "save_figure(" in "".join(cell["source"]):
                after = cells[i + 1] if i + 1 < len(cells) else None
                if after is None or after["cell_type"] != "markdown" or not "".join(after["source"]).startswith("*Figure: "):
                    missing.append(f"{nb_path.name}, cell {i}")
    assert not missing, f"figures without a caption cell right after them: {missing}"
