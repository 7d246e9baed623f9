"""The README's measured numbers, rendered from the committed result tables (`tables/`), never typed in.

    python -m rla_lib.readme           # rewrite every block of README.md from tables/
    python -m rla_lib.readme --check   # exit 1 if a block differs from what the tables say (a test runs this)

A block sits between `<!-- rla:begin NAME -->` and `<!-- rla:end NAME -->`; `BLOCKS[NAME]` renders it
from tables and their provenance. Verdict words come from the numbers and their CIs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from . import dose_response, spread
from .align import REGIONS
from .machine import describe
from .mismatch import config_name
from .paths import MODELS_DIR, ROOT, atomic_write
from .report import TABLES_DIR, change_vs_range, compare_interval, load_table, wall_seconds

README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- rla:begin (\S+) -->\n)(.*?)(<!-- rla:end \2 -->)", re.S)


# ---- formatting ------------------------------------------------------------------------------
def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:+.{digits}f}%"


def pct_ci(value: float, low: float, high: float) -> str:
    """Whole percents, or two decimals where the interval reaches within 2% of -100% (whole ones would all say -100%)."""
    digits = 2 if min(value, low, high) < -0.98 else 0
    return f"{pct(value, digits)} [{pct(low, digits)}, {pct(high, digits)}]"


def source(name: str, meta: dict) -> str:
    """Where a block's numbers come from: file, date, commit, machine."""
    return (f"_From `tables/{name}.csv` (written {meta.get('written', '?')[:10]}, commit {meta.get('commit') or '?'}; "
            f"measured on {describe(meta.get('machine', {}))})._")


MODEL_ORDER = ["qwen3-tiny", "qwen2-tiny", "qwen3-tiny-steps"]


# ---- blocks ---------------------------------------------------------------------------------
def block_models() -> str:
    rows = []
    for name in MODEL_ORDER:
        d = MODELS_DIR / name
        train, cfg = json.loads((d / "training.json").read_text()), json.loads((d / "config.json").read_text())
        size = sum(f.stat().st_size for f in d.glob("*.safetensors")) / 1e6
        minutes = train["history"][-1]["seconds"] / 60 if train.get("history") else float("nan")
        rows.append([f"`{name}`", f"`{cfg['architectures'][0]}`", train.get("task_name", "sums"),
                     f"{train['parameters'] / 1e6:.2f}M", f"{size:.1f} MB",
                     f"{train['steps']:,}", f"{minutes:.0f} min", f"{train['eval_accuracy_t1_fp32']:.1%}",
                     f"{train['eval_accuracy_greedy_fp32']:.1%}"])
    return md_table(["model", "architecture", "task", "parameters", "size", "training steps", "training time", "accuracy at T=1",
                     "greedy"], rows) + "\n\n_From `data/models/*/training.json` and `config.json`, written by `make models`._"


def block_table1() -> str:
    t, meta = load_table("03_table1")
    r, _ = load_table("03_reductions")
    t, r = t.set_index(["model", "mode", "training side"]), r.set_index(["model", "mode", "training side"])
    est = r["estimator"].iloc[0]
    all3, all3_bf16 = config_name(REGIONS), config_name(REGIONS, rope_cos_sin="bf16")
    rows, verdicts = [], []
    for (model, mode), _ in t.groupby(level=[0, 1], sort=False):
        stock = t.loc[(model, mode, "none")]
        a, b, f = r.loc[(model, mode, all3)], r.loc[(model, mode, all3_bf16)], r.loc[(model, mode, "fp32")]
        rows.append([f"{model} vs vLLM {mode}", f"{stock[est]:.3g} [{stock[f'{est} ci_low']:.3g}, {stock[f'{est} ci_high']:.3g}]",
                     f"{a['b']:.3g}", pct_ci(a["relative"], a["rel_ci_low"], a["rel_ci_high"]),
                     f"{b['b']:.3g}", pct_ci(b["relative"], b["rel_ci_low"], b["rel_ci_high"]),
                     f"{f['b']:.3g}", pct_ci(f["relative"], f["rel_ci_low"], f["rel_ci_high"])])
        verdicts.append(f"{model} vs {mode}: FP32 cos/sin {describe_vs_paper(a)}; BF16 cos/sin {describe_vs_paper(b)}")
    p = meta.get("params", {})
    head = (f"{est} KL(vLLM ‖ training), 1e-4 per token, 95% CIs resampling prompts ({p.get('n_prompts')} prompts x "
            f"{p.get('n_samples')} responses, up to {p.get('max_tokens')} tokens); changes are paired differences on the same tokens.")
    table = md_table(["model, engine mode", "stock BF16", "all three (FP32 cos/sin)", "change", "all three (BF16 cos/sin)",
                      "change", "Transformers FP32", "change"], rows)
    return "\n\n".join([head, table, "Against the paper's −10% to −25%: " + "; ".join(verdicts) + ".", source("03_table1", meta)])


def describe_vs_paper(row) -> str:
    return change_vs_range(row["rel_ci_low"], row["rel_ci_high"], row["separated"], -0.25, -0.10)


def block_shapley() -> str:
    t, meta = load_table("04_shapley")
    rows, notes = [], []
    for (model, mode, cs), g in t.groupby(["model", "mode", "cos_sin"], sort=False):
        g = g.set_index("region")
        red = g.iloc[0]
        cells = [f"{g.loc[reg, 'share']:.0%} [{g.loc[reg, 'share_lo']:.0%}, {g.loc[reg, 'share_hi']:.0%}]" for reg in g.index]
        meaningful = red["reduction_lo"] > 0
        rows.append([f"{model} vs {mode}", cs, f"{red['reduction']:.3g} [{red['reduction_lo']:.3g}, {red['reduction_hi']:.3g}]"]
                    + (cells if meaningful else ["(no clear reduction)"] * len(cells)))
        if meaningful:
            where = compare_interval(g.loc["rope", "share_lo"], g.loc["rope", "share_hi"], 0.769, 0.918)
            notes.append(f"{model} vs {mode} ({cs} cos/sin): RoPE {where} the paper's 77-92%")
    table = md_table(["model, mode", "RoPE cos/sin", "reduction (1e-4)", *[f"{r} share" for r in t["region"].unique()]], rows)
    return "\n\n".join([table, "; ".join(notes) + ".", source("04_shapley", meta)])


def block_schedule() -> str:
    k, meta = load_table("02_schedule_kl")
    r, _ = load_table("02_schedule_reductions")
    k = k.set_index(["model", "mode", "training side"])
    att = load_table("02_attention")[0] if (TABLES_DIR / "02_attention.csv").exists() else None
    rows = []
    for (model, mode), g in r.groupby(["model", "mode"], sort=False):
        g = g.set_index(["from", "to"])
        paper, sched, diff = g.loc[("none", "paper")], g.loc[("none", f"schedule_{mode}")], g.loc[("paper", f"schedule_{mode}")]
        row = [f"{model} vs {mode}", f"{paper['a']:.3g}", f"{paper['b']:.3g} ({pct(paper['relative'])})",
               f"{sched['b']:.3g} ({pct_ci(sched['relative'], sched['rel_ci_low'], sched['rel_ci_high'])})",
               f"{diff['diff']:+.3g} [{diff['diff_ci_low']:+.3g}, {diff['diff_ci_high']:+.3g}]"]
        if att is not None:
            a = att[(att["model"] == model) & (att["vLLM mode"] == mode)]
            best = a.loc[a["exact KL"].idxmin()]
            row.append(f"{best['exact KL']:.3g} ({pct_ci(best['change vs stock'], best['change ci_low'], best['change ci_high'])}), "
                       f"{best['attention on the training side']}")
        rows.append(row)
    header = ["model vs vLLM mode", "stock", "paper's regions", "engine's schedule", "schedule − paper (1e-4)"]
    header += ["schedule + closest attention variant"] if att is not None else []
    return "\n\n".join([md_table(header, rows), source("02_schedule_kl", meta)])


def block_overhead() -> str:
    t, meta = load_table("bench_align_overhead")
    rows = []
    for config, g in t.groupby("config", sort=False):
        g = g.set_index("shape")
        rows.append([config] + [f"{pct(g.loc[s, 'cpu_gmean_ratio'] - 1, 1)} [{pct(g.loc[s, 'cpu_ratio_ci_low'] - 1, 1)}, "
                                f"{pct(g.loc[s, 'cpu_ratio_ci_high'] - 1, 1)}] (memory {pct(g.loc[s, 'memory_ratio'] - 1, 1)})"
                                if s in g.index else "" for s in t["shape"].unique()])
    header = ["configuration"] + [f"{s}: {t[t['shape'] == s]['model'].iloc[0]}, {t[t['shape'] == s]['tokens'].iloc[0]} tokens"
                                  for s in t["shape"].unique()]
    p = meta.get("params", {})
    return "\n\n".join([f"Forward+backward CPU time vs stock (geometric mean over {p.get('rounds')} rounds of the per-round "
                        f"ratio, 95% CI with {'pairs of rounds' if p.get('order') == 'foldover' else 'rounds'} resampled, "
                        f"{p.get('order', 'rotate')} order, "
                        f"{p.get('threads')} thread(s)), activation memory vs stock:",
                        md_table(header, rows), source("bench_align_overhead", meta)])


def _on(row) -> str:
    """", on <machine>" for a fresh-clone row: the machine it recorded (rows from before 2026-12-01 did not)."""
    machine = row.get("machine")
    return f", on {machine}" if isinstance(machine, str) else ", machine not recorded"


def block_suite_time() -> str:
    t, meta = load_table("bench_fresh_clone")
    parts = [f"{r['label']}: {r['total_s'] / 60:.1f} min ({r['setup_s'] / 60:.1f} set-up + {r['test_s'] / 60:.1f} tests; "
             f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped; commit {r['commit']}{_on(r)})"
             for _, r in t.iterrows()]
    return "`make test` on a fresh clone: " + "; ".join(parts) + ".\n\n" + source("bench_fresh_clone", meta)


def pivot_md(t, row: str, cols: list[str], cell, row_header: str, col_label) -> str:
    """A long table as markdown: a row per value of `row`, a column per combination of `cols` (first-seen order),
    `cell(record)` in each; `col_label(key)` heads the columns."""
    t = t.reset_index() if row not in t.columns else t
    keys = list(dict.fromkeys(zip(*(t[c] for c in cols))))
    rows = []
    for value in dict.fromkeys(t[row]):
        part = t[t[row] == value]
        rows.append([value] + [cell(part[(part[cols] == list(key)).all(axis=1)].iloc[0]) for key in keys])
    return md_table([row_header] + [col_label(key) for key in keys], rows)


def share_ci(r) -> str:
    return f"{r['share bitwise equal']:.1%} [{r['ci_low']:.1%}, {r['ci_high']:.1%}]"


def differing_of(r) -> str:
    return f"{r['differing']:,} of {r['elements']:,}"


def block_bitwise_tokens() -> str:
    t, meta = load_table("02_bitwise_tokens")
    table = pivot_md(t, "training side", ["model", "vLLM mode"], share_ci, "training side", lambda k: f"{k[0]} vs vLLM {k[1]}")
    return "\n\n".join([table, source("02_bitwise_tokens", meta)])


def block_op_check() -> str:
    t, meta = load_table("02_op_check")
    a, _ = load_table("02_op_check_attention")
    ops = pivot_md(t, "point", ["model", "training side"], differing_of, "op (every op fed eager vLLM's inputs)",
                   lambda k: f"{k[0]}, {k[1]}")
    kernels = pivot_md(a, "numerics", ["model"], differing_of, "attention numerics, on eager vLLM's q/k/v", lambda k: k[0])
    return "\n\n".join([ops, kernels, source("02_op_check", meta)])


def block_real_shape_notebooks() -> str:
    t, meta = load_table("real_shape_notebooks")
    rows = [[r["notebook"], f"{r['seconds'] / 60:.1f} min"] for _, r in t.iterrows()]
    return "\n\n".join([f"{meta.get('params', {}).get('note', '')} (the target writes this table once every notebook's "
                         "test has passed: it ran, saved its figures and tables, and left no log noise in its cells):",
                         md_table(["notebook", "time"], rows), source("real_shape_notebooks", meta)])


def block_real_shape_results() -> str:
    t, meta = load_table("02_schedule_reductions", TABLES_DIR / "real-shape")
    t = t.reset_index() if "model" not in t.columns else t
    rows = []
    for (model, mode), g in t[t["from"] == "none"].groupby(["model", "mode"], sort=False):
        g = g.set_index("to")
        engine = [c for c in g.index if "attention" in c]
        cells = [pct_ci(g.loc[c, "relative"], g.loc[c, "rel_ci_low"], g.loc[c, "rel_ci_high"]) if c in g.index else ""
                 for c in ("paper", f"schedule_{mode}", engine[0] if engine else None)]
        rows.append([f"{Path(model).name} vs vLLM {mode}", f"{g['a'].iloc[0]:.3g}"] + cells + [f"{int(g['n_clusters'].iloc[0])}"])
    parts = [md_table(["model", "stock exact KL (1e-4)", "paper's regions", "read schedule", "engine-aligned", "prompts"], rows)]
    b, _ = load_table("02_bitwise_tokens", TABLES_DIR / "real-shape")
    parts += ["Response tokens whose training-side logprob is bit for bit the engine's:",
              pivot_md(b, "training side", ["model", "vLLM mode"], share_ci, "training side",
                       lambda k: f"{Path(k[0]).name} vs vLLM {k[1]}"),
              source("real-shape/02_schedule_reductions", meta)]
    return "\n\n".join(parts)


def block_scoring_memory() -> str:
    t, meta = load_table("bench_scoring_memory")
    rows = [[r["case"], "yes" if r["grad"] else "no", f"{r['tokens']:,}", f"{r['peak_gb']:.2f} GB", f"{r['seconds']:.0f} s"]
            for _, r in t.iterrows()]
    ratios = []
    for grad, target in ((False, None), (True, 0.25)):
        g = t[t["grad"] == grad].set_index("case")["peak_gb"]
        naive, chunked = (g[[c for c in g.index if c.endswith(p)][0]] for p in ("naive", "chunked"))
        verdict = "" if target is None else f" (target at most {target:.2f}: {'met' if chunked / naive <= target else 'missed'})"
        ratios.append(f"{'with' if grad else 'without'} gradients {chunked / naive:.2f}{verdict}")
    return "\n\n".join([md_table(["path", "gradients", "tokens", "peak memory", "time"], rows),
                         "Chunked over naive peak memory: " + "; ".join(ratios) + ".", source("bench_scoring_memory", meta)])


def block_fsdp() -> str:
    t, meta = load_table("fsdp_equivalence")
    names = {"accumulated": "one process, same split", "global_batch": "one process, one backward", "stock": "stock FSDP run"}
    rows = [[r["regions"] if r["regions"] != "none" else "stock", names.get(r["compared_with"], r["compared_with"]),
             f"{r['max_grad_norm']:g}", f"{r['max_abs_logprob_diff']:.3g}", f"{r['max_abs_loss_diff']:.3g}",
             f"{r['max_abs_param_diff']:.3g}", f"{r['relative_update_diff']:.3g}"] for _, r in t.iterrows()]
    r0 = t.iloc[0]
    return "\n\n".join([f"{r0['world_size']} processes (gloo), {r0['steps']} steps, {r0['rows']} responses / {r0['tokens']} "
                         f"response tokens, lr {r0['lr']:g}; max |difference| after the last step:",
                         md_table(["training side", "compared with", "clip", "logprobs (step 1)", "loss", "weights",
                                   "weight gap / training change"], rows), source("fsdp_equivalence", meta)])


def block_trl() -> str:
    t, meta = load_table("trl_mismatch")
    first = t[t["step"] == t["step"].min()].set_index("arm")
    stock = first.loc["stock", "mismatch/exact_kl"]
    rows = [[arm, r["positions"], f"{r['mismatch/k1']:.3g}", f"{r['mismatch/k3']:.3g}", f"{r['mismatch/exact_kl']:.3g}",
             pct(r["mismatch/exact_kl"] / stock - 1, 2), f"{r['sampling/sampling_logp_difference/mean']:.3g}",
             f"{t[t['arm'] == arm]['mismatch/exact_kl'].mean():.3g}"] for arm, r in first.iterrows()]
    same = bool(first["same_rollout_as_stock"].all())
    return "\n\n".join([
        f"Step {int(first['step'].iloc[0])}: {'the same' if same else 'NOT the same'} {int(first['mismatch/tokens'].iloc[0])} "
        f"sampled tokens in every arm (one batch, so no interval); nats per token; trl {meta.get('params', {}).get('trl', '?')}:",
        md_table(["arm", "positions", "k1", "k3", "exact KL", "exact KL vs stock", "TRL sampling_logp_difference/mean",
                  f"exact KL, mean of {t['step'].nunique()} steps"], rows), source("trl_mismatch", meta)])


CLUSTERING_SHOWN = ["q_proj", "input_norm.rsqrt", "input_norm.weight", "rope.q_cos", "rope.q_sin", "rope.q_sum", "attention",
                    "silu", "swiglu", "residual_attn", "residual_mlp"]


def block_clustering() -> str:
    t, meta = load_table("05_clustering")
    t = t[t["location"].isin(CLUSTERING_SHOWN)]
    models = list(dict.fromkeys(t["model"]))
    rows = []
    for (loc, positions), g in sorted(t.groupby(["location", "positions"], sort=False),
                                      key=lambda kv: (CLUSTERING_SHOWN.index(kv[0][0]), kv[0][1] != "task")):
        g = g.set_index("model")
        cells = [f"{g.loc[m, 'score']:.3g} ({g.loc[m, 'x_floor']:.1f}x floor; {g.loc[m, 'exact_frac']:.0%} on the grid) "
                 f"{g.loc[m, 'reproduces paper']}" if m in g.index else "" for m in models]
        rows.append([f"`{loc}`", positions, g["paper"].iloc[0], *cells])
    head = ("Fourier RMS of rounding positions, median over layers, over values that actually round (values already on "
            "the BF16 grid are left out and their share shown); floor = 1/sqrt(n); last word: does the paper's claim reproduce.")
    return "\n\n".join([head, md_table(["location", "positions", "paper", *models], rows), source("05_clustering", meta)])


def block_grpo_sweep() -> str:
    t, meta = load_table("06_sweep")
    p = meta.get("params", {})
    policy = "eval acc policy last mean" in t.columns
    rows = []
    for _, r in t.iterrows():
        row = [r["sweep"], r["config"], f"{int(r['degraded'])}/{int(r['seeds'])}", f"{int(r['diverged'])}/{int(r['seeds'])}",
               f"{r['eval acc first mean']:.3f} → {r['eval acc last mean']:.3f} ± {r['eval acc last se']:.3f}"]
        if policy:
            has = r["eval acc policy last mean"] == r["eval acc policy last mean"] and r["config"].endswith("rollouts")
            row.append(f"{r['eval acc policy last mean']:.3f} ± {r['eval acc policy last se']:.3f}" if has else "")
        row.append(f"{r['k3 mean (1e-4) mean']:.3g} ± {r['k3 mean (1e-4) se']:.2g}")
        rows.append(row)
    header = ["lr", "configuration", "degraded", "diverged at once", "held-out accuracy start → last (mean ± se over seeds)"]
    header += ["trained BF16 policy, last"] if policy else []
    header += ["mismatch k3 (1e-4/token)"]
    head = (f"Held-out accuracy on {p.get('eval_prompts')} problems at T=1; degraded = peaked after step 0, then ended below "
            "the peak by more than two combined binomial standard errors; diverged at once = never beat step 0 and ended below it "
            "by that margin.")
    sweep = (f"_Histories: `data/grpo_sweep/{p.get('file')}` (written {str(p.get('written', '?'))[:10]}, commit "
             f"{p.get('commit')})._")
    return "\n\n".join([head, md_table(header, rows), sweep, source("06_sweep", meta)])


def block_dose_response() -> str:
    arms, meta = load_table("06_dose_arms")
    fits, _ = load_table("06_dose_threshold")
    marks, _ = load_table("06_dose_references")
    rows = [[r["config"], f"{r['seq_exact_kl']:.2g} ± {r['seq_exact_kl se']:.1g}", f"{r['exact_kl']:.3g}",
             f"{r['acc_first']:.3f} → {r['acc_peak']:.3f} → {r['acc_last']:.3f} ± {r['acc_last se']:.3f}",
             f"{r['acc_worst_after_peak']:.3f} ± {r['acc_worst_after_peak se']:.3f}",
             f"{int(r['degraded'])}/{int(r['seeds'])}", f"{int(r['diverged'])}/{int(r['seeds'])}"] for _, r in arms.iterrows()]
    header = ["arm", "mismatch per response (nats)", "exact KL (1e-4/token)", "accuracy start → peak → final (± se)",
              "worst after peak", "degraded", "diverged at once"]
    lines = dose_response.verdict_lines(fits, marks.to_dict("records"))
    return "\n\n".join([md_table(header, rows), "\n".join(f"- {line}" for line in lines),
                          source("06_dose_arms", meta) + " " + source("06_dose_threshold", load_table("06_dose_threshold")[1])])


def block_grpo_step() -> str:
    parts = []
    for name, label in [("bench_grpo_step_bf16", "default BF16"), ("bench_grpo_step_fp32", "FP32 control")]:
        if (TABLES_DIR / f"{name}.csv").exists():
            t, meta = load_table(name)
            r, p = t.iloc[0], meta.get("params", {})
            parts.append(f"{label}: {r['total']:.2f} s per step ({r['rollout']:.2f} rollout + {r['score']:.2f} scoring + "
                         f"{r['update']:.2f} update + {r['sync']:.2f} weight sync; {p.get('prompts')} prompts x "
                         f"{p.get('group_size')} samples, {meta.get('machine', {}).get('cpu_threads')} threads, CPU "
                         f"{meta.get('machine', {}).get('cpu_capability')})")
    return "One GRPO step, median after warm-up (`benchmarks/grpo_step.py`): " + "; ".join(parts) + "."


def block_engine_start() -> str:
    """`benchmarks/engine_start.py`: one row per engine process, seconds to ready, one sampling call, close."""
    t, meta = load_table("bench_engine_start")
    rows = [[r.get("engine", "own processes"), r["scenario"], r["mode"], f"{r['start_s']:.1f}", f"{r['sample_s']:.2f}",
             f"{r['close_s']:.1f}", f"{r['teardown_s']:.1f}"] for _, r in t.iterrows()]
    header = ["engine core and worker in", "engine", "mode", "start (s)", "sampling 16 prompts x 8 (s)", "close() returns after (s)",
              "all its processes gone after (s)"]
    return "\n\n".join([md_table(header, rows), source("bench_engine_start", meta)])


def block_isa_spread() -> str:
    t, meta = load_table("07_isa_spread")
    rows, verdicts = [], []
    for _, r in t.iterrows():
        rows.append([f"{r['model']} vs {r['mode']}", r["level"], r["cpu_capability"], r["bf16_matmul"],
                     f"{r['stock']:.3g} [{r['stock ci_low']:.3g}, {r['stock ci_high']:.3g}]",
                     f"{r['paper']:.3g} ({pct_ci(r['stock->paper'], r['stock->paper ci_low'], r['stock->paper ci_high'])})",
                     f"{r['schedule']:.3g} ({pct_ci(r['stock->schedule'], r['stock->schedule ci_low'], r['stock->schedule ci_high'])})",
                     pct_ci(r["paper->schedule"], r["paper->schedule ci_low"], r["paper->schedule ci_high"])])
    for (model, mode), g in t.groupby(["model", "mode"], sort=False):
        effects = [f"{r['level']}: {spread.effect(r, 'stock', 'paper')}" for _, r in g.iterrows()]
        beats = sum(spread.effect(r, "paper", "schedule") == "cut" for _, r in g.iterrows())
        verdicts.append(f"{model} vs {mode}: the paper's regions give {', '.join(effects)}; the schedule read at each level "
                        f"beats them at {beats} of {len(g)} levels")
    control = t[t["level"].str.endswith("+fp32 matmul")]
    if len(control):
        uncapped = t[t["level"] == control["level"].iloc[0].removesuffix("+fp32 matmul")].set_index(["model", "mode"])
        same = sum(all(spread.effect(r, a, b) == spread.effect(uncapped.loc[(r["model"], r["mode"])], a, b)
                       for a, b in [("stock", "paper"), ("stock", "schedule"), ("paper", "schedule")])
                   for _, r in control.iterrows())
        verdicts.append(f"control (the uncapped level with the lower levels' training-side matmul): the same three verdicts as "
                        f"the uncapped level in {same} of {len(control)} model x mode cells, so "
                        + ("what moves between levels is the engine's kernels, not the training side's matmul"
                           if same == len(control) else "the training side's matmul moves some of it"))
    header = ["model vs vLLM mode", "ISA level", "torch kernels", "training BF16 matmul", "stock", "paper's regions",
              "read schedule", "schedule vs paper"]
    return "\n\n".join([md_table(header, rows), "; ".join(verdicts) + ".", source("07_isa_spread", meta)])


def block_bf16_matmul() -> str:
    t, meta = load_table("bench_bf16_matmul")
    rows = []
    for level, g in t.groupby("level", sort=False):
        g = g.set_index("kernel")
        rows.append([level, g["auto_mode"].iloc[0], *(f"{g.loc[k, 'forward_backward_gflops']:.0f}" for k in ("native", "fp32", "float32")),
                     *(f"{g.loc[k, 'model_forward_backward_s']:.2f}" for k in ("native", "fp32", "float32")),
                     f"{g['fp32_equals_native'].iloc[0]:.4%}", g["engine_matmul"].iloc[0], f"{g['fp32_equals_engine'].iloc[0]:.4%}"])
    header = ["ISA level", "chosen", "GFLOP/s: torch BF16", "BF16 via FP32", "FP32", "qwen3-tiny fwd+bwd s: torch BF16",
              "BF16 via FP32", "FP32", "BF16-via-FP32 outputs equal to torch BF16", "engine's BF16 linear",
              "equal to the engine's"]
    return "\n\n".join([md_table(header, rows), source("bench_bf16_matmul", meta)])


def _machine_short(meta: dict) -> str:
    m = meta.get("machine", {})
    generation = m.get("cpu_generation") or "generation not recorded"  # machines of one kind differ by CPU generation
    return (f"{m.get('cpu', '?')} ({generation}), {m.get('isa_level') or m.get('cpu_capability', '?')}, "
            f"{m.get('cpu_threads', '?')} threads")


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


def _speed_overhead(add, checks: list, controls: dict) -> None:
    """The speed table's alignment-overhead rows (block_speed): the targets' run, its A/A control, the capped run."""
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
            checks.append((f"`{config}` overhead", 3 if "all 3" in config else 5, "%", {"here": ends(a)}
                           | ({CAPPED: ends(pick(capped[0], config).iloc[0])} if has_capped else {})))


def block_speed() -> str:
    """Issue 19's targets, each before and after, from the tables the benchmarks and `make run-all` wrote; and after,
    with this CPU capped to AVX2 (no BF16 instructions, the issue's machine kind), where that run's table is there."""
    rows, checks = [], []  # checks: (target, limit, unit, {"here" | CAPPED: (value, upper end of its CI)})
    controls = {}  # where the alignment-overhead benchmark's A/A control (stock against itself) excludes zero

    def add(target, what, command, before, after, meta, before_meta=None, capped="(not measured)"):
        rows.append([target, what, before, after, capped, f"`{command}`", _machines(before_meta, meta)])

    minutes = lambda t: f"{wall_seconds(t) / 60:.1f} min"
    if (TABLES_DIR / "run_all_time.csv").exists():
        after, meta = load_table("run_all_time")
        before, before_meta = load_table("run_all_time_before")
        capped = _capped_table("run_all_time")
        add("`make run-all` <= 10 min", "all notebooks after set-up (first start to last end), fresh clone, cold compile caches",
            ".venv/bin/python benchmarks/fresh_clone_test.py --target run-all", f"{minutes(before)} ({before_meta['commit']})",
            f"{minutes(after)} ({meta['commit']})", meta, before_meta,
            f"{minutes(capped[0])} ({capped[1]['commit']})" if capped else "(not measured)")
        checks.append(("`make run-all`", 10, " min", _without_ci(wall_seconds(after) / 60,
                                                                  wall_seconds(capped[0]) / 60 if capped else None)))
    if (TABLES_DIR / "bench_fresh_clone.csv").exists():
        t, meta = load_table("bench_fresh_clone")
        is_capped = t["label"].astype(str).str.startswith(f"ISA={CAPPED}")
        first, last = t[~is_capped].iloc[0], t[~is_capped].iloc[-1]
        capped_row = t[is_capped].iloc[-1] if is_capped.any() else None
        counts = lambda r: f"{r['test_s'] / 60:.1f} min ({r['commit']}), {r['passed']} passed, {r['failed']} failed"
        add("`make test` <= 12 min", "whole suite on a fresh clone, after set-up", ".venv/bin/python benchmarks/fresh_clone_test.py",
            f"{first['test_s'] / 60:.1f} min ({first['commit']}{_on(first)})", counts(last) + _on(last), meta,
            capped=counts(capped_row) if capped_row is not None else "(not measured)")
        # a failing run's time is no result
        minutes_if_passed = lambda r: r["test_s"] / 60 if r is not None and r["failed"] == 0 and r["exit_code"] == 0 else None
        checks.append(("`make test`", 12, " min", _without_ci(minutes_if_passed(last), minutes_if_passed(capped_row))))
    step = lambda r: (f"{r['total']:.2f} s ({r['rollout']:.2f} rollout + {r['score']:.2f} scoring + {r['update']:.2f} update + "
                      f"{r['sync']:.2f} weight push)")
    if (TABLES_DIR / "bench_grpo_step_bf16.csv").exists():
        after, meta = load_table("bench_grpo_step_bf16")
        before, before_meta = load_table("bench_grpo_step_bf16_before")
        capped = _capped_table("bench_grpo_step_bf16")
        add("GRPO step <= 0.5 s", "default BF16, 16 prompts x 8 samples, median", "benchmarks/grpo_step.py",
            step(before.iloc[0]), step(after.iloc[0]), meta, before_meta, step(capped[0].iloc[0]) if capped else "(not measured)")
        checks.append(("the GRPO step", 0.5, " s", _without_ci(after["total"].iloc[0],
                                                                capped[0]["total"].iloc[0] if capped else None)))
    real_shape = "bench_grpo_step_bf16_qwen3-0.6b-shape"
    if (TABLES_DIR / f"{real_shape}.csv").exists():
        t, meta = load_table(real_shape)
        p = meta.get("params", {})
        with_memory = lambda r: f"{step(r)}, peak {r['peak_gb']:.1f} GB (training process)"
        before = _optional_table(f"{real_shape}_before")
        capped = _capped_table(real_shape)
        add("GRPO step at the real shape: time and peak memory", f"qwen3-0.6b-shape, {p.get('prompts')} prompts x "
            f"{p.get('group_size')} samples, median", "benchmarks/grpo_step.py --model .cache/real-shape/qwen3-0.6b-shape",
            f"{with_memory(before[0].iloc[0])} ({before[1]['commit']})" if before else "(not measured)",
            f"{with_memory(t.iloc[0])} ({meta['commit']})", meta, before[1] if before else None,
            f"{with_memory(capped[0].iloc[0])} ({capped[1]['commit']})" if capped else "(not measured)")
    _speed_overhead(add, checks, controls)
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
    def says(value, high, limit, unit):
        figure = f"{value:.1f}{unit}" if unit == "%" else f"{value:.2g}{unit}" if value < 1 else f"{value:.1f}{unit}"
        if high <= limit:
            return f"{figure} (target {limit:g}{unit}: met)"
        if value <= limit:
            return f"{figure} (target {limit:g}{unit}: below on the estimate, not shown: its CI reaches {high:.1f}{unit})"
        return f"{figure} (target {limit:g}{unit}: missed)"

    parts = []
    for where, name in [("here", "On this CPU"), (CAPPED, f"Capped to {CAPPED}")]:
        said = [f"{target} {says(*values[where], limit, unit)}" for target, limit, unit, values in checks if where in values]
        if said:
            parts.append(f"{name}: " + "; ".join(said) + ".")
        if where in (controls or {}):
            c = controls[where]
            parts.append(f"(There the overhead benchmark's A/A control, stock against itself, came out "
                         f"{pct(c['cpu_gmean_ratio'] - 1, 1)} [{pct(c['cpu_ratio_ci_low'] - 1, 1)}, "
                         f"{pct(c['cpu_ratio_ci_high'] - 1, 1)}]: its CI excludes zero, so the overhead CIs understate "
                         f"the run's drift.)")
    return " ".join(parts)


def measured_by(command: str, block):
    """A benchmark's block, or a line naming the command that measures it where its table is not there yet."""
    def render_block() -> str:
        try:
            return block()
        except FileNotFoundError:
            return f"_Not measured on this commit yet: run `{command}`, then `make readme`._"
    return render_block


BLOCKS = {
    "models": block_models,
    "table1": block_table1,
    "shapley": block_shapley,
    "schedule": block_schedule,
    "clustering": block_clustering,
    "overhead": measured_by("make bench", block_overhead),
    "grpo-sweep": block_grpo_sweep,
    "dose-response": block_dose_response,
    "grpo-step": measured_by("make bench", block_grpo_step),
    "engine-start": measured_by(".venv/bin/python benchmarks/engine_start.py", block_engine_start),
    "bf16-matmul": measured_by("make bench", block_bf16_matmul),
    "isa-spread": block_isa_spread,
    "speed": measured_by("make bench && make run-all", block_speed),
    "bitwise-tokens": measured_by("make run-all (notebook 02)", block_bitwise_tokens),
    "op-check": measured_by("make run-all (notebook 02)", block_op_check),
    "real-shape-results": measured_by("make test-real-shape", block_real_shape_results),
    "real-shape-notebooks": measured_by("make test-real-shape", block_real_shape_notebooks),
    "scoring-memory": measured_by(".venv/bin/python benchmarks/scoring_memory.py", block_scoring_memory),
    "fsdp": measured_by("make fsdp-grpo", block_fsdp),
    "trl": measured_by(".venv/bin/python experiments/trl_grpo.py", block_trl),
    "suite-time": measured_by(".venv/bin/python benchmarks/fresh_clone_test.py", block_suite_time),
}


def render(text: str, blocks=BLOCKS) -> tuple[str, list[str]]:
    """`text` with every known block re-rendered; also the names of blocks whose content changed."""
    changed = []

    def one(m):
        name = m.group(2)
        if name not in blocks:
            raise KeyError(f"README block {name!r} has no renderer in rla_lib.readme.BLOCKS ({', '.join(blocks)})")
        body = blocks[name]().strip() + "\n"
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report blocks that are out of date (exit 1 if any)")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    new, changed = render(text)
    if args.check:
        if changed:
            print(f"README blocks out of date with tables/: {', '.join(changed)}; run `make readme`", file=sys.stderr)
        return 1 if changed else 0
    if changed:
        atomic_write(args.readme, lambda tmp: tmp.write_text(new))
    print(f"README: {len(changed)} block(s) rewritten" + (f" ({', '.join(changed)})" if changed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
