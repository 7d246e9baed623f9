"""read_points: the decoder-layer structure of a value graph and, per layer, how each value of the canonical chain
(`LAYER_POINTS`, `FINAL_POINTS`) is held where the next op reads it. The regions are found by `detectors`."""

from __future__ import annotations

from . import detectors
from .detectors import Reading
from .graph import Graph
from .points import FINAL, FINAL_POINTS, LAYER_POINTS, Held, Points

_GRAPH_META = ("engine", "vllm", "torch", "model", "mode", "device", "float_sums")


class AnalysisError(RuntimeError):
    """The graph does not show the decoder-layer structure this package reads (the message names the source)."""


def read_points(g: Graph, strict: bool = True) -> Points:
    """Find norms, residual adds, RoPE, SwiGLU, projections and attention; read where each value is rounded."""
    src_desc = ", ".join(g.meta.get("files", [])) or g.name
    r = Reading(g)
    norms = detectors.find_norms(r)
    residual = [n for n in norms if not n.is_qk(r.nodes)]
    qk = [n for n in norms if n.is_qk(r.nodes)]
    if len(residual) < 3 or len(residual) % 2 == 0:
        raise AnalysisError(f"{src_desc}: found {len(residual)} residual-stream RMSNorms (rsqrt whose input is not a "
                            "projection); a decoder of L layers has 2L+1 (input and post-attention norm per layer, "
                            "final norm). Not a Qwen2/Qwen3-style decoder graph, or an unfamiliar code pattern.")
    n_layers = (len(residual) - 1) // 2
    r.bounds = [residual[2 * i].rsqrt for i in range(n_layers)]
    detectors.read_residual_norms(r, residual)
    detectors.read_qk_norms(r, qk)
    qk_outputs = {o for norm in qk for o in norm.outputs}
    detectors.read_rope(r, qk_outputs)
    detectors.read_rotary_kernels(r, qk_outputs)
    for lay in range(n_layers):
        if (lay, "qk_norm.normalized") not in r.values:
            r.put(lay, "qk_norm.normalized", Held.NA)
            r.put(lay, "qk_norm.output", Held.NA)
    swiglu_products = detectors.read_swiglu(r)
    attentions = detectors.read_attention(r)
    opaque_mlps = detectors.read_opaque_mlps(r, residual)
    detectors.read_projections(r, residual, attentions, swiglu_products, opaque_mlps)
    missing = _fill_missing(r, n_layers, bool(attentions))
    opaque = [f"layer {lay} {key}: inside {r.nodes[op].kernel or r.nodes[op].op}"
              for lay, op in sorted(opaque_mlps.items()) for key in detectors.MLP_POINTS]
    pts = Points(g.name, n_layers, r.values, r.where, r.labels,
                 meta={"source": src_desc, "n_attention": len(attentions), "has_qk_norm": bool(qk), "missing": missing,
                       "opaque": opaque, **{k: v for k, v in g.meta.items() if k in _GRAPH_META}})
    if strict and missing:
        raise AnalysisError(f"{src_desc}: could not read {len(missing)} rounding point(s): {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''}. The code does not match the decoder patterns "
                            "this reader knows (see rla_lib.graphs.read_points).")
    return pts  # opaque points are not missing: they are read as "opaque", each named in meta["opaque"]


def _fill_missing(r: Reading, n_layers: int, has_attention: bool) -> list[str]:
    """Points no detector read: n/a where the graph cannot have them, else "?"; returns the "?" ones."""
    missing = []
    for lay in range(n_layers):
        for key, _, _ in LAYER_POINTS:
            if (lay, key) not in r.values:
                if key == "attention.output" and not has_attention:
                    r.put(lay, key, Held.BETWEEN_PIECES)
                    continue
                if key in ("input_norm.sum", "input_norm.carried") and lay == 0:
                    continue
                r.values[(lay, key)] = Held.UNREAD
            if r.values[(lay, key)] == Held.UNREAD:
                missing.append(f"layer {lay} {key}")
    for key, _, _ in FINAL_POINTS:
        if (FINAL, key) not in r.values:
            r.values[(FINAL, key)] = Held.NOT_IN_GRAPH if key == "lm_head.output" else Held.UNREAD
        if r.values[(FINAL, key)] == Held.UNREAD:
            missing.append(f"final {key}")
    return missing
