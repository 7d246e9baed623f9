"""Exact Shapley values: how much of a gain each player (here: an aligned region) is responsible for.

phi_i = sum over coalitions S not containing i of |S|! (n-|S|-1)! / n! * (v(S + i) - v(S)).

`value` is called once per coalition (cached), so an expensive measurement runs 2^n times, never
more. For error bars, `bootstrap_shapley` recomputes the values on resampled *cached per-sequence
results* instead of rerunning any model, resampling prompts (all responses of a prompt together: they
are correlated, see `rla_lib.kl`).
"""

from __future__ import annotations

from itertools import combinations
from math import factorial

import numpy as np
import pandas as pd

from .. import kl


def coalitions(players):
    """All subsets of `players`, as frozensets, smallest first."""
    players = tuple(players)
    return [frozenset(c) for r in range(len(players) + 1) for c in combinations(players, r)]


def shapley_values(players, value) -> dict:
    """Exact Shapley values of `value: frozenset -> float` over `players`.

    Efficiency holds exactly: sum(values) == value(all) - value(none).
    """
    players = tuple(players)
    if len(set(players)) != len(players):
        raise ValueError(f"players must be distinct, got {players}")
    n = len(players)
    cache = {s: float(value(s)) for s in coalitions(players)}
    phi = {}
    for p in players:
        others = [q for q in players if q != p]
        phi[p] = sum(
            factorial(len(s)) * factorial(n - len(s) - 1) / factorial(n) * (cache[s | {p}] - cache[s])
            for s in (frozenset(c) for r in range(n) for c in combinations(others, r))
        )
    return phi


def shares(phi: dict) -> dict:
    """Each player's fraction of the total (can be negative, or above 1, when players pull apart)."""
    total = sum(phi.values())
    return {p: v / total if total else float("nan") for p, v in phi.items()}


def share_is_readable(share_lo: float, share_hi: float, reduction_lo: float, reduction_hi: float) -> bool:
    """Whether a share of a reduction says anything: the reduction's CI excludes zero (a ratio whose denominator may be
    0 has no bounded CI) and the share's CI is no wider than the whole 0-100% range. Otherwise: "cannot tell"."""
    return bool((reduction_lo > 0 or reduction_hi < 0) and share_hi - share_lo <= 1)


def bootstrap_shapley(players, per_sequence: dict, n_boot: int = 1000, seed: int = 0, reduction: bool = True, clusters=None):
    """Shapley values on `n_boot` resamples of prompts (clusters), all coalitions on the same resample.

    per_sequence maps each coalition (frozenset) to (sums, counts): the per-sequence sum of an
    estimator's per-token terms and the token count, with sequences in the same order for every
    coalition. clusters gives one prompt index per sequence: a prompt's responses are totalled and
    resampled together (None: each sequence its own cluster, right only with one response per prompt).
    The game's value is the token-weighted mean; with reduction=True the value of a coalition is the
    *reduction* from the empty coalition (so positive = the gap shrinks).
    Returns an array (n_boot, n_players) in the order of `players`.
    """
    players = tuple(players)
    totals = {s: kl.cluster_totals(clusters, sums, counts) for s, (sums, counts) in per_sequence.items()}
    n_clusters = len(next(iter(totals.values()))[0])
    idx = kl.bootstrap_indices(n_clusters, n_boot, seed)
    means = {s: sums[idx].sum(1) / counts[idx].sum(1) for s, (sums, counts) in totals.items()}
    base = means[frozenset()]
    out = np.empty((n_boot, len(players)))
    for b in range(n_boot):
        phi = shapley_values(players, lambda s: (base[b] - means[s][b]) if reduction else means[s][b])
        out[b] = [phi[p] for p in players]
    return out


def attribute(players, per_sequence: dict, n_boot: int = 1000, seed: int = 0, unit: float = 1e-4, clusters=None):
    """Shapley attribution of a gap reduction with prompt-level bootstrap 95% CIs, from cached per-sequence results.

    per_sequence and clusters are as in `bootstrap_shapley`. Returns (table, reduction, base): one row
    per player with phi (in `unit`), its CI, its share of the reduction and the share's CI; the
    reduction from the empty to the full coalition and the empty coalition's gap, both in `unit`.
    `table.attrs["reduction_ci"]` is the reduction's 95% CI (same resamples; by efficiency the
    Shapley values of a resample sum to its reduction).
    """
    players = tuple(players)
    gap = {s: np.sum(sums) / np.sum(counts) for s, (sums, counts) in per_sequence.items()}
    none, everything = frozenset(), frozenset(players)
    phi = shapley_values(players, lambda s: gap[none] - gap[s])
    boots = bootstrap_shapley(players, per_sequence, n_boot=n_boot, seed=seed, clusters=clusters)
    total = boots.sum(1, keepdims=True)
    share_boots = boots / np.where(total == 0, np.nan, total)
    reduction = gap[none] - gap[everything]
    rows = []
    for i, p in enumerate(players):
        lo, hi = np.nanquantile(boots[:, i], [0.025, 0.975])
        slo, shi = np.nanquantile(share_boots[:, i], [0.025, 0.975])
        rows.append({"region": p, "phi (1e-4)": phi[p] / unit, "phi ci": f"[{lo / unit:.3g}, {hi / unit:.3g}]",
                     "share": phi[p] / reduction if reduction else np.nan, "share ci": f"[{slo:.0%}, {shi:.0%}]",
                     "share_lo": slo, "share_hi": shi})
    table = pd.DataFrame(rows).set_index("region")
    red_lo, red_hi = np.quantile(total[:, 0], [0.025, 0.975])
    table.attrs["reduction_ci"] = (float(red_lo / unit), float(red_hi / unit))
    return table, reduction / unit, gap[none] / unit
