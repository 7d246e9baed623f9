import warnings

import numpy as np
import pytest
import torch

from rla_lib import kl
from rla_lib.align.monitor import MismatchMeter


def _softmax_logits(rng, shape, scale):
    x = rng.normal(0, scale, shape)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _synthetic(rng, n_seq=400, vocab=8, noise=0.05):
    """Inference and training distributions that differ by known per-position noise; tokens sampled from inference."""
    pairs = []
    for _ in range(n_seq):
        T = rng.integers(3, 12)
        p = _softmax_logits(rng, (T, vocab), 2.0)
        q = p + rng.normal(0, noise, p.shape)
        q = q - np.log(np.exp(q).sum(-1, keepdims=True))
        tok = np.array([rng.choice(vocab, p=np.exp(row)) for row in p])
        pairs.append(dict(inf_lp=p[np.arange(T), tok], train_lp=q[np.arange(T), tok], inf_full=p, train_full=q))
    return pairs


def test_exact_kl_on_hand_case_and_zero_for_equal():
    p = np.log(np.array([[0.5, 0.5]]))
    q = np.log(np.array([[0.25, 0.75]]))
    expected = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert kl.exact_terms(p, q)[0] == pytest.approx(expected)
    assert kl.exact_terms(q, q)[0] == 0.0
    # tokens with zero inference probability contribute nothing
    assert kl.exact_terms(np.array([[0.0, -np.inf]]), np.log(np.array([[0.5, 0.5]])))[0] == pytest.approx(np.log(2))


def test_topk_bound_is_a_lower_bound_and_exact_with_full_k():
    rng = np.random.default_rng(1)
    p = _softmax_logits(rng, (50, 10), 1.5)
    q = _softmax_logits(rng, (50, 10), 1.5)
    exact = kl.exact_terms(p, q)
    for k in (1, 3, 6):
        assert np.all(kl.topk_bound_terms(p, q, k) <= exact + 1e-12)
    np.testing.assert_allclose(kl.topk_bound_terms(p, q, 9), exact, rtol=1e-9)


def test_sampled_and_k3_are_unbiased_for_the_exact_kl():
    rng = np.random.default_rng(0)
    pairs = _synthetic(rng)
    est = kl.compare(pairs, estimators=("sampled", "k3", "exact"), n_boot=500)
    truth = est["exact"].value
    for name in ("sampled", "k3"):
        e = est[name]
        assert abs(e.value - truth) < 4 * e.se + 0.02 * truth, (name, e, truth)
    # k3 is the lower-variance estimator; exact has the least noise
    assert est["exact"].se < est["k3"].se < est["sampled"].se
    assert est["k3"].value > 0


def test_units_are_1e4_per_token():
    pairs = [dict(inf_lp=np.array([-1.0, -2.0]), train_lp=np.array([-1.0001, -2.0003]))]
    e = kl.estimate([kl.terms("sampled", p) for p in pairs], n_boot=10)
    assert e.value == pytest.approx(2.0) and e.n_tokens == 2 and e.n_sequences == 1


def test_bootstrap_ci_covers_truth_and_se_matches_spread():
    rng = np.random.default_rng(3)
    covered = 0
    for trial in range(40):
        per_seq = [rng.normal(1e-4, 3e-4, rng.integers(2, 20)) for _ in range(200)]
        e = kl.estimate(per_seq, n_boot=400, seed=trial)
        covered += e.ci_low <= 1.0 <= e.ci_high
        assert e.ci_low < e.value < e.ci_high
    assert covered >= 34  # nominal 95%: at least 85% of 40 trials


def test_needs_full_distributions_for_exact_and_rejects_unknown():
    pair = dict(inf_lp=np.zeros(2), train_lp=np.zeros(2))
    with pytest.raises(ValueError, match="full distributions"):
        kl.terms("exact", pair)
    with pytest.raises(ValueError, match="unknown estimator"):
        kl.terms("k9", pair)


def test_tokens_to_separate():
    rng = np.random.default_rng(0)
    a = [rng.normal(1.0, 1.0, 100) for _ in range(10)]
    b = [x - 0.5 for x in a]  # a constant paired difference: separable at once
    assert kl.tokens_to_separate(a, b) <= 2
    c = [x + rng.normal(0, 5.0, len(x)) for x in a]
    assert kl.tokens_to_separate(a, c) > 100


def test_the_meter_warns_once_when_the_mismatch_rises():
    meter = MismatchMeter(warn_ratio=3.0, baseline_steps=3, window=2)
    rng = np.random.default_rng(0)

    def step(noise):
        inf = torch.tensor(rng.normal(-1, 0.1, (1, 8)))
        return meter.record(inf, inf + torch.tensor(rng.normal(0, noise, (1, 8))), torch.ones(1, 8))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            step(0.001)
    assert not meter.rising
    with pytest.warns(RuntimeWarning, match="mismatch rising"):
        for _ in range(3):
            step(0.05)
    assert meter.rising and len(meter.k3_steps) == 8 and min(meter.k3_steps) >= 0


# ---- prompt clusters and paired differences ----------------------------------------------------
def _one_per_prompt(rng, n_prompts=300, mean=1e-4, sd=3e-4):
    return [rng.normal(mean, sd, rng.integers(2, 20)) for _ in range(n_prompts)]


def test_clusters_none_is_the_sequence_level_computation():
    rng = np.random.default_rng(5)
    per_seq = _one_per_prompt(rng) + [np.zeros(0)]  # an empty sequence is dropped
    e = kl.estimate(per_seq, n_boot=300, seed=7, method="percentile")
    # the sequence-level formulas, written out: resample whole sequences, SE of a ratio of sums
    sums, counts = np.array([t.sum() for t in per_seq[:-1]]), np.array([len(t) for t in per_seq[:-1]], float)
    idx = np.random.default_rng(7).integers(0, len(sums), size=(300, len(sums)))
    lo, hi = np.quantile(sums[idx].sum(1) / counts[idx].sum(1), [0.025, 0.975])
    mean = sums.sum() / counts.sum()
    se = np.sqrt((((sums - mean * counts) / counts.mean()) ** 2).sum() / (len(sums) * (len(sums) - 1)))
    assert (e.value, e.se, e.ci_low, e.ci_high) == (mean / 1e-4, se / 1e-4, lo / 1e-4, hi / 1e-4)
    assert e.n_sequences == e.n_clusters == len(sums)
    assert kl.estimate(per_seq, clusters=np.arange(len(per_seq)), n_boot=300, seed=7, method="percentile") == e
    # studentized (the default): each resample's ratio over its own SE, those t quantiles on the sample's SE
    boot_sums, boot_counts = sums[idx], counts[idx]
    boot_mean = boot_sums.sum(1) / boot_counts.sum(1)
    boot_se = np.sqrt((((boot_sums - boot_mean[:, None] * boot_counts) / boot_counts.mean(1, keepdims=True)) ** 2).sum(1)
                      / (len(sums) * (len(sums) - 1)))
    t_lo, t_hi = np.quantile((boot_mean - mean) / boot_se, [0.025, 0.975])
    s = kl.estimate(per_seq, n_boot=300, seed=7)
    assert (s.ci_low, s.ci_high) == pytest.approx(((mean - t_hi * se) / 1e-4, (mean - t_lo * se) / 1e-4), rel=1e-12)


@pytest.mark.parametrize("n_prompts", [8, 16, 32])
def test_studentized_ci_covers_at_few_prompts(n_prompts):
    """Coverage of the token-weighted mean's 95% CI with few prompts whose KL varies from prompt to prompt (lognormal
    effects, sigma 0.5; responses of 10-80 tokens). 800 replications (binomial SD 0.8 points): the studentized interval
    must cover within 4 points of 95% at every size; the percentile one falls short where prompts are few (about 85%
    at 8 prompts), which is why it is not the default."""
    rng = np.random.default_rng(100 + n_prompts)
    reps, truth = 800, np.exp(0.5**2 / 2) * np.exp(0.5)
    hits = {"studentized": 0, "percentile": 0}
    for r in range(reps):
        scale = rng.lognormal(0, 0.5, n_prompts)
        per_seq = [scale[p] * rng.lognormal(0, 1.0, rng.integers(10, 80)) for p in range(n_prompts)]
        for method in hits:
            e = kl.estimate(per_seq, n_boot=500, seed=r, unit=1.0, method=method)
            hits[method] += e.ci_low <= truth <= e.ci_high
    coverage = {m: h / reps for m, h in hits.items()}
    assert 0.91 <= coverage["studentized"] <= 0.99, coverage
    if n_prompts == 8:
        assert coverage["percentile"] < coverage["studentized"] - 0.03, coverage


def test_identical_copies_add_no_information():
    rng = np.random.default_rng(0)
    single = _one_per_prompt(rng)
    copies = 4
    repeated = [t for t in single for _ in range(copies)]
    prompts = np.repeat(np.arange(len(single)), copies)
    one = kl.estimate(single, n_boot=500, seed=1)
    clustered = kl.estimate(repeated, clusters=prompts, n_boot=500, seed=1)
    naive = kl.estimate(repeated, n_boot=500, seed=1)
    # per-prompt totals are `copies` times the single ones: the same ratio, residuals, and resamples
    assert clustered.value == pytest.approx(one.value, rel=1e-12)
    assert clustered.se == pytest.approx(one.se, rel=1e-9)
    assert (clustered.ci_low, clustered.ci_high) == pytest.approx((one.ci_low, one.ci_high), rel=1e-9)
    assert clustered.n_clusters == len(single) and clustered.n_sequences == len(repeated)
    # treating copies as independent shrinks the SE by sqrt(copies) (up to the m-1 vs m*copies-1 factor)
    assert naive.se * np.sqrt(copies) == pytest.approx(one.se, rel=0.01)
    assert "300 prompts" in str(clustered)


def test_clusters_must_match_the_sequences():
    with pytest.raises(ValueError, match="one prompt index per sequence"):
        kl.estimate([np.ones(3), np.ones(2)], clusters=[0, 0, 1])


def _sums(per_seq):
    return np.array([t.sum() for t in per_seq]), np.array([len(t) for t in per_seq])


def test_paired_difference_hand_cases():
    rng = np.random.default_rng(2)
    a_sums, counts = _sums(_one_per_prompt(rng, 100))
    prompts = np.arange(100) // 2
    same = kl.paired_difference(a_sums, a_sums, counts, clusters=prompts, n_boot=200)
    assert (same.diff, same.diff_ci_low, same.diff_ci_high, same.relative) == (0, 0, 0, 0)
    assert not same.separated and same.n_clusters == 50 and same.n_tokens == counts.sum()
    shift = kl.paired_difference(a_sums, a_sums + 0.5e-4 * counts, counts, clusters=prompts, n_boot=200)
    assert shift.diff == pytest.approx(0.5) and shift.b - shift.a == pytest.approx(0.5)
    assert (shift.diff_ci_low, shift.diff_ci_high) == pytest.approx((0.5, 0.5)) and shift.separated
    scaled = kl.paired_difference(a_sums, 0.7 * a_sums, counts, clusters=prompts, n_boot=200)
    assert scaled.relative == pytest.approx(-0.3)
    assert (scaled.rel_ci_low, scaled.rel_ci_high) == pytest.approx((-0.3, -0.3))
    assert scaled.diff == pytest.approx(-0.3 * scaled.a)
    assert str(scaled).startswith("-30% [-30%, -30%] (") and str(scaled).endswith(" 1e-4, 50 prompts)")
    row = scaled.as_row()
    assert row["relative"] == scaled.relative and row["separated"] == scaled.separated and row["n_clusters"] == 50


def test_paired_difference_ci_covers_the_truth_with_correlated_responses():
    # Many prompts, 3 responses each; a prompt effect shared by its responses (strong within-prompt
    # correlation) on both a and on the difference. Truth: mean a = 2, mean b = 1.5 (relative -25%).
    rng = np.random.default_rng(11)
    reps, n_prompts, per_prompt = 200, 100, 3
    hits_diff = hits_rel = hits_naive = 0
    for r in range(reps):
        prompts = np.repeat(np.arange(n_prompts), per_prompt)
        u, v = rng.normal(0, 1.0, n_prompts), rng.normal(0, 0.5, n_prompts)
        lengths = rng.integers(2, 12, len(prompts))
        a = [2.0 + u[p] + rng.normal(0, 0.3, n) for p, n in zip(prompts, lengths)]
        b = [x - 0.5 + v[p] + rng.normal(0, 0.1, len(x)) for x, p in zip(a, prompts)]
        (sa, counts), (sb, _) = _sums(a), _sums(b)
        d = kl.paired_difference(sa, sb, counts, clusters=prompts, n_boot=400, seed=r, unit=1.0)
        hits_diff += d.diff_ci_low <= -0.5 <= d.diff_ci_high
        hits_rel += d.rel_ci_low <= -0.25 <= d.rel_ci_high
        naive = kl.paired_difference(sa, sb, counts, n_boot=400, seed=r, unit=1.0)
        hits_naive += naive.diff_ci_low <= -0.5 <= naive.diff_ci_high
    # Nominal 95%. With 100 clusters a percentile bootstrap runs a little short (about 93-94%), and 200
    # replications add a binomial SD of 1.6 points: >= 85% leaves more than 5 SD of room, so only a real
    # defect (e.g. resampling sequences) fails it.
    assert hits_diff >= 0.85 * reps and hits_rel >= 0.85 * reps, (hits_diff, hits_rel)
    # resampling sequences ignores the shared prompt effect: its interval is about sqrt(3) too narrow
    assert hits_naive < hits_diff - 0.1 * reps, (hits_naive, hits_diff)


def test_tokens_to_separate_grows_with_correlated_copies():
    rng = np.random.default_rng(4)
    single_a = _one_per_prompt(rng, 200, mean=1.0, sd=1.0)
    single_b = [x - 0.3 + rng.normal(0, 1.0, len(x)) for x in single_a]
    copies = 4
    rep = lambda seqs: [t for t in seqs for _ in range(copies)]
    prompts = np.repeat(np.arange(200), copies)
    need_single = kl.tokens_to_separate(single_a, single_b)
    need_copies = kl.tokens_to_separate(rep(single_a), rep(single_b), clusters=prompts)
    # copies add tokens but no information: the same SE at 4x the tokens
    assert need_copies == pytest.approx(copies * need_single, rel=1e-6, abs=copies)
    assert kl.tokens_to_separate(rep(single_a), rep(single_b)) < need_copies / 2  # ignoring the clusters
    indep_a = _one_per_prompt(rng, 200 * copies, mean=1.0, sd=1.0)
    indep_b = [x - 0.3 + rng.normal(0, 1.0, len(x)) for x in indep_a]
    assert kl.tokens_to_separate(indep_a, indep_b, clusters=np.arange(800)) < need_copies
    assert kl.tokens_to_separate(single_a, single_a) == float("inf")


def test_summary_exact_kl_per_sequence_sums_each_response():
    from rla_lib.kl import exact_terms, mismatch_summary

    rng = np.random.default_rng(0)
    lengths = [3, 5, 1]
    inf_full = [np.log(rng.dirichlet(np.ones(6), size=n)) for n in lengths]
    train_full = [np.log(rng.dirichlet(np.ones(6), size=n)) for n in lengths]
    tokens = [rng.integers(0, 6, n) for n in lengths]
    inf_lp = [f[np.arange(len(t)), t] for f, t in zip(inf_full, tokens)]
    train_lp = [f[np.arange(len(t)), t] for f, t in zip(train_full, tokens)]
    s = mismatch_summary(inf_lp, train_lp, inf_full, train_full)
    per_response = [exact_terms(p, q).sum() for p, q in zip(inf_full, train_full)]
    assert s["exact_kl_per_sequence"] == pytest.approx(np.mean(per_response), rel=1e-12)
    assert s["exact_kl"] == pytest.approx(np.sum(per_response) / sum(lengths), rel=1e-12)


def test_all_equal_bound_is_the_exact_one_sided_bound():
    """n of n prompts all bitwise: the bound is the prompt share at which seeing n of n has probability 1 - level."""
    for n in (8, 32, 512):
        bound = kl.all_equal_bound(n)
        assert bound**n == pytest.approx(0.05)
        assert (bound - 1e-3) ** n < 0.05 < (bound + 1e-3) ** n  # any lower share would make n of n rarer than 5%
    assert kl.all_equal_bound(512) == pytest.approx(0.99417, abs=1e-5)
    assert kl.all_equal_bound(8) == pytest.approx(0.6877, abs=1e-4)
    with pytest.raises(ValueError):
        kl.all_equal_bound(0)


def test_all_or_none_is_rendered_as_a_count_and_an_exact_bound_not_a_zero_width_interval():
    from rla_lib.report import change_cell, share_cell

    assert share_cell(1.0, 1.0, 1.0, 6648, 512) == "all 6,648 tokens of 512 prompts (prompt share >= 99.4%, exact 95% bound)"
    assert share_cell(0.0, 0.0, 0.0, 256, 8).startswith("none of 256 tokens of 8 prompts (prompt share <= 31.2%")
    assert share_cell(0.3, 0.29, 0.31, 6648, 512) == "30.0% [29.0%, 31.0%]"
    assert change_cell(-1.0, -1.0, -1.0, 0.0, 256, 8).startswith("KL 0 on all 256 tokens of 8 prompts")
    assert change_cell(-0.2, -0.33, -0.06, 24.0, 256, 8) == "-20% [-33%, -6%]"
