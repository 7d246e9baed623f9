"""Collapse, defined before the runs, and what a study of it can tell apart (notebook 06b's collapse study).

    collapse(steps, accuracies, n)              # did a run collapse, and at which step
    rises_then_collapses(steps, accuracies, n)  # the long-horizon endpoint: learned beyond noise, then collapsed
    false_positive_rate(p, n, steps)            # how often a flat run (nothing learned, nothing lost) is called
                                                # collapsed, or "degraded" by `stability.accuracy_verdict`
    fisher_one_sided(a, n_a, b, n_b)            # p-value of "arm b collapses less often than arm a"
    seeds_for_rates(rate_a, rate_b)             # seeds per arm for that test to see rate_a vs rate_b
    seeds_for_difference(sd, delta)             # seeds per arm to see a difference in final accuracy
    mismatch_alarm(steps, mismatch)             # the step at which a run's mismatch starts rising (or None)
    learning(histories)                         # per run of one arm: did it learn beyond noise (nothing to collapse if not)
    warning_signs(histories, column)            # per run: did the mismatch rise before the collapse, by how many steps
    step_size_table(rates, grid)                # per arm: fewer collapses at the smaller of two step sizes?
    stage0(histories, kept)                     # the pre-registered pilot: which regime learns, by its rule
    stage0_shipped()                            # its finished runs kept in the repository (data/grpo_runs)

The paper's pattern is a run that rises, then falls to near zero and stays there. A fall "beyond noise" from a peak
(`stability.accuracy_verdict`'s "degraded") also fires on flat runs: the peak is the maximum of several noisy
evaluations. A collapse here is stricter: from some evaluation on, every evaluation is below `FRACTION` of the peak
and below the peak by more than the noise margin; that evaluation's step is the time to collapse. The peak may be
step 0 (the long-answer lead fell from its starting accuracy to zero): `peak_step` says whether the run rose first.
Its false-positive rate on flat runs is computed by simulating the evaluations (the same problems per evaluation
and schedule); on few problems it is large, which is why the study evaluates on hundreds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np

from ..paths import DATA_DIR, slug
from ..report import prose
from .stability import NOISE_Z, accuracy_verdict, binomial_se

FRACTION = 0.5  # a collapse ends below half the peak accuracy (the paper's runs fall to near zero)
MIN_SEEDS = 5


def collapse(steps, accuracies, n: int, fraction: float = FRACTION) -> dict:
    """`collapsed` and `step` (the first evaluation of the stretch that stays low to the end, or None) of one run's
    held-out evaluations (`steps` in order, step 0 before training; `n` problems each)."""
    steps, acc = np.asarray(steps), np.asarray(accuracies, dtype=float)
    if len(acc) == 0:
        return dict(collapsed=False, step=None, peak_step=None)
    peak_at = int(np.argmax(acc))
    margin = NOISE_Z * np.hypot(binomial_se(acc[peak_at], n), binomial_se(acc, n))
    low = (acc < fraction * acc[peak_at]) & (acc[peak_at] - acc > margin)
    low[: peak_at + 1] = False
    stays_low = np.logical_and.accumulate(low[::-1])[::-1]  # low here and at every later evaluation
    first = int(np.argmax(stays_low)) if stays_low.any() else None
    return dict(collapsed=first is not None, step=None if first is None else int(steps[first]),
                peak_step=int(steps[peak_at]))


def rises_then_collapses(steps, accuracies, n: int) -> bool:
    """The registered long-horizon endpoint: a collapse whose peak is above the first evaluation by more than
    NOISE_Z binomial standard errors (a run that learned, then lost it)."""
    acc = np.asarray(accuracies, dtype=float)
    out = collapse(steps, acc, n)
    if not out["collapsed"]:
        return False
    peak = acc.max()
    return bool(peak - acc[0] > NOISE_Z * np.hypot(binomial_se(peak, n), binomial_se(acc[0], n)))


def false_positive_rate(p: float, n: int, steps, runs: int = 20_000, seed: int = 0) -> dict:
    """The share of flat runs (every evaluation Binomial(n, p) / n, nothing learned) that `collapse` calls collapsed
    and that `accuracy_verdict` calls degraded, each with its Monte Carlo standard error and exact 95% interval."""
    gen = np.random.default_rng(seed)
    evaluations = gen.binomial(n, p, size=(runs, len(steps))) / n
    counts = {"collapsed": sum(collapse(steps, a, n)["collapsed"] for a in evaluations),
              "degraded": sum(accuracy_verdict(steps, a, n)["degraded"] for a in evaluations)}
    out = {"runs": runs}
    for name, k in counts.items():  # the exact interval: none of 20,000 is a bound, not a zero
        rate, (low, high) = k / runs, clopper_pearson(int(k), runs)
        out |= {name: rate, f"{name} se": float(np.sqrt(rate * (1 - rate) / runs)), f"{name} ci_low": low,
                f"{name} ci_high": high}
    return out


def _hypergeometric(k: int, n_a: int, n_b: int, total: int) -> float:
    """P(arm a holds k of the `total` collapses) with the margins fixed."""
    return math.comb(n_a, k) * math.comb(n_b, total - k) / math.comb(n_a + n_b, total)


def fisher_one_sided(a: int, n_a: int, b: int, n_b: int) -> float:
    """Fisher's exact p-value that arm b collapses less often than arm a: a collapses in n_a seeds, b in n_b.
    P(arm a holds a or more of the a + b collapses), the margins fixed."""
    total = a + b
    return float(sum(_hypergeometric(k, n_a, n_b, total) for k in range(a, min(n_a, total) + 1)))


def fisher_power(rate_a: float, rate_b: float, n: int, alpha: float = 0.05) -> float:
    """The chance that `fisher_one_sided` rejects at `alpha` with n seeds per arm, when arm a collapses with
    probability rate_a and arm b with rate_b (exact: every outcome enumerated)."""
    pa = [math.comb(n, k) * rate_a**k * (1 - rate_a) ** (n - k) for k in range(n + 1)]
    pb = [math.comb(n, k) * rate_b**k * (1 - rate_b) ** (n - k) for k in range(n + 1)]
    return float(sum(pa[a] * pb[b] for a in range(n + 1) for b in range(n + 1)
                     if fisher_one_sided(a, n, b, n) <= alpha))


def seeds_for_rates(rate_a: float, rate_b: float, alpha: float = 0.05, power: float = 0.8, most: int = 60) -> int | None:
    """The fewest seeds per arm (at least `MIN_SEEDS`) for Fisher's one-sided test to tell rate_a from rate_b at
    `alpha` with `power`; None if `most` are not enough."""
    for n in range(MIN_SEEDS, most + 1):
        if fisher_power(rate_a, rate_b, n, alpha) >= power:
            return n
    return None


def seeds_for_difference(sd: float, delta: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds per arm to see a difference `delta` in a per-seed quantity with seed-to-seed SD `sd` (two-sided `alpha`,
    normal approximation), at least `MIN_SEEDS`."""
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return max(MIN_SEEDS, math.ceil(2 * (z * sd / delta) ** 2))


def smallest_detectable(sd: float, seeds: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest difference in a per-seed quantity `seeds_for_difference` sees with `seeds` per arm."""
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    return float(z * sd * math.sqrt(2 / seeds))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a rate seen k times in n seeds."""
    def at_most(j, p):  # P(X <= j) for X ~ Binomial(n, p), 0 < p < 1: falls as p grows (log terms: n may be large)
        log_n = math.lgamma(n + 1)
        return sum(math.exp(log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p))
                   for i in range(j + 1))

    def solve(falling, target):  # the p in [0, 1] where falling(p) = target, by bisection
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if falling(mid) > target else (lo, mid)
        return (lo + hi) / 2

    tail = (1 - level) / 2
    low = 0.0 if k == 0 else solve(lambda p: at_most(k - 1, p), 1 - tail)  # P(X >= k) = tail
    high = 1.0 if k == n else solve(lambda p: at_most(k, p), tail)  # P(X <= k) = tail
    return float(low), float(high)


def _problems(run, history, problems: int | None) -> int:
    """Problems per evaluation of one run: its `eval_prompts` column, else `problems` (histories without the column)."""
    n = int(history["eval_prompts"].dropna().iloc[0]) if history["eval_prompts"].notna().any() else problems
    if n is None:
        raise ValueError(f"run {run} does not say how many problems each evaluation used: pass problems=")
    return n


def learning(histories, config: str = "FP32 control", problems: int | None = None) -> "pd.DataFrame":
    """Per run of `config` (one row per sweep and seed): held-out accuracy at step 0, its peak, the last evaluation and
    the mean of the evaluations in the run's second half (`late`: less noisy than the last alone), the gain of `late`
    over step 0 with its binomial standard error (on a fixed problem set, an upper bound of the sampling noise) and
    `learned`: a gain beyond NOISE_Z standard errors. Learning comes first: a run that learns nothing has nothing to
    collapse from."""
    import pandas as pd

    rows = []
    for run, h in histories[histories["config"] == config].groupby("run", sort=False):
        ev = h.dropna(subset=["eval_accuracy"]).sort_values("step")
        n = _problems(run, h, problems)
        first, steps, acc = ev["eval_accuracy"].iloc[0], ev["step"].to_numpy(), ev["eval_accuracy"].to_numpy()
        late = acc[steps > steps[-1] / 2]
        gain = late.mean() - first
        se = float(np.hypot(binomial_se(first, n), binomial_se(late.mean(), n * len(late))))
        rows.append(dict(sweep=h["sweep"].iloc[0], seed=int(h["seed"].iloc[0]), steps=int(steps[-1]), problems=n,
                         first=first, peak=acc.max(), peak_step=int(steps[acc.argmax()]), last=acc[-1],
                         late=late.mean(), late_evaluations=len(late), gain=gain, gain_se=se,
                         learned=bool(gain > NOISE_Z * se)))
    return pd.DataFrame(rows)


def collapse_rates(histories, by=("sweep", "config"), reference: str = "default BF16",
                   problems: int | None = None) -> "pd.DataFrame":
    """Per setting (`by`): seeds, collapses with the exact interval, median step of collapse, training steps and how
    many of them were exactly on-policy (`bitwise_steps`: every sampled token's training-side logprob equal to the
    engine's, max |difference| 0), and Fisher's one-sided p-value of fewer collapses than `reference` at the same
    `by[:-1]` (e.g. the same sweep). `problems`: per
    evaluation, for histories without an `eval_prompts` column (the settings search's sidecar has it)."""
    import pandas as pd

    rows = []
    for run, h in histories.groupby("run", sort=False):
        ev = h.dropna(subset=["eval_accuracy"]).sort_values("step")
        n = _problems(run, h, problems)
        out = collapse(ev["step"], ev["eval_accuracy"], n)
        rose = out["peak_step"] not in (None, 0)
        trained = h[h["step"] > 0]
        rows.append({**{b: h[b].iloc[0] for b in by}, "collapsed": out["collapsed"], "step": out["step"],
                     "rose first": rose, "rose then collapsed": rose and out["collapsed"],
                     "steps": len(trained), "bitwise steps": int((trained["max_abs_diff"] == 0).sum())})
    runs = pd.DataFrame(rows)
    table = runs.groupby(list(by), sort=False).agg(seeds=("collapsed", "size"), collapses=("collapsed", "sum"),
                                                   rose_first=("rose first", "sum"),
                                                   rose_then_collapsed=("rose then collapsed", "sum"),
                                                   median_step=("step", "median"), steps=("steps", "sum"),
                                                   bitwise_steps=("bitwise steps", "sum"))
    table[["ci_low", "ci_high"]] = [clopper_pearson(int(k), int(n)) for k, n in zip(table["collapses"], table["seeds"])]
    ref = {key[:-1]: row for key, row in table.iterrows() if key[-1] == reference}
    table["p fewer than " + reference] = [
        fisher_one_sided(int(ref[key[:-1]]["collapses"]), int(ref[key[:-1]]["seeds"]), int(row["collapses"]), int(row["seeds"]))
        if key[:-1] in ref and key[-1] != reference else float("nan") for key, row in table.iterrows()]
    return table


ALIGNED_ARMS = ("rope", "all three", "engine schedule")


def _counts(g, arm: str) -> str:
    """"<arm> <collapses>/<seeds>" from a sweep's `collapse_rates` rows."""
    return f"{arm} {int(g.loc[arm, 'collapses'])}/{int(g.loc[arm, 'seeds'])}"


def _seeds(n) -> str:
    return f"{int(n)} seed" + ("" if int(n) == 1 else "s")


PAPER_LIKE_RATES = (0.6, 0.0)  # the effect that matters: default BF16 collapsing in 3 of 5 runs, the aligned arm in none


@prose
def verdict(rates, sweep: str, reference: str = "default BF16", control: str = "FP32 control",
            alpha: float = 0.05, planned: bool = False) -> str:
    """One sweep's answer from its `collapse_rates` rows. A cause is named ("reproduces the paper", "not the mismatch",
    "the opposite of the paper") only where the comparison was `planned` (pre-registered, data/grpo_study/
    preregistration.json) and significant at `alpha` (the caller's level after Holm's correction); an unplanned one
    says what the counts show and that it is post hoc. Where nothing differs beyond chance it says "cannot tell", with
    the power of these seeds for the effect that matters (`PAPER_LIKE_RATES`): no difference found is never a cause."""
    g = rates.loc[sweep]
    if reference not in g.index:
        return f"no {reference} arm ({', '.join(g.index)} only): nothing to compare"
    ref, c = g.loc[reference], g.loc[control] if control in g.index else None
    counts = _counts(g, reference)
    control_counts = "" if c is None else _counts(g, control)
    post_hoc = "" if planned else ", post hoc"
    # p of "default BF16 collapses less often than the control": the other side of the arms' test
    p_more = np.nan if c is None else fisher_one_sided(int(c["collapses"]), int(c["seeds"]),
                                                       int(ref["collapses"]), int(ref["seeds"]))
    if p_more < alpha:
        return (("not the mismatch: " if planned else "") + f"{control_counts} collapses more often than {counts} "
                f"(Fisher p = {p_more:.2g}{post_hoc})")
    # aligned arms that collapsed, with p of "more often than default BF16": the paper's claim the other way round
    worse = {_counts(g, arm): fisher_one_sided(int(g.loc[arm, "collapses"]), int(g.loc[arm, "seeds"]),
                                               int(ref["collapses"]), int(ref["seeds"]))
             for arm in ALIGNED_ARMS if arm in g.index and g.loc[arm, "collapses"] > ref["collapses"]}
    if beyond := [f"{arm} (Fisher p = {p:.2g}{post_hoc})" for arm, p in worse.items() if p < alpha]:
        return (("the opposite of the paper: " if planned else "") + f"{', '.join(beyond)} "
                f"collapse{'s' if len(beyond) == 1 else ''} more often than {counts}")
    if ref["collapses"] == 0:
        return f"default BF16 did not collapse (0 of {_seeds(ref['seeds'])})" + (
            f"; {control_counts}" if c is not None and c["collapses"] > 0 else "") + (
            "; aligned arms that did, not more often beyond chance: "
            + ", ".join(f"{arm} (Fisher p = {p:.2g})" for arm, p in worse.items()) if worse else "")
    p = g[f"p fewer than {reference}"]
    if fewer := [arm for arm in ALIGNED_ARMS if arm in g.index and p[arm] < alpha]:
        return (("reproduces the paper: " if planned else "") + f"{', '.join(fewer)} collapse less often than "
                f"default BF16 (Fisher p < {alpha}{post_hoc})")
    others = [_counts(g, arm) for arm in (*ALIGNED_ARMS, control) if arm in g.index]
    seeds = int(min([ref["seeds"], *(g.loc[arm, "seeds"] for arm in (*ALIGNED_ARMS, control) if arm in g.index)]))
    power = fisher_power(*PAPER_LIKE_RATES, seeds, alpha)
    return (f"cannot tell with {_seeds(ref['seeds'])}: {counts}" + (f", {', '.join(others)}" if others else "")
            + f", no arm fewer beyond chance; power {power:.0%} to see collapse rates {PAPER_LIKE_RATES[0]:g} "
            f"against {PAPER_LIKE_RATES[1]:g} with {_seeds(seeds)} per arm")


def holm(pvalues: dict[str, float], alpha: float = 0.05) -> dict[str, dict]:
    """Holm's step-down procedure over a family of tests: each test's adjusted p (the running maximum of
    (m - rank) x p over the p-values in ascending order, capped at 1) and whether it rejects at family-wise `alpha`.
    A test with no p-value (not run) is reported as such and counts in m: a missing test cannot make the others
    easier to pass."""
    m = len(pvalues)
    ranked = sorted(((p, name) for name, p in pvalues.items() if p is not None and np.isfinite(p)))
    out, running = {}, 0.0
    for rank, (p, name) in enumerate(ranked):
        running = max(running, min(1.0, (m - rank) * p))
        out[name] = {"p": p, "adjusted": running, "rejects": running <= alpha}
    return out | {name: {"p": None, "adjusted": None, "rejects": False} for name in pvalues if name not in out}


def preregistration(path=None) -> dict:
    """The study's pre-registration (data/grpo_study/preregistration.json), checked: every test belongs to a question
    that lists it, and every question's tests exist."""
    path = Path(path) if path else DATA_DIR / "grpo_study" / "preregistration.json"
    reg = json.loads(path.read_text())
    if reg.get("format") != "rla-preregistration/1":
        raise ValueError(f"{path}: not a pre-registration (format rla-preregistration/1)")
    listed = {t for q in reg["questions"].values() for t in q["tests"]}
    owned = {name: t["question"] for name, t in reg["tests"].items()}
    if listed != set(owned) or any(name not in reg["questions"][q]["tests"] for name, q in owned.items()):
        raise ValueError(f"{path}: questions and tests do not match ({sorted(listed ^ set(owned))})")
    return reg


LEARN_LAST = 3  # stage 0: the mean of the last 3 evaluations against the first


def stage0(histories, reg: dict | None = None, kept=None) -> tuple["pd.DataFrame", dict]:
    """The pre-registered stage 0 (`preregistration()["stage_0_regime"]`), by its rule, on the histories of its runs
    (columns run, sweep, config, seed, step, eval_accuracy, eval_prompts, t_*; one sweep tag per candidate and step
    size). Per candidate: the registered seeds run to the end, those that learn (the mean of the last `LEARN_LAST`
    evaluations above the first by more than NOISE_Z binomial standard errors of that difference), collapses, the mean
    gain and the median core-hours of a run's training steps (`step_core_hours`, from its step timers; evaluations are
    not timed); `learns` once every registered seed has finished: at least 2 seeds learn and none collapses.

    `kept`: rows of an earlier stage-0 table, each with its `source`; a candidate none of whose runs is in `histories`
    keeps its row from there (its histories are gone, the rule's counts are not), one with any run here is computed
    afresh (`source` "runs"). Returns the table and `stage0_decision`'s decision."""
    import pandas as pd

    reg = reg or preregistration()
    stage = reg["stage_0_regime"]
    seeds, steps_of = set(stage["seeds"]), {tag: cand["steps"] for tag, cand, _ in stage0_runs(reg)}
    rows = []
    mine = histories[(histories["config"] == stage["arm"]) & histories["sweep"].isin(steps_of)]
    for sweep, runs in mine.groupby("sweep", sort=False):
        done, learned, collapsed, gains, hours = set(), 0, 0, [], []
        for run, h in runs.groupby("run", sort=False):
            ev = h.dropna(subset=["eval_accuracy"]).sort_values("step")
            steps, acc, n = ev["step"].to_numpy(), ev["eval_accuracy"].to_numpy(), _problems(run, h, None)
            if int(h["seed"].iloc[0]) not in seeds or len(acc) <= LEARN_LAST or steps[-1] < steps_of[sweep]:
                continue  # not registered, or not finished: not counted
            done.add(int(h["seed"].iloc[0]))
            last = acc[-LEARN_LAST:].mean()
            se = float(np.hypot(binomial_se(acc[0], n), binomial_se(last, n * LEARN_LAST)))
            learned += bool(last - acc[0] > NOISE_Z * se)
            collapsed += collapse(steps, acc, n)["collapsed"]
            gains.append(last - acc[0])
            hours.append(float(h.filter(like="t_").sum().sum()) / 3600)
        complete = done == seeds
        rows.append(dict(sweep=sweep, seeds_done=len(done), seeds_registered=len(seeds), learned=learned,
                         collapsed=collapsed, mean_gain=float(np.mean(gains)) if gains else float("nan"),
                         step_core_hours=float(np.median(hours)) if hours else float("nan"), complete=complete,
                         learns=complete and learned >= 2 and collapsed == 0, source="runs"))
    table = pd.DataFrame(rows)
    if kept is not None and len(kept):
        fresh = set(mine["sweep"])
        table = pd.concat([table, kept[kept["sweep"].isin(steps_of) & ~kept["sweep"].isin(fresh)]], ignore_index=True)
    return in_registered_order(table, "sweep", reg), stage0_decision(table, reg)


def in_registered_order(table, column: str, reg: dict | None = None):
    """`table`'s rows in the order the registration lists stage 0's candidates (`column` holds their tags)."""
    order = {tag: i for i, (tag, _, _) in enumerate(stage0_runs(reg))}
    return table.sort_values(column, key=lambda tags: tags.map(order), kind="stable", ignore_index=True) if len(table) else table


def stage0_decision(table, reg: dict | None = None) -> dict:
    """Stage 0's decision from its table: "incomplete" with the candidates left while any lacks a finished registered
    seed; else the regime R, the candidate that learns with the largest mean gain (ties: the fewer core-hours); else
    "none learns" (the study stops at stage 0)."""
    tags = [tag for tag, _, _ in stage0_runs(reg)]
    done = set(table.loc[table["complete"].astype(bool), "sweep"]) if len(table) else set()
    if left := [tag for tag in tags if tag not in done]:
        return dict(decision="incomplete", left=left)
    learners = table[table["learns"].astype(bool)].sort_values(["mean_gain", "step_core_hours"], ascending=[False, True])
    if learners.empty:
        return dict(decision="none learns", regime=None)
    return dict(decision="regime", regime=learners["sweep"].iloc[0])


def stage0_runs(reg: dict | None = None) -> list[tuple[str, dict, float]]:
    """Stage 0's (sweep tag, candidate, step size), one per candidate and step size, named
    `stage0-<model>-<prompts>x<group>[-t<temperature>]-lr<lr>` (experiments/grpo_sweep.py runs them)."""
    stage = (reg or preregistration())["stage_0_regime"]
    runs = []
    for cand in stage["candidates"]:
        hot = f"-t{cand['temperature']:g}" if "temperature" in cand else ""
        runs += [(f"stage0-{cand['model']}-{cand['prompts_per_step']}x{cand['group_size']}{hot}-lr{lr:g}", cand, lr)
                 for lr in cand["lr"]]
    return runs


RUNS_DIR = DATA_DIR / "grpo_runs"  # finished GRPO runs kept in the repository, a folder each (experiments/grpo_sweep.py)


def run_id(tag: str, seed: int, arm: str) -> str:
    """A study run's name, its folder's in results/ and in `RUNS_DIR`: sweep tag, seed, arm."""
    return f"{tag}-s{seed}-{slug(arm)}"


def shipped_history(run: str, runs_dir=None) -> Path:
    """Where a finished run's history is kept in the repository: `RUNS_DIR/<run>/history.csv.gz`."""
    return Path(runs_dir or RUNS_DIR) / run / "history.csv.gz"


def stage0_shipped(reg: dict | None = None, runs_dir=None) -> "pd.DataFrame | None":
    """The histories of stage 0's finished runs kept in the repository (`RUNS_DIR`), labelled as `stage0` reads them
    (run, sweep, config, seed), or None where none is."""
    import pandas as pd

    reg = reg or preregistration()
    stage = reg["stage_0_regime"]
    frames = [pd.read_csv(path).assign(run=name, sweep=tag, config=stage["arm"], seed=seed)
              for tag, _, _ in stage0_runs(reg) for seed in stage["seeds"]
              if (path := shipped_history(name := run_id(tag, seed, stage["arm"]), runs_dir)).exists()]
    return pd.concat(frames, ignore_index=True) if frames else None


def step_size_table(rates, grid) -> "pd.DataFrame":
    """Does collapse follow the step size? Sweeps whose settings (the sidecar's `grid`) differ only in the learning
    rate are compared at neighbouring step sizes: per arm run at both, its collapses at each and Fisher's one-sided
    p-value of fewer at the smaller step; then "every arm", pooled over those arms (arms of one sweep share seeds and
    prompts, so this pools strata: a summary, each arm's row is the test)."""
    import pandas as pd

    settings = {g["tag"]: g["settings"] for g in grid}
    swept = [tag for tag in dict.fromkeys(rates.index.get_level_values(0)) if tag in settings]
    groups: dict[str, list[str]] = {}
    for tag in swept:
        rest = {k: v for k, v in settings[tag].items() if k != "lr"}
        groups.setdefault(repr(sorted(rest.items())), []).append(tag)
    rows = []
    for tags in groups.values():
        tags = sorted(tags, key=lambda tag: settings[tag]["lr"])
        for small, large in zip(tags, tags[1:]):
            arms = [arm for arm in rates.loc[small].index if arm in rates.loc[large].index]
            pair = dict(smaller=small, larger=large, lr_smaller=settings[small]["lr"], lr_larger=settings[large]["lr"])
            counts = [(arm, *(int(rates.loc[(tag, arm), col]) for tag in (small, large) for col in ("collapses", "seeds")))
                      for arm in arms]
            if len(arms) > 1:
                counts.append(("every arm", *np.sum([c[1:] for c in counts], axis=0).tolist()))
            rows += [pair | dict(config=arm, collapses_smaller=a, seeds_smaller=n_a, collapses_larger=b, seeds_larger=n_b,
                                 **{"p fewer at the smaller step": fisher_one_sided(b, n_b, a, n_a)})
                     for arm, a, n_a, b, n_b in counts]
    return pd.DataFrame(rows, columns=["smaller", "larger", "lr_smaller", "lr_larger", "config", "collapses_smaller",
                                       "seeds_smaller", "collapses_larger", "seeds_larger", "p fewer at the smaller step"])


@prose
def step_size_verdict(table, alpha: float = 0.05, control_arm: str = "FP32 control") -> str:
    """The answer of `step_size_table`'s pooled rows (or its one arm's, where only one was run at both), for the
    pairs of step sizes where a run collapsed (where none did, the pair has nothing to tell); `control_arm`'s own
    counts beside the pooled ones (it has no BF16 mismatch: if it follows the step size, the step size suffices)."""
    sentences, quiet = [], 0
    for (small, large), g in table.groupby(["smaller", "larger"], sort=False):
        r = g[g["config"] == "every arm"].iloc[0] if (g["config"] == "every arm").any() else g.iloc[0]
        if r["collapses_smaller"] + r["collapses_larger"] == 0:
            quiet += 1
            continue
        who = f"the {len(g) - 1} arms run at both" if r["config"] == "every arm" else r["config"]
        p = r["p fewer at the smaller step"]
        word = "fewer beyond chance" if p < alpha else "not fewer beyond chance"
        control = g[g["config"] == control_arm]
        alone = "" if r["config"] == control_arm or control.empty else (
            f"; {control_arm} {int(control['collapses_smaller'].iloc[0])}/{int(control['seeds_smaller'].iloc[0])} "
            f"against {int(control['collapses_larger'].iloc[0])}/{int(control['seeds_larger'].iloc[0])}, "
            f"p = {control['p fewer at the smaller step'].iloc[0]:.2g}")
        sentences.append(f"{small} against {large}, {who}: {int(r['collapses_smaller'])}/{int(r['seeds_smaller'])} "
                         f"collapsed at lr {r['lr_smaller']:g} against {int(r['collapses_larger'])}/{int(r['seeds_larger'])} "
                         f"at lr {r['lr_larger']:g}, {word} (Fisher p = {p:.2g}{alone})")
    if quiet:
        sentences.append(f"{quiet} more pair{'s' if quiet > 1 else ''} of step sizes without a collapse at either")
    return "; ".join(sentences) if sentences else "no sweeps that differ only in the step size"


# ---- the warning sign: does the mismatch rise before accuracy falls? ------------------------------------------------
RISE, WINDOW = 3.0, 5  # an alarm: the median over the last WINDOW steps reaches RISE x the median of the first WINDOW
# A mismatch below its floor (an FP32 or exactly on-policy arm's rounding noise) never alarms. The history's per-token
# columns (k1 = sampled_kl, k3, exact KL) are in 1e-4 nats (kl.UNIT): 0.01 is 1e-6 nats, about 1% of default BF16's;
# the per-response ones in nats. Every mismatch a trainer may log is a candidate warning sign.
FLOORS = {"sampled_kl": 0.01, "k3": 0.01, "exact_kl": 0.01, "seq_k3": 1e-5, "seq_exact_kl": 1e-5}
MISMATCH_NAMES = {"sampled_kl": "per token (k1)", "k3": "per token (k3)", "exact_kl": "per token (exact KL)",
                  "seq_k3": "per response (k3)", "seq_exact_kl": "per response (exact KL)"}


def mismatch_alarm(steps, mismatch, floor: float, rise: float = RISE, window: int = WINDOW) -> int | None:
    """The first training step at which the median of the last `window` steps' mismatch reaches `rise` times the
    median of the first `window` steps (and `floor`): the practitioner's "the gap is rising". None: it never does."""
    steps, values = np.asarray(steps), np.asarray(mismatch, dtype=float)
    keep = ~np.isnan(values)
    steps, values = steps[keep], values[keep]
    if len(values) < 2 * window:
        return None
    threshold = max(rise * np.median(values[:window]), floor)
    for i in range(2 * window - 1, len(values)):  # windows after the baseline's, not overlapping it
        if np.median(values[i - window + 1: i + 1]) >= threshold:
            return int(steps[i])
    return None


def warning_signs(histories, column: str = "k3", by=("sweep", "config")) -> "pd.DataFrame":
    """Per run with `column` logged: whether it collapsed (and at which evaluation), the step its mismatch alarm
    fired, and the lead (collapse step minus alarm step; evaluations are `eval_every` apart, so a lead is known to
    that many steps). `warned` = the alarm fired no later than the collapse was seen; `false alarm` = it fired in a
    run that did not collapse."""
    import pandas as pd

    rows = []
    for run, h in histories.groupby("run", sort=False):
        h = h.sort_values("step")
        if column not in h or h[column].isna().all():
            continue
        ev = h.dropna(subset=["eval_accuracy"])
        out = collapse(ev["step"], ev["eval_accuracy"], int(h["eval_prompts"].dropna().iloc[0]))
        alarm = mismatch_alarm(h["step"], h[column], FLOORS[column])
        warned = out["collapsed"] and alarm is not None and alarm <= out["step"]
        rows.append({**{b: h[b].iloc[0] for b in by}, "run": run, "collapsed": out["collapsed"],
                     "collapse step": out["step"], "alarm step": alarm,
                     "lead": out["step"] - alarm if warned else float("nan"), "warned": warned,
                     "false alarm": not out["collapsed"] and alarm is not None})
    return pd.DataFrame(rows)


def warning_summary(signs) -> "pd.DataFrame":
    """Over runs (all, and per configuration): of the collapsed runs, how many the alarm warned (exact interval) and
    the median lead; of the others, how many it alarmed in (false alarms, exact interval)."""
    import pandas as pd

    def row(g):
        hit, miss = g[g["collapsed"]], g[~g["collapsed"]]
        warned, false = int(hit["warned"].sum()), int(miss["false alarm"].sum())
        w_ci = clopper_pearson(warned, len(hit)) if len(hit) else (float("nan"),) * 2
        f_ci = clopper_pearson(false, len(miss)) if len(miss) else (float("nan"),) * 2
        return {"collapsed runs": len(hit), "warned": warned, "warned ci_low": w_ci[0], "warned ci_high": w_ci[1],
                "median lead (steps)": hit["lead"].median(), "other runs": len(miss), "false alarms": false,
                "false alarm ci_low": f_ci[0], "false alarm ci_high": f_ci[1]}

    rows = [{"config": "all runs", **row(signs)}]
    rows += [{"config": config, **row(g)} for config, g in signs.groupby("config", sort=False)]
    return pd.DataFrame(rows).set_index("config")
