"""rla_lib.align.modeling_qwen: one list of rounding points, a region is the set of them it keeps in FP32, and recording
the points changes no bit."""

import ast
import json
from pathlib import Path

import pytest
import torch

from rla_lib import align as rla
from rla_lib.align.attention import truncate_to_bf16
from rla_lib.align.modeling_qwen import CARRIED_ROUNDING_POINTS, FINAL_POINTS, POINTS, ROUNDING_POINTS
from test_align import batch, build, one_thread  # noqa: F401 (one_thread: an autouse fixture)

MATMULS = {p.name for p in ROUNDING_POINTS if not p.exact}  # recomputed in FP32: not the kernel's own sum
CASES = {
    "stock": rla.Schedule(),
    "rope": rla.preset("rope"),
    "rope, stock Q/K norm, truncated": rla.schedule_from_options(("rope",), rope_qk_norm="stock", rope_rounding="truncate"),
    "swiglu": rla.preset("swiglu"),
    "residual_norm, FP32 weight": rla.schedule_from_options(("residual_norm",), norm_weight="fp32", residual_stream="fp32"),
    "the paper's three": rla.preset(*rla.REGIONS),
}


def logits(model, schedule=None, **align_kwargs):
    ids, mask = batch()
    handle = rla.align(model, schedule, **align_kwargs) if schedule is not None else None
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits
    finally:
        handle and handle.undo()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_region_rounds_at_every_point_but_those_it_keeps(arch, case, attn):
    schedule = CASES[case]
    model = build(arch, attn=attn)
    policy = schedule.rounding()
    seen: dict = {}

    def record(point, layer, fp32, rounded):
        assert fp32.dtype == torch.float32 and rounded.dtype == torch.bfloat16 and fp32.shape == rounded.shape, point
        if point not in MATMULS:  # pointwise: the recorded value is the one rounded, exactly
            expected = truncate_to_bf16(fp32) if point in policy.truncate else fp32.to(torch.bfloat16)
            assert torch.equal(expected, rounded), (point, layer)
        seen.setdefault(layer, set()).add(point)

    recorded = logits(model, schedule, record=record)
    assert torch.equal(recorded, logits(model, schedule))
    has_qk_norm = arch == "qwen3"
    layer_points = {p for p in POINTS if has_qk_norm or not p.startswith(("q_norm", "k_norm"))}
    assert set(seen) == {0, 1, "final"}
    for layer in (0, 1):
        assert seen[layer] == layer_points - policy.keep, layer
    assert seen["final"] == set(FINAL_POINTS) - policy.keep


def test_the_policy_names_only_points_of_the_model():
    every = rla.schedule_from_options(rla.ALL_REGIONS, norm_weight="fp32", residual_stream="fp32", rope_rounding="truncate")
    carried = {p.name for p in CARRIED_ROUNDING_POINTS}
    assert every.keep | every.truncate <= set(POINTS) | set(FINAL_POINTS) | carried
    assert every.keep == set(rla.KEEPABLE) and rla.Schedule().keep == frozenset()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize("case", ["stock", "the paper's three"])
def test_replay_sees_every_rounded_point_and_the_layer_carries_on_with_what_it_returns(arch, case):
    schedule = CASES[case]
    model = build(arch, attn="sdpa")
    seen: dict = {}

    def identity(point, layer, rounded):
        seen.setdefault(layer, set()).add(point)
        return rounded

    plain = logits(model, schedule)
    assert torch.equal(logits(model, schedule, replay=identity), plain)  # replaying itself: stock bits
    policy = schedule.rounding()
    layer_points = {p for p in POINTS if arch == "qwen3" or not p.startswith(("q_norm", "k_norm"))}
    assert seen[0] == seen[1] == layer_points - policy.keep and seen["final"] == set(FINAL_POINTS) - policy.keep

    def zero_last_mlp(point, layer, rounded):  # the last layer's MLP output replaced: only the residual carries on
        return torch.zeros_like(rounded) if (point, layer) == ("down_proj", 1) else rounded

    def without_last_mlp(module, args, output):
        return torch.zeros_like(output)

    hook = model.model.layers[1].mlp.register_forward_hook(without_last_mlp)
    try:
        expected = logits(model, schedule)
    finally:
        hook.remove()
    assert not torch.equal(expected, plain)
    assert torch.equal(logits(model, schedule, replay=zero_last_mlp), expected)


REPO = Path(__file__).resolve().parents[1]
SOURCES = ("rla_lib", "tests", "benchmarks", "experiments", "tools")
# A selection (a region's points, a claim's, a figure's panels) names some; a collection naming more than half of the
# layer's points is the list written again
MOST_NAMES = len(POINTS) // 2


def point_name_lists(source: str) -> list[int]:
    """Line numbers of the tuples, lists, sets and dicts in `source` that spell out more than `MOST_NAMES` point names,
    nested collections included (a table of rows, one point a row, is a list of them too)."""
    names = set(POINTS) | set(FINAL_POINTS)
    collections = (ast.Tuple, ast.List, ast.Set, ast.Dict)
    found, inside = [], set()
    for node in ast.walk(ast.parse(source)):  # outer collections before the ones they hold
        if not isinstance(node, collections) or id(node) in inside:
            continue
        spelled = {x.value for x in ast.walk(node) if isinstance(x, ast.Constant) and x.value in names}
        if len(spelled) > MOST_NAMES:
            found.append(node.lineno)
            inside |= {id(x) for x in ast.walk(node)}
    return found


def test_one_list_of_rounding_points():
    """The layer's rounding points are listed once (`ROUNDING_POINTS`); the capture, the op check, notebooks and tests
    derive theirs from it. The planted second list is found, so the check bites."""
    assert point_name_lists(f"LOCATIONS = {list(POINTS[:MOST_NAMES + 1])!r}") == [1]
    canonical = REPO / "rla_lib" / "align" / "modeling_qwen.py"
    line = next(i for i, text in enumerate(canonical.read_text().splitlines(), 1) if text.startswith("ROUNDING_POINTS = "))
    assert point_name_lists(canonical.read_text()) == [line]  # the one list itself
    found = []
    for path in (p for folder in SOURCES for p in sorted((REPO / folder).rglob("*.py")) if "fixtures" not in p.parts):
        found += [f"{path.relative_to(REPO)}:{n}" for n in point_name_lists(path.read_text()) if path != canonical]
    for path in sorted((REPO / "notebooks").glob("[0-9]*.ipynb")):
        for cell in (c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"):
            code = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!")))
            found += [f"{path.relative_to(REPO)}" for _ in point_name_lists(code)]
    assert not found, "a second list of rounding points (derive it from modeling_qwen.ROUNDING_POINTS):\n" + "\n".join(found)
