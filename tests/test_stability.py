"""Reading GRPO runs: verdicts computed from accuracies and their binomial noise (rla_lib.studies.stability)."""

import numpy as np
import pandas as pd
import pytest

from rla_lib.studies import stability


def fake_history(accuracies):
    """A run's history: held-out accuracy accuracies[0] before training, accuracies[i] after step i."""
    base = dict(reward=0.5, k3=1.0, sampled_kl=1.0, entropy=0.3, clip_frac=0.01, t_rollout=0.2, t_score=0.2, t_update=0.9, t_sync=0.05)
    rows = [dict(step=0, eval_accuracy=accuracies[0])] + [dict(base, step=i, eval_accuracy=a) for i, a in enumerate(accuracies[1:], 1)]
    return pd.DataFrame(rows)


def test_accuracy_verdict_hand_cases():
    n = 256
    se = lambda p: np.sqrt(p * (1 - p) / n)
    margin = 2 * np.hypot(se(0.7), se(0.5))  # 0.084 at n=256
    rose_then_fell = stability.accuracy_verdict([0, 25, 50], [0.5, 0.7, 0.5], n)
    assert rose_then_fell == dict(degraded=True, diverged=False, margin=pytest.approx(margin), peak_step=25)
    within_noise = stability.accuracy_verdict([0, 25, 50], [0.5, 0.7, 0.7 - 0.9 * margin], n)
    assert not within_noise["degraded"] and not within_noise["diverged"]
    never_improved = stability.accuracy_verdict([0, 25, 50], [0.55, 0.3, 0.0], n)
    assert never_improved["diverged"] and not never_improved["degraded"] and never_improved["peak_step"] == 0
    assert never_improved["margin"] == pytest.approx(2 * se(0.55))  # nothing of binomial noise at p = 0
    fell_a_little = stability.accuracy_verdict([0, 25], [0.55, 0.50], n)
    assert not fell_a_little["diverged"]  # 5 points is within 2 combined SEs (8.8 points) at n=256
    # the same drop is beyond noise with 10x the problems
    assert stability.accuracy_verdict([0, 25], [0.55, 0.50], 2560)["diverged"]
    assert stability.accuracy_verdict([0, 25], [0.55, 0.55], n)["peak_step"] == 0  # a tie with step 0 never improved


def test_summarize_degraded_diverged_and_eval_problems():
    h = fake_history([0.5, np.nan, 0.7, 0.5])
    s = stability.summarize(h, eval_prompts=256)
    assert s["eval acc first"] == 0.5 and s["eval acc peak"] == 0.7 and s["eval acc last"] == 0.5
    assert s["drop from peak"] == pytest.approx(0.2) and s["degraded"] and not s["diverged"]
    assert s["noise margin"] == pytest.approx(2 * np.hypot(np.sqrt(0.21 / 256), np.sqrt(0.25 / 256)))
    assert s["reward first 20%"] == 0.5 and s["step seconds"] == pytest.approx(1.35)  # training rows only
    assert "eval acc policy last" not in s
    assert not stability.summarize(h.assign(eval_accuracy=[0.5, np.nan, 0.7, 0.65]), eval_prompts=256)["degraded"]
    diverged = stability.summarize(h.assign(eval_accuracy=[0.5, np.nan, 0.2, 0.1]), eval_prompts=256)
    assert diverged["diverged"] and not diverged["degraded"]
    # the number of problems comes from the history when it says it, and must be given otherwise
    assert stability.summarize(h.assign(eval_prompts=16))["noise margin"] > s["noise margin"]
    with pytest.raises(ValueError, match="eval_prompts"):
        stability.summarize(h)
    policy = stability.summarize(h.assign(eval_accuracy_policy=[0.5, np.nan, 0.72, 0.6]), eval_prompts=256)
    assert policy["eval acc policy peak"] == 0.72 and policy["eval acc policy last"] == 0.6


def test_compare_seeds_means_and_counts():
    def history(run, config, accuracies):
        return fake_history(accuracies).assign(run=run, config=config)

    h = pd.concat([history("a0", "a", [0.5, 0.7, 0.5]), history("a1", "a", [0.5, 0.6, 0.6]), history("b0", "b", [0.5, 0.6, 0.62]),
                   history("b1", "b", [0.5, 0.3, 0.1]), history("b2", "b", [0.5, 0.6, 0.55])])
    t = stability.compare_seeds(h, eval_prompts=256)
    assert t.index.tolist() == ["a", "b"] and t["seeds"].tolist() == [2, 3]
    assert t["degraded"].tolist() == [1, 0] and t["diverged"].tolist() == [0, 1]  # b2 fell 5 points: within noise
    assert t.loc["a", ("eval acc last", "mean")] == pytest.approx(0.55) and t.loc["a", ("eval acc last", "se")] == pytest.approx(0.05)
    assert t.loc["a", ("drop from peak", "mean")] == pytest.approx(0.1)


def test_seed_difference():
    h = pd.concat([fake_history(acc).assign(run=f"{c}{i}", config=c)
                   for c, runs in {"a": [[0.5, 0.6], [0.5, 0.7]], "b": [[0.5, 0.5], [0.5, 0.6]]}.items() for i, acc in enumerate(runs)])
    diff, se = stability.seed_difference(stability.compare_seeds(h, eval_prompts=256), "a", "b")
    assert diff == pytest.approx(0.1) and se == pytest.approx(np.hypot(0.05, 0.05))
    # b's own metric: a's last accuracy against b's first (0.5 in both runs: no spread)
    diff, se = stability.seed_difference(stability.compare_seeds(h, eval_prompts=256), "a", "b", metric_b="eval acc first")
    assert diff == pytest.approx(0.15) and se == pytest.approx(0.05)


def test_seed_sd_pools_variances_weighted_by_degrees_of_freedom():
    runs = pd.DataFrame({"sweep": ["x"] * 5 + ["y"], "config": list("aaabbc"), "acc": [0.1, 0.2, 0.3, 0.5, 0.9, 0.4]})
    # a: variance 0.01 on 2 dof; b: 0.08 on 1 dof; c (one seed) adds nothing
    assert stability.seed_sd(runs, "acc") == pytest.approx(np.sqrt((2 * 0.01 + 0.08) / 3))
    assert stability.seed_sd(runs, "acc", by=["sweep", "config"]) == pytest.approx(np.sqrt((2 * 0.01 + 0.08) / 3))
    assert stability.seed_sd(runs[runs["config"] == "c"], "acc") == 0.0


def short_summary(runs: dict) -> pd.DataFrame:
    return pd.DataFrame({name: stability.summarize(fake_history(acc), eval_prompts=256) for name, acc in runs.items()}).T


def test_short_run_verdicts_follow_the_numbers():
    seen = short_summary({"default BF16": [0.5, 0.7, 0.5], "rope": [0.5, 0.7, 0.7], "all three": [0.5, 0.6, 0.62]})
    table = stability.short_run_table(seen)
    assert table.loc["default BF16", "status"] == "degraded" and table.loc["rope", "status"].startswith("held")
    assert table.loc["rope", "final minus default BF16's"] == pytest.approx(0.2)
    assert table.loc["rope", "than default BF16"] == "higher" and table.loc["default BF16", "than default BF16"] == ""
    assert stability.paper_effect(seen, steps=2).endswith("is seen here.")
    # the default run held: not seen; an aligned run that degraded is named
    not_seen = short_summary({"default BF16": [0.5, 0.6, 0.6], "rope": [0.5, 0.7, 0.5]})
    last = stability.paper_effect(not_seen, steps=2)
    assert "not seen in this run (2 steps)" in last and "held" in last and "an aligned run did not hold" in last
    assert stability.paper_effect(not_seen.drop(index="default BF16"), steps=2).startswith("The paper's effect cannot be judged")


def test_difference_word_uses_noise_z():
    se = 0.01
    assert stability.difference_word(-stability.NOISE_Z * se * 1.01, se) == "lower"
    assert stability.difference_word(stability.NOISE_Z * se * 1.01, se) == "higher"
    assert stability.difference_word(stability.NOISE_Z * se * 0.99, se).startswith("no different")


def sweep_histories(runs: dict) -> pd.DataFrame:
    """{(tag, config): [accuracies per seed]} -> stacked histories with run, sweep and config columns."""
    return pd.concat([fake_history(acc).assign(run=f"{tag}-{config}-{i}", sweep=tag, config=config, response_len=5.0)
                      for (tag, config), seeds in runs.items() for i, acc in enumerate(seeds)], ignore_index=True)


def test_sweep_differences_compare_each_arm_with_default_bf16_from_the_counts():
    fell, held = [0.5, 0.7, 0.5], [0.5, 0.7, 0.7]
    h = sweep_histories({("lr1", "default BF16"): [fell, held], ("lr1", "all three"): [held, held],
                         ("lr2", "default BF16"): [fell, fell], ("lr2", "FP32 control"): [fell, fell],
                         ("one seed", "default BF16"): [fell], ("one seed", "FP32 control"): [held],
                         ("control alone", "FP32 control"): [held]})  # a learning search: nothing to compare
    seeds = stability.compare_seeds(h, by=("sweep", "config"), eval_prompts=256)
    t = stability.sweep_differences(seeds)
    assert list(t.index) == [("lr1", "all three"), ("lr2", "FP32 control"), ("one seed", "FP32 control")]
    lr1 = t.loc[("lr1", "all three")]
    assert (lr1["failed"], lr1["default BF16 failed"], lr1["seeds"]) == (0, 1, 2)
    assert lr1["final minus default BF16"] == pytest.approx(0.1)  # seed means 0.7 and 0.6
    assert lr1["se"] == pytest.approx(np.hypot(seeds.loc[("lr1", "all three"), ("eval acc last", "se")],
                                               seeds.loc[("lr1", "default BF16"), ("eval acc last", "se")]))
    assert lr1["verdict"] == "no different (within 2 se)"  # 0.1 against 2 x 0.1
    assert t.loc[("lr2", "FP32 control"), ["failed", "default BF16 failed"]].tolist() == [2, 2]
    assert t.loc[("one seed", "FP32 control"), "verdict"].startswith("cannot tell")
    scale = stability.mismatch_per_response(h)
    assert scale["response tokens"] == 5.0
    assert scale["k3 per response (nats)"] == pytest.approx(5.0 * scale["k3 per token (1e-4)"] * 1e-4)
