"""The collapse study's design, fixed before its runs, and the collapse rates of the runs shipped so far.

    .venv/bin/python experiments/collapse_design.py     # seconds: writes tables/06_collapse*.csv

From `data/grpo_sweep/histories.csv.gz` (the settings search and dose study behind notebook 06b):
- 06_collapse: per sweep and configuration, how many seeds collapsed (`rla_lib.studies.collapse.collapse`: from some
  evaluation on, below half the peak and beyond noise, to the end), the exact 95% interval, how many rose first,
  the median step of collapse, and Fisher's one-sided p-value of fewer collapses than default BF16 in that sweep.
- 06_collapse_design: how often each definition fires on flat runs at each schedule used (simulated evaluations,
  with exact 95% intervals),
  the seed-to-seed SD of final accuracy (pooled over settings none of whose seeds collapsed), the smallest fall in
  final accuracy 3 and 5 seeds can detect, and the seeds per arm for the comparisons the study makes.
- 06_collapse_step_sizes: does collapse follow the step size? Sweeps whose settings differ only in the learning rate,
  at neighbouring step sizes: per arm run at both, its collapses at each and Fisher's one-sided p-value of fewer at
  the smaller step, and the arms pooled (`collapse.step_size_table`).
- 06_collapse_warning: the warning sign (`collapse.mismatch_alarm`: the mismatch's median over 5 steps reaches 3x its
  first 5 steps'), for each mismatch logged (`collapse.FLOORS`: k1, k3 and exact KL per token, k3 and exact KL per
  response): of the collapsed runs, how many it warned and how many
  steps ahead; of the others, how many it alarmed in. All runs, and per configuration.
"""

import argparse
import json

import numpy as np
import pandas as pd

from rla_lib.paths import DATA_DIR
from rla_lib.report import save_table
from rla_lib.studies import collapse as c
from rla_lib.studies.stability import seed_sd

HISTORIES = DATA_DIR / "grpo_sweep" / "histories.csv.gz"
ALPHA, POWER = 0.05, 0.8
RATES = [(0.8, 0.1), (0.5, 0.0), (1.0, 0.5)]  # collapse rates, default BF16 vs an aligned arm
FALLS = [0.05, 0.1]  # falls in final accuracy to detect


def schedules(histories: pd.DataFrame) -> pd.DataFrame:
    """Each sweep's evaluation schedule (steps, problems) and its runs' mean accuracy before training."""
    ev = histories.dropna(subset=["eval_accuracy"])
    rows = []
    for sweep, g in ev.groupby("sweep", sort=False):
        first_run = g[g["run"] == g["run"].iloc[0]]
        rows.append({"sweep": sweep, "steps": list(first_run["step"]), "problems": int(g["eval_prompts"].iloc[0]),
                     "start accuracy": float(g.loc[g["step"] == 0, "eval_accuracy"].mean())})
    return pd.DataFrame(rows)


def calm_seed_sd(histories: pd.DataFrame, rates: pd.DataFrame) -> tuple[float, int]:
    """The pooled seed-to-seed SD of final accuracy over settings with 2+ seeds none of which collapsed."""
    last = histories.dropna(subset=["eval_accuracy"]).sort_values("step").groupby("run").tail(1)
    calm = rates[(rates["collapses"] == 0) & (rates["seeds"] > 1)].index
    last = last[last.set_index(["sweep", "config"]).index.isin(calm)]
    return seed_sd(last, "eval_accuracy", by=["sweep", "config"]), len(calm)


def design(histories: pd.DataFrame, rates: pd.DataFrame, runs: int) -> pd.DataFrame:
    rows = []
    for s in schedules(histories).itertuples():
        fp = c.false_positive_rate(s[4], s.problems, s.steps, runs=runs)
        for name, note in [("collapsed", f"{len(s.steps)} evaluations of {s.problems} at p = {s[4]:.3f}"),
                           ("degraded", "stability.accuracy_verdict, the sweep's flag")]:
            rows.append({"quantity": f"flat runs called {name}, {s.sweep} schedule", "value": fp[name],
                         "ci_low": fp[f"{name} ci_low"], "ci_high": fp[f"{name} ci_high"], "note": note})
    sd, settings = calm_seed_sd(histories, rates)
    rows.append({"quantity": "seed SD of final accuracy", "value": sd,
                 "note": f"pooled over {settings} settings without a collapse"})
    for seeds in (3, 5):
        rows.append({"quantity": f"smallest detectable fall in final accuracy, {seeds} seeds per arm",
                     "value": c.smallest_detectable(sd, seeds, ALPHA, POWER),
                     "note": f"two-sided {ALPHA}, power {POWER}"})
    for fall in FALLS:
        rows.append({"quantity": f"seeds per arm to detect a fall of {fall:g} in final accuracy",
                     "value": c.seeds_for_difference(sd, fall, ALPHA, POWER),
                     "note": f"at least {c.MIN_SEEDS}"})
    for a, b in RATES:
        n = c.seeds_for_rates(a, b, ALPHA, POWER)
        rows.append({"quantity": f"seeds per arm to tell collapse rates {a:g} vs {b:g}",
                     "value": float("nan") if n is None else n,
                     "note": f"Fisher one-sided {ALPHA}, power {POWER}" + ("; more than 60" if n is None else "")})
    return pd.DataFrame(rows).set_index("quantity")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000, help="simulated flat runs per schedule")
    args = parser.parse_args(argv)
    histories = pd.read_csv(HISTORIES)
    sidecar = json.loads(HISTORIES.with_suffix("").with_suffix(".json").read_text())
    problems = sidecar["common"]["eval_prompts"]
    histories["eval_prompts"] = histories["eval_prompts"].fillna(problems)  # runs from before the column: the sidecar's
    rates = c.collapse_rates(histories)
    params = {"histories": str(HISTORIES.relative_to(DATA_DIR.parent)), "runs": args.runs, "alpha": ALPHA,
              "power": POWER, "fraction": c.FRACTION}
    save_table(rates, "06_collapse", params)
    table = design(histories, rates, args.runs)
    save_table(table, "06_collapse_design", params)
    step_sizes = c.step_size_table(rates, sidecar["grid"])
    save_table(step_sizes.set_index(["smaller", "larger", "config"]), "06_collapse_step_sizes", params)
    warning = pd.concat({column: c.warning_summary(c.warning_signs(histories, column)) for column in c.FLOORS},
                        names=["mismatch"])
    save_table(warning, "06_collapse_warning", params | {"rise": c.RISE, "window": c.WINDOW, "floors": c.FLOORS})
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(rates.to_string(), table.to_string(), step_sizes.to_string(), c.step_size_verdict(step_sizes),
              warning.to_string(), sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
