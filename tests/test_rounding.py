"""rla_lib.rounding: exact BF16 helpers, rounding positions and their clustering score, the op-chain toy."""

import math

import numpy as np
import pytest
import torch

from rla_lib import rounding as R


U7, U6 = 2.0**-7, 2.0**-6  # BF16 spacing in [1, 2) and [2, 4)


def f32(*values):
    return torch.tensor(values, dtype=torch.float32)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def random_fp32(n=200_000, seed=0):
    """Finite FP32 values from every binade (random bit patterns) plus scaled normals."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    scales = 10.0 ** torch.randint(-40, 39, (n,), generator=g).double()
    y = (torch.randn(n, generator=g, dtype=torch.float64) * scales).float()
    return torch.cat([x, y[torch.isfinite(y)], f32(0.0, -0.0)])


# ------------------------------------------------------------------------------------------------ round_bf16


def test_round_bf16_hand_cases():
    assert R.round_bf16(f32(1.003, 3.009)).float().tolist() == [1.0, 3.015625]
    # ties go to the even mantissa
    assert R.round_bf16(f32(1 + 2**-8)).item() == 1.0  # between 1.0 (even) and 1.0078125 (odd)
    assert R.round_bf16(f32(1 + 3 * 2**-8)).item() == 1 + 2 * U7  # between ...0078125 (odd) and ...015625 (even)
    assert R.round_bf16(f32(-(1 + 2**-8))).item() == -1.0
    assert R.round_bf16(f32(1 + 2**-8 + 2**-20)).item() == 1 + U7  # just above the tie
    # subnormals: BF16's smallest is 2**-133
    assert R.round_bf16(f32(2.0**-140)).item() == 0.0
    assert R.round_bf16(f32(2.0**-134)).item() == 0.0  # tie with 0 (even)
    assert R.round_bf16(f32(3 * 2.0**-134)).item() == 2.0**-132  # tie, to the even 2 * 2**-133
    assert R.round_bf16(f32(2.0**-133 * 1.4)).item() == 2.0**-133
    # overflow and non-finite
    assert R.round_bf16(f32(3.4e38)).item() == math.inf
    assert R.round_bf16(f32(-math.inf)).item() == -math.inf
    assert math.isnan(R.round_bf16(f32(math.nan)).item())
    assert R.round_bf16(f32(-0.0)).view(torch.int16).item() == -32768  # the sign of zero is kept


def test_round_bf16_matches_torch_bitwise_on_random_tensors():
    x = random_fp32()
    assert bits_equal(R.round_bf16(x), x.to(torch.bfloat16))
    sub = x[(x.abs() < 2.0**-126) & (x != 0)]
    assert sub.numel() > 10  # subnormals were covered
    assert bits_equal(R.round_bf16(sub), sub.to(torch.bfloat16))
    # non-contiguous and shaped input
    y = x[: 60_000].reshape(300, 200).t()
    assert bits_equal(R.round_bf16(y), y.to(torch.bfloat16))
    special = f32(math.inf, -math.inf, math.nan)
    assert bits_equal(R.round_bf16(special), special.to(torch.bfloat16))


def test_inputs_other_than_fp32():
    assert R.round_bf16(1.003).item() == 1.0  # a Python float is taken as FP32
    b = torch.tensor([1.5, -3.0], dtype=torch.bfloat16)
    assert bits_equal(R.round_bf16(b), b)
    with pytest.raises(TypeError, match="FP64"):
        R.round_bf16(torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(TypeError):
        R.bf16_ulp(torch.tensor([1]))


# ------------------------------------------------------------------------------------------------ ulp, neighbours, position


def test_round_mantissa():
    x = random_fp32()
    x = x[x.abs() < 3e38]  # round_bf16 sends the very top to inf, as does round_mantissa
    assert torch.equal(R.round_mantissa(x, 7), R.round_bf16(x).float())
    assert torch.equal(R.round_mantissa(x, 23), x)
    assert R.round_mantissa(f32(1.0625, 1.1875, 1.06, -3.3, 15.9), 3).tolist() == [1.0, 1.25, 1.0, -3.25, 16.0]  # ties to even
    for bits in (1, 3, 5):
        r = R.round_mantissa(x, bits)
        assert not (r.view(torch.int32) & ((1 << (23 - bits)) - 1)).any()  # only `bits` mantissa bits left
        normal = (x.abs() > 2.0**-120) & (x.abs() < 1e38)  # (near the top, coarse steps round up to inf)
        step = 2.0 ** (torch.floor(torch.log2(x[normal].abs().double())) - bits)
        assert ((r[normal].double() - x[normal].double()).abs() <= step / 2).all()  # nearest
    with pytest.raises(ValueError, match="bits"):
        R.round_mantissa(x, 24)


def test_ulp_hand_cases():
    x = f32(1.5, 1.0, 3.0, -3.0, 2.0, 1.9999, 0.75, 0.0, 2.0**-126, 2.0**-125, 2.0**-130, 3e38)
    want = [U7, U7, U6, U6, U6, U7, 2.0**-8, 2.0**-133, 2.0**-133, 2.0**-132, 2.0**-133, 2.0**120]
    assert R.bf16_ulp(x).tolist() == want


def test_neighbors_hand_cases():
    lo, hi = R.bf16_neighbors(f32(1.003, -1.003, 3.009, 1.5, -0.999, 0.0))
    assert lo.tolist() == [1.0, -1 - U7, 3.0, 1.5, -1.0, 0.0]
    assert hi.tolist() == [1 + U7, -1.0, 3 + U6, 1.5, -1 + 2.0**-8, 0.0]
    lo, hi = R.bf16_neighbors(f32(3.4e38))  # above the largest finite BF16: the upper neighbour is inf
    assert hi.item() == math.inf and lo.item() == R.BF16_MAX


def test_position_hand_cases():
    p = R.rounding_position(f32(1.003, -1.003, 1 + 2**-8, -(1 + 2**-8), 1.0, -1.0, 3.009, 2.0**-133 * 1.25))
    np.testing.assert_allclose(p.numpy(), [0.384, 0.616, 0.5, 0.5, 0.0, 0.0, 0.576, 0.25], atol=2**-16)


def test_neighbors_ulp_position_properties_on_random_tensors():
    x = random_fp32(seed=1)
    x = x[x.abs() < R.BF16_MAX]  # keep both neighbours finite
    lo, hi = R.bf16_neighbors(x)
    ulp, pos = R.bf16_ulp(x), R.rounding_position(x)
    for v in (lo, hi):
        assert bits_equal(v.to(torch.bfloat16).float(), v)  # exact BF16 values
    assert bool(((lo <= x) & (x <= hi)).all())
    exact = lo == hi
    assert torch.equal(exact, x.to(torch.bfloat16).float() == x)
    assert torch.equal((hi - lo)[~exact], ulp[~exact])
    # rounding picks one of them, the nearer one
    r = R.round_bf16(x).float()
    assert bool(((r == lo) | (r == hi)).all())
    tie = pos == 0.5
    assert torch.equal(r[~tie], torch.where(pos < 0.5, lo, hi)[~tie])
    assert bool(((R.round_bf16(x[tie]).view(torch.int16) & 1) == 0).all())  # ties: the even neighbour
    # position is (x - lower) / ulp, exactly, in [0, 1)
    want = (x.double() - lo.double()) / ulp.double()
    assert torch.equal(pos.double(), want)
    assert bool(((pos >= 0) & (pos < 1)).all()) and bool((pos[exact] == 0).all())


@pytest.mark.parametrize("fn", [R.bf16_ulp, R.bf16_neighbors, R.rounding_position])
def test_non_finite_is_rejected(fn):
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="finite"):
            fn(f32(1.0, bad))


def test_steps_and_grid():
    assert R.bf16_steps(f32(3.0), f32(3.015625)).item() == 1
    assert R.bf16_steps(f32(2.0 - U7), f32(2.0)).item() == 1  # across a binade
    assert R.bf16_steps(f32(-(2.0**-133)), f32(2.0**-133)).item() == 2  # across zero
    assert R.bf16_steps(f32(0.0), f32(-0.0)).item() == 0
    with pytest.raises(ValueError, match="representable"):
        R.bf16_steps(f32(1.0), f32(1.003))
    g = R.bf16_grid(1.0, 4.0)
    assert g[0].item() == 1.0 and g[-1].item() == 4.0 and len(g) == 128 + 128 + 1
    d = torch.diff(g)
    assert bool((d[g[:-1] < 2] == U7).all()) and bool((d[g[:-1] >= 2] == U6).all())
    assert R.bf16_grid(-1.01, -0.99).tolist() == [-1 - U7, -1.0, -1 + 2**-8, -1 + 2 * 2**-8]


def test_toy_chain():
    r = R.chain_rounding(1.003, "*3")
    assert r.unfused == (1.0, 3.0) and r.fused == 3.015625 and r.step_difference == 1
    assert R.chain_rounding(1.5, "*3").step_difference == 0  # exact input: fusion changes nothing
    x = f32(1.003, 1.5, 1.0 + 2**-9)
    assert R.chain_step_differences(x, "*3").tolist() == [1, 0, 0]
    assert R.chain_step_differences(x, "*3, +0.25, silu")[0].item() == R.chain_rounding(1.003, "*3, +0.25, silu").step_difference
    assert R.parse_chain("*3, +0.25 ,silu") == ["*3", "+0.25", "silu"]
    with pytest.raises(ValueError, match="cannot parse"):
        R.parse_chain("*three")


# ------------------------------------------------------------------------------------------------ clustering


def test_clustering_uniform_is_near_the_floor():
    for n, seed in [(1000, 0), (20_000, 1)]:
        p = torch.rand(n, generator=torch.Generator().manual_seed(seed))
        floor = R.uniform_floor(n)
        assert floor == 1 / math.sqrt(n)
        assert floor / 3 < R.fourier_clustering(p) < 3 * floor
    # positions on the 2**-16 grid (the histogram path) agree
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(2)) * 100
    assert R.rounding_clustering(x).score < 3 * R.uniform_floor(x.numel())


def test_clustering_single_and_two_points():
    assert R.fourier_clustering(torch.zeros(100)) == pytest.approx(1.0, abs=1e-12)
    assert R.fourier_clustering(torch.full((7,), 0.3713)) == pytest.approx(1.0, abs=1e-12)
    # half at 0, half at 0.5: |c_k| = 1 for even k, 0 for odd k
    assert R.fourier_clustering(torch.tensor([0.0, 0.5] * 50)) == pytest.approx(math.sqrt(0.5), abs=1e-12)


def test_distinct_value_floor():
    assert R.distinct_value_floor(f32(1.0, 2.0, 3.0, 4.0)) == (4, 0.5)
    d, floor = R.distinct_value_floor(f32(*([1.0] * 6 + [2.0] * 2)))
    assert d == 2 and floor == pytest.approx(math.sqrt(0.75**2 + 0.25**2))
    # a few distinct values repeated many times: the score sits near this floor, far above 1/sqrt(n)
    base = torch.randn(50, generator=torch.Generator().manual_seed(4))
    x = base.repeat(400)
    d, floor = R.distinct_value_floor(x)
    assert d == 50 and floor == pytest.approx(1 / math.sqrt(50))
    assert floor / 3 < R.rounding_clustering(x).score < 3 * floor


def test_fourier_coefficients_histogram_path_equals_direct_sum():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    p = R.rounding_position(x)
    k = np.arange(1, 17)[:, None]
    direct = np.exp(-2j * np.pi * k * p.double().numpy()[None]).mean(-1)
    np.testing.assert_allclose(R.fourier_coefficients(p).numpy(), direct, atol=1e-12)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        R.fourier_coefficients(torch.tensor([1.0]))


def grid_values(n, seed=0):
    """n FP32 values that are BF16 numbers (no rounding error)."""
    return R.round_bf16(torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10).float()


def off_grid_values(n, seed=1):
    """n FP32 values with uniformly random nonzero low 16 bits: uniform rounding positions, none exact."""
    g = torch.Generator().manual_seed(seed)
    high = grid_values(n, seed).view(torch.int32)
    low = torch.randint(1, 65536, (n,), generator=g, dtype=torch.int32)
    return (high | low).view(torch.float32)


def test_uniform_positions_sit_at_the_floor():
    v = off_grid_values(100_000)
    c = R.rounding_clustering(v)
    assert c.n == c.n_all == v.numel() and c.exact_frac == 0.0
    assert c.floor == 1 / math.sqrt(c.n)
    # n * score**2 is a mean of 16 independent Exp(1) variables (sd 0.25): a factor 3 is far outside it
    assert c.floor / 3 < c.score < 3 * c.floor
    assert c.floor / 3 < c.score_without_ties < 3 * c.floor
    # the mean signed error of uniform positions: within 5 standard errors of zero
    assert c.mean_error_se == pytest.approx(1 / math.sqrt(12 * c.distinct), rel=0.05)
    assert abs(c.mean_error) < 5 * c.mean_error_se


def test_grid_values_are_excluded_and_floors_use_the_filtered_sample():
    on, off = grid_values(30_000, seed=2), off_grid_values(10_000, seed=3)
    c = R.rounding_clustering(torch.cat([on, off]))
    assert (c.n_all, c.n) == (40_000, 10_000) and c.exact_frac == 0.75
    # bitwise the score, floors and distinct count of the off-grid part alone
    alone = R.rounding_clustering(off)
    for field in ("score", "floor", "distinct", "distinct_floor", "score_without_ties", "mean_error"):
        assert getattr(c, field) == getattr(alone, field), field
    assert c.floor / 3 < c.score < 3 * c.floor
    # counting the grid values as well is what made such a sample look clustered
    assert R.fourier_clustering(R.rounding_position(torch.cat([on, off]))) > 0.5


def test_a_sample_of_grid_values_only_gives_nan():
    c = R.rounding_clustering(grid_values(1000))
    assert c.n == 0 and c.n_all == 1000 and c.exact_frac == 1.0 and c.tie_frac == 0.0
    assert all(math.isnan(getattr(c, f)) for f in ("score", "floor", "distinct_floor", "score_without_ties", "mean_error"))
    assert math.isnan(R.rounding_clustering(torch.zeros(10)).score)
    with pytest.raises(ValueError, match="no finite values"):
        R.rounding_clustering(torch.tensor([float("nan"), float("inf")]))


def test_ties_round_to_the_even_neighbour_both_ways():
    # 1 + (2j+1) 2**-8 lies halfway between 1 + j 2**-7 and the next BF16 value: even j rounds down, odd j up
    ties = 1 + (2 * torch.arange(128, dtype=torch.float32) + 1) * 2.0**-8
    c = R.rounding_clustering(torch.cat([ties, -ties]))
    assert c.n == 256 and c.tie_frac == 1.0 and c.exact_frac == 0.0
    assert c.score == pytest.approx(1.0, abs=1e-12)  # all at one position: the score counts them as clustered
    assert c.mean_error == 0.0  # ... but their errors cancel exactly: half +1/2, half -1/2
    assert math.isnan(c.score_without_ties)
    # mixed with uniform positions, the tie share is reported and removing the ties restores the floor
    off = off_grid_values(20_000, seed=4)
    mixed = R.rounding_clustering(torch.cat([off, ties.repeat(40)]))
    assert mixed.tie_frac == pytest.approx((5120 + int((R.rounding_position(off) == 0.5).sum())) / mixed.n_all)
    assert mixed.score > 5 * mixed.floor and mixed.score_without_ties < 3 / math.sqrt(20_000)
