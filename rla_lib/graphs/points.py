"""The canonical chain of rounding points of a decoder layer, and how each side holds each value there.

A point's value is typed: `Held` (bf16, fp32, n/a, opaque, ...), `Mixed` (layers, or several readings of one
layer, disagree: each value with its count) or `Split` (one value read rounded by one consumer and unrounded by
another). Their text (str(), JSON) is what tables show and files store: "bf16", "mixed: bf16×3, fp32×1",
"mixed: bf16 into ·sin, fp32 into ·cos". `parse_value` reads that text back (saved points and schedules).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from enum import Enum

# (key, region, what) for every decoder layer, in chain order
LAYER_POINTS = [
    ("input_norm.sum", "input norm", "residual sum, as the norm reads it"),
    ("input_norm.carried", "input norm", "residual stream, as the add reads it"),
    ("input_norm.normalized", "input norm", "x·rsqrt(mean x²+eps), before ·weight"),
    ("input_norm.output", "input norm", "norm output, as q/k/v proj reads it"),
    ("qkv_proj.output", "q/k/v proj", "projection output"),
    ("qk_norm.normalized", "Q/K norm + RoPE", "q,k·rsqrt, before ·weight"),
    ("qk_norm.output", "Q/K norm + RoPE", "q/k norm output, as RoPE reads it"),
    ("rope.cos_sin", "Q/K norm + RoPE", "cos/sin, as the products read them"),
    ("rope.products", "Q/K norm + RoPE", "q·cos and rotate(q)·sin, before the sum"),
    ("rope.output", "Q/K norm + RoPE", "rotated q/k, as attention reads them"),
    ("attention.output", "attention", "attention output"),
    ("o_proj.output", "o_proj", "projection output"),
    ("post_norm.sum", "residual add + norm", "residual + attention, as the norm reads it"),
    ("post_norm.carried", "residual add + norm", "residual stream, as the add reads it"),
    ("post_norm.normalized", "residual add + norm", "x·rsqrt(mean x²+eps), before ·weight"),
    ("post_norm.output", "residual add + norm", "norm output, as gate/up proj reads it"),
    ("gate_up_proj.output", "SwiGLU", "gate/up projection output"),
    ("swiglu.silu", "SwiGLU", "silu(gate), before ·up"),
    ("swiglu.output", "SwiGLU", "silu(gate)·up, as down_proj reads it"),
    ("down_proj.output", "down_proj", "projection output"),
]
FINAL_POINTS = [
    ("final_norm.sum", "final norm", "residual + last MLP, as the norm reads it"),
    ("final_norm.carried", "final norm", "residual stream, as the add reads it"),
    ("final_norm.normalized", "final norm", "x·rsqrt(mean x²+eps), before ·weight"),
    ("final_norm.output", "final norm", "norm output, as lm_head reads it"),
    ("lm_head.output", "lm_head", "logits"),
]
POINT_INFO = {k: (r, w) for k, r, w in LAYER_POINTS + FINAL_POINTS}
FINAL = "final"  # the layer label of FINAL_POINTS


class Held(str, Enum):
    """How one value is held where the next op reads it. A str: equal to, and written as, its text."""

    BF16 = "bf16"  # rounded to BF16
    FP32 = "fp32"  # kept in FP32 (fused)
    NA = "n/a"  # no such value (no Q/K norm; layer 0's residual is the embedding)
    BETWEEN_PIECES = "n/a (between compiled pieces)"  # attention runs between piecewise-compiled graphs
    NOT_IN_GRAPH = "n/a (not in this graph)"  # lm_head outside the code that was read
    OPAQUE = "opaque"  # inside a kernel no probe has opened
    UNREAD = "?"  # the reader did not recognise the pattern

    def __str__(self):
        return self.value

    @property
    def absent(self) -> bool:
        return self in (Held.NA, Held.BETWEEN_PIECES, Held.NOT_IN_GRAPH)

    def counts(self) -> Counter:
        return Counter() if self.absent else Counter({self: 1})

    def major(self):
        """(BF16 | FP32 | None if neither, exact): the setting nearest to this value."""
        return (self, True) if self in (Held.BF16, Held.FP32) else (None, True)


def held(rounded: bool) -> Held:
    return Held.BF16 if rounded else Held.FP32


def _majority(counts: Counter):
    """BF16 or FP32, whichever holds more (BF16 on a tie); None if neither occurs."""
    top = [(v, n) for v, n in counts.most_common() if v in (Held.BF16, Held.FP32)]
    if not top:
        return None
    return top[0][0] if len(top) == 1 or top[0][1] > top[1][1] else Held.BF16


@dataclasses.dataclass(frozen=True)
class Mixed:
    """Values that differ across layers (or readings): ((value, count), ...), most common first."""

    counts_: tuple

    def __str__(self):
        return "mixed: " + ", ".join(f"{v}×{n}" for v, n in self.counts_)

    def counts(self) -> Counter:
        total = Counter()
        for v, n in self.counts_:
            total += Counter({v: n}) if isinstance(v, Held) else Counter({k: m * n for k, m in v.counts().items()})
        return total

    def major(self):
        return _majority(self.counts()), False


@dataclasses.dataclass(frozen=True)
class Split:
    """One value read rounded by some consumers, unrounded by others: ((Held, consumer), ...) in text order.

    E.g. torch.compile of Transformers: q·cos reads the Q/K norm output in FP32, rotate_half(q) was stored in BF16.
    """

    reads: tuple

    def __str__(self):
        return "mixed: " + ", ".join(f"{h} into ·{c}" for h, c in self.reads)

    def counts(self) -> Counter:
        return Counter(h for h, _ in self.reads)

    def major(self):
        return _majority(self.counts()), False


def split(reads) -> Split:
    """A Split from (Held, consumer) pairs, duplicates dropped, in the order of its text."""
    return Split(tuple(sorted(set(reads), key=lambda r: f"{r[0]} into ·{r[1]}")))


def combine(values) -> Held | Mixed | Split:
    """One value for several (n/a ignored): the value if they agree, else a Mixed with counts."""
    real = [v for v in values if v != Held.NA]
    if not real:
        return Held.NA
    c = Counter(real)
    if len(c) == 1:
        return real[0]
    flat = Counter()
    for v, n in c.items():  # a Mixed among them contributes its own counts, so the text stays readable
        flat += v.counts() if isinstance(v, Mixed) else Counter({v: n})
    return Mixed(tuple(flat.most_common()))


def combine_counts(values) -> Held | Mixed:
    """One value for several points (e.g. all residual-stream norms), counting layers inside mixed values."""
    total = Counter()
    for v in values:
        total += v.counts()
    if not total:
        return Held.NA
    if len(total) == 1:
        return next(iter(total))
    return Mixed(tuple(total.most_common()))


def parse_value(v):
    """A point value from its text (saved points and schedules); typed values pass through."""
    if isinstance(v, (Held, Mixed, Split)):
        return v
    if not v.startswith("mixed: "):
        return Held(v)
    parts = [(p, *p.rpartition("×")) for p in v.removeprefix("mixed: ").split(", ")]
    if not any(sep and n.isdigit() for _, _, sep, n in parts):
        return Split(tuple((Held(h), c) for h, _, c in (p.partition(" into ·") for p, *_ in parts)))
    counts, pending = [], []
    for p, value, sep, n in parts:  # a Split inside a Mixed has commas of its own: its parts end without a count
        if sep and n.isdigit():
            counts.append((parse_value(", ".join(pending + [value])), int(n)))
            pending = []
        else:
            pending.append(p)
    if pending:
        raise ValueError(f"not a rounding-point value: {v!r}")
    return Mixed(tuple(counts))


def is_mixed(v) -> bool:
    return isinstance(v, (Mixed, Split))


@dataclasses.dataclass
class Points:
    """Per (layer, point): how the value is held there (`Held`, `Mixed` or `Split`), where it is computed."""

    name: str
    n_layers: int
    values: dict  # (layer, key) -> value; layer is an int or FINAL
    where: dict  # (layer, key) -> kernels/ops that compute the value
    labels: dict  # node id -> (layer, key)
    meta: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict:
        """One value per point over all layers (a Mixed when layers differ; n/a ignored)."""
        out = {key: combine([self.values.get((i, key), Held.NA) for i in range(self.n_layers)])
               for key, _, _ in LAYER_POINTS}
        for key, _, _ in FINAL_POINTS:
            out[key] = self.values.get((FINAL, key), Held.NA)
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "n_layers": self.n_layers, "meta": self.meta,
                "values": [[l, k, str(v)] for (l, k), v in self.values.items()],
                "where": [[l, k, v] for (l, k), v in self.where.items()]}

    @classmethod
    def from_json(cls, d) -> Points:
        return cls(d["name"], d["n_layers"], {(l, k): parse_value(v) for l, k, v in d["values"]},
                   {(l, k): v for l, k, v in d.get("where", [])}, {}, d.get("meta", {}))
