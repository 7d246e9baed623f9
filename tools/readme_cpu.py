"""README blocks about CPU kinds: the gap and exactness at each instruction-set level (notebook 07) and the BF16
matmul's speed and bits per level (`benchmarks/bf16_matmul.py`)."""

from __future__ import annotations

from rla_lib.report import load_table, md_table, pct_ci, share_cell, source
from rla_lib.studies import spread


def block_isa_spread() -> str:
    t, meta = load_table("07_isa_spread")
    rows, verdicts = [], []
    for _, r in t.iterrows():
        rows.append([f"{r['model']} vs {r['mode']}", r["level"], r["cpu_capability"], r["bf16_matmul"],
                     f"{r['stock']:.3g} [{r['stock ci_low']:.3g}, {r['stock ci_high']:.3g}]",
                     f"{r['paper']:.3g} ({pct_ci(r['stock->paper'], r['stock->paper ci_low'], r['stock->paper ci_high'])})",
                     f"{r['schedule']:.3g} ({pct_ci(r['stock->schedule'], r['stock->schedule ci_low'], r['stock->schedule ci_high'])})",
                     pct_ci(r["paper->schedule"], r["paper->schedule ci_low"], r["paper->schedule ci_high"]),
                     engine_aligned_cell(r)])
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
    if "engine-aligned" in t:
        exact = spread.engine_aligned_exact(t)
        verdicts.append(f"engine-aligned: every token bitwise the engine's (KL 0) in {exact.sum()} of {len(exact)} (model, mode, "
                        f"level) cells, at {', '.join(dict.fromkeys(t.loc[exact[exact].index, 'level'])) or 'no level'}")
    header = ["model vs vLLM mode", "ISA level", "torch kernels", "training BF16 matmul", "stock", "paper's regions",
              "read schedule", "schedule vs paper", "engine-aligned"]
    return "\n\n".join([md_table(header, rows), "; ".join(verdicts) + ".", source("07_isa_spread", meta)])


def engine_aligned_cell(r) -> str:
    """The engine-aligned side at one level: its exactness (exact bound where every token is bitwise) and attention."""
    if "engine-aligned" not in r or r["engine-aligned"] != r["engine-aligned"]:  # an older table, or no kernel to copy
        return ""
    share = share_cell(r["engine-aligned bitwise"], r["engine-aligned bitwise ci_low"], r["engine-aligned bitwise ci_high"],
                       int(r["tokens"]), int(r["prompts"]))
    kl = "KL 0" if r["engine-aligned"] == 0 else f"KL {r['engine-aligned']:.3g}"
    return f"{kl}; bitwise: {share}; attention {r['engine attention']}"


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
