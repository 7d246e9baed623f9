"""rla_lib.studies.collapse: the collapse definition, its false-positive rate, and the seeds a comparison needs."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from rla_lib.studies import collapse as c
from rla_lib.studies.stability import accuracy_verdict

STEPS = [0, 25, 50, 75, 100, 125]


def test_a_rise_then_a_fall_that_stays_down_is_a_collapse_at_its_first_low_evaluation():
    out = c.collapse(STEPS, [0.4, 0.6, 0.7, 0.1, 0.05, 0.02], n=256)
    assert out == dict(collapsed=True, step=75, peak_step=50)
    assert c.collapse(STEPS[:4], [0.4, 0.7, 0.7, 0.1], n=256)["step"] == 75  # the last evaluation alone


def test_a_dip_that_recovers_or_a_fall_within_noise_is_not():
    assert not c.collapse(STEPS[:5], [0.4, 0.7, 0.2, 0.7, 0.7], n=256)["collapsed"]
    assert not c.collapse(STEPS[:4], [0.4, 0.7, 0.4, 0.36], n=256)["collapsed"]  # beyond noise, not below half
    assert not c.collapse(STEPS[:3], [0.05, 0.08, 0.03], n=64)["collapsed"]  # below half, within noise
    assert not c.collapse([], [], n=64)["collapsed"]


def test_the_simulated_false_positive_rates_match_exact_enumeration():
    """Three evaluations of 6 problems at p = 0.5 (343 outcomes): the Monte Carlo rates against the exact sums,
    within 4 of their standard errors."""
    n, p, steps = 6, 0.5, [0, 1, 2]
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    exact = {"collapsed": 0.0, "degraded": 0.0}
    for ks in itertools.product(range(n + 1), repeat=len(steps)):
        weight = math.prod(pmf[k] for k in ks)
        acc = [k / n for k in ks]
        exact["collapsed"] += weight * c.collapse(steps, acc, n)["collapsed"]
        exact["degraded"] += weight * accuracy_verdict(steps, acc, n)["degraded"]
    simulated = c.false_positive_rate(p, n, steps, runs=20_000)
    assert min(exact.values()) > 0.01  # both fire often on so few problems: the comparison has something to check
    for key in exact:
        assert abs(simulated[key] - exact[key]) <= 4 * simulated[f"{key} se"] + 1e-12, key


def test_fisher_one_sided_exact_values():
    assert c.fisher_one_sided(5, 5, 0, 5) == pytest.approx(1 / math.comb(10, 5), rel=1e-12)
    assert c.fisher_one_sided(0, 5, 5, 5) == pytest.approx(1.0, rel=1e-12)
    assert c.fisher_one_sided(3, 5, 3, 5) == pytest.approx(sum(math.comb(5, k) * math.comb(5, 6 - k) for k in (3, 4, 5))
                                                         / math.comb(10, 6), rel=1e-12)


def test_fishers_test_keeps_its_size_and_the_seed_count_reaches_the_power():
    assert c.fisher_power(0.5, 0.5, 8) <= 0.05  # no difference: rejects at most alpha of the time (exact, conservative)
    n = c.seeds_for_rates(0.8, 0.1)
    assert n is not None and c.fisher_power(0.8, 0.1, n) >= 0.8
    assert n == c.MIN_SEEDS or c.fisher_power(0.8, 0.1, n - 1) < 0.8
    assert c.seeds_for_rates(0.3, 0.25, most=20) is None


def test_seeds_for_a_difference_in_final_accuracy():
    z = 1.959963984540054 + 0.8416212335729143
    assert c.seeds_for_difference(0.032, 0.05) == math.ceil(2 * (z * 0.032 / 0.05) ** 2)
    assert c.seeds_for_difference(0.001, 0.5) == c.MIN_SEEDS
    n = c.seeds_for_difference(0.032, 0.03)
    assert c.smallest_detectable(0.032, n) <= 0.03 < c.smallest_detectable(0.032, n - 1)


def test_clopper_pearson_known_values():
    assert c.clopper_pearson(0, 5) == (0.0, pytest.approx(1 - 0.025 ** (1 / 5), abs=1e-12))  # (alpha/2)^(1/n)
    assert c.clopper_pearson(5, 5) == (pytest.approx(0.025 ** (1 / 5), abs=1e-12), 1.0)
    low, high = c.clopper_pearson(3, 10)  # the textbook values 0.0667, 0.6525
    assert low == pytest.approx(0.06673951, abs=1e-7) and high == pytest.approx(0.65245285, abs=1e-7)


def test_collapse_rates_from_histories():

    def run(name, config, accuracies):
        return pd.DataFrame({"run": name, "sweep": "s", "config": config, "eval_prompts": 256,
                             "step": STEPS[:len(accuracies)], "eval_accuracy": accuracies,
                             "max_abs_diff": [np.nan] + [0.0 if config == "aligned" else 0.01] * (len(accuracies) - 1)})

    falls, holds = [0.4, 0.6, 0.1, 0.0], [0.4, 0.6, 0.62, 0.6]
    h = pd.concat([run(f"d{i}", "default BF16", falls) for i in range(5)]
                  + [run(f"a{i}", "aligned", holds) for i in range(5)])
    t = c.collapse_rates(h)
    assert t.loc[("s", "default BF16"), "collapses"] == 5 and t.loc[("s", "aligned"), "collapses"] == 0
    assert t.loc[("s", "default BF16"), "median_step"] == 50
    assert t.loc[("s", "aligned"), ["steps", "bitwise_steps"]].tolist() == [15, 15]  # 5 runs x 3 training steps
    assert t.loc[("s", "default BF16"), "bitwise_steps"] == 0
    assert t.loc[("s", "aligned"), "p fewer than default BF16"] == pytest.approx(1 / math.comb(10, 5))


def test_the_verdict_follows_the_counts_and_fishers_test():

    def rates(**collapses):  # arm -> (collapses, seeds)
        rows = {("s", arm): {"seeds": n, "collapses": k} for arm, (k, n) in collapses.items()}
        t = pd.DataFrame(rows).T
        ref = collapses["default BF16"]
        t["p fewer than default BF16"] = [c.fisher_one_sided(ref[0], ref[1], k, n) if arm != "default BF16" else float("nan")
                                          for arm, (k, n) in collapses.items()]
        return t

    # a cause is named only from a planned comparison; the same counts unplanned say what they show, post hoc
    assert c.verdict(rates(**{"default BF16": (5, 5), "all three": (0, 5)}), "s", planned=True).startswith(
        "reproduces the paper")
    assert c.verdict(rates(**{"default BF16": (5, 5), "all three": (0, 5)}), "s") == (
        "all three collapse less often than default BF16 (Fisher p < 0.05, post hoc)")
    # no difference found is never a cause: 1/1 against 1/1 (and 3/3 against 3/3) cannot tell, with the power said
    one = c.verdict(rates(**{"default BF16": (1, 1), "FP32 control": (1, 1)}), "s", planned=True)
    assert one == ("cannot tell with 1 seed: default BF16 1/1, FP32 control 1/1, no arm fewer beyond chance; power 0% "
                   "to see collapse rates 0.6 against 0 with 1 seed per arm")
    assert c.verdict(rates(**{"default BF16": (3, 3), "all three": (3, 3), "FP32 control": (3, 3)}), "s").startswith(
        "cannot tell with 3 seeds: default BF16 3/3, all three 3/3, FP32 control 3/3")
    assert c.verdict(rates(**{"default BF16": (2, 5), "FP32 control": (4, 5)}), "s") == (
        "cannot tell with 5 seeds: default BF16 2/5, FP32 control 4/5, no arm fewer beyond chance; power "
        f"{c.fisher_power(0.6, 0.0, 5):.0%} to see collapse rates 0.6 against 0 with 5 seeds per arm")
    for verdict in (one, c.verdict(rates(**{"default BF16": (2, 5), "FP32 control": (4, 5)}), "s", planned=True)):
        assert not any(word in verdict for word in ("step size", "not the mismatch", "reproduces", "opposite"))
    assert c.verdict(rates(**{"default BF16": (2, 3), "all three": (0, 3), "FP32 control": (0, 3)}), "s").startswith(
        "cannot tell with 3 seeds")  # 2/3 vs 0/3: p = 0.2
    assert c.verdict(rates(**{"default BF16": (0, 3), "all three": (0, 3)}), "s").startswith("default BF16 did not")
    assert c.verdict(rates(**{"default BF16": (0, 3), "FP32 control": (1, 3)}), "s") == (
        "default BF16 did not collapse (0 of 3 seeds); FP32 control 1/3")  # 0/3 vs 1/3: chance
    assert c.verdict(rates(**{"default BF16": (0, 5), "FP32 control": (5, 5)}), "s", planned=True) == (  # p = 1 / C(10, 5)
        "not the mismatch: FP32 control 5/5 collapses more often than default BF16 0/5 (Fisher p = 0.004)")
    assert c.verdict(rates(**{"default BF16": (0, 5), "FP32 control": (5, 5)}), "s") == (
        "FP32 control 5/5 collapses more often than default BF16 0/5 (Fisher p = 0.004, post hoc)")
    assert c.verdict(rates(**{"default BF16": (0, 5), "rope": (3, 5), "all three": (1, 5), "engine schedule": (0, 5)}),
                     "s") == ("default BF16 did not collapse (0 of 5 seeds); aligned arms that did, not more often beyond "
                              "chance: rope 3/5 (Fisher p = 0.083), all three 1/5 (Fisher p = 0.5)")  # 3/5 vs 0/5: 10/120
    assert c.verdict(rates(**{"default BF16": (0, 5), "rope": (5, 5), "FP32 control": (0, 5)}), "s", planned=True) == (
        "the opposite of the paper: rope 5/5 (Fisher p = 0.004) collapses more often than default BF16 0/5")
    control_alone = pd.DataFrame({("s", "FP32 control"): {"seeds": 1, "collapses": 0}}).T  # a search of the control alone
    assert c.verdict(control_alone, "s").startswith("no default BF16 arm")


def test_learning_compares_the_second_half_with_step_0_by_binomial_noise():
    steps = [0, 10, 20, 30, 40]

    def run(name, accuracies, n=512, config="FP32 control"):
        return pd.DataFrame({"run": name, "sweep": name, "seed": 0, "config": config, "eval_prompts": n, "step": steps,
                             "eval_accuracy": accuracies})

    h = pd.concat([run("rises", [0.40, 0.45, 0.50, 0.52, 0.54]), run("flat", [0.40, 0.45, 0.38, 0.41, 0.42]),
                   run("few problems", [0.40, 0.45, 0.50, 0.52, 0.54], n=16), run("other arm", [0.4] * 5, config="x")])
    t = c.learning(h).set_index("sweep")
    assert list(t.index) == ["rises", "flat", "few problems"]  # the FP32 control's runs only
    assert t.loc["rises", "late"] == pytest.approx(0.53) and t.loc["rises", "late_evaluations"] == 2  # steps 30 and 40
    assert t.loc["rises", "gain_se"] == pytest.approx(math.hypot(math.sqrt(0.4 * 0.6 / 512), math.sqrt(0.53 * 0.47 / 1024)))
    assert t.loc["rises", "peak"] == 0.54 and t.loc["rises", "peak_step"] == 40
    assert t["learned"].tolist() == [True, False, False]  # the same curve on 16 problems is within noise
    with pytest.raises(ValueError, match="problems"):
        c.learning(run("unknown", [0.4] * 5).assign(eval_prompts=np.nan))


def test_the_mismatch_alarm_fires_when_the_running_median_reaches_three_times_the_start():
    steps = list(range(1, 31))
    flat = [1.0, 1.2, 0.9, 1.1, 1.0] * 6
    assert c.mismatch_alarm(steps, flat, floor=0.01) is None
    rising = flat[:15] + [5.0] * 15  # the median of five turns at the third high step
    assert c.mismatch_alarm(steps, rising, floor=0.01) == 18
    assert c.mismatch_alarm(steps[:10], [np.nan] + [1.0] * 8 + [9.0], floor=0.01) is None  # fewer than two windows
    one_spike = flat[:20] + [50.0] + flat[:9]  # a single spike does not move a median of five
    assert c.mismatch_alarm(steps, one_spike, floor=0.01) is None
    noise = [1e-9, 5e-9] * 15  # an FP32 arm: rounding noise that triples without reaching the floor
    assert c.mismatch_alarm(steps, noise[:10] + [1e-7] * 20, floor=0.01) is None


def test_warning_signs_count_warned_collapses_and_false_alarms():
    def run(name, accuracies, mismatch):
        steps = np.arange(0, 31)
        acc = np.full(31, np.nan)
        acc[::10] = accuracies
        return pd.DataFrame({"run": name, "sweep": "s", "config": name.split("-")[0], "step": steps,
                             "eval_accuracy": acc, "eval_prompts": 512, "k3": [np.nan] + mismatch})

    calm, rise = [1.0] * 30, [1.0] * 12 + [10.0] * 18  # rise: alarm at step 15
    h = pd.concat([run("a-1", [0.4, 0.6, 0.05, 0.01], rise),  # rose, collapse seen at 20, alarm at 15: warned, lead 5
                   run("a-2", [0.4, 0.6, 0.6, 0.02], calm),  # collapsed at 30 without an alarm
                   run("b-1", [0.4, 0.5, 0.5, 0.5], rise),  # an alarm, no collapse
                   run("b-2", [0.4, 0.5, 0.5, 0.5], calm)])
    signs = c.warning_signs(h, "k3").set_index("run")
    assert signs.loc["a-1", ["collapsed", "collapse step", "alarm step", "lead", "warned"]].tolist() == [True, 20, 15, 5, True]
    assert not signs.loc["a-2", "warned"] and signs.loc["b-1", "false alarm"] and not signs.loc["b-2", "false alarm"]
    summary = c.warning_summary(signs.reset_index()).loc["all runs"]
    assert (summary["collapsed runs"], summary["warned"], summary["other runs"], summary["false alarms"]) == (2, 1, 2, 1)
    assert summary["median lead (steps)"] == 5


def test_step_sizes_compare_sweeps_that_differ_only_in_the_learning_rate():
    rows = {("small", "default BF16"): (0, 5), ("small", "FP32 control"): (0, 5),
            ("large", "default BF16"): (4, 5), ("large", "FP32 control"): (5, 5), ("large", "rope"): (5, 5),
            ("other task", "FP32 control"): (5, 5)}
    rates = pd.DataFrame([{"sweep": s, "config": a, "collapses": k, "seeds": n} for (s, a), (k, n) in rows.items()])
    rates = rates.set_index(["sweep", "config"])
    task = dict(model="m", steps=30)
    grid = [dict(tag="large", settings=task | dict(lr=2e-4)), dict(tag="small", settings=task | dict(lr=1e-4)),
            dict(tag="other task", settings=dict(model="n", steps=30, lr=3e-4))]
    t = c.step_size_table(rates, grid).set_index("config")
    assert set(t.index) == {"default BF16", "FP32 control", "every arm"}  # rope ran at one step size only
    assert (t["smaller"] == "small").all() and (t["larger"] == "large").all()  # ordered by lr, not by the grid
    assert t.loc["FP32 control", "p fewer at the smaller step"] == pytest.approx(1 / math.comb(10, 5))
    assert t.loc["every arm", ["collapses_smaller", "seeds_smaller", "collapses_larger", "seeds_larger"]].tolist() == [0, 10, 9, 10]
    assert t.loc["every arm", "p fewer at the smaller step"] == pytest.approx(math.comb(10, 9) / math.comb(20, 9))  # 6.0e-05
    assert c.step_size_verdict(t.reset_index()) == (
        "small against large, the 2 arms run at both: 0/10 collapsed at lr 0.0001 against 9/10 at lr 0.0002, "
        "fewer beyond chance (Fisher p = 6e-05; FP32 control 0/5 against 5/5, p = 0.004)")
    quiet = rates.assign(collapses=0)
    assert c.step_size_verdict(c.step_size_table(quiet, grid)) == "1 more pair of step sizes without a collapse at either"
    assert c.step_size_verdict(c.step_size_table(rates, grid[2:])) == "no sweeps that differ only in the step size"


def test_holm_adjusts_step_down_and_counts_a_missing_test():
    adjusted = c.holm({"H1": 0.01, "H2": 0.04, "H3": 0.03, "H4": 0.5})
    assert [adjusted[h]["adjusted"] for h in ("H1", "H3", "H2", "H4")] == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert [h for h, r in adjusted.items() if r["rejects"]] == ["H1"]  # 0.03 alone would pass; Holm's 3 x 0.03 does not
    with_missing = c.holm({"H1": 0.01, "H2": None})
    assert with_missing["H1"]["adjusted"] == pytest.approx(0.02) and with_missing["H2"]["adjusted"] is None


def test_the_preregistration_names_every_test_of_every_question_and_the_holm_family():
    reg = c.preregistration()
    assert not reg["stage_0_regime"]["confirmatory"]
    tests = sorted(reg["tests"])
    assert tests == [f"H{i}" for i in range(1, len(tests) + 1)] and all(h in reg["multiplicity"] for h in ("H1", tests[-1]))
    assert reg["questions"]["Q2_edge"]["equivalence_margin"]["log_step_size"] == pytest.approx(math.log(1.25), abs=1e-6)


def stage0_history(tag, seed, accuracies, n=512, every=10):
    """One stage-0 run's history: evaluations every `every` steps, the step timers one second each."""
    steps = np.arange(len(accuracies)) * every
    return pd.DataFrame(dict(run=f"{tag}-s{seed}", sweep=tag, config="FP32 control", seed=seed, step=steps,
                             eval_accuracy=accuracies, eval_prompts=n, t_rollout=1.0, t_update=1.0))


def test_stage0_picks_the_regime_that_learns_by_the_registered_rule():
    reg = c.preregistration()
    reg = reg | {"stage_0_regime": reg["stage_0_regime"] | {"candidates": [
        dict(model="m", task="steps", lr=[1e-4], prompts_per_step=16, group_size=16, steps=30),
        dict(model="m", task="steps", lr=[2e-4], prompts_per_step=16, group_size=16, steps=30)]}}
    (rises, _, _), (flat, _, _) = c.stage0_runs(reg)
    assert (rises, flat) == ("stage0-m-16x16-lr0.0001", "stage0-m-16x16-lr0.0002")
    learning = [0.07, 0.10, 0.13, 0.15]  # the last three's mean, 0.127, is 4.0 standard errors above 0.07
    unmoved = [0.07, 0.08, 0.07, 0.08]  # +0.007: within noise (0.5 standard errors)
    runs = [stage0_history(rises, s, learning) for s in (0, 1, 2)] + [stage0_history(flat, s, unmoved) for s in (0, 1, 2)]
    table, decision = c.stage0(pd.concat(runs), reg)
    assert decision == dict(decision="regime", regime=rises)
    assert table.set_index("sweep")["learned"].to_dict() == {rises: 3, flat: 0}

    table, decision = c.stage0(pd.concat(runs[:-1]), reg)  # a seed still running: no decision yet
    assert decision == dict(decision="incomplete", left=[flat])
    halfway = stage0_history(flat, 2, unmoved[:2])  # unfinished: not counted, the candidate is still open
    assert c.stage0(pd.concat(runs[:-1] + [halfway]), reg)[1]["decision"] == "incomplete"

    falls = [0.07, 0.20, 0.02, 0.01]  # learned, then collapsed: a regime with no room to stay up is not the regime
    table, decision = c.stage0(pd.concat([stage0_history(rises, 0, falls)] + runs[1:]), reg)
    assert table.set_index("sweep").loc[rises, "collapsed"] == 1 and decision == dict(decision="none learns", regime=None)

    # a candidate whose runs are gone keeps its row of an earlier table; one with any run at hand is computed afresh
    earlier, _ = c.stage0(pd.concat(runs), reg)
    earlier = earlier.assign(source="tables/06_stage0.csv of abc1234")
    table, decision = c.stage0(pd.concat(runs[3:]), reg, kept=earlier)
    assert table["sweep"].tolist() == [rises, flat] and decision == dict(decision="regime", regime=rises)
    assert table.set_index("sweep")["source"].to_dict() == {rises: "tables/06_stage0.csv of abc1234", flat: "runs"}
    table, decision = c.stage0(pd.concat(runs[:1] + runs[3:]), reg, kept=earlier)  # one of rises' seeds at hand
    assert table.set_index("sweep").loc[rises, "seeds_done"] == 1 and decision == dict(decision="incomplete", left=[rises])
    assert c.stage0_decision(earlier, reg) == dict(decision="regime", regime=rises)


def test_stage0_reads_its_runs_kept_in_the_repository(tmp_path):
    reg = c.preregistration()
    (tag, _, _), arm = c.stage0_runs(reg)[0], reg["stage_0_regime"]["arm"]
    assert c.stage0_shipped(reg, tmp_path) is None
    for seed in (0, 2):
        folder = tmp_path / c.run_id(tag, seed, arm)
        folder.mkdir()
        stage0_history(tag, seed, [0.07, 0.1, 0.13, 0.15]).drop(columns=["run", "sweep", "config", "seed"]).to_csv(
            folder / "history.csv.gz", index=False)
    (tmp_path / c.run_id(tag, 1, "default BF16")).mkdir()  # not the registered arm: not read
    runs = c.stage0_shipped(reg, tmp_path)
    assert sorted(runs.groupby(["sweep", "seed", "config"]).groups) == [(tag, 0, arm), (tag, 2, arm)]
    assert c.stage0(runs, reg)[0].set_index("sweep").loc[tag, "seeds_done"] == 0  # 30 steps of 150: not finished
