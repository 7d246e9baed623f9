"""The README's speed blocks (the turnaround issue's targets), rendered from the benchmarks' tables by `tools.readme`:
each target before and after, here and with this CPU capped to AVX2, and the verdict words computed from them."""

from __future__ import annotations

import re

import pandas as pd

from rla_lib.report import TABLES_DIR, load_table, md_table, pct, source, wall_seconds


def _on(row) -> str:
    """", on <machine>" for a fresh-clone row: the machine it recorded (rows from before 2026-12-01 did not)."""
    machine = row.get("machine")
    return f", on {machine}" if isinstance(machine, str) else ", machine not recorded"


def block_suite_time() -> str:
    t, meta = load_table("bench_fresh_clone")
    def times(r) -> str:  # a run whose set-up time was lost (a numbering slip in one run): its tests' time only
        if pd.isna(r["setup_s"]):
            return f"{r['test_s'] / 60:.1f} min of tests (set-up not recorded"
        return f"{r['total_s'] / 60:.1f} min ({r['setup_s'] / 60:.1f} set-up + {r['test_s'] / 60:.1f} tests"

    parts = [f"{r['label']}: {times(r)}; {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped; commit "
             f"{r['commit']}{_on(r)})" for _, r in t.iterrows()]
    return "`make test` on a fresh clone: " + "; ".join(parts) + ".\n\n" + engine_starts() + source("bench_fresh_clone", meta)


def engine_starts() -> str:
    """How much of the newest timed run went on starting engines (`bench_engine_starts`, RLA_ENGINE_LOG), where recorded."""
    try:
        starts, meta = load_table("bench_engine_starts")
        times, _ = load_table("bench_test_times")
    except FileNotFoundError:
        return ""
    label = meta["params"]["label"]
    total, spent = times[label].sum(), starts["start_seconds"].sum()
    slowest = starts.iloc[0]
    return (f"In {label}, {int(starts['starts'].sum())} engine starts took {spent:.0f} s of the {total:.0f} s the tests "
            f"took together ({spent / total:.0%}); the slowest, {slowest['starts']} in `{slowest['test']}` "
            f"({slowest['engines']}), {slowest['start_seconds']:.0f} s.\n\n" + source("bench_engine_starts", meta) + "\n\n")


def _passed(runs):
    """Whether a fresh-clone run (a row, or each row of a table) passed: a failing run's time is no result."""
    return (runs["failed"] == 0) & (runs["exit_code"] == 0)


def _spread(runs, limit: float, last: int = 5) -> str:
    """How the latest passing runs on the newest run's machine spread (this VM's speed varies from run to run, by up
    to 60% in the table, so one run is not the machine's figure)."""
    capped = runs["label"].str.contains("ISA=|\\(capped\\)", regex=True)  # slower than the machine itself
    runs = runs[(runs["machine"] == runs["machine"].iloc[-1]) & _passed(runs) & ~capped]
    minutes = runs["test_s"].tail(last) / 60
    if len(minutes) < 2:
        return ""
    return (f"; its last {len(minutes)} passing runs there: {minutes.min():.1f}-{minutes.max():.1f} min, "
            f"{(minutes <= limit).sum()} of {len(minutes)} within {limit:g} min")


def _machine_short(meta: dict) -> str:
    m = meta.get("machine", {})
    generation = m.get("cpu_generation") or "generation not recorded"  # machines of one kind differ by CPU generation
    return (f"{m.get('cpu', '?')} ({generation}), {m.get('isa_level') or m.get('cpu_capability', '?')}, "
            f"{m.get('cpu_threads', '?')} threads")


def _cpu(meta: dict) -> str:
    """A table's CPU as fresh-clone rows name it: "<model name> (family F model M)"."""
    m = meta.get("machine", {})
    return f"{m.get('cpu', '?')} ({m.get('cpu_generation')})"


def _machines(before_meta: dict | None, meta: dict) -> str:
    """The machine of the 'after' figure, and that of the 'before' one where it was another (or is not known)."""
    after = _machine_short(meta)
    if before_meta is None or _machine_short(before_meta) == after:
        return after
    return f"before: {_machine_short(before_meta)}; after: {after}"


CAPPED = "avx2"  # the level the speed table also reports, capped on this CPU (`make ... ISA=avx2`)


def _optional_table(name: str):
    """load_table(name), or None where that table has not been written."""
    return load_table(name) if (TABLES_DIR / f"{name}.csv").exists() else None


def _capped_table(name: str):
    """The `name` table a run capped to `CAPPED` wrote (`<name>_avx2`), or None."""
    return _optional_table(f"{name}_{CAPPED}")


def _without_ci(here, capped=None) -> dict:
    """A speed check's values for a figure without a CI (its upper end is itself); None where not measured."""
    return {where: (value, value) for where, value in [("here", here), (CAPPED, capped)] if value is not None}


def _speed_overhead(add, checks: list, controls: dict, rows_meta: dict | None) -> None:
    """The speed table's alignment-overhead rows (block_speed): the targets' run, its A/A control, the capped run. A
    run on another CPU than the table's other rows (`rows_meta`) names its CPU in the verdict."""
    if not (TABLES_DIR / "bench_align_overhead.csv").exists():
        return
    # a run of the target configurations alone (more rounds in the same time) where there is one
    name = "bench_align_overhead_targets" if (TABLES_DIR / "bench_align_overhead_targets.csv").exists() else "bench_align_overhead"
    after, meta = load_table(name)
    before, _ = load_table("bench_align_overhead_before")
    capped = _capped_table("bench_align_overhead_targets") or _capped_table("bench_align_overhead")
    pick = lambda t, config: t[(t["shape"] == "large") & (t["config"] == config)]
    engine_before = load_table("bench_align_overhead_engine_before")  # the exact kernels as loops of torch ops

    def overhead(t, config) -> str:
        a, control = pick(t, config).iloc[0], pick(t, "stock (A/A)")
        text = f"{pct(a.get('cpu_gmean_ratio', a['cpu_ratio']) - 1, 1)}"
        if "cpu_ratio_ci_low" in a:
            text += f" [{pct(a['cpu_ratio_ci_low'] - 1, 1)}, {pct(a['cpu_ratio_ci_high'] - 1, 1)}]"
        if len(control) and "cpu_ratio_ci_low" in control:  # the design's own bias: stock against itself
            c = control.iloc[0]
            text += (f"; A/A control {pct(c['cpu_gmean_ratio'] - 1, 1)} [{pct(c['cpu_ratio_ci_low'] - 1, 1)}, "
                     f"{pct(c['cpu_ratio_ci_high'] - 1, 1)}]")
        return text

    for where, t in [("here", after)] + ([(CAPPED, capped[0])] if capped else []):
        control = pick(t, "stock (A/A)")
        if len(control) and "cpu_ratio_ci_low" in control and not (
                control.iloc[0]["cpu_ratio_ci_low"] <= 1 <= control.iloc[0]["cpu_ratio_ci_high"]):
            controls[where] = control.iloc[0]
    for config, target in [("all 3 fused", "all three regions `fused=True` <= +3%"),
                           ("engine schedule fused", "engine-aligned (schedule + attention) `fused=True` <= +5%")]:
        if pick(after, config).empty:
            continue
        a, b = pick(after, config).iloc[0], pick(before, config)
        if len(b):
            was = f"{pct(b.iloc[0]['cpu_ratio'] - 1, 1)} (median ratio)"
        else:  # the engine-aligned configuration's: its exact kernels as loops of torch ops
            b = pick(engine_before[0], config)
            was = f"{pct(b.iloc[0]['cpu_gmean_ratio'] - 1, 1)} ({engine_before[1]['commit']})" if len(b) else "(new)"
        rounds = meta.get("params", {}).get("rounds")
        add(target, f"forward+backward CPU time vs stock, {a['model']}, {a['tokens']} tokens, {rounds} rounds",
            "benchmarks/align_overhead.py" + (" --table bench_align_overhead_targets ..." if name.endswith("targets") else ""),
            was, overhead(after, config), meta,
            capped=overhead(capped[0], config) if capped and not pick(capped[0], config).empty else "(not measured)")
        if "cpu_ratio_ci_high" in a:
            ends = lambda r: (100 * (r["cpu_gmean_ratio"] - 1), 100 * (r["cpu_ratio_ci_high"] - 1))
            has_capped = capped and not pick(capped[0], config).empty
            elsewhere = f" (on {_cpu(meta)})" if rows_meta and _cpu(meta) != _cpu(rows_meta) else ""
            checks.append((f"`{config}` overhead{elsewhere}", 3 if "all 3" in config else 5, "%", {"here": ends(a)}
                           | ({CAPPED: ends(pick(capped[0], config).iloc[0])} if has_capped else {})))


def _make_test_row(add, checks: list, rows_meta: dict | None) -> None:
    """The `make test` target's row: the latest plain run on each CPU (runs beside a CPU hog test the suite, not its
    speed), capped runs likewise; the verdict goes by the run on the speed table's own CPU (`rows_meta`)."""
    t, meta = load_table("bench_fresh_clone")
    labels = t["label"].astype(str)
    t = t[~labels.str.startswith("loaded")]
    labels = t["label"].astype(str)
    # at the AVX2 level: capped on a newer CPU ("ISA=avx2 ...", "..., avx2 (capped) #k") or an AVX2-only CPU's own
    is_capped = (labels.str.startswith(f"ISA={CAPPED}") | labels.str.contains(f", {CAPPED} #", regex=False) |
                 labels.str.contains(f", {CAPPED} (capped) #", regex=False))
    uncapped, capped_runs = t[~is_capped], t[is_capped]
    first = uncapped.iloc[0]
    counts = lambda r: f"{r['test_s'] / 60:.1f} min ({r['commit']}), {r['passed']} passed, {r['failed']} failed"
    # a clone's first run (it has the set-up time): a repeat in the same clone starts with warm compile caches
    latest_cold = lambda runs: runs[runs["setup_s"] > 0].iloc[-1] if (runs["setup_s"] > 0).any() else runs.iloc[-1]

    def per_cpu(runs, spread: bool) -> str:
        """The latest cold run on each CPU the suite ran on, newest first."""
        groups = sorted(runs.groupby("machine", sort=False), key=lambda kv: -kv[1].index.max())
        return "; ".join(counts(latest_cold(g)) + _on(latest_cold(g)) + (_spread(g, 12) if spread else "")
                         for _, g in groups)

    def on_home(runs):
        """The latest cold run on the speed table's own CPU (its verdict's "this CPU"), else the latest cold run."""
        home = runs[runs["machine"] == _cpu(rows_meta)] if rows_meta else runs.iloc[0:0]
        return latest_cold(home) if len(home) else latest_cold(runs) if len(runs) else None

    last, capped_row = on_home(uncapped), on_home(capped_runs)
    add("`make test` <= 12 min", "whole suite on a fresh clone, after set-up", ".venv/bin/python benchmarks/fresh_clone_test.py",
        f"{first['test_s'] / 60:.1f} min ({first['commit']}{_on(first)})", per_cpu(uncapped, True), rows_meta or meta,
        capped=per_cpu(capped_runs, False) if len(capped_runs) else "(not measured)")
    minutes_if_passed = lambda r: r["test_s"] / 60 if r is not None and _passed(r) else None
    checks.append(("`make test`", 12, " min", _without_ci(minutes_if_passed(last), minutes_if_passed(capped_row))))


RUN_ALL_LIMIT = 12  # minutes, on every CPU kind (the speed issue's target; 10 before it)
# Every GRPO step's target (the tiny model's, the real shape's, the study's: block_study_step), as a multiple of its kernel
# bound: the engine's rollout plus the kernels the training bits depend on (GEMMs, attention, optimizer) as they ran. Set
# against that bound, not the linear-arithmetic floor: meeting the floor would need other kernels, and so other bits.
KERNEL_BOUND_LIMIT = 1.15


def _times_bound(t) -> float | None:
    """A GRPO-step table's step time as a multiple of its kernel bound (None for tables written before it was timed)."""
    return t["total"].iloc[0] / t["kernel_floor"].iloc[0] if t is not None and "kernel_floor" in t else None


def _step_text(r) -> str:
    """A GRPO-step table row in words: its parts, its floor and, where timed, the kernels its bits depend on."""
    text = (f"{r['total']:.2f} s ({r['rollout']:.2f} rollout + {r['score']:.2f} scoring + {r['update']:.2f} update + "
            f"{r['sync']:.2f} weight push)")
    if r.get("floor") is not None:  # tables written before the floor was measured have none
        text += (f"; floor {r['floor']:.2f} s = the engine's rollout + {r['training_floor']:.2f} s of linear-layer "
                 f"arithmetic on the real tokens at {r['gemm_gflops']:.0f} GFLOP/s")
    if r.get("kernel_floor") is not None:  # tables written before the kernels were timed have none
        text += (f"; the kernels the training bits depend on, as they ran: GEMMs {r['gemm_s']:.2f} s, attention "
                 f"{r['attention_s']:.2f} s, optimizer {r['optimizer_s']:.2f} s, with the rollout "
                 f"{r['kernel_floor']:.2f} s = {r['kernel_floor'] / r['floor']:.2f}x the floor")
    return text


def block_speed() -> str:
    """Issue 19's targets, each before and after, from the tables the benchmarks and `make run-all` wrote; and after,
    with this CPU capped to AVX2 (no BF16 instructions, the issue's machine kind), where that run's table is there."""
    rows, checks = [], []  # checks: (target, limit, unit, {"here" | CAPPED: (value, upper end of its CI)})
    controls = {}  # where the alignment-overhead benchmark's A/A control (stock against itself) excludes zero

    def add(target, what, command, before, after, meta, before_meta=None, capped="(not measured)"):
        rows.append([target, what, before, after, capped, f"`{command}`", _machines(before_meta, meta)])

    minutes = lambda t: f"{wall_seconds(t) / 60:.1f} min"
    rows_meta = None  # the CPU of the table's other rows ("this CPU" of the verdict)
    if (TABLES_DIR / "run_all_time.csv").exists():
        after, meta = load_table("run_all_time")
        rows_meta = meta
        before, before_meta = load_table("run_all_time_before")
        capped = _capped_table("run_all_time")
        add(f"`make run-all` <= {RUN_ALL_LIMIT} min", "all notebooks after set-up (first start to last end), fresh clone, cold compile caches",
            ".venv/bin/python benchmarks/fresh_clone_test.py --target run-all", f"{minutes(before)} ({before_meta['commit']})",
            f"{minutes(after)} ({meta['commit']})", meta, before_meta,
            f"{minutes(capped[0])} ({capped[1]['commit']})" if capped else "(not measured)")
        checks.append(("`make run-all`", RUN_ALL_LIMIT, " min", _without_ci(wall_seconds(after) / 60,
                                                                  wall_seconds(capped[0]) / 60 if capped else None)))
    if (TABLES_DIR / "bench_fresh_clone.csv").exists():
        _make_test_row(add, checks, rows_meta)

    bound = f"<= {KERNEL_BOUND_LIMIT:g}x its kernel bound"
    if (TABLES_DIR / "bench_grpo_step_bf16.csv").exists():
        after, meta = load_table("bench_grpo_step_bf16")
        before, before_meta = load_table("bench_grpo_step_bf16_before")
        capped = _capped_table("bench_grpo_step_bf16")
        add(f"GRPO step {bound}", "default BF16, 16 prompts x 8 samples, median",
            "benchmarks/grpo_step.py", _step_text(before.iloc[0]), _step_text(after.iloc[0]), meta, before_meta,
            _step_text(capped[0].iloc[0]) if capped else "(not measured)")
        checks.append(("the GRPO step", KERNEL_BOUND_LIMIT, "x its kernel bound", _without_ci(
            _times_bound(after), _times_bound(capped[0] if capped else None))))
    real_shape = "bench_grpo_step_bf16_qwen3-0.6b-shape"
    if (TABLES_DIR / f"{real_shape}.csv").exists():
        t, meta = load_table(real_shape)
        p = meta.get("params", {})
        def with_memory(table, meta) -> str:
            # random weights earn no task reward: all-0 advantages and gradients, not a step that learns
            rewards = "coin-flip rewards" if meta.get("params", {}).get("rewards") == "coin" else "every gradient 0"
            row = table.iloc[0]
            mapped = f", {row['pushed_gb']:.1f} GB of it the mapped weights' file" if "pushed_gb" in row else ""
            return f"{_step_text(row)}; peak {row['peak_gb']:.1f} GB (training process{mapped}); {rewards}"
        before = _optional_table(f"{real_shape}_before")
        capped = _capped_table(real_shape)
        checks.append(("the GRPO step at the real shape", KERNEL_BOUND_LIMIT, "x its kernel bound", _without_ci(
            _times_bound(t), _times_bound(capped[0] if capped else None))))
        add(f"GRPO step at the real shape {bound}; peak memory",
            f"qwen3-0.6b-shape, {p.get('prompts')} prompts x "
            f"{p.get('group_size')} samples, median", "benchmarks/grpo_step.py --model .cache/real-shape/qwen3-0.6b-shape "
            "--rewards coin", f"{with_memory(*before)} ({before[1]['commit']})" if before else "(not measured)",
            f"{with_memory(t, meta)} ({meta['commit']})", meta, before[1] if before else None,
            f"{with_memory(*capped)} ({capped[1]['commit']})" if capped else "(not measured)")
    if (TABLES_DIR / "bench_adamw_step.csv").exists():
        t, meta = load_table("bench_adamw_step")
        largest = lambda table: table.sort_values("parameters").iloc[-1]  # the largest model measured
        r, capped = largest(t), _capped_table("bench_adamw_step")
        native_step = lambda r: (f"{r['native_s']:.2f} s (`rla_lib.native.AdamW`; torch's for-loop {r['for_loop_s']:.2f} s; "
                                 f"bits equal to the for-loop's: {r['same_bits']})")
        add("AdamW step, the same bits", f"{r['model']}, {r['parameters'] / 1e6:.0f} M FP32 parameters, median of "
            f"{r['steps']}", "benchmarks/adamw_step.py", f"{r['for_loop_s']:.2f} s (torch's for-loop)", native_step(r),
            meta, capped=native_step(largest(capped[0])) if capped else "(not measured)")
    _speed_overhead(add, checks, controls, rows_meta)
    if (TABLES_DIR / "bench_bf16_matmul.csv").exists():
        t, meta = load_table("bench_bf16_matmul")
        low = t[t["level"] == t["level"].iloc[-1]].set_index("kernel")
        add("BF16 training math at FP32 speed without BF16 instructions",
            f"qwen3-tiny forward+backward at level {t['level'].iloc[-1]}: torch's BF16 GEMM -> "
            "BF16 via FP32 products", "benchmarks/bf16_matmul.py", f"{low.loc['native', 'model_forward_backward_s']:.2f} s",
            f"{low.loc['fp32', 'model_forward_backward_s']:.2f} s (FP32 model: {low.loc['float32', 'model_forward_backward_s']:.2f} s)",
            meta, capped="(the after column is at avx2)")
    if not rows:
        raise FileNotFoundError("no speed tables yet")
    table = md_table(["target", "what", "before", "after", f"after, capped to {CAPPED} (`ISA={CAPPED}`)", "measured by",
                      "machine"], rows)
    return "\n\n".join([table, speed_verdict(checks, controls)])


def speed_verdict(checks, controls=None) -> str:
    """Which targets hold, here and capped, in words: a target with a CI holds where the CI's upper end is below it."""
    # a multiple ("1.31x its kernel bound") to the hundredth its target is given in
    number = lambda value, unit: (f"{value:.1f}{unit}" if unit == "%" else f"{value:.2f}{unit}" if unit.startswith("x")
                                  else f"{value:.2g}{unit}" if value < 1 else f"{value:.1f}{unit}")

    def says(value, high, limit, unit):
        figure = number(value, unit)
        if high <= limit:
            return f"{figure} (target {limit:g}{unit}: met)"
        if value <= limit:
            return f"{figure} (target {limit:g}{unit}: below on the estimate, not shown: its CI reaches {high:.1f}{unit})"
        return f"{figure} (target {limit:g}{unit}: missed)"

    parts = []
    for where, name in [("here", "On this CPU"), (CAPPED, f"Capped to {CAPPED}")]:
        said = []
        for target, limit, unit, values in checks:
            if where in values:
                said.append(f"{target} {says(*values[where], limit, unit)}")
        if said:
            parts.append(f"{name}: " + "; ".join(said) + ".")
        if where in (controls or {}):
            c = controls[where]
            parts.append(f"(There the overhead benchmark's A/A control, stock against itself, came out "
                         f"{pct(c['cpu_gmean_ratio'] - 1, 1)} [{pct(c['cpu_ratio_ci_low'] - 1, 1)}, "
                         f"{pct(c['cpu_ratio_ci_high'] - 1, 1)}]: its CI excludes zero, so the overhead CIs understate "
                         f"the run's drift.)")
    return " ".join(parts)


def block_suite_repeats() -> str:
    """Repeat runs of the whole suite per condition (plain or beside a CPU hog, at an ISA level) and every test that
    failed in any of them (`benchmarks/fresh_clone_test.py --repeat N [--load]`)."""
    t, meta = load_table("bench_suite_repeats")
    rows = []
    for condition in dict.fromkeys(c.split(": ")[0] for c in t.columns if c != "test"):
        ran = t[t[f"{condition}: runs"].notna()]
        commit = " ".join(dict.fromkeys(str(ran[f"{condition}: commit"].iloc[0]).split()))  # each run's, once
        flaky = ran[ran[f"{condition}: failed"] > 0]
        failures = ", ".join(f"`{r['test']}` ({int(r[f'{condition}: failed'])} of {int(r[f'{condition}: runs'])})"
                             for _, r in flaky.iterrows()) or "none"
        runs = int(ran[f"{condition}: runs"].max())
        rows.append([condition, run_cpus(condition, runs), commit, runs, len(ran),
                     int((ran[f"{condition}: passed"] == ran[f"{condition}: runs"]).sum()),
                     int((ran[f"{condition}: skipped or xfailed"] == ran[f"{condition}: runs"]).sum()), failures])
    header = ["condition", "CPUs of its runs", "commits", "runs", "tests", "passed in every run",
              "skipped or an expected failure in every run", "tests that failed in a run"]
    return "\n\n".join([md_table(header, rows), source("bench_suite_repeats", meta)])


def run_cpus(condition: str, runs: int) -> str:
    """How many of the `runs` under `condition` ran on each CPU (each run's row in tables/bench_fresh_clone.csv, by
    its label "<condition> #k"): a condition names a level and a load, and several CPU kinds may have run it."""
    rows = load_table("bench_fresh_clone")[0]
    cpus = rows[rows["label"].str.fullmatch(rf"{re.escape(condition)} #\d+")]["machine"].value_counts(sort=False)
    unrecorded = [f"{runs - cpus.sum()} not recorded"] if runs > cpus.sum() else []
    return ", ".join([f"{n} on {cpu}" for cpu, n in cpus.items()] + unrecorded)


STUDY_MODEL = "qwen3-tiny-steps-hot"  # the collapse study's stage-0 model (data/grpo_study/preregistration.json)


def block_study_step() -> str:
    """The collapse study's step (its long answers, 32 prompts x 16 samples, one core per run), each arm natively and
    capped: its parts, its kernel bound, and the core-hours of 100 training steps, which decide how many seeds fit."""
    rows, verdicts, sources = [], [], []
    for precision, arm in [("fp32", "FP32 control"), ("bf16", "default BF16")]:
        for suffix, level in [("", "native"), (f"_{CAPPED}", f"capped to {CAPPED}")]:
            name = f"bench_grpo_step_{precision}_{STUDY_MODEL}{suffix}"
            found = _optional_table(name)
            if found is None:
                continue
            t, meta = found
            r, p = t.iloc[0], meta.get("params", {})
            threads = int(p.get("threads", 1))
            ratio = r["total"] / r["kernel_floor"]
            rows.append([arm, level, f"{p.get('prompts')} x {p.get('group_size')}, {p.get('task')} task",
                         f"{r['total']:.1f} ({r['rollout']:.1f} + {r['score']:.1f} + {r['update']:.1f} + "
                         f"{r['sync']:.1f})", f"{r['kernel_floor']:.1f}", f"{ratio:.2f}x",
                         f"{r['total'] * 100 * threads / 3600:.2f}", p.get("load_average", "not recorded"),
                         _machine_short(meta)])
            verdicts.append(f"{arm} {level} {ratio:.2f}x ({'met' if ratio <= KERNEL_BOUND_LIMIT else 'missed'})")
            sources.append(source(name, meta))
    if not rows:
        raise FileNotFoundError(f"no bench_grpo_step_*_{STUDY_MODEL} table yet")
    header = ["arm", "level", "prompts x samples", "step, s (rollout + scoring + update + push)", "kernel bound, s", "step / bound",
              "core-hours per 100 steps", "machine load (1 min)", "machine"]
    return "\n\n".join([md_table(header, rows),
                        f"Target: the step within {KERNEL_BOUND_LIMIT:g}x its kernel bound (the rollout and the "
                        "training kernels as profiled): " + "; ".join(verdicts) + ". Core-hours count the training "
                        "steps only, not the evaluations every 10 steps. The study runs one run per core, so a load near the "
                        "number of cores is how its runs are timed.", " ".join(sources)])
