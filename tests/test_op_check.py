"""rla_lib.studies.op_check against eager vLLM: every op of the engine-aligned training side, fed the engine's inputs,
gives the engine's output bit for bit; vLLM's attention kernel is reproduced by the "vllm_cpu" numerics."""

import pytest

from rla_lib import machine
from rla_lib.studies import op_check
from rla_lib.engine_align import align_to_engine, with_attention
from rla_lib.graphs import Graph, read_points
from rla_lib.graphs import schedule as graphs_schedule
from rla_lib.models import load_model
from test_graphs_inductor import EAGER_TRACE

pytestmark = pytest.mark.engine
# vLLM's attention kernel here: "avx512" (its polynomial exp) is what the vllm_cpu numerics reproduce; the AVX2 kernel
# (std::exp) and the AMX kernel (AMX tiles) are not reproduced yet, so there the check covers every other op
ATTENTION_REPRODUCED = machine.vllm_cpu_attention_kernel() == "avx512"


@pytest.fixture(scope="module")
def captures():
    return op_check.captured("qwen3-tiny", n=4)


def test_captures_hold_every_point(captures):
    assert len(captures["sequences"]) == len(captures["points"]) == len(captures["token_logprobs"]) == 4
    layers = load_model("qwen3-tiny").config.num_hidden_layers
    names = {f"{i}.{p}" for i in range(layers) for p in ("qkv", "o", "gate_up", "down", "attention_inputs")}
    assert all(set(points) == names | {"final_norm"} for points in captures["points"])


@pytest.mark.skipif(not ATTENTION_REPRODUCED, reason=f"vLLM runs its {machine.vllm_cpu_attention_kernel()} attention "
                    "kernel here, which attention='vllm_cpu' (its AVX-512 kernel) does not reproduce")
def test_vllm_cpu_attention_is_the_engines_bit_for_bit(captures):
    table = op_check.attention_kernels(captures, load_model("qwen3-tiny").config).set_index("numerics")
    assert table.loc["vllm_cpu", "differing"] == 0 and table.loc["vllm_cpu", "elements"] > 10_000
    assert table.loc["p_bf16", "differing"] > 0  # the check tells kernels apart


def test_engine_aligned_side_equals_eager_vllm_at_every_op(captures):
    model = load_model("qwen3-tiny")
    stock = op_check.teacher_forced(model, captures).groupby("point").differing.sum()
    assert stock["input_norm"] > 0 and stock["post_norm"] > 0 and stock["attention"] > 0  # stock rounds elsewhere
    # the schedule read from eager vLLM's real aten trace of this model (committed; a live capture reads the same)
    points = read_points(Graph.load(EAGER_TRACE))
    schedule = with_attention(graphs_schedule(points, "vllm:eager"), "vllm_cpu" if ATTENTION_REPRODUCED else "flash")
    handle = align_to_engine(model, schedule)
    try:
        aligned = op_check.teacher_forced(model, captures).groupby("point").differing.sum()
    finally:
        handle.undo()
    assert set(aligned.index) == set(op_check.LAYER_POINTS) | {"final_norm", "token_logprobs"}
    if not ATTENTION_REPRODUCED:
        aligned = aligned.drop("attention")
    assert (aligned == 0).all(), aligned[aligned > 0]


def test_capture_in_a_process_with_engine_workers_is_refused_saying_what_to_set():
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        op_check.capture("qwen3-tiny")
