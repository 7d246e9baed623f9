"""rla_lib.native: the C kernels give the bits of the torch-op loops they replace (vector_sums.square_sum, the
vLLM CPU attention forward), on random data with padding, sliding windows, GQA and rows that attend to nothing; and
torch's BF16 dot-product GEMM, against its order spelled in torch ops and, where it runs, torch's own kernel."""

import copy
import types

import pytest
import torch

import torch.nn.functional as F

from rla_lib.align import attention as rla_attention
from rla_lib import bf16_matmul, machine, native
from rla_lib.align import vector_sums
from rla_lib.align.vector_sums import lane_tree_sum

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the torch-op loops are the only path")


def torch_ops(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)


@pytest.mark.parametrize("layout", ["vec2x16", "vec1x16", "vec2x8", "vec1x8"])
@pytest.mark.parametrize("n", [5, 32, 100, 1024])
def test_square_sum_bitwise_the_torch_loop(monkeypatch, layout, n):
    x = torch.randn(3, 70, n, generator=torch.Generator().manual_seed(n)) * 3
    fast = vector_sums.square_sum(x, layout)
    torch_ops(monkeypatch)
    slow = vector_sums.square_sum(x, layout)
    assert fast.shape == slow.shape == x.shape[:-1]
    assert torch.equal(fast, slow)
    assert not torch.equal(fast, x.pow(2).sum(-1)) or n <= 8  # a test that can fail: torch's order differs


def random_attention(batch=3, heads=4, length=37, keys=None, dim=64, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = keys or length
    q = torch.randn(batch, heads, length, dim, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_heads or heads, keys, dim, generator=g).bfloat16() for _ in range(2))
    return q, k * 2, v


def causal(batch, length, left_padding=(), window=None):
    attended = torch.ones(length, length, dtype=torch.bool).tril()
    if window:
        attended &= ~torch.ones(length, length, dtype=torch.bool).tril(-window)
    attended = attended.expand(batch, 1, length, length).clone()
    for row, pad in enumerate(left_padding):
        attended[row, :, :, :pad] = False
        attended[row, :, :pad, :] = False  # padding queries attend to nothing
    return attended


@pytest.mark.parametrize("case", ["causal", "left-padded", "sliding-window", "per-head", "one-query", "GQA", "odd-dim"])
def test_vllm_cpu_forward_bitwise_the_torch_loop(monkeypatch, case):
    q, k, v = random_attention(length=1 if case == "one-query" else 37, keys=37, seed=len(case),
                               kv_heads=2 if case == "GQA" else None, dim=40 if case == "odd-dim" else 64)
    if case == "one-query":
        attended = torch.ones(3, 1, 1, 37, dtype=torch.bool)
    elif case == "per-head":
        attended = causal(3, 37).expand(3, 4, 37, 37) & (torch.rand(3, 4, 37, 37) > 0.2)
    else:
        attended = causal(3, 37, left_padding=(0, 5, 19) if case == "left-padded" else (),
                          window=9 if case == "sliding-window" else None)
    fast_out, fast_lse, fast_p = rla_attention._vllm_cpu_forward(q, k, v, attended, 0.125, weights=True)
    assert torch.equal(rla_attention._vllm_cpu_forward(q, k, v, attended, 0.125)[0].nan_to_num(), fast_out.nan_to_num())
    torch_ops(monkeypatch)
    slow_out, slow_lse, slow_p = rla_attention._vllm_cpu_forward(q, k, v, attended, 0.125, weights=True)
    # the log-sum-exp (read by the backward only): C's logf and torch's log, each within an ulp of the true value
    assert torch.equal(fast_lse.isinf(), slow_lse.isinf())
    assert torch.equal(fast_lse.isinf(), ~attended.any(-1).expand(3, 4, -1))
    torch.testing.assert_close(fast_lse, slow_lse, rtol=1e-6, atol=1e-6)
    assert fast_out.dtype == slow_out.dtype == torch.bfloat16
    assert torch.equal(fast_out, slow_out) or torch.equal(fast_out.isnan(), slow_out.isnan()) and torch.equal(
        fast_out.nan_to_num(), slow_out.nan_to_num())
    assert torch.equal(fast_p.nan_to_num(), slow_p.nan_to_num()) and torch.equal(fast_p.isnan(), slow_p.isnan())
    assert torch.isfinite(fast_out[attended.any(-1).expand(3, 4, -1)]).all()


def test_vllm_cpu_forward_differs_from_torch_matmul_order():
    """The C path is not merely FP32 attention in torch's order: the fused multiply-add chains change bits."""
    q, k, v = random_attention(length=64, dim=128)
    attended = causal(3, 64)
    out, _, _ = rla_attention._vllm_cpu_forward(q, k, v, attended, 0.125)
    scores = (q.float() * 0.125) @ k.float().transpose(-1, -2)
    reference = (scores.masked_fill(~attended, float("-inf")).softmax(-1) @ v.float()).bfloat16()
    assert not torch.equal(out, reference)
    assert (out.float() - reference.float()).abs().max() < 0.02  # the same function: within a few BF16 ulps


def test_sdpa_backward_at_given_output_is_torch_sdpa_gradient():
    """The wiring of vllm_cpu's backward: given SDPA's own output and log-sum-exp, the gradient is autograd's through
    torch's SDPA, bit for bit (left-padded rows included)."""
    q, k, v = (t.requires_grad_() for t in random_attention(kv_heads=4, dim=32))
    additive = torch.where(causal(3, 37, left_padding=(0, 5, 19)), 0.0, torch.finfo(torch.bfloat16).min).bfloat16()
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=0.125)
    expected = torch.autograd.grad(sdpa, (q, k, v), grad_out)
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=additive,
                                                                                 scale=0.125)
    got = torch.autograd.grad(rla_attention._SdpaBackward.apply(q, k, v, out.detach(), logsumexp, additive, 0.125),
                              (q, k, v), grad_out)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_vllm_cpu_gradient_is_the_stock_sdpa_gradient_within_rounding():
    """At the engine's output (a few BF16 ulps from SDPA's), the gradient stays SDPA's to within that difference."""
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = (t.requires_grad_() for t in random_attention(kv_heads=2, dim=32))
    attended = causal(3, 37)
    grad_out = torch.randn(3, 37, 4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    out, _ = rla_attention.vllm_cpu_attention(module, q, k, v, attended, 0.125)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attended, scale=0.125,
                                                                 enable_gqa=True)
    expected = torch.autograd.grad(reference.transpose(1, 2), (q, k, v), grad_out)
    for a, b in zip(got, expected):
        assert (a.float() - b.float()).norm() < 0.01 * b.float().norm()
    assert not all(torch.equal(a, b) for a, b in zip(got, expected))  # not SDPA's own forward: the engine's output


def dot_order_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ in the order of torch's BF16 dot product without BF16 instructions (ReducedPrecisionFloatGemvFastPathKernel,
    AVX2 build), spelled as torch ops: products exact in FP32, k = 64i + 8r + l into register r's lane l, i in order;
    registers paired (r + 4, + 2, + 1), lanes paired (l ^ 4, ^ 2, ^ 1); then the 16-wide part of the tail in one more
    register (k's lane: (k - 64I) % 8, in order), paired alike and added; then the rest one by one."""
    p = x.float()[:, None, :] * w.float()[None, :, :]  # (M, N, K), exact
    k = p.shape[-1]
    whole, vectors = k // 64 * 64, k // 16 * 16

    # registers and lanes are both paired upper half onto lower half (AVX2's vec_reduce_all): lane_tree_sum
    regs = torch.zeros(*p.shape[:2], 8, 8)
    for i in range(0, whole, 64):
        regs = regs + p[..., i : i + 64].unflatten(-1, (8, 8))
    tail = torch.zeros(*p.shape[:2], 8)
    for i in range(whole, vectors, 8):
        tail = tail + p[..., i : i + 8]
    total = lane_tree_sum(lane_tree_sum(regs.transpose(-1, -2))) + lane_tree_sum(tail)
    for i in range(vectors, k):
        total = total + p[..., i]
    return total


@pytest.mark.parametrize("rows, k, cols", [(7, 256, 40), (13, 200, 33), (1, 896, 17), (6, 24, 16), (5, 7, 3), (9, 1024, 64)])
def test_torch_dot_linear_sums_in_torchs_dot_order(rows, k, cols):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(cols, k, generator=g) * 0.1).bfloat16()
    fast = native.torch_dot_linear(x, w)
    assert fast.dtype == torch.float32 and fast.shape == (rows, cols)
    assert torch.equal(fast, dot_order_reference(x, w))
    # a test that can fail: another order of the same exact products (the FP32 library's) differs in the FP32 sum
    assert not torch.equal(fast, x.float() @ w.float().T) or k <= 8


@pytest.mark.skipif(not bf16_matmul.engine_linear_is_torchs(), reason="torch's BF16 linear here is not its dot-product loop "
                    "(BF16 instructions or oneDNN's BF16 GEMM): only an AVX2-only CPU runs it")
def test_torch_bf16_linear_is_torchs_kernel_bit_for_bit():
    """On an AVX2-only CPU (vLLM's `_C_AVX2` build multiplies with torch's BF16 linear) the training side's forward
    gives torch's own BF16 linear's bits, bias included, at every row count (a row's sum does not depend on the rest)."""
    assert bf16_matmul._dot_loop_is_torchs()  # the C loop is taken, not the slow kernel itself
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(130, 1000, generator=g).bfloat16(), (torch.randn(77, 1000, generator=g) / 16).bfloat16(), \
        torch.randn(77, generator=g).bfloat16()
    for m in (1, 2, 7, 48, 130):
        assert torch.equal(bf16_matmul.torch_bf16_linear(x[:m], w), F.linear(x[:m], w))
        assert torch.equal(bf16_matmul.torch_bf16_linear(x[:m], w, b), F.linear(x[:m], w, b))
    # the FP32 library's sums, the path at other levels, round otherwise in about 3 outputs in 10,000 (a product
    # of 80,000 outputs: some 24 expected)
    x, w = torch.randn(400, 1000, generator=g).bfloat16(), (torch.randn(200, 1000, generator=g) / 16).bfloat16()
    assert not torch.equal(bf16_matmul.rows_times(x.float(), w.float().T).bfloat16(), F.linear(x, w))


def adamw_histories(make, betas, weight_decay, steps=4):
    """Parameters and state after `steps` steps of the optimizer `make` builds, on tensors of awkward sizes (odd, one
    element, a large one that the kernels split across threads) with gradients over many magnitudes, zeros included."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 33), (1,), (300_007,), (64, 1024), (3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    opt = make(params, lr=3e-3, betas=betas, weight_decay=weight_decay, eps=1e-8)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-9, 1, p.shape, generator=g).float()
            p.grad.view(-1)[::13] = 0
        opt.step()
    return params, opt


@pytest.fixture(params=["one pass", "two passes"])
def adamw_passes(request, monkeypatch):
    """AdamW's step in one pass calling torch's sqrt from C, or in two around torch.sqrt (where torch's sqrt is not
    MKL's, `native.torch_sqrt_kernel`)."""
    if request.param == "two passes":
        monkeypatch.setattr(native, "torch_sqrt_kernel", lambda: None)
    return request.param


def test_torchs_sqrt_is_found_where_torch_has_mkl():
    """The one-pass step is the one that runs here (torch's FP32 sqrt is MKL's on x86 builds)."""
    assert (native.torch_sqrt_kernel() is not None) == (torch.backends.mkl.is_available() and
                                                        native.library() is not None)


@pytest.mark.parametrize("betas, weight_decay", [((0.9, 0.999), 0.0), ((0.9, 0.95), 0.1), ((0.3, 0.99), 0.0)],
                         ids=["grpo", "weight-decay", "lerp-large-weight"])
def test_adamw_gives_torchs_for_loop_bits(betas, weight_decay, adamw_passes):
    """Every parameter and moment bit for bit as torch's for-loop AdamW. Both lerp branches (weight 1-beta1 below and
    above 0.5); a test that can fail: torch's fused AdamW rounds differently (checked below)."""
    fast, fast_opt = adamw_histories(native.AdamW, betas, weight_decay)
    loop, loop_opt = adamw_histories(lambda *a, **k: torch.optim.AdamW(*a, foreach=False, **k), betas, weight_decay)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(fast, loop))
    for a, b in zip(fast_opt.state.values(), loop_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    fused, _ = adamw_histories(lambda *a, **k: torch.optim.AdamW(*a, fused=True, **k), betas, weight_decay)
    assert not all(torch.equal(a.detach(), b.detach()) for a, b in zip(fused, loop))


def test_adamw_state_loads_into_torchs_and_back():
    """A checkpoint of one continues in the other with the same bits (the state is torch's own)."""
    params, opt = adamw_histories(native.AdamW, (0.9, 0.999), 0.0)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(copies, lr=3e-3, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a file: no tensor shared
    for a, b in zip(params, copies):
        a.grad = b.grad = torch.full_like(a, 1e-3)
    opt.step()
    torch_opt.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, copies))
    back = [torch.nn.Parameter(p.detach().clone()) for p in copies]
    back_opt = native.AdamW(back, lr=1.0)  # the loaded state brings the run's settings
    back_opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for a, b in zip(back, copies):
        a.grad = b.grad = torch.full_like(a, -2e-3)
    back_opt.step()
    torch_opt.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(back, copies))


@pytest.mark.parametrize("clip, kernels", [(0.37, "native"), (1.0, "native"), (0.37, "torch ops")])
def test_adamw_step_with_bf16_grads_is_their_fp32_copies_clipped_then_stepped(clip, kernels, adamw_passes, monkeypatch):
    """step_with_grads(BF16 gradients, clip coefficient, BF16 copies) gives the bits of torch's for-loop AdamW after
    copying them into FP32 gradients and multiplying those by the coefficient (grpo.Policy's earlier step), then of
    copying the parameters into the BF16 copies, over steps where one gradient is missing; without the compiled
    kernels, the torch ops it stands for run."""
    if kernels == "torch ops":
        monkeypatch.setattr(native, "library", lambda: None)
    g = torch.Generator().manual_seed(1)
    shapes = [(7, 33), (1,), (300_007,), (64, 1024), (3,)]
    start = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    fast, loop = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    copies = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    fast_opt, loop_opt = native.AdamW(fast, lr=3e-3), torch.optim.AdamW(loop, lr=3e-3, foreach=False)
    coefficient = torch.tensor(clip, dtype=torch.float32)
    for step in range(4):
        grads = [(torch.randn(s, generator=g) * 10.0 ** torch.randint(-9, 1, s, generator=g).float()).bfloat16()
                 for s in shapes]
        grads[1] = None if step == 2 else grads[1]
        fast_opt.step_with_grads(grads, coefficient, copies=copies)
        for p, grad in zip(loop, grads):
            p.grad = None if grad is None else grad.float()
        torch._foreach_mul_([p.grad for p in loop if p.grad is not None], coefficient)
        loop_opt.step()
        assert all(torch.equal(c.view(torch.int16), p.detach().bfloat16().view(torch.int16))
                   for c, p in zip(copies, loop))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(fast, loop))
    for a, b in zip(fast_opt.state.values(), loop_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    if kernels == "native":
        assert all(p.grad is None for p in fast)  # no FP32 gradients were made


def test_adamw_step_with_grads_refuses_a_list_of_the_wrong_length():
    opt = native.AdamW([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match="one gradient .or None. per parameter: 2, got 1"):
        opt.step_with_grads([torch.zeros(3).bfloat16()], torch.tensor(1.0))
    with pytest.raises(ValueError, match="one copy per parameter: 2, got 1"):
        opt.step_with_grads([None, None], torch.tensor(1.0), copies=[torch.zeros(3).bfloat16()])


def test_bf16_norms_are_torchs_vector_norms_bit_for_bit():
    """Each BF16 tensor's FP32 2-norm as torch.linalg.vector_norm(t, 2, dtype=torch.float32) gives it, over lengths
    with and without a tail of the lanes and magnitudes down to those whose squares round (a seed other than the
    probe's); tensors it does not cover give None (the caller runs torch)."""
    g = torch.Generator().manual_seed(5)
    tensors = [(torch.randn(n, generator=g) * 10.0 ** torch.randint(low, high, (n,), generator=g).double()).bfloat16()
               for n in (1, 3, 8, 9, 13, 24, 30, 47, 1025, 300_007) for low, high in ((-30, 5), (-24, -18))]
    tensors.append(torch.zeros(40, dtype=torch.bfloat16))
    norms = native.bf16_norms(tensors)
    assert norms is not None or native.library() is None
    if norms is not None:
        expected = torch.stack([torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors])
        assert torch.equal(norms.view(torch.int32), expected.view(torch.int32))
    assert native.bf16_norms([torch.ones(3)]) is None  # FP32
    assert native.bf16_norms([torch.ones(4, 4, dtype=torch.bfloat16).T[:, :2]]) is None  # not contiguous
