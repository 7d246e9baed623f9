"""One naming scheme for the sides that compute or score the same tokens, in measurements, graphs and tables:

- `vllm:<mode>`: the engine, mode "compiled" or "eager" (`engine`);
- `hf:bf16:<config>`: Transformers eager in BF16 under an alignment configuration, `none` = stock (`training`);
- `hf:fp32`: Transformers in FP32 (`FP32`), the zero-mismatch reference;
- `hf:compiled`: torch.compile of stock BF16 Transformers (`HF_COMPILED`), a third "engine" read by rla_lib.graphs.

A training configuration (regions and the schedule details of `rla_lib.align.schedule.DETAILS`, plus `fused`) is named
once too (`config_name`): details that act on none of its regions are left out, so two configurations that score alike
share a name and a cache file. `schedule_of` turns one into what `align` applies.

Keys are built here and never parsed back; display labels are made from them, not the other way round.
"""

from itertools import combinations

from .align import ALL_REGIONS, REGIONS, Alignment, Schedule, align
from .align.schedule import DETAILS, schedule_from_options

STOCK = "hf:bf16:none"
FP32 = "hf:fp32"
HF_COMPILED = "hf:compiled"


def engine(mode: str) -> str:
    return f"vllm:{mode}"


def sampled(mode: str) -> str:
    """The engine's logprobs of the tokens it sampled, as its sampler returned them (after temperature, top-k and
    top-p: what a trainer gets back with the rollouts); `engine(mode)` is the same tokens re-scored, untruncated."""
    return f"vllm:{mode}:sampled"


def training(config: str = "none") -> str:
    return f"hf:bf16:{config}"


# Which regions each option acts on (an option is inert without its regions): two configurations that differ only in
# inert options score identically, so they share a name and a cache file. `fused` is how the schedule runs, not where
# it rounds (same bits), but runs are named with it.
OPTION_REGIONS = {name: regions for name, (_, _, regions) in DETAILS.items()}
OPTION_REGIONS["fused"] = ("rope", "swiglu")
_DEFAULTS = {name: default for name, (default, _, _) in DETAILS.items()} | {"fused": False}


def canonical_config(regions, options=None) -> tuple[tuple[str, ...], dict]:
    """(regions in `ALL_REGIONS` order, only the options that differ from their default and act on those regions)."""
    regions = tuple(regions)
    unknown = sorted(set(regions) - set(ALL_REGIONS)) + sorted(set(options or {}) - set(OPTION_REGIONS))
    if unknown:
        raise ValueError(f"unknown region(s) or option(s) {unknown}")
    kept = {k: v for k, v in sorted((options or {}).items()) if v != _DEFAULTS[k] and set(OPTION_REGIONS[k]) & set(regions)}
    return tuple(r for r in ALL_REGIONS if r in regions), kept


def schedule_of(regions, options=None) -> tuple[Schedule, bool]:
    """A configuration's (`Schedule`, fused), as `align` takes them."""
    options = dict(options or {})
    fused = options.pop("fused", False)
    return schedule_from_options(regions, **options), fused


def align_config(model, regions, options=None, **kwargs) -> Alignment:
    """`align(model, ...)` for a configuration (regions, options); `kwargs` as `align` takes them."""
    applied, fused = schedule_of(regions, options)
    return align(model, applied, fused=fused, **kwargs)


def config_name(regions, **options) -> str:
    """A training configuration's name: regions joined by '+' ('none' for stock), then '|option=value' for
    each non-default option that acts on those regions (`config_name(("rope",), rope_cos_sin="bf16")`)."""
    name = "+".join(regions) if regions else "none"
    _, kept = canonical_config(regions, options) if options else ((), {})
    return name + "".join(f"|{k}={v}" for k, v in kept.items())


def all_configs(regions) -> list[tuple[str, ...]]:
    """Every subset of the regions, smallest first: the rows of the paper's Table 1."""
    return [c for r in range(len(regions) + 1) for c in combinations(regions, r)]


def paper_configs() -> dict[str, tuple[tuple[str, ...], dict]]:
    """The paper's Table 1 rows (every subset of the regions), RoPE in both cos/sin readings:
    FP32 (this project's reading of the paper) and BF16 (vLLM's cos/sin cache)."""
    configs = {config_name(c): (c, {}) for c in all_configs(REGIONS)}
    return configs | {config_name(c, rope_cos_sin="bf16"): (c, {"rope_cos_sin": "bf16"}) for c in all_configs(REGIONS) if "rope" in c}
