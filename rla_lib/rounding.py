"""BF16 rounding with exact semantics, rounding positions, their clustering, and where a model rounds.

Part 1, BF16 arithmetic on FP32 tensors (exact: integer operations on the int32 view, no float tricks).

BF16 keeps the sign, the 8 exponent bits and the top 7 mantissa bits of an FP32 number, so every BF16
value is an FP32 value whose low 16 bits are zero, and the low 16 bits of an FP32 value say where it lies
between its two BF16 neighbours.

- `round_bf16(x)`: round to nearest, ties to even, returned as a `torch.bfloat16` tensor; bitwise the same
  as torch's own `x.to(torch.bfloat16)` for every finite input, subnormals included (FP32 subnormals map
  to BF16 subnormals, or to zero, with the same rule). Overflow gives +-inf exactly as torch does.
  Non-finite inputs are *handled*: +-inf stay +-inf and NaN stays NaN (NaN's sign and payload bits are not
  specified; torch 2.13 on CPU writes 0xFFFF, this function writes the same).
- `bf16_ulp(x)`: the spacing of BF16 numbers at x: 2**(e - 7) with e = floor(log2|x|) for normal x, i.e.
  the gap from |x| truncated to BF16 to the next BF16 of larger magnitude (ulp(1.5) = ulp(1.0) = 2**-7,
  ulp(3.0) = 2**-6). In the subnormal range it is the constant 2**-133; ulp(0) = 2**-133 too.
- `bf16_neighbors(x)`: `(lower, upper)`, the largest BF16 value <= x and the smallest >= x (as FP32
  tensors holding exact BF16 values). They coincide when x is a BF16 value; otherwise
  `upper - lower == bf16_ulp(x)`. Next to the largest finite BF16 value `upper` may be +-inf.
- `rounding_position(x)`: `(x - lower) / bf16_ulp(x)`, in [0, 1); 0 exactly when x is representable.
  It is exact (a multiple of 2**-16) and follows the number line, so for negative x it is
  `1 - (|x| - trunc|x|) / ulp`: position 0.25 of a negative value lies a quarter of a step above the
  BF16 value below it (towards -inf). Positions 0 and 0.5 (ties) mean the same for both signs.
- `bf16_steps(a, b)`: how many BF16 steps b lies above a (both BF16-representable).

`bf16_ulp`, `bf16_neighbors` and `rounding_position` reject non-finite inputs with a ValueError: there
is no interval around inf or NaN. All functions take FP32 tensors; BF16/FP16 tensors and Python numbers
are converted to FP32 first (exactly for tensors; a Python float is rounded to FP32 as torch does).
FP64 tensors are refused (the conversion would itself round).

Part 2, clustering of rounding positions (the paper's measure).

For positions p_1..p_N in [0, 1), `fourier_coefficients` gives c_k = mean_i exp(-2 pi i k p_i) for
k = 1..16, and `fourier_clustering` their RMS magnitude, sqrt(mean_k |c_k|^2). All N at one position
gives exactly 1. For N independent uniform positions E|c_k|^2 = 1/N, so the score sits near
`uniform_floor(N) = 1/sqrt(N)`: report that floor next to every score. Positions that are exact
multiples of 2**-16 (everything `rounding_position` returns) are histogrammed first, so millions of
values cost one `bincount`. Note that the floor assumes independent samples: duplicated values (for
example the same prefix scored twice) are not independent; `distinct_prefix_mask` removes those.

`rounding_clustering(values)` is the score of a location's values, computed over the values that
actually round only. A value already on the BF16 grid (position 0) has no rounding error at all: it
cannot contribute a systematic error, and counting it would make a location look clustered for the
trivial reason that nothing happens there (q * cos with cos = 1.0 exactly, a product with zero, a
copy). So it is excluded, and its share is reported separately (`exact_frac`), as is the share of
exact ties (`tie_frac`, position 0.5): a tie does round, but round-to-nearest-even sends it to
whichever neighbour is even, up for some values and down for others, so ties add no direction by
themselves. `mean_error` is the net signed error in ulps; `mean_error_se` its spread if the distinct
values' errors were independent and uniform on [-1/2, 1/2] (distinct_floor / sqrt(12)). The floors
(`floor` = 1/sqrt(n), `distinct_floor`) are computed on the same filtered sample; `score_all_values`
keeps the earlier score over every value, for comparison only. A sample with no value to round gives
NaN scores and floors (`n = 0`, `exact_frac = 1`) rather than an error, so a table of many locations
can hold it.

Part 3, where the stock Transformers model rounds (Qwen2/Qwen3, BF16).

`capture_prerounding(model, input_ids, attention_mask)` runs the stock model once, records each decoder
layer's BF16 input, then replays the layer op by op: each op runs exactly as the stock model runs it
(same BF16 tensors, checked: the replayed layer output must equal the stock layer output bitwise) and
again in FP32 on the upcast BF16 inputs of that op. The FP32 result is the value the op had just before
it was stored to BF16. `LOCATIONS` lists the locations (q/k/v/o/gate/up/down projections, the attention
output, RMSNorm x*rsqrt before and after the weight, Qwen3's Q/K norms, the RoPE products and sums, SiLU,
the SwiGLU product and both residual sums). For pointwise ops the FP32 value is exact: rounding it gives
the stock BF16 tensor bit for bit. For matmuls it is an FP32 recomputation whose accumulation order
differs from the BF16 kernel's, so rounding it reproduces the stock tensor except for rare one-step
differences (more than 99.9% of elements equal). For attention with "sdpa" on CPU it mirrors PyTorch's
BF16 flash kernel, which rounds the unnormalised probabilities to BF16 before multiplying by V (a plain
FP32 recomputation would agree on only ~90% of elements); elsewhere it is the plain FP32 recomputation.
The final `model.norm` is not captured (it is not part of a decoder layer).

RoPE at other positions: the embedded models have 64 positions and the task sequences ~40 tokens, so
`capture_prerounding` sees RoPE only where cos is close to 1. `capture_rope_at_positions(model, ids,
mask, positions)` takes the q/k the stock model feeds to RoPE (`capture_rope_inputs`: after the
projections and Qwen3's Q/K norms) and rotates them at other positions (`rope_prerounding`), e.g. each
token at a position drawn uniformly from [0, 4096), with the model's own `rotary_emb` (its rope_theta,
BF16 cos/sin) and the stock arithmetic: the products and sums a long-context forward would round for
those q/k values (with "task" it equals `capture_prerounding`'s RoPE locations bitwise).

Part 4, small demonstrations for the notebooks: a chain of pointwise ops evaluated unfused (rounded after
every op) and fused (rounded once), region outputs of one decoder layer, and how a change in one region
propagates through the layers to the log-probabilities.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .machine import has_fp32_matmul

# --------------------------------------------------------------------------------------------------
# Part 1: BF16 arithmetic
# --------------------------------------------------------------------------------------------------

BF16_MIN_SUBNORMAL = 2.0**-133
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_LOW16 = 0xFFFF
_HIGH16 = -0x10000  # 0xFFFF0000 as int32


def _as_fp32(x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        return torch.as_tensor(x, dtype=torch.float32)
    if x.dtype == torch.float32:
        return x
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    if x.dtype == torch.float64:
        raise TypeError("rla_lib.rounding works on FP32 values; an FP64 tensor would be rounded by the conversion. "
                        "Convert it yourself with .float() if that is what you mean.")
    raise TypeError(f"expected a floating-point tensor (FP32, or BF16/FP16 which convert exactly), got {x.dtype}.")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _round_off_low_bits(u: torch.Tensor, shift: int) -> torch.Tensor:
    """Unsigned FP32 bit patterns (int64) without their low `shift` bits, rounded to nearest, ties to even."""
    return (u + (1 << (shift - 1)) - 1 + ((u >> shift) & 1)) >> shift


def _require_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        n = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{what} is defined for finite values only; got {n} inf/nan value(s). "
                         "Filter them out first (e.g. x[torch.isfinite(x)]).")


def round_bf16(x) -> torch.Tensor:
    """Round FP32 to the nearest BF16 value, ties to even (a `torch.bfloat16` tensor).

    Bitwise identical to `x.to(torch.bfloat16)`, subnormals and overflow included; inf stays inf,
    NaN stays NaN (see the module docstring).
    """
    x = _as_fp32(x)
    bits = _bits(x).to(torch.int64) & 0xFFFFFFFF  # unsigned view
    rounded = _round_off_low_bits(bits, 16) & _LOW16  # carry into the exponent is the right answer
    rounded = torch.where(torch.isnan(x), torch.full_like(rounded, 0xFFFF), rounded)
    # inf: 0x7F800000 + 0x7FFF keeps the exponent at all ones and the mantissa at zero, so no special case.
    out = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    return out.view(torch.bfloat16)


def round_mantissa(x, bits: int) -> torch.Tensor:
    """Round FP32 to `bits` explicit mantissa bits (ties to even), returned as FP32; exponent range unchanged.

    `bits=7` equals `round_bf16` for finite values; fewer bits give a controlled, coarser rounding
    (FP8 E4M3 keeps 3, E5M2 keeps 2; their exponent range and scaling are not modelled).
    """
    if not 0 <= bits <= 23:
        raise ValueError(f"bits must be in [0, 23] (FP32 has 23 mantissa bits), got {bits}")
    x = _as_fp32(x)
    _require_finite(x, "round_mantissa")
    if bits == 23:
        return x.clone()
    shift = 23 - bits
    u = _round_off_low_bits(_bits(x).to(torch.int64) & 0xFFFFFFFF, shift) << shift  # a carry into the exponent is right
    return _from_bits(torch.where(u >= 2**31, u - 2**32, u))


def bf16_ulp(x) -> torch.Tensor:
    """Spacing of BF16 numbers at x (FP32 tensor): 2**(floor(log2|x|) - 7), 2**-133 below 2**-126."""
    x = _as_fp32(x)
    _require_finite(x, "bf16_ulp")
    exponent = (_bits(x) >> 23) & 0xFF  # biased exponent field, 0 for zero/subnormal
    normal_ulp = (exponent - 7).clamp(min=1) << 23  # 2**(e-7) as an FP32 normal number
    tiny_ulp = torch.ones_like(exponent) << (exponent.clamp(min=1) + 15)  # FP32 subnormal 2**(e-134)
    return _from_bits(torch.where(exponent >= 8, normal_ulp, tiny_ulp))


def bf16_neighbors(x) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower, upper): the largest BF16 value <= x and the smallest >= x, as FP32 tensors."""
    x = _as_fp32(x)
    _require_finite(x, "bf16_neighbors")
    bits = _bits(x)
    toward_zero = bits & _HIGH16  # truncation keeps the sign: the neighbour of smaller magnitude
    exact = (bits & _LOW16) == 0
    away = toward_zero + 0x10000  # next BF16 of larger magnitude (sign bit untouched; may become inf)
    away = torch.where(exact, toward_zero, away)
    negative = bits < 0
    lower = torch.where(negative, away, toward_zero)
    upper = torch.where(negative, toward_zero, away)
    return _from_bits(lower), _from_bits(upper)


def rounding_position(x) -> torch.Tensor:
    """(x - lower) / bf16_ulp(x) in [0, 1), exactly (FP32 multiples of 2**-16)."""
    x = _as_fp32(x)
    _require_finite(x, "rounding_position")
    bits = _bits(x)
    frac = (bits & _LOW16).to(torch.float32) / 65536.0  # distance from the neighbour of smaller magnitude
    return torch.where((bits < 0) & (frac > 0), 1.0 - frac, frac)


def bf16_steps(a, b) -> torch.Tensor:
    """How many BF16 steps b lies above a (int64; both must be BF16 values, +-0 count as equal)."""
    a, b = _as_fp32(a), _as_fp32(b)
    for name, v in (("a", a), ("b", b)):
        _require_finite(v, "bf16_steps")
        if bool(((_bits(v) & _LOW16) != 0).any()):
            raise ValueError(f"bf16_steps: {name} holds values that are not BF16-representable; round them first.")

    def ordinal(v):
        h = (_bits(v) >> 16).to(torch.int64)  # signed 16-bit pattern
        return torch.where(h < 0, -(h & 0x7FFF), h)

    return ordinal(b) - ordinal(a)


def bf16_grid(lo: float, hi: float) -> torch.Tensor:
    """All BF16 values in [lo, hi] in increasing order (FP32 tensor); refuses more than 2**16 of them."""
    lo_t, hi_t = _as_fp32(float(lo)), _as_fp32(float(hi))
    if not lo_t <= hi_t:
        raise ValueError(f"bf16_grid needs lo <= hi, got {lo}, {hi}.")
    start = bf16_neighbors(lo_t)[1]  # smallest BF16 >= lo
    stop = bf16_neighbors(hi_t)[0]  # largest BF16 <= hi
    if start > stop:
        return torch.empty(0)
    first = int(bf16_steps(torch.tensor(0.0), start))  # ordinal: signed number of steps from zero
    n = int(bf16_steps(start, stop)) + 1
    if n > 65536:
        raise ValueError(f"[{lo}, {hi}] holds {n} BF16 values; pick a narrower range.")
    ordinals = torch.arange(first, first + n, dtype=torch.int64)
    high = torch.where(ordinals < 0, 0x8000 | (-ordinals), ordinals)
    return _from_bits(high << 16)


# --------------------------------------------------------------------------------------------------
# Part 2: clustering of rounding positions
# --------------------------------------------------------------------------------------------------

N_COEFFS = 16


def uniform_floor(n: int) -> float:
    """What `fourier_clustering` gives for n independent uniform positions (RMS over k): 1/sqrt(n)."""
    if n <= 0:
        raise ValueError("uniform_floor needs at least one sample.")
    return 1.0 / math.sqrt(n)


_GRID_TABLES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _grid_table(n_coeffs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of 2 pi k b / 2**16 for k = 1..n_coeffs, b = 0..2**16-1 (float64, cached)."""
    if n_coeffs not in _GRID_TABLES:
        k = torch.arange(1, n_coeffs + 1, dtype=torch.int64)[:, None]
        b = torch.arange(65536, dtype=torch.int64)[None]
        phase = (k * b % 65536).to(torch.float64) * (2.0 * math.pi / 65536.0)  # reduce first: exact phases
        _GRID_TABLES[n_coeffs] = (torch.cos(phase), torch.sin(phase))
    return _GRID_TABLES[n_coeffs]


def fourier_coefficients(positions, n_coeffs: int = N_COEFFS) -> torch.Tensor:
    """c_k = mean_i exp(-2 pi i k p_i), k = 1..n_coeffs (complex128)."""
    p = torch.as_tensor(positions).reshape(-1).to(torch.float64)
    if p.numel() == 0:
        raise ValueError("no positions given.")
    if not bool(((p >= 0) & (p < 1)).all()):
        raise ValueError("positions must lie in [0, 1).")
    scaled = p * 65536.0
    if bool((scaled == scaled.round()).all()):  # exact grid (rounding_position output): histogram first
        counts = torch.bincount(scaled.to(torch.int64), minlength=65536).to(torch.float64) / p.numel()
        cos, sin = _grid_table(n_coeffs)
        return torch.complex(cos @ counts, -(sin @ counts))
    k = torch.arange(1, n_coeffs + 1, dtype=torch.float64)
    coeffs = torch.zeros(n_coeffs, dtype=torch.complex128)
    for s in range(0, p.numel(), 1 << 16):
        phase = 2.0 * math.pi * k[:, None] * p[None, s : s + (1 << 16)]
        coeffs += torch.complex(torch.cos(phase).sum(-1), -torch.sin(phase).sum(-1))
    coeffs /= p.numel()
    return coeffs


def fourier_clustering(positions, n_coeffs: int = N_COEFFS) -> float:
    """RMS of |c_k|, k = 1..n_coeffs: ~1/sqrt(N) for uniform positions, 1 for a single position."""
    c = fourier_coefficients(positions, n_coeffs)
    return float(torch.sqrt((c.abs() ** 2).mean()))


@dataclass(frozen=True)
class RoundingClustering:
    """The clustering of one sample of FP32 values, measured over the values that actually round."""

    n_all: int  # finite values in the sample
    n: int  # values not on the BF16 grid: the sample every other field is computed on
    exact_frac: float  # share of n_all already BF16 (no rounding error), excluded from the score
    tie_frac: float  # share of n_all exactly halfway (rounded to the even neighbour), part of the score
    score: float  # fourier_clustering of the n values' positions (NaN when n = 0)
    floor: float  # 1/sqrt(n): the score of n independent uniform positions
    distinct: int  # distinct FP32 values among the n
    distinct_floor: float  # the score if only the distinct values had independent uniform positions
    score_without_ties: float  # the score once the ties are removed too
    mean_error: float  # mean of (round(x) - x) / ulp over the n values: the net direction, ~0 if none
    mean_error_se: float  # its standard error if the distinct values' errors were independent uniform
    score_all_values: float  # the earlier measure, exact values counted too: for comparison only

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _signed_error_ulp(v: torch.Tensor) -> torch.Tensor:
    """(round_bf16(v) - v) / ulp, exact: both are within one BF16 step, and ulp is a power of two."""
    return ((round_bf16(v).float() - v) / bf16_ulp(v)).double()


def rounding_clustering(values, n_coeffs: int = N_COEFFS) -> RoundingClustering:
    """Clustering of the rounding positions of the finite FP32 `values` that are not already BF16.

    See the module docstring (Part 2): exact values are excluded and counted in `exact_frac`, ties are
    kept and counted in `tie_frac`, floors are those of the filtered sample, and a sample with no value
    to round gives NaN scores (not an error) with `exact_frac = 1`.
    """
    v = _as_fp32(values).reshape(-1)
    v = v[torch.isfinite(v)]
    n_all = v.numel()
    if n_all == 0:
        raise ValueError("no finite values given.")
    pos = rounding_position(v)
    score_all_values = fourier_clustering(pos, n_coeffs)
    rounds = pos != 0
    ties = pos == 0.5
    exact_frac, tie_frac = float((~rounds).double().mean()), float(ties.double().mean())
    v, pos, ties = v[rounds], pos[rounds], ties[rounds]
    nan = float("nan")
    if v.numel() == 0:
        return RoundingClustering(n_all, 0, exact_frac, tie_frac, nan, nan, 0, nan, nan, nan, nan, score_all_values)
    distinct, distinct_floor = distinct_value_floor(v)
    without_ties = fourier_clustering(pos[~ties], n_coeffs) if bool((~ties).any()) else nan
    return RoundingClustering(n_all, v.numel(), exact_frac, tie_frac, fourier_clustering(pos, n_coeffs),
                              uniform_floor(v.numel()), distinct, distinct_floor, without_ties,
                              float(_signed_error_ulp(v).mean()), distinct_floor / math.sqrt(12.0), score_all_values)


def clustering_score(values) -> float:
    """The clustering score of the FP32 `values` that actually round (`rounding_clustering(values).score`).

    Values already on the BF16 grid are not counted (they have no rounding error); for the old score over
    every value, use `fourier_clustering(rounding_position(values))`.
    """
    return rounding_clustering(values).score


# --------------------------------------------------------------------------------------------------
# Part 3: the values the stock model is about to round
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    name: str
    group: str  # the kind of op, for tables
    paper: str  # what the paper reports for this kind: "near-uniform", "clustered" or "not reported"
    exact: bool  # True: pointwise op, the FP32 value is exact; False: matmul/attention recomputation
    qwen3_only: bool = False


LOCATIONS = tuple(
    Location(*row)
    for row in [
        ("q_proj", "projection", "near-uniform", False),
        ("k_proj", "projection", "near-uniform", False),
        ("v_proj", "projection", "near-uniform", False),
        ("q_norm.rsqrt", "Q/K norm x*rsqrt", "near-uniform", True, True),
        ("q_norm.weight", "Q/K norm *weight", "near-uniform", True, True),
        ("k_norm.rsqrt", "Q/K norm x*rsqrt", "near-uniform", True, True),
        ("k_norm.weight", "Q/K norm *weight", "near-uniform", True, True),
        ("rope.q_cos", "RoPE product", "clustered", True),
        ("rope.q_sin", "RoPE product", "clustered", True),
        ("rope.q_sum", "RoPE sum", "not reported", True),
        ("rope.k_cos", "RoPE product", "clustered", True),
        ("rope.k_sin", "RoPE product", "clustered", True),
        ("rope.k_sum", "RoPE sum", "not reported", True),
        ("attention", "attention", "near-uniform", False),
        ("o_proj", "projection", "near-uniform", False),
        ("residual_attn", "residual sum", "clustered", True),
        ("input_norm.rsqrt", "RMSNorm x*rsqrt", "near-uniform", True),
        ("input_norm.weight", "RMSNorm *weight", "near-uniform", True),
        ("post_norm.rsqrt", "RMSNorm x*rsqrt", "near-uniform", True),
        ("post_norm.weight", "RMSNorm *weight", "near-uniform", True),
        ("gate_proj", "projection", "near-uniform", False),
        ("up_proj", "projection", "near-uniform", False),
        ("silu", "SiLU", "clustered", True),
        ("swiglu", "SwiGLU product", "not reported", True),
        ("down_proj", "projection", "near-uniform", False),
        ("residual_mlp", "residual sum", "clustered", True),
    ]
)
LOCATION_BY_NAME = {loc.name: loc for loc in LOCATIONS}


class _Recorder:
    """Collects (fp32, bf16) pairs per location for one replayed layer; tensors stored as (B, T, ...)."""

    def __init__(self):
        self.fp32: dict[str, torch.Tensor] = {}
        self.bf16: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, fp32: torch.Tensor, bf16: torch.Tensor, heads_first: bool = False) -> None:
        assert name in LOCATION_BY_NAME, name
        assert fp32.dtype == torch.float32 and fp32.shape == bf16.shape, (name, fp32.dtype, fp32.shape, bf16.shape)
        if heads_first:  # (B, H, T, D) -> (B, T, H, D)
            fp32, bf16 = fp32.transpose(1, 2), bf16.transpose(1, 2)
        self.fp32[name] = fp32.contiguous()
        self.bf16[name] = bf16.contiguous()


def _linear_fp32(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.float()
    return torch.nn.functional.linear(x.float(), linear.weight.float(), bias)


def _replay_norm(norm, x: torch.Tensor, prefix: str, rec: _Recorder) -> torch.Tensor:
    """Stock RMSNorm, step by step: FP32 x*rsqrt, rounded, times the weight (BF16*BF16, exact in FP32)."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance + norm.variance_epsilon)
    normed_bf16 = normed.to(x.dtype)
    rec(f"{prefix}.rsqrt", normed, normed_bf16)
    out = norm.weight * normed_bf16
    rec(f"{prefix}.weight", norm.weight.float() * normed_bf16.float(), out)
    return out


def _replay_rope(x, cos, sin, tag: str, rotate_half, rec: _Recorder) -> torch.Tensor:
    """Stock apply_rotary_pos_emb for one of q/k: (x*cos) + (rotate_half(x)*sin), each op rounded."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    a = x * cos
    rec(f"rope.{tag}_cos", x.float() * cos.float(), a, heads_first=True)
    r = rotate_half(x)
    b = r * sin
    rec(f"rope.{tag}_sin", r.float() * sin.float(), b, heads_first=True)
    out = a + b
    rec(f"rope.{tag}_sum", a.float() + b.float(), out, heads_first=True)
    return out


def _attention_prerounding(attn, q, k, v, mask, fp32_recompute: torch.Tensor) -> torch.Tensor:
    """The FP32 attention output just before the BF16 kernel rounds it, as (B, T, H, D).

    PyTorch's CPU SDPA kernel for BF16 (flash attention on CPU) keeps the scores, the running max and the
    softmax denominator in FP32 but rounds the *unnormalised* probabilities exp(s - max) to BF16 before
    the product with V; its output is (P_bf16 @ V) / denominator, rounded once. For "sdpa" on CPU we
    mirror that (bitwise at these sequence lengths, where the kernel uses a single KV block, on CPUs where
    torch's exp is accurate; AVX2 builds use the approximate `fexp_u20`, relative error up to about 1e-4, so
    a few probabilities round the other way there); for "eager" (which rounds the normalised probabilities)
    and anything else we return the plain FP32 recomputation.
    """
    if attn.config._attn_implementation != "sdpa" or q.device.type != "cpu" or q.shape[2] > 256:
        return fp32_recompute
    n_rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(n_rep, dim=1)
    vf = v.float().repeat_interleave(n_rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * attn.scaling
    t_q, t_k = scores.shape[-2:]
    if mask is None:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    top = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - top)
    out = (e.to(q.dtype).float() @ vf) / e.sum(-1, keepdim=True)
    return out.transpose(1, 2)


def _replay_layer(layer, hidden_states: torch.Tensor, kwargs: dict, rec: _Recorder) -> torch.Tensor:
    """The stock Qwen2/Qwen3 decoder layer of transformers 5.19, one rounding location at a time."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(layer).__module__]
    attn, mlp = layer.self_attn, layer.mlp
    residual = hidden_states
    h = _replay_norm(layer.input_layernorm, hidden_states, "input_norm", rec)

    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    rec("q_proj", _linear_fp32(attn.q_proj, h), q)
    rec("k_proj", _linear_fp32(attn.k_proj, h), k)
    rec("v_proj", _linear_fp32(attn.v_proj, h), v)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if hasattr(attn, "q_norm"):
        q = _replay_norm(attn.q_norm, q, "q_norm", rec)
        k = _replay_norm(attn.k_norm, k, "k_norm", rec)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    q = _replay_rope(q, cos, sin, "q", modeling.rotate_half, rec)
    k = _replay_rope(k, cos, sin, "k", modeling.rotate_half, rec)

    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, modeling.eager_attention_forward)
    common = dict(dropout=0.0, scaling=attn.scaling, sliding_window=attn.sliding_window)
    mask = kwargs.get("attention_mask")
    a, _ = interface(attn, q, k, v, mask, **common)
    a_fp32 = _attention_prerounding(attn, q, k, v, mask, interface(attn, q.float(), k.float(), v.float(), mask, **common)[0])
    a = a.reshape(*h.shape[:-1], -1).contiguous()
    rec("attention", a_fp32.reshape(a.shape), a)
    o = attn.o_proj(a)
    rec("o_proj", _linear_fp32(attn.o_proj, a), o)

    s = residual + o
    rec("residual_attn", residual.float() + o.float(), s)
    h = _replay_norm(layer.post_attention_layernorm, s, "post_norm", rec)
    gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    rec("gate_proj", _linear_fp32(mlp.gate_proj, h), gate)
    rec("up_proj", _linear_fp32(mlp.up_proj, h), up)
    act = mlp.act_fn(gate)
    rec("silu", mlp.act_fn(gate.float()), act)
    prod = act * up
    rec("swiglu", act.float() * up.float(), prod)
    d = mlp.down_proj(prod)
    rec("down_proj", _linear_fp32(mlp.down_proj, prod), d)
    out = s + d
    rec("residual_mlp", s.float() + d.float(), out)
    return out


def _check_capturable(model) -> torch.nn.Module:
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise TypeError(f"capture_prerounding expects a Qwen2/Qwen3 *ForCausalLM or *Model, got {type(model).__name__}.")
    arch = type(base).__name__
    if arch not in ("Qwen2Model", "Qwen3Model"):
        raise TypeError(f"capture_prerounding supports Qwen2/Qwen3 only (its replay follows their layers), got {arch}.")
    dtype = base.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        raise TypeError(f"capture_prerounding needs a BF16 model (it records what BF16 rounds); this one is {dtype}.")
    try:
        from . import align
    except ImportError:  # pragma: no cover - align is developed alongside
        align = None
    if align is not None and align.current(model) is not None:
        raise RuntimeError("capture_prerounding records the stock model's rounding; undo the alignment first.")
    for name, module in base.named_modules():
        if "forward" in module.__dict__ and not has_fp32_matmul(module):  # the BF16 GEMM's kernel is not a patch
            raise RuntimeError(f"{name or 'model'} has a patched forward; capture_prerounding needs the stock model.")
    return base


@torch.no_grad()
def capture_prerounding(model, input_ids, attention_mask=None, *, layers: Iterable[int] | None = None,
                        locations: Iterable[str] | None = None, return_bf16: bool = False):
    """FP32 values just before the stock model rounds them: {location: {layer: tensor (B, T, ...)}}.

    `input_ids` (B, T) and `attention_mask` as for the model (right padding: slice out the real tokens
    with the mask, e.g. `tensor[mask.bool()]`). Each decoder layer's BF16 input is taken from one stock
    forward; the layer is then replayed op by op (see the module docstring), and the replayed output must
    equal the stock output bitwise (else RuntimeError). With `return_bf16=True` also returns the stock
    BF16 tensors at the same locations: `(fp32, bf16)`.
    """
    base = _check_capturable(model)
    input_ids = torch.as_tensor(input_ids)
    n_layers = len(base.layers)
    wanted_layers = list(range(n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < n_layers for i in wanted_layers):
        raise ValueError(f"layers must be in 0..{n_layers - 1}, got {wanted_layers}.")
    wanted_locs = None if locations is None else set(locations)
    if wanted_locs is not None and not wanted_locs <= set(LOCATION_BY_NAME):
        raise ValueError(f"unknown location(s) {sorted(wanted_locs - set(LOCATION_BY_NAME))}; see LOCATIONS.")

    seen = {}
    handles = []
    for i in wanted_layers:
        def pre(module, args, kwargs, i=i):
            hs = args[0] if args else kwargs["hidden_states"]
            seen[i] = {"input": hs, "kwargs": {k: v for k, v in kwargs.items() if k != "hidden_states"}}

        def post(module, args, kwargs, output, i=i):
            seen[i]["output"] = output[0] if isinstance(output, tuple) else output

        handles.append(base.layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(base.layers[i].register_forward_hook(post, with_kwargs=True))
    try:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    fp32 = {loc.name: {} for loc in LOCATIONS}
    bf16 = {loc.name: {} for loc in LOCATIONS}
    for i in wanted_layers:
        rec = _Recorder()
        out = _replay_layer(base.layers[i], seen[i]["input"], seen[i]["kwargs"], rec)
        stock = seen[i]["output"]
        if out.dtype != stock.dtype or not torch.equal(out.view(torch.int16), stock.view(torch.int16)):
            raise RuntimeError(f"the replay of layer {i} differs from the stock layer: the modeling code is not the one "
                               "rla_lib.rounding was written against (transformers 5.19).")
        for name in rec.fp32:
            if wanted_locs is None or name in wanted_locs:
                fp32[name][i] = rec.fp32[name]
                bf16[name][i] = rec.bf16[name]
    fp32 = {k: v for k, v in fp32.items() if v}
    bf16 = {k: v for k, v in bf16.items() if v}
    return (fp32, bf16) if return_bf16 else fp32


ROPE_LOCATIONS = ("rope.q_cos", "rope.q_sin", "rope.q_sum", "rope.k_cos", "rope.k_sin", "rope.k_sum")


@torch.no_grad()
def capture_rope_inputs(model, input_ids, attention_mask=None, *, layers: Iterable[int] | None = None):
    """{layer: (q, k)}: the BF16 query and key the stock model feeds to RoPE, as (B, T, heads, head_dim).

    That is after the projections and, for Qwen3, after the per-head Q/K norms; recorded with forward
    hooks on one stock forward.
    """
    base = _check_capturable(model)
    n_layers = len(base.layers)
    wanted = list(range(n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < n_layers for i in wanted):
        raise ValueError(f"layers must be in 0..{n_layers - 1}, got {wanted}.")
    seen: dict = {}
    handles = []
    for i in wanted:
        attn = base.layers[i].self_attn
        has_qk_norm = hasattr(attn, "q_norm")  # Qwen3: per-head norms, output already (B, T, H, D)
        for tag in ("q", "k"):
            module = getattr(attn, f"{tag}_norm" if has_qk_norm else f"{tag}_proj")

            def record(m, a, out, key=(i, tag), d=attn.head_dim, per_head=has_qk_norm):
                seen[key] = out if per_head else out.unflatten(-1, (-1, d))

            handles.append(module.register_forward_hook(record))
    try:
        base(input_ids=torch.as_tensor(input_ids), attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: (seen[i, "q"], seen[i, "k"]) for i in wanted}


@torch.no_grad()
def rope_prerounding(model, rope_inputs: dict, position_ids) -> dict:
    """The FP32 RoPE products and sums (`ROPE_LOCATIONS`) the stock model would round if the tokens of
    `rope_inputs` (`capture_rope_inputs`) sat at `position_ids` (B, T): {location: {layer: (B, T, H, D)}}.

    cos and sin come from the model's own `rotary_emb` (its rope_theta and rope type) in BF16, as in the
    stock forward, and the arithmetic is the stock `apply_rotary_pos_emb`'s, op by op (`_replay_rope`). The
    q/k values are the captured ones: what changes with position is the rotation, not the values rotated.
    """
    base = _check_capturable(model)
    modeling = sys.modules[type(base).__module__]
    position_ids = torch.as_tensor(position_ids)
    out = {name: {} for name in ROPE_LOCATIONS}
    for layer, (q, k) in rope_inputs.items():
        if tuple(position_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, the tokens {tuple(q.shape[:2])}.")
        cos, sin = base.rotary_emb(q, position_ids)
        rec = _Recorder()
        _replay_rope(q.transpose(1, 2), cos, sin, "q", modeling.rotate_half, rec)
        _replay_rope(k.transpose(1, 2), cos, sin, "k", modeling.rotate_half, rec)
        for name in ROPE_LOCATIONS:
            out[name][layer] = rec.fp32[name]
    return out


def task_positions(input_ids) -> torch.Tensor:
    """(B, T) positions 0..T-1: what the stock forward uses for right-padded rows without position_ids."""
    b, t = torch.as_tensor(input_ids).shape
    return torch.arange(t).expand(b, t)


def uniform_positions(shape, max_position: int, seed: int = 0) -> torch.Tensor:
    """(B, T) positions drawn independently and uniformly from [0, max_position): tokens of long contexts."""
    if max_position < 1:
        raise ValueError(f"max_position must be at least 1, got {max_position}.")
    return torch.randint(0, int(max_position), tuple(shape), generator=torch.Generator().manual_seed(seed))


def positions_label(positions) -> str:
    """'task' or 'uniform [0, 4096)': how a `positions` setting appears in tables."""
    return "task" if positions == "task" else f"uniform [0, {int(positions)})"


def capture_rope_at_positions(model, input_ids, attention_mask=None, positions="task", *, seed: int = 0,
                              layers: Iterable[int] | None = None) -> dict:
    """`rope_prerounding` of the task tokens' own q/k at `positions`: "task" (the positions the stock
    forward uses: with "task" the result equals `capture_prerounding`'s RoPE locations bitwise), an int P
    (each token at a position drawn uniformly from [0, P), seeded), or a (B, T) tensor of positions."""
    rope_inputs = capture_rope_inputs(model, input_ids, attention_mask, layers=layers)
    shape = torch.as_tensor(input_ids).shape
    if isinstance(positions, str):
        if positions != "task":
            raise ValueError(f'positions must be "task", an int max position or a tensor, got {positions!r}.')
        position_ids = task_positions(input_ids)
    elif isinstance(positions, int):
        position_ids = uniform_positions(shape, positions, seed)
    else:
        position_ids = torch.as_tensor(positions)
    return rope_prerounding(model, rope_inputs, position_ids)


def distinct_prefix_mask(input_ids, attention_mask=None) -> torch.Tensor:
    """(B, T) bool: real tokens whose prefix (tokens 0..t) has not appeared earlier in the batch.

    In a causal model the values at position t depend only on tokens 0..t, so a repeated prefix repeats
    every value: counting it twice is not an independent sample.
    """
    ids = torch.as_tensor(input_ids)
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
    out = torch.zeros_like(mask)
    seen = set()
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if mask[b, t]:
                key = tuple(ids[b, : t + 1].tolist())
                if key not in seen:
                    seen.add(key)
                    out[b, t] = True
    return out


def distinct_value_floor(values) -> tuple[int, float]:
    """(number of distinct values, the floor the score has when only the distinct values are random).

    A tensor whose n values take d distinct values with counts n_1..n_d behaves like d weighted samples:
    if each distinct value's position were independent and uniform, E|c_k|^2 = sum_j (n_j/n)^2, so the
    score sits near sqrt(sum_j (n_j/n)^2) (= 1/sqrt(n) when all values differ). A score at this floor
    is explained by few distinct values, not by positions bunching up.
    """
    v = _as_fp32(values).reshape(-1)
    if v.numel() == 0:
        raise ValueError("no values given.")
    s = torch.sort(v.contiguous().view(torch.int32))[0]
    starts = torch.cat([torch.tensor([True]), s[1:] != s[:-1]]).nonzero()[:, 0]
    counts = torch.diff(torch.cat([starts, torch.tensor([s.numel()])])).double()
    return int(counts.numel()), float(torch.sqrt(((counts / v.numel()) ** 2).sum()))


def clustering_table(captures: dict, token_mask=None, n_coeffs: int = N_COEFFS):
    """One row per (location, layer) with the fields of `rounding_clustering` (a pandas DataFrame).

    `captures` is `capture_prerounding`'s (or `capture_rope_at_positions`') output; `token_mask` (B, T)
    selects the tokens to count. Scores and floors are over the values that actually round (`n` of
    `n_all`); `exact_frac` and `tie_frac` are shares of all `n_all` values.
    """
    import pandas as pd

    rows = []
    for name, per_layer in captures.items():
        loc = LOCATION_BY_NAME[name]
        for layer, values in per_layer.items():
            v = values[torch.as_tensor(token_mask).bool()] if token_mask is not None else values
            stats = rounding_clustering(v, n_coeffs)
            rows.append(dict(location=name, group=loc.group, paper=loc.paper, exact=loc.exact, layer=layer, **stats.as_dict()))
    return pd.DataFrame(rows)


def summarize_clustering(table):
    """Per location (rows in table order): median, min and max over layers of the score, medians of the
    floors and of every other field, and `x_floor` = median / floor. Layers with nothing to round (NaN
    score) are left out of the median and counted in `layers_without_rounding`."""
    g = table.groupby("location", sort=False)
    out = g.agg(group=("group", "first"), paper=("paper", "first"), layers=("layer", "count"),
                layers_without_rounding=("score", lambda x: int(x.isna().sum())),
                median=("score", "median"), min=("score", "min"), max=("score", "max"),
                floor=("floor", "median"), n=("n", "median"), n_all=("n_all", "median"),
                distinct=("distinct", "median"), distinct_floor=("distinct_floor", "median"),
                exact_frac=("exact_frac", "median"), tie_frac=("tie_frac", "median"),
                score_without_ties=("score_without_ties", "median"), mean_error=("mean_error", "median"),
                mean_error_se=("mean_error_se", "median"), score_all_values=("score_all_values", "median"))
    out["x_floor"] = out["median"] / out["floor"]
    return out


# --------------------------------------------------------------------------------------------------
# Part 4: demonstrations
# --------------------------------------------------------------------------------------------------

_OPS = {
    "*": lambda x, a: x * a,
    "+": lambda x, a: x + a,
    "-": lambda x, a: x - a,
    "/": lambda x, a: x / a,
}
_FUNCS = {
    "silu": torch.nn.functional.silu,
    "exp": torch.exp,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "square": torch.square,
    "neg": torch.neg,
}


def parse_chain(chain: str | Sequence[str]) -> list[str]:
    """'*3, +0.25, silu' -> ['*3', '+0.25', 'silu'], each checked (ops: * + - / with a number, or a function)."""
    steps = [s.strip() for s in (chain.split(",") if isinstance(chain, str) else chain) if s.strip()]
    for s in steps:
        if s not in _FUNCS and not re.fullmatch(r"[*+\-/]\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s):
            raise ValueError(f"cannot parse op {s!r}: use *NUMBER, +NUMBER, -NUMBER, /NUMBER or one of {', '.join(_FUNCS)}.")
    return steps


def _apply(step: str, x: torch.Tensor) -> torch.Tensor:
    if step in _FUNCS:
        return _FUNCS[step](x)
    return _OPS[step[0]](x, torch.tensor(float(step[1:]), dtype=torch.float32))


@dataclass(frozen=True)
class ChainResult:
    value: float  # the FP32 input (output of the first op, as FP32)
    steps: tuple[str, ...]
    unfused: tuple[float, ...]  # BF16 value after each op, each op reading the previous rounded value
    fused_fp32: tuple[float, ...]  # FP32 intermediates of the fused kernel
    fused: float  # the fused kernel's single rounding of its last FP32 value
    step_difference: int  # fused minus unfused, in BF16 steps at the output

    def __str__(self) -> str:
        lines = [f"input {self.value!r} (FP32), ops: {', '.join(self.steps) or 'none'}"]
        lines.append(f"  unfused (round after every op): {self.unfused[0]!r} -> " + " -> ".join(map(repr, self.unfused[1:])))
        lines.append(f"  fused (FP32 inside, round once): {self.fused_fp32[0]!r} -> "
                     + " -> ".join(f"{v!r}" for v in self.fused_fp32[1:]) + f" -> rounded {self.fused!r}")
        lines.append(f"  difference: {self.step_difference:+d} BF16 step(s) (ulp at the output: {float(bf16_ulp(self.fused))})")
        return "\n".join(lines)


def _run_chain(x: torch.Tensor, steps: Sequence[str]):
    """(unfused values after each op, fused FP32 values after each op) for an FP32 tensor x."""
    u = round_bf16(x).float()
    unfused, fused = [u], [x]
    for s in steps:
        u = round_bf16(_apply(s, u)).float()
        x = _apply(s, x)
        unfused.append(u)
        fused.append(x)
    return unfused, fused


def chain_rounding(value: float, chain: str | Sequence[str] = "*3") -> ChainResult:
    """Evaluate `chain` on `value` as separate BF16 kernels (unfused) and as one fused kernel.

    Every op computes in FP32 either way (as PyTorch's BF16 kernels do); unfused rounds the input and each
    result to BF16, fused keeps FP32 throughout and rounds only the final value.
    """
    steps = parse_chain(chain)
    x = _as_fp32(float(value))
    unfused, fused = _run_chain(x, steps)
    f = round_bf16(fused[-1]).float()
    if not (torch.isfinite(f) and torch.isfinite(unfused[-1])):
        raise ValueError("the chain left the finite BF16 range.")
    return ChainResult(float(x), tuple(steps), tuple(map(float, unfused)), tuple(map(float, fused)), float(f),
                       int(bf16_steps(unfused[-1], f)))


def chain_step_differences(values, chain: str | Sequence[str] = "*3") -> torch.Tensor:
    """`chain_rounding(...).step_difference` for every element of an FP32 tensor (int64 tensor)."""
    x = _as_fp32(values)
    unfused, fused = _run_chain(x, parse_chain(chain))
    f = round_bf16(fused[-1]).float()
    ok = torch.isfinite(f) & torch.isfinite(unfused[-1])
    if not bool(ok.all()):
        raise ValueError("the chain left the finite BF16 range for some inputs.")
    return bf16_steps(unfused[-1], f)


def _attention_probe_name() -> str:
    return "rla_rounding_probe"


@contextlib.contextmanager
def record_region_outputs(model, layer: int = 0):
    """Record the outputs of the three aligned regions in one decoder layer, stock or aligned alike.

    Yields a dict filled during the forward: "rope" -> (q, k) as the attention kernel receives them
    (rotated, BF16), "swiglu" -> the input of down_proj (the rounded SwiGLU product), "residual_norm" ->
    the output of post_attention_layernorm (the norm reading the residual sum). Uses forward hooks and a
    registered attention function that records its inputs and then calls the model's own attention.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = getattr(model, "model", model)
    target = base.layers[layer]
    record: dict = {}
    original = base.config._attn_implementation
    modeling = sys.modules[type(target).__module__]
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(original, modeling.eager_attention_forward)

    def probe(module, query, key, value, attention_mask, **kw):
        if module is target.self_attn:
            record["rope"] = (query.detach().clone(), key.detach().clone())
        return inner(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_attention_probe_name(), probe)
    handles = [
        target.mlp.down_proj.register_forward_pre_hook(lambda m, args: record.__setitem__("swiglu", args[0].detach().clone())),
        target.post_attention_layernorm.register_forward_hook(
            lambda m, args, out: record.__setitem__("residual_norm", out.detach().clone())),
    ]
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    try:
        for c in configs.values():
            c._attn_implementation = _attention_probe_name()
        yield record
    finally:
        for c in configs.values():
            c._attn_implementation = original
        for h in handles:
            h.remove()


def region_difference(stock: torch.Tensor, other: torch.Tensor) -> dict:
    """How two BF16 tensors of one region output differ.

    `differing` elements, `one_step` (how many of them are one BF16 step apart), `max_steps`, and
    `max_diff_rms`, the largest |difference| in units of the tensor's RMS. Step counts grow without
    bound near zero (BF16 values get dense there), so a result that nearly cancels can be many steps
    apart while the difference itself stays tiny: read `max_steps` together with `max_diff_rms`.
    """
    a, b = stock.float().reshape(-1), other.to(stock.dtype).float().reshape(-1)
    steps = bf16_steps(a, b).abs()
    rms = float(a.pow(2).mean().sqrt())
    return dict(elements=a.numel(), differing=int((steps > 0).sum()), frac_differing=float((steps > 0).double().mean()),
                one_step=int((steps == 1).sum()), max_steps=int(steps.max()),
                max_diff_rms=float((a - b).abs().max()) / rms if rms > 0 else 0.0)


@torch.no_grad()
def layerwise_divergence(model, input_ids, attention_mask, regions, token_mask=None, **align_options):
    """Stock vs aligned (`regions`, options): how far apart each decoder layer's output, the final norm and
    the logits are, on the tokens of `token_mask` (default: `attention_mask`).

    Returns a pandas DataFrame, one row per stage ("layer 0" .. "layer L-1", "final norm", "logits"):
    relative L2 difference and fraction of differing elements. Layer outputs are compared after rounding
    to BF16 (an aligned residual stream may be carried in FP32 between layers).
    """
    import pandas as pd

    from .align import aligned

    base = getattr(model, "model", model)
    modules = [(f"layer {i}", layer) for i, layer in enumerate(base.layers)] + [("final norm", base.norm)]

    def run():
        seen = {}
        handles = [m.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(
            name, (out[0] if isinstance(out, tuple) else out).to(torch.bfloat16).float())) for name, m in modules]
        try:
            seen["logits"] = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        finally:
            for h in handles:
                h.remove()
        return seen

    stock = run()
    with aligned(model, regions, **align_options):
        other = run()
    mask = token_mask if token_mask is not None else attention_mask
    mask = torch.ones(input_ids.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    rows = []
    for name in [n for n, _ in modules] + ["logits"]:
        a, b = stock[name][mask], other[name][mask]
        rows.append(dict(stage=name, rel_diff=float((a - b).norm() / a.norm()), frac_differing=float((a != b).double().mean())))
    return pd.DataFrame(rows)


__all__ = [
    "BF16_MIN_SUBNORMAL", "LOCATIONS", "LOCATION_BY_NAME", "Location", "N_COEFFS", "ROPE_LOCATIONS", "ChainResult",
    "RoundingClustering", "bf16_grid", "capture_rope_at_positions", "capture_rope_inputs", "positions_label",
    "rope_prerounding", "rounding_clustering", "task_positions", "uniform_positions",
    "bf16_neighbors", "bf16_steps", "bf16_ulp", "capture_prerounding", "chain_rounding", "chain_step_differences", "clustering_score",
    "clustering_table", "distinct_prefix_mask", "distinct_value_floor", "fourier_clustering", "fourier_coefficients", "layerwise_divergence",
    "parse_chain", "record_region_outputs", "region_difference", "round_bf16", "rounding_position",
    "summarize_clustering", "uniform_floor",
]
