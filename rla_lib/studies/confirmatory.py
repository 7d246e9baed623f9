"""The collapse study's registered analyses (data/grpo_study/preregistration.json), one function per question.

    runs = outcomes(histories)                # one row per run: collapsed, rose then collapsed, first/peak/last
    firth_logit(X, y)                         # logistic regression that stays finite when the outcomes separate
    q1 = dose_curve(runs)                     # Q1: collapse on log10 dose per TIS arm: D50, H1, H2, BF16's place
    q2 = edge_shift(runs, margin)             # Q2: each arm's half-collapse step size against default BF16: H3-H5
    q3 = long_horizon(runs)                   # Q3: rises then collapses, default BF16 against on-policy: H6
    family = holm_family(q1, q2, q3)          # Holm over H1-H6 (a test not run counts in the family)
    verdicts(q1, q2, q3, family)              # each question's answer by the registered rule

Why Firth's penalised likelihood: with 4-8 seeds per dose or step size, collapse is often all-or-nothing on
either side of the transition (complete separation); maximum likelihood then has no finite slope, so neither a D50
nor a shift. Firth's penalty (half the log-determinant of the information) keeps every estimate finite and removes
the first-order small-sample bias; tests are penalised likelihood ratios with the penalty of the full model
(Heinze & Schemper 2002, as R's logistf).

A verdict names a cause only from a registered test significant after Holm's correction; otherwise it says
"cannot tell" with the power for the effect that matters (collapse rates 0.6 against 0, `PAPER_LIKE_RATES`), or,
for a step-size shift, "no shift that matters" only when the shift's whole 95% interval lies inside the margin.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..report import prose
from .collapse import (PAPER_LIKE_RATES, clopper_pearson, collapse, fisher_one_sided, fisher_power, holm,
                       rises_then_collapses)
from .stability import policy_accuracy

REFERENCE = "default BF16"
ON_POLICY = "engine schedule"  # the exactly on-policy arm: every sampled token's training logprob is the engine's
TESTS = ("H1", "H2", "H3", "H4", "H5", "H6")
EDGE_TESTS = {"engine schedule": "H3", "FP32 control": "H4", "rope": "H5"}


def outcomes(histories: pd.DataFrame) -> pd.DataFrame:
    """One row per run of `histories` (columns run, sweep, config, seed, step, eval_accuracy(_policy), eval_prompts):
    the registered endpoints (`collapsed`, its `collapse_step`, `rises_then_collapses`) and the evaluations they rest
    on (first, peak, last held-out accuracy, `evaluations`, `last_step`). The accuracy is the trained policy's, as
    registered (`stability.policy_accuracy`: not the coarse copy a coarse-rollout run's engine holds)."""
    rows = []
    for run, h in histories.groupby("run", sort=False):
        ev = policy_accuracy(h)
        n = int(h["eval_prompts"].dropna().iloc[0])
        steps, acc = ev["step"].to_numpy(), ev["accuracy"].to_numpy(dtype=float)
        out = collapse(steps, acc, n)
        rows.append(dict(run=run, sweep=h["sweep"].iloc[0], config=h["config"].iloc[0], seed=int(h["seed"].iloc[0]),
                         evaluations=len(acc), last_step=int(steps[-1]) if len(steps) else 0, problems=n,
                         first=acc[0] if len(acc) else np.nan, peak=acc.max() if len(acc) else np.nan,
                         last=acc[-1] if len(acc) else np.nan, collapsed=out["collapsed"],
                         collapse_step=out["step"], rises_then_collapses=rises_then_collapses(steps, acc, n)))
    return pd.DataFrame(rows)


# --- Firth's logistic regression --------------------------------------------------------------------------------

def _expit(eta):
    return np.exp(-np.logaddexp(0.0, -eta))


def _penalised(X, y, beta) -> float:
    """log L + 0.5 log det I(beta): the function Firth's estimate maximises."""
    eta = X @ beta
    w = _expit(eta) * _expit(-eta)
    logdet = np.linalg.slogdet(X.T @ (w[:, None] * X))[1]
    return float(np.sum(y * eta - np.logaddexp(0.0, eta)) + 0.5 * logdet)


def firth_logit(X, y, fixed_zero=(), iterations: int = 200, tol: float = 1e-9) -> tuple[np.ndarray, float]:
    """Firth's bias-reduced logistic regression of y (0/1) on the columns of X (include a column of ones for the
    intercept): the coefficients and the maximised penalised log-likelihood. `fixed_zero`: column indices held at 0
    (the null model of a penalised likelihood-ratio test; the penalty keeps the full model's information)."""
    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    free = np.array([j for j in range(X.shape[1]) if j not in set(fixed_zero)])
    beta = np.zeros(X.shape[1])
    value = _penalised(X, y, beta)
    for _ in range(iterations):
        p = _expit(X @ beta)
        w = p * (1 - p)
        inverse = np.linalg.pinv(X.T @ (w[:, None] * X))
        leverage = w * np.einsum("ij,jk,ik->i", X, inverse, X)
        score = X.T @ (y - p + leverage * (0.5 - p))
        step = np.zeros_like(beta)
        info_free = X[:, free].T @ (w[:, None] * X[:, free])
        step[free] = np.linalg.pinv(info_free) @ score[free]
        scale = 1.0
        while True:  # halve the step until the penalised likelihood does not fall
            trial = beta + scale * step
            trial_value = _penalised(X, y, trial)
            if trial_value >= value - 1e-12 or scale < 1e-8:
                break
            scale /= 2
        beta, value = trial, trial_value
        if np.max(np.abs(scale * step)) < tol:
            break
    return beta, value


def _chi2_1_tail(statistic: float) -> float:
    """P(chi-square with 1 degree of freedom > statistic)."""
    return math.erfc(math.sqrt(max(statistic, 0.0) / 2))


def lr_test(X, y, column: int, side: str = "two-sided") -> float:
    """The penalised likelihood-ratio p-value of coefficient `column` (one-sided "greater": it is above 0)."""
    beta, full = firth_logit(X, y)
    _, null = firth_logit(X, y, fixed_zero=(column,))
    p = _chi2_1_tail(2 * (full - null))
    if side == "greater":
        return p / 2 if beta[column] > 0 else 1 - p / 2
    return p


# --- Q1: the dose at which mismatch collapses training -----------------------------------------------------------

def _dose_fit(rungs: pd.DataFrame) -> tuple[float, float, float]:
    """(intercept, slope on log10 dose, D50) from one TIS arm's runs (columns rung, dose, collapsed): each rung's
    dose is the median over its seeds (the registration's). D50 is infinite when the slope is not positive."""
    dose = rungs.groupby("rung")["dose"].transform("median").to_numpy(dtype=float)
    X = np.column_stack([np.ones(len(dose)), np.log10(dose)])
    (b0, b1), _ = firth_logit(X, rungs["collapsed"].to_numpy(dtype=float))
    return b0, b1, 10 ** (-b0 / b1) if b1 > 0 else math.inf


def _resample_within(runs: pd.DataFrame, by: str, gen) -> pd.DataFrame:
    """Seeds drawn with replacement within each `by` group (a dose rung): the registered bootstrap."""
    picks = [g.iloc[gen.integers(0, len(g), len(g))] for _, g in runs.groupby(by, sort=False)]
    return pd.concat(picks, ignore_index=True)


def _percentile_ci(values, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval; infinite values are kept (a D50 beyond every tested dose) and never interpolated."""
    values = np.sort(np.asarray(values, dtype=float))
    values = values[~np.isnan(values)]
    if not len(values):
        return math.nan, math.nan
    tail = (1 - level) / 2
    return (float(np.quantile(values, tail, method="inverted_cdf")),
            float(np.quantile(values, 1 - tail, method="inverted_cdf")))


def collapse_counts(runs: pd.DataFrame, by: list[str], outcome: str = "collapsed") -> pd.DataFrame:
    """Per group of `by`: its runs (`seeds`), how many had `outcome` with the exact 95% interval of that rate, and the
    mean final held-out accuracy. Counts, no test: what a question's runs show before its registered test runs."""
    rows = []
    for key, g in runs.groupby(by, sort=False):
        k = int(g[outcome].sum())
        low, high = clopper_pearson(k, len(g))
        rows.append(dict(zip(by, key if isinstance(key, tuple) else (key,)), seeds=len(g), **{outcome: k},
                         rate=k / len(g), ci_low=low, ci_high=high, last=float(g["last"].mean())))
    return pd.DataFrame(rows)


def rung_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Q1 per TIS arm and rung: seeds, the median dose, collapses with their exact interval, mean final accuracy."""
    runs = runs.assign(tis=runs["tis"].astype(bool))
    table = collapse_counts(runs, ["tis", "rung"])
    dose = runs.groupby(["tis", "rung"], sort=False)["dose"].median()
    table.insert(3, "dose", [float(dose[(t, r)]) for t, r in zip(table["tis"], table["rung"])])
    return table.rename(columns={"collapsed": "collapses"})


def dose_curve(runs: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> dict:
    """Q1 from one row per run: `rung` (a ladder step's label; default BF16's runs are the natural rung), `tis`,
    `seed`, `dose` (nats per response at the first step, `dose_response.DOSE`), `collapsed`, `last`.

    Returns `rungs` (per rung and TIS arm: seeds, median dose, collapses with the exact interval, mean final accuracy),
    `fits` (per TIS arm: slope, D50 with its bootstrap interval), `H1` (penalised LR test, one-sided: collapse rises
    with dose, without TIS), `H2` (the bootstrap p of log10 D50 with TIS minus without, one-sided up) and `natural`
    (default BF16's dose over D50 without TIS, with its bootstrap interval)."""
    gen = np.random.default_rng(seed)
    arms = {bool(t): g for t, g in runs.groupby("tis")}
    fits, boot, natural_boot = [], {}, []
    for tis, g in arms.items():
        b0, b1, d50 = _dose_fit(g)
        boot[tis] = []
        for _ in range(n_boot):
            resampled = _resample_within(g, "rung", gen)
            boot[tis].append(_dose_fit(resampled)[2])
            if not tis:  # default BF16's dose, resampled with the rest
                natural_boot.append(resampled.loc[resampled["rung"] == REFERENCE, "dose"].median())
        boot[tis] = np.array(boot[tis])
        low, high = _percentile_ci(boot[tis])
        fits.append(dict(tis=tis, runs=len(g), rungs=g["rung"].nunique(), slope=b1, d50=d50, d50_low=low, d50_high=high))
    out = dict(rungs=rung_table(runs), fits=pd.DataFrame(fits), H1=None, H2=None, natural=None)
    if False in arms:
        g = arms[False]
        dose = g.groupby("rung")["dose"].transform("median").to_numpy(dtype=float)
        X = np.column_stack([np.ones(len(g)), np.log10(dose)])
        out["H1"] = lr_test(X, g["collapsed"].to_numpy(dtype=float), 1, side="greater")
        natural = g.loc[g["rung"] == REFERENCE, "dose"]
        if len(natural):
            d50 = next(f["d50"] for f in fits if not f["tis"])
            low, high = _percentile_ci(np.array(natural_boot) / boot[False])  # an infinite D50: ratio 0
            out["natural"] = dict(dose=float(natural.median()), ratio=float(natural.median() / d50),
                                  ratio_low=low, ratio_high=high)
    if True in arms and False in arms:
        with np.errstate(invalid="ignore"):
            shift = np.log10(boot[True]) - np.log10(boot[False])  # both infinite: undefined, counts against H2
        out["H2"] = float((np.sum(~(shift > 0)) + 1) / (n_boot + 1))
    return out


# --- Q2: does mismatch move the stability edge? --------------------------------------------------------------------

def _edge_design(runs: pd.DataFrame, arms: list[str]) -> np.ndarray:
    columns = [np.ones(len(runs)), np.log(runs["lr"].to_numpy(dtype=float))]
    columns += [(runs["arm"] == arm).to_numpy(dtype=float) for arm in arms]
    return np.column_stack(columns)


def _edge_fit(runs: pd.DataFrame, arms: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The fitted coefficients and each arm's half-collapse log step size minus default BF16's: -beta_arm /
    beta_log_lr (NaN when collapse does not rise with the step size: no edge to move)."""
    beta, _ = firth_logit(_edge_design(runs, arms), runs["collapsed"].to_numpy(dtype=float))
    return beta, (-beta[2:] / beta[1] if beta[1] > 0 else np.full(len(arms), np.nan))


def edge_shift(runs: pd.DataFrame, margin: float, n_boot: int = 2000, seed: int = 0, power_sims: int = 200) -> dict:
    """Q2 from one row per run: `arm`, `lr`, `seed`, `collapsed`. Per arm against default BF16: the shift of the
    half-collapse step size (log; positive: the arm tolerates larger steps) with its 95% interval from bootstrap refits
    resampling seeds (a seed's runs together: the arms are paired), the two-sided bootstrap p, `equivalent` (the
    whole interval inside +-margin) and `power`: the approximate chance that the penalised LR test of the arm term
    sees a shift of one margin with these seeds and step sizes (simulated from the fitted reference curve)."""
    gen = np.random.default_rng(seed)
    arms = [a for a in dict.fromkeys(runs["arm"]) if a != REFERENCE]
    beta, shifts = _edge_fit(runs, arms)
    seeds = runs["seed"].unique()
    by_seed = {s: g for s, g in runs.groupby("seed")}
    boot = np.array([_edge_fit(pd.concat([by_seed[s] for s in gen.choice(seeds, len(seeds))], ignore_index=True), arms)[1]
                     for _ in range(n_boot)])
    rows = []
    for j, arm in enumerate(arms):
        b = boot[:, j]
        low, high = _percentile_ci(b)
        p = min(1.0, 2 * (min(np.sum(~(b > 0)), np.sum(~(b < 0))) + 1) / (n_boot + 1))
        mine = runs[runs["arm"].isin([REFERENCE, arm])]
        rows.append(dict(arm=arm, test=EDGE_TESTS.get(arm), runs=int((runs["arm"] == arm).sum()),
                         collapses=int(runs.loc[runs["arm"] == arm, "collapsed"].sum()),
                         reference_collapses=int(runs.loc[runs["arm"] == REFERENCE, "collapsed"].sum()),
                         shift=float(shifts[j]), shift_low=low, shift_high=high, undefined=int(np.isnan(b).sum()),
                         p=p, equivalent=bool(abs(low) < margin and abs(high) < margin),
                         power=_edge_power(mine, beta[:2], margin, power_sims, gen)))
    return dict(arms=pd.DataFrame(rows), margin=margin, slope=float(beta[1]))


def _edge_power(runs: pd.DataFrame, reference: np.ndarray, margin: float, sims: int, gen) -> float:
    """Simulated power of the arm term's penalised LR test (two-sided, 0.05) when the arm's edge sits one margin
    above the reference's, on this design (its step sizes and seeds), the reference curve as fitted."""
    if reference[1] <= 0 or sims == 0:
        return math.nan
    arm = (runs["arm"] != REFERENCE).to_numpy(dtype=float)
    X = np.column_stack([np.ones(len(runs)), np.log(runs["lr"].to_numpy(dtype=float)), arm])
    truth = X @ np.array([reference[0], reference[1], -margin * reference[1]])
    hits = sum(lr_test(X, (gen.random(len(runs)) < _expit(truth)).astype(float), 2) < 0.05 for _ in range(sims))
    return hits / sims


# --- Q3: the long horizon -------------------------------------------------------------------------------------------

def long_horizon(runs: pd.DataFrame) -> dict:
    """Q3 from one row per run: `arm`, `seed`, `rises_then_collapses`. Per arm the count with its exact interval; H6:
    Fisher's one-sided p that the on-policy arm rises-then-collapses less often than default BF16; the power of that
    test for collapse rates 0.6 against 0 with the seeds run."""
    rows = []
    for arm, g in runs.groupby("arm", sort=False):
        k = int(g["rises_then_collapses"].sum())
        low, high = clopper_pearson(k, len(g))
        rows.append(dict(arm=arm, seeds=len(g), rises_then_collapses=k, ci_low=low, ci_high=high))
    table = pd.DataFrame(rows).set_index("arm")
    out = dict(arms=table, H6=None, power=None)
    if {REFERENCE, ON_POLICY} <= set(table.index):
        ref, onp = table.loc[REFERENCE], table.loc[ON_POLICY]
        out["H6"] = fisher_one_sided(int(ref["rises_then_collapses"]), int(ref["seeds"]),
                                     int(onp["rises_then_collapses"]), int(onp["seeds"]))
        out["power"] = fisher_power(*PAPER_LIKE_RATES, int(min(ref["seeds"], onp["seeds"])))
    return out


# --- the family and the verdicts -----------------------------------------------------------------------------------

def holm_family(q1: dict | None, q2: dict | None, q3: dict | None, alpha: float = 0.05) -> dict[str, dict]:
    """Holm's correction over the registered H1-H6; a test whose runs are missing has no p and still counts."""
    p = dict.fromkeys(TESTS)
    if q1:
        p["H1"], p["H2"] = q1["H1"], q1["H2"]
    if q2:
        for row in q2["arms"].itertuples():
            if row.test:
                p[row.test] = row.p
    if q3:
        p["H6"] = q3["H6"]
    return holm(p, alpha)


def _adjusted(family, test) -> str:
    t = family[test]
    return f"{test}: p = {t['p']:.2g}, Holm-adjusted {t['adjusted']:.2g}"


@prose
def q1_verdict(q1: dict, family: dict) -> str:
    """Q1's answer: a dose that collapses training (a cause) only if H1 rejects after Holm's correction."""
    if q1 is None or q1["H1"] is None:
        return "Q1 (dose): not run"
    fits = q1["fits"].set_index("tis")
    rungs = q1["rungs"][~q1["rungs"]["tis"]]
    if not family["H1"]["rejects"]:
        seeds = int(rungs["seeds"].min())
        return (f"Q1 (dose): cannot tell whether mismatch collapses training here ({_adjusted(family, 'H1')}); power "
                f"{fisher_power(*PAPER_LIKE_RATES, seeds):.0%} to see collapse rates {PAPER_LIKE_RATES[0]:g} against "
                f"{PAPER_LIKE_RATES[1]:g} between two doses with {seeds} seeds each")
    f = fits.loc[False]
    text = (f"Q1 (dose): mismatch collapses training: collapse rises with dose ({_adjusted(family, 'H1')}); half the "
            f"runs collapse at {f['d50']:.3g} [{f['d50_low']:.3g}, {f['d50_high']:.3g}] nats per response")
    if q1["natural"]:
        n = q1["natural"]
        text += (f"; natural BF16 mismatch sits at {n['ratio']:.2g} [{n['ratio_low']:.2g}, {n['ratio_high']:.2g}] "
                 "of that dose")
    if q1["H2"] is not None:
        text += ("; TIS moves it up (" if family["H2"]["rejects"] else "; cannot tell whether TIS moves it (") + \
            _adjusted(family, "H2") + ")"
    return text


@prose
def q2_verdict(q2: dict, family: dict) -> str:
    """Q2's answer per arm: a shift only from a test that rejects after Holm; "no shift that matters" only with the
    whole interval inside the margin; otherwise cannot tell, with the power to see one margin."""
    if q2 is None:
        return "Q2 (edge): not run"
    margin = math.exp(q2["margin"]) - 1
    parts = []
    for row in q2["arms"].itertuples():
        factor = f"x{math.exp(row.shift):.2f} [{math.exp(row.shift_low):.2f}, {math.exp(row.shift_high):.2f}]"
        if row.test and family[row.test]["rejects"]:
            parts.append(f"{row.arm} moves the edge {factor} ({_adjusted(family, row.test)})")
        elif row.equivalent:
            parts.append(f"{row.arm}: no shift that matters, {factor} inside +-{margin:.0%}")
        else:
            parts.append(f"{row.arm}: cannot tell, {factor}; power {row.power:.0%} to see a {margin:.0%} shift")
    return "Q2 (edge, step size of half collapse against default BF16): " + "; ".join(parts)


@prose
def q3_verdict(q3: dict, family: dict) -> str:
    """Q3's answer: default BF16 rises then collapses more often only if H6 rejects after Holm."""
    if q3 is None or q3["H6"] is None:
        return "Q3 (long horizon): not run"
    t = q3["arms"]
    counts = ", ".join(f"{arm} {int(r['rises_then_collapses'])}/{int(r['seeds'])}" for arm, r in t.iterrows())
    if family["H6"]["rejects"]:
        return f"Q3 (long horizon): default BF16 rises then collapses more often than on-policy ({counts}; " \
               f"{_adjusted(family, 'H6')})"
    return (f"Q3 (long horizon): cannot tell ({counts}; {_adjusted(family, 'H6')}); power {q3['power']:.0%} to see "
            f"rates {PAPER_LIKE_RATES[0]:g} against {PAPER_LIKE_RATES[1]:g}")
