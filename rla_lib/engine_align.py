"""Align the training side to an engine in one call: its rounding schedule read from its code, attention from its kernel.

    handle = align_to_engine(model, engine)            # a running Engine, compiled or eager
    handle = align_to_engine(model, "schedule.json")   # or a saved schedule (rla_lib.align.align_to_engine: no vLLM)
    handle.undo()                                      # stock again, bit for bit

The schedule's points come from `rla_lib.graphs`: the engine's inductor output code (compiled) or its aten
trace (eager), captured once per model, mode and machine and cached under results/graphs. Attention is one
opaque kernel, invisible there. On vLLM-CPU (x86) its numerics are those of the kernel of the library the
engine loaded (`attention.VLLM_CPU_BUILDS`, read from vLLM's C++ sources); elsewhere (CUDA) `probe_attention`
picks them end to end: the engine scores held-out task sequences, the training side aligned to the schedule
scores the same tokens with each of `rla_lib.align`'s attention numerics, and the closest is kept. Either way
the probe records, for each numerics, its distance (exact KL per token at a small vocabulary, mean |logprob
difference| otherwise) and how many tokens are bitwise the engine's; `exactness` says it in words. The choice
and its evidence go into the schedule's "attention" section, so a saved schedule carries them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import kl, sides, task
from . import align as fix
from .align import refuse_if_aligned, unalign
from .align.attention import KERNELS, VLLM_CPU_BUILDS
from .align.schedule import load_schedule, save_schedule, schedule_to_align_kwargs
from .engine import Engine
from .graphs import GRAPHS_DIR, capturing, model_key, read_sides, schedule
from .machine import machine_key, vllm_cpu_attention_kernel
from .models import load_model
from .scoring import token_logprobs

ATTENTION_NUMERICS = tuple(KERNELS)


def probe_sequences(engine: Engine, n: int = 64, max_tokens: int = 32, seed: int = 0) -> list[list[int]]:
    """Held-out task prompts with one response each, sampled by the engine (T=1)."""
    prompts = [p.prompt for p in task.load_split()[:n]]
    return [g[0].ids for g in engine.sample(prompts, n=1, max_tokens=max_tokens, seed=seed, progress=False)]


def closeness(engine_scores, training_scores, full: bool) -> float:
    """How far the training side is from the engine on the same tokens: exact KL(engine || training) per
    token (full distributions), else mean |logprob difference| of the scored tokens."""
    if full:
        return float(np.mean(np.concatenate([kl.exact_terms(e.full, t[1]) for e, t in zip(engine_scores, training_scores)])))
    return float(np.mean(np.abs(np.concatenate([e.token_logprobs - t for e, t in zip(engine_scores, training_scores)]))))


def probe_attention(engine: Engine, model, regions, options: dict, sequences, candidates=ATTENTION_NUMERICS) -> dict:
    """Each attention numerics of `candidates` on top of (regions, options) against the engine on the same tokens: how
    far (exact KL per token, or mean |logprob difference| at a large vocabulary) and how many scored tokens are bitwise
    the engine's; "numerics" is the closest."""
    full = engine.spec.small_vocab
    engine_scores = engine.score(sequences, full_vocab=full, progress=False)
    engine_lp = np.concatenate([e.token_logprobs for e in engine_scores])
    distance, bitwise = {}, {}
    for numerics in candidates:
        handle = sides.align_config(model, (*regions, "attention"), options | {"attention": numerics})
        try:
            training = token_logprobs(model, sequences, full_vocab=full)
        finally:
            handle.undo()
        distance[numerics] = closeness(engine_scores, training, full)
        bitwise[numerics] = int((np.concatenate([t[0] if full else t for t in training]) == engine_lp).sum())
    return {"numerics": min(distance, key=distance.get), "distance": distance, "bitwise": bitwise,
            "measure": "exact KL per token" if full else "mean |logprob difference|",
            "sequences": len(sequences), "tokens": len(engine_lp),
            "how": "probed end to end (rla_lib.engine_align.probe_attention): the closest numerics"}


def probe_run_evidence(probe, mode: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """`probe_attention`'s evidence from a measurement already made (a `mismatch_run.MismatchRun` of the probe prompts that
    scored each schedule with each attention numerics, sides `schedule_<mode>+attention_<numerics>`): exact KL per token
    (1e-4) against the engine and tokens bitwise, per numerics; "numerics" the closest."""
    engine = sides.engine(mode)
    trained = {a: sides.training(f"schedule_{mode}+attention_{a}") for a in ATTENTION_NUMERICS}
    distance = {a: float(probe.estimate(engine, t, "exact", n_boot=n_boot, seed=seed).value) for a, t in trained.items()}
    bitwise = {a: int((probe.token_lp[engine] == probe.token_lp[t]).sum()) for a, t in trained.items()}
    return dict(numerics=min(distance, key=distance.get), distance=distance, bitwise=bitwise,
                measure="exact KL per token, 1e-4 (probe prompts)", tokens=len(probe.token_lp[engine]),
                sequences=len(probe.prompts), how="closest on the probe prompts of a measurement")


def attention_section(found: dict) -> dict:
    """The attention numerics an engine schedule takes, from a probe's evidence `found` (`probe_attention`'s fields, or
    none): the kernel the engine loaded where it is known (the probe, if any, verifies it), else the probe's closest.
    The one criterion, whoever measured the probe (`engine_schedule`, notebook 03b)."""
    known = kernel_numerics()
    if known:
        return found | {"numerics": known, "how": f"vLLM-CPU's {vllm_cpu_attention_kernel()} attention kernel, the "
                        "library the engine loaded (rla_lib.machine.vllm_cpu_attention_kernel)"
                        + (", verified on the probe" if found else "")}
    if not found:
        raise ValueError("the engine's attention kernel is not known here (not vLLM-CPU on x86): probe it")
    return found


def kernel_numerics() -> str | None:
    """The numerics reproducing the attention kernel a vLLM-CPU engine started here runs (read from the library it
    loads), or None where there is none (CUDA: an opaque kernel, probed instead)."""
    return None if torch.cuda.is_available() else VLLM_CPU_BUILDS.get(vllm_cpu_attention_kernel())


def exactness(sched: dict) -> str:
    """How exact the schedule's training side was on its probe, in words: "exact" only when every probe token was
    bitwise the engine's."""
    attention = sched.get("attention", {})
    numerics, bitwise = attention.get("numerics"), attention.get("bitwise", {})
    if numerics not in bitwise:
        return f"attention {numerics}: not probed, exactness unknown (align_to_engine with a running Engine probes it)"
    n, equal, gap = attention["tokens"], bitwise[numerics], attention["distance"][numerics]
    if equal == n and gap == 0:
        return f"exact on the probe: {n:,} of {n:,} tokens bitwise the engine's, {attention['measure']} 0 (attention {numerics})"
    return (f"not exact: {equal:,} of {n:,} probe tokens bitwise ({equal / n:.1%}), {attention['measure']} {gap:.3g} "
            f"(attention {numerics}); rla_lib.op_check finds the op that differs")


def with_attention(sched: dict, numerics: str, **evidence) -> dict:
    """The schedule with its attention section (how the numerics were chosen goes in `evidence`)."""
    if numerics not in ATTENTION_NUMERICS:
        raise ValueError(f"attention numerics must be one of {ATTENTION_NUMERICS}, got {numerics!r}")
    return sched | {"attention": {"numerics": numerics, **evidence}}


def with_rope_rounding(sched: dict, mode: str) -> dict:
    """The schedule with how the engine's rotary embedding rounds the rotated Q and K, where it is not to nearest:
    eager vLLM-CPU calls its C++ rotary kernel (csrc/cpu/pos_encoding.cpp), which converts its FP32 result to BF16
    toward zero in the builds without AVX512-BF16 (`machine.vllm_cpu_attention_kernel()` "avx512" or "avx2"); compiled,
    the rotary is inductor's code, which rounds to nearest, as CUDA kernels do."""
    build = vllm_cpu_attention_kernel()
    if mode != "eager" or torch.cuda.is_available() or build not in ("avx512", "avx2"):
        return sched
    return sched | {"rope_rounding": {"rounding": "truncate", "how": f"vLLM-CPU's {build} build, eager rotary kernel"}}


def vllm_cos_sin_cache(config) -> torch.Tensor:
    """vLLM's rotary cos/sin cache for a Qwen config, as its RotaryEmbedding builds it: FP32 frequencies and
    angles, cos and sin concatenated, rounded once to BF16 (max_position_embeddings x head_dim)."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.einsum("i,j -> ij", torch.arange(config.max_position_embeddings, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), -1).to(torch.bfloat16)


def cos_sin_equal(model) -> bool:
    """Whether vLLM's BF16 cos/sin cache equals the stock Transformers model's BF16 cos/sin, bit for bit."""
    config = model.config
    cache = vllm_cos_sin_cache(config)
    half = cache.shape[-1] // 2
    positions = torch.arange(config.max_position_embeddings)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), positions)
    return torch.equal(cache[:, :half], cos[0, :, :half]) and torch.equal(cache[:, half:], sin[0, :, :half])


def engine_schedule(engine: Engine, model=None, probe: bool = True, n_sequences: int = 64, force: bool = False) -> dict:
    """The rounding schedule of a running engine: points read from its code or trace (cached capture of the same
    model and mode on this machine), plus its attention numerics probed against `model` (default: loaded here)."""
    sched = code_schedule(engine.spec.path, engine.mode, force)
    model = load_model(engine.spec.path, dtype=engine.dtype) if model is None and probe else model
    known = kernel_numerics()
    found = {}
    if probe:
        regions, options = schedule_to_align_kwargs(sched)
        # a known kernel is verified (one scoring pass), an unknown one chosen among all numerics
        found = probe_attention(engine, model, regions, options, probe_sequences(engine, n_sequences),
                                (known,) if known else ATTENTION_NUMERICS)
    return with_attention(sched, **attention_section(found))


def code_schedule(model, mode: str, force: bool = False) -> dict:
    """The engine's rounding points for (model, mode), read from its code or trace (one capture, kept on this
    machine), without attention's numerics (one opaque kernel there)."""
    side = sides.engine(mode)
    points, _ = read_sides(model, (side,), force=force, progress=False)
    return with_rope_rounding(schedule(points[side], side), mode)


def engine_schedule_path(model, mode: str) -> Path:
    """Where the engine's full schedule for (model, mode) on this machine is kept (BF16 kernels differ by machine)."""
    return GRAPHS_DIR / model_key(model) / f"engine-schedule-{mode}-{machine_key()}.json"


def keep_engine_schedule(sched: dict, model, mode: str) -> Path:
    """Keep `sched` as the engine's full schedule for (model, mode) on this machine (the one writer of that file)."""
    return save_schedule(sched, engine_schedule_path(model, mode))


def engine_schedule_for(model, mode: str = "compiled", **schedule_kwargs) -> dict:
    """The engine's full schedule for (model, mode): the one kept on this machine (notebook 03b or an earlier call),
    else read and probed now (one engine start) and kept."""
    path = engine_schedule_path(model, mode)
    if path.exists():
        return load_schedule(path)
    sched = started_engine_schedule(model, mode, **schedule_kwargs)
    keep_engine_schedule(sched, model, mode)
    return sched


def started_engine_schedule(model, mode: str, force: bool = False, **schedule_kwargs) -> dict:
    """`engine_schedule` of an engine of (model, mode) started for it: one start, which also makes the capture the
    schedule is read from (`graphs.capturing`; force=True captures afresh, with an engine of its own)."""
    with capturing(model, () if force else (mode,)) as capture, Engine(model, mode=mode) as engine:
        capture(engine)
        return engine_schedule(engine, force=force, **schedule_kwargs)


def engine_schedule_from_code(model, mode: str = "compiled") -> dict:
    """The engine's full schedule for (model, mode) without a probe where none is needed: the one kept on this machine,
    else its code's points with the attention kernel the engine loads (vLLM-CPU: known from its library, not verified
    here, so `exactness` says "not probed"). Where that kernel is not known (CUDA), `engine_schedule_for` probes it."""
    if engine_schedule_path(model, mode).exists() or kernel_numerics() is None:
        return engine_schedule_for(model, mode)
    return with_attention(code_schedule(model, mode), **attention_section({}))


def align_to_engine(model, source, replace: bool = False, **schedule_kwargs):
    """`rla_lib.align.align_to_engine`, where `source` may also be a running `Engine`: its schedule is read from its code
    and its attention numerics probed on `model` (stock for the probe; `schedule_kwargs` go to `engine_schedule`).
    `exactness(handle.engine_schedule)` says how exact it was on the probe."""
    refuse_if_aligned(model, replace)
    if isinstance(source, Engine):
        unalign(model)
        source = engine_schedule(source, model, **schedule_kwargs)
    return fix.align_to_engine(model, source, replace=replace)
