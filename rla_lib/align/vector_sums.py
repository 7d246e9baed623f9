"""Sums in the order CPU kernels add them: FP32 vector registers of lanes, each lane accumulating its own elements
in order, then the lanes paired down to one. vLLM's CPU attention sums its softmax row this way (16 lanes,
`rla_lib.align.attention`), inductor's C++ reductions sum an RMSNorm's x² this way (`rla_lib.align`'s `rms_sum`). The same
math in torch's own order (`x.pow(2).mean(-1)`) differs in the last bits of a good share of rows.
"""

from __future__ import annotations

import torch

from . import native


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reference, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`'s bits (computed in a kernel's order, no graph), with the gradient of `reference` (the same math in
    torch's order). `reference + (value - reference).detach()` would round the difference and can change bits."""
    return _StraightThrough.apply(reference, value.detach())


def lane_tree_sum(lanes: torch.Tensor) -> torch.Tensor:
    """Sum of a vector register's FP32 lanes (last dim, a power of 2) as x86 horizontal reductions pair them (GCC's
    `_mm512_reduce_add_ps`, ATen's `vec_reduce_all`): upper half onto lower half, again and again."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., half:] + lanes[..., :half]
    return lanes[..., 0]


def square_sum(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Σx² over the last dim of an FP32 tensor as inductor's vectorised reduction adds it, `layout` "vec<N>x<W>": N
    registers of W lanes take the row in steps of N·W elements (one add per lane per step, in row order), then the
    registers are added in order and the lanes paired down (`lane_tree_sum`). In C where it compiles
    (`rla_lib.native`), else as the loop of torch ops below: the same bits."""
    registers, width = map(int, layout.removeprefix("vec").split("x"))
    if native.library() is not None:
        return native.square_sum(x, registers, width)
    n = x.shape[-1]
    steps = torch.nn.functional.pad(x, (0, -n % (registers * width))).unflatten(-1, (-1, registers * width))
    acc = steps[..., 0, :] * steps[..., 0, :]
    for i in range(1, steps.shape[-2]):
        acc = acc + steps[..., i, :] * steps[..., i, :]
    lanes = acc[..., :width]
    for r in range(1, registers):
        lanes = lanes + acc[..., r * width : (r + 1) * width]
    return lane_tree_sum(lanes)


RMS_SUM_LAYOUTS = ("torch", "vec2x16", "vec1x16", "vec2x8", "vec1x8")
NORM_KINDS = ("input_norm", "post_norm", "qk_norm", "final_norm")


def rms_sum_layouts(spec: str, n_layers: int | None = None) -> dict[str, list[str]]:
    """The `rms_sum` option read: {norm kind: layout per layer (one for final_norm)}. `spec` is one layout for every
    norm, or per kind, e.g. "input_norm=vec2x16,vec2x16;post_norm=vec2x16,vec1x16;qk_norm=...;final_norm=vec2x16"
    (a kind left out sums as "torch"; one layout for a kind applies to all its layers). With `n_layers`, each kind's
    list is checked against the model's layers."""
    if spec in RMS_SUM_LAYOUTS:
        per_kind = {kind: [spec] for kind in NORM_KINDS}
    else:
        per_kind = {}
        for part in spec.split(";"):
            kind, _, layouts = part.partition("=")
            if kind not in NORM_KINDS or not layouts:
                raise ValueError(f"rms_sum={spec!r}: {part!r} is not <kind>=<layout>,...; kinds: {', '.join(NORM_KINDS)}, "
                                 f"layouts: {', '.join(RMS_SUM_LAYOUTS)}.")
            per_kind[kind] = layouts.split(",")
        bad = sorted({x for v in per_kind.values() for x in v} - set(RMS_SUM_LAYOUTS))
        if bad:
            raise ValueError(f"rms_sum={spec!r}: unknown layout(s) {bad}; allowed: {', '.join(RMS_SUM_LAYOUTS)}.")
    if n_layers is None:
        return per_kind
    out = {}
    for kind in NORM_KINDS:
        want = 1 if kind == "final_norm" else n_layers
        layouts = per_kind.get(kind, ["torch"])
        layouts = layouts * want if len(layouts) == 1 else layouts
        if len(layouts) != want:
            raise ValueError(f"rms_sum gives {len(layouts)} {kind} layouts for a model with {want}: a schedule read from "
                             "another model's code?")
        out[kind] = layouts
    return out


def rms_sum_spec(sums: dict) -> str:
    """The `rms_sum` option for {kind: layouts}: the one layout if all norms share it, else the per-kind form."""
    every = {x for layouts in sums.values() for x in layouts}
    if len(every) == 1:
        return every.pop()
    return ";".join(f"{kind}={','.join(sums[kind])}" for kind in NORM_KINDS if kind in sums)
