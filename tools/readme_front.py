"""The front page's three headline tables, small by construction: the gap and the paper's regions at every
instruction-set level side by side (notebook 07's table, so the page does not change with the machine that ran the
notebooks last), engine-aligned exactness per CPU kind (`benchmarks/exactness.py`), and where the pre-registered
collapse study stands (notebook 06b): its stage 0 and its three questions. Every number and verdict word is computed from the committed tables; docs/results.md has them
all in full."""

from __future__ import annotations

import math

import pandas as pd

from rla_lib.machine import ISA_LEVELS
from rla_lib.report import load_table, md_table, pct_ci, source
from rla_lib.studies import collapse, spread

EFFECT_WORDS = {"cut": "a cut", "rise": "a rise", "none": "no change beyond noise"}


def is_exact(r) -> bool:
    """An exactness row: every token, as sampled and as rescored, bitwise, and every KL term 0."""
    return r["sampled_bitwise"] == 1 and r["rescored_bitwise"] == 1 and bool(r["kl_all_zero"])


def exactness_verdict(r) -> str:
    """"exact" only where `is_exact`."""
    if is_exact(r):
        return (f"exact: all {r['tokens']:,} tokens of {r['prompts']} prompts, as sampled and rescored; KL 0 "
                f"(prompt share >= {r['prompt_share_bound']:.1%}, exact 95% bound)")
    nonfinite = float(r.get("kl_nonfinite", float("nan")))  # (NaN or absent in rows written before the count was kept)
    if not math.isnan(nonfinite) and nonfinite > 0:
        return f"not exact: {int(r['kl_nonfinite'])} KL terms not finite (an error in the measurement, not skipped)"
    if r["sampled_bitwise"] == 1 and r["rescored_bitwise"] == 1:  # the scored tokens agree; some KL term is not 0
        if math.isnan(nonfinite):  # a row from before non-finite terms were counted: one may have been skipped
            return (f"not exact: every scored token bitwise ({r['tokens']:,} tokens, {r['prompts']} prompts), but not every "
                    f"KL term is 0 (mean {r['exact_kl']:.3g} per token); the row predates the count of non-finite terms, "
                    "which its mean may have skipped: re-measure with benchmarks/exactness.py")
        return (f"not exact: every scored token bitwise ({r['tokens']:,} tokens, {r['prompts']} prompts), but the full "
                f"distributions differ at some position (KL terms not all 0; mean {r['exact_kl']:.3g} per token)")
    return (f"not exact: {r['sampled_bitwise']:.1%} of tokens bitwise as sampled, {r['rescored_bitwise']:.1%} rescored; "
            f"{r['prompts_all_bitwise']} of {r['prompts']} prompts all bitwise; KL {r['exact_kl']:.3g} per token")


def block_front_gap() -> str:
    """Stock BF16 against the paper's three regions, a column per instruction-set level (`07_isa_spread`; the control
    rows, a level with another training-side matmul, stay in docs/results.md)."""
    t, meta = load_table("07_isa_spread")
    t = t[~t["level"].str.contains("+", regex=False)]
    levels = list(dict.fromkeys(t["level"]))
    rows, flips = [], []
    for (model, mode), g in t.groupby(["model", "mode"], sort=False):
        g = g.set_index("level")
        rows.append([f"{model} vs vLLM {mode}"] + [
            f"{g.loc[lv, 'stock']:.3g} → {g.loc[lv, 'paper']:.3g} "
            f"({pct_ci(g.loc[lv, 'stock->paper'], g.loc[lv, 'stock->paper ci_low'], g.loc[lv, 'stock->paper ci_high'])})"
            for lv in levels])
        effects = {lv: spread.effect(g.loc[lv], "stock", "paper") for lv in levels}
        if len(set(effects.values())) > 1:
            flips.append(f"{model} vs {mode} (" + ", ".join(f"{lv}: {EFFECT_WORDS[e]}" for lv, e in effects.items()) + ")")
    p = meta.get("params", {})
    setting = (f"({p.get('n_prompts')} prompts x {p.get('n_samples')} responses; one CPU, its kernels capped to each "
               "level.)")
    header = ["model vs engine mode"] + [f"{lv} ({t[t['level'] == lv]['cpu_capability'].iloc[0]} kernels)" for lv in levels]
    verdict = (f"The paper's regions change the gap differently between levels in {len(flips)} of {len(rows)} cells: "
               + "; ".join(flips) + "." if flips else
               f"The paper's regions give the same verdict at every level in all {len(rows)} cells.")
    return md_table(header, rows) + "\n\n" + " ".join([verdict, setting, source("07_isa_spread", meta)])


def block_front_exactness() -> str:
    """`align_to_engine` as a user calls it, per CPU kind (a row) and instruction-set level (a column)."""
    t, meta = load_table("exactness")
    aligned = t[t.side == "engine-aligned"].copy()
    aligned["exact"] = aligned.apply(is_exact, axis=1)
    stock = t[t.side == "stock"]
    order = list(ISA_LEVELS)  # highest first
    levels = sorted(dict.fromkeys(aligned["level"]), key=lambda lv: order.index(lv) if lv in order else len(order))
    rows, misses = [], []
    for cpu, g in aligned.groupby("cpu", sort=False):
        s = stock[stock["cpu"] == cpu]["sampled_bitwise"]
        cells = []
        for level in levels:
            at = g[g["level"] == level]
            cells.append(f"{int(at['exact'].sum())} of {len(at)} exact" if len(at) else "not run")
            misses += [f"{cpu} at {level}, {r['model']} vs {r['mode']}: {exactness_verdict(r).removeprefix('not exact: ')}"
                       for _, r in at[~at["exact"]].iterrows()]
        rows.append([cpu, f"{s.min():.1%} to {s.max():.1%}", *cells])
    header = ["CPU kind", "stock BF16: tokens bitwise"] + [f"engine-aligned at {level}" for level in levels]
    p = meta.get("params", {})
    setting = f"({p.get('prompts')} held-out prompts x {p.get('samples')} samples per cell.)"
    notes = (["Not exact: " + "; ".join(misses) + "."] if misses else []) + [setting, source("exactness", meta, collected=True)]
    return md_table(header, rows) + "\n\n" + " ".join(notes)


def _candidate(tag: str, cand: dict, lr: float) -> str:
    hot = f", T {cand['temperature']:g}" if "temperature" in cand else ""
    return f"{cand['model']}, {cand['prompts_per_step']}x{cand['group_size']}{hot}, lr {lr:g}"


def kept_note(table, key: str, name=lambda k: k) -> str:
    """The rows of a study table kept from an earlier one (`source` other than "runs"; `grpo_sweep.kept_rows`), named."""
    if "source" not in table:
        return ""
    kept = table[table["source"].fillna("runs") != "runs"]
    return "".join(f" Kept from `{src}`, their runs' histories gone with the machine that ran them: "
                   f"{'; '.join(name(k) for k in rows[key])}." for src, rows in kept.groupby("source"))


def study_plan() -> tuple["pd.DataFrame", dict]:
    """The registered study's runs per stage (planned, finished) and its verdicts (experiments/collapse_study.py
    --tables); empty before its first tables."""
    try:
        plan, meta = load_table("06_study_plan")
    except FileNotFoundError:
        return pd.DataFrame(columns=["planned", "finished"]), {}
    return plan.set_index("stage"), meta


def block_front_study() -> str:
    """The collapse study as registered (data/grpo_study/preregistration.json): stage 0 per candidate from its table
    (candidates without a finished run shown as such), each question with its tests and whether it has run, and one
    sentence computed from both."""
    reg = collapse.preregistration()
    table, meta = load_table("06_stage0")
    done = table.set_index("sweep") if len(table) else None
    seeds = len(reg["stage_0_regime"]["seeds"])
    rows, finished = [], 0
    for tag, cand, lr in collapse.stage0_runs(reg):
        r = done.loc[tag] if done is not None and tag in done.index and done.loc[tag, "seeds_done"] > 0 else None
        n = 0 if r is None else int(r["seeds_done"])
        finished += n
        rows.append([_candidate(tag, cand, lr), f"{n} of {seeds}", "-" if r is None else f"{int(r['learned'])} of {n}",
                     "-" if r is None else f"{int(r['collapsed'])} of {n}",
                     "-" if r is None else f"{r['mean_gain']:+.3f}", "yes" if r is not None and r["learns"] else
                     ("not yet: seeds left" if r is None or not r["complete"] else "no")])
    stage0 = md_table(["stage 0 candidate (FP32 control)", "seeds run", "learned", "collapsed", "mean gain", "learns"], rows)
    decision = meta["params"]["decision"]
    regime = decision.get("regime")
    plan, plan_meta = study_plan()
    questions = md_table(["question", "registered tests", "runs"], [
        [q["question"], ", ".join(q["tests"]),
         "waiting for stage 0's regime" if decision["decision"] == "incomplete" else
         "none: stage 0 found no regime that learns" if regime is None else
         f"{plan.loc[stage, 'finished']} of {plan.loc[stage, 'planned']} planned finished" if stage in plan.index else
         "none planned yet"]
        for stage, q in zip(("q1", "q2", "q3"), reg["questions"].values())])
    total = seeds * len(rows)
    names = {tag: _candidate(tag, cand, lr) for tag, cand, lr in collapse.stage0_runs(reg)}
    if decision["decision"] == "incomplete":
        answer = (f"Cannot tell yet whether the mismatch causes collapse here: the registered questions wait for stage 0, "
                  f"which has {finished} of its {total} runs; none of its questions has run.")
    elif regime is None:
        answer = ("Cannot tell: no stage-0 candidate learned by the registered rule, so the study stops there and asks "
                  "no confirmatory question of a regime that does not learn.")
    else:
        tests = plan_meta.get("params", {}).get("tests", {})
        ran = any(t.get("p") is not None for t in tests.values())
        answer = (f"Stage 0 chose regime R: {names.get(regime, regime)}, the largest mean gain of the candidates that "
                  "learn. " + ("" if ran else "Cannot tell yet whether the mismatch causes collapse here: no registered "
                               "test has run. ") +
                  " ".join(f"{verdict}." for stage, verdict in zip(("q1", "q2", "q3"), plan_meta.get("params", {}).get(
                      "verdicts", [])) if stage in plan.index and plan.loc[stage, "finished"] > 0)).rstrip()  # begun
    kept = kept_note(table, "sweep", names.get)
    return "\n\n".join([stage0, questions, answer + kept + " The earlier, unplanned sweeps and their verdicts: "
                         "docs/results.md. " + source("06_stage0", meta)])
