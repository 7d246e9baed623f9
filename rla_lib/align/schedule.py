"""The rounding schedule file: where an engine rounds, as data, and applying it to a model.

A schedule is JSON (`SCHEDULE_FORMAT`). The lab's graph reader writes it from an engine's own code (`rla schedule`,
`rla_lib.engine_align`); a trainer takes it home and applies it with `align_to_engine(model, "schedule.json")`, with
nothing of the lab installed. `schedule_from_file` reads it into a `Schedule` (the points kept in FP32, those
truncated, the attention kernel, the norms' sum order) from:

- "align": the regions the engine keeps in FP32 and their details, as the reader mapped its points (with "notes" on
  what cannot be expressed, and "exact" where there is none), in the names `schedule_from_options` reads;
- "sums" (optional): how each norm sums x², per norm kind and layer (`vector_sums.rms_sum_layouts`);
- "rope_rounding" (optional): {"rounding": "truncate"} where the engine's rotary kernel rounds toward zero;
- "attention" (optional): {"numerics": one of `attention.KERNELS`}, the engine's attention kernel, with the evidence
  it was chosen on.

`save_schedule` also writes "rounding": the same `Schedule` spelled in rounding points (`modeling_qwen`), for
people reading the file. The rest ("points" per layer and kernel, "source") is the reader's evidence.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import atomic_write
from .attention import KERNELS as ATTENTION_KERNELS
from .modeling_qwen import QK_NORM, Schedule, preset
from .patch import ALL_REGIONS, Alignment, align, refuse_if_aligned, unalign
from .vector_sums import rms_sum_spec

SCHEDULE_FORMAT = "rla-rounding-schedule/1"


class ScheduleFileError(ValueError):
    """A file that is not a rounding schedule."""


def save_schedule(sched: dict, path) -> Path:
    """Write `sched` (with its "rounding" section made anew from what applying it reads) atomically."""
    sched = sched | {"rounding": rounding_section(schedule_from_file(sched))}
    return atomic_write(path, lambda p: p.write_text(json.dumps(sched, indent=1, default=str)))


def rounding_section(schedule: Schedule) -> dict:
    return {"keep": sorted(schedule.keep), "truncate": sorted(schedule.truncate), "attention": schedule.attention,
            "rms_sum": schedule.rms_sum}


def load_schedule(path) -> dict:
    """A schedule file (`save_schedule`, `rla schedule`), refused with its name where it is missing or not one."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such schedule file (`rla schedule` or `engine_schedule_for` writes one)")
    try:
        d = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ScheduleFileError(f"{path}: not a rounding schedule, the file is not JSON ({error}); write it again with "
                                "`rla schedule`") from None
    if not isinstance(d, dict) or d.get("format") != SCHEDULE_FORMAT or "align" not in d:
        raise ScheduleFileError(f"{path}: not a rounding schedule ({SCHEDULE_FORMAT}); write it again with "
                                "`rla schedule`")
    return d


# The names a schedule file's "align" section (and the lab's configuration names) give a schedule's details, with
# their defaults and the region each acts in (outside it a detail has no effect)
DETAILS = {
    "rope_cos_sin": ("fp32", ("fp32", "bf16"), ("rope",)),  # bf16: cos/sin rounded first (point rope.cos_sin)
    "rope_qk_norm": ("fp32", ("fp32", "stock"), ("rope",)),  # stock: the Q/K norm rounds as Transformers does
    "rope_rounding": ("nearest", ("nearest", "truncate"), ("rope",)),  # truncate: rotated Q/K toward zero
    "norm_weight": ("stock", ("stock", "fp32"), ("residual_norm",)),  # fp32: points *_norm.rsqrt kept
    "residual_stream": ("bf16", ("bf16", "fp32"), ("residual_norm",)),  # fp32: point residual_stream kept
    "attention": ("fp32", tuple(ATTENTION_KERNELS), ("attention",)),  # the engine's kernel
    "rms_sum": ("torch", None, ("rope", "residual_norm")),  # `vector_sums.rms_sum_layouts`
}


def schedule_from_options(regions, **details) -> Schedule:
    """The `Schedule` of regions (`ALL_REGIONS`) with `DETAILS` named: what a format-1 file's "align" section and the
    lab's configuration names ("rope|rope_cos_sin=bf16") mean."""
    if unknown := sorted(set(details) - set(DETAILS)):
        raise ValueError(f"unknown schedule detail(s) {unknown}; known: {', '.join(DETAILS)}.")
    for name, value in details.items():
        allowed = DETAILS[name][1]
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not valid; allowed values: {', '.join(map(repr, allowed))}.")
    regions = (regions,) if isinstance(regions, str) else tuple(regions)
    base = preset(*regions)
    on = {name: value for name, value in details.items()
          if value != DETAILS[name][0] and set(DETAILS[name][2]) & set(regions)}  # a detail outside its regions: none
    keep, truncate = set(base.keep), set()
    if on.get("rope_cos_sin") == "bf16":
        keep.discard("rope.cos_sin")
    if on.get("rope_qk_norm") == "stock":
        keep -= set(QK_NORM)
    if on.get("rope_rounding") == "truncate":
        truncate = {"rope.q_sum", "rope.k_sum"}
    if on.get("norm_weight") == "fp32":
        keep |= {"input_norm.rsqrt", "post_norm.rsqrt", "final_norm.rsqrt"}
    if on.get("residual_stream") == "fp32":
        keep.add("residual_stream")
    attention = on.get("attention", base.attention)
    return Schedule(frozenset(keep), frozenset(truncate), attention, on.get("rms_sum", "torch"))


def schedule_to_align_kwargs(sched: dict) -> tuple[tuple[str, ...], dict]:
    """(regions, details) of a schedule file: its "align" section, how its norms sum ("sums"), how its rotary
    kernel rounds ("rope_rounding") and its attention numerics ("attention"); `schedule_from_options` reads them."""
    if sched.get("format") != SCHEDULE_FORMAT:
        raise ValueError(f"not a rounding schedule ({SCHEDULE_FORMAT}): format {sched.get('format')!r}")
    regions, options = tuple(sched["align"]["regions"]), dict(sched["align"]["options"])
    if sched.get("sums") and any(r in regions for r in ("rope", "residual_norm")):
        options["rms_sum"] = rms_sum_spec(sched["sums"])
    rounding = sched.get("rope_rounding", {}).get("rounding")
    if rounding and "rope" in regions:
        options["rope_rounding"] = rounding
    numerics = sched.get("attention", {}).get("numerics")
    if numerics:
        regions, options["attention"] = (*regions, "attention"), numerics
    return tuple(r for r in ALL_REGIONS if r in regions), options


def schedule_from_file(sched: dict) -> Schedule:
    """The `Schedule` a schedule file (its contents) applies."""
    regions, details = schedule_to_align_kwargs(sched)
    return schedule_from_options(regions, **details)


def align_to_engine(model, schedule, replace: bool = False, fused: bool = False) -> Alignment:
    """Make `model` round where the engine does: `schedule` is a schedule (dict) or the path of a saved one. Returns
    the `align` handle (`.undo()` restores stock; `.schedule` the `Schedule` applied, `.engine_schedule` the file's
    contents). A model already aligned is refused unless `replace=True`. (`rla_lib.engine_align.align_to_engine` also
    takes a running engine.)"""
    refuse_if_aligned(model, replace)
    if isinstance(schedule, (str, Path)):
        schedule = load_schedule(schedule)
    elif not isinstance(schedule, dict):
        raise TypeError(f"schedule must be a schedule dict or a schedule file, got {type(schedule).__name__} "
                        "(a running Engine: rla_lib.align_to_engine)")
    applied = schedule_from_file(schedule)
    unalign(model)
    handle = align(model, applied, fused=fused)
    handle.engine_schedule = schedule
    return handle
