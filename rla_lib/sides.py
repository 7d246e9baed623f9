"""One naming scheme for the sides that compute or score the same tokens, in measurements, graphs and tables:

- `vllm:<mode>`: the engine, mode "compiled" or "eager" (`engine`);
- `hf:bf16:<config>`: Transformers eager in BF16 under an alignment configuration, `none` = stock (`training`);
- `hf:fp32`: Transformers in FP32 (`FP32`), the zero-mismatch reference;
- `hf:compiled`: torch.compile of stock BF16 Transformers (`HF_COMPILED`), a third "engine" read by rla_lib.graphs.

A training configuration (regions and `rla_lib.align` options) is named once too (`config_name`): options that act
on none of its regions are left out, so two configurations that score alike share a name and a cache file.

Keys are built here and never parsed back; display labels are made from them, not the other way round.
"""

from itertools import combinations

from .align import ALL_REGIONS, REGIONS, AlignOptions

STOCK = "hf:bf16:none"
FP32 = "hf:fp32"
HF_COMPILED = "hf:compiled"


def engine(mode: str) -> str:
    return f"vllm:{mode}"


def training(config: str = "none") -> str:
    return f"hf:bf16:{config}"


# Which regions each rla_lib.align option acts on (an option is inert without its regions): two
# configurations that differ only in inert options score identically, so they share a name and a cache file.
OPTION_REGIONS = {"rope_cos_sin": ("rope",), "rope_qk_norm": ("rope",), "rope_rounding": ("rope",), "norm_weight": ("residual_norm",),
                  "residual_stream": ("residual_norm",), "fused": ("rope", "swiglu"), "attention": ("attention",),
                  "rms_sum": ("rope", "residual_norm")}


def canonical_config(regions, options=None) -> tuple[tuple[str, ...], dict]:
    """(regions in `ALL_REGIONS` order, only the options that differ from their default and act on those regions)."""
    regions = tuple(regions)
    unknown = sorted(set(regions) - set(ALL_REGIONS)) + sorted(set(options or {}) - set(OPTION_REGIONS))
    if unknown:
        raise ValueError(f"unknown region(s) or option(s) {unknown}")
    defaults = AlignOptions()
    kept = {k: v for k, v in sorted((options or {}).items())
            if v != getattr(defaults, k) and set(OPTION_REGIONS[k]) & set(regions)}
    return tuple(r for r in ALL_REGIONS if r in regions), kept


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
