"""rla_lib.real_shape at a reduced size (the full checkpoints are made by `make real-shape`): the shape, the
calibrated entropy, the same bytes on every run, and that it loads like any checkpoint."""

import pytest
import torch

from rla_lib import real_shape, task
from rla_lib.models import load_model, load_tokenizer, resolve_model

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=2048)


def test_full_configs_are_the_released_shapes():
    q3, q2 = real_shape.make_config("qwen3-0.6b-shape"), real_shape.make_config("qwen2-0.5b-shape")
    assert (q3.num_hidden_layers, q3.hidden_size, q3.num_attention_heads, q3.num_key_value_heads, q3.head_dim) == (28, 1024, 16, 8, 128)
    assert (q2.num_hidden_layers, q2.hidden_size, q2.num_attention_heads, q2.num_key_value_heads) == (24, 896, 14, 2)
    assert q3.vocab_size == q2.vocab_size == 151_936 and q3.tie_word_embeddings and q2.tie_word_embeddings
    with pytest.raises(ValueError, match="unknown shape"):
        real_shape.make_config("qwen3-8b-shape")


@pytest.mark.parametrize("name", list(real_shape.SHAPES))
def test_small_checkpoint_is_peaked_deterministic_and_loads(name, tmp_path):
    a = real_shape.make_checkpoint(name, tmp_path / "a", **SMALL)
    b = real_shape.make_checkpoint(name, tmp_path / "b", **SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    spec = resolve_model(a)
    assert spec.vocab_size == SMALL["vocab_size"] and spec.family == ("qwen3" if "qwen3" in name else "qwen2")
    model = load_model(a)
    with torch.no_grad():  # calibrated on random tokens; on held-out random tokens the entropy is near the target
        logits = model(input_ids=real_shape.probe_batch(SMALL["vocab_size"], seed=7)).logits
    # the bisection hits the target on the probe batch; another batch and BF16 weights move it a little
    assert abs(real_shape.mean_entropy(logits) - real_shape.TARGET_ENTROPY) < 0.5
    assert real_shape.mean_entropy(logits) < 0.5 * torch.log(torch.tensor(float(SMALL["vocab_size"]))).item()
    prompt = task.load_split()[0].prompt
    assert load_tokenizer(a).encode(prompt) == load_tokenizer("qwen3-tiny").encode(prompt)
