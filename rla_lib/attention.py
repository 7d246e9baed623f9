"""Attention as an inference engine computes it: the kernels of `rla_lib.align`'s "attention" region.

Transformers' eager attention rounds the scores q·kᵀ·scale (+ mask) and the probabilities P to the model
dtype; SDPA on CPU is a fused kernel of its own. Engines' attention kernels (vLLM's CPU attention,
flash-attention style kernels) read the BF16 q/k/v, keep scores, softmax and P·V in FP32 and round the
output once. The kernels here have the signature of Transformers' attention functions (those of
`AttentionInterface`), so `align` calls them in place of the one the model was loaded with:

- `fp32_attention`: scores, softmax and P·V in FP32, the output rounded once to the model dtype.
- `flash_attention`: the same in FP32 in the order of vLLM's CPU attention kernel: q scaled before q·kᵀ,
  exp(s - max)·V unnormalised, divided by the row sum at the end (as online-softmax kernels do), rounded once.
- `p_bf16_attention`: the same, with P rounded to the model dtype before P·V.
- `eager_attention`: Transformers' eager attention (the model family's `eager_attention_forward`).

Each reads the mask Transformers built for the model's `attn_implementation` and adds it as eager
attention does (see `additive_mask`); sliding windows and padding are in that mask. The engine has no
attention dropout, so the kernels refuse a non-zero one.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import repeat_kv  # the same function in modeling_qwen2


def additive_mask(
    attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, is_causal: bool
) -> torch.Tensor | None:
    """The mask as eager attention adds it to the scores: 0 where a key is attended, the dtype's minimum elsewhere.

    Transformers passes, depending on `attn_implementation`: an additive float mask (eager; returned as is),
    a boolean one (SDPA, True = attended; converted as `masking_utils.eager_mask` does), or None where SDPA's
    own `is_causal` flag stands for the mask: a causal mask aligned top-left (keys past the query length are
    empty cache slots) when there is more than one query, no mask for a single query.
    """
    if attention_mask is None:
        q_length, kv_length = query.shape[2], key.shape[2]
        if q_length == 1 or not is_causal:
            return None
        # 4D, as Transformers builds masks (4.57's eager attention slices the mask as 4D)
        attention_mask = torch.ones(1, 1, q_length, kv_length, dtype=torch.bool, device=query.device).tril()
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise TypeError(
            "rla_lib.align's attention region reads 4D boolean or additive attention masks (those of the eager "
            f"and sdpa implementations), got {type(attention_mask).__name__} of shape "
            f"{tuple(getattr(attention_mask, 'shape', ()))}: load the model with attn_implementation='sdpa' or 'eager'."
        )
    if attention_mask.dtype == torch.bool:
        zero = torch.tensor(0.0, device=attention_mask.device, dtype=query.dtype)
        return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return attention_mask


def _refuse_dropout(dropout: float) -> None:
    if dropout:
        raise ValueError(
            f"rla_lib.align's attention region has no attention dropout (the engine has none), got dropout={dropout}."
        )


def _fp32_operands(module, query, key, value, attention_mask, dropout, is_causal):
    """(additive mask or None, FP32 keys and values repeated for GQA): what the FP32 kernels read."""
    _refuse_dropout(dropout)
    mask = additive_mask(attention_mask, query, key, module.is_causal if is_causal is None else is_causal)
    return (mask, repeat_kv(key, module.num_key_value_groups).float(),
            repeat_kv(value, module.num_key_value_groups).float())


def _engine_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, round_p):
    """softmax(q·kᵀ·scaling + mask)·v in FP32 from the model-dtype q/k/v, the output rounded once."""
    mask, key_states, value_states = _fp32_operands(module, query, key, value, attention_mask, dropout, is_causal)
    attn_weights = torch.matmul(query.float(), key_states.transpose(2, 3)) * scaling
    if mask is not None:
        attn_weights = attn_weights + mask.float()
    attn_weights = torch.softmax(attn_weights, dim=-1)
    if round_p:
        attn_weights = attn_weights.to(query.dtype).float()
    attn_output = torch.matmul(attn_weights, value_states).to(query.dtype)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def fp32_attention(
    module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, is_causal=None, **kwargs
):
    """Scores, softmax and P·V in FP32, the output rounded once (returns it and the FP32 P)."""
    return _engine_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, round_p=False)


def flash_attention(
    module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, is_causal=None, **kwargs
):
    """As `fp32_attention`, but in the order of vLLM's CPU attention kernel (csrc/cpu/cpu_attn_vec.hpp): q scaled in
    FP32 before q·kᵀ, then (exp(s - max)·V) / sum exp(s - max), normalised at the end as online-softmax kernels do
    (returns the output and the normalised FP32 P)."""
    mask, key_states, value_states = _fp32_operands(module, query, key, value, attention_mask, dropout, is_causal)
    scores = torch.matmul(query.float() * scaling, key_states.transpose(2, 3))
    if mask is not None:
        scores = scores + mask.float()
    unnormalised = torch.exp(scores - scores.amax(-1, keepdim=True))
    row_sum = unnormalised.sum(-1, keepdim=True)
    attn_output = (torch.matmul(unnormalised, value_states) / row_sum).to(query.dtype)
    return attn_output.transpose(1, 2).contiguous(), unnormalised / row_sum


def p_bf16_attention(
    module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, is_causal=None, **kwargs
):
    """As `fp32_attention`, with P rounded to the model dtype before P·V (returns the rounded P, in FP32)."""
    return _engine_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, round_p=True)


def eager_attention(
    module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, is_causal=None, **kwargs
):
    """Transformers' eager attention (scores and P in the model dtype), whatever mask the model was loaded for."""
    _refuse_dropout(dropout)
    mask = additive_mask(attention_mask, query, key, module.is_causal if is_causal is None else is_causal)
    modeling = sys.modules[type(module).__module__]
    return modeling.eager_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)


KERNELS = {"fp32": fp32_attention, "flash": flash_attention, "p_bf16": p_bf16_attention, "eager": eager_attention}
