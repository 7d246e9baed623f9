"""Is the engine-aligned training side exact on this CPU? Per model and vLLM mode, at this machine's level and each
lower level it can be capped to (`rla_lib.machine.ISA_LEVELS`, each in its own process):

    .venv/bin/python benchmarks/exactness.py [--models qwen3-tiny qwen2-tiny] [--prompts 64] [--levels avx2] [--no-save]
    .venv/bin/python benchmarks/exactness.py --models qwen3-tiny --modes eager --levels native --prompts 2 --samples 1 --max-tokens 4 --no-save   # quickest, starts vLLM (slow: make test-bench)

For each (level, model, mode) an engine starts and `align_to_engine(model, engine)` reads its rounding schedule and
takes its attention kernel's numerics (verified on 64 probe prompts). Then held-out prompts (after the probe's) are
sampled, `--samples` each at T=1, with the whole sampling distribution at every response position, and the engine
rescores the same sequences; the training side scores them stock and engine-aligned. Per side: response tokens
whose logprob is bitwise the engine's (as sampled, and as rescored), prompts with every token bitwise (with the exact
one-sided 95% bound on that share: `kl.all_equal_bound`), the exact KL(engine's sampling distribution || training)
per token (a term that is not finite is counted, `kl_nonfinite`, and makes the mean NaN: never skipped) and the largest
|logprob difference|. One criterion, `is_exact` in the renderer: every token bitwise as sampled and as rescored, and
every exact-KL term 0.

Writes tables/exactness.csv (and .json); rows of other CPUs are kept (a CPU, level, model and mode's rows are replaced),
so the table collects every CPU kind it was run on. The README's exactness section is rendered from it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pandas as pd

from rla_lib.machine import cpu_generation, cpu_model, isa_level, isa_levels, resolve_levels, vllm_cpu_attention_kernel
from rla_lib.paths import ROOT
from rla_lib.report import save_collected

TABLE = "exactness"
MODES = ("compiled", "eager")


def exactness_row(samples, prompt_of, rescored, training, full: bool, sampled: bool = True) -> dict:
    """The one exactness criterion's figures for a training side against the engine on the same sequences: response
    tokens bitwise as sampled (`samples`, drawn by this engine; `sampled=False` where it could not sample: re-scoring
    only) and as re-scored (`rescored`), prompts (`prompt_of` each sample) with every token bitwise and the exact bound
    on that share, the exact KL per token where whole distributions were kept (`full`; a term that is not finite is
    counted, `kl_nonfinite`, and makes the mean NaN: never skipped), and the largest |logprob difference|."""
    from rla_lib import kl

    per_token = []
    for prompt, sample, engine_scores, scored in zip(prompt_of, samples, rescored, training):
        start = len(sample.prompt_ids) - 1  # entry t scores token t + 1
        lp, dist = scored if full else (scored, None)
        again = engine_scores.token_logprobs[start:] == lp[start:]
        reference = sample.logprobs if sampled else engine_scores.token_logprobs[start:]
        terms = kl.exact_terms(sample.full, dist[start:]) if full and sampled else np.full(len(again), np.nan)
        per_token.append(pd.DataFrame(dict(prompt=prompt, sampled=reference == lp[start:], rescored=again, kl=terms,
                                           gap=np.abs(reference.astype(np.float64) - lp[start:]))))
    tokens = pd.concat(per_token)
    bitwise_prompts = tokens.groupby("prompt")[["sampled", "rescored"]].all().all(axis=1)
    return dict(tokens=len(tokens), sampled_bitwise=tokens.sampled.mean() if sampled else np.nan,
                rescored_bitwise=tokens.rescored.mean(), prompts_all_bitwise=int(bitwise_prompts.sum()),
                prompt_share_bound=kl.all_equal_bound(len(bitwise_prompts)) if bitwise_prompts.all() else np.nan,
                exact_kl=tokens.kl.mean(skipna=False), kl_all_zero=bool((tokens.kl == 0).all()) if sampled else None,
                kl_nonfinite=int((~np.isfinite(tokens.kl)).sum()) if full and sampled else 0, max_abs_gap=tokens.gap.max())


def score_sides(model_name: str, mode: str, prompts: int, samples: int, max_tokens: int, seed: int) -> list[dict]:
    """One engine: its samples and rescoring against the stock and the engine-aligned training side."""
    from rla_lib import task
    from rla_lib.engine import Engine
    from rla_lib.engine_align import align_to_engine, exactness
    from rla_lib.models import load_model
    from rla_lib.scoring import token_logprobs

    held_out = [p.prompt for p in task.load_split()[64 : 64 + prompts]]  # the probe takes the first 64
    rows = []
    with Engine(model_name, mode=mode) as engine:
        full = engine.spec.small_vocab  # whole distributions only where the vocabulary is small
        model = load_model(model_name)
        handle = align_to_engine(model, engine)
        schedule, report = handle.engine_schedule, exactness(handle.engine_schedule)
        handle.undo()
        groups = engine.sample(held_out, n=samples, max_tokens=max_tokens, seed=seed, full=full, progress=False)
        drawn = [(p, s) for p, group in enumerate(groups) for s in group]
        sequences = [s.ids for _, s in drawn]
        rescored = engine.score(sequences, progress=False)
        for side in ("stock", "engine-aligned"):
            handle = align_to_engine(model, schedule) if side == "engine-aligned" else None
            try:
                training = token_logprobs(model, sequences, full_vocab=full)
            finally:
                handle and handle.undo()
            rows.append(dict(model=model_name, mode=mode, side=side, prompts=prompts,
                             **exactness_row([s for _, s in drawn], [p for p, _ in drawn], rescored, training, full),
                             probe=report if side == "engine-aligned" else ""))
    return rows


def measure_here(models, modes, prompts: int, samples: int, max_tokens: int, seed: int) -> pd.DataFrame:
    rows = [r for m in models for mode in modes for r in score_sides(m, mode, prompts, samples, max_tokens, seed)]
    return pd.DataFrame(rows).assign(cpu=f"{cpu_model()} ({cpu_generation()})", level=isa_level(),
                                     vllm_attention_kernel=vllm_cpu_attention_kernel())


def measure_level(level: str, args) -> pd.DataFrame:
    """`measure_here` in a process capped to `level` (the machine's own level runs uncapped)."""
    cmd = [sys.executable, __file__, "--worker", "--models", *args.models, "--modes", *args.modes,
           "--prompts", str(args.prompts), "--samples", str(args.samples), "--max-tokens", str(args.max_tokens),
           "--seed", str(args.seed)]
    if level != isa_levels()[0]:
        cmd = [sys.executable, "-m", "rla_lib.machine", "--level", level, *cmd]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"the {level} run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return pd.DataFrame(json.loads(run.stdout.strip().splitlines()[-1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen2-tiny"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--levels", nargs="+", help="default: every level this CPU can run; native: its own")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:  # one level's rows, as JSON on the last line
        print(measure_here(args.models, args.modes, args.prompts, args.samples, args.max_tokens, args.seed)
              .to_json(orient="records"))
        return
    try:
        levels = resolve_levels(args.levels)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    new = pd.concat([measure_level(level, args) for level in levels], ignore_index=True)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(new.drop(columns=["probe"]).to_string(index=False))
    if args.save:
        params = dict(models=args.models, modes=args.modes, prompts=args.prompts, samples=args.samples,
                      max_tokens=args.max_tokens, seed=args.seed, levels=levels)
        save_collected(new, TABLE, ["cpu", "level", "model", "mode"], params)  # a run of some models keeps the others' rows


if __name__ == "__main__":
    main()
