"""The dose-response study: how much train/inference mismatch does uncorrected GRPO tolerate?

    runs = run_table(histories)                 # one row per run: its dose, measured mismatch and outcome
    arms = arm_table(runs)                      # one row per arm: mean and se over seeds
    versus_reference(runs)                      # each arm minus default BF16, paired by seed, with a t interval
    fit = threshold(runs[~runs.tis])            # where accuracy starts to fall, with a bootstrap CI
    verdict_table(fits); mark_table(fits, marks)  # the verdicts, a row per fit and per reference mark

The dose is applied on the rollout side only (`arms.dose_configurations`: coarser rollout weights, or logit
noise in the engine's sampler); the trained policy stays BF16. The x axis (`DOSE`) is what the run *measured*, not
the knob, before training changed it: the mismatch per response at the run's first training step (sampled from the
initial weights, before any update), the exact KL(inference || training) summed over each response's tokens
(`seq_exact_kl_start`, nats; `seq_k3_start` is the k3 estimate of the same sum; the means over all steps,
`seq_exact_kl` and `seq_k3`, are kept beside them). Per-response, because that is what a sequence-level importance
ratio sees and what grows with response length.

Outcomes are the trained policy's held-out accuracy (`eval_accuracy_policy`: with coarse rollouts the
engine's copy is not the policy). Per run: first, peak, final, and worst after the peak; `degraded` / `diverged`
as `stability.accuracy_verdict` defines them (a drop beyond NOISE_Z binomial standard errors of the
evaluations compared).

The threshold is a breakpoint fit over runs: accuracy = a for log10(mismatch) <= t, a - b (log10(mismatch) - t)
above, b >= 0 (a "hockey stick"), least squares with t on a grid spanning the dosed runs. Its 95% CI comes from
resampling seeds within each arm (2000 bootstrap fits). Where the best fit has no fall (b = 0), or the fall
is within noise, there is no threshold inside the tested range and the verdict says so.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..report import prose
from .arms import CONFIGURATIONS, ENGINE_SCHEDULE, TIS, dose_configurations
from .stability import NOISE_Z, accuracy_verdict, binomial_se, eval_problems, policy_accuracy, seed_sd

KINDS = ("none", "bits", "noise", "aligned", "fp32")  # default BF16; the two doses; the zero-mismatch arms
REFERENCE = "default BF16"  # the arm every other is compared with
DOSE = "seq_exact_kl_start"  # the dose axis: per-response exact KL (nats) at the first training step
KIND_LABELS = {"none": "default BF16", "bits": "coarse rollout weights", "noise": "logit noise",
               "aligned": "aligned training side", "fp32": "FP32 both sides"}


def arm_of(config: str) -> dict:
    """What an arm's name stands for: dose kind, dose (mantissa bits or noise sigma), TIS on or off."""
    settings = (CONFIGURATIONS | dose_configurations()).get(config)
    if settings is None and config != ENGINE_SCHEDULE:
        raise ValueError(f"unknown arm {config!r}")
    settings = settings or {}
    if settings.get("precision") == "fp32":
        kind, dose = "fp32", np.nan
    elif config == ENGINE_SCHEDULE or settings.get("regions"):
        kind, dose = "aligned", np.nan
    elif settings.get("rollout_mantissa_bits") is not None:
        kind, dose = "bits", float(settings["rollout_mantissa_bits"])
    elif settings.get("rollout_logit_noise"):
        kind, dose = "noise", float(settings["rollout_logit_noise"])
    else:
        kind, dose = "none", np.nan
    return dict(kind=kind, dose=dose, tis=settings.get("tis_cap") is not None, base=config.removesuffix(TIS))


def run_outcome(history: pd.DataFrame, eval_prompts: int | None = None) -> dict:
    """One run: its measured mismatch (at the first training step, and means over steps) and its policy's held-out
    accuracy outcomes."""
    n = eval_problems(history, eval_prompts)
    ev = policy_accuracy(history)
    h = history[history["step"] > 0]
    logged = h.dropna(subset=["seq_exact_kl"]).sort_values("step")
    start = logged.iloc[0] if len(logged) else pd.Series(dtype=float)  # the first training step: before any update
    verdict = accuracy_verdict(ev["step"], ev["accuracy"], n)
    after_peak = ev[ev["step"] >= verdict["peak_step"]]["accuracy"]
    return dict(
        seq_exact_kl_start=start.get("seq_exact_kl", np.nan), seq_k3_start=start.get("seq_k3", np.nan),
        seq_exact_kl=h["seq_exact_kl"].mean(), seq_k3=h["seq_k3"].mean(), exact_kl=h["exact_kl"].mean(),
        k3=h["k3"].mean(), response_len=h["response_len"].mean(), steps=int(h["step"].max()),
        acc_first=ev["accuracy"].iloc[0], acc_peak=ev["accuracy"].max(), peak_step=verdict["peak_step"],
        acc_last=ev["accuracy"].iloc[-1], acc_worst_after_peak=after_peak.min(), eval_prompts=n,
        degraded=verdict["degraded"], diverged=verdict["diverged"], margin=verdict["margin"])


def run_table(histories: pd.DataFrame, eval_prompts: int | None = None) -> pd.DataFrame:
    """One row per run of stacked histories (columns `run`, `config`, `seed`, and the study's per-step columns)."""
    rows = []
    for run, h in histories.groupby("run", sort=False):
        config = h["config"].iloc[0]
        rows.append(dict(run=run, config=config, seed=int(h["seed"].iloc[0]), **arm_of(config),
                         **run_outcome(h, eval_prompts)))
    return pd.DataFrame(rows)


def arm_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per arm, in the order arms first appear: mean and standard error over seeds, and how many seeds
    degraded or diverged. Accuracy se is over seeds (training randomness and evaluation noise together)."""
    metrics = ["seq_exact_kl_start", "seq_k3_start", "seq_exact_kl", "seq_k3", "exact_kl", "k3", "response_len",
               "acc_first", "acc_peak", "acc_last", "acc_worst_after_peak"]
    g = runs.groupby("config", sort=False)
    out = g[["kind", "dose", "tis", "base"]].first()
    for m in metrics:
        out[m], out[m + " se"] = g[m].mean(), g[m].sem()
    out["seeds"], out["degraded"], out["diverged"] = g.size(), g["degraded"].sum().astype(int), g["diverged"].sum().astype(int)
    out["eval se"] = binomial_se(out["acc_last"], int(runs["eval_prompts"].iloc[0]))
    if (runs["config"] == REFERENCE).any():  # each arm against default BF16, paired by seed
        for y, name in (("acc_last", "final"), ("acc_worst_after_peak", "worst after peak")):
            versus = versus_reference(runs, y)[["diff", "ci_low", "ci_high", "verdict", "detectable"]]
            out = out.join(versus.add_prefix(f"{name} vs {REFERENCE} "))
    return out.reset_index()


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (q > 0.5), by bisection on its CDF (Simpson's rule on the density)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = lambda t: np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
    def cdf(x):
        t = np.linspace(0.0, x, 2001)
        w = np.ones_like(t); w[1:-1:2], w[2:-1:2] = 4, 2
        return 0.5 + float((w * density(t)).sum() * (x / 2000) / 3)
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def versus_reference(runs: pd.DataFrame, y: str = "acc_last", reference: str = REFERENCE,
                     level: float = 0.95, power: float = 0.8) -> pd.DataFrame:
    """Per arm: `y` minus the reference arm's, paired by seed (the same seed gives both arms the same prompts), the
    mean difference and its t interval over seeds, and whether it is `lower`/`higher` beyond seed noise or `within`
    it. With 3 seeds the t interval is wide (t = 4.3): only large falls count. `detectable` is the power: the
    smallest true difference the arm's seeds find with probability `power` (paired t, the SD of the differences
    pooled over arms)."""
    ref = runs[runs["config"] == reference].set_index("seed")[y]
    diffs = {config: (g.set_index("seed")[y] - ref).dropna()
             for config, g in runs[runs["config"] != reference].groupby("config", sort=False)}
    pooled = seed_sd(pd.concat(diffs, names=["config", "seed"]).rename(y).reset_index(), y) if diffs else 0.0
    rows = []
    for config, d in diffs.items():
        n, mean = len(d), float(d.mean()) if len(d) else np.nan
        t = t_quantile((1 + level) / 2, n - 1) if n > 1 else np.nan
        half = t * float(d.std(ddof=1)) / np.sqrt(n) if n > 1 else np.nan
        verdict = ("lower" if mean + half < 0 else "higher" if mean - half > 0 else "within seed noise") \
            if np.isfinite(half) else "one seed: no interval"
        detectable = (t + t_quantile(power, n - 1)) * pooled / np.sqrt(n) if n > 1 and pooled > 0 else np.nan
        rows.append({"config": config, "seeds": n, "diff": mean, "ci_low": mean - half, "ci_high": mean + half,
                     "verdict": verdict, "detectable": detectable})
    return pd.DataFrame(rows).set_index("config")


# ---- the threshold -------------------------------------------------------------------------------------
def fit_runs(runs: pd.DataFrame, kind: str = "both", tis: bool = False) -> pd.DataFrame:
    """The runs of one fit: the doses of `kind` ("bits", "noise" or "both") with or without TIS, default BF16 with the
    same TIS setting, and the zero-mismatch arms (aligned, FP32: TIS changes nothing there) as the low anchor."""
    kinds = ["bits", "noise"] if kind == "both" else [kind]
    dosed = runs["kind"].isin(kinds + ["none"]) & (runs["tis"] == tis)
    return runs[dosed | runs["kind"].isin(["aligned", "fp32"])]


def fit_table(runs: pd.DataFrame, n_boot: int = 2000) -> pd.DataFrame:
    """Every fit the study reports: each dose kind (and both pooled) x TIS off / on x final / worst-after-peak."""
    rows = []
    for kind in ("both", "bits", "noise"):
        for tis in (False, True):
            for y in ("acc_last", "acc_worst_after_peak"):
                fit = threshold(fit_runs(runs, kind, tis), y=y, n_boot=n_boot)
                rows.append(dict(kind=kind, tis=tis, outcome=y, **{k: v for k, v in fit.items() if k != "y"}))
    return pd.DataFrame(rows)


def _hockey_stick(x, y, grid):
    """Best (sse, t, a, b) of y = a - b * max(0, x - t), b >= 0, over breakpoints t in grid (all t at once)."""
    hinge = np.maximum(0.0, x[None, :] - grid[:, None])  # (breakpoints, runs)
    hc = hinge - hinge.mean(1, keepdims=True)
    var = (hc**2).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        b = np.where(var > 0, -(hc * (y - y.mean())).sum(1) / var, 0.0)
    b = np.maximum(b, 0.0)  # a rise with mismatch is no threshold: the flat fit
    a = y.mean() + b * hinge.mean(1)
    sse = ((y[None, :] - (a[:, None] - b[:, None] * hinge)) ** 2).sum(1)
    i = int(np.argmin(np.round(sse, 15)))  # the first (lowest) breakpoint among equal fits
    return float(sse[i]), float(grid[i]), float(a[i]), float(b[i])


def threshold(runs: pd.DataFrame, x: str = DOSE, y: str = "acc_last", n_boot: int = 2000, seed: int = 0,
              level: float = 0.95, grid_points: int = 121) -> dict:
    """Where `y` starts to fall with the mismatch `x` (log10 scale), over the runs given (one TIS setting).

    Returns the breakpoint (`threshold`, in x's units) and its bootstrap CI, the fitted fall per decade beyond it
    (`slope`), the fitted fall at the largest dose (`fall_at_max`) against the margin a fall must exceed to count
    (`margin`: NOISE_Z standard deviations of the difference between two runs' outcomes, from the seed-to-seed SD
    within arms, evaluation noise included, or two binomial SEs where that is larger), and `found`: whether the fall
    at the largest dose exceeds the margin. The CI resamples seeds within each arm. `at_lowest_dose`: the breakpoint
    is the lowest dose tested, so accuracy falls from the first dose on and no breakpoint is located inside the range.
    """
    runs = runs[np.isfinite(runs[x]) & (runs[x] > 0) & np.isfinite(runs[y])]
    if runs["config"].nunique() < 3:  # a breakpoint and a slope need at least three arms
        return dict(x=x, y=y, runs=len(runs), fitted=False, found=False, threshold=np.nan, ci_low=np.nan, ci_high=np.nan, slope=0.0,
                    at_lowest_dose=False, plateau=float(runs[y].mean()), fall_at_max=0.0, margin=np.nan,
                    max_tested=float(runs[x].max()) if len(runs) else np.nan, share_without_fall=np.nan)
    lx, acc = np.log10(runs[x].to_numpy(float)), runs[y].to_numpy(float)
    dosed = runs["kind"].isin(["bits", "noise"]).to_numpy()
    grid = np.linspace(lx[dosed].min() if dosed.any() else lx.min(), lx.max(), grid_points)
    _, t, a, b = _hockey_stick(lx, acc, grid)
    n = int(runs["eval_prompts"].iloc[0])
    margin = float(NOISE_Z * np.sqrt(2) * max(seed_sd(runs, y), binomial_se(a, n)))
    fall = b * max(0.0, lx.max() - t) if np.isfinite(t) else 0.0
    found = bool(b > 0 and fall > margin)
    groups = [np.flatnonzero(runs["config"].to_numpy() == c) for c in dict.fromkeys(runs["config"])]
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        idx = np.concatenate([rng.choice(g, len(g)) for g in groups])
        _, tb, _, bb = _hockey_stick(lx[idx], acc[idx], grid)
        fell = bb > 0 and bb * max(0.0, lx.max() - tb) > margin
        boot.append(tb if fell else np.inf)  # no fall beyond noise in this resample: beyond the tested range
    boot = np.array(boot)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")  # no interpolation with inf
    return dict(x=x, y=y, runs=len(runs), fitted=True, found=found, threshold=10**t if found else np.nan,
                at_lowest_dose=bool(found and t == grid[0]),
                ci_low=10**lo if found else np.nan, ci_high=10**hi if found and np.isfinite(hi) else np.inf if found else np.nan,
                slope=float(b), plateau=float(a), fall_at_max=float(fall), margin=margin, max_tested=float(10 ** lx.max()),
                share_without_fall=float(np.mean(~np.isfinite(boot))))


# ---- reference marks -----------------------------------------------------------------------------------
def reference_marks(runs: pd.DataFrame, steps_runs: pd.DataFrame | None, real_shape_kl: dict | None,
                    lengths=(1000, 8000)) -> list[dict]:
    """Per-response mismatch of default BF16 where it was measured, and what the paper's setting implies.

    real_shape_kl: dict(value=..., ci_low=..., ci_high=...) per-token exact KL in nats of stock BF16 Transformers
    against compiled vLLM at the Qwen3-0.6B shape (notebook 03b's real-shape table); times response `lengths`.
    """
    marks = []
    for label, table in (("default BF16, embedded model (short answers)", runs),
                         ("default BF16, embedded model (long answers)", steps_runs)):
        if table is None or not len(table):
            continue
        bf16 = table[(table["kind"] == "none") & ~table["tis"]]
        if len(bf16):
            marks.append(dict(label=label, value=bf16[DOSE].mean(), low=bf16[DOSE].min(), high=bf16[DOSE].max(),
                              tokens=bf16["response_len"].mean()))
    if real_shape_kl:
        marks.append(dict(label=f"paper-like: Qwen3-0.6B-shape per-token KL x {lengths[0]:,}-{lengths[1]:,} tokens",
                          value=real_shape_kl["value"] * np.sqrt(lengths[0] * lengths[1]),
                          low=real_shape_kl["ci_low"] * lengths[0], high=real_shape_kl["ci_high"] * lengths[1],
                          tokens=float(np.sqrt(lengths[0] * lengths[1]))))
    return marks


# ---- the verdict ---------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.2g}"


OUTCOMES = {"acc_last": "final accuracy", "acc_worst_after_peak": "the worst accuracy after the peak"}


@prose
def tis_sentence(without: dict, with_tis: dict) -> str:
    if not (without.get("fitted", True) and with_tis.get("fitted", True)):
        return "Whether TIS moves the threshold needs both fits (too few arms in one of them)."
    if without["found"] and with_tis["found"]:
        overlap = without["ci_low"] <= with_tis["ci_high"] and with_tis["ci_low"] <= without["ci_high"]
        ratio = with_tis["threshold"] / without["threshold"]
        return (f"TIS moves the threshold by a factor {ratio:.2g} ({'within' if overlap else 'beyond'} the two CIs' "
                f"overlap: {'not shown to move it' if overlap else 'it moves it'}).")
    if without["found"] and not with_tis["found"]:
        return ("With TIS no fall beyond noise is left in the tested range, where without it accuracy falls: "
                "TIS moves the threshold past the largest dose tested.")
    if with_tis["found"] and not without["found"]:
        return "Only the TIS runs fall beyond noise in the tested range: TIS does not help here."
    return "Neither with nor without TIS does final accuracy fall beyond noise in the tested range."


@prose
def mark_position(mark: dict, fit: dict) -> str:
    """Where a reference mark's mismatch sits against a fit: below its threshold's CI, inside it, or against the
    largest dose tested when no threshold was found."""
    edge = fit["threshold"] if fit["found"] else fit["max_tested"]
    if fit["found"] and np.isfinite(fit["ci_low"]):
        factor = fit["ci_low"] / mark["value"]
        return (f"{factor:.2g}x below the threshold's lower CI bound" if factor > 1
                else f"inside or above the threshold's CI (its lower bound is {_fmt(fit['ci_low'])})")
    factor = edge / mark["value"]
    return (f"{factor:.2g}x below the largest mismatch tested ({_fmt(edge)}), at which the pooled fit's fall of "
            f"{OUTCOMES.get(fit.get('y'), 'accuracy')} was within the noise margin" if factor > 1
            else f"beyond the tested range (up to {_fmt(edge)})")


def fits_by_key(fits: pd.DataFrame) -> dict:
    """A `fit_table` (or the table it was saved to) as {(kind, tis, outcome): fit}, each fit as `threshold` returns it."""
    return {(r["kind"], bool(r["tis"]), r["outcome"]): r.to_dict() | dict(y=r["outcome"]) for _, r in fits.iterrows()}


@prose
def threshold_verdict(fit: dict) -> str:
    """A fit's verdict in a few words (its numbers are `verdict_table`'s other columns)."""
    if not fit.get("fitted", True):
        return "too few arms to fit"
    if not fit["found"]:
        return "no fall beyond noise in the tested range"
    where = ("falls from the lowest dose tested (no breakpoint inside the range)" if fit.get("at_lowest_dose")
             else "falls from the threshold on")
    shaky = fit["share_without_fall"] > 0.025  # the CI's upper end is "no fall at all"
    return where + (f"; not established ({fit['share_without_fall']:.0%} of seed resamples show no fall)" if shaky else "")


@prose
def verdict_table(fits: pd.DataFrame, worst_after_peak: bool = False) -> pd.DataFrame:
    """The study's verdict as a table, a row per fit: both kinds pooled without and with TIS, each kind alone,
    (the worst-after-peak fit,) with the threshold and its CI, the fall at the largest dose against the noise
    margin, and `threshold_verdict`."""
    fit = fits_by_key(fits)
    keys = [("both", False, "acc_last"), ("both", True, "acc_last")]
    keys += [(kind, tis, "acc_last") for kind in ("bits", "noise") for tis in (False, True)]
    keys += [("both", False, "acc_worst_after_peak")] if worst_after_peak else []
    rows = []
    for kind, tis, outcome in keys:
        f = fit[(kind, tis, outcome)]
        found = f.get("fitted", True) and f["found"]
        rows.append({"arms": "both kinds pooled" if kind == "both" else f"{KIND_LABELS[kind]} only",
                     "TIS": "with" if tis else "without", "outcome": OUTCOMES[outcome], "runs": int(f["runs"]),
                     "threshold (nats per response)": _fmt(f["threshold"]) if found else "—",
                     "95% CI": f"{_fmt(f['ci_low'])} to {_fmt(f['ci_high'])}" if found else "—",
                     "fall per tenfold dose": f"{f['slope']:.3f}" if found else "—",
                     "fall at the largest dose": f"{f['fall_at_max']:.3f}" if f.get("fitted", True) else "—",
                     "noise margin": f"{f['margin']:.3f}" if f.get("fitted", True) else "—",
                     "verdict": threshold_verdict(f)})
    return pd.DataFrame(rows)


@prose
def mark_table(fits: pd.DataFrame, marks: list[dict]) -> pd.DataFrame:
    """Where each reference mark's mismatch sits against the pooled fit without TIS (`mark_position`)."""
    both = fits_by_key(fits)[("both", False, "acc_last")]
    return pd.DataFrame([{"mark": m["label"], "nats per response": _fmt(m["value"]), "tokens": f"{m['tokens']:.0f}",
                          "against the pooled fit without TIS": mark_position(m, both)}
                         for m in marks])


@prose
def tis_verdict(fits: pd.DataFrame) -> str:
    """Whether TIS moves the pooled threshold (`tis_sentence` over the two pooled fits)."""
    fit = fits_by_key(fits)
    return tis_sentence(fit[("both", False, "acc_last")], fit[("both", True, "acc_last")])
