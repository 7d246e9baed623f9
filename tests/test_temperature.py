"""The sampling temperature on both sides: the engine samples softmax(logits / T) and returns that
distribution's logprobs; the training side scores the same distribution."""

import numpy as np
import pytest
import torch

from rla_lib import grpo, task
from rla_lib.align.monitor import mismatch_summary
from rla_lib.kl import UNIT
from rla_lib.models import load_model
from rla_lib.scoring import hidden_states, log_softmax_at, pad_batch, token_logprobs

T = 0.7
PROMPTS = [p.prompt for p in task.make_split(8, 6)]
# FP32 engine vs FP32 Transformers: different kernels, same arithmetic up to FP32 rounding. The bound
# the FP32 weight-sync test uses (tests/test_grpo.py); measured here at T=0.7: max 8e-6 over ~170 tokens.
FP32_TOL = 1e-4
# k3 of a per-token difference d is about d^2 / 2, so |d| <= FP32_TOL bounds it by FP32_TOL^2 / 2 per
# token: in the monitor's unit (1e-4 / token) that is 5e-5; asserted with a factor 2 to spare.
FP32_K3_BOUND = FP32_TOL**2 / UNIT
TINY = dict(steps=2, prompts_per_step=4, group_size=4, max_tokens=24, eval_every=2, eval_prompts=8, checkpoint_every=2, lr=1e-4)


def k3(inference, training) -> float:
    return mismatch_summary(inference, training)["k3"] / UNIT


def test_log_softmax_at_divides_in_fp32_after_the_cast_and_not_at_t1():
    logits = (8 * torch.randn(5, 16)).bfloat16()
    assert torch.equal(log_softmax_at(logits), torch.log_softmax(logits.float(), -1))  # T=1: no division at all
    # vLLM: logits.to(float32), then in-place division by its FP32 temperature tensor, then log-softmax
    vllm_order = torch.log_softmax(logits.to(torch.float32).div_(torch.full((5, 1), T, dtype=torch.float32)), -1)
    assert torch.equal(log_softmax_at(logits, T), vllm_order)
    with pytest.raises(ValueError, match="temperature"):
        log_softmax_at(logits, 0.0)


def test_scorer_and_policy_apply_the_temperature():
    model = load_model("qwen3-tiny")
    seqs = [[1, 5, 6, 7, 8, 9], [1, 4, 4, 3]]
    ids, mask = pad_batch(seqs)
    with torch.no_grad():  # the scorer's own path: decoder over the batch, LM head over the flattened positions
        h = hidden_states(model, ids, mask)[:, :-1]
        logits = model.lm_head(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1)
    targets = ids[:, 1:, None]
    for temperature in (1.0, T):
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets)[..., 0]
        for i, got in enumerate(token_logprobs(model, seqs, temperature=temperature)):
            np.testing.assert_array_equal(got, expected[i, : len(seqs[i]) - 1].numpy())
    # the GRPO policy scores the distribution its config samples from
    one = torch.tensor([seqs[0]])
    for temperature in (1.0, T):
        policy = grpo.Policy(grpo.GRPOConfig(temperature=temperature))
        with torch.no_grad():
            logits = policy.compute(input_ids=one, attention_mask=torch.ones_like(one)).logits[:, :-1]
        lp, _ = policy.logprobs(one, torch.ones_like(one), grad=False)
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, one[:, 1:, None])[..., 0]
        assert torch.equal(lp, expected)
    with pytest.raises(ValueError, match="temperature"):
        grpo.GRPOConfig(temperature=0)


@pytest.fixture(scope="module")
def fp32_engine():
    from rla_lib.engine import Engine

    with Engine("qwen3-tiny", dtype="float32") as engine:
        yield engine


@pytest.mark.engine
def test_engine_returns_the_tempered_distribution(fp32_engine):
    samples = [s for g in fp32_engine.sample(PROMPTS, n=4, max_tokens=24, temperature=T, seed=3) for s in g]
    seqs, starts = [s.ids for s in samples], [s.response_start for s in samples]
    engine_lp = [s.logprobs for s in samples]
    model = load_model("qwen3-tiny", dtype="float32")
    tempered = [lp[a:] for lp, a in zip(token_logprobs(model, seqs, temperature=T), starts)]
    plain = [lp[a:] for lp, a in zip(token_logprobs(model, seqs), starts)]

    def max_abs(a, b):
        return max(np.abs(x - y).max() for x, y in zip(a, b))

    assert max_abs(engine_lp, tempered) < FP32_TOL  # the same distribution, to FP32 rounding
    assert max_abs(engine_lp, plain) > 100 * FP32_TOL  # scoring at T=1 is visibly another distribution
    assert k3(engine_lp, tempered) < FP32_K3_BOUND < 1e4 * FP32_K3_BOUND < k3(engine_lp, plain)  # orders apart
    # the engine's own scoring at T renormalises its full T=1 distribution: equal up to FP32 rounding
    scored = [sc.token_logprobs[a:] for sc, a in zip(fp32_engine.score(seqs, temperature=T), starts)]
    assert max_abs(engine_lp, scored) < FP32_TOL
    full = fp32_engine.score(seqs[:2], full_vocab=True, temperature=T)
    np.testing.assert_allclose(np.exp(full[0].full).sum(-1), 1.0, atol=1e-5)


@pytest.mark.engine
def test_grpo_at_temperature_end_to_end(fp32_engine, tmp_path):
    """Two GRPO steps at T=0.7 with the FP32 control: both sides score the sampled distribution, so the
    logged mismatch stays at FP32 rounding, as at T=1 (untempered scoring gives k3 orders larger: above)."""
    try:
        h = grpo.run(grpo.GRPOConfig(precision="fp32", temperature=T, **TINY), tmp_path / "t07", engine=fp32_engine, progress=False)
    finally:
        fp32_engine.load_weights(load_model("qwen3-tiny", dtype="float32"))
    train = h[h["step"] > 0]
    assert train["tokens"].gt(0).all() and train["k3"].lt(FP32_K3_BOUND).all()
    assert train["max_abs_diff"].lt(FP32_TOL).all()
    ev = h.dropna(subset=["eval_accuracy"])
    assert ev["step"].tolist() == [0, 2] and ev["eval_accuracy_policy"].tolist() == ev["eval_accuracy"].tolist()


@pytest.mark.engine
def test_bf16_grpo_mismatch_at_temperature_is_of_the_order_at_t1(compiled_engine, tmp_path):
    """Default BF16 stack, T=0.7 vs T=1, same seed and prompts. Tempering divides the BF16 logit errors by
    T, so k3 grows by about 1/T^2 = 2; a factor 10 leaves room for the sampling noise of ~200 tokens.
    Without the fix the T=0.7 run's k3 is tens of times larger (the T=1 distribution scored instead)."""
    try:
        at_t = grpo.run(grpo.GRPOConfig(temperature=T, **TINY), tmp_path / "t07", engine=compiled_engine, progress=False)
        at_1 = grpo.run(grpo.GRPOConfig(**TINY), tmp_path / "t1", engine=compiled_engine, progress=False)
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))
    k3_t, k3_1 = at_t.loc[at_t["step"] > 0, "k3"].mean(), at_1.loc[at_1["step"] > 0, "k3"].mean()
    assert 0 < k3_t < 10 * k3_1
