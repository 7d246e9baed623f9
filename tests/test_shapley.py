import numpy as np
import pytest

from rla_lib.studies.shapley import bootstrap_shapley, coalitions, shapley_values, shares


def test_additive_game_gives_each_player_its_own_value():
    w = {"a": 1.0, "b": -2.0, "c": 5.0}
    phi = shapley_values(w, lambda s: sum(w[p] for p in s))
    assert phi == pytest.approx(w)


def test_symmetric_players_share_equally_and_null_player_gets_zero():
    phi = shapley_values("xyz", lambda s: float({"x", "y"} <= s) * 6.0)  # z never matters
    assert phi["x"] == pytest.approx(3.0) and phi["y"] == pytest.approx(3.0) and phi["z"] == pytest.approx(0.0)


def test_glove_game():
    # one left glove L, two right gloves R1, R2; a pair is worth 1: phi_L = 2/3, phi_R = 1/6 each
    v = lambda s: float("L" in s and bool({"R1", "R2"} & s))
    phi = shapley_values(("L", "R1", "R2"), v)
    assert phi == pytest.approx({"L": 2 / 3, "R1": 1 / 6, "R2": 1 / 6})


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_efficiency_and_one_call_per_coalition(n):
    rng = np.random.default_rng(n)
    table = {s: rng.normal() for s in coalitions(range(n))}
    calls = []
    phi = shapley_values(range(n), lambda s: calls.append(s) or table[s])
    assert len(calls) == 2**n == len(set(calls))
    assert sum(phi.values()) == pytest.approx(table[frozenset(range(n))] - table[frozenset()])


def test_shares_and_distinct_players():
    assert shares({"a": 1.0, "b": 3.0}) == {"a": 0.25, "b": 0.75}
    with pytest.raises(ValueError, match="distinct"):
        shapley_values(["a", "a"], lambda s: 0.0)


def test_bootstrap_covers_the_truth_on_a_synthetic_game():
    # per-token gap: base 10, player a removes 3, b removes 1 (additive), per-token noise sd 2
    rng = np.random.default_rng(0)
    counts = rng.integers(5, 15, size=300)
    noise = [rng.normal(0, 2, c) for c in counts]
    effect = {"a": 3.0, "b": 1.0}
    per_seq = {s: (np.array([(10 - sum(effect[p] for p in s) + e).sum() for e in noise]), counts) for s in coalitions("ab")}
    boots = bootstrap_shapley("ab", per_seq, n_boot=300)
    lo, hi = np.quantile(boots, [0.025, 0.975], axis=0)
    assert lo[0] <= 3.0 <= hi[0] and lo[1] <= 1.0 <= hi[1]


def test_attribute_table_on_an_additive_game():
    from rla_lib.studies.shapley import attribute

    counts = np.full(50, 10)
    effect = {"a": 3e-4, "b": 1e-4}
    per_seq = {s: (np.full(50, (10e-4 - sum(effect[p] for p in s)) * 10), counts) for s in coalitions("ab")}
    table, reduction, base = attribute("ab", per_seq, n_boot=50)
    assert reduction == pytest.approx(4.0) and base == pytest.approx(10.0)
    assert table.loc["a", "phi (1e-4)"] == pytest.approx(3.0) and table.loc["b", "share"] == pytest.approx(0.25)


def _additive_game(rng, n_seq=300, own_noise_sd=0.0):
    """Per-token gap 10, a removes 3, b removes 1; noise shared by all coalitions (so every resample's
    reduction is exactly 4), plus, optionally, noise of each coalition's own."""
    counts = rng.integers(5, 15, size=n_seq)
    noise = [rng.normal(0, 2.0, c) for c in counts]
    effect = {"a": 3.0, "b": 1.0}
    return {s: (np.array([(10 - sum(effect[p] for p in s) + e + rng.normal(0, own_noise_sd, len(e))).sum() for e in noise]), counts)
            for s in coalitions("ab")}


def test_bootstrap_without_clusters_resamples_sequences():
    per_seq = _additive_game(np.random.default_rng(1), n_seq=80)
    plain = bootstrap_shapley("ab", per_seq, n_boot=50, seed=3)
    np.testing.assert_array_equal(plain, bootstrap_shapley("ab", per_seq, n_boot=50, seed=3, clusters=np.arange(80)))


def test_bootstrap_resamples_prompts_and_copies_add_no_information():
    per_seq = _additive_game(np.random.default_rng(2), n_seq=100, own_noise_sd=1.0)
    copies = 3
    repeated = {s: (np.repeat(sums, copies), np.repeat(counts, copies)) for s, (sums, counts) in per_seq.items()}
    prompts = np.repeat(np.arange(100), copies)
    one = bootstrap_shapley("ab", per_seq, n_boot=200, seed=0)
    clustered = bootstrap_shapley("ab", repeated, n_boot=200, seed=0, clusters=prompts)
    np.testing.assert_allclose(clustered, one, rtol=1e-9)  # same resamples of the same per-prompt totals
    naive = bootstrap_shapley("ab", repeated, n_boot=200, seed=0)
    # about 1/sqrt(3) = 0.58 when copies count as data; a 200-resample spread is good to about 5%
    assert naive[:, 0].std() < 0.75 * one[:, 0].std()


def test_attribute_passes_clusters_and_reports_the_reduction_ci():
    from rla_lib.studies.shapley import attribute

    per_seq = _additive_game(np.random.default_rng(3))
    prompts = np.arange(300) // 2
    table, reduction, base = attribute("ab", per_seq, n_boot=300, unit=1.0, clusters=prompts)
    lo, hi = table.attrs["reduction_ci"]
    assert (lo, hi, reduction) == pytest.approx((4.0, 4.0, 4.0))  # shared noise: every resample cuts exactly 4
    boots = bootstrap_shapley("ab", per_seq, n_boot=300, clusters=prompts)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(boots.sum(1), [0.025, 0.975])))
    assert table.loc["a", "share_lo"] <= 0.75 <= table.loc["a", "share_hi"]


def test_a_share_says_cannot_tell_where_the_reduction_may_be_zero_or_its_ci_spans_the_whole_range():
    from rla_lib.studies.shapley import share_is_readable

    assert share_is_readable(0.69, 1.01, 0.23, 0.50)        # qwen3-tiny vs compiled: RoPE 83% [69%, 101%]
    assert not share_is_readable(-0.74, 0.92, 0.05, 1.00)   # qwen2-tiny vs compiled (fp32): [-74%, 92%] spans 166 points
    assert not share_is_readable(0.2, 0.4, -0.01, 0.3)      # the reduction's CI includes 0: no bounded ratio
    assert share_is_readable(0.2, 0.4, -0.3, -0.1)          # a clearly negative reduction (the gap grows) has shares too
