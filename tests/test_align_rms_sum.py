"""rla_lib.align's `rms_sum`: the norms' Σx² in the order of inductor's vectorised C++ reduction (compiled vLLM on
CPU), read per norm from the engine's code by rla_lib.graphs. Reference: inductor itself, compiling the same RMSNorm
on this machine; the layout it chose is read from the code it generated."""

from pathlib import Path

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from rla_lib import align as rla
from rla_lib.align.modeling_qwen import rms_normalize as layer_rms_normalize
from rla_lib.align.vector_sums import rms_sum_layouts, rms_sum_spec, straight_through
from rla_lib.align.schedule import schedule_to_align_kwargs
from rla_lib.graphs import parse_output_code, read_points, schedule
from rla_lib.graphs.inductor import float_sum_layout
from rla_lib.models import load_model

CPU_CODE = Path(__file__).parent / "fixtures" / "inductor_cpu_vllm_qwen3.py"


def rms_normalize(x):
    f = x.float()
    return f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [128, 896])
def test_rms_sum_is_inductors_reduction_bit_for_bit(dtype, width):
    torch._dynamo.reset()
    x = torch.randn(512, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    expected, code = run_and_get_code(torch.compile(rms_normalize), x)
    layouts = {layout for c in code if (layout := float_sum_layout(c))}
    assert len(layouts) == 1, code
    layout = layouts.pop()
    assert torch.equal(layer_rms_normalize(x, 1e-6, layout), expected)  # FP32 values, before any rounding
    assert not torch.equal(layer_rms_normalize(x, 1e-6), expected)  # torch's mean sums in another order


def test_schedule_reads_each_norms_sum_from_the_cpu_code():
    sched = schedule(read_points(parse_output_code(CPU_CODE)), "vllm:compiled")
    # layers 1 and 3 fuse the residual add into their post-attention norm and sum from FP32 registers of 16 lanes
    assert sched["sums"] == {"input_norm": ["vec2x16"] * 4, "post_norm": ["vec2x16", "vec1x16", "vec2x16", "vec1x16"],
                             "qk_norm": ["vec2x16"] * 4, "final_norm": ["vec2x16"]}
    _, options = schedule_to_align_kwargs(sched)
    assert rms_sum_layouts(options["rms_sum"], 4) == sched["sums"]
    model = load_model("qwen3-tiny")
    ids = torch.tensor([[1, 2, 3, 11, 4, 5, 14]])
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        with rla.aligned(model, rla.schedule_from_options(("rope", "residual_norm"), **options)):
            aligned = model(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, stock)  # undone
    assert not torch.equal(aligned, stock)


def test_rms_sum_spec_round_trip_and_errors():
    sums = {"input_norm": ["vec2x16", "vec1x16"], "post_norm": ["vec1x16", "vec1x16"], "qk_norm": ["torch", "torch"],
            "final_norm": ["vec2x16"]}
    assert rms_sum_layouts(rms_sum_spec(sums), 2) == sums
    assert rms_sum_spec({k: ["vec2x8"] * len(v) for k, v in sums.items()}) == "vec2x8"
    assert rms_sum_layouts("vec1x8", 3)["post_norm"] == ["vec1x8"] * 3
    with pytest.raises(ValueError, match="unknown layout"):
        rla.Schedule(rms_sum="post_norm=vec3x16")
    with pytest.raises(ValueError, match="kinds: input_norm"):
        rla.Schedule(rms_sum="mlp_norm=vec2x16")
    with pytest.raises(ValueError, match="3 input_norm layouts for a model with 4"):
        rla.align(load_model("qwen3-tiny"), rla.schedule_from_options(("residual_norm",), rms_sum="input_norm=vec2x16,vec2x16,vec1x16"))


def test_straight_through_keeps_the_bits_and_passes_the_gradient():
    reference = torch.tensor([1.0], requires_grad=True)
    value = torch.tensor([2.0**-30])
    assert (reference + (value - reference)).item() == 0.0  # the additive form loses the value
    out = straight_through(reference * 3, value)
    assert out.item() == 2.0**-30
    out.backward()
    assert reference.grad.item() == 3.0
