import math
import warnings
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler

from rla_lib import kl
from rla_lib.align.monitor import (PREFIX, MismatchCallback, MismatchMeter, alerts, combine, masquerades, mismatch_metrics,
                                   mismatch_summary)

NAN = float("nan")


def _hand_case():
    """Two responses, padded to T=3: d = logp_inf - logp_train is (0.5, 0) and (-0.25); padding holds junk."""
    inf = torch.tensor([[-1.0, -2.0, NAN], [-0.5, 7.0, -1e30]], dtype=torch.float64)
    train = torch.tensor([[-1.5, -2.0, 3.0], [-0.25, NAN, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return inf, train, mask


def test_hand_computed_case():
    cap = 1.2  # e^0.25 = 1.284 lies above it, e^-0.5 and 1 below
    m = mismatch_metrics(*_hand_case(), tis_cap=cap)
    k3_a, k3_c = math.expm1(-0.5) + 0.5, math.expm1(0.25) - 0.25  # rho - 1 - log rho with rho = e^-d
    # sums of a few exactly representable numbers: bitwise
    assert m["mismatch/tokens"] == 3 and m["mismatch/sequences"] == 2
    assert m["mismatch/k1"] == 0.25 / 3
    assert m["mismatch/abs_diff_mean"] == 0.75 / 3 and m["mismatch/abs_diff_max"] == 0.5
    assert m["mismatch/k1_per_sequence"] == (0.5 - 0.25) / 2
    assert m["mismatch/is_ratio_above_cap"] == 1 / 3 and m["mismatch/seq_is_ratio_above_cap"] == 1 / 2
    # through exp / expm1: libm may differ from numpy's by an ulp
    assert m["mismatch/k3"] == pytest.approx((k3_a + k3_c) / 3, rel=1e-14)
    assert m["mismatch/k3_per_sequence"] == pytest.approx((k3_a + k3_c) / 2, rel=1e-14)
    assert m["mismatch/is_ratio_mean"] == pytest.approx((math.exp(-0.5) + 1 + math.exp(0.25)) / 3, rel=1e-14)
    assert m["mismatch/is_ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-15)
    assert m["mismatch/is_ratio_max"] == pytest.approx(math.exp(0.25), rel=1e-15)
    assert m["mismatch/tis_weight_mean"] == pytest.approx((math.exp(-0.5) + 1 + cap) / 3, rel=1e-14)
    assert "mismatch/exact_kl" not in m
    assert all(type(v) is float for v in m.values())


def test_keys_also_under_verl_and_trl_names_equal_their_formulas():
    """verl's rollout_corr/kl and k3_kl (verl/trainer/ppo/rollout_corr_helper.py, compute_offpolicy_metrics: its
    old_log_prob is the training side) and TRL's sampling/sampling_logp_difference (GRPOTrainer: |old - sampling|
    over the completion mask), computed here as they compute them, on random float64 logprobs."""
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 9, generator=gen, dtype=torch.float64) * 3
    old = rollout + torch.randn(4, 9, generator=gen, dtype=torch.float64) * 0.1
    mask = (torch.arange(9) < torch.tensor([[9], [4], [7], [1]])).to(torch.float64)

    def masked_mean(x):
        return float((x * mask).sum() / mask.sum())

    log_ratio = old - rollout
    verl = {"rollout_corr/kl": masked_mean(rollout - old), "rollout_corr/k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1)}
    delta = (old - rollout).abs()
    trl = {"sampling/sampling_logp_difference/mean": masked_mean(delta),
           "sampling/sampling_logp_difference/max": float(delta[mask.bool()].max())}
    m = mismatch_metrics(rollout, old, mask, also_as=("verl", "trl"))
    for key, value in (verl | trl).items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert m["rollout_corr/kl"] == m["mismatch/k1"]
    assert "rollout_corr/kl" not in mismatch_metrics(rollout, old, mask)  # only where asked
    meter = MismatchMeter(also_as=("verl",))
    meter.record(rollout, old, mask)
    assert meter.flush()["rollout_corr/k3_kl"] == m["mismatch/k3"]
    with pytest.raises(ValueError, match="also_as takes a tuple of verl, trl"):
        mismatch_metrics(rollout, old, mask, also_as="verl")


def test_importance_weight_spread_is_verls_token_level_definition():
    """verl's rollout_is_std, rollout_is_eff_sample_size and rollout_is_ratio_fraction_low (compute_is_metrics with
    rollout_is="token": weights exp(clamp(log rho, +-20)), clamped to [1/cap, cap] for the std and the ESS) and its
    chi2_seq (compute_offpolicy_metrics: the mean over responses of exp(2 clamp(sum log rho, +-20)), minus 1), written
    here as verl writes them, against ours on a batch wide enough to reach both clamps."""
    gen = torch.Generator().manual_seed(1)
    rollout = -torch.rand(6, 11, generator=gen, dtype=torch.float64) * 3
    old = rollout + torch.randn(6, 11, generator=gen, dtype=torch.float64) * 0.8  # some rho beyond 2 and below 1/2
    mask = (torch.arange(11) < torch.tensor([[11], [3], [8], [1], [11], [5]])).to(torch.float64)
    cap = 2.0

    def masked_mean(x, axis=None):
        return (x * mask).sum() / mask.sum() if axis is None else (x * mask).sum(axis) / mask.sum(axis)

    log_ratio = old - rollout
    weights = torch.exp(log_ratio.clamp(-20, 20)) * mask
    clamped = weights.clamp(min=1 / cap, max=cap)
    std = torch.sqrt(torch.clamp(masked_mean(clamped.square()) - masked_mean(clamped).square(), min=0.0))
    ess = 1.0 / masked_mean((clamped / (masked_mean(clamped) + 1e-8)).square())
    low = masked_mean((weights < 1 / cap).to(torch.float64))
    chi2_seq = torch.exp(2.0 * (log_ratio * mask).sum(-1).clamp(-20, 20)).mean() - 1.0
    m = mismatch_metrics(rollout, old, mask, tis_cap=cap, also_as=("verl",))
    assert 0 < float(low) < 0.5 and float((weights > cap).sum()) > 0  # both clamps matter here
    for ours, theirs in (("is_ratio_std", std), ("is_ess", ess), ("is_ratio_below_floor", low), ("chi2_seq", chi2_seq)):
        assert m[PREFIX + ours] == pytest.approx(float(theirs), rel=1e-12), ours
    assert m["rollout_corr/chi2_seq"] == m[PREFIX + "chi2_seq"]
    assert 0 < m[PREFIX + "is_ess"] < 1
    same = mismatch_metrics(rollout, rollout, mask)  # no mismatch: every weight 1
    assert same[PREFIX + "is_ratio_std"] == 0 and same[PREFIX + "is_ess"] == pytest.approx(1, abs=1e-7)


def test_padding_is_ignored_whatever_it_holds():
    inf, train, mask = _hand_case()
    m = mismatch_metrics(inf, train, mask)
    # the same tokens, other junk in the padding, a float mask, and an extra all-padding response
    inf2 = torch.cat([torch.where(mask.bool(), inf, -5.0), torch.full((1, 3), NAN)])
    train2 = torch.cat([torch.where(mask.bool(), train, 9.0), torch.zeros(1, 3, dtype=torch.float64)])
    mask2 = torch.cat([mask.float(), torch.zeros(1, 3)])
    assert mismatch_metrics(inf2, train2, mask2) == m
    assert all(np.isfinite(v) for v in m.values())


def test_no_tokens_gives_nan_not_an_error():
    m = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert m["mismatch/tokens"] == 0 and m["mismatch/sequences"] == 0
    assert np.isnan(m["mismatch/k1"]) and np.isnan(m["mismatch/k3_per_sequence"])


def _random_batch(seed=0, B=4, T=6, V=7, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    p = torch.log_softmax(2 * torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    q = torch.log_softmax(p + noise * torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    tokens = torch.multinomial(p.exp().reshape(-1, V), 1, generator=g).reshape(B, T, 1)
    lengths = torch.tensor([6, 3, 1, 5])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return p.gather(-1, tokens)[..., 0], q.gather(-1, tokens)[..., 0], mask, p, q


def test_exact_kl_is_kl_exact_terms_on_the_response_tokens():
    inf, train, mask, p, q = _random_batch()
    m = mismatch_metrics(inf, train, mask, p, q)
    expected = np.concatenate([kl.exact_terms(p[b][mask[b]].numpy(), q[b][mask[b]].numpy()) for b in range(len(p))])
    assert m["mismatch/exact_kl"] == expected.mean()
    assert mismatch_metrics(inf, inf, mask, p, p)["mismatch/exact_kl"] == 0.0
    with pytest.raises(ValueError, match="both sides"):
        mismatch_metrics(inf, train, mask, p, None)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        mismatch_metrics(inf, train, mask, p, q[:, :-1])


def test_per_sequence_sums_and_the_token_means():
    inf, train, mask, _, _ = _random_batch(seed=1)
    m = mismatch_metrics(inf, train, mask)
    d = [(a - b)[k].numpy() for a, b, k in zip(inf, train, mask)]
    k3 = [kl.k3_terms(t, 0.0) for t in d]
    assert m["mismatch/k1_per_sequence"] == pytest.approx(np.mean([t.sum() for t in d]), rel=1e-12)
    assert m["mismatch/k3_per_sequence"] == pytest.approx(np.mean([t.sum() for t in k3]), rel=1e-12)
    # the token means weight each token once: per-sequence sums over the token count
    n = mask.sum().item()
    assert m["mismatch/k1"] == pytest.approx(sum(t.sum() for t in d) / n, rel=1e-12)
    assert m["mismatch/k3"] == pytest.approx(sum(t.sum() for t in k3) / n, rel=1e-12)


def test_tis_statistics_match_the_weights_a_trainer_applies():
    inf, train, mask, _, _ = _random_batch(seed=2, noise=0.6)
    for cap in (1.05, 2.0):
        m = mismatch_metrics(inf, train, mask, tis_cap=cap)
        rho = torch.exp(train - inf)[mask]  # grpo.py and verl: exp(old_log_prob - rollout_log_prob)
        assert m["mismatch/tis_weight_mean"] == pytest.approx(torch.clamp(rho, max=cap).mean().item(), rel=1e-12)
        assert m["mismatch/is_ratio_mean"] == pytest.approx(rho.mean().item(), rel=1e-12)
        assert m["mismatch/is_ratio_above_cap"] == (rho > cap).double().mean().item()
        seq_rho = torch.exp(((train - inf) * mask).sum(-1))
        assert m["mismatch/seq_is_ratio_above_cap"] == (seq_rho > cap).double().mean().item()
    assert 0 < mismatch_metrics(inf, train, mask, tis_cap=1.05)["mismatch/is_ratio_above_cap"] < 1  # the test bites


def test_bf16_inputs_are_subtracted_in_float64():
    # -1.0078125 and -256 are BF16 numbers; their difference 254.9921875 is not (BF16 would give 255)
    inf = torch.tensor([[-1.0078125]], dtype=torch.bfloat16)
    train = torch.tensor([[-256.0]], dtype=torch.bfloat16)
    assert (inf - train).item() == 255.0
    m = mismatch_metrics(inf, train, torch.ones(1, 1))
    assert m["mismatch/k1"] == 254.9921875 and m["mismatch/abs_diff_max"] == 254.9921875


def test_the_metrics_are_mismatch_summary_of_the_response_tokens():
    """One computation: the trainer's (B, T) tensors and the GRPO loop's per-response arrays give the same numbers."""
    inf, train, mask, _, _ = _random_batch(seed=3)
    m = mismatch_metrics(inf, train, mask)
    s = mismatch_summary([a[k].numpy() for a, k in zip(inf, mask)], [b[k].numpy() for b, k in zip(train, mask)])
    assert (m["mismatch/k1"], m["mismatch/k3"]) == (s["k1"], s["k3"])
    assert (m["mismatch/abs_diff_mean"], m["mismatch/abs_diff_max"]) == (s["abs_diff_mean"], s["abs_diff_max"])
    assert m["mismatch/tokens"] == s["tokens"] == mask.sum().item()


def test_shapes_are_checked():
    inf, train, mask, _, _ = _random_batch()
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        mismatch_metrics(inf, train[:, :-1], mask)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        mismatch_metrics(inf[0], train[0], mask[0])


def test_meter_combines_the_steps_between_two_logs():
    inf, train, mask, _, _ = _random_batch()
    meter = MismatchMeter(tis_cap=1.5)
    a = meter.record(inf, train, mask)
    b = meter.record(train, inf, mask)
    meter.record(inf, train, torch.zeros_like(mask))  # a step with no tokens is left out
    out = meter.flush()
    assert out == combine([a, b]) and meter.pending == [] and meter.flush() == {}
    assert out["mismatch/tokens"] == 2 * mask.sum().item()
    assert out["mismatch/k1"] == (a["mismatch/k1"] + b["mismatch/k1"]) / 2 and out["mismatch/k1"] == 0.0
    assert out["mismatch/abs_diff_max"] == max(a["mismatch/abs_diff_max"], b["mismatch/abs_diff_max"])
    assert out["mismatch/is_ratio_min"] == min(a["mismatch/is_ratio_min"], b["mismatch/is_ratio_min"])


class _Reporter(TrainerCallback):
    """Stands for wandb / tensorboard: keeps what it was asked to log."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_callback_adds_the_keys_to_the_logs_and_the_history():
    inf, train, mask, _, _ = _random_batch()
    reporter = _Reporter()
    handler = CallbackHandler([reporter], None, None, None, None)
    callback = MismatchCallback().attach(type("Trainer", (), {"callback_handler": handler})())
    assert handler.callbacks[0] is callback  # ahead of the reporters
    expected = callback.record(inf, train, mask)
    state, control = TrainerState(global_step=4), TrainerControl()
    logs = {"loss": 0.5}
    state.log_history.append({**logs, "step": 4})  # what Trainer.log does before calling on_log
    handler.on_log(None, state, control, logs)
    assert logs == {"loss": 0.5, **expected} and reporter.seen[-1] == logs
    assert state.log_history[-1] == {"loss": 0.5, "step": 4, **expected}
    # an evaluation's log is left alone and does not take the pending training metrics
    callback.record(inf, train, mask)
    handler.on_log(None, state, control, eval_logs := {"eval_loss": 0.7})
    assert eval_logs == {"eval_loss": 0.7} and len(callback.pending) == 1
    # nothing recorded since the last log: nothing added
    callback.flush()
    handler.on_log(None, state, control, quiet := {"loss": 0.4})
    assert quiet == {"loss": 0.4}


def test_importing_the_monitor_loads_no_plotting_library():
    """A trainer that imports the monitor pays for what it uses: no matplotlib (the monitor's plot imports it)."""
    code = "import sys, rla_lib.align.monitor; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_non_finite_logprobs_are_counted_and_left_out():
    """A NaN or infinite logprob on a response token (a broken kernel, an overflow) is counted under
    mismatch/nonfinite and left out of every statistic, which stays what the finite tokens give."""
    inf, train, mask = _hand_case()
    clean = mismatch_metrics(inf, train, mask)
    assert clean[PREFIX + "nonfinite"] == 0
    bad_inf = torch.cat([inf, torch.tensor([[NAN, -1.0, 0.0]], dtype=torch.float64)])
    bad_train = torch.cat([train, torch.tensor([[-1.0, float("-inf"), 0.0]], dtype=torch.float64)])
    bad = mismatch_metrics(bad_inf, bad_train, torch.cat([mask, torch.tensor([[1, 1, 0]])]))
    assert bad[PREFIX + "nonfinite"] == 2
    without_count = lambda m: {k: v for k, v in m.items() if k != PREFIX + "nonfinite"}
    assert without_count(bad) == without_count(clean)
    meter = MismatchMeter()
    with pytest.warns(RuntimeWarning, match="not rounding: 2 response tokens have a non-finite logprob"):
        meter.record(bad_inf, bad_train, torch.cat([mask, torch.tensor([[1, 1, 0]])]))
    meter.record(inf, train, mask)
    assert meter.flush()[PREFIX + "nonfinite"] == 2  # summed between two logs, as the token counts


def _rank_batches():
    """Two ranks' batches (4 and 3 responses of other lengths; a NaN on rank 1) and the same rows as one batch."""
    a = _random_batch(seed=1, B=4)
    b = _random_batch(seed=2, B=3, noise=0.2)
    b[0][1, 0] = NAN  # a non-finite token, counted on its rank
    return (a, b), tuple(torch.cat([x, y]) for x, y in zip(a, b))


def _rank_metrics(rank: int, store_path: str, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        batches, _ = _rank_batches()
        results[rank] = mismatch_metrics(*batches[rank])  # reduced: a process group of 2 runs
        empty = [x[:0] for x in batches[rank]]
        results[f"one rank empty {rank}"] = mismatch_metrics(*(batches[0] if rank == 0 else empty))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_logs_the_metrics_of_all_ranks_tokens(tmp_path):
    """2 ranks over gloo: each rank's metrics equal one process's on both batches together (token means weighted by
    tokens, response means by responses, counts summed, extremes over ranks), to float64 rounding; a rank without
    tokens takes the other's."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_rank_metrics, args=(str(tmp_path / "store"), results), nprocs=2)
    batches, whole = _rank_batches()
    single = mismatch_metrics(*whole)
    assert single["mismatch/nonfinite"] == 1 and "mismatch/exact_kl" in single
    for rank in (0, 1):
        assert results[rank].keys() == single.keys()
        for key, value in single.items():
            assert results[rank][key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        alone = mismatch_metrics(*batches[0], across=False)
        for key, value in alone.items():
            assert results[f"one rank empty {rank}"][key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    # the rank's own, without a process group
    assert mismatch_metrics(*batches[0]) == mismatch_metrics(*batches[0], across=False)


def test_attach_records_each_trl_rollout_by_itself():
    """On a trainer with TRL's `_generate_and_score_completions`, `attach` records every training rollout (the
    engine's and the trainer's logprobs, TRL's masks); an evaluation rollout is not recorded, and a rollout without
    both logprobs warns once."""
    inf, train, mask, _, _ = _random_batch()
    tool_mask = torch.ones_like(mask)
    tool_mask[0, 1] = 0

    class Trainer:
        callback_handler = CallbackHandler([], None, None, None, None)
        model = torch.nn.Linear(1, 1)

        def _generate_and_score_completions(self, inputs):
            return inputs

    trainer = Trainer()
    callback = MismatchCallback().attach(trainer)
    rollout = {"sampling_per_token_logps": inf, "old_per_token_logps": train, "completion_mask": mask.long(),
               "tool_mask": tool_mask}
    assert trainer._generate_and_score_completions(rollout) is rollout
    assert callback.pending == [mismatch_metrics(inf, train, mask.long() * tool_mask)]
    trainer.model.eval()
    trainer._generate_and_score_completions(rollout)
    assert len(callback.pending) == 1
    trainer.model.train()
    with pytest.warns(RuntimeWarning, match="use_vllm=True"):
        trainer._generate_and_score_completions({"completion_mask": mask})
    assert len(callback.pending) == 1


def test_chi2_token_and_verls_warning_levels():
    """mismatch/chi2_token is verl's rollout_corr/chi2_token (mean rho^2 - 1 over the masked tokens); `alerts` fires at
    verl's documented levels and stays quiet below them; the meter warns once when a level is first passed."""
    gen = torch.Generator().manual_seed(1)
    rollout = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 2
    mask = (torch.arange(6) < torch.tensor([[6], [3], [5]])).to(torch.float64)
    close = rollout + torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.01
    rho = (close - rollout).exp()
    m = mismatch_metrics(rollout, close, mask, also_as=("verl",))
    assert m["rollout_corr/chi2_token"] == m["mismatch/chi2_token"] == pytest.approx(
        float((rho**2 * mask).sum() / mask.sum()) - 1, rel=1e-12, abs=1e-15)
    assert alerts(m) == []
    far = rollout - 1.5  # every token: d = 1.5, k1 = 1.5 > 0.1; rho = e^-1.5, mean weight 0.22 < 0.5
    lines = alerts(mismatch_metrics(rollout, far, mask))
    assert [line.split(" ", 1)[0] for line in lines] == ["mismatch/k1", "mismatch/tis_weight_mean"]
    assert lines[0] == "mismatch/k1 (rollout_corr/kl) = 1.5: KL divergence indicates significant off-policy gap"
    spread = rollout + torch.where(torch.arange(6) % 2 == 0, 1.0, -1.0)  # rho = e, 1/e: chi2 = (e^2 + e^-2)/2 - 1 > 1
    assert "mismatch/chi2_token" in alerts(mismatch_metrics(rollout, spread, mask))[-1]
    meter = MismatchMeter(alerts=True)
    with pytest.warns(RuntimeWarning) as passed:
        meter.record(rollout, far, mask)
    assert [str(w.message) for w in passed] == [f"verl's warning level passed: {line}" for line in lines]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meter.record(rollout, far, mask)  # still past: no second warning
        MismatchMeter().record(rollout, far, mask)  # alerts are asked for


def test_what_masquerades_as_mismatch_is_named_and_a_clean_batch_is_quiet():
    """`masquerades`: each check fires on a batch built to have it and stays quiet on a clean one; the meter warns once
    per kind."""
    gen = torch.Generator().manual_seed(2)
    engine = -torch.rand(8, 6, generator=gen, dtype=torch.float64) * 2 - 0.05
    mask = torch.ones(8, 6)
    clean = engine + torch.randn(8, 6, generator=gen, dtype=torch.float64) * 1e-3  # rounding-sized, both ways
    ids = torch.randint(0, 50, (8, 6), generator=gen)
    assert masquerades(engine, clean, mask, ids, group_size=4) == {}
    # one-sided: every engine logprob 0.05 above the trainer's (a truncated sampling distribution renormalized)
    assert list(masquerades(engine, engine - 0.05, mask)) == ["one-sided"]
    # placeholders: the engine reports 0 on two tokens the trainer gives about e^-1
    placeholder = engine.clone()
    placeholder[0, :2] = 0.0
    assert list(masquerades(placeholder, clean, mask)) == ["placeholder"]
    # non-finite on a response token (a NaN under the mask is a failure; under padding it is nothing)
    broken = engine.clone()
    broken[1, 3] = float("nan")
    assert list(masquerades(broken, clean, mask)) == ["nonfinite"]
    assert masquerades(broken, clean, mask.index_put((torch.tensor(1), torch.tensor(3)), torch.tensor(0.0))) == {}
    # duplicates: the first group of 4 identical responses of low probability (a reused seed); the second group
    # identical too but certain (logprob near 0: a confident model repeats itself), not flagged
    dup_ids = ids.clone()
    dup_ids[1:4] = dup_ids[0]
    dup_ids[5:8] = dup_ids[4]
    confident = engine.clone()
    confident[4:8] = -1e-6
    found = masquerades(confident, confident + clean - engine, mask, dup_ids, group_size=4)
    assert list(found) == ["duplicates"] and found["duplicates"].startswith("1 of 2 groups hold 4 identical responses")
    meter = MismatchMeter()
    with pytest.warns(RuntimeWarning, match="not rounding: the engine's logprob is above the trainer's"):
        meter.record(engine, engine - 0.05, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        meter.record(engine, engine - 0.05, mask)  # once per kind
