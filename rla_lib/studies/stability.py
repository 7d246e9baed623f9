"""Reading GRPO runs: did a run degrade, diverge at once, or hold, and do configurations differ beyond noise?

    summary = summarize(history)                   # one run in a row (accuracy first/peak/last, verdict, mismatch)
    seeds = compare_seeds(histories, by=("config",))   # runs that differ by seed: mean and se per setting
    short_run_report(summaries); sweep_report(seeds, histories)   # the verdict lines notebook 06 prints

A held-out accuracy is a binomial proportion; every "lower", "degraded" or "no different" below comes
from the numbers and their standard errors (`NOISE_Z` of them), never typed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

# A held-out accuracy is a binomial proportion over `n` problems: standard error sqrt(p (1 - p) / n),
# about 3 points at n = 256. A drop counts only beyond NOISE_Z combined standard errors of the two
# evaluations compared. Two, not one: the peak is the maximum over several noisy evaluations, so it is
# biased upwards (by about one SE with a handful of evaluations); one SE would flag flat runs.
NOISE_Z = 2.0


def binomial_se(p, n: int):
    """Standard error of an accuracy p measured on n problems."""
    return np.sqrt(np.asarray(p) * (1 - np.asarray(p)) / n)


def seed_sd(runs: pd.DataFrame, y: str, by="config") -> float:
    """The pooled seed-to-seed SD of `y` (one row per run) within groups `by`, each group weighted by its degrees of
    freedom (groups with 2+ seeds; 0 where none has)."""
    groups = runs.groupby(by)[y]
    var, dof = groups.var(ddof=1), groups.size() - 1
    return float(np.sqrt((var * dof)[dof > 0].sum() / dof.sum())) if dof.sum() else 0.0


def accuracy_verdict(steps, accuracies, n: int) -> dict:
    """Did a run degrade (rose, then fell beyond noise) or diverge at once (never improved, fell beyond noise)?

    `steps`, `accuracies`: the evaluations in order (step 0 = before training); `n`: problems per evaluation.
    degraded: the peak comes after step 0 and the last evaluation is below it by more than the margin.
    diverged: the best evaluation is step 0 and the last is below it by more than the margin.
    margin = NOISE_Z * sqrt(se(peak)^2 + se(last)^2).
    """
    steps, acc = np.asarray(steps), np.asarray(accuracies, dtype=float)
    if len(acc) == 0:
        return dict(degraded=False, diverged=False, margin=float("nan"), peak_step=float("nan"))
    i = int(np.argmax(acc))  # the first maximum: a tie with step 0 counts as never improved
    peak, last = acc[i], acc[-1]
    margin = float(NOISE_Z * np.hypot(binomial_se(peak, n), binomial_se(last, n)))
    fell = bool(peak - last > margin)
    return dict(degraded=fell and bool(steps[i] > 0), diverged=fell and bool(steps[i] == 0), margin=margin,
                peak_step=int(steps[i]))


def eval_problems(history: pd.DataFrame, eval_prompts: int | None = None) -> int:
    """Problems per held-out evaluation: the argument if given, else the history's `eval_prompts` column."""
    if eval_prompts is not None:
        return int(eval_prompts)
    if "eval_prompts" in history and history["eval_prompts"].notna().any():
        values = history["eval_prompts"].dropna().unique()
        if len(values) == 1:
            return int(values[0])
    raise ValueError("the history does not say how many problems each evaluation used (no single `eval_prompts` "
                     "value): pass eval_prompts= (the settings search used 256, recorded in its sidecar JSON)")


def _accuracy_columns(ev: pd.DataFrame, column: str, label: str) -> dict:
    acc = ev[column]
    return {f"{label} first": acc.iloc[0], f"{label} peak": acc.max(), f"{label} last": acc.iloc[-1]}


def summarize(history: pd.DataFrame, eval_prompts: int | None = None) -> pd.Series:
    """One run in a row: reward and held-out accuracy early/peak/late, whether it degraded or diverged
    (`accuracy_verdict`, with the margin used), mismatch, clip fraction, step time.

    "eval acc first" is the accuracy before training (step 0). With coarse rollouts, "eval acc policy ..."
    is the trained BF16 policy's own accuracy (the engine's coarse copy is "eval acc ...").
    `eval_prompts`: problems per evaluation; default from the history's `eval_prompts` column.
    """
    n = eval_problems(history, eval_prompts)
    ev = history.dropna(subset=["eval_accuracy"])
    h = history[history["step"] > 0]
    k = max(1, len(h) // 5)
    nan = float("nan")
    accuracy = _accuracy_columns(ev, "eval_accuracy", "eval acc") if len(ev) else dict.fromkeys(
        ["eval acc first", "eval acc peak", "eval acc last"], nan)
    out = pd.Series({
        "reward first 20%": h["reward"].head(k).mean(), "reward last 20%": h["reward"].tail(k).mean(), **accuracy,
        "k3 mean (1e-4)": h["k3"].mean(), "k3 first 20% (1e-4)": h["k3"].head(k).mean(),
        "k3 last 20% (1e-4)": h["k3"].tail(k).mean(),
        "sampled KL mean (1e-4)": h["sampled_kl"].mean(), "entropy last 20%": h["entropy"].tail(k).mean(),
        "clip frac": h["clip_frac"].mean(),
        "step seconds": h[["t_rollout", "t_score", "t_update", "t_sync"]].sum(1).median(),
    })
    if "eval_accuracy_policy" in history and history["eval_accuracy_policy"].notna().any():
        out = pd.concat([out, pd.Series(_accuracy_columns(history.dropna(subset=["eval_accuracy_policy"]),
                                                          "eval_accuracy_policy", "eval acc policy"))])
    verdict = accuracy_verdict(ev["step"], ev["eval_accuracy"], n)
    out["drop from peak"] = out["eval acc peak"] - out["eval acc last"]
    out["noise margin"] = verdict["margin"]
    out["eval problems"] = n
    out["degraded"], out["diverged"] = verdict["degraded"], verdict["diverged"]
    return out


FLAGS = ("degraded", "diverged")


def compare_seeds(histories: pd.DataFrame, by=("config",), eval_prompts: int | None = None) -> pd.DataFrame:
    """Runs that differ only by seed, side by side: mean and standard error over seeds of each summary.

    `histories` stacks run histories with a `run` column naming each run and the `by` columns labelling
    its settings. Returns one row per setting, columns (metric, "mean" | "se"), plus `seeds`, `degraded`
    and `diverged` (how many of the seeds did). `eval_prompts` as in `summarize`.
    """
    by = list(by)
    runs = histories.groupby("run", sort=False)  # settings keep the order they first appear in
    per_run = pd.DataFrame({run: summarize(h, eval_prompts).rename(None) for run, h in runs}).T
    labels = runs[by].first()
    per_run = per_run.join(labels)
    metrics = [c for c in per_run.columns if c not in by and c not in FLAGS]
    per_run[metrics] = per_run[metrics].astype(float)
    g = per_run.groupby(by, sort=False)
    table = pd.concat({"mean": g[metrics].mean(), "se": g[metrics].sem()}, axis=1).swaplevel(axis=1)
    table = table[[(m, s) for m in metrics for s in ("mean", "se")]]
    table[("seeds", "")] = g.size()
    for flag in FLAGS:
        table[(flag, "")] = g[flag].apply(lambda c: int(c.astype(bool).sum()))
    return table


def seed_difference(table: pd.DataFrame, a, b, metric: str = "eval acc last", metric_b: str | None = None) -> tuple[float, float]:
    """Difference of seed means a - b of `metric` in a `compare_seeds` table, and its standard error.

    `metric_b` (default: `metric`) is b's metric, e.g. the 3-bit arm's trained-policy accuracy against a plain
    run's accuracy (which is its policy's: the engine holds the policy's own weights there)."""
    metric_b = metric_b or metric
    (ma, sa), (mb, sb) = table.loc[a, [(metric, "mean"), (metric, "se")]], table.loc[b, [(metric_b, "mean"), (metric_b, "se")]]
    return float(ma - mb), float(np.hypot(sa, sb))


# ---- the settings search's shipped histories ------------------------------------------------
def sweep_sidecar_path(histories_path) -> Path:
    """`histories.csv.gz` -> `histories.json`: where the search records when and from what it was collected."""
    path = Path(histories_path)
    return path.with_name(path.name.split(".")[0] + ".json")


def load_sweep(histories_path) -> tuple[pd.DataFrame, dict]:
    """The stacked per-step histories of a settings search and its sidecar ({} if it has none)."""
    sidecar = sweep_sidecar_path(histories_path)
    meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    return pd.read_csv(histories_path), meta


# ---- the verdicts notebook 06 prints --------------------------------------------------------
DEFAULT, ALIGNED, FP32, COARSE = "default BF16", ("rope", "all three"), "FP32 control", "default BF16, 3-bit rollouts"


def status(row) -> str:
    """A summarised run's verdict in words."""
    return "degraded" if row["degraded"] else "diverged at once" if row["diverged"] else "held (no drop beyond noise)"


def difference_word(diff: float, se: float) -> str:
    """a - b = diff ± se: 'lower', 'higher', or 'no different' within NOISE_Z standard errors."""
    return "lower" if diff < -NOISE_Z * se else "higher" if diff > NOISE_Z * se else f"no different (within {NOISE_Z:g} se)"


def final_accuracy_difference(summary: pd.DataFrame, a: str, b: str) -> tuple[float, float]:
    """Last held-out accuracy of run a minus run b (single seeds) and its binomial standard error."""
    acc_a, acc_b, n = summary.loc[a, "eval acc last"], summary.loc[b, "eval acc last"], summary.loc[b, "eval problems"]
    return float(acc_a - acc_b), float(np.hypot(binomial_se(acc_a, n), binomial_se(acc_b, n)))


def short_run_report(summary: pd.DataFrame, steps: int) -> list[str]:
    """Verdict lines for single-seed runs (rows of `summarize`, indexed by configuration name; a
    `max |logprob diff|` column is used where present)."""
    lines = []
    for name, row in summary.iterrows():
        lines.append(f"{name:>20}: {status(row)}: accuracy {row['eval acc first']:.3f} -> peak {row['eval acc peak']:.3f} -> last "
                     f"{row['eval acc last']:.3f} (drop counts beyond {row['noise margin']:.3f}, {int(row['eval problems'])} problems); "
                     f"mismatch k3 {row['k3 mean (1e-4)']:.3g} x 1e-4 per token"
                     + (f", max |logprob diff| {row['max |logprob diff|']:.2g}" if "max |logprob diff|" in row else ""))
    if FP32 in summary.index and "max |logprob diff|" in summary:
        r = summary.loc[FP32]
        lines.append(f"\nThe FP32 control's mismatch is small, not zero: k3 {r['k3 mean (1e-4)']:.3g} x 1e-4 per token, "
                     f"largest per-token logprob difference {r['max |logprob diff|']:.2g}.")
    if DEFAULT not in summary.index:
        return lines + [f"\nThe paper's effect cannot be judged: no {DEFAULT} run."]
    for other in [n for n in summary.index if n != DEFAULT]:
        diff, se = final_accuracy_difference(summary, DEFAULT, other)
        lines.append(f"{DEFAULT} vs {other}: final accuracy {diff:+.3f} ± {se:.3f} (evaluation noise) -> {difference_word(diff, se)}")
    default_degraded = bool(summary.loc[DEFAULT, "degraded"])
    aligned_hold = all(not (summary.loc[n, "degraded"] or summary.loc[n, "diverged"]) for n in ALIGNED if n in summary.index)
    lines.append("\nThe paper's effect (default degrades, aligned holds) is " + (
        "seen here." if default_degraded and aligned_hold else
        f"not seen in this run ({steps} steps): the {DEFAULT} run {status(summary.loc[DEFAULT])}"
        + ("" if aligned_hold else ", and an aligned run did not hold") + "."))
    return lines


def seed_counts(seeds: pd.DataFrame, key) -> dict:
    """Seeds, and how many degraded or diverged, of one setting of a `compare_seeds` table."""
    return {c: int(seeds.loc[key, (c, "")]) for c in ("seeds", "degraded", "diverged")}


def counts_text(seeds: pd.DataFrame, key) -> str:
    c = seed_counts(seeds, key)
    return f"degraded in {c['degraded']}/{c['seeds']}, diverged at once in {c['diverged']}/{c['seeds']} seeds"


def failures(seeds: pd.DataFrame, key) -> int:
    c = seed_counts(seeds, key)
    return c["degraded"] + c["diverged"]


def _mean(seeds, key, metric="k3 mean (1e-4)") -> float:
    return seeds.loc[key, (metric, "mean")]


def _tags(seeds: pd.DataFrame) -> list:
    return list(dict.fromkeys(seeds.index.get_level_values(0)))


def sweep_settings_report(seeds: pd.DataFrame) -> list[str]:
    """Per learning rate (tag): each configuration's counts and accuracies, and default BF16 against each other one."""
    lines = []
    for tag in _tags(seeds):
        lines.append(f"== {tag}")
        for c in seeds.loc[tag].index:
            r = seeds.loc[(tag, c)]
            lines.append(f"  {c:>30}: {counts_text(seeds, (tag, c))}; accuracy {r[('eval acc first', 'mean')]:.3f} -> peak "
                         f"{r[('eval acc peak', 'mean')]:.3f} -> last {r[('eval acc last', 'mean')]:.3f} ± "
                         f"{r[('eval acc last', 'se')]:.3f}; k3 measured {_mean(seeds, (tag, c)):.3g} x 1e-4/token")
        for other in [c for c in seeds.loc[tag].index if c != DEFAULT]:
            diff, se = seed_difference(seeds, (tag, DEFAULT), (tag, other))
            lines.append(f"  {DEFAULT} vs {other}: final accuracy {diff:+.3f} ± {se:.3f} -> {difference_word(diff, se)}")
    return lines


def paper_like(seeds: pd.DataFrame, tag) -> bool:
    """The paper's pattern at one setting: default BF16 degraded in some seed, all-three and FP32 in none."""
    others = [o for o in ("all three", FP32) if o in seeds.loc[tag].index]
    return seed_counts(seeds, (tag, DEFAULT))["degraded"] > 0 and not any(failures(seeds, (tag, o)) for o in others)


def _paper_lines(seeds) -> list[str]:
    lines = ["1. Does default BF16 degrade where aligned and FP32 hold?"]
    for tag in _tags(seeds):
        others = [o for o in ("all three", FP32) if o in seeds.loc[tag].index]
        lower = [o for o in others if difference_word(*seed_difference(seeds, (tag, DEFAULT), (tag, o))) == "lower"]
        lines.append(f"   {tag}: {DEFAULT} {counts_text(seeds, (tag, DEFAULT))}; "
                     + "; ".join(f"{o} {counts_text(seeds, (tag, o))}" for o in others)
                     + f" -> {'yes' if paper_like(seeds, tag) else 'no'}; final accuracy below "
                     + (", ".join(lower) if lower else "neither") + f" by more than {NOISE_Z:g} se")
    return lines


def _fp32_control_lines(seeds) -> list[str]:
    lines = ["\n2. Failures without the BF16 mismatch: the FP32 control (its k3 as measured) against default BF16"]
    tags = [t for t in _tags(seeds) if (t, FP32) in seeds.index]
    for tag in tags:
        lines.append(f"   at {tag} the FP32 control (k3 {_mean(seeds, (tag, FP32)):.3g} x 1e-4) {counts_text(seeds, (tag, FP32))}; "
                     f"{DEFAULT} (k3 {_mean(seeds, (tag, DEFAULT)):.3g} x 1e-4) {counts_text(seeds, (tag, DEFAULT))}")
    as_often = [t for t in tags if 0 < failures(seeds, (t, FP32)) >= failures(seeds, (t, DEFAULT))]
    lines.append("   where the FP32 control failed at least as often as default BF16: " + (", ".join(as_often) or "nowhere")
                 + (" (at those learning rates the runs fail without needing the BF16 mismatch; this says nothing of other "
                    "models or settings)" if as_often else ""))
    return lines


def _coarse_lines(seeds, has_policy_eval: bool) -> list[str]:
    lines = [f"\n4. The deliberately larger mismatch ({COARSE})"]
    for tag in [t for t in _tags(seeds) if (t, COARSE) in seeds.index]:
        diff, se = seed_difference(seeds, (tag, COARSE), (tag, DEFAULT))
        line = (f"   {tag}: k3 {_mean(seeds, (tag, COARSE)) / _mean(seeds, (tag, DEFAULT)):.3g}x default BF16's; "
                f"{counts_text(seeds, (tag, COARSE))}; final accuracy of the engine's coarse copy vs default BF16 {diff:+.3f} ± {se:.3f}")
        if has_policy_eval and not np.isnan(_mean(seeds, (tag, COARSE), "eval acc policy last")):
            pdiff, pse = seed_difference(seeds, (tag, COARSE), (tag, DEFAULT), "eval acc policy last", "eval acc last")
            line += f"; the trained BF16 policy itself vs default BF16 {pdiff:+.3f} ± {pse:.3f}"
        lines.append(line)
    if not has_policy_eval:
        lines.append("   These histories predate `eval_accuracy_policy`: the 3-bit arm's accuracy is its coarse engine copy's only.")
    return lines


def sweep_report(seeds: pd.DataFrame, histories: pd.DataFrame) -> list[str]:
    """The settings search's five questions, answered from a `compare_seeds` table indexed (tag, config)
    and the stacked histories it came from."""
    has_policy_eval = ("eval acc policy last", "mean") in seeds.columns
    lines = _paper_lines(seeds) + _fp32_control_lines(seeds)
    lines.append("\n3. Mismatch over a run (k3 mean of the first -> last 20% of steps, x 1e-4 per token)")
    for tag in _tags(seeds):
        lines.append(f"   {tag}: " + "; ".join(f"{c} {_mean(seeds, (tag, c), 'k3 first 20% (1e-4)'):.3g} -> "
                                               f"{_mean(seeds, (tag, c), 'k3 last 20% (1e-4)'):.3g}" for c in seeds.loc[tag].index))
    lines += _coarse_lines(seeds, has_policy_eval)
    train = histories[histories["step"] > 0]
    length, per_token = train["response_len"].mean(), train.loc[train["config"] == DEFAULT, "k3"].mean()
    lines += ["\n5. Scale of the mismatch per response here",
              f"   mean response {length:.3g} tokens; default BF16 k3 {per_token:.3g} x 1e-4 per token, "
              f"about {length * per_token * 1e-4:.2g} nats per response"]
    return lines
