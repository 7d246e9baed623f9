"""rla_lib.graphs schedules: JSON round trip, mapping to rla_lib.align options, and back through a traced model."""

import pytest

from rla_lib.align.schedule import ScheduleFileError, load_schedule, save_schedule, schedule_to_align_kwargs
from rla_lib import graphs
from rla_lib.align import REGIONS, current, schedule_from_options
from rla_lib.align.modeling_qwen import QK_NORM
from rla_lib.engine_align import align_to_engine
from rla_lib.models import load_model
from test_graphs_inductor import CPU_CODE
from test_graphs_reader import tiny


def effective(regions, options, family):
    """The points kept that matter (Qwen2 has no Q/K norm; the sum order is tested in tests/test_align_rms_sum.py)."""
    keep = schedule_from_options(regions, **{k: v for k, v in options.items() if k != "rms_sum"}).keep
    return keep - set(QK_NORM) if family == "qwen2" else keep


def test_schedule_json_roundtrip_and_apply(tmp_path):
    sched = graphs.schedule(graphs.read_points(graphs.parse_output_code(CPU_CODE)), "vllm:compiled")
    path = save_schedule(sched, tmp_path / "schedule.json")
    loaded = load_schedule(path)
    regions, options = schedule_to_align_kwargs(loaded)
    assert regions == REGIONS
    sums = options.pop("rms_sum")  # how each norm sums x², per layer (tests/test_align_rms_sum.py)
    assert options == {"rope_cos_sin": "bf16", "rope_qk_norm": "fp32", "norm_weight": "fp32", "residual_stream": "fp32"}
    with pytest.raises(ValueError, match="layouts for a model with 2"):  # the schedule's 4 layers against 2
        align_to_engine(tiny("qwen3"), loaded)
    options["rms_sum"] = sums
    model = load_model("qwen3-tiny")
    handle = align_to_engine(model, loaded)
    assert current(model).schedule == schedule_from_options(regions, **options) == handle.schedule
    handle.undo()
    assert current(model) is None
    with pytest.raises(ScheduleFileError):
        (tmp_path / "other.json").write_text('{"format": "something else"}')
        load_schedule(tmp_path / "other.json")


@pytest.mark.parametrize("text, error, message", [
    (None, FileNotFoundError, "no such schedule file"),
    ('{"format": ', ScheduleFileError, "the file is not JSON"),
    ("[1, 2]", ScheduleFileError, "not a rounding schedule"),
])
def test_a_bad_schedule_file_is_named_with_what_was_expected(tmp_path, text, error, message):
    path = tmp_path / "schedule.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(error, match=message) as raised:
        align_to_engine(tiny("qwen3"), path)
    assert str(path) in str(raised.value)


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
    got = schedule_to_align_kwargs(sched)
    assert effective(*got, family) == effective(regions, options, family)
    assert sched["align"]["exact"], sched["align"]["notes"]
    # and aligning to that schedule rounds exactly where the traced model did
    again = graphs.read_points(graphs.training_graph(model, *got))
    assert again.summary() == points.summary()


def test_the_reader_names_the_rounding_points_of_the_one_list():
    """Every value the reader reads stands for points of `modeling_qwen`'s list, and every point there is read."""
    from rla_lib.align.modeling_qwen import CARRIED_ROUNDING_POINTS, FINAL_ROUNDING_POINTS, ROUNDING_POINTS
    from rla_lib.graphs.points import LAYER_POINTS
    from rla_lib.graphs.schedules import ROUNDING_POINTS_READ
    from rla_lib.graphs.points import FINAL_POINTS as READ_FINAL

    listed = {p.name for p in ROUNDING_POINTS + FINAL_ROUNDING_POINTS + CARRIED_ROUNDING_POINTS}
    assert set(ROUNDING_POINTS_READ) == {key for key, _, _ in LAYER_POINTS + READ_FINAL}
    read = {p for points in ROUNDING_POINTS_READ.values() for p in points}
    assert read == listed, (read ^ listed)


def test_a_read_schedule_keeps_the_keepable_points_the_engine_holds_in_fp32():
    """The schedule the rules map the reader's values to keeps in FP32 exactly the keepable points whose read values are
    FP32 (the CPU code read: a schedule without notes), spelled in the one list's names in the saved file."""
    from rla_lib.align import KEEPABLE
    from rla_lib.graphs.schedules import ROUNDING_POINTS_READ

    sched = graphs.schedule(graphs.read_points(graphs.parse_output_code(CPU_CODE)), "vllm:compiled")
    assert sched["align"]["exact"], sched["align"]["notes"]
    in_fp32 = {p for key, v in sched["points"].items() if v["value"] == "fp32" for p in ROUNDING_POINTS_READ[key]}
    held = {p for key, v in sched["points"].items() if v["value"] != "fp32" for p in ROUNDING_POINTS_READ[key]}
    expected = (in_fp32 - held) & set(KEEPABLE)
    assert sorted(expected) == save_schedule_and_read(sched)["rounding"]["keep"]


def save_schedule_and_read(sched):
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        return json.loads(save_schedule(sched, Path(folder) / "s.json").read_text())
