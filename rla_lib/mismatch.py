"""One measurement run: vLLM samples responses, then every side scores the same tokens.

    run = measure("qwen3-tiny", modes=("compiled", "eager"))           # STANDARD sizes: 512 prompts x 2
    run.estimate("vllm:compiled", "hf:bf16:none", "exact")              # a kl.Estimate, prompt-level CI
    run.difference("vllm:compiled", "hf:bf16:none", "hf:bf16:rope+swiglu+residual_norm")   # paired change
    run.save(path); MismatchRun.load(path)

Sides are named as everywhere (`rla_lib.sides`): `vllm:<mode>` (the engine), `hf:bf16:<config>` (Transformers
BF16, stock when the config is `none`, else aligned with those regions) and `hf:fp32` (Transformers FP32). Only response
tokens are kept: they are what a policy-gradient update uses. Full next-token distributions are kept
where the vocabulary is small; otherwise only the scored tokens' logprobs, and the exact KL of each
(engine mode, training side) pair is computed with the engine running, chunk by chunk over positions
(`rla_lib.exact_kl`), and kept as per-token terms. Each sequence keeps the
index of the held-out prompt it answers: the prompt is the unit of every error bar (`rla_lib.kl`).

One shared measurement: `measure` caches in layers, so notebooks asking for the same (model, engine
mode, training configuration) get the same arrays. The sampled responses are keyed by the model, the
scoring code, the sampling mode (the first of `modes`) and the sizes; each engine mode's scores and
each training side are then separate files in that folder, keyed by what they depend on (a training
side by its regions and options, not its name). A later call scores only what is missing. The result is a
`mismatch_run.MismatchRun`; the cache's keys and layers are `mismatch_cache`'s, configuration names `sides`'.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pandas as pd

from . import kl, sides, task
from .align import REGIONS
from .engine import Engine, check_truncation, default_context
from .exact_kl import exact_kl
from .graphs import capturing
from .machine import machine
from .mismatch_cache import (cache_folder, copy_side, load_or_sample, load_or_score_exact, load_or_score_side,
                             load_side, sample_key, side_file)
from .mismatch_run import MismatchRun
from .models import load_model, load_tokenizer, resolve_model
from .paths import RESULTS_DIR
from .progress import bar
from .prompts import check_room, prompt_ids
from .sides import align_config, all_configs, canonical_config, config_name
from .scoring import token_logprobs

# Default sizes for a trustworthy headline: many distinct prompts (the whole held-out split, the
# independent unit of the error bars) and two responses each, rather than many samples of few prompts.
STANDARD = dict(n_prompts=512, n_samples=2, max_tokens=32, seed=0)




# ---- measuring ----------------------------------------------------------------------------------
def sample_responses(engine, n_prompts: int, n_samples: int, max_tokens: int, temperature: float, seed: int,
                     progress: bool | None = None, prompts: list[list[int]] | None = None, top_p: float = 1.0,
                     top_k: int = 0):
    """Responses sampled by the engine: sequences, response starts, rewards, the prompt each answers (its index
    into the held-out split, or into `prompts`, the caller's token ids: their rewards are NaN, nothing checks them),
    and the sampler's logprob of each response token (after temperature, top_k and top_p)."""
    problems = task.load_split() if prompts is None else None
    if problems is not None and n_prompts > len(problems):
        raise ValueError(f"n_prompts={n_prompts}, but the held-out split has {len(problems)} problems")
    inputs = [p.prompt for p in problems[:n_prompts]] if prompts is None else prompts
    forced = {} if progress is None else {"progress": progress}  # None: the engine's default (bars in a kernel)
    truncation = {k: v for k, v in dict(top_p=top_p, top_k=top_k).items() if v not in (1.0, 0)}
    groups = engine.sample(inputs, n=n_samples, max_tokens=max_tokens, temperature=temperature, seed=seed,
                           **truncation, **forced)
    samples = [(i, s) for i, g in enumerate(groups) for s in g if s.response_ids]
    rewards = [np.nan if problems is None else task.reward(problems[i], s.text) for i, s in samples]
    return ([s.ids for _, s in samples], [s.response_start for _, s in samples], np.array(rewards, np.float64),
            np.array([i for i, _ in samples], np.int64), [s.logprobs for _, s in samples])


def _temperature_kwargs(temperature: float) -> dict:
    """Scorers get the sampling temperature only when it is not 1 (at 1 both score bit for bit as without it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return {} if temperature == 1.0 else {"temperature": temperature}


def score_training_side(run: MismatchRun, model, side: str, full: bool, temperature: float = 1.0) -> None:
    res = token_logprobs(model, run.sequences, full_vocab=full, **_temperature_kwargs(temperature))
    run.add(side, [r[0] for r in res] if full else res, [r[1] for r in res] if full else None)


def _score_engine_modes(run, model, modes, folder, key, full, temperature, progress, prompts=None,
                        exact_scorers=None, on_engine=None) -> MismatchRun:
    """Sample with the first mode (unless cached), then add every mode's scores (each cached on its own); with
    `exact_scorers` (a large vocabulary) also each mode's exact KL against those training sides, with the same
    engine. An engine starts once per mode, and only where something of that mode is not cached."""
    t_kwargs = _temperature_kwargs(temperature)
    for mode in bar(modes, progress, desc="vLLM modes", leave=False):
        side, path = sides.engine(mode), None if folder is None else folder / f"vllm-{mode}.npz"
        with ExitStack() as stack:
            running = []  # this mode's engine, once started: its scores and its exact KL share it

            def engine():
                if not running:
                    running.append(stack.enter_context(Engine(model, mode=mode, seed=key["seed"])))
                    if on_engine is not None:
                        on_engine(running[0])
                return running[0]

            if run is None:  # the first mode samples; its sampler's logprobs are kept as their own side
                def sampled_run():
                    *responses, logprobs = sample_responses(
                        engine(), key["n_prompts"], key["n_samples"], key["max_tokens"], temperature, key["seed"],
                        progress, prompts, key.get("top_p", 1.0), key.get("top_k", 0))
                    run = MismatchRun(*responses, meta=dict(key) | {"machine_info": machine()})
                    run.add(sides.sampled(mode), [np.concatenate([np.zeros(start, np.float32), lp])
                                                  for start, lp in zip(run.starts, logprobs)])
                    return run

                run = load_or_sample(folder, sampled_run, keep=(sides.sampled(mode),))
            if not load_side(run, side, path):
                def score(run, side):
                    scores = engine().score(run.sequences, full_vocab=full, progress=progress, **t_kwargs)
                    run.add(side, [s.token_logprobs for s in scores], [s.full for s in scores] if full else None)

                load_or_score_side(run, side, path, score)
            if exact_scorers:
                _exact_at_large_vocab(run, model, mode, engine, exact_scorers, folder, temperature, progress)
    return run


def _score_training_sides(run, model, scorers: dict, folder, full, temperature, progress=None) -> None:
    """Add every training side (side -> (dtype, regions, options)); the model of a dtype is loaded only if some
    side of it must be scored."""
    loaded, done = {}, {}
    for side, (dtype, regions, options) in bar(scorers.items(), progress, total=len(scorers), desc="training sides", leave=False):
        path = side_file(folder, dtype, regions, options)
        identity = (dtype, json.dumps(canonical_config(regions, options)))
        if identity in done:
            copy_side(run, done[identity], side)
            continue

        def score(run, side):
            if dtype not in loaded:
                loaded[dtype] = load_model(model, dtype=dtype)
            handle = align_config(loaded[dtype], tuple(regions), options) if dtype == "bfloat16" else None
            try:
                score_training_side(run, loaded[dtype], side, full, temperature)
            finally:
                if handle is not None:
                    handle.undo()

        load_or_score_side(run, side, path, score)
        done[identity] = side


def _exact_at_large_vocab(run, model, mode, engine, scorers: dict, folder, temperature, progress=None) -> None:
    """The exact KL of engine `mode` against every training side where whole distributions are too large to keep:
    the engine's hidden states once, then each training side chunk by chunk. `engine()`: that mode's engine (started
    on first use, so only if some pair is not cached)."""
    inference, hidden, loaded = sides.engine(mode), None, {}
    for side, (dtype, regions, options) in scorers.items():
        path = None if folder is None else folder / f"exact-{mode}-{side_file(folder, dtype, regions, options).name}"

        def score():
            nonlocal hidden
            if hidden is None:
                hidden = engine().prompt_hidden(run.sequences, progress)
            if dtype not in loaded:
                loaded[dtype] = load_model(model, dtype=dtype)
            handle = align_config(loaded[dtype], tuple(regions), options) if dtype == "bfloat16" else None
            try:
                res = exact_kl(engine(), loaded[dtype], run.sequences, run.starts, temperature=temperature,
                               engine_hidden=hidden)
            finally:
                if handle is not None:
                    handle.undo()
            return np.concatenate(res.terms)  # exact_kl starts each sequence at its response

        load_or_score_exact(run, inference, side, path, score)


def measure(
    model: str = "qwen3-tiny",
    modes=("compiled", "eager"),
    training_configs: dict | None = None,
    n_prompts: int = STANDARD["n_prompts"],
    n_samples: int = STANDARD["n_samples"],
    max_tokens: int = STANDARD["max_tokens"],
    temperature: float = 1.0,
    seed: int = STANDARD["seed"],
    fp32_reference: bool = True,
    cache_dir: Path | None = RESULTS_DIR / "mismatch",
    progress: bool | None = None,
    prompts: list | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
) -> MismatchRun:
    """Sample with the first engine mode, score with every mode and every training configuration.

    training_configs maps a name to (regions, align options); by default the 8 subsets of the three
    regions with the paper's options. With cache_dir set, the sampled responses, each engine mode's
    scores and each training side are cached separately (see the module docstring): a call with other
    modes or configurations reuses what is there and scores only what is missing. Two names with the
    same (regions, options) get the same arrays. cache_dir=None: no caching.
    temperature != 1: both the engine and Transformers score softmax(logits / T), the distribution the
    engine sampled from. top_p < 1 or top_k > 0 truncate the sampling distribution; every side still scores the full
    one (what a trainer scores), and the sampler's own logprobs are kept as `sides.sampled(modes[0])`.
    progress: bars over the engine modes and training sides, and vLLM's own while it samples and scores
    (None: only in a Jupyter kernel, see `rla_lib.progress`).
    prompts: your own prompts instead of the task's held-out split (n_prompts is then their number): per prompt a
    text, a chat (a list of {"role", "content"} messages: the checkpoint's chat template applied) or token ids; see
    `rla_lib.prompts` (and `read_prompts` for a JSON-lines file). Their rewards are NaN.
    An engine starts only for what is not cached; one that starts also leaves its mode's graph capture where this
    machine has none yet (`graphs.capturing`: notebook 03a's reading, without an engine start of its own).
    """
    _temperature_kwargs(temperature)  # fail before any engine starts
    check_truncation(top_p, top_k)
    spec = resolve_model(model)
    if prompts is not None:  # rendered and checked here, before any engine starts
        prompts = prompt_ids(prompts, load_tokenizer(spec), spec.name)
        check_room(prompts, max_tokens, default_context(spec))
        n_prompts = len(prompts)
    if training_configs is None:
        training_configs = {config_name(c): (c, {}) for c in all_configs(REGIONS)}
    key = sample_key(spec.path, sides.engine(modes[0]), n_prompts, n_samples, max_tokens, temperature, seed, prompts,
                     top_p, top_k)
    folder = cache_folder(cache_dir, key)
    full = spec.small_vocab
    samples = None if folder is None else folder / "samples.npz"
    run = MismatchRun.load(samples) if samples is not None and samples.exists() else None
    scorers = {sides.training(name): ("bfloat16", tuple(regions), dict(options)) for name, (regions, options) in training_configs.items()}
    if fp32_reference:
        scorers[sides.FP32] = ("float32", (), {})
    # at a large vocabulary each mode's engine also gives the exact KL against every side, before it closes
    with capturing(spec.path, modes) as capture:
        run = _score_engine_modes(run, spec, modes, folder, key, full, temperature, progress, prompts,
                                  exact_scorers=None if full else scorers, on_engine=capture)
    _score_training_sides(run, spec, scorers, folder, full, temperature, progress)
    run.meta = dict(run.meta) | {"modes": list(modes), "fp32": fp32_reference,
                                 "configs": {k: [list(v[0]), dict(v[1])] for k, v in training_configs.items()}}
    return run


def table(run: MismatchRun, inference: str, trainings, estimators=("sampled", "k3", "exact"), n_boot: int = 2000, seed: int = 0):
    """One row per training side: each estimator's value, se and 95% CI (1e-4, prompt-level), tokens, prompts."""
    rows = []
    for side in trainings:
        est = kl.compare(run.pairs(inference, side), estimators=estimators, clusters=run.prompts, n_boot=n_boot, seed=seed)
        row = {"training side": side}
        for e, v in est.items():
            row |= {f"{e}": v.value, f"{e} se": v.se, f"{e} ci_low": v.ci_low, f"{e} ci_high": v.ci_high}
        first = next(iter(est.values()))
        row |= {"tokens": first.n_tokens, "prompts": first.n_clusters}
        rows.append(row)
    return pd.DataFrame(rows).set_index("training side")
