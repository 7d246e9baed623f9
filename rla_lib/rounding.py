"""BF16 rounding with exact semantics, rounding positions and their clustering, and the op-chain toy.

Pure arithmetic on tensors (torch only). Where a Transformers model rounds, and the values it is about to
round, are `rla_lib.studies.prerounding`; per-location tables and the paper's claims are `rla_lib.studies.location_clustering`.

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
- `bf16_steps(a, b)`: how many BF16 steps b lies above a (both BF16-representable); `region_difference`
  summarises two BF16 tensors' differences in those steps.

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
example the same prefix scored twice) are not independent (`location_clustering.distinct_prefix_mask`
removes those).

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

Part 3, the toy of notebook 01: a chain of pointwise ops evaluated unfused (rounded after every op) and
fused (rounded once), `chain_rounding` for one value and `chain_step_differences` for many.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Part 1: BF16 arithmetic
# --------------------------------------------------------------------------------------------------

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


def region_difference(stock: torch.Tensor, other: torch.Tensor) -> dict:
    """How two BF16 tensors differ (e.g. one region's output, stock vs aligned).

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


def _signed_error_ulp(v: torch.Tensor) -> torch.Tensor:
    """(round_bf16(v) - v) / ulp, exact: both are within one BF16 step, and ulp is a power of two."""
    return ((round_bf16(v).float() - v) / bf16_ulp(v)).double()


def rounding_clustering(values) -> RoundingClustering:
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
    score_all_values = fourier_clustering(pos)
    rounds = pos != 0
    ties = pos == 0.5
    exact_frac, tie_frac = float((~rounds).double().mean()), float(ties.double().mean())
    v, pos, ties = v[rounds], pos[rounds], ties[rounds]
    nan = float("nan")
    if v.numel() == 0:
        return RoundingClustering(n_all, 0, exact_frac, tie_frac, nan, nan, 0, nan, nan, nan, nan, score_all_values)
    distinct, distinct_floor = distinct_value_floor(v)
    without_ties = fourier_clustering(pos[~ties]) if bool((~ties).any()) else nan
    return RoundingClustering(n_all, v.numel(), exact_frac, tie_frac, fourier_clustering(pos),
                              uniform_floor(v.numel()), distinct, distinct_floor, without_ties,
                              float(_signed_error_ulp(v).mean()), distinct_floor / math.sqrt(12.0), score_all_values)


# --------------------------------------------------------------------------------------------------
# Part 3: the op-chain toy
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
