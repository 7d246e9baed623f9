"""What `rla measure` reports for a model and its prompts: per engine mode, the mismatch of each training side
(stock BF16, each of the paper's regions alone, the three together, aligned to where the engine rounds), its change
against stock on the same tokens, the share of tokens bit for bit the engine's, and which configuration to use.

    run = measure(model, modes, training_configs=configs(model, modes), prompts=...)
    df = summary(run, modes)          # one row per (mode, training side), CIs over prompts
    print("\n".join(advice(df)))      # per mode: the configuration to use, or that none helps beyond noise
    masquerade_lines(run, modes, group_size)   # what only looks like mismatch (none on a clean run)
    sampling_lines(run, modes)                 # with top-p / top-k: the sampler's logprobs against the full softmax
"""

from __future__ import annotations

import pandas as pd
import torch

from . import sides
from .align import REGIONS
from .align.monitor import masquerades
from .engine_align import engine_schedule_from_code
from .align.schedule import schedule_to_align_kwargs
from .kl import FEW_PROMPTS
from .mismatch_run import MismatchRun
from .sides import config_name
from .report import pct_ci, share_cell

# label -> training configuration name (`sides.config_name`), the engine-aligned one per mode
SIDES = {"stock BF16": "none", "RoPE only": "rope", "SwiGLU only": "swiglu", "residual RMSNorm only": "residual_norm",
         "the paper's three regions": config_name(REGIONS)}
ENGINE_ALIGNED = "engine-aligned"
HOW = {"stock BF16": "nothing to change", "RoPE only": 'rla_lib.aligned(model, ("rope",))',
       "SwiGLU only": 'rla_lib.aligned(model, ("swiglu",))', "residual RMSNorm only": 'rla_lib.aligned(model, ("residual_norm",))',
       "the paper's three regions": "rla_lib.aligned(model, rla_lib.REGIONS)",
       ENGINE_ALIGNED: "rla_lib.align_to_engine(model, engine), or the file `rla schedule` writes where the engine runs"}


HEADER = ["mode", "training side", "k1 (gap)", "k3", "exact KL", "change vs stock", "tokens bitwise"]  # the table's


def engine_config(mode: str) -> str:
    return f"schedule_{mode}"


def configs(model, modes, engine_aligned: bool = True) -> dict:
    """The training configurations to measure (name -> (regions, options)): the stock side, the paper's regions, and
    per mode the engine's own schedule (`engine_schedule_from_code`: the measurement itself says how exact it is)."""
    out = {name: (tuple(r for r in REGIONS if r in name.split("+")), {}) for name in SIDES.values()}
    if engine_aligned:
        out |= {engine_config(m): schedule_to_align_kwargs(engine_schedule_from_code(model, m)) for m in modes}
    return out


def side_labels(run: MismatchRun, mode: str) -> dict[str, str]:
    """The training sides measured against `mode`: label -> side name in the run (engine-aligned where scored)."""
    labels = {label: sides.training(name) for label, name in SIDES.items()}
    engine_side = sides.training(engine_config(mode))
    if engine_side in run.token_lp:
        labels[ENGINE_ALIGNED] = engine_side
    return labels


def _row(run: MismatchRun, inference: str, label: str, side: str, n_boot: int, seed: int) -> dict:
    estimators = run.estimators_for(inference, side)
    row = {"training side": label, "side": side}
    for e in estimators:
        est = run.estimate(inference, side, e, n_boot, seed)
        row |= {e: est.value * est.unit, f"{e} ci_low": est.ci_low * est.unit, f"{e} ci_high": est.ci_high * est.unit}
    change_by = "exact" if "exact" in estimators else "k3"  # a KL >= 0 per prompt: its relative change is a ratio
    if side != sides.STOCK:
        d = run.difference(inference, sides.STOCK, side, change_by, n_boot, seed)
        row |= {"change by": change_by, "change": d.relative, "change ci_low": d.rel_ci_low,
                "change ci_high": d.rel_ci_high, "lower than stock": bool(d.diff_ci_high < 0)}
    share = run.bitwise_share(inference, side, n_boot, seed)
    return row | {"bitwise": share.value, "bitwise ci_low": share.ci_low, "bitwise ci_high": share.ci_high,
                  "tokens": share.n_tokens, "prompts": share.n_clusters}


def summary(run: MismatchRun, modes, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per (engine mode, training side): k1 (the mean logprob gap, `sampled`), k3 and the exact KL where the
    run has it, in nats per token with 95% CIs over prompts; the paired relative change against stock BF16 (exact
    KL, else k3) and whether its CI lies below zero; the share of tokens whose logprob is the engine's bit for bit."""
    rows = [{"mode": m} | _row(run, sides.engine(m), label, side, n_boot, seed)
            for m in modes for label, side in side_labels(run, m).items()]
    return pd.DataFrame(rows)


def _kl_cell(r, e: str) -> str:
    if e not in r or pd.isna(r[e]):
        return "-"
    if r[e] == r[f"{e} ci_low"] == r[f"{e} ci_high"] == 0:  # every term 0: a count, not a zero-width interval
        return f"0 on all {int(r['tokens']):,} tokens"
    if r[f"{e} ci_low"] == r[f"{e} ci_high"]:  # every prompt alike: no interval to give, and none of zero width
        return f"{r[e]:.3g} (alike on every prompt)"
    return f"{r[e]:.3g} [{r[f'{e} ci_low']:.3g}, {r[f'{e} ci_high']:.3g}]"


def row_cells(r) -> list[str]:
    """One summary row as the printed table's cells (`HEADER`)."""
    kl_cells = [_kl_cell(r, e) for e in ("sampled", "k3", "exact")]
    change = ("-" if pd.isna(r.get("change")) else "to 0 on every token" if r[r["change by"]] == 0
              else pct_ci(r["change"], r["change ci_low"], r["change ci_high"]))
    share = share_cell(r["bitwise"], r["bitwise ci_low"], r["bitwise ci_high"], int(r["tokens"]), int(r["prompts"]))
    return [r["mode"], r["training side"], *kl_cells, change, share]


def text_table(df: pd.DataFrame) -> str:
    """The summary as an aligned text table (nats per token; the change is relative, against stock BF16)."""
    cells = [HEADER] + [row_cells(r) for _, r in df.iterrows()]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def masquerade_lines(run: MismatchRun, modes, group_size: int) -> list[str]:
    """What only looks like mismatch between each engine mode and stock BF16 on this run's tokens
    (`align.monitor.masquerades`, each sequence's `group_size` responses a group): one line each, none on a clean run."""
    lengths, offsets = run.lengths, run.offsets
    width = int(lengths.max()) if len(lengths) else 0

    def padded(flat):
        out = torch.zeros(len(lengths), width, dtype=torch.float64)
        for i, (a, n) in enumerate(zip(offsets[:-1], lengths)):
            out[i, :n] = torch.from_numpy(flat[a:a + n].astype("float64"))
        return out

    mask = (torch.arange(width)[None] < torch.as_tensor(lengths)[:, None]).double()
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(run.sequences, run.starts)):
        ids[i, :lengths[i]] = torch.as_tensor(seq[start + 1:])
    stock = padded(run.token_lp[sides.STOCK])
    # the re-scored logprobs: the sampler's, under truncation, are one-sided and exactly 0 wherever the nucleus held one
    # token, which `sampling_lines` measures as what it is
    return [f"vLLM {mode}: not rounding: {message}" for mode in modes
            for message in masquerades(padded(run.token_lp[sides.engine(mode)]), stock, mask, ids, group_size).values()]


def truncation(run: MismatchRun) -> str:
    """How the run's sampler truncated its distribution ("top_p 0.9", "top_k 20, top_p 0.9"), or "" (not at all)."""
    return ", ".join(f"{k} {run.meta[k]:g}" for k in ("top_k", "top_p") if k in run.meta)


def sampling_lines(run: MismatchRun, modes, n_boot: int = 2000, seed: int = 0) -> list[str]:
    """Where the sampler truncated (top-k / top-p), what that does to the gap a trainer sees: vLLM returns each sampled
    token's logprob under the truncated, renormalised distribution, while the trainer scores the full softmax. On
    the same tokens: the sampler's logprobs minus the engine's re-scored (full) ones, and stock BF16's k1 gap against
    each, with 95% intervals over prompts. Empty where nothing was truncated."""
    how, sampler, full = truncation(run), sides.sampled(modes[0]), sides.engine(modes[0])
    if not how or sampler not in run.token_lp:
        return []
    nats = lambda e: f"{e.value * e.unit:.3g} [{e.ci_low * e.unit:.3g}, {e.ci_high * e.unit:.3g}]"
    bias = run.estimate(sampler, full, "sampled", n_boot, seed)
    against_sampler = run.estimate(sampler, sides.STOCK, "sampled", n_boot, seed)
    against_full = run.estimate(full, sides.STOCK, "sampled", n_boot, seed)
    return [f"Sampled with {how}: vLLM's sampler returns logprobs of the truncated distribution, renormalised, "
            f"{nats(bias)} nats per token above the full softmax on these tokens (95% over prompts). A trainer that "
            f"compares its logprobs with the sampler's sees that as mismatch: stock BF16's k1 gap is {nats(against_sampler)} "
            f"against the sampler's logprobs and {nats(against_full)} against the full distribution. That part is not "
            "rounding: score the importance ratio against the untruncated distribution (re-scored logprobs), or apply "
            "the same truncation to the trainer's logits."]


def _counted(row) -> str:
    """": N tokens of P prompts" where the row counts them, else nothing."""
    return f": {int(row['tokens']):,} tokens of {int(row['prompts'])} prompts" if "tokens" in row and "prompts" in row else ""


def gate(df, side: str, max_kl: float) -> tuple[bool, str]:
    """A trainer's CI check on a `summary`: does `side`'s mismatch stay within `max_kl` (nats per token) in every engine
    mode? The exact KL where the run has it, else k3; the estimate is compared (its interval is reported beside it).
    Returns (passed, one line saying why)."""
    rows = df[df["training side"] == side]
    if rows.empty:
        raise ValueError(f"no training side {side!r} in this measurement (sides: {', '.join(dict.fromkeys(df['training side']))})")
    worst, verdicts = None, []
    for _, r in rows.iterrows():
        e = "exact" if r["exact"] == r["exact"] else "k3"  # NaN: no exact KL in this run
        value = (f"0 nats per token (0 on every token{_counted(r)})" if r[e] == 0 and r[f"{e} ci_high"] == 0 else
                 f"{r[e]:.3g} [{r[f'{e} ci_low']:.3g}, {r[f'{e} ci_high']:.3g}] nats per token")  # no zero-width interval
        verdicts.append((r[e] > max_kl, r[e], f"{side} vs vLLM {r['mode']}: {'exact KL' if e == 'exact' else 'k3'} {value}"))
        worst = verdicts[-1] if worst is None or verdicts[-1][1] > worst[1] else worst
    failed = [text for over, _, text in verdicts if over]
    if failed:
        return False, f"FAIL: {'; '.join(failed)} > --max-kl {max_kl:g}"
    return True, f"PASS: {worst[2]} <= --max-kl {max_kl:g} (the largest of {len(verdicts)} mode(s))"


def advice(df: pd.DataFrame) -> list[str]:
    """Per mode, computed from the rows: the configuration to use (the lowest mismatch among those whose paired change
    lies below zero; bit for bit beats any estimate), or that none lowers it beyond the prompt-to-prompt noise."""
    lines = []
    for mode, rows in df.groupby("mode", sort=False):
        fewest = int(rows["prompts"].min())
        exact = rows[(rows["bitwise"] == 1) & (rows["training side"] != "stock BF16")]
        better = rows[rows.get("lower than stock", pd.Series(False, index=rows.index)).fillna(False).astype(bool)]
        if len(exact):
            r = exact.iloc[0]
            lines.append(f"vLLM {mode}: use {r['training side']} ({HOW[r['training side']]}): every one of "
                         f"{int(r['tokens']):,} response tokens of {int(r['prompts'])} prompts scores bit for bit as the "
                         "engine's (zero mismatch)")
        elif len(better):
            by = better["change by"].iloc[0]
            r = better.loc[better[by].idxmin()]
            lines.append(f"vLLM {mode}: use {r['training side']} ({HOW[r['training side']]}): {by} KL "
                         f"{pct_ci(r['change'], r['change ci_low'], r['change ci_high'])} against stock BF16 on the same "
                         f"tokens ({int(r['prompts'])} prompts)")
        else:
            lines.append(f"vLLM {mode}: no configuration lowers the mismatch below stock BF16 beyond the prompt-to-prompt "
                         f"noise ({fewest} prompts): measure more prompts, or keep stock")
        if fewest < FEW_PROMPTS:
            lines.append(f"  (intervals from {fewest} prompts, fewer than {FEW_PROMPTS}: read them as rough)")
    return lines

