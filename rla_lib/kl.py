"""Measuring the inference-training mismatch on the same tokens, with error bars.

Inputs are per-sequence arrays over the *response* tokens that the inference side sampled:
the inference logprob and the training logprob of each token, and, where the vocabulary is small
enough for the engine to return it, both full next-token distributions at each position.

Estimators of KL(inference || training), all reported in units of 1e-4 per token:
- ``sampled``: mean of (inference logprob - training logprob), the paper's estimator (unbiased, noisy:
  each term can be either sign);
- ``k3``: mean of r - 1 - log r with r = p_train / p_inf (unbiased as well, never negative, lower variance);
- ``exact``: the KL of the two full distributions at each position, averaged over positions (no
  sampling noise at a position, only across positions);
- ``topk_bound``: with top-k logprobs only, the KL between the two distributions coarsened to the
  top-k tokens plus one "rest" bucket: a lower bound on the exact KL (data-processing inequality).
Also ``abs``: mean |difference| (not a KL; a scale for how far apart single tokens are).

Error bars treat the sequence as the unit (tokens of one response are not independent): the
standard error of a ratio of sums, and percentile bootstrap intervals resampling whole sequences.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

UNIT = 1e-4
ESTIMATORS = ("sampled", "k3", "exact", "topk_bound", "abs")


# ---- per-token terms ------------------------------------------------------------------------
def sampled_terms(inf_lp, train_lp):
    return np.asarray(inf_lp, np.float64) - np.asarray(train_lp, np.float64)


def k3_terms(inf_lp, train_lp):
    d = sampled_terms(inf_lp, train_lp)
    return np.expm1(-d) + d  # r - 1 - log r with log r = -d; expm1 keeps tiny values exact


def exact_terms(inf_full, train_full):
    """Per-position KL(p_inf || p_train) from (T, V) log-probability arrays (-inf allowed)."""
    p, q = np.asarray(inf_full, np.float64), np.asarray(train_full, np.float64)
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(p), 0.0, np.exp(p) * (p - q))
    return terms.sum(-1)


def topk_bound_terms(inf_full, train_full, k: int):
    """KL after merging all but the inference side's top-k tokens into one bucket (<= exact KL)."""
    p, q = np.asarray(inf_full, np.float64), np.asarray(train_full, np.float64)
    top = np.argsort(-p, axis=-1)[:, :k]
    pk, qk = np.take_along_axis(p, top, -1), np.take_along_axis(q, top, -1)
    rest_p = np.log1p(-np.minimum(np.exp(pk).sum(-1), 1 - 1e-15))
    rest_q = np.log1p(-np.minimum(np.exp(qk).sum(-1), 1 - 1e-15))
    return (np.exp(pk) * (pk - qk)).sum(-1) + np.exp(rest_p) * (rest_p - rest_q)


def terms(estimator: str, pair: dict, k: int = 20):
    """Per-token terms of one estimator for one sequence. `pair` holds inf_lp, train_lp, inf_full, train_full."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {ESTIMATORS}")
    if estimator == "sampled":
        return sampled_terms(pair["inf_lp"], pair["train_lp"])
    if estimator == "k3":
        return k3_terms(pair["inf_lp"], pair["train_lp"])
    if estimator == "abs":
        return np.abs(sampled_terms(pair["inf_lp"], pair["train_lp"]))
    if pair.get("inf_full") is None or pair.get("train_full") is None:
        raise ValueError(f"the {estimator!r} estimator needs full distributions from both sides (small vocabulary)")
    if estimator == "exact":
        return exact_terms(pair["inf_full"], pair["train_full"])
    return topk_bound_terms(pair["inf_full"], pair["train_full"], k)


# ---- aggregation with error bars -------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """A token-weighted mean over sequences, in units of 1e-4, with a standard error and a bootstrap CI."""

    value: float
    se: float
    ci_low: float
    ci_high: float
    n_tokens: int
    n_sequences: int

    def __str__(self):
        return f"{self.value:.4g} ± {self.se:.2g} [{self.ci_low:.4g}, {self.ci_high:.4g}] (1e-4, {self.n_tokens} tokens)"


def ratio_mean_se(sums, counts):
    """Mean of tokens pooled over sequences, and its cluster (per-sequence) standard error."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    m = len(sums)
    mean = sums.sum() / counts.sum()
    if m < 2:
        return mean, float("nan")
    resid = (sums - mean * counts) / counts.mean()
    return mean, float(np.sqrt((resid**2).sum() / (m * (m - 1))))


def bootstrap_means(sums, counts, n_boot: int = 2000, seed: int = 0):
    """Token-weighted means of `n_boot` resamples of whole sequences (reusable across estimators)."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    idx = np.random.default_rng(seed).integers(0, len(sums), size=(n_boot, len(sums)))
    return sums[idx].sum(1) / counts[idx].sum(1)


def estimate(per_sequence_terms, n_boot: int = 2000, seed: int = 0, level: float = 0.95, unit: float = UNIT) -> Estimate:
    sums = np.array([t.sum() for t in per_sequence_terms])
    counts = np.array([len(t) for t in per_sequence_terms])
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    if not len(sums):
        raise ValueError("no tokens to estimate from")
    mean, se = ratio_mean_se(sums, counts)
    boots = bootstrap_means(sums, counts, n_boot, seed)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return Estimate(mean / unit, se / unit, lo / unit, hi / unit, int(counts.sum()), int(len(sums)))


def tokens_to_separate(terms_a, terms_b, z: float = 2.0) -> float:
    """Tokens needed before the paired difference of two configurations' terms is z standard errors
    from zero (both scored on the same tokens), from the per-token spread seen here."""
    d = np.concatenate(terms_a) - np.concatenate(terms_b)
    if d.mean() == 0:
        return float("inf")
    return float(np.ceil((z * d.std(ddof=1) / abs(d.mean())) ** 2))


def compare(pairs: list[dict], estimators=("sampled", "k3", "exact"), n_boot: int = 2000, seed: int = 0) -> dict[str, Estimate]:
    """Every requested estimator for one (inference, training) pair of scorings."""
    return {e: estimate([terms(e, p) for p in pairs], n_boot, seed, unit=UNIT) for e in estimators}


# ---- a monitor for any training loop ----------------------------------------------------
class MismatchMonitor:
    """Feed it the inference and training logprobs of each step's sampled tokens.

        monitor = MismatchMonitor()
        for step ...:
            monitor.update(step, inference_logprobs, training_logprobs)   # lists of per-response arrays
        monitor.history   # a DataFrame, one row per step
        monitor.plot()

    It warns (once per episode) when the recent k3 mismatch rises above `warn_ratio` times its early
    level: the paper's first advice to a team is to log this gap and watch it before a collapse.
    """

    def __init__(self, warn_ratio: float = 3.0, baseline_steps: int = 5, window: int = 5):
        self.warn_ratio, self.baseline_steps, self.window = warn_ratio, baseline_steps, window
        self.rows: list[dict] = []
        self.rising = False

    def update(self, step: int, inference_logprobs, training_logprobs) -> dict:
        inf = [np.asarray(a, np.float64) for a in inference_logprobs]
        train = [np.asarray(b, np.float64).reshape(-1) for b in training_logprobs]
        if [len(a) for a in inf] != [len(b) for b in train]:
            raise ValueError("inference and training logprobs must cover the same tokens (same lengths per response)")
        d = np.concatenate([a - b for a, b in zip(inf, train)]) if inf else np.zeros(0)
        row = {"step": step, "tokens": len(d), "sampled_kl": d.mean() / UNIT if len(d) else np.nan,
               "k3": (np.expm1(-d) + d).mean() / UNIT if len(d) else np.nan, "mean_abs_diff": np.abs(d).mean() if len(d) else np.nan,
               "max_abs_diff": np.abs(d).max() if len(d) else np.nan}
        self.rows.append(row)
        self._check()
        return row

    def _check(self):
        k3 = self.history["k3"].to_numpy()
        if len(k3) < self.baseline_steps + self.window:
            return
        baseline = np.nanmedian(k3[: self.baseline_steps])
        recent = np.nanmean(k3[-self.window :])
        rising = baseline > 0 and recent > self.warn_ratio * baseline
        if rising and not self.rising:
            warnings.warn(f"mismatch rising: recent k3 {recent:.3g}e-4 is {recent / baseline:.1f}x its early level "
                          f"{baseline:.3g}e-4 (step {self.rows[-1]['step']})", RuntimeWarning, stacklevel=3)
        self.rising = rising

    @property
    def history(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["step", "tokens", "sampled_kl", "k3", "mean_abs_diff", "max_abs_diff"])

    def plot(self, ax=None):
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(6, 3))[1]
        h = self.history
        ax.plot(h["step"], h["k3"], label="k3")
        ax.plot(h["step"], h["sampled_kl"], label="mean(logp_inf - logp_train)", alpha=0.6)
        ax.set(xlabel="step", ylabel="mismatch (1e-4 per token)")
        ax.legend()
        return ax
