"""Train the embedded default models (`make models`): a tiny Qwen3 and a tiny Qwen2.

Supervised training on the running-sum addition task, stopped early on purpose: the
models answer right often but not always at temperature 1, so RL has room to improve,
and their next-token distributions are peaked like a real LM's (a random-init model's
near-uniform outputs make mismatch numbers meaningless).

A third, `qwen3-tiny-steps`, answers the long-answer task variant (`task.TASKS["steps"]`, 45-100
response tokens): it starts from `qwen3-tiny` (same shape, context extended to 160 positions; RoPE has
no length-bound parameter) and is fine-tuned on the new format, which is much faster than training
from scratch. `--arch qwen3-steps` trains just this one.

A fourth, `qwen3-tiny-steps-hot`, is not trained: it is `qwen3-tiny-steps` with its final RMSNorm weight
halved. The weight multiplies the normed hidden state, so (tied embeddings) every logit is halved exactly, in
BF16 as in FP32: sampling it at temperature 1 is sampling `qwen3-tiny-steps` at temperature 2. A high-entropy
start (right on about 7% of long-answer problems at temperature 1, against about 50% greedy) gives GRPO room
to learn, which the sharp `qwen3-tiny-steps` (about 0.03 nats per token) does not. `make models` makes all four.

Deterministic on a given machine: fixed seeds, fixed thread count, data drawn from a
seeded generator. Run: python -m rla_lib.pretrain [--arch qwen3 qwen2 qwen3-steps qwen3-steps-hot] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from . import task
from .models import EMBEDDED_MODELS
from .tokenizer import VOCAB, build_tokenizer

EMBEDDED = {"qwen3": EMBEDDED_MODELS["qwen3-tiny"], "qwen2": EMBEDDED_MODELS["qwen2-tiny"],
            "qwen3-steps": EMBEDDED_MODELS["qwen3-tiny-steps"],
            "qwen3-steps-hot": EMBEDDED_MODELS["qwen3-tiny-steps-hot"]}  # by --arch
# Training stops at the first check where temperature-1 accuracy on a dev split reaches the target: right
# often but not always, so RL has room to improve. Qwen2 (no Q/K norm) learns slower: a longer schedule.
# The long-answer model needs every one of 5-9 additions right: a lower target, a fine-tune from qwen3-tiny.
TRAINING = {"qwen3": dict(steps=2000, stop_at_accuracy=0.5), "qwen2": dict(steps=4000, stop_at_accuracy=0.5),
            "qwen3-steps": dict(steps=1500, stop_at_accuracy=0.4, lr=1e-3, init="qwen3", task="steps"),
            "qwen3-steps-hot": dict(steps=0, init="qwen3-steps", task="steps", logit_scale=0.5)}
DEV_SPLIT_SEED = 4242
MAX_POSITIONS = {"sums": 64, "steps": 160}  # longest prompt + response: 39 and 126 tokens
MAX_NEW_TOKENS = {"sums": 24, "steps": 112}

SHAPE = dict(
    vocab_size=len(VOCAB),
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA, as in every Qwen2/Qwen3 release
    head_dim=64,
    max_position_embeddings=MAX_POSITIONS["sums"],
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    dtype="bfloat16",
)


def make_config(arch: str):
    if arch == "qwen3":  # Q/K RMSNorm, no QKV bias, tied embeddings (as Qwen3-0.6B/1.7B)
        return Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "qwen2":  # QKV bias, no Q/K norm, untied (as DeepSeek-R1-Distill-Qwen-1.5B)
        return Qwen2Config(**SHAPE, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    raise ValueError(f"arch must be 'qwen3' or 'qwen2', got {arch!r}")


def encode_batch(problems, tokenizer, with_solution=True):
    """Right-padded ids, attention mask and a mask over the tokens the loss is taken on."""
    rows, loss_rows = [], []
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        response = tokenizer.encode(p.solution) + [tokenizer.eos_token_id] if with_solution else []
        rows.append(prompt + response)
        loss_rows.append([0] * len(prompt) + [1] * len(response))
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in loss_rows])
    return ids, attn, loss_mask


@torch.no_grad()
def sampled_accuracy(model, tokenizer, problems, temperature=1.0, seed=0, batch_size=128):
    """Accuracy of answers sampled by Transformers' `generate` (the engine is not needed here)."""
    max_new_tokens = MAX_NEW_TOKENS[problems[0].format]
    model.eval()
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    correct = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
        kwargs = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(task.reward(p, t) for p, t in zip(chunk, texts))
    model.train()
    return correct / len(problems)


def train(arch: str, steps: int, batch_size: int = 64, lr: float = 3e-3, seed: int = 0, log_every: int = 100,
          stop_at_accuracy: float | None = None, init: str | None = None, task_name: str = "sums",
          logit_scale: float | None = None):
    """Train from scratch (or from the embedded model of `init`); with stop_at_accuracy, stop at the first check
    (every `log_every` steps, from a third of the way on) where temperature-1 accuracy on a dev split reaches it.
    logit_scale multiplies the final norm weight at the end: every logit by that factor (a power of 2: exactly)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    task_config = task.TASKS[task_name]
    if init:
        model = AutoModelForCausalLM.from_pretrained(EMBEDDED[init], dtype=torch.float32)
        model.config.max_position_embeddings = MAX_POSITIONS[task_name]
    else:
        model = AutoModelForCausalLM.from_config(make_config(arch), dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    )
    dev_split = task.make_split(DEV_SPLIT_SEED, 128, task_config)
    history, t0 = [], time.time()
    for step in range(1, steps + 1):
        ids, attn, loss_mask = encode_batch([task.sample_problem(rng, task_config) for _ in range(batch_size)], tokenizer)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps:
            row = {"step": step, "loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)}
            if stop_at_accuracy is not None and step >= steps // 3:
                row["dev_accuracy_t1"] = sampled_accuracy(model, tokenizer, dev_split, temperature=1.0, seed=step)
            history.append(row)
            print(f"[{arch}] {row}", flush=True)
            if row.get("dev_accuracy_t1", 0.0) >= (stop_at_accuracy or 2.0):
                break
    if logit_scale is not None:
        with torch.no_grad():
            model.model.norm.weight.mul_(logit_scale)
    return model, tokenizer, history


def save_model(model, tokenizer, out_dir: Path, metadata: dict) -> None:
    """Write a Hugging Face directory (BF16 safetensors, config, tokenizer) atomically."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "training.json").write_text(json.dumps(metadata, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=list(EMBEDDED), choices=sorted(EMBEDDED),
                        help="a model that starts from another (`init`) runs after it")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps, no early stop (default: {TRAINING})")
    parser.add_argument("--out", type=Path, default=None, help="output root (default: data/models, and the eval split)")
    parser.add_argument("--eval-size", type=int, default=task.EVAL_SPLIT_SIZE, help="held-out problems to report accuracy on")
    args = parser.parse_args(argv)
    if len(args.arch) > 1:  # one process per model, in parallel, each on one thread
        return _train_in_parallel(args)
    # Results depend on the thread count; one thread makes them the same on any machine with this
    # torch build (`make models` trains the two models in parallel processes instead).
    torch.set_num_threads(1)
    for arch in args.arch:
        settings = dict(TRAINING[arch], **(dict(steps=args.steps, stop_at_accuracy=None) if args.steps else {}))
        task_name = settings.pop("task", "sums")
        eval_split = task.make_split(task.EVAL_SPLIT_SEED, task.EVAL_SPLIT_SIZE, task.TASKS[task_name])
        if args.out is None:
            task.save_split(eval_split, task.eval_split_path(task_name))
        eval_split = eval_split[: args.eval_size]
        model, tokenizer, history = train(arch.split("-")[0], **settings, task_name=task_name)
        steps = history[-1]["step"] if history else 0
        acc_t1 = sampled_accuracy(model, tokenizer, eval_split, temperature=1.0)
        acc_greedy = sampled_accuracy(model, tokenizer, eval_split, temperature=0.0)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{arch}] eval accuracy: T=1 {acc_t1:.3f}, greedy {acc_greedy:.3f}; {n_params / 1e6:.2f}M parameters")
        meta = dict(arch=arch, steps=steps, schedule=settings, parameters=n_params, eval_accuracy_t1_fp32=acc_t1,
                    eval_accuracy_greedy_fp32=acc_greedy, task=asdict(task.TASKS[task_name]), task_name=task_name,
                    history=history)
        out = (args.out / EMBEDDED[arch].name) if args.out else EMBEDDED[arch]
        save_model(model, tokenizer, out, meta)
        print(f"[{arch}] saved to {out}")


def _train_in_parallel(args) -> None:
    extra = (["--steps", str(args.steps)] if args.steps else []) + ["--eval-size", str(args.eval_size)] + (["--out", str(args.out)] if args.out else [])
    groups, left = [], list(args.arch)
    while left:  # the ones others start from train first
        groups.append([a for a in left if TRAINING[a].get("init") not in left])
        left = [a for a in left if a not in groups[-1]]
    for group in groups:
        procs = {a: subprocess.Popen([sys.executable, "-m", "rla_lib.pretrain", "--arch", a, *extra]) for a in group}
        failed = [a for a, p in procs.items() if p.wait() != 0]
        if failed:
            raise SystemExit(f"training failed for {failed}; see the output above")


if __name__ == "__main__":
    main()
