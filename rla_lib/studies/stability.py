"""Reading GRPO runs: did a run degrade, diverge at once, or hold, and do configurations differ beyond noise?

    summary = summarize(history)                   # one run in a row (accuracy first/peak/last, verdict, mismatch)
    seeds = compare_seeds(histories, by=("config",))   # runs that differ by seed: mean and se per setting
    short_run_table(summary); paper_effect(...)    # the short runs' verdicts notebook 06a shows
    sweep_differences(seeds)                       # the settings search: each arm against default BF16, a verdict each

A held-out accuracy is a binomial proportion; every "lower", "degraded" or "no different" below comes
from the numbers and their standard errors (`NOISE_Z` of them), never typed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..report import prose

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


def policy_accuracy(history: pd.DataFrame) -> pd.DataFrame:
    """The trained policy's held-out accuracy by step (columns step, accuracy): `eval_accuracy_policy`, as with coarse
    rollouts the engine holds a rounded copy whose accuracy is `eval_accuracy`; a history without that column (its
    engine held the policy itself) gives `eval_accuracy`."""
    col = "eval_accuracy_policy" if history.get("eval_accuracy_policy", pd.Series(dtype=float)).notna().any() \
        else "eval_accuracy"
    return history.dropna(subset=[col]).sort_values("step")[["step", col]].rename(columns={col: "accuracy"})


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


# ---- the verdicts of notebook 06a ------------------------------------------------------------
DEFAULT, ALIGNED, FP32 = "default BF16", ("rope", "all three"), "FP32 control"


def status(row) -> str:
    """A summarised run's verdict in words."""
    return "degraded" if row["degraded"] else "diverged at once" if row["diverged"] else "held (no drop beyond noise)"


def difference_word(diff: float, se: float) -> str:
    """a - b = diff ± se: 'lower', 'higher', or 'no different' within NOISE_Z standard errors; without an error
    (one seed each: no seed-to-seed spread) 'cannot tell'."""
    if not np.isfinite(se):
        return "cannot tell (one seed: no seed-to-seed error)"
    return "lower" if diff < -NOISE_Z * se else "higher" if diff > NOISE_Z * se else f"no different (within {NOISE_Z:g} se)"


def final_accuracy_difference(summary: pd.DataFrame, a: str, b: str) -> tuple[float, float]:
    """Last held-out accuracy of run a minus run b (single seeds) and its binomial standard error."""
    acc_a, acc_b, n = summary.loc[a, "eval acc last"], summary.loc[b, "eval acc last"], summary.loc[b, "eval problems"]
    return float(acc_a - acc_b), float(np.hypot(binomial_se(acc_a, n), binomial_se(acc_b, n)))


def short_run_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The single-seed runs' verdicts, a row per configuration (rows of `summarize`, indexed by name; a
    `max |logprob diff|` column is used where present): its status, accuracy first -> peak -> last with the margin a
    drop must pass, its mismatch, and its final accuracy against default BF16's with the evaluation noise."""
    rows = []
    for name, row in summary.iterrows():
        r = {"config": name, "status": status(row), "accuracy first": row["eval acc first"], "peak": row["eval acc peak"],
             "last": row["eval acc last"], "noise margin": row["noise margin"], "eval problems": int(row["eval problems"]),
             "k3 (1e-4 per token)": row["k3 mean (1e-4)"]}
        if "max |logprob diff|" in summary:
            r["max |logprob diff|"] = row["max |logprob diff|"]
        diff, se = final_accuracy_difference(summary, name, DEFAULT) if DEFAULT in summary.index and name != DEFAULT else (np.nan, np.nan)
        r |= {"final minus default BF16's": diff, "se": se,
              "than default BF16": difference_word(diff, se) if np.isfinite(diff) else ""}
        rows.append(r)
    return pd.DataFrame(rows).set_index("config")


@prose
def paper_effect(summary: pd.DataFrame, steps: int) -> str:
    """Whether these runs show the paper's effect: default BF16 degrades while every aligned run holds."""
    if DEFAULT not in summary.index:
        return f"The paper's effect cannot be judged: no {DEFAULT} run."
    default_degraded = bool(summary.loc[DEFAULT, "degraded"])
    aligned_hold = all(not (summary.loc[n, "degraded"] or summary.loc[n, "diverged"]) for n in ALIGNED if n in summary.index)
    return "The paper's effect (default degrades, aligned holds) is " + (
        "seen here." if default_degraded and aligned_hold else
        f"not seen in this run ({steps} steps): the {DEFAULT} run {status(summary.loc[DEFAULT])}"
        + ("" if aligned_hold else ", and an aligned run did not hold") + ".")


def sweep_differences(seeds: pd.DataFrame) -> pd.DataFrame:
    """The settings search's comparisons as a table: per setting (sweep) with a default BF16 arm, each other arm's
    failures (degraded or diverged at once) beside default BF16's, its final held-out accuracy minus default BF16's with
    the standard error over seeds and the verdict word (one seed each has no seed-to-seed error: "cannot tell"), its
    mismatch as a multiple of default BF16's and, for an arm whose engine holds coarser weights, the trained BF16
    policy's own final accuracy minus default BF16's."""
    rows = []
    for tag, config in seeds.index:
        if config == DEFAULT or (tag, DEFAULT) not in seeds.index:
            continue
        diff, se = seed_difference(seeds, (tag, config), (tag, DEFAULT))
        row = {"sweep": tag, "config": config, "seeds": int(seeds.loc[(tag, config), ("seeds", "")]),
               "failed": sum(int(seeds.loc[(tag, config), (f, "")]) for f in FLAGS),
               "default BF16 failed": sum(int(seeds.loc[(tag, DEFAULT), (f, "")]) for f in FLAGS),
               "final minus default BF16": diff, "se": se, "verdict": difference_word(diff, se),
               "k3 / default BF16's": seeds.loc[(tag, config), ("k3 mean (1e-4)", "mean")]
               / seeds.loc[(tag, DEFAULT), ("k3 mean (1e-4)", "mean")]}
        policy = ("eval acc policy last", "mean")  # (elsewhere the engine holds the policy's own weights: the same)
        if "-bit rollouts" in config and policy in seeds.columns and not np.isnan(seeds.loc[(tag, config), policy]):
            row["trained policy minus default BF16"], row["policy se"] = seed_difference(
                seeds, (tag, config), (tag, DEFAULT), "eval acc policy last", "eval acc last")
        rows.append(row)
    return pd.DataFrame(rows).set_index(["sweep", "config"])


def mismatch_per_response(histories: pd.DataFrame) -> dict:
    """Default BF16's mismatch per response over the training steps of `histories`: mean response length (tokens),
    k3 per token (1e-4 nats) and their product in nats, to set beside the paper's long responses."""
    train = histories[histories["step"] > 0]
    length, per_token = train["response_len"].mean(), train.loc[train["config"] == DEFAULT, "k3"].mean()
    return {"response tokens": length, "k3 per token (1e-4)": per_token, "k3 per response (nats)": length * per_token * 1e-4}
