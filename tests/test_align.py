"""Rounding-location alignment (rla_lib.align) on tiny Qwen2/Qwen3 models built from configs.

The references below are written from the region definitions, independently of rla_lib.align:
`reference_logits` is a whole forward pass that rounds exactly where each region says, and must
reproduce stock Transformers bit for bit when no region is on.
"""

import contextlib
import dataclasses
import inspect
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from rla_lib import align as rla
from rla_lib import sides
from rla_lib.align import versions as align_versions
from rla_lib.align.modeling_qwen import FusedSwiGLU
from rla_lib.paths import ROOT


BF16 = torch.bfloat16
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, modeling_qwen2),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, modeling_qwen3),
}
SHAPES = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
}
OPTION_CASES = [
    {},
    {"rope_cos_sin": "bf16"},
    {"rope_qk_norm": "stock"},
    {"norm_weight": "fp32"},
    {"residual_stream": "fp32"},
    {"rope_cos_sin": "bf16", "rope_qk_norm": "stock", "norm_weight": "fp32", "residual_stream": "fp32"},
]
PAPER_OPTIONS = {
    "rope_cos_sin": "fp32", "rope_qk_norm": "fp32", "rope_rounding": "nearest", "norm_weight": "stock", "residual_stream": "bf16", "fused": False,
    "attention": "fp32",  # acts on the "attention" region only, which the paper does not have
    "rms_sum": "torch",  # Transformers' own Σx² order
}  # fmt: skip
REGION_CASES = [("rope",), ("swiglu",), ("residual_norm",), rla.REGIONS]


@contextlib.contextmanager
def aligned_options(model, regions=rla.REGIONS, **options):
    """`rla.aligned` for a configuration named as tables name it: regions and schedule details (`sides.schedule_of`)."""
    schedule, fused = sides.schedule_of(regions, options)
    with rla.aligned(model, schedule, fused=fused) as handle:
        yield handle


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: thread start-up and contention dominate, one thread is 10-100x faster on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(family="qwen3", dtype=BF16, seed=0, attn="eager", layers=2, **overrides):
    config_cls, model_cls, _ = FAMILIES[family]
    config = config_cls(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, head_dim=16,
        vocab_size=32, max_position_embeddings=64, initializer_range=0.1, attn_implementation=attn,
        **{**SHAPES["gqa-untied"], **overrides},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # unlike .to(dtype), keeps FP32 rope frequencies
    assert type(model) is model_cls
    with torch.no_grad():  # non-trivial norm weights and biases, so their rounding matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def batch(seed=1, rows=3, length=10, pad_right=True):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 32, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, pad in enumerate([0, 3, 5][:rows]):  # rows of different lengths
        if pad_right:
            mask[row, length - pad :] = 0
        else:
            mask[row, :pad] = 0
    return input_ids, mask


def logits(model, input_ids, mask=None, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask, **kwargs).logits


# --------------------------------------------------------------------------------------------------
# Reference: a whole forward pass that rounds where the regions say (eager attention, no padding).
# --------------------------------------------------------------------------------------------------


def ref_rms_norm(x, norm, weight_mode):
    """RMSNorm of x in FP32; weight_mode: stock (round, then BF16 weight multiply), fp32 (one rounding), none."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    if weight_mode == "stock":
        return norm.weight * x.to(norm.weight.dtype)
    if weight_mode == "fp32":
        return (norm.weight.float() * x).to(norm.weight.dtype)
    return norm.weight.float() * x


def ref_cos_sin(config, length):
    dim = config.head_dim
    theta = config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters") else config.rope_theta  # 5.x, 4.x
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.arange(length)[None, :, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def ref_rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def ref_attention(attn, x, cos, sin, regions, opt):
    b, t, _ = x.shape
    dtype, rope = x.dtype, "rope" in regions
    q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, t, -1, attn.head_dim)
    k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, t, -1, attn.head_dim)
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, t, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        mode = "none" if rope and opt["rope_qk_norm"] == "fp32" else "stock"
        q, k = ref_rms_norm(q, attn.q_norm, mode), ref_rms_norm(k, attn.k_norm, mode)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if rope:  # FP32 rotary, one rounding
        if opt["rope_cos_sin"] == "bf16":
            cos, sin = cos.to(dtype).float(), sin.to(dtype).float()
        q, k = ref_rotate(q.float(), cos, sin).to(dtype), ref_rotate(k.float(), cos, sin).to(dtype)
    else:  # stock: every op rounds
        q, k = ref_rotate(q, cos.to(dtype), sin.to(dtype)), ref_rotate(k, cos.to(dtype), sin.to(dtype))
    mask = torch.full((1, 1, t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)
    modeling = sys.modules[type(attn).__module__]
    out, _ = modeling.eager_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
    return F.linear(out.reshape(b, t, -1), attn.o_proj.weight, attn.o_proj.bias)


def ref_mlp(mlp, x, regions):
    gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)
    if "swiglu" in regions:
        product = (F.silu(gate.float()) * up.float()).to(x.dtype)
    else:
        product = F.silu(gate) * up
    return F.linear(product, mlp.down_proj.weight)


def reference_logits(model, input_ids, regions=(), **options):
    opt = {**PAPER_OPTIONS, **options}
    aligned_norms = "residual_norm" in regions
    base = model.model
    cos, sin = ref_cos_sin(model.config, input_ids.shape[1])

    def block(h, norm, sublayer):
        if not aligned_norms:  # stock: BF16 residual, each add rounds
            return h + sublayer(ref_rms_norm(h, norm, "stock"))
        out = sublayer(ref_rms_norm(h, norm, opt["norm_weight"]))  # the norm reads the unrounded sum
        carried = h.to(out.dtype) if opt["residual_stream"] == "bf16" else h
        return carried.float() + out.float()

    h = base.embed_tokens(input_ids)
    for layer in base.layers:
        h = block(h, layer.input_layernorm, lambda x: ref_attention(layer.self_attn, x, cos, sin, regions, opt))
        h = block(h, layer.post_attention_layernorm, lambda x: ref_mlp(layer.mlp, x, regions))
    h = ref_rms_norm(h, base.norm, opt["norm_weight"] if aligned_norms else "stock")
    return F.linear(h, model.lm_head.weight)


# --------------------------------------------------------------------------------------------------
# Stock behaviour is untouched
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_no_region_and_undo_are_bitwise_stock(family, shape, use_cache):
    model = build(family, attn="sdpa", **SHAPES[shape])
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask, use_cache=use_cache)

    with rla.aligned(model, ()):
        assert torch.equal(logits(model, input_ids, mask, use_cache=use_cache), stock)
    handle = rla.align(model)
    assert not torch.equal(logits(model, input_ids, mask, use_cache=use_cache), stock)
    handle.undo()
    assert rla.current(model) is None
    assert torch.equal(logits(model, input_ids, mask, use_cache=use_cache), stock)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decoding_after_undo_is_bitwise_stock(family):
    model = build(family)
    input_ids, _ = batch(rows=2, length=8)

    def decode_step():
        with torch.no_grad():
            prefill = model(input_ids=input_ids[:, :-1], use_cache=True)
            return model(input_ids=input_ids[:, -1:], past_key_values=prefill.past_key_values).logits

    stock = decode_step()
    rla.align(model).undo()
    assert torch.equal(decode_step(), stock)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_after_undo_is_identical(family):
    model = build(family, attn="sdpa")
    input_ids, mask = batch(pad_right=False)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    stock = model.generate(input_ids, **kwargs)
    with rla.aligned(model, ()):
        assert torch.equal(model.generate(input_ids, **kwargs), stock)
    rla.align(model).undo()
    assert torch.equal(model.generate(input_ids, **kwargs), stock)


def test_a_stock_model_next_to_an_aligned_one_is_unaffected():
    stock_model, aligned_model = build(), build()
    input_ids, mask = batch()
    stock = logits(stock_model, input_ids, mask)
    with rla.aligned(aligned_model):
        assert not torch.equal(logits(aligned_model, input_ids, mask), stock)
        assert torch.equal(logits(stock_model, input_ids, mask), stock)


# --------------------------------------------------------------------------------------------------
# FP32 models: every rounding is a no-op, so alignment changes nothing (exercises all the plumbing)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("options", [OPTION_CASES[0], OPTION_CASES[-1]], ids=["paper", "engine"])
def test_fp32_model_is_bitwise_unchanged(family, attn, options):
    model = build(family, dtype=torch.float32, attn=attn, **SHAPES["mha-tied"])
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask, use_cache=True)
    stock_ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with aligned_options(model, **options):
        assert torch.equal(logits(model, input_ids, mask, use_cache=True), stock)
        ids = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(ids, stock_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_sliding_window_and_outputs_pass_through(family):
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    model = build(
        family, dtype=torch.float32, layers=3, use_sliding_window=True, sliding_window=4, layer_types=layer_types
    )
    assert model.model.has_sliding_layers and model.model.layers[0].self_attn.sliding_window == 4
    input_ids, mask = batch()
    kwargs = dict(output_attentions=True, output_hidden_states=True)
    with torch.no_grad():
        stock = model(input_ids=input_ids, attention_mask=mask, **kwargs)
        with rla.aligned(model):
            out = model(input_ids=input_ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.logits, stock.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, stock.attentions)) and len(out.attentions) == 3
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, stock.hidden_states))


# --------------------------------------------------------------------------------------------------
# Aligned regions equal the FP32-and-round-once references
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_without_regions_is_bitwise_stock(family):
    model = build(family)
    input_ids, _ = batch()
    assert torch.equal(reference_logits(model, input_ids), logits(model, input_ids))


# Each region alone and all three with the paper's options; each option value with its region alone and
# with all three; all engine options together.
REFERENCE_CASES = [(regions, {}) for regions in REGION_CASES] + [
    (regions, options)
    for options, region in zip(OPTION_CASES[1:5], ["rope", "rope", "residual_norm", "residual_norm"])
    for regions in [(region,), rla.REGIONS]
] + [(rla.REGIONS, OPTION_CASES[5])]


def case_id(case):
    regions, options = case
    return "+".join(regions) + "|" + (",".join(f"{k}={v}" for k, v in options.items()) or "paper")


def test_default_options_are_the_papers():
    assert sides.schedule_of(rla.REGIONS, PAPER_OPTIONS) == (rla.preset(*rla.REGIONS), False)
    assert sides.schedule_of(rla.REGIONS) == (rla.align(build(), replace=True).schedule, False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=case_id)
def test_aligned_model_matches_reference(family, case):
    regions, options = case
    model = build(family)
    input_ids, _ = batch()
    expected = reference_logits(model, input_ids, regions, **options)
    with aligned_options(model, regions, **options):
        assert torch.equal(logits(model, input_ids), expected)


def test_rope_uses_fp32_frequencies_after_model_to_bf16():
    model = build("qwen3", dtype=torch.float32).to(BF16)  # .to() rounds the inv_freq buffers too
    rotary = model.model.rotary_emb
    bf16_buffers = rotary.inv_freq, rotary.original_inv_freq
    assert rotary.inv_freq.dtype == BF16
    input_ids, _ = batch()
    stock = logits(model, input_ids)
    for options in ({}, {"rope_cos_sin": "bf16"}):
        with aligned_options(model, "rope", **options):
            assert torch.equal(logits(model, input_ids), reference_logits(model, input_ids, ("rope",), **options))
        assert rotary.inv_freq is bf16_buffers[0] and rotary.original_inv_freq is bf16_buffers[1]
    assert torch.equal(logits(model, input_ids), stock)


def test_options_of_disabled_regions_have_no_effect():
    model = build()
    input_ids, mask = batch()
    with rla.aligned(model, "swiglu"):
        expected = logits(model, input_ids, mask)
    with aligned_options(model, "swiglu", **OPTION_CASES[-1]):
        assert torch.equal(logits(model, input_ids, mask), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_swiglu_product_is_fp32_rounded_once(family):
    model = build(family)
    mlp = model.model.layers[1].mlp
    seen = {}
    mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.update(gate=o))
    mlp.up_proj.register_forward_hook(lambda m, i, o: seen.update(up=o))
    mlp.down_proj.register_forward_pre_hook(lambda m, i: seen.update(product=i[0]))
    input_ids, mask = batch()
    with rla.aligned(model, "swiglu"):
        logits(model, input_ids, mask)
    gate, up = seen["gate"], seen["up"]
    assert torch.equal(seen["product"], (F.silu(gate.float()) * up.float()).to(BF16))
    assert not torch.equal(seen["product"], F.silu(gate) * up)  # the stock rounding is really gone


# the last: eager vLLM-CPU without AVX512-BF16 (BF16 cos/sin, stock Q/K norm, the rotated Q/K truncated)
EAGER_TRUNCATING = {"rope_cos_sin": "bf16", "rope_qk_norm": "stock", "rope_rounding": "truncate"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options", OPTION_CASES[:3] + [EAGER_TRUNCATING],
                         ids=["paper", "cos_sin=bf16", "qk_norm=stock", "eager-truncating"])
def test_rotated_qk_are_fp32_rounded_once(family, options, monkeypatch):
    model = build(family)
    attn = model.model.layers[1].self_attn
    modeling = FAMILIES[family][2]
    seen = {}
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw["hidden_states"]), with_kwargs=True)

    stock_attention = modeling.eager_attention_forward

    def capture(module, query, key, *args, **kwargs):  # the attention kernel's Q and K
        if module is attn:
            seen.update(q=query, k=key)
        return stock_attention(module, query, key, *args, **kwargs)

    input_ids, _ = batch()
    with aligned_options(model, "rope", **options):
        monkeypatch.setattr(modeling, "eager_attention_forward", capture)  # after align, whose source guard reads it
        logits(model, input_ids)

    opt = {**PAPER_OPTIONS, **options}
    x, (b, t) = seen["x"], input_ids.shape
    cos, sin = ref_cos_sin(model.config, t)
    if opt["rope_cos_sin"] == "bf16":
        cos, sin = cos.to(BF16).float(), sin.to(BF16).float()
    for proj, norm, got in (("q_proj", "q_norm", seen["q"]), ("k_proj", "k_norm", seen["k"])):
        states = getattr(attn, proj)(x).view(b, t, -1, attn.head_dim)
        if hasattr(attn, norm):
            states = ref_rms_norm(states, getattr(attn, norm), "none" if opt["rope_qk_norm"] == "fp32" else "stock")
        rotated = ref_rotate(states.transpose(1, 2).float(), cos, sin)
        if opt["rope_rounding"] == "truncate":  # the low 16 bits dropped: toward zero, never to a larger magnitude
            expected = (rotated.view(torch.int32) >> 16).to(torch.int16).view(BF16)
            assert not torch.equal(expected, rotated.to(BF16)) and (expected.float().abs() <= rotated.abs()).all()
        else:
            expected = rotated.to(BF16)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "options",
    [{}, {"norm_weight": "fp32"}, {"residual_stream": "fp32"}, {"norm_weight": "fp32", "residual_stream": "fp32"}],
    ids=["paper", "norm_weight=fp32", "residual_stream=fp32", "both"],
)
def test_residual_norms_read_the_unrounded_sum(family, options):
    model = build(family, layers=3)
    base, seen = model.model, {}
    for i, layer in enumerate(base.layers):
        layer.register_forward_pre_hook(lambda m, a, kw, i=i: seen.update({("in", i): a[0]}), with_kwargs=True)
        layer.self_attn.register_forward_hook(lambda m, a, o, i=i: seen.update({("attn", i): o[0]}))
        layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.update({("mlp", i): o}))
        layer.input_layernorm.register_forward_hook(lambda m, a, o, i=i: seen.update({("norm1", i): o}))
        layer.post_attention_layernorm.register_forward_hook(lambda m, a, o, i=i: seen.update({("norm2", i): o}))
        layer.register_forward_hook(lambda m, a, o, i=i: seen.update({("out", i): o}))
    base.norm.register_forward_hook(lambda m, a, o: seen.update(final=o))
    input_ids, mask = batch()
    with aligned_options(model, "residual_norm", **options):
        logits(model, input_ids, mask)

    weight_mode = options.get("norm_weight", "stock")
    carry = (lambda s: s.float()) if options.get("residual_stream") == "fp32" else (lambda s: s.to(BF16).float())
    for i in range(len(base.layers)):
        layer_in = seen[("in", i)]
        assert layer_in.dtype == (BF16 if i == 0 else torch.float32)
        assert torch.equal(seen[("norm1", i)], ref_rms_norm(layer_in, base.layers[i].input_layernorm, weight_mode))
        mid = carry(layer_in) + seen[("attn", i)].float()
        assert torch.equal(seen[("norm2", i)], ref_rms_norm(mid, base.layers[i].post_attention_layernorm, weight_mode))
        assert torch.equal(seen[("out", i)], carry(mid) + seen[("mlp", i)].float())
    assert seen["final"].dtype == BF16
    assert torch.equal(seen["final"], ref_rms_norm(seen[("out", i)], base.norm, weight_mode))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("regions", REGION_CASES, ids="+".join)
def test_each_region_changes_bf16_logits(family, regions):
    model = build(family)
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask)
    with rla.aligned(model, regions):
        assert not torch.equal(logits(model, input_ids, mask), stock)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("regions", REGION_CASES, ids="+".join)
def test_forward_backward_and_optimizer_step(family, regions):
    model = build(family).train()
    input_ids, mask = batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with rla.aligned(model, regions):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert torch.isfinite(loss)
        assert all(g is not None and g.dtype == BF16 and torch.isfinite(g).all() for g in grads.values())
        optimizer.step()
        assert torch.isfinite(model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family):
    def grads(checkpointing):
        model = build(family).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        input_ids, mask = batch()
        with aligned_options(model, residual_stream="fp32"):
            model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss.backward()
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_training_is_bitwise_unchanged(family):
    def step(regions):
        model = build(family, dtype=torch.float32).train()
        input_ids, mask = batch()
        with rla.aligned(model, regions):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
            loss.backward()
        return loss, [p.grad for p in model.parameters()]

    (stock_loss, stock_grads), (loss, grads) = step(()), step(rla.REGIONS)
    assert torch.equal(loss, stock_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, stock_grads))


# --------------------------------------------------------------------------------------------------
# fused=True (torch.compile'd kernels) gives the eager aligned bits
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)  # the rotary gets FP32 Q/K on Qwen3, BF16 ones on Qwen2
def test_fused_is_bitwise_equal_to_eager_aligned(family):
    def run(fused):
        model = build(family).train()
        input_ids, mask = batch()
        with rla.aligned(model, fused=fused):
            out = model(input_ids=input_ids, attention_mask=mask, labels=input_ids)
            out.loss.backward()
        return [out.logits] + [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_fused_swiglu_kernel_on_a_large_odd_shape():
    generator = torch.Generator().manual_seed(0)
    gate = (3 * torch.randn(3, 37, 3072, generator=generator)).to(BF16).requires_grad_()
    up = torch.randn(3, 37, 3072, generator=generator).to(BF16).requires_grad_()
    weights = torch.randn(3072, generator=generator)
    results = []
    for swiglu in (lambda g, u: (F.silu(g.float()) * u.float()).to(BF16), FusedSwiGLU.apply):
        gate.grad = up.grad = None
        out = swiglu(gate, up)
        (out.float() * weights).sum().backward()
        results.append((out, gate.grad, up.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# --------------------------------------------------------------------------------------------------
# Handle, re-align, context manager, loading
# --------------------------------------------------------------------------------------------------


def test_realign_is_refused_unless_asked_to_replace_and_undo_restores():
    model = build()
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask)
    with aligned_options(model, "swiglu", norm_weight="fp32"):
        only_swiglu = logits(model, input_ids, mask)

    first = rla.align(model, ("rope", "residual_norm"))
    with pytest.raises(ValueError, match=r"already aligned \(keep q_norm.rsqrt, .*residual_attn, .*replace=True"):
        rla.align(model, ["swiglu"])
    assert first.active  # refused: the model keeps its alignment
    second = rla.align(model, ["swiglu"], replace=True)
    assert second.schedule == rla.Schedule(keep={"silu"}) == rla.preset("swiglu") and not second.fused
    assert rla.current(model) is second
    assert not first.active and second.active
    assert torch.equal(logits(model, input_ids, mask), only_swiglu)
    first.undo()  # replaced already: no-op
    assert torch.equal(logits(model, input_ids, mask), only_swiglu)
    second.undo()
    second.undo()
    assert rla.current(model) is None
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(logits(model, input_ids, mask), stock)


def test_context_manager_restores_on_exception_and_nesting():
    model = build()
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask)
    with pytest.raises(KeyError):
        with rla.aligned(model):
            raise KeyError("boom")
    assert rla.current(model) is None
    assert torch.equal(logits(model, input_ids, mask), stock)

    with aligned_options(model, "rope", rope_cos_sin="bf16") as outer:
        rope_only = logits(model, input_ids, mask)
        with rla.aligned(model, rla.REGIONS):
            assert rla.current(model).schedule.regions() == rla.REGIONS
        assert rla.current(model).schedule == outer.schedule and "rope.cos_sin" not in outer.schedule.keep
        assert torch.equal(logits(model, input_ids, mask), rope_only)
    assert rla.current(model) is None


def test_base_model_and_causal_lm_share_one_alignment():
    model = build()
    input_ids, mask = batch()
    handle = rla.align(model.model, "swiglu")
    assert rla.current(model) is handle and handle.schedule == rla.preset("swiglu")
    with pytest.raises(ValueError, match="already aligned"):  # the same model, reached through its causal LM
        rla.align(model, "rope")
    rla.align(model, "rope", replace=True)
    assert not handle.active
    rla.unalign(model.model)
    assert rla.current(model) is None


def test_saved_and_reloaded_model(tmp_path):
    model = build("qwen3", **SHAPES["mha-tied"])
    input_ids, mask = batch()
    with rla.aligned(model):
        expected = logits(model, input_ids, mask)
    model.save_pretrained(tmp_path)
    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=BF16, attn_implementation="eager").eval()
    with rla.aligned(loaded):
        assert torch.equal(logits(loaded, input_ids, mask), expected)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_unknown_region():
    with pytest.raises(ValueError, match="unknown region.*'ropes'.*known regions: rope, swiglu, residual_norm"):
        rla.align(build(), ("ropes",))


def test_bad_and_unknown_option():
    model = build()
    with pytest.raises(ValueError, match="rope_cos_sin='fp16' is not valid; allowed values: 'fp32', 'bf16'"):
        rla.schedule_from_options(rla.REGIONS, rope_cos_sin="fp16")
    with pytest.raises(ValueError, match="unknown schedule detail.*rope_cos"):
        rla.schedule_from_options(rla.REGIONS, rope_cos="bf16")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rope_cos_sin'"):
        rla.align(model, rope_cos_sin="bf16")
    with pytest.raises(ValueError, match=r"fused=1: True or False"):
        rla.align(model, fused=1)
    assert rla.current(model) is None


def test_schedule_refuses_what_the_layer_cannot_keep():
    with pytest.raises(ValueError, match=r"cannot keep \['swiglu'\] in FP32; points it can keep: input_norm.rsqrt"):
        rla.Schedule(keep={"swiglu"})  # the input of down_proj, a BF16 GEMM
    with pytest.raises(ValueError, match=r"cannot truncate \['silu'\]"):
        rla.Schedule(keep={"silu"}, truncate={"silu"})
    with pytest.raises(ValueError, match="needs the RoPE products kept"):
        rla.Schedule(truncate={"rope.q_sum", "rope.k_sum"})
    with pytest.raises(ValueError, match="FP32 cos/sin need the RoPE products kept"):
        rla.Schedule(keep={"rope.cos_sin"})
    with pytest.raises(ValueError, match="attention='sdpa' is not valid; allowed values: 'fp32', 'flash'"):
        rla.Schedule(attention="sdpa")
    with pytest.raises(ValueError, match="unknown region.*'ropes'"):
        rla.preset("ropes")


def test_a_schedule_is_its_points():
    """Any set of keepable points is a schedule; the presets are sets of points, and the lab's detail names are too."""
    rope = rla.preset("rope")
    assert rope.regions() == ("rope",) and rla.preset(*rla.ALL_REGIONS).regions() == rla.ALL_REGIONS
    assert rla.schedule_from_options("rope", rope_cos_sin="bf16") == dataclasses.replace(rope, keep=rope.keep - {"rope.cos_sin"})
    assert rla.schedule_from_options("swiglu", norm_weight="fp32") == rla.preset("swiglu")  # a detail of a region that is off
    engine = rla.schedule_from_options(rla.REGIONS, norm_weight="fp32", residual_stream="fp32", rope_rounding="truncate")
    assert engine.keep - rla.preset(*rla.REGIONS).keep == {"input_norm.rsqrt", "post_norm.rsqrt", "final_norm.rsqrt",
                                                            "residual_stream"}
    assert engine.truncate == {"rope.q_sum", "rope.k_sum"}
    model = build()
    input_ids, mask = batch()
    with rla.aligned(model, rla.Schedule(keep={"silu"})):  # a schedule written as points: the preset's bits
        by_points = logits(model, input_ids, mask)
    with rla.aligned(model, "swiglu"):
        assert torch.equal(logits(model, input_ids, mask), by_points)


def test_unsupported_architecture_and_dtype():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=32
    )
    with pytest.raises(TypeError, match="Qwen2/Qwen3.*LlamaForCausalLM"):
        rla.align(LlamaForCausalLM(config))
    with pytest.raises(TypeError, match="bfloat16 and float32.*float16"):
        rla.align(build(dtype=torch.float16))


def test_a_module_patched_elsewhere_is_refused_and_the_model_left_stock():
    model = build()
    input_ids, mask = batch()
    stock = logits(model, input_ids, mask)
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: type(mlp).forward(mlp, x)
    with pytest.raises(RuntimeError, match="already has a patched forward"):
        rla.align(model)
    assert rla.current(model) is None
    del mlp.forward
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(logits(model, input_ids, mask), stock)


def test_a_module_with_its_class_forward_bound_is_stock():
    """What Transformers 4.57's output capturing leaves on attention and decoder layers after output_attentions=True."""
    model, expected = build(), build()
    input_ids, mask = batch()
    for module in model.modules():
        if isinstance(module, (modeling_qwen3.Qwen3Attention, modeling_qwen3.Qwen3DecoderLayer)):
            module.forward = type(module).forward.__get__(module)
    with rla.aligned(model), rla.aligned(expected):
        assert torch.equal(logits(model, input_ids, mask), logits(expected, input_ids, mask))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_changed_transformers_source_is_refused(monkeypatch):
    model = build()
    key, release = "qwen3.Qwen3Attention.forward", align_versions.supported_release()
    monkeypatch.setitem(release.sha256, key, "0" * 64)
    expected = rf"modeling_qwen3\.Qwen3Attention\.forward differs.*transformers=={re.escape(release.verified)}"
    with pytest.raises(RuntimeError, match=expected):
        rla.align(model)
    assert rla.current(model) is None
    rla.align(build("qwen2"))  # the other family's code is unchanged


def test_unsupported_transformers_version_is_refused_naming_the_supported_ones(monkeypatch):
    model = build()
    monkeypatch.setattr(align_versions, "INSTALLED", "4.50.3")
    supported = ", ".join(re.escape(release.verified) for release in align_versions.RELEASES.values())
    with pytest.raises(RuntimeError, match=rf"supports transformers {supported} .*not 4\.50\.3.*pip install transformers=="):
        rla.align(model)
    assert rla.current(model) is None and not any("forward" in m.__dict__ for m in model.modules())


def test_every_supported_release_guards_the_same_functions():
    keys = {release.verified: sorted(release.sha256) for release in align_versions.RELEASES.values()}
    assert all(k == keys["5.19.0"] for k in keys.values()), keys


def test_every_supported_series_is_tested():
    """The main environment (`make setup`: requirements/pins.txt) has one supported release, `make test-transformers`
    installs each other's verified one (requirements/transformers-<series>.txt) with the main environment's torch."""
    project = (ROOT / "requirements" / "pins.txt").read_text().splitlines()
    main = next(pin.split("==")[1] for pin in project if pin.startswith("transformers=="))
    extra = re.search(r"^TF_SERIES := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert sorted([align_versions.series(main), *extra]) == sorted(align_versions.RELEASES)
    assert main == align_versions.RELEASES[align_versions.series(main)].verified
    torch_pin = next(pin for pin in project if pin.startswith("torch=="))
    for series in extra:
        pins = (ROOT / "requirements" / f"transformers-{series}.txt").read_text().split("\n")
        assert f"transformers=={align_versions.RELEASES[series].verified}" in pins and torch_pin in pins


def test_changed_source_text_is_refused(monkeypatch):
    original = inspect.getsource
    monkeypatch.setattr(
        inspect, "getsource", lambda obj: original(obj) + ("# edited\n" if obj.__name__ == "rotate_half" else "")
    )
    with pytest.raises(RuntimeError, match="rotate_half differs"):
        rla.align(build("qwen2"))


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_rope_trains(family):
    """The truncated rotary output passes the gradient of rounding to nearest (a straight-through estimate): every
    parameter gets a finite gradient, the projections before the rotary a non-zero one."""
    model = build(family).train()
    input_ids, mask = batch()
    with aligned_options(model, ("rope",), **EAGER_TRUNCATING):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in (model.model.layers[0].self_attn.q_proj.weight.grad,))
