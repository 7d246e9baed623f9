"""The measured numbers of README.md, the pages under docs/ and benchmarks/README.md, rendered from the committed result
tables (`tables/`), never typed in.

    python -m tools.readme           # rewrite every block of every page (PAGES) from tables/
    python -m tools.readme --check   # exit 1 if a block differs from what the tables say (a test runs this)

A block sits between `<!-- rla:begin NAME -->` and `<!-- rla:end NAME -->`; `BLOCKS[NAME]` renders it
from tables and their provenance. Verdict words come from the numbers and their CIs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from rla_lib import mismatch_report
from rla_lib.align import REGIONS
from rla_lib.kl import FEW_PROMPTS
from rla_lib.sides import config_name
from rla_lib.paper import GAP_REDUCTION, ROPE_SHAPLEY_SHARE, percent_range
from rla_lib.models import EMBEDDED_MODELS
from rla_lib.paths import MODELS_DIR, ROOT, atomic_write
from rla_lib.pretrain import EMBEDDED
from rla_lib.report import (TABLES_DIR, change_cell, change_vs_range, compare_interval, load_table, md_table, pct, pct_ci,
                            share_cell, source)
from rla_lib.scoring import CHUNKED_PEAK_TARGET, chunked_peak_target_applies
from rla_lib.settings import TEST_VARIABLES, VARIABLES
from rla_lib.studies import collapse, dose_response
from rla_lib.studies.shapley import share_is_readable
from tools.readme_cpu import block_bf16_matmul, block_isa_spread
from tools.readme_front import (block_front_exactness, block_front_gap, block_front_study, exactness_verdict,
                                is_exact, kept_note, study_plan)
from tools.readme_speed import block_speed, block_study_step, block_suite_repeats, block_suite_time

README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
# the front page, how to, every result, and the benchmarks' targets and the test suite's runs commit by commit
PAGES = (README, ROOT / "docs" / "guide.md", ROOT / "docs" / "results.md", BENCHMARKS)
BLOCK = re.compile(r"(<!-- rla:begin (\S+) -->\n)(.*?)(<!-- rla:end \2 -->)", re.S)


MODEL_ORDER = list(EMBEDDED_MODELS)


# ---- blocks ---------------------------------------------------------------------------------
def block_models() -> str:
    rows = []
    for name in MODEL_ORDER:
        d = MODELS_DIR / name
        train, cfg = json.loads((d / "training.json").read_text()), json.loads((d / "config.json").read_text())
        size = sum(f.stat().st_size for f in d.glob("*.safetensors")) / 1e6
        scale = train["schedule"].get("logit_scale")
        steps, minutes = ((f"none: `{EMBEDDED[train['schedule']['init']].name}`, logits x {scale:g}", "—") if not train["steps"]
                          else (f"{train['steps']:,}", f"{train['history'][-1]['seconds'] / 60:.0f} min"))
        rows.append([f"`{name}`", f"`{cfg['architectures'][0]}`", train.get("task_name", "sums"),
                     f"{train['parameters'] / 1e6:.2f}M", f"{size:.1f} MB", steps, minutes, f"{train['eval_accuracy_t1_fp32']:.1%}",
                     f"{train['eval_accuracy_greedy_fp32']:.1%}"])
    return md_table(["model", "architecture", "task", "parameters", "size", "training steps", "training time", "accuracy at T=1",
                     "greedy"], rows) + "\n\n_From `data/models/*/training.json` and `config.json`, written by `make models`._"


def block_table1() -> str:
    t, meta = load_table("02_table1")
    r, _ = load_table("02_reductions")
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
    return "\n\n".join([head, table, f"Against the paper's −{percent_range(*GAP_REDUCTION).replace('-', '% to −')}: " + "; ".join(verdicts) + ".", source("02_table1", meta)])


def describe_vs_paper(row) -> str:
    return change_vs_range(row["rel_ci_low"], row["rel_ci_high"], row["separated"], *GAP_REDUCTION)


def block_shapley() -> str:
    t, meta = load_table("04_shapley")
    rows, notes = [], []
    for (model, mode, cs), g in t.groupby(["model", "mode", "cos_sin"], sort=False):
        g = g.set_index("region")
        red = g.iloc[0]
        readable = {reg: share_is_readable(g.loc[reg, "share_lo"], g.loc[reg, "share_hi"], red["reduction_lo"], red["reduction_hi"])
                    for reg in g.index}
        cells = [("" if readable[reg] else "cannot tell: ") +
                 f"{g.loc[reg, 'share']:.0%} [{g.loc[reg, 'share_lo']:.0%}, {g.loc[reg, 'share_hi']:.0%}]" for reg in g.index]
        meaningful = red["reduction_lo"] > 0
        rows.append([f"{model} vs {mode}", cs, f"{red['reduction']:.3g} [{red['reduction_lo']:.3g}, {red['reduction_hi']:.3g}]"]
                    + (cells if meaningful else ["(no clear reduction)"] * len(cells)))
        if meaningful:
            where = compare_interval(g.loc["rope", "share_lo"], g.loc["rope", "share_hi"], *ROPE_SHAPLEY_SHARE) \
                if readable["rope"] else "cannot tell (its CI spans more than the whole range) against"
            notes.append(f"{model} vs {mode} ({cs} cos/sin): RoPE {where} the paper's {percent_range(*ROPE_SHAPLEY_SHARE)}")
    table = md_table(["model, mode", "RoPE cos/sin", "reduction (1e-4)", *[f"{r} share" for r in t["region"].unique()]], rows)
    return "\n\n".join([table, "; ".join(notes) + ".", source("04_shapley", meta)])


def block_schedule() -> str:
    k, meta = load_table("03_schedule_kl")
    r, _ = load_table("03_schedule_reductions")
    k = k.set_index(["model", "mode", "training side"])
    rows, with_attention = [], False
    for (model, mode), g in r.groupby(["model", "mode"], sort=False):
        g = g.set_index(["from", "to"])
        paper, sched, diff = g.loc[("none", "paper")], g.loc[("none", f"schedule_{mode}")], g.loc[("paper", f"schedule_{mode}")]
        row = [f"{model} vs {mode}", f"{paper['a']:.3g}", f"{paper['b']:.3g} ({pct(paper['relative'])})",
               f"{sched['b']:.3g} ({pct_ci(sched['relative'], sched['rel_ci_low'], sched['rel_ci_high'])})",
               f"{diff['diff']:+.3g} [{diff['diff_ci_low']:+.3g}, {diff['diff_ci_high']:+.3g}]"]
        engine = [to for frm, to in g.index if frm == "none" and "+attention_" in to]  # the side notebook 03b chose
        if engine:
            e, size, with_attention = g.loc[("none", engine[0])], k.loc[(model, mode, "none")], True
            change = change_cell(e["relative"], e["rel_ci_low"], e["rel_ci_high"], e["b"], int(size["tokens"]),
                                 int(size["prompts"]))
            kl_and_change = change if e["b"] == 0 else f"{e['b']:.3g} ({change})"
            row.append(f"{kl_and_change}, attention {engine[0].split('+attention_')[1]}")
        rows.append(row)
    header = ["model vs vLLM mode", "stock", "paper's regions", "engine's schedule", "schedule − paper (1e-4)"]
    header += ["engine-aligned: schedule + the engine's attention"] if with_attention else []
    reported, total = int(k["prompts"].max()), int(meta["params"]["n_prompts"])
    split = (f"_On {reported} held-out prompts of {total}: the attention numerics (the kernel the engine loaded, verified "
             f"there, or where it is not known the closest there) is fixed on the other {total - reported} "
             "(`MismatchRun.split_prompts`), so none is scored on the prompts it was chosen on._"
             if reported < total else "")
    return "\n\n".join(part for part in [md_table(header, rows), split, source("03_schedule_kl", meta)] if part)


def block_overhead() -> str:
    """The overhead table at this machine's level and, where there is one, capped to avx2 (the speed table's level)."""
    capped = "bench_align_overhead_avx2"
    if not (TABLES_DIR / f"{capped}.csv").exists():
        return overhead_table("bench_align_overhead")
    return "\n\n".join([overhead_table("bench_align_overhead"), "Capped to avx2 (`python -m rla_lib.machine --level avx2 "
                        ".venv/bin/python benchmarks/align_overhead.py`):", overhead_table(capped)])


def overhead_table(name: str) -> str:
    t, meta = load_table(name)
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
                        md_table(header, rows), source(name, meta)])


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
    return share_cell(r["share bitwise equal"], r["ci_low"], r["ci_high"], int(r["tokens"]), int(r["prompts"]))


def differing_of(r) -> str:
    return f"{r['differing']:,} of {r['elements']:,}"


def block_bitwise_tokens() -> str:
    t, meta = load_table("03_bitwise_tokens")
    table = pivot_md(t, "training side", ["model", "vLLM mode"], share_ci, "training side", lambda k: f"{k[0]} vs vLLM {k[1]}")
    return "\n\n".join([table, source("03_bitwise_tokens", meta)])


def block_exactness() -> str:
    t, meta = load_table("exactness")
    aligned = t[t.side == "engine-aligned"].set_index(["cpu", "level", "model", "mode"])
    stock = t[t.side == "stock"].set_index(["cpu", "level", "model", "mode"])
    rows = [[f"{cpu}, level {level} (vLLM attention kernel {r['vllm_attention_kernel']})", f"{model} vs vLLM {mode}",
             f"{stock.loc[(cpu, level, model, mode), 'sampled_bitwise']:.1%}", exactness_verdict(r)]
            for (cpu, level, model, mode), r in aligned.iterrows()]
    table = md_table(["CPU", "model", "stock BF16: tokens bitwise", "engine-aligned"], rows)
    p = meta.get("params", {})
    setting = (f"_{p.get('prompts')} held-out prompts x {p.get('samples')} samples of up to {p.get('max_tokens')} tokens "
               "per row (the last run's settings)._")
    return "\n\n".join([table, setting, source("exactness", meta, collected=True)])


MEASURE_MODELS = ("qwen3-tiny", "qwen2-tiny")  # `make measure-example`: rla measure on each, tables/measure-<model>/


def _measure_change(r) -> str:
    """A training side's change against stock in the README's words: the CI, and whether it lies below or above 0."""
    if r["bitwise"] == 1:
        return share_cell(1.0, 1.0, 1.0, int(r["tokens"]), int(r["prompts"])) + " bitwise"
    word = ("lower" if r["change ci_high"] < 0 else "higher" if r["change ci_low"] > 0 else "no change beyond noise")
    return f"{pct_ci(r['change'], r['change ci_low'], r['change ci_high'])} ({word})"


def block_measure() -> str:
    rows, advice, metas = [], [], []
    for model in MEASURE_MODELS:
        t, meta = load_table("measure", TABLES_DIR / f"measure-{model}")
        metas.append(meta)
        for mode, g in t.groupby("mode", sort=False):
            g = g.set_index("training side")
            stock = g.loc["stock BF16"]
            rows.append([model, f"vLLM {mode}", f"{stock['exact']:.3g} [{stock['exact ci_low']:.3g}, {stock['exact ci_high']:.3g}]",
                         *[_measure_change(g.loc[side]) for side in ("RoPE only", "the paper's three regions", "engine-aligned")]])
        advice += [f"{model}: {line}" for line in meta["params"]["advice"] if not line.startswith(" ")]
    p = metas[0]["params"]
    setting = (f"_`rla measure` on `{p['prompts']}` ({p['n_prompts']} prompts x {p['n_samples']} samples "
               f"of up to {p['max_tokens']} tokens; exact KL in nats per token; changes paired against stock on the same "
               f"tokens, 95% intervals over prompts). Its advice:_")
    sources = [source(f"measure-{m}/measure", meta) for m, meta in zip(MEASURE_MODELS, metas)]
    table = md_table(["model", "engine", "stock BF16: exact KL", "RoPE only", "the paper's three regions", "engine-aligned"], rows)
    # the CI gate's line on the first model's scores, as `rla measure ... --max-kl 0` prints it for each side
    first, _ = load_table("measure", TABLES_DIR / f"measure-{MEASURE_MODELS[0]}")
    gates = [f"- `--gate-side \"{side}\" --max-kl 0`: rla measure: {mismatch_report.gate(first, side, 0.0)[1]}"
             for side in (mismatch_report.ENGINE_ALIGNED, "stock BF16")]
    return "\n\n".join([table, setting, "\n".join(f"- {a}" for a in advice),
                         f"_As a CI gate, on {MEASURE_MODELS[0]}'s scores (exit 0 on PASS, 3 on FAIL):_", "\n".join(gates),
                         *sources])


def block_measure_top_p() -> str:
    """`rla measure --top-p` on an embedded model: what the sampler's truncated logprobs add to the gap, as printed."""
    _, meta = load_table("measure", TABLES_DIR / "measure-top-p-qwen3-tiny")
    p = meta["params"]
    setting = (f"_`rla measure --top-p {p['top_p']:g}` on qwen3-tiny, `{p['prompts']}` ({p['n_prompts']} prompts x "
               f"{p['n_samples']} samples of up to {p['max_tokens']} tokens, vLLM {p['modes'][0]}), beside its advice:_")
    lines = [line for line in p["advice"] if line.startswith("Sampled with")]
    return "\n\n".join([setting, "\n".join(f"> {line}" for line in lines),
                         source("measure-top-p-qwen3-tiny/measure", meta)])


def block_where() -> str:
    """`rla where` on the embedded models: each (mode, side, reading)'s first parting, as the command printed it."""
    lines, sources = [], []
    for model in MEASURE_MODELS:
        _, meta = load_table("where", TABLES_DIR / f"where-{model}")
        lines += [f"- {model}: {line}" for line in meta["params"]["first"]]
        sources.append(source(f"where-{model}/where", meta))
    p = meta["params"]
    setting = (f"_`rla where` on the first {p['sequences']} prompts of `{p['prompts']}` (one response each, up to "
               f"{p['max_tokens']} tokens): code, the rounding read from the engine's code; values, every op "
               "teacher-forced:_")
    return "\n\n".join([setting, "\n".join(lines), *sources])


def block_settings() -> str:
    """The environment variables rla_lib reads (`rla_lib.settings`), and those of the tests."""
    rows = [[f"`{name}`", f"`{default}`" if default else "unset", what] for name, (default, what) in VARIABLES.items()]
    rows += [[f"`{name}`", "unset", f"{what} (tests)"] for name, what in TEST_VARIABLES.items()]
    return md_table(["variable", "default", "what it changes"], rows)


def block_op_check() -> str:
    t, meta = load_table("03_op_check")
    a, _ = load_table("03_op_check_attention")
    ops = pivot_md(t, "point", ["model", "training side"], differing_of, "op (every op fed eager vLLM's inputs)",
                   lambda k: f"{k[0]}, {k[1]}")
    kernels = pivot_md(a, "numerics", ["model"], differing_of, "attention numerics, on eager vLLM's q/k/v", lambda k: k[0])
    return "\n\n".join([ops, kernels, source("03_op_check", meta)])


def block_real_shape_notebooks() -> str:
    t, meta = load_table("real_shape_notebooks")
    rows = [[r["notebook"], f"{r['seconds'] / 60:.1f} min"] for _, r in t.iterrows()]
    return "\n\n".join([f"{meta.get('params', {}).get('note', '')} (the target writes this table once every notebook's "
                         "test has passed: it ran, saved its figures and tables, and left no log noise in its cells):",
                         md_table(["notebook", "time"], rows), source("real_shape_notebooks", meta)])


def block_real_shape_results() -> str:
    t, meta = load_table("03_schedule_reductions", TABLES_DIR / "real-shape")
    t = t.reset_index() if "model" not in t.columns else t
    rows = []
    for (model, mode), g in t[t["from"] == "none"].groupby(["model", "mode"], sort=False):
        g = g.set_index("to")
        engine = [c for c in g.index if "attention" in c]
        cells = [change_cell(g.loc[c, "relative"], g.loc[c, "rel_ci_low"], g.loc[c, "rel_ci_high"], g.loc[c, "b"],
                             int(g.loc[c, "n_tokens"]), int(g.loc[c, "n_clusters"])) if c in g.index else ""
                 for c in ("paper", f"schedule_{mode}", engine[0] if engine else None)]
        rows.append([f"{Path(model).name} vs vLLM {mode}", f"{g['a'].iloc[0]:.3g}"] + cells + [f"{int(g['n_clusters'].iloc[0])}"])
    parts = [md_table(["model", "stock exact KL (1e-4)", "paper's regions", "read schedule", "engine-aligned", "prompts"], rows)]
    fewest = int(t["n_clusters"].min())
    if fewest < FEW_PROMPTS:
        parts.append(f"_Intervals from {fewest} prompts, fewer than {FEW_PROMPTS}: a bootstrap over so few covers short of "
                     "95% (tests/test_kl.py measures it at 8, 16 and 32); read them as rough._")
    b, _ = load_table("03_bitwise_tokens", TABLES_DIR / "real-shape")
    parts += ["Response tokens whose training-side logprob is bit for bit the engine's:",
              pivot_md(b, "training side", ["model", "vLLM mode"], share_ci, "training side",
                       lambda k: f"{Path(k[0]).name} vs vLLM {k[1]}"),
              source("real-shape/03_schedule_reductions", meta)]
    return "\n\n".join(parts)


def block_scoring_memory() -> str:
    t, meta = load_table("bench_scoring_memory")
    rows = [[r["case"], "yes" if r["grad"] else "no", f"{r['tokens']:,}", f"{r['peak_gb']:.2f} GB", f"{r['seconds']:.0f} s"]
            for _, r in t.iterrows()]
    ratios = []
    applies = chunked_peak_target_applies(meta["params"]["tokens"], meta["params"]["vocab"])
    for grad, target in ((False, None), (True, CHUNKED_PEAK_TARGET)):
        g = t[t["grad"] == grad].set_index("case")["peak_gb"]
        naive, chunked = (g[[c for c in g.index if c.endswith(p)][0]] for p in ("naive", "chunked"))
        verdict = ""
        if target is not None:
            met = ("met" if chunked / naive <= target else "missed") if applies else "not at this size"
            verdict = f" (target at most {target:.2f}: {met})"
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


def block_engine_settings() -> str:
    t, meta = load_table("engine_settings")
    rows, verdicts = [], []
    for _, r in t.iterrows():
        sampled = "cannot sample: " + r["sampling_error"] if isinstance(r["sampling_error"], str) else f"{r['sampled_bitwise']:.1%}"
        kl = "0 (every term)" if r["kl_all_zero"] is True or r["kl_all_zero"] == "True" else (
            "none (no samples)" if r["exact_kl"] != r["exact_kl"] else f"{r['exact_kl']:.3g}")
        rows.append([r["cpu"], r["level"], f"{r['model']} vs {r['mode']}", r["setting"], sampled, f"{r['rescored_bitwise']:.1%}",
                     kl, f"{int(r['prompts_all_bitwise'])} of {int(r['prompts'])}"])
        could_sample = not isinstance(r["sampling_error"], str)
        exact = is_exact(r) if could_sample else r["rescored_bitwise"] == 1  # the one criterion, on what was measured
        verdicts.append((r["setting"], exact, not could_sample))
    summary = []
    for setting in dict.fromkeys(s for s, _, _ in verdicts):
        mine = [(e, failed) for s, e, failed in verdicts if s == setting]
        words = f"{setting}: exact in {sum(e for e, _ in mine)} of {len(mine)} cells"
        if failed := sum(f for _, f in mine):  # then only re-scoring was compared
            words += f" as re-scored, and could not sample in {failed} of them (the engine build, not the alignment)"
        summary.append(words)
    summary = "; ".join(summary)
    return "\n\n".join([md_table(["CPU", "level", "model vs vLLM", "setting", "tokens bitwise as sampled",
                                   "as re-scored", "exact KL", "prompts all bitwise"], rows),
                         f"Engine-aligned, by setting: {summary}.", source("engine_settings", meta, collected=True)])


def block_split_kv() -> str:
    """Split-KV decode (benchmarks/split_kv.py): the kernel's share of decode calls whose output bits change, by head
    shape, keys and threads; an engine of two threads end to end, split on and off, against the aligned side. Both
    tables collect rows per CPU and level: a column (kernel) or a list (engine) for each."""
    kernel, kmeta = load_table("split_kv_kernel")
    engine, emeta = load_table("split_kv_engine")
    where = list(dict.fromkeys(zip(kernel["cpu"], kernel["level"])))
    shapes = list(dict.fromkeys(kernel["shape"]))
    rows = []
    for (threads, keys), g in kernel.groupby(["threads", "keys"], sort=True):
        g = g.set_index(["cpu", "level", "shape"])
        rows.append([str(threads), str(keys), str(int(g["parts"].iloc[0]))]
                    + [f"{int(g.loc[(*w, s), 'draws_differing'])} of {int(g.loc[(*w, s), 'draws'])}"
                       if (*w, s) in g.index else "" for w in where for s in shapes])
    several_cpus = len({cpu for cpu, _ in where}) > 1
    table = md_table(["threads", "keys", "parts", *[f"{s}, {level}" + (f" ({cpu})" if several_cpus else "")
                                                    for cpu, level in where for s in shapes]], rows)

    def kl(row) -> str:
        return "0" if row["kl_all_zero"] in (True, "True") else format(row["exact_kl"], ".2g")

    parts = ["Draws whose decoded-token attention output has other bits with split-KV on than off, by head shape and "
             "level:", table, source("split_kv_kernel", kmeta, collected=True)]
    for (cpu, level), part in engine.groupby(["cpu", "level"], sort=False):
        e, r = part.set_index(["batch", "split_kv"]), part.iloc[0]
        lines = []
        for batch in sorted(set(part["batch"])):
            on, off = e.loc[(batch, True)], e.loc[(batch, False)]
            keys = f" (at {on['keys_where_differing']} keys)" if int(on["tokens_differing"]) else ""
            lines.append(f"- {'each prompt alone' if batch == 1 else f'{batch} prompts a step'}: "
                         f"{int(on['tokens_differing'])} of {int(on['tokens_compared'])} sampled logprobs differ between "
                         f"split on and off{keys}; engine-aligned is bitwise on {on['sampled_bitwise']:.2%} of sampled "
                         f"tokens with it on ({int(on['prompts_all_bitwise'])} of {int(on['prompts'])} prompts, exact KL "
                         f"{kl(on)}) and {off['sampled_bitwise']:.2%} with it off (exact KL {kl(off)}); "
                         f"{on['seconds']:.1f} s on, {off['seconds']:.1f} s off")
        parts += [f"_{cpu}, level {level} (vLLM's {r['vllm_attention_kernel']} attention): {r['model']}, vLLM {r['mode']} "
                  f"on {int(r['engine_threads'])} threads, {int(r['prompts'])} prompts, up to "
                  f"{emeta['params']['max_tokens']} tokens each:_", "\n".join(lines)]
    return "\n\n".join([*parts, source("split_kv_engine", emeta, collected=True)])


def block_fsdp_engine() -> str:
    t, meta = load_table("fsdp_engine")
    rows = [[r["arm"], int(r["step"]), f"{int(r['response_tokens'])}", f"{r['bitwise']:.1%}", f"{r['max_abs_diff']:.3g}"]
            for _, r in t.iterrows()]
    r0 = t.iloc[0]
    aligned = t[t["arm"] == "engine-aligned"]
    verdict = (f"engine-aligned under FSDP2 is the engine's, bit for bit, at all {len(aligned)} steps"
               if ((aligned["bitwise"] == 1) & (aligned["max_abs_diff"] == 0)).all() and len(aligned)
               else "engine-aligned under FSDP2 is NOT the engine's at every step")
    return "\n\n".join([f"{r0['world_size']} processes (gloo), {r0['rows']} responses; each step's weights in the engine "
                         f"before it scores: {verdict}.", md_table(["training side", "step", "response tokens",
                                                                     "bitwise the engine's", "largest difference"], rows),
                         source("fsdp_engine", meta)])


def block_trl() -> str:
    t, meta = load_table("trl_mismatch")
    first = t[t["step"] == t["step"].min()].set_index("arm")
    stock = first.loc["stock", "mismatch/exact_kl"]
    rows = [[arm, r["positions"], f"{r['mismatch/k1']:.3g}", f"{r['mismatch/k3']:.3g}", f"{r['mismatch/exact_kl']:.3g}",
             "to 0 (every token bitwise)" if r["mismatch/exact_kl"] == 0 and r["sampling/sampling_logp_difference/max"] == 0
             else pct(r["mismatch/exact_kl"] / stock - 1, 2), f"{r['sampling/sampling_logp_difference/mean']:.3g}",
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
        pm = lambda m, mean=".3f", se=".3f": (f"{r[m + ' mean']:{mean}} ± {r[m + ' se']:{se}}" if r["seeds"] > 1
                                              else f"{r[m + ' mean']:{mean}} (one seed)")
        row = [r["sweep"], r["config"], f"{int(r['degraded'])}/{int(r['seeds'])}", f"{int(r['diverged'])}/{int(r['seeds'])}",
               f"{r['eval acc first mean']:.3f} → " + pm("eval acc last")]
        if policy:
            has = r["eval acc policy last mean"] == r["eval acc policy last mean"] and r["config"].endswith("rollouts")
            row.append(pm("eval acc policy last") if has else "")
        row.append(pm("k3 mean (1e-4)", ".3g", ".2g"))
        rows.append(row)
    header = ["sweep", "configuration", "degraded", "diverged at once", "held-out accuracy start → last (mean ± se over seeds)"]
    header += ["trained BF16 policy, last"] if policy else []
    header += ["mismatch k3 (1e-4/token)"]
    problems = (", ".join(f"{int(n)} ({', '.join(dict.fromkeys(g['sweep']))})" for n, g in t.groupby("eval problems"))
                if "eval problems" in t else p.get("eval_prompts"))
    head = (f"Held-out accuracy on {problems} problems at T=1; degraded = peaked after step 0, then ended below "
            "the peak by more than two combined binomial standard errors; diverged at once = never beat step 0 and ended below it "
            "by that margin.")
    sweep = (f"_Histories: `data/grpo_sweep/{p.get('file')}` (written {str(p.get('written', '?'))[:10]}, commit "
             f"{p.get('commit')})._")
    return "\n\n".join([head, md_table(header, rows), sweep, source("06_sweep", meta)])


def _bitwise_steps(rows) -> str:
    """Exactly on-policy steps, "k of n"; by sweep too where the arm was bitwise on some of its steps only."""
    k, n = int(rows["bitwise_steps"].sum()), int(rows["steps"].sum())
    if k in (0, n) or "sweep" not in rows.index.names:
        return f"{k} of {n}"
    return f"{k} of {n} (" + ", ".join(f"{sweep} {_bitwise_steps(r.droplevel('sweep'))}"
                                     for sweep, r in rows.groupby(level="sweep", sort=False)) + ")"


def block_study_cost() -> str:
    """The registered study's largest plan in core-hours per stage-0 candidate (experiments/collapse_study.py)."""
    t, meta = load_table("06_study_cost")
    cores = meta.get("machine", {}).get("cpu_count") or 1
    rows = [[r["candidate"].removeprefix("stage0-"), f"{r['fp32_step_s']:.1f}",
             f"{r['bf16_step_s']:.1f}" + ("" if r["bf16_measured"] else " (taken as FP32's)"),
             *(f"{r[f'{stage}_core_hours']:.0f}" for stage in ("edge", "q1", "q2", "q3")), f"{r['core_hours']:.0f}",
             f"{r['core_hours'] / cores / 24:.1f}"] for _, r in t.iterrows()]
    header = ["stage-0 candidate", "FP32 step, s", "BF16 step, s", "edge", "Q1 (dose)", "Q2 (edge shift)",
              "Q3 (long)", "core-hours in all", f"days on {cores} cores"]
    return "\n\n".join([md_table(header, rows), (kept_note(t, "candidate") + " " + source("06_study_cost", meta)).strip()])


def block_study_progress() -> str:
    """The registered study's gating stages as they stand: the edge search's runs and what they found, and the
    calibrated dose of every rung of Q1's ladder (experiments/collapse_study.py --tables)."""
    edge, edge_meta = load_table("06_study_edge")
    calibration, calibration_meta = load_table("06_study_calibration")
    edge_rows = [[f"{r['lr']:.3g}", int(r["seed"]), f"{r['first']:.3f} → {r['peak']:.3f} → {r['last']:.3f}",
                  f"yes, at step {int(r['collapse_step'])}" if r["collapsed"] else "no"]
                 for _, r in edge.sort_values(["lr", "seed"]).iterrows()]
    parts = [edge_meta.get("params", {}).get("found", "")]
    if edge_rows:
        parts += [md_table(["step size", "seed", "held-out accuracy first → peak → last", "collapsed"], edge_rows)]
    parts.append(source("06_study_edge", edge_meta))
    if len(calibration):
        paper_like = calibration_meta.get("params", {}).get("paper_like_dose")
        times = lambda x: f"{x:.3g}" if x < 1000 else f"{x:,.0f}"
        rows = [[r["rung"], f"{r['dose']:.3g}", times(r["times_natural"]), f"{r['times_paper_like']:.3g}",
                 "yes" if r["in_q1"] else "no"] for _, r in calibration.iterrows()]
        ran = calibration[calibration["in_q1"].astype(bool)]
        natural = calibration.loc[calibration["rung"] == "default BF16", "times_paper_like"]
        said = (f"Q1 runs {len(ran)} of the {len(calibration)} rungs, up to “{ran['rung'].iloc[-1]}” "
                f"({ran['dose'].iloc[-1]:.3g} nats per response), the first past the paper-like {paper_like:g}. "
                if len(ran) else "Q1's rungs are set once every rung is calibrated. ")
        if len(natural):
            said += f"The natural BF16 mismatch is {natural.iloc[0]:.2g} of the paper-like dose."
        parts += [said, md_table(["rung", "dose (nats per response)", "x natural BF16", "x paper-like", "in Q1"], rows),
                  source("06_study_calibration", calibration_meta)]
    return "\n\n".join(part for part in parts + q1_so_far() + study_cost_so_far() if part)


def study_cost_so_far() -> list[str]:
    """Each stage's runs planned now and finished, the core-hours they took and the core-hours its runs left would
    take at the median step of its finished ones (tables/06_study_plan.csv), on the CPUs the runs ran on."""
    plan, meta = study_plan()
    if not len(plan) or "core_hours_spent" not in plan:
        return []
    hours = lambda x: "not known yet" if x != x else f"{x:.1f}"
    rows = [[stage, int(r["planned"]), int(r["finished"]), hours(r["core_hours_spent"]), hours(r["core_hours_left"])]
            for stage, r in plan.iterrows()]
    cpus = meta.get("params", {}).get("ran_on", [])
    said = (f"What the runs have cost so far, in core-hours of training steps (one run per core; evaluations not "
            f"counted), run on {', '.join(cpus) or 'no machine yet'}; what the runs planned now have left, at the "
            "median step of the stage's finished runs (later plans add runs, e.g. Q1's bracket seeds):")
    return [said, md_table(["stage", "runs planned now", "finished", "core-hours spent", "core-hours left"], rows),
            source("06_study_plan", meta)]


def q1_so_far() -> list[str]:
    """Q1's finished runs per rung and TIS arm (tables/06_study_q1.csv): counts with exact intervals, and whether its
    registered test has run (it waits for every planned run); nothing before its first run."""
    try:
        q1, meta = load_table("06_study_q1")
    except FileNotFoundError:
        return []
    params = meta.get("params", {})
    rows = [[r["rung"], "yes" if r["tis"] else "no", int(r["seeds"]), f"{r['dose']:.3g}",
             f"{int(r['collapses'])} of {int(r['seeds'])} [{r['ci_low']:.0%}, {r['ci_high']:.0%}]", f"{r['last']:.3f}"]
            for _, r in q1.iterrows()]
    said = (f"Q1's runs so far: {int(q1['seeds'].sum())} finished, {len(params.get('missing', []))} planned still to "
            "run; " + ("its registered test has run (the verdicts: the front page)." if params.get("test_run") else
                       "counts only: its registered test waits for every planned run."))
    return [said, md_table(["rung", "TIS", "seeds", "dose (nats per response)", "collapsed [exact 95% CI]",
                            "held-out accuracy, last (mean)"], rows), source("06_study_q1", meta)]


def block_collapse() -> str:
    rates, meta = load_table("06_collapse")
    design, _ = load_table("06_collapse_design")
    step_sizes, step_sizes_meta = load_table("06_collapse_step_sizes")
    rates = rates.set_index(["sweep", "config"])
    arms = [a for a in ("default BF16", "default BF16 + TIS", *collapse.ALIGNED_ARMS, "FP32 control")
            if a in rates.index.get_level_values(1)]
    rows = []
    for sweep in dict.fromkeys(rates.index.get_level_values(0)):
        g = rates.loc[sweep]
        cells = [f"{int(g.loc[a, 'collapses'])}/{int(g.loc[a, 'seeds'])} [{g.loc[a, 'ci_low']:.0%}, {g.loc[a, 'ci_high']:.0%}]"
                 if a in g.index else "" for a in arms]
        shown = g.loc[[a for a in arms if a in g.index]]
        rose = f"{int(shown['rose_first'].sum())}/{int(shown['seeds'].sum())}"
        rows.append([sweep, *cells, rose, collapse.verdict(rates, sweep)])
    d = design.set_index("quantity")["value"].to_dict()
    flat = design[design["quantity"].str.startswith("flat runs called")]
    collapsed = flat[flat["quantity"].str.contains("collapsed")]
    degraded = flat[flat["quantity"].str.contains("degraded")]
    runs = int(meta["params"]["runs"])
    facts = [
        "On flat runs (simulated evaluations at each schedule above, " + (
            f"{runs:,} each) the collapse definition never fired (exact 95% upper bound {collapsed['ci_high'].max():.3%})"
            if collapsed["value"].max() == 0 else
            f"{runs:,} each) the collapse definition fired at most {collapsed['value'].max():.2%} of the time "
            f"(upper bound {collapsed['ci_high'].max():.3%})") +
        f"; the sweep's \"degraded\" flag fired in {degraded['value'].min():.1%} to {degraded['value'].max():.1%} of them.",
        f"Seed SD of final accuracy: {d['seed SD of final accuracy']:.3f}; with 3 seeds per arm a fall smaller than "
        f"{d['smallest detectable fall in final accuracy, 3 seeds per arm']:.3f} goes unseen "
        f"({d['smallest detectable fall in final accuracy, 5 seeds per arm']:.3f} with 5).",
        f"Collapses that followed a rise (the paper's pattern): {int(rates['rose_then_collapsed'].sum())} of "
        f"{int(rates['collapses'].sum())}; the runs that collapsed fell from their starting accuracy (a step size too "
        "large for every arm), so the paper's regime, runs that learn and then collapse, is still to be found."
        if rates["rose_then_collapsed"].sum() == 0 else
        f"Collapses that followed a rise (the paper's pattern): {int(rates['rose_then_collapsed'].sum())} of "
        f"{int(rates['collapses'].sum())}.",
        ("Training steps exactly on-policy (every sampled token's training-side logprob equal to the engine's): " + "; ".join(
            f"{config} {_bitwise_steps(g)}"
            for config, g in rates.groupby(level="config", sort=False) if config in arms) + "."
         if "bitwise_steps" in rates else ""),
        f"Does collapse follow the step size? {collapse.step_size_verdict(step_sizes)}.",
        "Seeds per arm the study needs: " + "; ".join(f"{q.removeprefix('seeds per arm to ')} {int(v)}"
                                                     for q, v in d.items() if q.startswith("seeds per arm") and v == v) + ".",
    ]
    learned, learning_meta = load_table("06_learning")
    warning, warning_meta = load_table("06_collapse_warning")
    header = ["sweep", *[f"{a}: collapsed" for a in arms], "runs that rose first (peak after step 0)", "verdict"]
    return "\n\n".join([md_table(header, rows), learning_sentence(learned), *facts,
                        warning_sentence(warning, warning_meta["params"]), source("06_learning", learning_meta),
                        source("06_collapse", meta), source("06_collapse_step_sizes", step_sizes_meta),
                        source("06_collapse_warning", warning_meta)])


def learning_sentence(learned) -> str:
    """Does the FP32 control learn (`06_learning`)? Without a rise there is nothing to collapse from."""
    best = learned.loc[learned["gain"].idxmax()]
    return (f"First, learning (`collapse.learning`): the FP32 control's held-out accuracy over the second half of a run "
            f"beat its step 0 by more than two binomial standard errors in {int(learned['learned'].sum())} of "
            f"{len(learned)} runs; the largest gain, {best['sweep']} seed {int(best['seed'])}: {best['first']:.3f} → "
            f"{best['late']:.3f} ({best['gain']:+.3f} ± {best['gain_se']:.3f}; peak {best['peak']:.3f}).")


def warning_sentence(warning, params) -> str:
    """The warning sign's answer from `06_collapse_warning`: per mismatch column, warned collapses and false alarms."""
    w = warning.set_index(["mismatch", "config"])
    parts = []
    for column in dict.fromkeys(w.index.get_level_values(0)):
        a = w.loc[(column, "all runs")]
        hits = (f"it came before {int(a['warned'])} of {int(a['collapsed runs'])} collapses "
                f"[{a['warned ci_low']:.0%}, {a['warned ci_high']:.0%}]"
                + (f", a median {a['median lead (steps)']:.0f} steps ahead" if a["warned"] else "")
                if a["collapsed runs"] else "no run that logged it collapsed")
        parts.append(f"{collapse.MISMATCH_NAMES.get(column, column)}: {hits}; it fired in {int(a['false alarms'])} of "
                     f"{int(a['other runs'])} runs that did not collapse [{a['false alarm ci_low']:.0%}, "
                     f"{a['false alarm ci_high']:.0%}]")
    text = (f"The warning sign (`collapse.mismatch_alarm`: the mismatch's median over {params['window']} steps reaches "
            f"{params['rise']:g}x its first {params['window']} steps'), " + "; ".join(parts) + ".")
    fp32 = w.loc[(w.index.get_level_values(0)[0], "FP32 control")] if (w.index.get_level_values(0)[0], "FP32 control") in w.index else None
    if fp32 is not None and fp32["collapsed runs"] > 0:
        text += (f" The FP32 control, with no mismatch to rise, collapsed {int(fp32['collapsed runs'])} times: here a "
                 "rising gap went with a collapse, it was not needed for one.")
    return text


def block_dose_response() -> str:
    arms, meta = load_table("06_dose_arms")
    fits, fits_meta = load_table("06_dose_threshold")
    marks, _ = load_table("06_dose_references")
    versus = "final vs default BF16 "  # each arm minus default BF16 on the same seeds (dose_response.versus_reference)

    def against(r):
        return "" if math.isnan(r[versus + "diff"]) else (
            f"{r[versus + 'diff']:+.3f} [{r[versus + 'ci_low']:+.3f}, {r[versus + 'ci_high']:+.3f}] {r[versus + 'verdict']}")

    dose = dose_response.DOSE
    rows = [[r["config"], f"{r[dose]:.2g} ± {r[dose + ' se']:.1g}", f"{r['exact_kl']:.3g}",
             f"{r['acc_first']:.3f} → {r['acc_peak']:.3f} → {r['acc_last']:.3f} ± {r['acc_last se']:.3f}",
             f"{r['acc_worst_after_peak']:.3f} ± {r['acc_worst_after_peak se']:.3f}", against(r),
             f"{int(r['degraded'])}/{int(r['seeds'])}", f"{int(r['diverged'])}/{int(r['seeds'])}"] for _, r in arms.iterrows()]
    header = ["arm", "mismatch per response at the first step (nats)", "exact KL, run mean (1e-4/token)",
              "accuracy start → peak → final (± se)", "worst after peak",
              "final minus default BF16's, same seed (95% t interval)", "degraded", "diverged at once"]
    lower = arms[arms[versus + "verdict"] == "lower"]["config"].tolist()
    lines = ["Against default BF16 on the same seeds: " + (
        f"final accuracy lower beyond seed noise for {', '.join(lower)}" if lower else
        "no arm's final accuracy is lower beyond seed noise") + f" (t intervals over {int(arms['seeds'].max())} seeds); "
        f"the smallest fall these seeds find 4 times in 5 is {arms[versus + 'detectable'].max():.3f}."]
    lines.append(dose_response.tis_verdict(fits))
    verdicts = dose_response.verdict_table(fits, worst_after_peak=True)
    positions = dose_response.mark_table(fits, marks.to_dict("records"))
    return "\n\n".join([md_table(header, rows), "\n".join(f"- {line}" for line in lines),
                          md_table(list(verdicts.columns), verdicts.values.tolist()),
                          md_table(list(positions.columns), positions.values.tolist()),
                          source("06_dose_arms", meta) + " " + source("06_dose_threshold", fits_meta)])


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
    "collapse": measured_by(".venv/bin/python experiments/collapse_design.py", block_collapse),
    "study-cost": measured_by(".venv/bin/python experiments/collapse_study.py --tables", block_study_cost),
    "study-progress": measured_by(".venv/bin/python experiments/collapse_study.py --tables", block_study_progress),
    "grpo-step": measured_by("make bench", block_grpo_step),
    "study-step": measured_by("benchmarks/grpo_step.py --model qwen3-tiny-steps-hot --task steps --max-tokens 112 "
                              "--prompts 32 --group-size 16 --steps 4 --precision fp32 (and bf16; one thread)",
                              block_study_step),
    "engine-start": measured_by(".venv/bin/python benchmarks/engine_start.py", block_engine_start),
    "bf16-matmul": measured_by("make bench", block_bf16_matmul),
    "isa-spread": block_isa_spread,
    "speed": measured_by("make bench && make run-all", block_speed),
    "bitwise-tokens": measured_by("make run-all (notebook 03b)", block_bitwise_tokens),
    "op-check": measured_by("make run-all (notebook 03b)", block_op_check),
    "exactness": measured_by(".venv/bin/python benchmarks/exactness.py", block_exactness),
    "front-gap": block_front_gap,
    "front-exactness": measured_by(".venv/bin/python benchmarks/exactness.py", block_front_exactness),
    "front-study": measured_by(".venv/bin/python experiments/grpo_sweep.py --stage0-table", block_front_study),
    "measure": measured_by("make measure-example", block_measure),
    "where": measured_by("make measure-example", block_where),
    "measure-top-p": measured_by("make measure-example", block_measure_top_p),
    "settings": block_settings,
    "real-shape-results": measured_by("make test-real-shape", block_real_shape_results),
    "real-shape-notebooks": measured_by("make test-real-shape", block_real_shape_notebooks),
    "scoring-memory": measured_by(".venv/bin/python benchmarks/scoring_memory.py", block_scoring_memory),
    "fsdp": measured_by("make fsdp-grpo", block_fsdp),
    "engine-settings": measured_by(".venv/bin/python benchmarks/engine_settings.py", block_engine_settings),
    "split-kv": measured_by(".venv/bin/python benchmarks/split_kv.py", block_split_kv),
    "fsdp-engine": measured_by(".venv/bin/python experiments/fsdp_grpo.py --engine", block_fsdp_engine),
    "trl": measured_by(".venv/bin/python experiments/trl_grpo.py", block_trl),
    "suite-time": measured_by(".venv/bin/python benchmarks/fresh_clone_test.py", block_suite_time),
    "suite-repeats": measured_by(".venv/bin/python benchmarks/fresh_clone_test.py --repeat 3 [--load]", block_suite_repeats),
}


def render(text: str, blocks=BLOCKS) -> tuple[str, list[str]]:
    """`text` with every known block re-rendered; also the names of blocks whose content changed."""
    changed = []

    def one(m):
        name = m.group(2)
        if name not in blocks:
            raise KeyError(f"README block {name!r} has no renderer in tools.readme.BLOCKS ({', '.join(blocks)})")
        body = blocks[name]().strip() + "\n"
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report blocks that are out of date (exit 1 if any)")
    parser.add_argument("--pages", type=Path, nargs="*", default=PAGES, help="the pages to render (default: all)")
    args = parser.parse_args(argv)
    stale = []
    for page in args.pages:
        new, changed = render(page.read_text())
        stale += [f"{page.name}: {name}" for name in changed]
        if changed and not args.check:
            atomic_write(page, lambda tmp: tmp.write_text(new))
    if args.check:
        if stale:
            print(f"blocks out of date with tables/: {', '.join(stale)}; run `make readme`", file=sys.stderr)
        return 1 if stale else 0
    print(f"{len(stale)} block(s) rewritten" + (f" ({', '.join(stale)})" if stale else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
