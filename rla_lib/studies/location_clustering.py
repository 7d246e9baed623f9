"""Clustering of rounding positions per location of a model, and the paper's claims about it (notebook 05).

The score itself is `rounding.rounding_clustering` (over the values that actually round, with its floors);
the values are those `prerounding` captures. This module turns them into tables and verdicts:

- `capture_model`: one model's captures on held-out task sequences (and RoPE at realistic positions), with
  `clustering_table`'s rows per (location, layer).
- `summarize_models`: per (model, positions, location) the median over layers (`summarize_clustering`),
  classified against the floor and the paper's range (`classify_score`) and checked against what the paper
  reports for that kind of location (`paper_verdict`).
- `claim_results`: the paper's claims (`PAPER_CLAIMS`), each judged over its locations (`claim_outcome`);
  `claims_table`, `location_verdicts` and `rope_claims` are the tables of verdicts; `rope_verdict` reads the
  last one as a sentence.

A location's median score is compared with the floor 1/sqrt(n) of its sample, not with the paper's
absolute numbers for near-uniform locations: at the floor, the score is set by the sample count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

from .. import task
from ..align.modeling_qwen import ROUNDING_POINTS
from ..models import load_model, load_tokenizer, resolve_model
from .prerounding import (LOCATION_BY_NAME, ROPE_LOCATIONS, capture_prerounding, capture_rope_at_positions,
                          positions_label, task_positions, uniform_positions)
from ..rounding import round_bf16, rounding_clustering
from ..report import prose
from ..scoring import pad_batch

# A median within this band around the paper's lower bound for clustered locations is "borderline": the
# measurement cannot say on which side it lies. Above it, "clustered (paper's range)".
BORDERLINE_BAND = (0.8, 1.25)
# Share of values (exact, or exact ties) above which `score_explanation` names it.
NOTABLE_SHARE = 0.02
# A net rounding error this many times its standard error is named as a direction.
ERROR_SE_MULTIPLE = 3



def _points(kind: str, suffix: str = "") -> list[str]:
    """The layer's rounding points of one kind (`modeling_qwen.Point.kind`), those whose name ends in `suffix`."""
    return [p.name for p in ROUNDING_POINTS if p.kind == kind and p.name.endswith(suffix)]


PAPER_CLAIMS = {
    "projections near-uniform": _points("projection"),
    "attention output near-uniform": _points("attention"),
    "RMSNorm output near-uniform (x*rsqrt stage)": _points("RMSNorm x*rsqrt"),
    "RMSNorm output near-uniform (after the weight)": _points("RMSNorm *weight"),
    "SiLU output clustered": _points("SiLU"),
    "RoPE products clustered (q*cos)": _points("RoPE product", "_cos"),
    "RoPE products clustered (rotate_half(q)*sin)": _points("RoPE product", "_sin"),
    "residual sums clustered": _points("residual sum"),
}
# The columns of the summary a reader compares, in this order (the saved table names "median" "score").
SUMMARY_COLUMNS = ["group", "paper", "median", "min", "max", "floor", "x_floor", "n", "exact_frac", "tie_frac",
                   "score_without_ties", "mean_error", "mean_error_se", "distinct_floor", "score_all_values", "measured",
                   "reproduces paper"]


# --------------------------------------------------------------------------------------------------
# Samples and tables
# --------------------------------------------------------------------------------------------------


def distinct_prefix_mask(input_ids, attention_mask=None) -> torch.Tensor:
    """(B, T) bool: real tokens whose prefix (tokens 0..t) has not appeared earlier in the batch.

    In a causal model the values at position t depend only on tokens 0..t, so a repeated prefix repeats
    every value: counting it twice is not an independent sample.
    """
    ids = torch.as_tensor(input_ids)
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
    out = torch.zeros_like(mask)
    seen = set()
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if mask[b, t]:
                key = tuple(ids[b, : t + 1].tolist())
                if key not in seen:
                    seen.add(key)
                    out[b, t] = True
    return out


def clustering_table(captures: dict, token_mask=None) -> pd.DataFrame:
    """One row per (location, layer) with the fields of `rounding_clustering`.

    `captures` is `capture_prerounding`'s (or `capture_rope_at_positions`') output; `token_mask` (B, T)
    selects the tokens to count. Scores and floors are over the values that actually round (`n` of
    `n_all`); `exact_frac` and `tie_frac` are shares of all `n_all` values.
    """
    rows = []
    for name, per_layer in captures.items():
        loc = LOCATION_BY_NAME[name]
        for layer, values in per_layer.items():
            v = values[torch.as_tensor(token_mask).bool()] if token_mask is not None else values
            stats = rounding_clustering(v)
            rows.append(dict(location=name, group=loc.group, paper=loc.paper, exact=loc.exact, layer=layer, **stats.as_dict()))
    return pd.DataFrame(rows)


def summarize_clustering(table: pd.DataFrame) -> pd.DataFrame:
    """Per location (rows in table order): median, min and max over layers of the score, medians of the
    floors and of every other field, and `x_floor` = median / floor. Layers with nothing to round (NaN
    score) are left out of the median and counted in `layers_without_rounding`."""
    g = table.groupby("location", sort=False)
    out = g.agg(group=("group", "first"), paper=("paper", "first"), layers=("layer", "count"),
                layers_without_rounding=("score", lambda x: int(x.isna().sum())),
                median=("score", "median"), min=("score", "min"), max=("score", "max"),
                floor=("floor", "median"), n=("n", "median"), n_all=("n_all", "median"),
                distinct=("distinct", "median"), distinct_floor=("distinct_floor", "median"),
                exact_frac=("exact_frac", "median"), tie_frac=("tie_frac", "median"),
                score_without_ties=("score_without_ties", "median"), mean_error=("mean_error", "median"),
                mean_error_se=("mean_error_se", "median"), score_all_values=("score_all_values", "median"))
    out["x_floor"] = out["median"] / out["floor"]
    return out


def calibration_samples(seed: int) -> dict[str, torch.Tensor]:
    """Synthetic samples whose answer is known: uniform positions (at the floor), values on the BF16 grid
    (excluded), exact ties (score 1, no net error), and mixtures of them."""
    g = torch.Generator().manual_seed(seed)

    def on_grid(n):  # BF16 numbers: nothing to round
        return round_bf16(torch.randn(n, generator=g) * 10).float()

    def off_grid(n):  # nonzero random low 16 bits: uniform rounding positions
        low = torch.randint(1, 65536, (n,), generator=g, dtype=torch.int32)
        return (on_grid(n).view(torch.int32) | low).view(torch.float32)

    ties = 1 + (2 * torch.arange(128, dtype=torch.float32) + 1) * 2.0**-8  # exactly halfway between BF16 neighbours
    return {
        "uniform positions, n=10,000": off_grid(10_000),
        "uniform positions, n=1,000,000": off_grid(1_000_000),
        "all on the grid": on_grid(1000),
        "80% on the grid, rest uniform": torch.cat([on_grid(8000), off_grid(2000)]),
        "exact ties only": ties.repeat(8),
        "half on the grid, half ties": torch.cat([on_grid(1024), ties.repeat(8)]),
    }


def calibration_table(samples: dict[str, torch.Tensor]) -> pd.DataFrame:
    """`rounding_clustering` of each sample: the earlier score (all values) next to the score over the
    values that round, with the floor, the exact and tie shares and the net error."""
    rows = []
    for label, v in samples.items():
        c = rounding_clustering(v)
        rows.append({"sample": label, "values": c.n_all, "exact share": c.exact_frac, "tie share": c.tie_frac,
                     "earlier score (all values)": c.score_all_values, "score (rounding values)": c.score,
                     "floor 1/√n": c.floor, "mean error (ulp)": c.mean_error})
    return pd.DataFrame(rows).set_index("sample")


# --------------------------------------------------------------------------------------------------
# One model's captures
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelCapture:
    """One model's captured values on held-out task sequences and their clustering rows."""

    name: str
    token_mask: torch.Tensor  # (B, T): the tokens counted (distinct prefixes, or every real token)
    captures: dict  # capture_prerounding at the task positions: {location: {layer: (B, T, ...)}}
    rope_captures: dict  # capture_rope_at_positions at the realistic positions ({} without them)
    table: pd.DataFrame  # clustering_table rows of both, with "model" and "positions" columns
    description: str  # architecture, rope_theta, token counts, how often cos is exactly 1.0


def _describe_capture(name, net, mask, token_mask, position_sets: dict, distinct_prefixes: bool) -> str:
    """What was measured, in two lines: the model, the tokens, and how often RoPE's cos is exactly 1.0 in
    BF16 (q*cos = q: nothing to round) at each set of positions."""
    cos_one = {label: float((net.model.rotary_emb(net.model.embed_tokens.weight, pos)[0][token_mask] == 1).double().mean())
               for label, pos in position_sets.items()}
    rope_theta = (getattr(net.config, "rope_parameters", None) or {}).get("rope_theta", getattr(net.config, "rope_theta", None))
    norm_ones = {n: bool((m.weight == 1).all()) for n, m in net.named_modules() if n.endswith("norm")}
    return (f"{name}: {resolve_model(name).architecture}, {len(net.model.layers)} layers, rope_theta {rope_theta:g}, "
            f"max_position_embeddings {net.config.max_position_embeddings}; {int(mask.sum())} tokens at positions "
            f"0..{int(mask.sum(1).max()) - 1}, {int(token_mask.sum())} counted (distinct prefixes: {distinct_prefixes}); "
            f"norm weights all ones: {sum(norm_ones.values())} of {len(norm_ones)} norms\n"
            "  share of cos entries exactly 1.0 in BF16: " + ", ".join(f"{v:.1%} at {k} positions" for k, v in cos_one.items()))


def capture_model(name: str, n_prompts: int, *, distinct_prefixes: bool = True, max_position: int | None = None,
                  seed: int = 0) -> ModelCapture:
    """Capture `name` on the first `n_prompts` held-out sequences (prompt + reference response + end-of-text)
    and tabulate every location; with `max_position`, RoPE also with each token at a position drawn
    uniformly from [0, max_position) (seeded)."""
    net, tok = load_model(name), load_tokenizer(name)
    sequences = [tok.encode(p.prompt + p.solution) + [tok.eos_token_id] for p in task.load_split()[:n_prompts]]
    ids, mask = pad_batch(sequences)
    token_mask = distinct_prefix_mask(ids, mask) if distinct_prefixes else mask.bool()
    captures = capture_prerounding(net, ids, mask)
    tables = [clustering_table(captures, token_mask).assign(model=name, positions=positions_label("task"))]
    position_sets = {positions_label("task"): task_positions(ids)}
    rope_captures = {}
    if max_position is not None:
        label = positions_label(max_position)
        position_sets[label] = uniform_positions(ids.shape, max_position, seed)
        rope_captures = capture_rope_at_positions(net, ids, mask, position_sets[label])
        tables.append(clustering_table(rope_captures, token_mask).assign(model=name, positions=label))
    description = _describe_capture(name, net, mask, token_mask, position_sets, distinct_prefixes)
    return ModelCapture(name, token_mask, captures, rope_captures, pd.concat(tables, ignore_index=True), description)


# --------------------------------------------------------------------------------------------------
# Classes and the paper's claims
# --------------------------------------------------------------------------------------------------


def classify_score(median: float, floor: float, k_floor: float, clustered_min: float) -> str:
    """"at the floor" (<= k_floor x floor), "clustered (paper's range)" (>= the paper's lower bound with the
    upper margin of `BORDERLINE_BAND`), "borderline" (inside the band), "above the floor" (in between), or
    "nothing rounds" (no score)."""
    if math.isnan(median):
        return "nothing rounds"
    if median <= k_floor * floor:
        return "at the floor"
    if median >= BORDERLINE_BAND[1] * clustered_min:
        return "clustered (paper's range)"
    if median >= BORDERLINE_BAND[0] * clustered_min:
        return "borderline"
    return "above the floor"


def paper_verdict(paper: str, measured: str) -> str:
    """Whether a location reproduces what the paper reports for its kind: "yes", "no", "borderline",
    "weaker" (clustered, but only above the floor) or "—" (the paper does not report it)."""
    if paper == "not reported":
        return "—"
    if paper == "near-uniform":
        return "yes" if measured == "at the floor" else "no"
    return {"clustered (paper's range)": "yes", "borderline": "borderline", "above the floor": "weaker"}.get(measured, "no")


def summarize_models(table: pd.DataFrame, k_floor: float, clustered_min: float) -> pd.DataFrame:
    """`summarize_clustering` per (model, positions) of `capture_model` tables, one row per location, with its
    class ("measured", `classify_score`) and whether it reproduces the paper ("reproduces paper")."""
    summaries = []
    for (name, label), t in table.groupby(["model", "positions"], sort=False):
        s = summarize_clustering(t).reset_index()
        s["model"], s["positions"] = name, label
        s["measured"] = [classify_score(m, f, k_floor, clustered_min) for m, f in zip(s["median"], s["floor"])]
        s["reproduces paper"] = [paper_verdict(p, m) for p, m in zip(s["paper"], s["measured"])]
        summaries.append(s)
    return pd.concat(summaries, ignore_index=True)


def saved_summary(summary: pd.DataFrame) -> pd.DataFrame:
    """The summary as the result table stores it: indexed by (model, location, positions), "median" as "score"."""
    columns = [c if c != "median" else "score" for c in SUMMARY_COLUMNS] + ["n_all", "layers", "layers_without_rounding"]
    return summary.rename(columns={"median": "score"}).set_index(["model", "location", "positions"])[columns]


def claim_outcome(verdicts) -> str:
    """One claim over its locations' `paper_verdict`s: "reproduces" only if every location does."""
    v = set(verdicts)
    if v == {"yes"}:
        return "reproduces"
    if v == {"no"}:
        return "does not reproduce"
    if v <= {"yes", "borderline"}:
        return "is borderline"
    if v <= {"weaker", "borderline"}:
        return "holds only weakly (above the floor, below the paper's range)"
    return "is mixed (" + ", ".join(sorted(v)) + ")"


def claim_results(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (claim, positions, model) that has measured locations: the claim's `claim_outcome`, and
    the range of its locations' median scores and of their exact shares."""
    rows = []
    for claim, locs in PAPER_CLAIMS.items():
        for label in summary.positions.unique():
            for name in summary.model.unique():
                s = summary[(summary.model == name) & (summary.positions == label) & summary.location.isin(locs)]
                if len(s):
                    rows.append(dict(claim=claim, positions=label, model=name, outcome=claim_outcome(s["reproduces paper"]),
                                     score_min=s["median"].min(), score_max=s["median"].max(),
                                     exact_min=s.exact_frac.min(), exact_max=s.exact_frac.max()))
    return pd.DataFrame(rows)


def _span(lo: float, hi: float, fmt: str = "{:.2g}") -> str:
    """"lo–hi" as formatted, or one number when both format alike."""
    lo, hi = fmt.format(lo), fmt.format(hi)
    return lo if lo == hi else f"{lo}–{hi}"


def _column_span(values: pd.Series, fmt: str = "{:.2g}") -> str:
    return _span(values.min(), values.max(), fmt)


@prose
def claims_table(results: pd.DataFrame) -> pd.DataFrame:
    """`claim_results` in words: per (claim, positions), a column per model with the outcome, the score range
    and the exact share (empty where the model has no such location)."""
    models = list(results.model.unique())
    rows = []
    for (claim, label), g in results.groupby(["claim", "positions"], sort=False):
        g = g.set_index("model")
        row = {"claim": claim, "positions": label}
        for name in models:
            r = g.loc[name] if name in g.index else None
            row[name] = None if r is None else (f"{r.outcome} ({_span(r.score_min, r.score_max)}; "
                                                f"{_span(r.exact_min, r.exact_max, '{:.0%}')} exact)")
        rows.append(row)
    return pd.DataFrame(rows).set_index(["claim", "positions"])


# --------------------------------------------------------------------------------------------------
# Verdicts in words
# --------------------------------------------------------------------------------------------------


def score_explanation(r) -> str:
    """What explains a location's score (a `summarize_models` row): exact values, ties, few distinct values,
    a net rounding direction."""
    why = []
    if r.exact_frac > NOTABLE_SHARE:
        why.append(f"{r.exact_frac:.0%} of values exact (excluded)")
    if r.tie_frac > NOTABLE_SHARE:
        why.append(f"{r.tie_frac:.0%} exact ties (score without them {r.score_without_ties:.2g})")
    if r.distinct_floor > 2 * r.floor and r["median"] <= 1.5 * r.distinct_floor:
        why.append(f"near the distinct-value floor {r.distinct_floor:.2g}: few distinct values")
    if abs(r.mean_error) > ERROR_SE_MULTIPLE * r.mean_error_se:
        why.append(f"net rounding error {r.mean_error:+.2g} ulp ({abs(r.mean_error) / r.mean_error_se:.0f}x its spread)")
    return "; ".join(why) or "no spike at 0 or 0.5, values distinct"


@prose
def location_verdicts(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (model, positions, location): the paper's class, the measured one (median over layers and its multiple
    of the floor), the verdict against the paper and what explains the score (`score_explanation`)."""
    view = summary.assign(why=summary.apply(score_explanation, axis=1))
    view = view[["model", "positions", "location", "paper", "measured", "median", "x_floor", "reproduces paper", "why"]]
    return view.set_index(["model", "positions", "location"])


@prose
def tie_error_line(summary: pd.DataFrame) -> str | None:
    """Where ties are common: how many rows keep their net rounding error within `ERROR_SE_MULTIPLE` x its
    standard error, and the largest (None if no row has a notable tie share)."""
    tied = summary[summary.tie_frac > NOTABLE_SHARE]
    if not len(tied):
        return None
    ratio = tied.mean_error.abs() / tied.mean_error_se
    worst = tied.loc[ratio.idxmax()]
    return (f"Net rounding error where ties are common (tie share > {NOTABLE_SHARE:.0%}): |mean_error| within "
            f"{ERROR_SE_MULTIPLE}x its spread at {int((ratio <= ERROR_SE_MULTIPLE).sum())} of {len(tied)} (model, positions, "
            f"location) rows; largest {worst.mean_error:+.2g} ulp = {ratio.max():.1f}x its spread ({worst.model}, "
            f"{worst.positions}, {worst.location}).")


ROPE_CLAIM_VALUES = {"q*cos and k*cos": ["rope.q_cos", "rope.k_cos"], "rotate_half*sin": ["rope.q_sin", "rope.k_sin"],
                     "RoPE sums (not in the paper)": ["rope.q_sum", "rope.k_sum"]}


@prose
def rope_claims(summary: pd.DataFrame) -> pd.DataFrame:
    """The paper's RoPE claim per (model, values, positions): the share of exact values, the earlier score (exact
    values counted), the score over the values that round and its multiple of the floor (spans over the two
    locations' medians), and the verdict: the paper's claim's outcome (`claim_outcome`), or for the sums, which
    the paper does not list, the measured class."""
    rows = []
    for name in summary.model.unique():
        for values, locs in ROPE_CLAIM_VALUES.items():
            for label in summary.positions.unique():
                s = summary[(summary.model == name) & (summary.positions == label) & summary.location.isin(locs)]
                if not len(s):
                    continue
                reported = (s.paper != "not reported").all()
                rows.append({"model": name, "values": values, "positions": label,
                             "exact share": _column_span(s.exact_frac, "{:.0%}"),
                             "earlier score": _column_span(s.score_all_values),
                             "score over rounding values": _column_span(s["median"]),
                             "x floor": _column_span(s.x_floor, "{:.0f}"),
                             "verdict": (f"the paper's claim {claim_outcome(s['reproduces paper'])}" if reported
                                         else ", ".join(sorted(set(s.measured))))})
    return pd.DataFrame(rows).set_index(["model", "values", "positions"])


@prose
def rope_verdict(summary: pd.DataFrame, clustered_range: tuple[float, float]) -> str:
    """`rope_claims` at the last set of positions (the realistic ones when measured), all models together, as a
    sentence against the paper's clustered range."""
    final = summary.positions.unique()[-1]
    at_final = summary[summary.positions == final]
    products = at_final[at_final.location.isin(ROPE_CLAIM_VALUES["q*cos and k*cos"] + ROPE_CLAIM_VALUES["rotate_half*sin"])]
    sums = at_final[at_final.location.isin(ROPE_CLAIM_VALUES["RoPE sums (not in the paper)"])]
    return (f"At {final} positions, the paper's claim 'RoPE products are clustered' "
            f"{claim_outcome(products['reproduces paper'])} on these models (scores {_column_span(products['median'])} "
            f"against the paper's {clustered_range[0]}–{clustered_range[1]}); the RoPE sums, which the paper does not "
            f"list, are {', '.join(sorted(set(sums.measured)))} ({_column_span(sums['median'])}).")


def rope_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The RoPE locations per (model, location), a column per set of positions for each of: exact share, the
    earlier score, the score over the values that round, its floor and the ratio to it."""
    fields = ["exact_frac", "score_all_values", "median", "floor", "x_floor"]
    rope = summary[summary.location.isin(ROPE_LOCATIONS)]
    view = rope.pivot_table(index=["model", "location"], columns="positions", sort=False, values=fields)
    return view.reindex(columns=fields, level=0)
