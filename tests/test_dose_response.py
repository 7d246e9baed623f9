"""The dose-response study's reading: arms, per-run outcomes, the threshold fit and its verdicts."""

import numpy as np
import pandas as pd
import pytest

from rla_lib.report import TABLES_DIR
from rla_lib.studies import dose_response as dr
from rla_lib.studies.arms import ENGINE_SCHEDULE


def test_arms_are_read_from_their_names():
    assert dr.arm_of("default BF16") == dict(kind="none", dose=pytest.approx(np.nan, nan_ok=True), tis=False, base="default BF16")
    assert dr.arm_of("default BF16, 2-bit rollouts + TIS") | {"dose": 2.0} == dict(
        kind="bits", dose=2.0, tis=True, base="default BF16, 2-bit rollouts")
    assert dr.arm_of("default BF16, logit noise 0.3")["kind"] == "noise" and dr.arm_of("default BF16, logit noise 0.3")["dose"] == 0.3
    assert dr.arm_of("FP32 control")["kind"] == "fp32"
    assert dr.arm_of("all three")["kind"] == dr.arm_of(ENGINE_SCHEDULE)["kind"] == "aligned"
    with pytest.raises(ValueError, match="unknown arm"):
        dr.arm_of("default BF16, 9-bit rollouts")


def history(accuracies, seq_kl=0.01, eval_prompts=512, every=25, policy=None):
    steps = np.arange(0, every * (len(accuracies) - 1) + 1)
    h = pd.DataFrame(dict(step=steps, eval_prompts=eval_prompts, eval_accuracy=np.nan, eval_accuracy_policy=np.nan,
                          seq_exact_kl=seq_kl, seq_k3=seq_kl, exact_kl=seq_kl / 7e-4, k3=seq_kl / 7e-4, response_len=7.0))
    h.loc[h["step"] % every == 0, "eval_accuracy"] = accuracies
    h.loc[h["step"] % every == 0, "eval_accuracy_policy"] = policy if policy is not None else accuracies
    h.loc[0, ["seq_exact_kl", "seq_k3", "exact_kl", "k3", "response_len"]] = np.nan  # step 0 has no training step
    return h


def test_run_outcome_reads_the_policy_accuracy_and_worst_after_peak():
    o = dr.run_outcome(history([0.5, 0.6, 0.7, 0.55, 0.58], seq_kl=0.02))
    assert (o["acc_first"], o["acc_peak"], o["peak_step"], o["acc_last"], o["acc_worst_after_peak"]) == (0.5, 0.7, 50, 0.58, 0.55)
    assert o["seq_exact_kl"] == pytest.approx(0.02) and o["degraded"] and not o["diverged"]  # 0.12 > 2 se (~0.06)
    grown = history([0.5, 0.6, 0.7], seq_kl=0.02)
    grown.loc[grown["step"] > 1, "seq_exact_kl"] = 0.08  # the mismatch grows once training moves the weights
    o = dr.run_outcome(grown)
    assert o["seq_exact_kl_start"] == pytest.approx(0.02) and o["seq_exact_kl"] > 0.07  # the dose: before any update
    coarse = dr.run_outcome(history([0.5, 0.6, 0.6], policy=[0.5, 0.4, 0.3]))  # the engine's copy is not the policy
    assert coarse["acc_last"] == 0.3 and coarse["diverged"]


def synthetic_runs(breakpoint, fall_per_decade, seeds=3, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    doses = {"FP32 control": 1e-9, "default BF16": 1e-3, "default BF16, logit noise 0.1": 3e-3,
             **{f"default BF16, {b}-bit rollouts": x for b, x in zip((3, 2, 1), (3e-2, 1e-1, 5e-1))}}
    for config, x in doses.items():
        for s in range(seeds):
            acc = 0.6 - fall_per_decade * max(0.0, np.log10(x) - np.log10(breakpoint)) + noise * rng.standard_normal()
            rows.append(dict(run=f"{config}-{s}", config=config, seed=s, **dr.arm_of(config), seq_exact_kl=x, seq_exact_kl_start=x, acc_last=acc,
                             eval_prompts=512))
    return pd.DataFrame(rows)


def test_threshold_finds_a_planted_breakpoint_and_its_ci_covers_it():
    fit = dr.threshold(synthetic_runs(breakpoint=1e-2, fall_per_decade=0.2), n_boot=300)
    # the doses bracket the breakpoint (3e-3 flat, 3e-2 fallen): the fit places it within a factor 1.5
    assert fit["found"] and fit["ci_low"] <= fit["threshold"] <= fit["ci_high"] and 1e-2 / 1.5 < fit["threshold"] < 1e-2 * 1.5
    assert fit["slope"] == pytest.approx(0.2, rel=0.25) and fit["share_without_fall"] == 0
    assert dr.threshold_verdict(fit) == "falls from the threshold on"


def test_no_threshold_when_accuracy_does_not_fall_beyond_noise():
    fit = dr.threshold(synthetic_runs(breakpoint=1e-2, fall_per_decade=0.0), n_boot=300)
    assert not fit["found"] and np.isnan(fit["threshold"]) and fit["fall_at_max"] <= fit["margin"]
    assert dr.threshold_verdict(fit) == "no fall beyond noise in the tested range"
    found = dr.threshold(synthetic_runs(breakpoint=1e-2, fall_per_decade=0.2), n_boot=300)
    assert "past the largest dose" in dr.tis_sentence(found, fit)
    mark = dict(label="BF16", value=1e-3, tokens=7)
    assert "below the threshold's lower CI bound" in dr.mark_position(mark, found)
    assert "below the largest mismatch tested" in dr.mark_position(mark, fit)


def test_t_quantiles_match_the_tables():
    for df, t in [(2, 4.302653), (4, 2.776445), (30, 2.042272)]:
        assert dr.t_quantile(0.975, df) == pytest.approx(t, abs=1e-5)


def test_each_arm_against_default_bf16_is_paired_by_seed():
    runs = synthetic_runs(breakpoint=1e-2, fall_per_decade=0.2, seeds=4, noise=0.01)
    versus = dr.versus_reference(runs, "acc_last")
    assert "default BF16" not in versus.index and (versus["seeds"] == 4).all()
    one_bit = versus.loc["default BF16, 1-bit rollouts"]  # 0.2 x log10(50): a fall of 0.34, far beyond the noise
    assert one_bit["verdict"] == "lower" and one_bit["ci_low"] < one_bit["diff"] < one_bit["ci_high"] < 0
    assert versus.loc["FP32 control", "verdict"] == "within seed noise"  # both below the breakpoint
    # paired by seed: an arm equal to default BF16 plus a constant on every seed has a zero-width interval there
    shifted = runs[runs["config"] == "default BF16"].assign(config="shifted", acc_last=lambda r: r["acc_last"] - 0.01)
    v = dr.versus_reference(pd.concat([runs, shifted]), "acc_last").loc["shifted"]
    assert v["diff"] == pytest.approx(-0.01) and v["ci_high"] - v["ci_low"] == pytest.approx(0, abs=1e-12)
    # the power: (t_0.975 + t_0.8 at 3 dof) x the SD of the paired differences pooled over arms / sqrt(4 seeds)
    ref = runs[runs["config"] == "default BF16"].set_index("seed")["acc_last"]
    var = [(g.set_index("seed")["acc_last"] - ref).var(ddof=1) for c, g in runs.groupby("config") if c != "default BF16"]
    assert versus["detectable"].tolist() == pytest.approx([(3.182446 + 0.978472) * np.sqrt(np.mean(var)) / 2] * 5, rel=1e-5)
    outcomes = dict(seq_k3=runs["seq_exact_kl"], seq_k3_start=runs["seq_exact_kl"], exact_kl=1.0, k3=1.0, response_len=7.0, acc_first=0.6, acc_peak=0.6,
                    acc_worst_after_peak=runs["acc_last"], degraded=False, diverged=False)
    arms = dr.arm_table(runs.assign(**outcomes)).set_index("config")
    assert arms.loc["default BF16, 1-bit rollouts", "final vs default BF16 verdict"] == "lower"


def test_the_margin_counts_seed_noise_and_a_fall_from_the_first_dose_says_so():
    noisy = synthetic_runs(breakpoint=1e-2, fall_per_decade=0.0, noise=0.05)
    fit = dr.threshold(noisy, n_boot=100)
    assert fit["margin"] == pytest.approx(2 * np.sqrt(2) * dr.seed_sd(noisy, "acc_last"))
    assert dr.seed_sd(noisy, "acc_last") > 0.03  # the planted seed noise, larger than two binomial SEs at 512 problems
    early = dr.threshold(synthetic_runs(breakpoint=1e-4, fall_per_decade=0.2), n_boot=100)
    assert early["found"] and early["at_lowest_dose"]
    assert dr.threshold_verdict(early).startswith("falls from the lowest dose tested")
    assert not dr.threshold(synthetic_runs(breakpoint=1e-2, fall_per_decade=0.2), n_boot=100)["at_lowest_dose"]


def test_verdict_tables_read_the_fits():
    fits = pd.read_csv(TABLES_DIR / "06_dose_threshold.csv")
    table = dr.verdict_table(fits, worst_after_peak=True)
    assert len(table) == 7 and table["verdict"].str.len().gt(0).all()
    by_key = dr.fits_by_key(fits)
    pooled = by_key[("both", False, "acc_last")]
    row = table.iloc[0]
    assert (row["arms"], row["TIS"], row["runs"]) == ("both kinds pooled", "without", pooled["runs"])
    assert row["verdict"] == dr.threshold_verdict(pooled)
    assert (row["threshold (nats per response)"] == "—") == (not pooled["found"])
    marks = [dict(label="tiny", value=pooled["max_tested"] / 10, tokens=40), dict(label="huge", value=pooled["max_tested"] * 10, tokens=9000)]
    where = dr.mark_table(fits, marks)["against the pooled fit without TIS"].tolist()
    assert where == [dr.mark_position(m, pooled) for m in marks]
    assert dr.tis_verdict(fits) == dr.tis_sentence(pooled, by_key[("both", True, "acc_last")])
