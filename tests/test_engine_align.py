"""rla_lib.engine_align: a schedule with its probed attention numerics, applied in one call."""

import numpy as np
import pytest
import torch

from rla_lib.align.schedule import save_schedule, schedule_to_align_kwargs
from rla_lib import graphs
from rla_lib.align import current, schedule_from_options
from rla_lib import task
from rla_lib.engine_align import (ATTENTION_NUMERICS, align_to_engine, cos_sin_equal, exactness, kernel_numerics,
                                  probe_attention, probe_sequences, with_attention)
from rla_lib.machine import describe, vllm_cpu_attention_kernel
from rla_lib.models import load_model
from rla_lib.scoring import pad_batch, token_logprobs
from test_graphs_inductor import CPU_CODE


def compiled_schedule(attention=None):
    sched = graphs.schedule(graphs.read_points(graphs.parse_output_code(CPU_CODE)), "vllm:compiled")
    return sched | ({"attention": {"numerics": attention}} if attention else {})


def logits(model):
    ids, mask = pad_batch([[1, 2, 3, 11, 4, 5, 14], [3, 3, 11, 2]])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_schedule_attention_section_adds_the_region_and_its_numerics():
    regions, options = schedule_to_align_kwargs(compiled_schedule())
    assert "attention" not in regions and "attention" not in options
    regions_a, options_a = schedule_to_align_kwargs(compiled_schedule("p_bf16"))
    assert regions_a == (*regions, "attention") and options_a == options | {"attention": "p_bf16"}


def test_align_to_engine_from_a_schedule_dict_and_file(tmp_path):
    model = load_model("qwen3-tiny")
    stock = logits(model)
    sched = compiled_schedule("fp32")
    handle = align_to_engine(model, sched)
    regions, options = schedule_to_align_kwargs(sched)
    assert current(model).schedule == schedule_from_options(regions, **options) and handle.schedule.attention == "fp32"
    aligned = logits(model)
    handle.undo()
    assert torch.equal(logits(model), stock) and not torch.equal(aligned, stock)
    handle = align_to_engine(model, save_schedule(sched, tmp_path / "s.json"))
    assert torch.equal(logits(model), aligned)
    with pytest.raises(ValueError, match="already aligned .*replace=True"):  # a second call says what the first did
        align_to_engine(model, sched)
    assert handle.active
    handle = align_to_engine(model, sched, replace=True)
    assert torch.equal(logits(model), aligned)
    handle.undo()
    with pytest.raises(TypeError, match="a schedule dict or a schedule file"):
        align_to_engine(model, 3)


@pytest.mark.engine
def test_probe_attention_picks_the_closest_numerics(compiled_engine):
    model = load_model("qwen3-tiny")
    regions, options = schedule_to_align_kwargs(compiled_schedule())
    sequences = probe_sequences(compiled_engine, n=8, max_tokens=12)
    found = probe_attention(compiled_engine, model, regions, options, sequences)
    assert set(found["distance"]) == set(ATTENTION_NUMERICS)
    assert found["numerics"] == min(found["distance"], key=found["distance"].get)
    assert found["measure"] == "exact KL per token", found
    # a KL >= 0, here of FP32 log-probabilities: where the sides are (nearly) equal, the mean can be a few 1e-9 below
    assert all(d >= -1e-7 for d in found["distance"].values()), found
    assert current(model) is None  # every probe was undone


# The kernels measured exact end to end (every token of held-out prompts): vLLM's AVX512-BF16 vector kernel (Zen 5,
# the README's notebook 03b tables) and its AVX2 build (Zen 3, tables/exactness.csv). On the others (AMX, AVX-512
# without BF16) the attention is bitwise per op, but the whole forward was not yet measured there against the engine
# (its AMX linear kernel, its oneDNN linear): an inexact result there is an expected failure, reported, not hidden.
MEASURED_EXACT = ("avx512_bf16", "avx2")


@pytest.mark.engine
@pytest.mark.skipif(kernel_numerics() is None, reason="no numerics reproduces this engine's attention kernel yet")
def test_aligned_to_the_running_engine_is_exact_on_prompts_the_probe_did_not_see(compiled_engine):
    """The engine's read schedule with its kernel's attention numerics: every logprob the engine returns, while
    sampling (what GRPO and TRL train on) and re-scoring, is the training side's bit for bit, and so is every whole
    distribution (exact KL 0), on held-out prompts; the probe's report says "exact"."""
    model = load_model("qwen3-tiny")
    handle = align_to_engine(model, compiled_engine, n_sequences=16)
    try:
        assert handle.engine_schedule["attention"]["numerics"] == kernel_numerics()
        report = exactness(handle.engine_schedule)
        prompts = [p.prompt for p in task.load_split()[64:80]]  # the probe took the first 16
        samples = [s for g in compiled_engine.sample(prompts, n=2, max_tokens=24, seed=7, full=True) for s in g]
        rescored = compiled_engine.score([s.ids for s in samples], full_vocab=True)
        training = token_logprobs(model, [s.ids for s in samples], full_vocab=True)
    finally:
        handle.undo()
    bitwise = all(np.array_equal(engine.token_logprobs, lp) and np.array_equal(engine.full, full)
                  and np.array_equal(sample.logprobs, lp[len(sample.prompt_ids) - 1:])
                  and np.array_equal(sample.full, full[len(sample.prompt_ids) - 1:])  # entry t scores token t + 1
                  for sample, engine, (lp, full) in zip(samples, rescored, training))
    if vllm_cpu_attention_kernel() not in MEASURED_EXACT and not (bitwise and report.startswith("exact on the probe")):
        pytest.xfail(f"not exact end to end on vLLM's {vllm_cpu_attention_kernel()} kernels yet: {report} ({describe()})")
    assert report.startswith("exact on the probe"), (describe(), report)
    assert bitwise, describe()


def test_exactness_says_exact_only_when_every_probe_token_is_bitwise():
    probed = dict(numerics="vllm_cpu", tokens=200, measure="exact KL per token", how="by hand")
    exact = with_attention(compiled_schedule(), **probed, distance={"vllm_cpu": 0.0}, bitwise={"vllm_cpu": 200})
    assert exactness(exact).startswith("exact on the probe: 200 of 200 tokens")
    one_off = with_attention(compiled_schedule(), **probed, distance={"vllm_cpu": 2e-9}, bitwise={"vllm_cpu": 199})
    assert exactness(one_off).startswith("not exact: 199 of 200 probe tokens bitwise (99.5%)")
    assert "op_check" in exactness(one_off)
    assert exactness(compiled_schedule("flash")).startswith("attention flash: not probed")


def test_with_attention_checks_the_numerics():
    sched = compiled_schedule()
    assert schedule_to_align_kwargs(with_attention(sched, "eager", how="by hand"))[1]["attention"] == "eager"
    with pytest.raises(ValueError, match="attention numerics"):
        with_attention(sched, "fp16")


def test_vllm_cos_sin_cache_against_transformers_rotary():
    """The BF16 tables are those of FP32 angles rounded once, on both sides, for the embedded models (a
    difference would show as a rope.cos_sin point that cannot be aligned)."""
    for name in ("qwen3-tiny", "qwen2-tiny"):
        assert cos_sin_equal(load_model(name))
