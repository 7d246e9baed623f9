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
- `sdpa_cpu_unrounded` (not a region kernel): the stock side's own attention, PyTorch's BF16 SDPA kernel on CPU, as
  the FP32 value it is about to round (what `rla_lib.studies.prerounding` records).
- `vllm_cpu_attention`: vLLM's CPU attention kernel (`cpu_attention_with_kv_cache`, AVX-512 build of the "vec" ISA,
  csrc/cpu/cpu_attn_impl.hpp and cpu_attn_vec.hpp) operation for operation: q·kᵀ as sequential fused
  multiply-adds over the head dimension, the kernel's polynomial exp (cpu_attn_macros.h), the row sum in 16
  vector lanes reduced pairwise, P·V as sequential fused multiply-adds over the keys, and a multiply by the
  reciprocal of the sum. Bitwise equal to the engine's attention output on this machine (the notebook-03b
  per-op check and tests/test_engine_align.py); its backward is that of torch's fused SDPA kernel in the model
  dtype (the same function in exact arithmetic), evaluated at this output. Its loops run in C (`rla_lib.native`)
  where a C compiler is at hand, else as loops of tensor ops over head_dim and keys (the same bits, slower).
- `vllm_cpu_avx512_attention`, `vllm_cpu_avx2_attention`: the same kernel as vLLM-CPU's other x86 builds run it
  (`VLLM_CPU_BUILDS`). Without AVX512-BF16 the output is truncated to BF16, not rounded (`_C_AVX512`); the AVX2
  build (`_C_AVX2`, compiled without FMA) also rounds each product before its add, takes the C library's expf
  (`std::exp`) and sums the 16 lanes as two 8-lane halves in order (in C only: glibc's expf has no torch equivalent).
  Each bitwise equal to its engine's attention output (capped Intel Xeon, tests/test_op_check.py).
- `vllm_cpu_amx_attention`: vLLM-CPU's AMX kernel (`_C` on CPUs with AMX tiles): the vector kernel's softmax, q·kᵀ
  on BF16 q with the scale applied to the logits, P rounded to BF16 before P·V, each AMX tile instruction's products
  summed as its hardware does (native_kernels.c); in C only. Bitwise equal to its engine's output (Intel Xeon).

Each reads the mask Transformers built for the model's `attn_implementation` and adds it as eager
attention does (see `additive_mask`); sliding windows and padding are in that mask. The engine has no
attention dropout, so the kernels refuse a non-zero one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import repeat_kv  # the same function in modeling_qwen2

from . import native
from .vector_sums import lane_tree_sum


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


def sdpa_cpu_unrounded(query, key, value, attention_mask, scaling: float) -> torch.Tensor:
    """PyTorch's CPU SDPA kernel for BF16 (its flash attention) just before it rounds its output, in FP32, (B, T, H, D).

    The kernel keeps the scores, the running max and the softmax denominator in FP32 but rounds the *unnormalised*
    probabilities exp(s - max) to BF16 before the product with V; its output is (P_bf16·V) / denominator, rounded
    once. This is that value, bitwise the kernel's where it takes the keys in one block (here: 256 or fewer) and its
    exp is accurate; AVX2 builds use the approximate `fexp_u20` (relative error up to about 1e-4), so a few
    probabilities round the other way there. `attention_mask` as Transformers passes it to SDPA: None (causal),
    boolean (True = attended) or additive."""
    n_rep = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(n_rep, dim=1)
    values = value.float().repeat_interleave(n_rep, dim=1)
    scores = (query.float() @ keys.transpose(-1, -2)) * scaling
    t_q, t_k = scores.shape[-2:]
    if attention_mask is None:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=query.device).tril(t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask.float()
    unnormalised = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (unnormalised.to(query.dtype).float() @ values) / unnormalised.sum(-1, keepdim=True)
    return out.transpose(1, 2)


# ---- vLLM's CPU attention kernel, bit for bit ----------------------------------------------------------------------

def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a·b + c rounded once to FP32, as a fused multiply-add: the FP64 product of two FP32 values is exact, so
    only the FP64 sum rounds before the FP32 rounding (a double rounding that can differ once in ~2^29 cases)."""
    return torch.addcmul(c.double(), a.double(), b.double()).float()


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits - (1 << 32) if bits >= 1 << 31 else bits], dtype=torch.int32).view(torch.float32)[0]


# DEFINE_FAST_EXP of csrc/cpu/cpu_attn_macros.h (x86 with AVX-512): exp(x) = 2^n · p(r), r = x - n·ln2, p of degree 5
_EXP_LOG2E, _EXP_LN2, _EXP_LN_FLT_MIN, _EXP_LN_FLT_MAX = (_f32(b) for b in (0x3FB8AA3B, 0x3F317218, 0xC2AEAC50, 0x42B17218))
_EXP_POLY = tuple(torch.tensor(c, dtype=torch.float32) for c in (0.00828929059, 0.0418978221, 0.166676521,
                                                                  0.499991506, 0.999999701, 1.0))


def vllm_fast_exp(x: torch.Tensor) -> torch.Tensor:
    """The exp of vLLM's CPU attention softmax (AVX-512 `fast_exp`), elementwise on an FP32 tensor; 0 below ln(FLT_MIN)."""
    src = torch.maximum(torch.minimum(x, _EXP_LN_FLT_MAX), _EXP_LN_FLT_MIN)
    fx = torch.floor(fma32(src, _EXP_LOG2E, torch.tensor(0.5)))
    r = fma32(-fx, _EXP_LN2, src)
    poly = fma32(r, _EXP_POLY[0], _EXP_POLY[1])
    for coefficient in _EXP_POLY[2:]:
        poly = fma32(r, poly, coefficient)
    two_n = ((fx - 1).to(torch.int32) + 127).bitwise_left_shift(23).view(torch.float32)
    return poly * torch.where(x < _EXP_LN_FLT_MIN, 0.0, two_n) * 2


@functools.cache
def addcmul_rounds_once() -> bool:
    """Whether FP32 `torch.addcmul(c, a, b)` is a fused multiply-add on this CPU (ATen's vectorised loop uses the FMA
    instruction where there is one), checked once in the broadcast layout the kernel below uses; else it runs the
    FP64 form of `fma32`, 3x slower, the same bits."""
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(64, 8, 1, generator=g), torch.randn(64, 1, 33, generator=g), torch.randn(64, 8, 33, generator=g)
    return torch.equal(torch.addcmul(c, a, b), fma32(a, b, c))


def _fma_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_i acc ← a[i]·b[i] + acc, one fused multiply-add per i in order; a[i] (…, 1) columns, b[i] (…, 1, n) rows."""
    if addcmul_rounds_once():
        for a_i, b_i in zip(a, b):
            acc = torch.addcmul(acc, a_i, b_i)
        return acc
    wide = torch.empty_like(acc, dtype=torch.float64)
    for a_i, b_i in zip(a, b):
        torch.addcmul(wide.copy_(acc), a_i.double(), b_i.double(), out=wide)
        acc.copy_(wide)
    return acc


# vLLM-CPU's x86 attention kernels, by the library it loads (vllm/platforms/cpu.py) and, in `_C` on CPUs with AMX, its
# AMX kernel (cpu_attn_amx.hpp), and the numerics reproducing each. `_C` (AVX512-BF16) rounds the output to BF16 to nearest (`_mm512_cvtneps_pbh`); without
# AVX512-BF16, `_C_AVX512` and `_C_AVX2` drop the low 16 bits instead (csrc/cpu/cpu_types_x86.hpp, BF16Vec16 from
# FP32Vec16). `_C_AVX2` also has its own loops (rla_lib/native_kernels.c, lane_sum).
VLLM_CPU_BUILDS = {"amx": "vllm_cpu_amx", "avx512_bf16": "vllm_cpu", "avx512": "vllm_cpu_avx512",
                   "avx2": "vllm_cpu_avx2"}
ROUNDS_TO_NEAREST = ("amx", "avx512_bf16")  # the kernels of `_C`, built with AVX512-BF16


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 to BF16 by dropping the low 16 bits (round toward zero), as vLLM-CPU converts without AVX512-BF16."""
    return (x.float().contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _to_model_dtype(out: torch.Tensor, dtype: torch.dtype, build: str) -> torch.Tensor:
    if dtype == torch.bfloat16 and build not in ROUNDS_TO_NEAREST:
        return truncate_to_bf16(out)
    return out.to(dtype)


def _vllm_cpu_forward(query, key, value, attended, scaling, weights=False, build="avx512_bf16"):
    """The kernel's forward on (B, H, T, D) q and (B, KV, S, D) k/v in the model dtype; `attended` (B, 1|H, T, S);
    `build` one of `VLLM_CPU_BUILDS`. Returns the output (rows that attend to nothing: NaN), each row's log-sum-exp of
    its scores (+inf where it attends to nothing) and, with `weights`, the normalised FP32 P (else None). In C where it
    compiles (`rla_lib.native`), else as loops of torch ops: the same bits (the log-sum-exp, which only the backward
    reads, within an ulp); the AVX2 build's loops in C only."""
    loops = build if build in ("avx2", "amx") else "avx512"
    tiles = None if loops == "amx" else _row_tiles(attended, query.shape[-1])
    if native.library() is not None:
        out, logsumexp, p = native.vllm_cpu_attention(query.float(), key.float(), value.float(), attended, scaling,
                                                      weights, loops, tiles)
        return _to_model_dtype(out, query.dtype, build), logsumexp, p
    keys_per_row = attended.sum(-1).amax(1)  # (B, T): keys each query row attends
    if tiles is not None and bool(((tiles > 0) & (keys_per_row > tiles)).any()):
        raise RuntimeError("sequences longer than one of vLLM-CPU's KV tiles need rla_lib's C kernels (built by the "
                           "system C compiler, which failed or is missing: see the warning above); install gcc")
    q = query.float() * scaling  # the vector kernel scales q in FP32 while copying it to its buffer
    if loops != "avx512":
        raise RuntimeError(f"attention='{VLLM_CPU_BUILDS[build]}' runs in C only (rla_lib/native_kernels.c, built by the "
                           "system C compiler, which failed or is missing: see the warning above); the torch-op loops "
                           "are the AVX-512 kernel's. Install a C compiler (e.g. gcc) and run again.")
    groups = query.shape[1] // key.shape[1]
    # The row sum's 16 lanes count from the sequence's first position (its first slot in the KV cache)
    start = attended.flatten(1, 2).any(1).int().argmax(-1)  # (B,): first position any query attends to
    out, logsumexp, p = _vllm_cpu_forward_torch(q, repeat_kv(key, groups).float(), repeat_kv(value, groups).float(),
                                                attended, start)
    return _to_model_dtype(out, query.dtype, build), logsumexp, p if weights else None


def _row_tiles(attended, head_dim: int) -> torch.Tensor:
    """(B, T) KV tile size of each query row: each sequence's length read from the keys its rows attend (right
    padding), its prefilled part from `prefilled` (default: all)."""
    keys = attended.flatten(1, 2).any(1).int()  # (B, S): the keys some row attends, a sequence's tokens
    starts, ends = keys.argmax(-1), keys.cumsum(-1).argmax(-1) + 1
    lengths = (ends - starts).tolist()
    given = _PREFILLED.get()
    if given is not None and len(given) != len(lengths):
        raise ValueError(f"prefilled: {len(given)} lengths for a batch of {len(lengths)} sequences")
    return kv_tiles(lengths, lengths if given is None else given, attended.shape[-2], head_dim, starts=starts.tolist())


def _vllm_cpu_forward_torch(q, key, value, attended, start):
    key_rows = key.transpose(-1, -2).contiguous()  # (B, H, D, S)
    scores = torch.zeros(q.shape[:-1] + (key.shape[-2],), dtype=torch.float32)
    # q·kᵀ: one fused multiply-add per head dimension, in order
    scores = _fma_accumulate(scores, q.movedim(-1, 0)[..., None], key_rows.movedim(-2, 0)[..., None, :])
    scores = scores.masked_fill(~attended, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # rows that attend to nothing (left padding)
    p = vllm_fast_exp(scores - row_max).masked_fill(~attended, 0.0)
    # The row sum in 16 lanes: lane l holds the keys at start + l, start + l + 16, ... (left padding shifted out)
    n = p.shape[-1]
    index = (torch.arange(n) + start[:, None]).clamp(max=n - 1)
    shifted = p.gather(-1, index[:, None, None, :].expand_as(p)).masked_fill(torch.arange(n) + start[:, None, None, None] >= n, 0.0)
    shifted = torch.nn.functional.pad(shifted, (0, -n % 16)).unflatten(-1, (-1, 16))
    lanes = torch.zeros_like(shifted[..., 0, :])
    for group in range(shifted.shape[-2]):
        lanes = lanes + shifted[..., group, :]
    row_sum = lane_tree_sum(lanes)
    inverse_sum = (1.0 / row_sum.double()).float()[..., None]
    out = torch.zeros(q.shape, dtype=torch.float32)
    # P·V: one fused multiply-add per key, in order
    out = _fma_accumulate(out, p.movedim(-1, 0)[..., None], value.movedim(-2, 0)[..., None, :])
    logsumexp = torch.where(row_sum > 0, row_max[..., 0] + row_sum.log(), float("inf"))
    return inverse_sum * out, logsumexp, p * inverse_sum


# ---- vLLM-CPU's KV tiles: how many keys a query row's softmax takes at a time ---------------------------------
# cpu_attn_impl.hpp, AttentionScheduler, for the vector kernels (cpu_attn_vec.hpp: 8 query rows per iteration, keys in
# units of 32, FP32 q/logits/partial-output buffers, a BF16 KV cache), from half the L2 cache torch reports. A prefill
# takes its queries in tiles of `prefill_q_tile` tokens; each q tile's KV tile size follows from its (rounded) rows. A
# decoded token is one row (rounded to 8). Rows whose keys fit one tile are what the untiled kernel computes.
Q_ROWS_PER_ITER, KEY_ALIGN, MAX_Q_TILE_ITERS = 8, 32, 128
BUFFER_BYTES = dict(q=4, kv=2, logits=4, out=4)
_PREFILLED = contextvars.ContextVar("rla_prefilled", default=None)


def l2_cache_bytes() -> int:
    """The L2 size vLLM-CPU sizes its tiles by: torch's CPU capabilities (at::cpu::get_cpu_capabilities)."""
    return int(torch._C._cpu._get_cpu_capability()["l2_cache_size"])


def prefill_q_tile(head_dim: int, l2: int) -> int:
    """calcu_default_tile_size: query tokens per prefill q tile."""
    b = BUFFER_BYTES
    tile = (l2 >> 1) // (head_dim * (b["q"] + 2 * b["kv"] + b["out"]) + Q_ROWS_PER_ITER * b["logits"])
    tile = min(tile, MAX_Q_TILE_ITERS * Q_ROWS_PER_ITER)
    return max(tile // Q_ROWS_PER_ITER * Q_ROWS_PER_ITER, Q_ROWS_PER_ITER)


def kv_tile(q_rows: int, head_dim: int, l2: int) -> int:
    """calcu_tile_size_with_constant_q: keys per KV tile for a q tile of `q_rows` rows (rounded up to 8)."""
    b, rows = BUFFER_BYTES, -(-q_rows // Q_ROWS_PER_ITER) * Q_ROWS_PER_ITER
    room = (l2 >> 1) - rows * head_dim * (b["q"] + b["out"])
    one_round = rows <= Q_ROWS_PER_ITER  # one q iteration: K and V need not stay in the cache
    tile = room // (b["logits"] * Q_ROWS_PER_ITER + (0 if one_round else 2 * head_dim * b["kv"]))
    return max(tile // KEY_ALIGN * KEY_ALIGN, KEY_ALIGN)


def kv_tiles(lengths, prefilled, width: int, head_dim: int, l2: int | None = None, starts=None) -> torch.Tensor:
    """(B, width) KV tile size of each query row of sequences of `lengths` tokens (starting at row `starts`, default 0:
    left padding before) whose first `prefilled` tokens the engine computed in one prefill, the rest one decoded token
    at a time."""
    l2 = l2_cache_bytes() if l2 is None else l2
    q_tile, decode = prefill_q_tile(head_dim, l2), kv_tile(1, head_dim, l2)
    tiles = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, (n, p, s) in enumerate(zip(lengths, prefilled, [0] * len(lengths) if starts is None else starts)):
        p = min(int(p), int(n))
        for first in range(0, p, q_tile):
            tiles[row, s + first : s + min(first + q_tile, p)] = kv_tile(min(q_tile, p - first), head_dim, l2)
        tiles[row, s + p : s + n] = decode
    return tiles


@contextlib.contextmanager
def prefilled(lengths):
    """For the engine-numerics attention kernels within the block: how many leading tokens of each sequence of the
    batch the engine computed in one prefill (its prompt, for the logprobs it returned while sampling); the tokens after
    them it decoded one at a time. Outside such a block every token counts as prefilled, as when the engine re-scores a
    sequence. The two differ only for sequences longer than one KV tile (`kv_tile`)."""
    token = _PREFILLED.set(None if lengths is None else [int(n) for n in lengths])
    try:
        yield
    finally:
        _PREFILLED.reset(token)


class _SdpaBackward(torch.autograd.Function):
    """The attention output as given (a kernel's, computed outside autograd); the gradient that of torch's fused CPU
    SDPA kernel at that output: its backward reads only q, k, v, the output and each row's log-sum-exp, so the
    forward it would have run is not needed."""

    @staticmethod
    def forward(ctx, query, key, value, out, logsumexp, mask, scale, is_causal=False):
        ctx.save_for_backward(query, key, value, out, logsumexp, mask)
        ctx.scale, ctx.is_causal = scale, is_causal
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, logsumexp, mask = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), query, key, value, out, logsumexp, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale)
        return *grads, None, None, None, None, None


def vllm_cpu_attention(
    module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, is_causal=None,
    weights: bool = False, build: str = "avx512_bf16", **kwargs
):
    """vLLM's CPU attention kernel bit for bit in the forward (see the module docstring); the backward is that of
    torch's fused SDPA kernel in the model dtype, at this output. Query rows that attend to nothing (left padding; no
    engine computes them) give the mean of the values, as the other kernels do, and no gradient. Returns the output
    and, as Transformers' sdpa and flash kernels do, no weights (None); with `weights=True` the normalised FP32 P."""
    if query.device.type != "cpu":
        raise ValueError(f"attention='vllm_cpu' is vLLM's CPU kernel; this model is on {query.device.type}: "
                         "use the numerics the probe reads for that engine (e.g. 'flash').")
    _refuse_dropout(dropout)
    mask = additive_mask(attention_mask, query, key, module.is_causal if is_causal is None else is_causal)
    attended = torch.ones(1, 1, 1, 1, dtype=torch.bool) if mask is None else mask == 0
    attended = attended.expand(query.shape[0], -1, query.shape[2], key.shape[2])
    with torch.no_grad():
        out, logsumexp, p = _vllm_cpu_forward(query, key, value, attended, scaling, weights, build)
        # Rows that attend to nothing (left padding; no engine computes them): what the other kernels give there, the
        # mean of all values (every score equally masked), and no gradient (their log-sum-exp is +inf).
        empty = ~attended.any(-1, keepdim=True)
        if empty.any():
            mean = repeat_kv(value.float().mean(-2, keepdim=True), module.num_key_value_groups)
            mean = _to_model_dtype(mean, query.dtype, build)  # converted as this build converts its output
            out = torch.where(empty, mean, out)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        groups = module.num_key_value_groups
        # no mask from Transformers and as many queries as keys: plain causal, which SDPA's backward knows to skip
        causal = attention_mask is None and mask is not None and query.shape[2] == key.shape[2]
        out = _SdpaBackward.apply(query, repeat_kv(key, groups), repeat_kv(value, groups), out,
                                  logsumexp.contiguous(),
                                  None if mask is None or causal else mask.to(query.dtype), scaling, causal)
    return out.transpose(1, 2).contiguous(), p


def vllm_cpu_amx_attention(module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                           is_causal=None, weights: bool = False, **kwargs):
    """vLLM-CPU's AMX attention kernel (`_C` on CPUs with AMX tiles): the AVX-512 kernel's softmax, q·kᵀ on BF16 q
    with the scale applied to the logits, and P rounded to BF16 before P·V (the row sum adds the FP32 values)."""
    return vllm_cpu_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, weights, "amx")


def vllm_cpu_avx512_attention(module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                              is_causal=None, weights: bool = False, **kwargs):
    """vLLM-CPU's vector attention as its AVX-512 build without BF16 instructions computes it (`_C_AVX512`): the loops
    of `vllm_cpu_attention`, the output truncated to BF16."""
    return vllm_cpu_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, weights, "avx512")


def vllm_cpu_avx2_attention(module: nn.Module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                            is_causal=None, weights: bool = False, **kwargs):
    """vLLM-CPU's vector attention as its AVX2 build computes it (`_C_AVX2`, compiled without FMA): each product
    rounded before its add, the C library's expf, the 16-lane row sum as two 8-lane halves summed in order, the output
    truncated to BF16."""
    return vllm_cpu_attention(module, query, key, value, attention_mask, scaling, dropout, is_causal, weights, "avx2")


KERNELS = {"fp32": fp32_attention, "flash": flash_attention, "p_bf16": p_bf16_attention, "eager": eager_attention,
           "vllm_cpu": vllm_cpu_attention, "vllm_cpu_amx": vllm_cpu_amx_attention,
           "vllm_cpu_avx512": vllm_cpu_avx512_attention,
           "vllm_cpu_avx2": vllm_cpu_avx2_attention}
