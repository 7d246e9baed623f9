"""rla_lib.graphs.read_points on an eager vLLM trace and on traced Transformers, and the typed point values."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from rla_lib.align.schedule import schedule_to_align_kwargs
from rla_lib import graphs
from rla_lib.graphs.points import Held, Mixed, Split, combine, parse_value
from test_graphs_inductor import CPU_CODE, EAGER_TRACE

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


def test_eager_vllm_trace_fixture():
    g = graphs.Graph.load(EAGER_TRACE)
    assert g.meta["probes"]["rotary_embedding"]["best"] == "fp32_round_once"
    s = graphs.read_points(g).summary()
    assert {k: s[k] for k in EAGER_CPU} == EAGER_CPU
    sched = graphs.schedule(graphs.read_points(g), "vllm:eager")
    assert schedule_to_align_kwargs(sched) == (
        ("rope", "residual_norm"),
        {"residual_stream": "bf16", "norm_weight": "stock", "rope_cos_sin": "bf16", "rope_qk_norm": "stock"})
    assert sched["align"]["exact"] and not graphs.schedule_notes(sched)


def test_stock_transformers_rounds_after_every_op():
    s = graphs.read_points(graphs.training_graph(tiny("qwen3"))).summary()
    assert {v for v in s.values() if v != "n/a"} == {"bf16"}


# ---- typed point values: their text is what tables show and files store --------------------------------------
SPLIT = Split(((Held.BF16, "sin"), (Held.FP32, "cos")))


@pytest.mark.parametrize("value,text", [
    (Held.FP32, "fp32"),
    (Held.BETWEEN_PIECES, "n/a (between compiled pieces)"),
    (Mixed(((Held.FP32, 2), (Held.BF16, 1))), "mixed: fp32×2, bf16×1"),
    (SPLIT, "mixed: bf16 into ·sin, fp32 into ·cos"),
    (Mixed(((Held.BF16, 1), (SPLIT, 3))), "mixed: bf16×1, mixed: bf16 into ·sin, fp32 into ·cos×3"),
])
def test_point_values_read_back_from_their_text(value, text):
    assert str(value) == text and json.dumps([value], default=str) == json.dumps([text])
    assert parse_value(text) == value


def test_combined_values_count_layers_and_pick_the_majority():
    assert combine([Held.NA, Held.BF16, Held.BF16]) == Held.BF16
    mixed = combine([Held.FP32, Held.BF16, Held.FP32])
    assert str(mixed) == "mixed: fp32×2, bf16×1" and mixed.major() == (Held.FP32, False)
    assert Mixed(((Held.FP32, 1), (Held.BF16, 1))).major() == (Held.BF16, False)  # a tie rounds
    assert SPLIT.major() == (Held.BF16, False) and Held.OPAQUE.major() == (None, True)


def test_points_json_roundtrip_keeps_typed_values():
    p = graphs.read_points(graphs.parse_output_code(CPU_CODE))
    again = graphs.Points.from_json(json.loads(json.dumps(p.to_json())))
    assert again.values == p.values and again.summary() == p.summary()
    assert all(isinstance(v, Held) for v in again.values.values())


def test_fp32_products_rounded_once_are_read_as_a_bf16_projection(monkeypatch):
    """The training side's BF16 linear without BF16 instructions (`bf16_matmul`: FP32 products of the BF16 operands,
    rounded once before anything reads them) holds its output in BF16, as a BF16 GEMM does: every projection reads so,
    in a trace of the same model made either way."""
    projections = [key for key, _, _ in graphs.LAYER_POINTS + graphs.FINAL_POINTS if key.endswith("proj.output")
                   or key == "lm_head.output"]
    read = {}
    for mode in ("native", "fp32"):
        monkeypatch.setenv("RLA_BF16_MATMUL", mode)
        read[mode] = graphs.read_points(graphs.training_graph("qwen3-tiny")).summary()
    assert all(read[mode][key] == "bf16" for mode in read for key in projections), read
