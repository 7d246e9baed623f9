"""The training arms compared in notebook 06a and the settings search (`experiments/grpo_sweep.py`), by name, and
running many of them: the GRPO loop itself (`rla_lib.grpo`) knows none of them.

    settings = configuration("all three", "qwen3-tiny")         # GRPOConfig keyword arguments
    runs = [(GRPOConfig(**settings, steps=50), out / run_name("all three", settings))]
    for cfg, out_dir, history in run_many(runs): ...            # one engine per (model, mode, dtype)
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence

from ..align import REGIONS
from ..align.monitor import TIS_CAP
from ..align.schedule import schedule_to_align_kwargs
from ..engine import Engine
from ..engine_align import engine_schedule_for
from ..grpo import run
from ..memory import release_memory
from ..paths import slug

# The configurations compared in notebook 06a and the settings search, by name.
CONFIGURATIONS = {
    "default BF16": dict(),
    "rope": dict(regions=("rope",)),
    "all three": dict(regions=REGIONS),
    "FP32 control": dict(precision="fp32"),
    "default BF16 + TIS": dict(tis_cap=2.0),
    "default BF16, 3-bit rollouts": dict(rollout_mantissa_bits=3),  # a deliberately larger mismatch
}
ENGINE_SCHEDULE = "engine schedule"  # aligned to the engine's own rounding schedule, attention included

# The dose axis of the mismatch study (issue 15): rollouts made deliberately worse in two unrelated ways while
# the trained policy stays BF16. Coarser weights (BF16 keeps 7 mantissa bits; FP8 E4M3 keeps 3) perturb every
# layer deterministically; logit noise perturbs only the sampler, at random. Each with and without TIS.
ROLLOUT_BITS = (3, 2, 1)
LOGIT_NOISE = (0.1, 0.3, 1.0)
TIS = " + TIS"


def dose_configurations(tis_cap: float = TIS_CAP) -> dict[str, dict]:
    """The dose arms by name: default BF16, then each dose, each also with truncated importance sampling."""
    arms = {"default BF16": {}}
    arms |= {f"default BF16, {b}-bit rollouts": dict(rollout_mantissa_bits=b) for b in ROLLOUT_BITS}
    arms |= {f"default BF16, logit noise {s:g}": dict(rollout_logit_noise=s) for s in LOGIT_NOISE}
    return arms | {name + TIS: dict(settings, tis_cap=tis_cap) for name, settings in arms.items()}


def configuration(name: str, model: str, engine_mode: str = "compiled") -> dict:
    """GRPOConfig settings of a named configuration: one of `CONFIGURATIONS` or `dose_configurations()`, or
    `ENGINE_SCHEDULE`, read for this model and engine mode on this machine (`rla_lib.engine_align.engine_schedule_for`:
    kept, or read and probed)."""
    if name == ENGINE_SCHEDULE:
        regions, options = schedule_to_align_kwargs(engine_schedule_for(model, engine_mode))
        return dict(regions=regions, align_options=options, engine_mode=engine_mode)
    named = CONFIGURATIONS | dose_configurations()
    if name not in named:
        raise ValueError(f"unknown configuration {name!r}; choose from {[*named, ENGINE_SCHEDULE]}")
    return named[name]


def run_name(name: str, settings: dict) -> str:
    """A run's folder name: the configuration's slug, plus a digest of the settings for `ENGINE_SCHEDULE`, whose
    settings follow the engine (another schedule read later is another run, not a resume)."""
    if name != ENGINE_SCHEDULE:
        return slug(name)
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True, default=list).encode()).hexdigest()[:8]
    return f"{slug(name)}-{digest}"


def run_many(runs, progress: bool | None = None, keep_going: bool = False):
    """Run `[(cfg, out_dir), ...]` in order, one engine per (model, mode, dtype) shared by the runs that need it.

    Yields `(cfg, out_dir, history)` as each run finishes. Given a list, an engine is closed as soon as no later run
    needs it, so the next precision's engine starts in this process (a second engine alongside needs processes of its
    own, tens of seconds more to start); a lazy iterable (the settings search claims runs as it goes) keeps them to the
    end. keep_going=True: a run that fails yields the exception in place of its history and the next run starts (its
    checkpoint is kept; the failed engine is replaced), so one bad run does not stop a sweep.
    """
    def key(cfg):
        return cfg.model, cfg.engine_mode, cfg.engine_dtype

    later = Counter(key(cfg) for cfg, _ in runs) if isinstance(runs, Sequence) else None
    engines = {}
    try:
        for cfg, out_dir in runs:
            k = key(cfg)
            try:
                if k not in engines:
                    engines[k] = Engine(cfg.model, mode=cfg.engine_mode, dtype=cfg.engine_dtype, seed=cfg.seed)
                release_memory()  # the previous run's weights and optimizer state
                history = run(cfg, out_dir, engine=engines[k], progress=progress)
            except Exception as error:
                if not keep_going:
                    raise
                engine = engines.pop(k, None)
                if engine is not None:
                    engine.close()
                history = error
            if later is not None:
                later[k] -= 1
                if not later[k] and k in engines:
                    engines.pop(k).close()
            yield cfg, out_dir, history
    finally:
        for engine in engines.values():
            engine.close()
