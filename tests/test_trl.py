"""rla_lib.trl_grpo: TRL's GRPOTrainer with rollouts from the real engine (2 steps per arm), and its refusals."""

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rla_lib.align import Schedule, align
from rla_lib.engine_align import align_to_engine, kernel_numerics
from rla_lib.machine import vllm_cpu_attention_kernel
from rla_lib.models import load_model, load_tokenizer, resolve_model
from rla_lib.scoring import token_logprobs
from rla_lib.tokenizer import build_tokenizer
from rla_lib.trl_grpo import EngineGRPOTrainer, EngineScoring, GRPOConfig, task_dataset, task_reward
from test_engine_align import MEASURED_EXACT

MISMATCH_KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/exact_kl", "mismatch/abs_diff_mean", "mismatch/tokens"]
TRL_KEYS = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/mean", "reward"]


def config(tmp_path, **overrides):
    return GRPOConfig(**dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=16,
                             num_generations=4, max_completion_length=24, learning_rate=1e-4, bf16=False, use_cpu=True,
                             gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, log_level="warning") | overrides)


class RecordingTrainer(EngineGRPOTrainer):
    """Keeps the last step's TRL batch and both full distributions, to check the exact KL's inputs."""

    def _full_distributions(self, out):
        self.recorded = (out, *super()._full_distributions(out))
        return self.recorded[1:]


@pytest.mark.engine
def test_two_steps_log_the_mismatch_and_the_aligned_side_is_closer_on_the_same_tokens(compiled_engine, tmp_path):
    runs = {}
    try:
        for arm in ("stock", "aligned"):
            model = load_model("qwen3-tiny")
            if arm == "aligned":
                align_to_engine(model, compiled_engine)
            trainer = RecordingTrainer(model, compiled_engine, task_reward, config(tmp_path), task_dataset(32))
            trainer.train()
            runs[arm] = trainer
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))  # the shared engine goes back to the shipped weights
    logs = {arm: [h for h in t.state.log_history if "loss" in h] for arm, t in runs.items()}
    for arm, rows in logs.items():
        assert [h["step"] for h in rows] == [1, 2]
        assert all(k in h for h in rows for k in MISMATCH_KEYS + TRL_KEYS), arm
        assert all(h["mismatch/tokens"] > 0 for h in rows)
        # the same masked tokens as TRL's own metric: TRL averages |d| in FP32, the monitor in FP64
        assert all(h["mismatch/abs_diff_mean"] == pytest.approx(h["sampling/sampling_logp_difference/mean"], rel=1e-5)
                   for h in rows)
        assert all(h["mismatch/abs_diff_max"] == h["sampling/sampling_logp_difference/max"] for h in rows)
        # the exact KL's training side is the distribution TRL scored: its sampled-token entries are TRL's logprobs
        # (both FP32 log-softmax of the same BF16 logits, reduced in a different order: a few FP32 ulps)
        out, _, training = runs[arm].recorded
        mask = out["completion_mask"].bool()
        picked = training.gather(-1, out["completion_ids"][..., None])[..., 0]
        torch.testing.assert_close(picked[mask], out["old_per_token_logps"][mask], rtol=0, atol=1e-5)
    # step 1 samples the same tokens in both runs (same weights in the engine, same seeds): a paired comparison
    assert runs["stock"].rollout_digests[0] == runs["aligned"].rollout_digests[0]
    stock, aligned = logs["stock"][0], logs["aligned"][0]
    assert aligned["mismatch/k3"] < stock["mismatch/k3"]
    assert aligned["mismatch/exact_kl"] < stock["mismatch/exact_kl"]
    if vllm_cpu_attention_kernel() in MEASURED_EXACT:
        # the trainer scores as the engine does: aligned to the engine, TRL's own metrics read exactly no mismatch
        for h in logs["aligned"]:
            assert h["sampling/sampling_logp_difference/max"] == 0 and h["mismatch/exact_kl"] == 0, h
        assert aligned["sampling/importance_sampling_ratio/mean"] == 1 and aligned["mismatch/k1"] == 0
        assert stock["sampling/sampling_logp_difference/max"] > 0  # the check bites: stock BF16 is not the engine's


def stand_in_engine(model="qwen3-tiny"):
    """What the trainer's checks read of an Engine (its checkpoint and tokenizer), without starting vLLM."""
    return types.SimpleNamespace(spec=resolve_model(model), tokenizer=load_tokenizer(model))


@pytest.mark.parametrize("case, match", [
    ("llama", "LlamaForCausalLM; this trainer takes Qwen2ForCausalLM or Qwen3ForCausalLM"),
    ("qwen2 model, qwen3 engine", "engine runs a Qwen3ForCausalLM"),
    ("other tokenizer", "the tokenizer is not the engine's"),
    ("autocast", "set bf16=False"),
    ("top_p", "temperature only; leave top_p"),
    ("name", "pass the model object"),
])
def test_bad_input_is_refused_before_training_and_writes_nothing(tmp_path, case, match):
    model, tokenizer, overrides = load_model("qwen3-tiny"), None, {}
    if case == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
    elif case == "qwen2 model, qwen3 engine":
        model = load_model("qwen2-tiny")
    elif case == "other tokenizer":
        tokenizer = build_tokenizer(vocab_size=32)
    elif case == "name":
        model = "qwen3-tiny"
    else:
        overrides = {"autocast": dict(bf16=True), "top_p": dict(top_p=0.9)}[case]
    with pytest.raises((ValueError, TypeError), match=match):
        EngineGRPOTrainer(model, stand_in_engine(), task_reward, config(tmp_path, **overrides), task_dataset(8),
                          processing_class=tokenizer)
    assert not (tmp_path / "out").exists()


def test_a_plain_grpo_trainer_with_the_mixin_scores_as_the_engine_does(tmp_path):
    """`class Trainer(EngineScoring, trl.GRPOTrainer)`: TRL's per-token logprobs of a left-padded batch are, bit for
    bit, the logprobs the engine's way of scoring (`rla_lib.scoring`, FP32 log-softmax of the LM head's logits, each
    sequence alone from position 0) gives, for a model whose attention is the engine's kernel (as `align_to_engine`
    makes it): that kernel reads each row from its first real key, so padding moves none of its sums. Prompts longer
    than a vector of keys, padded by odd widths: PyTorch's SDPA (the stock model's) sums keys in vector lanes counted
    from the padded row's first slot, so there a padded row is not the row alone. TRL's own route differs in the last
    bits."""
    from trl import GRPOTrainer

    class Trainer(EngineScoring, GRPOTrainer):
        pass

    model = load_model("qwen3-tiny")
    align(model, Schedule(attention=kernel_numerics()))
    trainer = Trainer(model, task_reward, args=config(tmp_path), train_dataset=task_dataset(8),
                      processing_class=load_tokenizer("qwen3-tiny"))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (3, 40, 18, 33)]
    completion = torch.randint(3, vocab, (len(prompts), 6), generator=gen)
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p, c]) for p, c in zip(prompts, completion)])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p) + 6)]) for p in prompts]).long()
    with torch.no_grad():
        mixin = trainer._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep=6)[0]
        trl_own = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, logits_to_keep=6)[0]
    alone = [torch.from_numpy(token_logprobs(model, [torch.cat([p, c]).tolist()])[0][-6:])
             for p, c in zip(prompts, completion)]
    assert torch.equal(mixin, torch.stack(alone))
    assert not torch.equal(trl_own, mixin)  # the check bites: TRL's own route (and numbering) is not the engine's
