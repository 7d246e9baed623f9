"""The front page's three headline tables, small by construction: the gap and the paper's regions at every
instruction-set level side by side (notebook 07's table, so the page does not change with the machine that ran the
notebooks last), engine-aligned exactness per CPU kind (`benchmarks/exactness.py`), and the collapse question's current
answer (notebook 06b). Every number and verdict word is computed from the committed tables; docs/results.md has them
all in full."""

from __future__ import annotations

import math

from rla_lib.machine import ISA_LEVELS
from rla_lib.report import load_table, md_table, pct_ci, source
from rla_lib.studies import collapse, spread

EFFECT_WORDS = {"cut": "a cut", "rise": "a rise", "none": "no change beyond noise"}
MAX_COLLAPSE_ROWS = 6  # the sweeps with the most seeds per arm; docs/results.md lists every sweep


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


def _collapse_cells(g, arms) -> list[str]:
    return [f"{int(g.loc[a, 'collapses'])}/{int(g.loc[a, 'seeds'])}" if a in g.index else "" for a in arms]


def block_front_collapse() -> str:
    """The sweeps that can speak to the paper's claim (a default BF16 arm, an aligned arm, a collapse in some arm), the
    most seeded first, with `collapse.verdict`; how many aligned arms collapsed less often beyond chance."""
    rates, meta = load_table("06_collapse")
    rates = rates.set_index(["sweep", "config"])
    arms = [a for a in ("default BF16", *collapse.ALIGNED_ARMS, "FP32 control") if a in rates.index.get_level_values(1)]
    telling = []
    for sweep in dict.fromkeys(rates.index.get_level_values(0)):
        g = rates.loc[sweep]
        if "default BF16" in g.index and any(a in g.index for a in collapse.ALIGNED_ARMS) and g["collapses"].sum() > 0:
            telling.append((sweep, g))
    fewer = [s for s, g in telling if any(g.loc[a, "p fewer than default BF16"] < 0.05
                                          for a in collapse.ALIGNED_ARMS if a in g.index)]
    shown = sorted(telling, key=lambda sg: -sg[1]["seeds"].min())[:MAX_COLLAPSE_ROWS]
    rows = [[sweep, *_collapse_cells(g, arms), collapse.verdict(rates, sweep)]
            for sweep, g in telling if any(sweep == s for s, _ in shown)]
    answer = (f"An aligned arm collapsed less often than default BF16 beyond chance (one-sided Fisher p < 0.05) in "
              f"{len(fewer)} of the {len(telling)} sweeps with a collapse and both arms"
              + (f" ({', '.join(fewer)})" if fewer else "") + f"; collapses that followed a rise, the paper's pattern: "
              f"{int(rates['rose_then_collapsed'].sum())} of {int(rates['collapses'].sum())}"
              + (f"; FP32 control, which has no mismatch: {int(rates.xs('FP32 control', level=1)['collapses'].sum())} "
                 "collapses" if "FP32 control" in arms else "") + ".")
    more = len(telling) - len(shown)
    header = ["sweep", *[f"{a}: collapsed" for a in arms], "verdict"]
    notes = [answer] + ([f"{more} more such sweeps in docs/results.md."] if more else []) + [source("06_collapse", meta)]
    return md_table(header, rows) + "\n\n" + " ".join(notes)
