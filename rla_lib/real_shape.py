"""Real-shape checkpoints made here: the Qwen3-0.6B configuration and a Qwen2-0.5B counterpart, untrained but peaked.

    python -m rla_lib.real_shape          # make real-shape: writes .cache/real-shape/qwen3-0.6b-shape, qwen2-0.5b-shape
    model = ".cache/real-shape/qwen3-0.6b-shape"   # then any notebook's `model` parameter, or resolve_model(...)

The shapes are those of the released configurations: Qwen3-0.6B (28 layers, hidden 1024, intermediate 3072, 16
query and 8 key/value heads of 128, Q/K norm, vocabulary 151,936, tied embeddings, RoPE theta 1e6, 40,960
positions) and Qwen2-0.5B (24 layers, hidden 896, intermediate 4864, 14 and 2 heads of 64, QKV bias, the same
vocabulary, tied embeddings, theta 1e6, 32,768 positions). The weights are Transformers' own random
initialisation from a fixed seed (the same bytes on every run of the same torch), with one exception that makes
the next-token distributions peaked like a trained model's instead of near-uniform (uniform over 151,936 tokens
has 11.9 nats of entropy; a trained model on text has a few): the final norm's weight is a constant, found by
bisection so that the mean next-token entropy over a fixed probe batch is `TARGET_ENTROPY` nats. A mismatch
measured on a near-uniform model would say little about a real one.

The tokenizer is the task's (one token per character, `rla_lib.tokenizer`) with unused tokens up to the
vocabulary size, so the task's prompts encode exactly as on the embedded models. The directories are large
(1.2 and 1.0 GB in BF16) and not committed; they are made on demand and kept under `.cache/`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from .paths import ROOT, atomic_write
from .tokenizer import build_tokenizer

REAL_SHAPE_DIR = ROOT / ".cache" / "real-shape"
TARGET_ENTROPY = 2.0  # nats: mean next-token entropy of the probe batch
VOCAB_SIZE = 151_936
COMMON = dict(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, dtype="bfloat16", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
SHAPES = {
    "qwen3-0.6b-shape": (Qwen3Config, dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072,
                                           num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                           max_position_embeddings=40_960)),
    "qwen2-0.5b-shape": (Qwen2Config, dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                                           num_attention_heads=14, num_key_value_heads=2,
                                           max_position_embeddings=32_768)),
}

# The 0.6B shape cut to 2 narrow layers, its vocabulary kept: every vocabulary-sized path at full size in seconds
# (tests, the notebooks' real-vocabulary tier). head_dim 64 is the smallest vLLM's CPU attention accepts.
NARROW = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
              head_dim=64, max_position_embeddings=4096)
NARROW_NAME = "qwen3-0.6b-shape-narrow"


def make_config(name: str, **overrides):
    """The configuration of one real shape (`overrides` shrink it, e.g. for tests)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {list(SHAPES)}")
    config_class, shape = SHAPES[name]
    return config_class(**COMMON | shape | overrides)


def mean_entropy(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def calibrate_final_norm(model, probe_ids: torch.Tensor, target: float = TARGET_ENTROPY, steps: int = 24) -> float:
    """Set the final norm's weight to the constant giving `target` nats of mean next-token entropy on the probe
    batch (bisection on a log scale: the entropy falls as the logits grow). Returns the constant.
    The logits are linear in that constant (the LM head has no bias), so they are computed once; 24 halvings of
    [1e-3, 1e4] on a log scale leave it within 1e-6 of its value, far inside the BF16 the weight is saved in."""
    norm = model.model.norm
    seen = []
    hook = norm.register_forward_hook(lambda module, args, output: seen.append(args[0]))  # the final norm's input
    with torch.no_grad():
        model.model(input_ids=probe_ids)
        hook.remove()
        logits = model.lm_head(norm(seen[0]) / norm.weight)  # at weight 1
        low, high = 1e-3, 1e4
        for _ in range(steps):
            mid = (low * high) ** 0.5
            low, high = (mid, high) if mean_entropy(logits * mid) > target else (low, mid)
        scale = (low * high) ** 0.5
        norm.weight.fill_(scale)
    return scale


def probe_batch(vocab_size: int, seed: int = 0, rows: int = 8, length: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def make_checkpoint(name: str, out_dir=None, seed: int = 0, target: float = TARGET_ENTROPY, folder: str | None = None,
                    **overrides):
    """Write one real-shape checkpoint directory (config, BF16 safetensors, tokenizer; `real_shape.json` last, so
    its presence means complete) into `out_dir / (folder or name)`; returns its path."""
    out = Path(REAL_SHAPE_DIR if out_dir is None else out_dir) / (folder or name)
    config = make_config(name, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    scale = calibrate_final_norm(model, probe_batch(config.vocab_size, seed), target)
    model.to(torch.bfloat16).save_pretrained(out)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    with torch.no_grad():
        entropy = mean_entropy(model(input_ids=probe_batch(config.vocab_size, seed + 1)).logits)
    info = dict(shape=name, overrides=overrides, seed=seed, target_entropy=target, final_norm_weight=scale, held_out_entropy=entropy,
                note="random initialisation (seeded); only the final norm weight is set, for peaked distributions")
    atomic_write(out / "real_shape.json", lambda tmp: tmp.write_text(json.dumps(info, indent=1)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--narrow", action="store_true", help=f"only {NARROW_NAME}: the Qwen3 shape in 2 narrow layers")
    parser.add_argument("--out", default=None, help=f"folder of the checkpoints (default {REAL_SHAPE_DIR})")
    args = parser.parse_args(argv)
    out_dir = REAL_SHAPE_DIR if args.out is None else Path(args.out)
    for name in [] if args.narrow else args.shape:
        out = make_checkpoint(name, out_dir)
        info = json.loads((out / "real_shape.json").read_text())
        print(f"{out}: mean next-token entropy {info['held_out_entropy']:.2f} nats on held-out random tokens "
              f"(final norm weight {info['final_norm_weight']:.3g})")
    print(make_narrow(out_dir))
    return 0


def make_narrow(out_dir=None) -> Path:
    """The narrow full-vocabulary checkpoint (`NARROW`), written once: its path."""
    out = Path(REAL_SHAPE_DIR if out_dir is None else out_dir) / NARROW_NAME
    return out if (out / "real_shape.json").exists() else make_checkpoint("qwen3-0.6b-shape", out.parent, folder=NARROW_NAME, **NARROW)


if __name__ == "__main__":
    raise SystemExit(main())
