"""Tables and the figure: where each side rounds, where sides differ, what each fused kernel keeps in FP32."""

from __future__ import annotations

from collections import defaultdict

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D

from .detectors import WALK_OPS, Walker
from .graph import BF16_DTYPES, Graph
from .points import FINAL, FINAL_POINTS, LAYER_POINTS, POINT_INFO, Held, Points


def points_table(points: dict, per_layer: bool = False):
    """Rows: (layer, region, point); columns: one per side. Values bf16/fp32/n/a (see Points)."""
    rows = []
    first = next(iter(points.values()))
    layers = list(range(first.n_layers)) if per_layer else ["all"]
    for lay in layers:
        for key, region, what in LAYER_POINTS:
            row = {"layer": lay, "region": region, "point": key, "what": what}
            for side, p in points.items():
                row[side] = str(p.summary()[key] if lay == "all" else p.values.get((lay, key), Held.NA))
            rows.append(row)
    for key, region, what in FINAL_POINTS:
        row = {"layer": "final", "region": region, "point": key, "what": what}
        for side, p in points.items():
            row[side] = str(p.values.get((FINAL, key), Held.NA))
        rows.append(row)
    return pd.DataFrame(rows).set_index(["layer", "region", "point"])


def points_match(reference: Points, other: Points) -> tuple[int, int]:
    """(agreeing, compared): of the (layer, point) values `reference` holds readably in BF16 or FP32, how many
    `other` holds the same way."""
    keys = [k for k, v in reference.values.items() if v in (Held.BF16, Held.FP32)]
    return sum(other.values.get(k) == reference.values[k] for k in keys), len(keys)


def rounding_diff(points: dict, reference: str, per_layer: bool = True):
    """Where each side rounds differently from `reference`: one row per (layer, point, side)."""
    t = points_table(points, per_layer=per_layer)
    rows = []
    for idx, r in t.iterrows():
        ref = r[reference]
        for side in points:
            if side == reference or r[side] == ref:
                continue
            if r[side] == Held.BF16 and ref == Held.FP32:
                who = f"{side} rounds, {reference} keeps FP32"
            elif r[side] == Held.FP32 and ref == Held.BF16:
                who = f"{reference} rounds, {side} keeps FP32"
            else:
                who = f"{reference}: {ref}; {side}: {r[side]}"
            rows.append({"layer": idx[0], "region": idx[1], "point": idx[2], "side": side, reference: ref,
                         "side value": r[side], "difference": who})
    return pd.DataFrame(rows)


def _layer_label(layer) -> str:
    return "final" if layer == FINAL else f"L{layer}"


def _describe(g: Graph, points: Points, w: Walker, nid: int) -> str:
    for src, _ in w.back(nid) + [(nid, False)]:
        lab = points.labels.get(src)
        if lab:
            return f"{_layer_label(lab[0])} {lab[1]}"
    src, _ = w.source(nid)
    n = g[src] if src is not None else g[nid]
    if n.op in ("sum", "welford"):
        return "Σx² partial (for rsqrt)"
    if n.op == "neg" or any(g[s].op == "neg" for s, _ in w.back(nid, walk=WALK_OPS - {"neg"})):
        return "rotate_half (−x2, x1)"
    return f"{n.op} value"


def kernel_table(g: Graph, points: Points):
    """One row per fused-kernel call: source ops from its name, BF16 stores (roundings), FP32 stores and the
    values it keeps in FP32 inside, and the decoder regions/layers its values belong to."""
    w = Walker(g)
    by_kernel = defaultdict(list)
    for n in g.nodes:
        if n.kernel in g.kernels:
            by_kernel[n.kernel].append(n)
    rows = []
    for kname, info in g.kernels.items():
        nodes = by_kernel.get(kname, [])
        labs = sorted({points.labels[n.id] for n in nodes if n.id in points.labels}, key=str)
        bf16_stores, fp32_stores = [], []
        for n in nodes:
            if n.op == "store":
                (bf16_stores if n.dtype in BF16_DTYPES else fp32_stores).append(_describe(g, points, w, n.inputs[0]))
        inside = sorted({f"{_layer_label(l)} {k}" for l, k in labs if points.values.get((l, k)) == Held.FP32})
        rows.append({
            "kernel": kname, "fused ops (from name)": ", ".join(info.get("ops", [])),
            "regions": ", ".join(sorted({POINT_INFO[k][0] for _, k in labs})),
            "layers": ", ".join(sorted({str(l) for l, _ in labs}, key=lambda x: (len(x), x))),
            "BF16 stores (roundings)": "; ".join(sorted(set(bf16_stores))),
            "FP32 stores": "; ".join(sorted(set(fp32_stores))),
            "kept FP32 inside": "; ".join(inside),
        })
    return pd.DataFrame(rows)


_STYLES = {Held.BF16: dict(marker="s", color="#c0392b", ms=9), Held.FP32: dict(marker="o", mfc="white", color="#2471a3", ms=9)}


def plot_layer_chain(points: dict, layer: int = 1, reference: str | None = None, title: str | None = None, ax=None):
    """One decoder layer as its op chain (x) with each side's rounding points marked (rows)."""
    keys = [k for k, _, _ in LAYER_POINTS]
    sides = list(points)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(10, 0.62 * len(keys)), 0.55 * len(sides) + 2.6))
    else:
        fig = ax.figure
    ref = reference or sides[0]
    for y, side in enumerate(sides):
        for x, key in enumerate(keys):
            v = points[side].values.get((layer, key), Held.NA)
            major, exact = v.major()
            if major is None:
                ax.plot(x, y, marker="x", color="0.6", ms=7, ls="none")
                continue
            ax.plot(x, y, ls="none", **_STYLES[major])
            if not exact:
                ax.plot(x, y, marker="s", mfc="none", color="#8e44ad", ms=14, ls="none")
            rv = points[ref].values.get((layer, key), Held.NA)
            if side != ref and rv.major()[0] is not None and v != rv:
                ax.plot(x, y, marker="o", mfc="none", color="#f39c12", ms=17, mew=2, ls="none")
    ax.grid(False)
    _region_axis(ax, keys)
    ax.set_yticks(range(len(sides)), sides)
    ax.set_ylim(len(sides) - 0.4, -1.0)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    handles = [Line2D([], [], ls="none", **_STYLES[Held.BF16], label="rounded to BF16"),
               Line2D([], [], ls="none", **_STYLES[Held.FP32], label="kept in FP32"),
               Line2D([], [], ls="none", marker="x", color="0.6", label="n/a"),
               Line2D([], [], ls="none", marker="o", mfc="none", color="#f39c12", ms=12, mew=2, label=f"differs from {ref}"),
               Line2D([], [], ls="none", marker="s", mfc="none", color="#8e44ad", ms=12, label="mixed across layers/paths")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.30), ncol=5, fontsize=8, frameon=False)
    ax.set_title(title or f"decoder layer {layer}: where each side rounds", fontsize=10)
    return fig


def _region_axis(ax, keys):
    """Point names on x, separators and region names above them."""
    regions = [POINT_INFO[k][0] for k in keys]
    for x in range(1, len(keys)):
        if regions[x] != regions[x - 1]:
            ax.axvline(x - 0.5, color="0.85", lw=1)
    ax.set_xticks(range(len(keys)), [k.split(".", 1)[1].replace("_", " ") if "." in k else k for k in keys],
                  rotation=60, ha="right", fontsize=8)
    starts = [0] + [x for x in range(1, len(keys)) if regions[x] != regions[x - 1]]
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else len(keys)
        ax.text((s + e - 1) / 2, -0.75, regions[s], ha="center", va="bottom", fontsize=7.5, color="0.3")
