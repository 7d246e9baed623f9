"""Time `make test` (or `make run-all`) on a fresh clone of this repository, as CI runs it (set-up included).

    .venv/bin/python benchmarks/fresh_clone_test.py [--env OMP_NUM_THREADS=1] [--label name]
    .venv/bin/python benchmarks/fresh_clone_test.py --target run-all [--table run_all_time_before] [--commit REV]

Clones HEAD (or --commit) into a temporary folder, runs `make setup` and then `make test` there, and writes the times and
pytest's counts to tables/bench_fresh_clone.csv (one row per label; the README's "Time" line reads it).
Takes as long as the suite: about 10 minutes on 2 cores.

--target run-all: `make run-all` in the clone, with compile caches as cold as on a fresh machine (TMPDIR, where
inductor and the capped levels keep theirs, is a new empty folder; vLLM's own cache is in the clone). The clone's
per-notebook times (`rla_lib.report times`) are copied to tables/<--table>.csv, which the README's speed table reads.
"""

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd

from rla_lib.machine import cpu_generation, cpu_model
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the make commands")
    parser.add_argument("--label", default=None, help="row name (default: the --env settings or 'default')")
    parser.add_argument("--target", choices=["test", "run-all"], default="test")
    parser.add_argument("--table", default="run_all_time", help="--target run-all: the table the times go to")
    parser.add_argument("--commit", default="HEAD", help="the commit to check out in the clone (e.g. the one before a "
                        "change, for a before/after pair measured on one machine)")
    args = parser.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLA_", "VIRTUAL_ENV"))} | extra
    label = args.label or (",".join(args.env) or "default")
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="rla-fresh-") as tmp:
        subprocess.run(["git", "clone", "--quiet", str(ROOT), tmp], check=True)
        subprocess.run(["git", "checkout", "--quiet", commit], cwd=tmp, check=True)
        setup_s, out, rc = timed(["make", "setup"], tmp, env)
        if rc:
            raise SystemExit(f"make setup failed:\n{out[-3000:]}")
        if args.target == "run-all":
            run_all(Path(tmp), env, setup_s, commit, args.table)
            return
        test_s, out, rc = timed(["make", "test"], tmp, env)
    log = atomic_write(RESULTS_DIR / f"fresh_clone_{label}.log", lambda tmp: tmp.write_text(out))
    print(out[-1500:])
    print("\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), f"\n(full log: {log})")
    counts = pytest_counts(out)
    row = dict(label=label, commit=commit, machine=f"{cpu_model()} ({cpu_generation()})", setup_s=round(setup_s),
               test_s=round(test_s), total_s=round(setup_s + test_s),
               passed=counts.get("passed", 0), failed=counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
               skipped=counts.get("skipped", 0), exit_code=rc)
    print(row)
    path = TABLES_DIR / "bench_fresh_clone.csv"
    old = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=list(row))
    table = pd.concat([old[old["label"] != label], pd.DataFrame([row])], ignore_index=True)
    save_table(table.set_index("label"), "bench_fresh_clone", dict(labels=list(table["label"])))
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
