"""rla_lib.rounding: exact BF16 helpers, the clustering score, and the capture of pre-rounding values."""

import copy
import math

import numpy as np
import pytest
import torch

from rla_lib import rounding as R
from rla_lib.models import EMBEDDED_MODELS
from tiny_models import batch, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

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
    assert R.clustering_score(x) < 3 * R.uniform_floor(x.numel())


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
    assert floor / 3 < R.clustering_score(x) < 3 * floor


def test_fourier_coefficients_histogram_path_equals_direct_sum():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    p = R.rounding_position(x)
    k = np.arange(1, 17)[:, None]
    direct = np.exp(-2j * np.pi * k * p.double().numpy()[None]).mean(-1)
    np.testing.assert_allclose(R.fourier_coefficients(p).numpy(), direct, atol=1e-12)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        R.fourier_coefficients(torch.tensor([1.0]))


# ------------------------------------------------------------------------------------------------ capture


def stock_module_outputs(model, ids, mask):
    """BF16 outputs of the stock modules that are rounding locations, via forward hooks."""
    base = model.model
    seen, handles = {}, []
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj", "silu": "mlp.act_fn", "input_norm.weight": "input_layernorm",
             "post_norm.weight": "post_attention_layernorm", "q_norm.weight": "self_attn.q_norm",
             "k_norm.weight": "self_attn.k_norm", "residual_mlp": ""}
    for i, layer in enumerate(base.layers):
        for loc, path in names.items():
            try:
                module = layer.get_submodule(path) if path else layer
            except AttributeError:  # Qwen2 has no Q/K norm
                continue
            handles.append(module.register_forward_hook(
                lambda m, a, out, key=(loc, i): seen.__setitem__(key, out[0] if isinstance(out, tuple) else out)))
    with torch.no_grad():
        base(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return seen


# Non-pointwise locations: the stock BF16 kernel sums in its own order, with its own exp (CPU-dependent), so the
# captured FP32 value (our recomputation) is not bitwise the kernel's. Each check below states a bound on
# |kernel's FP32 value - ours| and requires the stock BF16 value to be a rounding of something within it.
FP32_U = 2.0**-24  # FP32 unit roundoff
# exp inside torch's CPU flash attention: AVX2 builds use `fexp_u20` (a cubic in 2**frac), max relative error
# 1.06e-4 = 2**-13.2 (emulated bitwise against the kernel under ATEN_CPU_CAPABILITY=avx2); AVX512 builds use an
# exp within 20 FP32 ulps. 2**-12 covers both with a 2.3x margin.
KERNEL_EXP_REL_ERR = 2.0**-12
# Floors on the share of values whose rounding agrees (real tokens). A value rounds differently only when it lies
# within the kernel's error of a rounding boundary: with error eps*|y| the chance is about 2*eps*|y|/ulp(y), and
# ulp(y) >= 2**-8*|y|. The share is deterministic for given inputs and kernel; it changes with the kernel.
# - matmul: two FP32 sums of n <= 768 exact BF16 products in different orders differ by about sqrt(n)*u*sum|x w|
#   (random-walk rounding errors), 2**-19 relative when sum|x w| ~ |y|: about 2**-10 (0.1%) of values differ;
#   measured <= 0.09% on both AVX512 and AVX2 kernels. Floor 99%: 10x margin.
# - attention: a probability's BF16 rounding flips with chance (its pre-rounding error)/step, so the share grows
#   linearly with the kernel's exp error. AVX2's exp (max error 2**-13.2) gives <= 1.7% differing here (AVX512's
#   accurate exp <= 0.1%); an exp at the full KERNEL_EXP_REL_ERR everywhere would give <= 2.3 x 1.7% = 3.9%.
#   Floor 95%, still above a capture that skips the kernel's BF16 probabilities (85-94% equal here).
EQUAL_SHARE_FLOOR = {"matmul": 0.99, "attention": 0.95}
MATMUL_INPUTS = {"q_proj": ("self_attn.q_proj", "input_norm.weight"), "k_proj": ("self_attn.k_proj", "input_norm.weight"),
                 "v_proj": ("self_attn.v_proj", "input_norm.weight"), "o_proj": ("self_attn.o_proj", "attention"),
                 "gate_proj": ("mlp.gate_proj", "post_norm.weight"), "up_proj": ("mlp.up_proj", "post_norm.weight"),
                 "down_proj": ("mlp.down_proj", "swiglu")}


def gamma(n: int) -> float:
    """Higham's gamma_n: |fl(sum of n terms) - sum| <= gamma_n * sum|terms|, in any order."""
    return n * FP32_U / (1 - n * FP32_U)


def matmul_error_bound(layer, name: str, bf16: dict, index: int) -> torch.Tensor:
    """|kernel's FP32 y - our FP32 y| <= 2 gamma_{n+1} (|x| @ |W|^T + |b|): both sum exact BF16 products in FP32."""
    module, input_location = MATMUL_INPUTS[name]
    linear = layer.get_submodule(module)
    x = bf16[input_location][index].float()
    magnitude = x.abs() @ linear.weight.float().abs().T
    if linear.bias is not None:
        magnitude = magnitude + linear.bias.float().abs()
    return 2 * gamma(linear.in_features + 1) * magnitude


def flippable(e: torch.Tensor, rel_err: torch.Tensor) -> torch.Tensor:
    """True where some value within e*(1 +- rel_err) rounds to another BF16 value than e (rounding is monotone)."""
    return R.round_bf16(e * (1 - rel_err)) != R.round_bf16(e * (1 + rel_err))


def attention_error_bound(attn, bf16: dict, index: int, mask: torch.Tensor) -> torch.Tensor:
    """|kernel's FP32 attention output - ours| per element, (B, T, H*D), from the captured BF16 q, k, v.

    Kernel (torch CPU flash attention, one KV block at these lengths): s' = q.k * scale in FP32, e' = exp(s' - max)
    with relative error <= KERNEL_EXP_REL_ERR, p' = bf16(e'), S' = sum e', o' = p' @ v / S'. Ours is the same with
    exact-order sums and torch.exp. e' = e (1 + eta), |eta| <= exp error + |s' - s| (<= 2 gamma_D scale |q|.|k|).
    p' != p only where e is within that of a BF16 rounding boundary, and then by one step <= 2**-7 p. So
    |o' - o| <= 2**-7 sum_{flippable} p |v| / S + (eta_max + gamma_T) A, A = sum p |v| / S; doubled for margin.
    """
    B, T = mask.shape
    q = bf16["rope.q_sum"][index].float().transpose(1, 2)  # (B, H, T, D)
    k = bf16["rope.k_sum"][index].float().transpose(1, 2)
    v = bf16["v_proj"][index].float().view(B, T, -1, attn.head_dim).transpose(1, 2)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    scores = ((q @ k.transpose(-1, -2)) * attn.scaling).masked_fill(~allowed, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    p, total = R.round_bf16(e).float(), e.sum(-1, keepdim=True)
    score_err = 2 * gamma(attn.head_dim) * attn.scaling * (q.abs() @ k.abs().transpose(-1, -2))
    eta = 2 * (KERNEL_EXP_REL_ERR + score_err)
    flips = ((p * flippable(e, eta).logical_and(allowed)) @ v.abs()) * 2.0**-7
    magnitude = (p @ v.abs()) * (eta.amax() + 2 * gamma(T))
    bound = 2 * (flips + magnitude) / total
    return bound.transpose(1, 2).reshape(B, T, -1)


def assert_within_kernel_error(f, b, bound, floor, what):
    """b is the rounding of some value within f +- bound, everywhere; and f itself rounds to b often enough."""
    lo, hi = R.round_bf16(f - bound).float(), R.round_bf16(f + bound).float()
    assert bool(((lo <= b.float()) & (b.float() <= hi)).all()), (what, float((b.float() - f).abs().max()))
    equal = float((R.round_bf16(f) == b).double().mean())
    assert equal >= floor, (what, equal, floor)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_capture_reproduces_the_stock_bf16_tensors(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    fp32, bf16 = R.capture_prerounding(model, ids, mask, return_bf16=True)
    expected = [loc.name for loc in R.LOCATIONS if arch == "qwen3" or not loc.qwen3_only]
    assert list(fp32) == expected and all(sorted(v) == [0, 1] for v in fp32.values())
    real = mask.bool()  # padded positions are never read; the kernel's masked rows are not compared
    for name in expected:
        loc = R.LOCATION_BY_NAME[name]
        for index in (0, 1):
            f, b = fp32[name][index], bf16[name][index]
            assert f.dtype == torch.float32 and b.dtype == torch.bfloat16 and f.shape[:2] == ids.shape
            if loc.exact:  # pointwise op: the captured FP32 value rounds to the stock tensor bit for bit
                assert bits_equal(R.round_bf16(f), b), (name, index)
                continue
            layer = model.model.layers[index]
            if name == "attention":
                bound, floor = attention_error_bound(layer.self_attn, bf16, index, mask), EQUAL_SHARE_FLOOR["attention"]
            else:
                bound, floor = matmul_error_bound(layer, name, bf16, index), EQUAL_SHARE_FLOOR["matmul"]
            assert_within_kernel_error(f[real], b[real], bound[real], floor, (name, index))
    # the BF16 tensors are the stock model's own (checked against forward hooks on the stock modules)
    for (name, layer), out in stock_module_outputs(model, ids, mask).items():
        if name in bf16:
            assert bits_equal(bf16[name][layer].reshape(out.shape), out), (name, layer)


def test_capture_selects_and_refuses():
    model = tiny_model("qwen3", layers=2, seed=1)
    ids, mask = batch()
    sel = R.capture_prerounding(model, ids, mask, layers=[1], locations=["silu", "rope.q_cos"])
    assert sorted(sel) == ["rope.q_cos", "silu"] and list(sel["silu"]) == [1]
    assert sel["rope.q_cos"][1].shape == (*ids.shape, 4, 64)
    with pytest.raises(ValueError, match="unknown location"):
        R.capture_prerounding(model, ids, mask, locations=["nope"])
    from rla_lib.align import aligned

    with aligned(model, ("rope",)), pytest.raises(RuntimeError, match="stock"):
        R.capture_prerounding(model, ids, mask)
    with pytest.raises(TypeError, match="BF16"):
        R.capture_prerounding(copy.deepcopy(model).float(), ids, mask)


def test_distinct_prefix_mask():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    assert R.distinct_prefix_mask(ids, mask).tolist() == [[True, True, True], [False, False, True], [False, True, False]]


def test_clustering_table_on_a_capture():
    model = tiny_model("qwen2", layers=1, seed=2)
    ids, mask = batch()
    table = R.clustering_table(R.capture_prerounding(model, ids, mask), mask)
    assert set(table.columns) >= {"location", "layer", "n", "score", "floor"}
    assert bool((table.score <= 1 + 1e-12).all()) and bool((table.score > 0).all())
    row = table.set_index("location").loc["o_proj"]
    # the score and its floor count the values that round (n of n_all): exact ones are a separate share
    assert row.n_all == int(mask.sum()) * 256 and row.n == round(row.n_all * (1 - row.exact_frac))
    assert row.floor == pytest.approx(1 / math.sqrt(row.n))
    summary = R.summarize_clustering(table)
    assert list(summary.index) == list(dict.fromkeys(table.location))


def test_region_probes_and_divergence():
    model = tiny_model("qwen3", layers=2, seed=3)
    ids, mask = batch()
    with torch.no_grad():
        with R.record_region_outputs(model, layer=0) as stock:
            model(input_ids=ids, attention_mask=mask)
        from rla_lib.align import aligned

        with aligned(model, ("rope",)), R.record_region_outputs(model, layer=0) as rope:
            model(input_ids=ids, attention_mask=mask)
        with aligned(model, ("swiglu",)), R.record_region_outputs(model, layer=0) as swiglu:
            model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert set(stock) == {"rope", "swiglu", "residual_norm"}
    diff = R.region_difference(stock["rope"][0], rope["rope"][0])
    assert 0 < diff["differing"] < diff["elements"] and diff["max_steps"] >= 1
    # SwiGLU comes after attention: aligning it leaves layer 0's rotated Q/K alone and changes its own output
    assert R.region_difference(stock["rope"][1], swiglu["rope"][1])["differing"] == 0
    assert R.region_difference(stock["swiglu"], swiglu["swiglu"])["differing"] > 0
    table = R.layerwise_divergence(model, ids, mask, ("swiglu",), token_mask=mask)
    assert table.stage.tolist() == ["layer 0", "layer 1", "final norm", "logits"]
    assert bool((table.rel_diff > 0).all()) and bool((table.frac_differing <= 1).all())


@pytest.mark.skipif(not (EMBEDDED_MODELS["qwen3-tiny"] / "config.json").exists(), reason="embedded model missing")
def test_capture_on_the_embedded_model():
    from rla_lib.models import load_model

    model = load_model("qwen3-tiny")
    ids, mask = batch()
    fp32, bf16 = R.capture_prerounding(model, ids, mask, return_bf16=True, layers=[0, 3])
    for name, per_layer in fp32.items():
        if R.LOCATION_BY_NAME[name].exact:
            for layer, f in per_layer.items():
                assert bits_equal(R.round_bf16(f), bf16[name][layer]), (name, layer)
