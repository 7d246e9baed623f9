"""rla_lib.studies.prerounding: the values the stock model is about to round (checked against the stock BF16 tensors),
RoPE at chosen positions, and the region outputs of stock vs aligned layers."""

import copy

import pytest
import torch

from rla_lib.studies import prerounding as P
from rla_lib import rounding as R
from rla_lib.align import aligned
from rla_lib.models import EMBEDDED_MODELS, load_model
from tiny_models import batch, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


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
    fp32, bf16 = P.capture_prerounding(model, ids, mask, return_bf16=True)
    expected = [loc.name for loc in P.LOCATIONS if arch == "qwen3" or not loc.qwen3_only]
    assert list(fp32) == expected and all(sorted(v) == [0, 1] for v in fp32.values())
    real = mask.bool()  # padded positions are never read; the kernel's masked rows are not compared
    for name in expected:
        loc = P.LOCATION_BY_NAME[name]
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
    sel = P.capture_prerounding(model, ids, mask, layers=[1], locations=["silu", "rope.q_cos"])
    assert sorted(sel) == ["rope.q_cos", "silu"] and list(sel["silu"]) == [1]
    assert sel["rope.q_cos"][1].shape == (*ids.shape, 4, 64)
    with pytest.raises(ValueError, match="unknown location"):
        P.capture_prerounding(model, ids, mask, locations=["nope"])
    with aligned(model, ("rope",)), pytest.raises(RuntimeError, match="stock"):
        P.capture_prerounding(model, ids, mask)
    with pytest.raises(TypeError, match="BF16"):
        P.capture_prerounding(copy.deepcopy(model).float(), ids, mask)


def test_region_probes_and_divergence():
    model = tiny_model("qwen3", layers=2, seed=3)
    ids, mask = batch()
    with torch.no_grad():
        with P.record_region_outputs(model, layer=0) as stock:
            model(input_ids=ids, attention_mask=mask)
        with aligned(model, ("rope",)), P.record_region_outputs(model, layer=0) as rope:
            model(input_ids=ids, attention_mask=mask)
        with aligned(model, ("swiglu",)), P.record_region_outputs(model, layer=0) as swiglu:
            model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert set(stock) == {"rope", "swiglu", "residual_norm"}
    diff = R.region_difference(stock["rope"][0], rope["rope"][0])
    assert 0 < diff["differing"] < diff["elements"] and diff["max_steps"] >= 1
    # SwiGLU comes after attention: aligning it leaves layer 0's rotated Q/K alone and changes its own output
    assert R.region_difference(stock["rope"][1], swiglu["rope"][1])["differing"] == 0
    assert R.region_difference(stock["swiglu"], swiglu["swiglu"])["differing"] > 0
    table = P.layerwise_divergence(model, ids, mask, ("swiglu",), token_mask=mask)
    assert table.stage.tolist() == ["layer 0", "layer 1", "final norm", "logits"]
    assert bool((table.rel_diff > 0).all()) and bool((table.frac_differing <= 1).all())


def test_region_differences_counts_the_real_tokens_of_each_region_output():
    model = tiny_model("qwen3", layers=2, seed=3)
    ids, mask = batch()
    table = P.region_differences(model, ids, mask, layer=0)
    assert table.index.tolist() == [("rope", "rotated Q"), ("rope", "rotated K"), ("swiglu", "SwiGLU product (down_proj input)"),
                                    ("residual_norm", "post-attention RMSNorm output")]
    cfg, tokens = model.config, int(mask.sum())
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert table.elements.tolist() == [tokens * q, tokens * kv, tokens * cfg.intermediate_size, tokens * cfg.hidden_size]
    assert bool((table.differing > 0).all()) and bool((table.differing < table.elements).all())
    # the rotated Q row is region_difference of the recorded outputs, on the real tokens only
    real = mask.bool()
    with torch.no_grad():
        with P.record_region_outputs(model, layer=0) as stock:
            model(input_ids=ids, attention_mask=mask)
        with aligned(model, ("rope",)), P.record_region_outputs(model, layer=0) as rope:
            model(input_ids=ids, attention_mask=mask)
    want = R.region_difference(stock["rope"][0].transpose(1, 2)[real], rope["rope"][0].transpose(1, 2)[real])
    assert table.loc[("rope", "rotated Q")].to_dict() == pytest.approx(want)


@pytest.mark.skipif(not (EMBEDDED_MODELS["qwen3-tiny"] / "config.json").exists(), reason="embedded model missing")
def test_capture_on_the_embedded_model():
    model = load_model("qwen3-tiny")
    ids, mask = batch()
    fp32, bf16 = P.capture_prerounding(model, ids, mask, return_bf16=True, layers=[0, 3])
    for name, per_layer in fp32.items():
        if P.LOCATION_BY_NAME[name].exact:
            for layer, f in per_layer.items():
                assert bits_equal(R.round_bf16(f), bf16[name][layer]), (name, layer)


# ------------------------------------------------------------------------------------------------ RoPE at positions


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_task_positions_reproduce_the_capture_bitwise(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    full = P.capture_prerounding(model, ids, mask)
    rope = P.capture_rope_at_positions(model, ids, mask, "task")
    assert list(rope) == list(P.ROPE_LOCATIONS)
    for name in P.ROPE_LOCATIONS:
        for layer in (0, 1):
            assert torch.equal(rope[name][layer], full[name][layer]), (name, layer)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_position_zero_is_exact_and_excluded(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    q, k = P.capture_rope_inputs(model, ids, mask)[0]
    at_zero = P.capture_rope_at_positions(model, ids, mask, torch.zeros_like(ids))
    # cos = 1 and sin = 0 exactly: q*cos is q itself, the sin product is zero, the sum is q
    assert torch.equal(at_zero["rope.q_cos"][0], q.float()) and torch.equal(at_zero["rope.k_sum"][0], k.float())
    assert not bool(at_zero["rope.q_sin"][0].any())
    for name in P.ROPE_LOCATIONS:
        c = R.rounding_clustering(at_zero[name][0])
        assert c.exact_frac == 1.0 and c.n == 0, name
    # at task positions the first token (position 0) is all exact, so none of it is in the sample
    task = P.capture_rope_at_positions(model, ids, mask, "task")["rope.q_cos"][0]
    assert bool((R.rounding_position(task[:, 0]) == 0).all())
    c = R.rounding_clustering(task)
    assert c.n == int((R.rounding_position(task[:, 1:]) != 0).sum())


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_long_positions_match_a_stock_forward_at_those_positions(arch):
    """Layer 0's q/k do not depend on position, so the stock model run with position_ids far beyond
    max_position_embeddings must rotate them to round_bf16 of the captured sums, bit for bit."""
    model = tiny_model(arch)
    ids, mask = batch()
    positions = P.uniform_positions(ids.shape, 4096, seed=5)
    assert int(positions.max()) >= model.config.max_position_embeddings  # the test means something
    rope = P.capture_rope_at_positions(model, ids, mask, positions, layers=[0])
    with torch.no_grad(), P.record_region_outputs(model, layer=0) as record:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    q, k = (t.transpose(1, 2) for t in record["rope"])  # (B, H, T, D) -> (B, T, H, D)
    assert torch.equal(R.round_bf16(rope["rope.q_sum"][0]).view(torch.int16), q.contiguous().view(torch.int16))
    assert torch.equal(R.round_bf16(rope["rope.k_sum"][0]).view(torch.int16), k.contiguous().view(torch.int16))


def test_positions_settings():
    a = P.uniform_positions((3, 5), 4096, seed=1)
    assert torch.equal(a, P.uniform_positions((3, 5), 4096, seed=1)) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 4096
    assert P.task_positions(torch.zeros(2, 4)).tolist() == [[0, 1, 2, 3]] * 2
    assert (P.positions_label("task"), P.positions_label(4096)) == ("task", "uniform [0, 4096)")
    model = tiny_model("qwen2")
    ids, mask = batch()
    with pytest.raises(ValueError, match="positions must be"):
        P.capture_rope_at_positions(model, ids, mask, "long")
    with pytest.raises(ValueError, match="position_ids has shape"):
        P.rope_prerounding(model, P.capture_rope_inputs(model, ids, mask, layers=[0]), torch.zeros(1, 2, dtype=torch.long))
