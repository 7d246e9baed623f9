"""The arithmetic of a Qwen2/Qwen3 decoder layer, written once, with its rounding points named.

Eager Transformers rounds to the model dtype after every op; an engine's fused kernels keep some of those values in
FP32. Each value Transformers rounds is a *rounding point* (`POINTS`, in the order a layer computes them), and a
`Rounding` policy says per point whether the value is rounded (to nearest, or toward zero as vLLM-CPU's builds without
AVX512-BF16 convert) or kept in FP32, and may record the FP32 value just before it is rounded:

- stock: every point rounded. Where an op's inputs are in the model dtype it runs as Transformers runs it, so the
  forward and the backward are the stock ones, bit for bit;
- aligned (`rla_lib.align`): a region is the set of points it keeps in FP32 (`rounding_policy`);
- recording (`rla_lib.studies.prerounding`): a policy with `record`, called at every point it rounds;
- replaying (`rla_lib.studies.op_check`): a policy with `replay`, which may put another value (an engine's own, for
  teacher forcing) in place of the rounded one at every point.

`rla_lib.align` binds these functions into the modules' forwards (its part: caches, masks, Transformers releases);
the Qwen layer's ops are written here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import sdpa_cpu_unrounded, truncate_to_bf16
from .vector_sums import square_sum, straight_through

POINTS = ("input_norm.rsqrt", "input_norm.weight", "q_proj", "k_proj", "v_proj", "q_norm.rsqrt", "q_norm.weight",
          "k_norm.rsqrt", "k_norm.weight", "rope.q_cos", "rope.q_sin", "rope.q_sum", "rope.k_cos", "rope.k_sin",
          "rope.k_sum", "attention", "o_proj", "residual_attn", "post_norm.rsqrt", "post_norm.weight", "gate_proj",
          "up_proj", "silu", "swiglu", "down_proj", "residual_mlp")
FINAL_POINTS = ("final_norm.rsqrt", "final_norm.weight")  # the model's last norm, after the layers


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


def rounding_policy(regions, options, layer=None, record=None, replay=None) -> Rounding:
    """The points `align`'s regions keep in FP32, under its `options` (rope_qk_norm, rope_rounding, norm_weight)."""
    keep, truncate = set(), set()
    if "rope" in regions:
        keep |= {"rope.q_cos", "rope.q_sin", "rope.k_cos", "rope.k_sin"}
        if options.rope_qk_norm == "fp32":
            keep |= {"q_norm.rsqrt", "q_norm.weight", "k_norm.rsqrt", "k_norm.weight"}
        if options.rope_rounding == "truncate":
            truncate |= {"rope.q_sum", "rope.k_sum"}
    if "swiglu" in regions:
        keep.add("silu")
    if "residual_norm" in regions:
        keep |= {"residual_attn", "residual_mlp"}
        if options.norm_weight == "fp32":
            keep |= {"input_norm.rsqrt", "post_norm.rsqrt", "final_norm.rsqrt"}
    return Rounding(frozenset(keep), frozenset(truncate), record, layer, replay)


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


def residual_sum(residual: torch.Tensor, update: torch.Tensor, point: str, rounding: Rounding,
                 stream: str = "bf16") -> torch.Tensor:
    """residual + a sublayer's output (point `residual_attn` or `residual_mlp`). `residual` is the stream carried from
    the previous add (or the embeddings): rounded at every add (`stream="bf16"`, as Transformers and vLLM carry it) or
    never (`"fp32"`: compiled vLLM on CPU)."""
    if stream == "bf16":
        residual = residual.to(update.dtype)
    return rounding.at(point, torch.add, residual, update, dtype=update.dtype)
