"""The rounding schedule written from the points read off an engine: their mapping to `rla_lib.align` options.

The file format, and applying a schedule, are the fix's (`rla_lib.align.schedule`); the reader writes the "align"
section it reads. The mapping is one rule per align region (`_RULES`): each reads the schedule's point values and sets its
region and options, with a note wherever the engine does something the options cannot express. Points no
rule owns must round as stock Transformers does (`_FIXED_POINTS`). A new align option is one more rule.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..align import REGIONS
from ..align.modeling_qwen import CARRIED_ROUNDING_POINTS, FINAL_ROUNDING_POINTS, ROUNDING_POINTS
from ..align.schedule import SCHEDULE_FORMAT, save_schedule
from ..align.vector_sums import NORM_KINDS
from ..models import resolve_model
from .graph import GRAPHS_DIR
from .points import FINAL, FINAL_POINTS, LAYER_POINTS, Held, Mixed, Points, Split, combine_counts, parse_value

# points no align option changes: the engine must round them as Transformers does
_FIXED_POINTS = ("input_norm.output", "qkv_proj.output", "rope.output", "attention.output", "o_proj.output",
                 "post_norm.output", "gate_up_proj.output", "swiglu.output", "down_proj.output", "final_norm.output",
                 "lm_head.output")
_NORMS = ("input_norm", "post_norm", "final_norm")
# The training side's rounding points (`rla_lib.align.modeling_qwen`, the one list of them) each value the reader reads
# stands for (their `read_as`): an engine module computes q/k/v, gate/up and q/k together; a norm's input sum is the
# residual sum before it (the previous layer's `residual_mlp` for an input norm); the logits come after the last point.
# Here, not in .points: the reader reads engine code without torch, which the fix's list imports.
ROUNDING_POINTS_READ = {key: tuple(p.name for p in ROUNDING_POINTS + FINAL_ROUNDING_POINTS + CARRIED_ROUNDING_POINTS
                                   if key in p.read_as) for key, _, _ in LAYER_POINTS + FINAL_POINTS}


@dataclasses.dataclass
class _Mapping:
    """Point values (key -> Held/Mixed/Split) being mapped: the regions and options chosen, notes on the rest."""

    summary: dict
    has_qk_norm: bool
    regions: list = dataclasses.field(default_factory=list)
    options: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)

    def value(self, key):
        return self.summary.get(key, Held.NA)

    def norms(self, point: str):
        """One value for a point of all residual-stream norms (input, post-attention, final)."""
        return combine_counts(self.value(f"{n}.{point}") for n in _NORMS)

    def pick(self, label, value, on, off, default=None):
        """`on` if the engine keeps `value` in FP32, `off` if it rounds it; majority (noted) if layers differ."""
        major, exact = value.major()
        if major is None:
            self.notes.append(f"{label}: engine value {str(value)!r} cannot be read as bf16/fp32; left at {default!r}")
            return default
        if not exact:
            self.notes.append(f"{label}: layers differ ({value}); nearest setting follows the majority ({major})")
        return on if major == Held.FP32 else off


def _residual_norm(m: _Mapping):
    """The norms read an unrounded sum; options: the carried residual, the weight multiply."""
    carried, normalized = m.norms("carried"), m.norms("normalized")
    if m.pick("residual_norm: residual sum read by the norms", m.norms("sum"), True, False, False):
        m.regions.append("residual_norm")
        m.options["residual_stream"] = m.pick("residual_stream", carried, "fp32", "bf16", "bf16")
        m.options["norm_weight"] = m.pick("norm_weight", normalized, "fp32", "stock", "stock")
        return
    if carried.major()[0] == Held.FP32:
        m.notes.append("residual carried in FP32 while the norms read a rounded sum: align has no such option "
                       "(residual_stream needs residual_norm); left stock")
    if normalized.major()[0] == Held.FP32:
        m.notes.append("norm weight multiplied in FP32 while the norm reads a rounded sum: align's norm_weight "
                       "only exists inside residual_norm; left stock")


def _rope(m: _Mapping):
    """The rotary products in FP32; options: cos/sin as read, the Q/K norm before it."""
    cos_sin = m.value("rope.cos_sin")
    if m.pick("rope: q·cos and rotate(q)·sin", m.value("rope.products"), True, False, False):
        m.regions.append("rope")
        m.options["rope_cos_sin"] = m.pick("rope_cos_sin", cos_sin, "fp32", "bf16", "fp32")
        if m.has_qk_norm:
            m.options["rope_qk_norm"] = _rope_qk_norm(m)
        return
    if cos_sin.major()[0] == Held.FP32:
        m.notes.append("FP32 cos/sin but rounded RoPE products: not expressible (rope_cos_sin exists only inside rope)")
    if m.has_qk_norm and m.value("qk_norm.output").major()[0] == Held.FP32:
        m.notes.append("unrounded Q/K norm output but rounded RoPE products: not expressible; left stock")


def _rope_qk_norm(m: _Mapping) -> str:
    nz, out = m.value("qk_norm.normalized"), m.value("qk_norm.output")
    if _partly_rounded(out):  # e.g. rotate_half(q) stored in BF16, q·cos read in FP32
        m.notes.append(f"Q/K norm output reaches RoPE partly rounded ({out}): align has no such option; "
                       f"nearest follows the norm itself ({nz})")
        out = nz
    (a, a_exact), (b, b_exact) = nz.major(), out.major()
    if a is None or b is None:
        m.notes.append(f"Q/K norm: {str(nz)!r}/{str(out)!r} not readable; rope_qk_norm left at 'fp32'")
        return "fp32"
    if a != b:
        m.notes.append(f"Q/K norm rounds {nz} before ·weight and {out} after it: align's rope_qk_norm is "
                       f"all-FP32 or stock (two roundings); nearest follows the output ({b})")
    if not (a_exact and b_exact):
        m.notes.append(f"Q/K norm differs across layers ({nz} / {out}); nearest follows the majority")
    return "fp32" if b == Held.FP32 else "stock"


def _partly_rounded(v) -> bool:
    """Read rounded by some consumers and unrounded by others (in some layer)."""
    return isinstance(v, Split) or isinstance(v, Mixed) and any(isinstance(x, Split) for x, _ in v.counts_)


def _swiglu(m: _Mapping):
    if m.pick("swiglu: silu(gate) before ·up", m.value("swiglu.silu"), True, False, False):
        m.regions.append("swiglu")


_RULES = (_residual_norm, _rope, _swiglu)  # in the order of their notes


def _align_mapping(summary: dict, has_qk_norm: bool):
    """Map a schedule's point values to (regions, align options, notes on what does not map exactly)."""
    m = _Mapping({k: parse_value(v) for k, v in summary.items()}, has_qk_norm)
    for rule in _RULES:
        rule(m)
    for key in _FIXED_POINTS:
        v = m.value(key)
        if v != Held.BF16 and not (isinstance(v, Held) and v.absent):
            m.notes.append(f"{key} is {v} in the engine, BF16 in Transformers, and no align option changes it")
    return tuple(r for r in REGIONS if r in m.regions), m.options, m.notes


def norm_sums(points: Points) -> dict | None:
    """How each norm of the engine sums x² (`rla_lib.align`'s `rms_sum` layouts), per kind and layer: the float sum
    reduction of the kernel that computes the norm (inductor's C++ code); None where the code shows none (an eager
    trace, Triton code)."""
    layouts = points.meta.get("float_sums") or {}
    if not layouts:
        return None

    def layout(layer, key):
        found = [layouts.get(k.split("#")[0]) for k in points.where.get((layer, key), [])]
        return next((f for f in found if f), "torch")  # "torch": no sum read for it (e.g. no Q/K norm)

    sums = {kind: [layout(i, f"{kind}.normalized") for i in range(points.n_layers)] for kind in NORM_KINDS[:-1]}
    return sums | {"final_norm": [layout(FINAL, "final_norm.normalized")]}


def schedule(points: Points, engine: str | None = None, meta: dict | None = None) -> dict:
    """A machine-readable rounding schedule from the points read off an engine's code or trace."""
    summary = points.summary()
    has_qk_norm = points.meta.get("has_qk_norm", True)
    regions, options, notes = _align_mapping(summary, has_qk_norm)
    per_layer = {}
    for key, region, what in LAYER_POINTS:
        per_layer[key] = {"region": region, "what": what, "value": str(summary[key]),
                          "per_layer": [str(points.values.get((i, key), Held.NA)) for i in range(points.n_layers)],
                          "kernels": sorted({k for i in range(points.n_layers) for k in points.where.get((i, key), [])})}
    for key, region, what in FINAL_POINTS:
        per_layer[key] = {"region": region, "what": what, "value": str(summary[key]), "per_layer": None,
                          "kernels": points.where.get((FINAL, key), [])}
    for key, entry in per_layer.items():  # the values read, in the names of the training side's rounding points
        entry["rounding_points"] = list(ROUNDING_POINTS_READ[key])
    return {
        "format": SCHEDULE_FORMAT,
        "engine": engine or points.name,
        "n_layers": points.n_layers,
        "has_qk_norm": has_qk_norm,
        "source": {k: v for k, v in {**points.meta, **(meta or {})}.items() if k not in ("missing", "float_sums")},
        "points": per_layer,
        **({"sums": sums} if (sums := norm_sums(points)) else {}),
        "align": {"regions": list(regions), "options": options, "exact": not notes, "notes": notes},
        "values": "bf16 = the value is rounded to BF16 where the next op reads it; fp32 = kept in FP32 (fused); "
                  "n/a = no such value (e.g. no Q/K norm, layer 0's residual is the embedding)",
    }


def schedule_notes(sched: dict) -> list[str]:
    """What the align options cannot express of the engine's schedule (its points read again)."""
    if sched.get("format") != SCHEDULE_FORMAT:
        raise ValueError(f"not a rounding schedule ({SCHEDULE_FORMAT}): format {sched.get('format')!r}")
    summary = {k: v["value"] for k, v in sched["points"].items()}
    return _align_mapping(summary, sched.get("has_qk_norm", True))[2]


def export_schedule(points: Points, model, side: str, directory=None) -> Path:
    """Write the schedule JSON for one side to results/graphs/<model>/schedule-<side>.json."""
    directory = Path(directory) if directory else GRAPHS_DIR / resolve_model(model).path.name
    return save_schedule(schedule(points, side), directory / f"schedule-{side.replace(':', '-')}.json")
