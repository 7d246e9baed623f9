import warnings

import numpy as np
import pytest

from rla_lib import kl


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


def test_monitor_history_and_warning():
    mon = kl.MismatchMonitor(warn_ratio=3.0, baseline_steps=3, window=2)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(5):
            inf = [rng.normal(-1, 0.1, 8)]
            mon.update(step, inf, [inf[0] + rng.normal(0, 0.001, 8)])
    with pytest.warns(RuntimeWarning, match="mismatch rising"):
        for step in range(5, 8):
            inf = [rng.normal(-1, 0.1, 8)]
            mon.update(step, inf, [inf[0] + rng.normal(0, 0.05, 8)])
    h = mon.history
    assert list(h["step"]) == list(range(8)) and mon.rising
    assert (h["k3"] >= 0).all() and h["tokens"].eq(8).all()
    with pytest.raises(ValueError, match="same tokens"):
        mon.update(9, [np.zeros(3)], [np.zeros(4)])
