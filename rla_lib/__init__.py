"""rla_lib: rounding-location alignment between vLLM and Transformers (the module map: rla_lib/README.md).

The names a user needs, importable from the package itself; each module loads on first use, so `import rla_lib`
stays cheap (no torch, Transformers or vLLM until a name is used):

    import rla_lib
    with rla_lib.aligned(model, rla_lib.REGIONS): ...     # the paper's three regions, in place, for the block
    rla_lib.align_to_engine(model, engine)                # or round where a running engine rounds (its schedule)
    run = rla_lib.measure("qwen3-tiny")                   # vLLM samples; every training side scores the same tokens
    rla_lib.mismatch_metrics(inference_lp, train_lp, mask)  # the mismatch in your own trainer (or MismatchCallback)
"""

import importlib

# `align` itself is not among them: `rla_lib.align` is the module (`from rla_lib.align import align`)

_EXPORTS = {
    "aligned": "align", "current": "align", "Schedule": "align", "preset": "align", "REGIONS": "align",
    "ALL_REGIONS": "align",
    "align_to_engine": "engine_align", "engine_schedule_for": "engine_align", "exactness": "engine_align",
    "Engine": "engine",
    "measure": "mismatch",
    "mismatch_metrics": "align", "MismatchMeter": "align", "MismatchCallback": "align",
    "load_model": "models", "load_tokenizer": "models", "resolve_model": "models",
    "GRPOConfig": "grpo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # loaded once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
