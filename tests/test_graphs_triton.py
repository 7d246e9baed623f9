"""rla_lib.graphs on REAL inductor output code of vLLM on CUDA (Triton kernels).

Fixture tests/fixtures/inductor_cuda_vllm_qwen2moe_h100.py: a Qwen1.5-MoE-style decoder compiled by vLLM on an H100
(full graph: attention and the fused MoE `vllm.moe_forward_shared` inside it), trimmed to three layers; its header
names the source and the trimming.
"""

import ast
from pathlib import Path

from rla_lib import graphs
from rla_lib.graphs.detectors import Walker
from rla_lib.graphs.inductor_kernels import parse_triton_kernel, triton_expr_op

MOE_CODE = Path(__file__).parent / "fixtures" / "inductor_cuda_vllm_qwen2moe_h100.py"

# Read off the kernels by hand; every layer agrees. Why each holds:
# - Triton computes BF16 ops in FP32 and inductor emits `.to(tl.float32)` for the graph's round trips
#   (x_residual = add.to(bf16).to(fp32)), so no value is rounded inside a kernel: only stores to *bf16 round.
# - residual sums: `tmpA + tmpB` in FP32, the norm re-reads it from registers or from an *fp32 buffer (buf18/buf48,
#   out_ptr0 / in_out_ptr0): sum fp32; the residual stream is carried in that *fp32 buffer (fp32, n/a in layer 0,
#   where it is the embedding gathered inside the norm kernel).
# - norm: x * rsqrt, `.to(tl.float32)`, * weight, one store to *bf16: normalized fp32, output bf16.
# - qkv / o_proj: extern mm / addmm into bf16 buffers; attention writes a bf16 buffer (for layers >= 1 a buffer
#   reused from the MoE op's tuple output, `buf23 = buf16 = buf15[0]`).
# - RoPE (triton_poi_fused_add_cat_index_select_..._2): q and the cos/sin cache row are loaded from *bf16 (the table
#   is BF16), the products and the sum stay FP32, one store to *bf16: cos_sin bf16, products fp32, output bf16.
# - no Q/K norm (Qwen2-MoE); the MLP is `torch.ops.vllm.moe_forward_shared`: opaque.
EXPECTED_LAYER = {
    "input_norm.sum": "fp32", "input_norm.carried": "fp32", "input_norm.normalized": "fp32", "input_norm.output": "bf16",
    "qkv_proj.output": "bf16", "qk_norm.normalized": "n/a", "qk_norm.output": "n/a", "rope.cos_sin": "bf16",
    "rope.products": "fp32", "rope.output": "bf16", "attention.output": "bf16", "o_proj.output": "bf16",
    "post_norm.sum": "fp32", "post_norm.carried": "fp32", "post_norm.normalized": "fp32", "post_norm.output": "bf16",
    "gate_up_proj.output": "opaque", "swiglu.silu": "opaque", "swiglu.output": "opaque", "down_proj.output": "opaque",
}
LAYER0 = {"input_norm.sum": "n/a", "input_norm.carried": "n/a", "post_norm.carried": "n/a"}  # the embedding
# the cut point: layer 3's input norm (kernel _8) reads the layer-2 MoE sum + the FP32 residual buffer buf48
EXPECTED_FINAL = {"final_norm.sum": "fp32", "final_norm.carried": "fp32", "final_norm.normalized": "fp32",
                  "final_norm.output": "bf16", "lm_head.output": "n/a (not in this graph)"}


def assert_read(p, layer_values, layer0_values, final_values, layers=3):
    """Every layer reads `layer_values` (layer 0 with `layer0_values` over them), the final norm `final_values`."""
    assert (p.n_layers, p.meta["n_attention"], p.meta["has_qk_norm"], p.meta["missing"]) == (layers, layers, False, [])
    for layer in range(layers):
        expected = {**layer_values, **(layer0_values if layer == 0 else {})}
        got = {k: str(p.values.get((layer, k), "n/a")) for k in expected}
        assert got == expected, f"layer {layer}"
    assert {k: str(p.values[("final", k)]) for k in final_values} == final_values


def test_real_cuda_moe_points_on_every_layer():
    assert_read(graphs.read_points(graphs.parse_output_code(MOE_CODE)), EXPECTED_LAYER, LAYER0, EXPECTED_FINAL)


def test_tuple_extern_outputs_are_linked_and_keep_their_dtype():
    """`buf15 = moe_forward_shared(...); buf16 = buf15[0]`: the element is the op's output, not a new input, so the
    attention output later written into buf16's storage (buf23) and the o_proj output (buf29 <- buf24 <- buf17 = buf15[1])
    keep the BF16 of their buffers."""
    g = graphs.parse_output_code(MOE_CODE)
    moes = [n.id for n in g.nodes if n.op == "opaque:moe_forward_shared"]
    assert len(moes) == 3
    items = [n for n in g.nodes if n.op == "view" and n.inputs and n.inputs[0] in moes]
    assert len(items) == 6 and all(n.dtype == "bf16" for n in items)  # outputs [0] (shared) and [1] (routed)
    assert not [n for n in g.nodes if n.op == "input" and "[" in n.text]  # no tuple element read as a graph input
    attention = [n for n in g.nodes if n.op == "attention"]
    assert len(attention) == 3 and all(n.dtype == "bf16" and n.rounds for n in attention)
    assert all(n.dtype == "bf16" for n in g.nodes if n.op == "mm")
    # the MoE sum the next norm reads is built from both tuple outputs
    w = Walker(g)
    sums = [n for n in g.nodes if n.op == "add" and len(n.inputs) == 2 and len({w.source(i)[0] for i in n.inputs}) == 1]
    assert {w.source(n.inputs[0])[0] for n in sums} >= set(moes)


def test_opaque_moe_is_reported_not_guessed():
    """strict=True: the fused MoE's points are "opaque" and named, the rest of the model is still read; the router
    matmul that also reads the post-attention norm is not taken for gate/up."""
    p = graphs.read_points(graphs.parse_output_code(MOE_CODE), strict=True)
    assert len(p.meta["opaque"]) == 3 * 4
    assert all(s.endswith("inside vllm.moe_forward_shared") for s in p.meta["opaque"])
    assert "layer 1 swiglu.output: inside vllm.moe_forward_shared" in p.meta["opaque"]
    assert str(p.summary()["gate_up_proj.output"]) == "opaque"
    assert all("mm" not in w for (lay, k), w in p.where.items() if k == "gate_up_proj.output")


def _kernel(body: str):
    code = ("@triton.jit\n"
            "@triton_heuristics.reduction(triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*i32', "
            "'out_ptr0': '*fp32'}})\n"
            f"def k(in_ptr0, in_ptr1, out_ptr0, xnumel):\n{body}")
    return parse_triton_kernel("triton_red_fused_9", code, "test")


def test_triton_front_end_constructs_of_real_cuda_code():
    """Looped reductions keep their `_tmpN` accumulator (the sum reads the squares, not nothing); `.to(tl.int64)` is
    an index cast; eviction_policy / other= / libdevice.rsqrt / device_assert read as in inductor's CUDA code."""
    k = _kernel("    _tmp3 = tl.full([XBLOCK, R0_BLOCK], 0, tl.float32)\n"
                "    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):\n"
                "        tmp0 = tl.load(in_ptr0 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)\n"
                "        tmp1 = tmp0 * tmp0\n"
                "        tmp2 = _tmp3 + tmp1\n"
                "        _tmp3 = tl.where(r0_mask & xmask, tmp2, _tmp3)\n"
                "    tmp3 = tl.sum(_tmp3, 1)[:, None]\n"
                "    tmp4 = libdevice.rsqrt(tmp3)\n"
                "    tl.device_assert(tmp4 > 0, 'x')\n"
                "    tl.store(out_ptr0 + (x0), tmp4, xmask)\n")
    defs = {s[1]: s[2] for s in k.stmts if s[0] == "def"}
    assert "_tmp3" in defs and triton_expr_op(defs["tmp3"])[:2] == ("sum", ["_tmp3"])
    assert triton_expr_op(defs["tmp4"])[0] == "rsqrt"
    assert triton_expr_op(ast.parse("tmp0.to(tl.int64)", mode="eval").body)[0] == "cast_int"
    assert triton_expr_op(ast.parse("tmp0.to(tl.bfloat16)", mode="eval").body)[0] == "round"
    assert [s[0] for s in k.stmts].count("store") == 1
    assert graphs.kernel_name_ops("triton_red_fused_1") == []
