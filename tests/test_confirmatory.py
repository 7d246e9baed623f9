"""rla_lib.studies.confirmatory: the registered analyses recover what simulated studies hide in them, and their
verdicts name a cause only from a test that passes Holm's correction."""

import math

import numpy as np
import pandas as pd
import pytest

from rla_lib.studies import confirmatory as q
from rla_lib.studies import collapse as c
from rla_lib.studies.collapse import preregistration

CAUSAL = ("collapses training:", "moves the edge", "more often than on-policy", "TIS moves it up")


def test_firth_on_a_two_by_two_table_is_the_log_odds_ratio_with_half_added_to_each_cell():
    """A known closed form: with one binary covariate, Firth's slope is log((a+.5)(d+.5) / ((b+.5)(c+.5)))."""
    a, b, c, d = 7, 2, 3, 0  # x=1: 7 collapsed, 2 not; x=0: 3 collapsed, 0 not (a zero cell: ML has no finite answer)
    x = np.array([1] * (a + b) + [0] * (c + d))
    y = np.array([1] * a + [0] * b + [1] * c + [0] * d)
    beta, _ = q.firth_logit(np.column_stack([np.ones(len(x)), x]), y)
    assert beta[1] == pytest.approx(math.log((a + .5) * (d + .5) / ((b + .5) * (c + .5))), abs=1e-7)
    assert beta[0] == pytest.approx(math.log((c + .5) / (d + .5)), abs=1e-7)


def test_firth_stays_finite_under_complete_separation_and_the_lr_test_sees_the_slope():
    x = np.repeat(np.log10([0.01, 0.1, 1, 10]), 4)
    y = (x > -0.5).astype(float)  # none collapses below 0.3, every run above
    X = np.column_stack([np.ones(len(x)), x])
    beta, _ = q.firth_logit(X, y)
    assert np.all(np.isfinite(beta)) and beta[1] > 0
    assert q.lr_test(X, y, 1, side="greater") < 0.001
    assert q.lr_test(X, 1 - y, 1, side="greater") > 0.999  # the other direction


def test_the_lr_test_keeps_its_size_when_dose_does_nothing():
    gen = np.random.default_rng(1)
    X = np.column_stack([np.ones(24), np.repeat(np.log10([0.01, 0.1, 1, 10]), 6)])
    rejections = np.mean([q.lr_test(X, (gen.random(24) < 0.3).astype(float), 1) < 0.05 for _ in range(400)])
    assert rejections < 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)


def dose_runs(d50, slope, seeds, gen, doses=(0.001, 0.01, 0.1, 0.3, 1, 3, 10, 30), tis=False):
    rows = []
    for i, dose in enumerate(doses):
        rung = q.REFERENCE if i == 0 else f"noise {i}"
        p = 1 / (1 + math.exp(-slope * (math.log10(dose) - math.log10(d50))))
        rows += [dict(rung=rung, tis=tis, seed=s, dose=dose * (1 + 0.01 * s), collapsed=bool(gen.random() < p),
                      last=0.3) for s in range(seeds)]
    return pd.DataFrame(rows)


def test_dose_curve_finds_a_known_d50_and_the_tis_shift():
    """The estimate within 4 sampling SDs of the truth (the SD of log10 D50 at this design, simulated), the bootstrap
    interval about as wide as that SD says, H1 and H2 decisive at 160 runs per arm."""
    gen = np.random.default_rng(0)
    sd = np.std([math.log10(q._dose_fit(dose_runs(1.0, 3.0, 20, gen))[2]) for _ in range(100)])
    runs = pd.concat([dose_runs(1.0, 3.0, 20, gen), dose_runs(10.0, 3.0, 20, gen, tis=True)])
    out = q.dose_curve(runs, n_boot=300)
    fits = out["fits"].set_index("tis")
    for tis, truth in ((False, 1.0), (True, 10.0)):
        f = fits.loc[tis]
        assert abs(math.log10(f["d50"] / truth)) < 4 * sd, (f, sd)
        assert f["d50_low"] < f["d50"] < f["d50_high"]
        assert 0.5 < math.log10(f["d50_high"] / f["d50_low"]) / (2 * 1.96 * sd) < 2, (f, sd)
    assert out["H1"] < 1e-4 and out["H2"] < 0.05
    natural = out["natural"]
    assert natural["ratio_low"] <= natural["ratio"] <= natural["ratio_high"] < 0.01  # 0.001 against a D50 of 1
    r = out["rungs"]
    assert (r["collapses"] <= r["seeds"]).all() and (r["ci_low"] <= r["rate"]).all() and (r["rate"] <= r["ci_high"]).all()


def test_a_dose_that_never_collapses_gives_an_infinite_d50_and_no_cause():
    gen = np.random.default_rng(0)
    runs = dose_runs(1e6, 3.0, 4, gen)
    assert not runs["collapsed"].any()
    out = q.dose_curve(runs, n_boot=100)
    assert out["H1"] > 0.05
    family = q.holm_family(out, None, None)
    text = q.q1_verdict(out, family)
    assert text.startswith("Q1 (dose): cannot tell") and not any(word in text for word in CAUSAL)


def edge_runs(shifts, seeds, gen, lrs=(1e-4, 1.5e-4, 2.25e-4), lr_half=1.5e-4, slope=6.0):
    rows = []
    for s in range(seeds):
        for arm, shift in shifts.items():
            for lr in lrs:
                p = 1 / (1 + math.exp(-slope * (math.log(lr) - math.log(lr_half) - shift)))
                rows.append(dict(arm=arm, lr=lr, seed=s, collapsed=bool(gen.random() < p)))
    return pd.DataFrame(rows)


def test_edge_shift_recovers_a_known_shift_and_finds_none_where_there_is_none():
    gen = np.random.default_rng(3)
    runs = edge_runs({q.REFERENCE: 0.0, "engine schedule": math.log(2), "FP32 control": 0.0}, 60, gen)
    out = q.edge_shift(runs, margin=math.log(1.25), n_boot=200, power_sims=0)
    arms = out["arms"].set_index("arm")
    moved, still = arms.loc["engine schedule"], arms.loc["FP32 control"]
    for row, truth in ((moved, math.log(2)), (still, 0.0)):  # within 4 bootstrap standard errors of the truth
        se = (row["shift_high"] - row["shift_low"]) / (2 * 1.96)
        assert abs(row["shift"] - truth) < 4 * se and row["undefined"] == 0, row
    assert moved["p"] == pytest.approx(2 / 201)  # the smallest 200 refits can give: a doubling, at 60 seeds, never 0
    assert moved["test"] == "H3" and still["test"] == "H4"


def test_power_of_the_edge_test_grows_with_seeds():
    gen = np.random.default_rng(4)
    few = q.edge_shift(edge_runs({q.REFERENCE: 0.0, "rope": 0.0}, 4, gen), math.log(1.25), n_boot=50, power_sims=60)
    many = q.edge_shift(edge_runs({q.REFERENCE: 0.0, "rope": 0.0}, 40, gen), math.log(1.25), n_boot=50, power_sims=60)
    assert few["arms"]["power"].iloc[0] < many["arms"]["power"].iloc[0]


def test_rises_then_collapses_needs_a_rise_beyond_noise_before_the_collapse():
    steps = [0, 10, 20, 30, 40]
    assert c.rises_then_collapses(steps, [0.1, 0.3, 0.35, 0.05, 0.02], 512)
    assert not c.rises_then_collapses(steps, [0.3, 0.31, 0.3, 0.05, 0.02], 512)  # fell from the start, never rose
    assert not c.rises_then_collapses(steps, [0.1, 0.3, 0.35, 0.34, 0.33], 512)  # rose and stayed


def test_outcomes_reads_histories_by_run():
    h = pd.DataFrame({"run": "r", "sweep": "s", "config": q.REFERENCE, "seed": 2, "eval_prompts": 512,
                      "step": [0, 5, 10, 20, 30], "eval_accuracy": [0.1, np.nan, 0.3, 0.02, 0.01]})
    row = q.outcomes(h).iloc[0]
    assert (row["collapsed"], row["collapse_step"], row["rises_then_collapses"], row["evaluations"]) == (True, 20, True, 4)


def test_the_endpoint_is_the_trained_policy_s_accuracy_not_the_coarse_copy_s():
    """With coarse rollouts the engine holds a rounded copy: the registered endpoint is the trained policy's held-out
    accuracy (`eval_accuracy_policy`), whichever of the two falls."""
    steps, rises, falls = [0, 10, 20, 30], [0.07, 0.15, 0.18, 0.2], [0.07, 0.15, 0.02, 0.01]
    h = pd.DataFrame({"sweep": "s", "config": "default BF16, 3-bit rollouts", "seed": 0, "eval_prompts": 512,
                      "step": steps * 2, "run": ["copy falls"] * 4 + ["policy falls"] * 4,
                      "eval_accuracy": falls + rises, "eval_accuracy_policy": rises + falls})
    rows = q.outcomes(h).set_index("run")
    assert not rows.loc["copy falls", "collapsed"] and rows.loc["policy falls", "collapsed"]
    assert rows.loc["copy falls", "last"] == 0.2 and rows.loc["policy falls", "last"] == 0.01


def long_runs(ref, onp, seeds):
    return pd.DataFrame([dict(arm=q.REFERENCE, seed=s, rises_then_collapses=s < ref) for s in range(seeds)]
                        + [dict(arm=q.ON_POLICY, seed=s, rises_then_collapses=s < onp) for s in range(seeds)])


@pytest.mark.parametrize("ref,onp,seeds", [(1, 1, 1), (3, 0, 3), (1, 0, 3), (0, 0, 3), (3, 1, 8)])
def test_no_causal_word_without_a_test_that_passes_holm(ref, onp, seeds):
    out = q.long_horizon(long_runs(ref, onp, seeds))
    family = q.holm_family(None, None, out)
    text = q.q3_verdict(out, family)
    assert family["H6"]["adjusted"] == pytest.approx(min(1.0, 6 * out["H6"]))  # five missing tests still count
    assert not family["H6"]["rejects"] and text.startswith("Q3 (long horizon): cannot tell")
    assert not any(word in text for word in CAUSAL) and "power" in text


def test_a_decisive_long_horizon_names_the_cause():
    out = q.long_horizon(long_runs(8, 0, 8))
    family = q.holm_family(None, None, out)
    assert family["H6"]["rejects"] and "more often than on-policy" in q.q3_verdict(out, family)


def q2_result(low, high, test="H3", p=0.5):
    arms = pd.DataFrame([dict(arm="engine schedule", test=test, shift=(low + high) / 2, shift_low=low, shift_high=high,
                              p=p, equivalent=abs(low) < math.log(1.25) and abs(high) < math.log(1.25), power=0.3)])
    return dict(arms=arms, margin=math.log(1.25))


def test_equivalence_needs_the_whole_interval_inside_the_margin():
    narrow, wide = q2_result(-0.1, 0.15), q2_result(-0.1, 0.4)
    assert "no shift that matters" in q.q2_verdict(narrow, q.holm_family(None, narrow, None))
    text = q.q2_verdict(wide, q.holm_family(None, wide, None))
    assert "cannot tell" in text and "power 30%" in text and not any(w in text for w in CAUSAL)
    moved = q2_result(0.5, 0.9, p=0.0005)
    assert "moves the edge" in q.q2_verdict(moved, q.holm_family(None, moved, None))  # 6 x 0.0005 < 0.05


def test_the_module_tests_are_the_registered_ones():
    reg = preregistration()
    assert set(q.TESTS) == set(reg["tests"])
    assert {t for t in q.EDGE_TESTS.values()} == set(reg["questions"]["Q2_edge"]["tests"])
    assert set(reg["questions"]["Q2_edge"]["arms"]) == {q.REFERENCE, *q.EDGE_TESTS}
    assert reg["questions"]["Q3_long"]["arms"] == [q.REFERENCE, q.ON_POLICY]
