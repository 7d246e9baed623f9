"""rla_lib.engine_align: a schedule with its probed attention numerics, applied in one call."""

import pytest
import torch

from rla_lib import graphs
from rla_lib.align import current
from rla_lib.engine_align import (ATTENTION_NUMERICS, align_to_engine, cos_sin_equal, probe_attention, probe_sequences,
                                  with_attention)
from rla_lib.models import load_model
from rla_lib.scoring import pad_batch
from test_graphs_inductor import CPU_CODE


def compiled_schedule(attention=None):
    sched = graphs.schedule(graphs.read_points(graphs.parse_output_code(CPU_CODE)), "vllm:compiled")
    return sched | ({"attention": {"numerics": attention}} if attention else {})


def logits(model):
    ids, mask = pad_batch([[1, 2, 3, 11, 4, 5, 14], [3, 3, 11, 2]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_schedule_attention_section_adds_the_region_and_its_numerics():
    regions, options = graphs.schedule_to_align_kwargs(compiled_schedule())
    assert "attention" not in regions and "attention" not in options
    regions_a, options_a = graphs.schedule_to_align_kwargs(compiled_schedule("p_bf16"))
    assert regions_a == (*regions, "attention") and options_a == options | {"attention": "p_bf16"}


def test_align_to_engine_from_a_schedule_dict_and_file(tmp_path):
    model = load_model("qwen3-tiny")
    stock = logits(model)
    sched = compiled_schedule("fp32")
    handle = align_to_engine(model, sched)
    regions, options = graphs.schedule_to_align_kwargs(sched)
    assert current(model)[0] == regions and current(model)[1].attention == "fp32"
    aligned = logits(model)
    handle.undo()
    assert torch.equal(logits(model), stock) and not torch.equal(aligned, stock)
    handle = align_to_engine(model, graphs.save_schedule(sched, tmp_path / "s.json"))
    assert torch.equal(logits(model), aligned)
    handle.undo()
    with pytest.raises(TypeError, match="Engine, a schedule dict or a schedule file"):
        align_to_engine(model, 3)


@pytest.mark.engine
def test_probe_attention_picks_the_closest_numerics(compiled_engine):
    model = load_model("qwen3-tiny")
    regions, options = graphs.schedule_to_align_kwargs(compiled_schedule())
    sequences = probe_sequences(compiled_engine, n=8, max_tokens=12)
    found = probe_attention(compiled_engine, model, regions, options, sequences)
    assert set(found["distance"]) == set(ATTENTION_NUMERICS)
    assert found["numerics"] == min(found["distance"], key=found["distance"].get)
    assert found["measure"] == "exact KL per token" and all(d >= 0 for d in found["distance"].values())
    assert current(model) is None  # every probe was undone


def test_with_attention_checks_the_numerics():
    sched = compiled_schedule()
    assert graphs.schedule_to_align_kwargs(with_attention(sched, "eager", how="by hand"))[1]["attention"] == "eager"
    with pytest.raises(ValueError, match="attention numerics"):
        with_attention(sched, "fp16")


def test_vllm_cos_sin_cache_against_transformers_rotary():
    """The BF16 tables are those of FP32 angles rounded once, on both sides, for the embedded models (a
    difference would show as a rope.cos_sin point that cannot be aligned)."""
    for name in ("qwen3-tiny", "qwen2-tiny"):
        assert cos_sin_equal(load_model(name))
