"""The rounding schedule file: where an engine rounds, as data, and applying it to a model.

A schedule is JSON (`SCHEDULE_FORMAT`). The lab's graph reader writes it from an engine's own code (`rla schedule`,
`rla_lib.engine_align`); a trainer takes it home and applies it with `align_to_engine(model, "schedule.json")`, with
nothing of the lab installed. What applying reads:

- "align": the regions the engine keeps in FP32 and their options, as the reader mapped its points (with "notes" on
  what the options cannot express, and "exact" where there is none);
- "sums" (optional): how each norm sums x², per norm kind and layer (`vector_sums.rms_sum_layouts`);
- "rope_rounding" (optional): {"rounding": "truncate"} where the engine's rotary kernel rounds toward zero;
- "attention" (optional): {"numerics": one of `attention.KERNELS`}, the engine's attention kernel, with the evidence
  it was chosen on.

The rest ("points" per layer and kernel, "source") is the reader's evidence, kept for people and for the lab.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..paths import atomic_write
from .patch import ALL_REGIONS, Alignment, align, refuse_if_aligned, unalign
from .vector_sums import rms_sum_spec

SCHEDULE_FORMAT = "rla-rounding-schedule/1"


class ScheduleFileError(ValueError):
    """A file that is not a rounding schedule."""


def save_schedule(sched: dict, path) -> Path:
    return atomic_write(path, lambda p: p.write_text(json.dumps(sched, indent=1, default=str)))


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


def schedule_to_align_kwargs(sched: dict) -> tuple[tuple[str, ...], dict]:
    """(regions, options) for `align` from a schedule: its "align" section, how its norms sum ("sums"), how its rotary
    kernel rounds ("rope_rounding") and its attention numerics ("attention")."""
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
    return regions, options


def align_to_engine(model, schedule, replace: bool = False) -> Alignment:
    """Make `model` round where the engine does: `schedule` is a schedule (dict) or the path of a saved one. Returns
    the `align` handle (`.undo()` restores stock; `.schedule` is the schedule applied). A model already aligned is
    refused unless `replace=True`. (`rla_lib.engine_align.align_to_engine` also takes a running engine.)"""
    refuse_if_aligned(model, replace)
    if isinstance(schedule, (str, Path)):
        schedule = load_schedule(schedule)
    elif not isinstance(schedule, dict):
        raise TypeError(f"schedule must be a schedule dict or a schedule file, got {type(schedule).__name__} "
                        "(a running Engine: rla_lib.align_to_engine)")
    regions, options = schedule_to_align_kwargs(schedule)
    unalign(model)
    handle = align(model, tuple(r for r in ALL_REGIONS if r in regions), **options)
    handle.schedule = schedule
    return handle
