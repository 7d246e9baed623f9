"""rla_lib.op_check against eager vLLM: every op of the engine-aligned training side, fed the engine's inputs,
gives the engine's output bit for bit; vLLM's vector attention kernel, in each of its x86 builds, is reproduced by its
numerics (`attention.VLLM_CPU_BUILDS`)."""

import json
import subprocess
import sys

import pytest

from rla_lib import machine
from rla_lib.align.attention import ROUNDS_TO_NEAREST, VLLM_CPU_BUILDS
from rla_lib import op_check
from rla_lib.engine_align import with_attention, with_rope_rounding
from rla_lib.graphs import Graph, read_points
from rla_lib.graphs import schedule as graphs_schedule
from rla_lib.models import load_model
from test_graphs_inductor import EAGER_TRACE

pytestmark = pytest.mark.engine
# vLLM's attention kernel here and the numerics reproducing it: its AMX kernel and each build of its vector kernel
# (AVX512-BF16, AVX-512, AVX2) have one; a kernel without one (another CPU) leaves attention out of the check
KERNEL = machine.vllm_cpu_attention_kernel()
ATTENTION_REPRODUCED = KERNEL in VLLM_CPU_BUILDS
NUMERICS = VLLM_CPU_BUILDS.get(KERNEL)


def converted_otherwise(kernel: str) -> list[str]:
    """The numerics of the kernels that convert their output to BF16 otherwise than `kernel` (nearest vs truncated)."""
    return [n for name, n in VLLM_CPU_BUILDS.items() if (name in ROUNDS_TO_NEAREST) != (kernel in ROUNDS_TO_NEAREST)]


@pytest.fixture(scope="module")
def captures():
    return op_check.captured("qwen3-tiny", n=4)


def test_captures_hold_every_point(captures):
    assert len(captures["sequences"]) == len(captures["points"]) == len(captures["token_logprobs"]) == 4
    layers = load_model("qwen3-tiny").config.num_hidden_layers
    names = {f"{i}.{p}" for i in range(layers) for p in ("qkv", "o", "gate_up", "down", "attention_inputs")}
    assert all(set(points) == names | {"final_norm"} for points in captures["points"])


@pytest.mark.skipif(not ATTENTION_REPRODUCED, reason=f"vLLM runs its {KERNEL} attention kernel here, which no numerics "
                    "of rla_lib.align.attention reproduces yet")
def test_vllm_cpu_attention_is_the_engines_bit_for_bit(captures):
    table = op_check.attention_kernels(captures, load_model("qwen3-tiny").config).set_index("numerics")
    assert table.loc[NUMERICS, "differing"] == 0 and table.loc[NUMERICS, "elements"] > 10_000
    # the builds that convert the output otherwise (to nearest vs truncated) are told apart (see below)
    other_conversion = converted_otherwise(KERNEL)
    assert (table.loc[other_conversion + ["p_bf16"], "differing"] > 1000).all()


# Run in a process capped to a level (rla_lib.machine --level): the build vLLM loads there, and each numerics' count of
# differing attention output elements on that engine's own q/k/v, as one JSON line.
CAPPED_CHECK = """
import json
from rla_lib import machine
from rla_lib.models import load_model
from rla_lib import op_check
table = op_check.attention_kernels(op_check.captured("qwen3-tiny", n=4), load_model("qwen3-tiny").config)
print(json.dumps(dict(kernel=machine.vllm_cpu_attention_kernel(), differing=dict(zip(table.numerics, table.differing)))))
"""


@pytest.mark.parametrize("level", list(VLLM_CPU_BUILDS))
def test_each_vector_build_of_vllms_attention_is_reproduced_bit_for_bit(level):
    """Every x86 attention kernel of vLLM-CPU this CPU can run (capped to lower levels): the AMX kernel and the vector
    kernel of `_C` (AVX512-BF16), `_C_AVX512` and `_C_AVX2`, each against its engine, told apart from the builds that
    convert the output otherwise."""
    if level not in machine.isa_levels():
        pytest.skip(f"this CPU cannot run level {level}")
    cmd = [sys.executable, "-m", "rla_lib.machine", "--level", level, sys.executable, "-c", CAPPED_CHECK]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["kernel"] == level  # the cap makes vLLM load that build
    differing = found["differing"]
    assert differing[VLLM_CPU_BUILDS[level]] == 0
    # the builds that convert the output otherwise (to nearest vs truncated) differ in about half the elements; the
    # AVX-512 and AVX2 loops, both truncated, in about one element in 10^5, which a small capture may not hold
    other_conversion = converted_otherwise(level)
    assert all(differing[n] > 1000 for n in other_conversion)


def test_engine_aligned_side_equals_eager_vllm_at_every_op(captures):
    model = load_model("qwen3-tiny")
    stock = op_check.teacher_forced(model, captures).groupby("point").differing.sum()
    assert stock["input_norm"] > 0 and stock["post_norm"] > 0 and stock["attention"] > 0  # stock rounds elsewhere
    # the schedule read from eager vLLM's real aten trace of this model (committed; a live capture reads the same)
    points = read_points(Graph.load(EAGER_TRACE))
    schedule = with_attention(graphs_schedule(points, "vllm:eager"), NUMERICS if ATTENTION_REPRODUCED else "flash")
    schedule = with_rope_rounding(schedule, "eager")  # the builds without AVX512-BF16 truncate the rotated Q/K
    aligned = op_check.teacher_forced(model, captures, schedule).groupby("point").differing.sum()
    assert set(aligned.index) == set(op_check.LAYER_POINTS) | {"final_norm", "token_logprobs"}
    if not ATTENTION_REPRODUCED:
        aligned = aligned.drop("attention")
    assert (aligned == 0).all(), aligned[aligned > 0]


def test_capture_in_a_process_with_engine_workers_is_refused_saying_what_to_set():
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        op_check.capture("qwen3-tiny")
