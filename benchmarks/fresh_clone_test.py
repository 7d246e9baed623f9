"""Time `make test` (or `make run-all`) on a fresh clone of this repository, as CI runs it (set-up included).

    .venv/bin/python benchmarks/fresh_clone_test.py [--env OMP_NUM_THREADS=1] [--label name]
    .venv/bin/python benchmarks/fresh_clone_test.py --target run-all [--table run_all_time_before] [--commit REV]
    .venv/bin/python benchmarks/fresh_clone_test.py --dry-run   # quickest

Clones HEAD (or --commit) into a temporary folder, runs `make setup` and then `make test` there, and writes the times and
pytest's counts to tables/bench_fresh_clone.csv (one row per label; the README's "Time" line reads it).
Takes as long as the suite: about 10 minutes on 2 cores.

--repeat N [--load]: `make test` N times in one fresh clone (set-up once), optionally beside a CPU hog pinned to one
core for the whole run (`--load`: what a busy CI machine does to the suite's timing assumptions). Each test's outcome
in each run (pytest's JUnit XML) goes to tables/bench_suite_repeats.csv, one column group per condition
("plain" or "loaded", at the machine's own level or "<level> (capped)" with `--env ISA=<level>`); every run's time
goes to tables/bench_fresh_clone.csv as "<condition> #k", k counting on from the runs the table holds, and each test's
seconds to tables/bench_test_times.csv (one column per run: where the suite's time goes, before and after a change; the
next `make test` runs the slowest files first from it). A test that failed once is a flaky test to fix at its root.

--target run-all: `make run-all` in the clone, with compile caches as cold as on a fresh machine (TMPDIR, where
inductor and the capped levels keep theirs, is a new empty folder; vLLM's own cache is in the clone). The clone's
per-notebook times (`rla_lib.report times`) are copied to tables/<--table>.csv, which the README's speed table reads.

--dry-run: clone and check out as a run would, refuse a stale README as `make test` would (with this environment's
Python, the clone's code), and print what the run would do and which tables it would write; no set-up, no suite,
nothing written (a check that the script works: the smoke test cannot run the whole suite inside the suite).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from rla_lib.machine import cpu_generation, cpu_model, isa_levels
from rla_lib.paths import RESULTS_DIR, ROOT, atomic_write
from rla_lib.report import TABLES_DIR, notebook_times, save_table


def timed(cmd, cwd, env) -> tuple[float, str, int]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, proc.stdout + proc.stderr, proc.returncode


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing counts ("265 passed, 2 skipped in 728.28s", with or without the ==== rule)."""
    summaries = [{k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
                 for line in re.findall(r"^=*\s*(\d+ (?:passed|failed|error).*?) in [\d.]+s", output, re.M)]
    return max(summaries, key=lambda c: sum(c.values()), default={})  # the suite's, not the smaller align runs after it


def test_name(case: ET.Element) -> str:
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"


def test_outcomes(junit_xml: Path) -> dict[str, str]:
    """Each test's outcome in one run from pytest's JUnit XML: passed, failed, skipped or xfailed."""
    outcomes = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = test_name(case)
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif skipped is not None:
            outcomes[name] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def save_test_times(condition: str, label: str, junit_xml: Path, commit: str) -> pd.DataFrame:
    """Each test's seconds in one run (set-up, call and tear-down, as JUnit XML gives them) into
    tables/bench_test_times.csv, one column per run label, so a change's before and after sit side by side; each file's
    sum printed. The suite runs files whole on two processes (--dist loadfile), so the slowest files set its time."""
    times = {test_name(c): float(c.get("time", 0)) for c in ET.parse(junit_xml).getroot().iter("testcase")}
    new = pd.Series(times, name=label).rename_axis("test").to_frame()
    path = TABLES_DIR / "bench_test_times.csv"
    if path.exists():
        old = pd.read_csv(path, index_col="test").drop(columns=[label], errors="ignore")
        new = old.join(new, how="outer")
    new = new.round(2)
    save_table(new, "bench_test_times", dict(labels=list(new.columns), condition=condition), commit=commit)
    by_file = new[label].groupby(new.index.str.split("::").str[0]).sum().sort_values(ascending=False)
    print(f"{label}: slowest files (s):", by_file.head(12).round(0).to_dict())
    return new


def save_engine_starts(label: str, log: Path, times: pd.Series, commit: str) -> None:
    """The run's engine starts (RLA_ENGINE_LOG: one line each) per test, beside the test's seconds, into
    tables/bench_engine_starts.csv: how much of the suite is starting engines, and in which tests (the newest run)."""
    starts = pd.read_json(log, lines=True) if log.exists() and log.stat().st_size else pd.DataFrame(
        columns=["test", "phase", "model", "mode", "in_process", "seconds"])
    kinds = starts.assign(kind=starts["mode"] + starts["in_process"].map({True: " in process", False: ""}))
    table = kinds.groupby("test").agg(starts=("seconds", "size"), start_seconds=("seconds", "sum"),
                                      engines=("kind", lambda k: ", ".join(f"{n} {kind}" for kind, n in k.value_counts().items())))
    table["test_seconds"] = times.reindex(table.index)
    table = table.sort_values("start_seconds", ascending=False).round(1)
    save_table(table, "bench_engine_starts", dict(label=label), commit=commit)
    total = times.sum()
    print(f"{label}: {len(starts)} engine starts in {table.index.size} tests, {starts['seconds'].sum():.0f} s of "
          f"{total:.0f} s of test time ({starts['seconds'].sum() / total:.0%}); slowest starts by test (s):",
          table["start_seconds"].head(10).to_dict())


@contextmanager
def cpu_hog(load: bool):
    """A busy loop pinned to core 0 for the duration (nothing if not `load`)."""
    if not load:
        yield
        return
    # it stops by itself when this process dies (killed, so no `finally` runs): no busy core is left behind
    # (this process's id given, not read by the hog: it may start only after this process is gone)
    busy_while_parent_lives = f"import os\nwhile os.getppid() == {os.getpid()}:\n    sum(range(100_000))"
    hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", busy_while_parent_lives])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def save_repeats(condition: str, runs: list[dict[str, str]], commit: str) -> pd.DataFrame:
    """Per test, how many runs under `condition` it passed (and failed), added to the counts of earlier invocations
    in tables/bench_suite_repeats.csv (a condition's runs can come from several sessions; the commits column lists
    each run's commit), beside the other conditions' columns."""
    tests = sorted({t for r in runs for t in r})
    count = lambda t, outcome: sum(r.get(t) == outcome for r in runs)
    columns = {"passed": ("passed",), "failed": ("failed",), "skipped or xfailed": ("skipped", "xfailed")}
    new = pd.DataFrame({"test": tests, f"{condition}: runs": len(runs)} |
                       {f"{condition}: {name}": [sum(count(t, o) for o in outcomes) for t in tests]
                        for name, outcomes in columns.items()})
    commits = [commit] * len(runs)
    path = TABLES_DIR / "bench_suite_repeats.csv"
    seen = [condition]
    if path.exists():
        old = pd.read_csv(path)
        seen = [c.split(": ")[0] for c in old.columns if c != "test"] + seen
        mine = [c for c in old.columns if c.startswith(f"{condition}: ")]
        if mine:
            earlier = old[["test"] + mine].dropna(subset=[f"{condition}: runs"])
            commits = str(earlier[f"{condition}: commit"].iloc[0]).split() + commits
            merged = earlier.merge(new, on="test", how="outer", suffixes=("", " new"))
            counts = [c for c in merged.columns if c.split(": ")[-1].removesuffix(" new") in ["runs", *columns]]
            merged[counts] = merged[counts].fillna(0)
            for name in ["runs", *columns]:
                merged[f"{condition}: {name}"] = merged[f"{condition}: {name}"] + merged[f"{condition}: {name} new"]
            new = merged[["test"] + [f"{condition}: {n}" for n in ["runs", *columns]]]
        old = old[[c for c in old.columns if c not in mine]]
        new = old.merge(new, on="test", how="outer")
    new[f"{condition}: commit"] = " ".join(commits)
    new.loc[new[f"{condition}: runs"].isna(), f"{condition}: commit"] = None
    counts = [c for c in new.columns if c.split(": ")[-1] in ["runs", *columns]]
    new[counts] = new[counts].astype("Int64")
    conditions = list(dict.fromkeys(seen))  # the table's order, a new condition last
    new = new[["test"] + [f"{c}: {n}" for c in conditions for n in ["commit", "runs", *columns]]]
    new = new.set_index("test").sort_index()
    save_table(new, "bench_suite_repeats", dict(conditions=sorted({c.split(": ")[0] for c in new.columns})), commit=commit)
    return new


def repeat_tests(clone: Path, env: dict, setup_s: float, commit: str, repeat: int, load: bool) -> int:
    """`make test` `repeat` times in the clone (beside a CPU hog if `load`); per-test outcomes and each run's time saved."""
    level = f"{env['ISA']} (capped)" if env.get("ISA") else isa_levels()[0]  # a real AVX2-only CPU is not a capped one
    condition = f"{'loaded' if load else 'plain'}, {level}"
    runs, exit_codes = [], []
    first = earlier_runs(condition) + 1
    for k in range(first, first + repeat):
        junit, starts = clone / f".junit-{k}.xml", clone / f".engine-starts-{k}.jsonl"
        with cpu_hog(load):
            test_s, out, rc = timed(["make", "test", f"PYTEST_ARGS=--junitxml={junit}"], clone,
                                    env | {"RLA_ENGINE_LOG": str(starts)})
        atomic_write(RESULTS_DIR / f"fresh_clone_{slug_condition(condition)}_{k}.log", lambda tmp: tmp.write_text(out))
        runs.append(test_outcomes(junit) if junit.exists() else {})
        if junit.exists():
            times = save_test_times(condition, f"{condition} #{k} ({commit})", junit, commit)
            save_engine_starts(f"{condition} #{k} ({commit})", starts, times[f"{condition} #{k} ({commit})"], commit)
        exit_codes.append(rc)
        failed = sorted(t for t, o in runs[-1].items() if o == "failed")
        print(f"{condition} #{k}: exit {rc}, {test_s / 60:.1f} min, {len(runs[-1])} tests, failed: {failed or 'none'}", flush=True)
        record_run(f"{condition} #{k}", commit, setup_s if k == first else 0, test_s, out, rc)  # set-up once
    table = save_repeats(condition, runs, commit)
    flaky = table[table[f"{condition}: failed"] > 0]
    print(f"{condition}: {repeat} run(s) now; over the table's {int(table[f'{condition}: runs'].max())} runs of this "
          f"condition, tests that failed at least once: {list(flaky.index) or 'none'}")
    return max(exit_codes)


def earlier_runs(condition: str) -> int:
    """How many runs under `condition` tables/bench_suite_repeats.csv counts already (a new run's number follows)."""
    path = TABLES_DIR / "bench_suite_repeats.csv"
    column = f"{condition}: runs"
    runs = pd.read_csv(path).get(column) if path.exists() else None
    return 0 if runs is None or runs.isna().all() else int(runs.max())


def slug_condition(condition: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", condition.lower()).strip("_")


def record_run(label: str, commit: str, setup_s: float, test_s: float, out: str, rc: int) -> dict:
    """One `make test` run's times and pytest's counts as a row of tables/bench_fresh_clone.csv (by label)."""
    counts = pytest_counts(out)
    row = dict(label=label, commit=commit, machine=f"{cpu_model()} ({cpu_generation()})", setup_s=round(setup_s),
               test_s=round(test_s), total_s=round(setup_s + test_s),
               passed=counts.get("passed", 0), failed=counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
               skipped=counts.get("skipped", 0), exit_code=rc)
    path = TABLES_DIR / "bench_fresh_clone.csv"
    old = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=list(row))
    table = pd.concat([old[old["label"] != label], pd.DataFrame([row])], ignore_index=True)
    save_table(table.set_index("label"), "bench_fresh_clone", dict(labels=list(table["label"])), commit=commit)
    return row


def run_all(clone: Path, env: dict, setup_s: float, commit: str, table: str) -> None:
    """`make run-all` in the clone with cold compile caches; its notebook times copied to tables/<table>.csv."""
    cold = clone / ".cold-tmp"
    cold.mkdir()
    run_s, out, rc = timed(["make", "run-all"], clone, env | {"TMPDIR": str(cold)})
    log = atomic_write(RESULTS_DIR / f"fresh_clone_run_all_{commit}.log", lambda tmp: tmp.write_text(out))
    if rc:
        raise SystemExit(f"make run-all failed (log: {log}):\n{out[-3000:]}")
    kept = RESULTS_DIR / f"fresh_clone_run_all_{commit}_tables"  # the clone's result tables, to compare with others
    shutil.copytree(clone / "tables", kept, dirs_exist_ok=True)
    times = notebook_times(clone / "notebooks" / "executed")
    print(times.to_string(index=False), f"\nset-up {setup_s / 60:.1f} min; make run-all {run_s / 60:.1f} min (log: {log}; tables: {kept})")
    save_table(times, table, dict(directory="notebooks/executed of a fresh clone", note=(
        f"fresh clone of {commit}, cold compile caches (benchmarks/fresh_clone_test.py --target run-all); "
        f"set-up {setup_s:.0f} s, make run-all {run_s:.0f} s in all")), commit=commit)


def refuse_stale_readme(clone: Path, commit: str, python: str | None = None) -> None:
    """A commit whose README blocks disagree with its own tables fails test_readme for that alone (a benchmark's
    tables committed before `make readme`): say so before a run's half hour, not in its failure count. `python`:
    the clone's environment by default; the clone's code either way."""
    check = subprocess.run([python or str(clone / ".venv" / "bin" / "python"), "-m", "tools.readme", "--check"],
                           cwd=clone, env=os.environ | {"PYTHONPATH": str(clone)}, capture_output=True, text=True)
    if check.returncode:
        raise SystemExit(f"{commit}: {check.stdout.strip() or check.stderr.strip()[-500:]}. Run `make readme`, commit, "
                         "and start this again.")


def planned(args, label: str, commit: str) -> str:
    """What a run with these arguments would do and write (--dry-run)."""
    if args.target == "run-all":
        runs, tables = "`make run-all` with cold compile caches", f"tables/{args.table}.csv"
    elif args.repeat:
        runs = f"`make test` {args.repeat} times" + (" beside a CPU hog on core 0" if args.load else "")
        tables = "tables/bench_fresh_clone.csv, bench_suite_repeats.csv, bench_test_times.csv and bench_engine_starts.csv"
    else:
        runs, tables = "`make test`", f"tables/bench_fresh_clone.csv (row {label!r})"
    checked = "; its README blocks match its tables" if args.target == "test" else ""
    env = f" with {' '.join(args.env)}" if args.env else ""
    return (f"dry run at {commit}: cloned and checked out{checked}. A run would take `make setup`, then {runs}{env}, "
            f"in the clone, and write {tables}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the make commands")
    parser.add_argument("--label", default=None, help="row name (default: the --env settings or 'default')")
    parser.add_argument("--target", choices=["test", "run-all"], default="test")
    parser.add_argument("--table", default="run_all_time", help="--target run-all: the table the times go to")
    parser.add_argument("--commit", default="HEAD", help="the commit to check out in the clone (e.g. the one before a "
                        "change, for a before/after pair measured on one machine)")
    parser.add_argument("--repeat", type=int, default=0, help="run `make test` this many times in the clone and count "
                        "each test's outcomes (tables/bench_suite_repeats.csv)")
    parser.add_argument("--load", action="store_true", help="with --repeat: a CPU hog on core 0 for the whole run")
    parser.add_argument("--dry-run", action="store_true", help="clone, check and say what a run would do; run nothing")
    args = parser.parse_args()
    if args.load and not args.repeat:
        parser.error("--load goes with --repeat N")
    if args.repeat and args.target != "test":
        parser.error("--repeat runs `make test`: leave out --target run-all")
    extra = dict(kv.split("=", 1) for kv in args.env)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLA_", "VIRTUAL_ENV"))} | extra
    label = args.label or (",".join(args.env) or "default")
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="rla-fresh-") as tmp:
        subprocess.run(["git", "clone", "--quiet", str(ROOT), tmp], check=True)
        subprocess.run(["git", "checkout", "--quiet", commit], cwd=tmp, check=True)
        if args.dry_run:
            if args.target == "test":
                refuse_stale_readme(Path(tmp), commit, python=sys.executable)
            print(planned(args, label, commit))
            return
        setup_s, out, rc = timed(["make", "setup"], tmp, env)
        if rc:
            raise SystemExit(f"make setup failed:\n{out[-3000:]}")
        if args.target == "test":
            refuse_stale_readme(Path(tmp), commit)
        if args.target == "run-all":
            run_all(Path(tmp), env, setup_s, commit, args.table)
            return
        if args.repeat:
            raise SystemExit(repeat_tests(Path(tmp), env, setup_s, commit, args.repeat, args.load))
        test_s, out, rc = timed(["make", "test"], tmp, env)
    log = atomic_write(RESULTS_DIR / f"fresh_clone_{label}.log", lambda tmp: tmp.write_text(out))
    print(out[-1500:])
    print("\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), f"\n(full log: {log})")
    print(record_run(label, commit, setup_s, test_s, out, rc))
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
