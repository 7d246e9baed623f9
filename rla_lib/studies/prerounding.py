"""Where the stock Transformers model rounds (Qwen2/Qwen3, BF16), and the values it is about to round.

`capture_prerounding(model, input_ids, attention_mask)` runs the stock model once, and once more with every
module's forward bound to `rla_lib.align.modeling_qwen` under the stock rounding policy (`align(model, (), record=...)`):
each op runs exactly as the stock model runs it, so the two forwards must agree bit for bit (checked), and at each
rounding point the op's FP32 value on the upcast inputs is recorded: the value the op had just before it was stored
to BF16. `LOCATIONS` lists the locations, the layer's rounding points (`modeling_qwen.ROUNDING_POINTS`: q/k/v/o/gate/up/down
projections, the attention output, RMSNorm x*rsqrt before and after the weight, Qwen3's Q/K norms, the RoPE products
and sums, SiLU, the SwiGLU product and both residual sums) with what the paper reports of each kind (`PAPER`). For pointwise ops the FP32 value is exact: rounding it gives
the stock BF16 tensor bit for bit. For matmuls it is an FP32 recomputation whose accumulation order differs from the
BF16 kernel's, so rounding it reproduces the stock tensor except for rare one-step differences (more than 99.9% of
elements equal). For attention with "sdpa" on CPU it mirrors PyTorch's BF16 flash kernel
(`attention.sdpa_cpu_unrounded`: the unnormalised probabilities rounded to BF16 before the product with V; a plain
FP32 recomputation would agree on only ~90% of elements); elsewhere it is the plain FP32 recomputation. The final
`model.norm` is not captured (it is not part of a decoder layer).

RoPE at other positions: the embedded models have 64 positions and the task sequences ~40 tokens, so
`capture_prerounding` sees RoPE only where cos is close to 1. `capture_rope_at_positions(model, ids,
mask, positions)` takes the q/k the stock model feeds to RoPE (`capture_rope_inputs`: after the
projections and Qwen3's Q/K norms) and rotates them at other positions (`rope_prerounding`), e.g. each
token at a position drawn uniformly from [0, 4096) (`uniform_positions`), with the model's own
`rotary_emb` (its rope_theta, BF16 cos/sin) and the stock arithmetic: the products and sums a
long-context forward would round for those q/k values (with "task" it equals `capture_prerounding`'s
RoPE locations bitwise).

Stock vs aligned (`rla_lib.align`), for notebook 01: `record_region_outputs` records the outputs of the
three aligned regions in one layer, `region_differences` compares them stock vs each region aligned, and
`layerwise_divergence` follows a change in one region through the layers to the logits.

The BF16 arithmetic (rounding, positions, steps) is `rla_lib.rounding`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..align import REGIONS, align, aligned, current
from ..bf16_matmul import has_fp32_matmul
from ..align.modeling_qwen import POINTS, ROUNDING_POINTS, Point, Rounding, rotary
from ..rounding import region_difference


@dataclass(frozen=True)
class Location:
    name: str
    group: str  # the kind of op, for tables
    paper: str  # what the paper reports for this kind: "near-uniform", "clustered" or "not reported"
    exact: bool  # True: pointwise op, the FP32 value is exact; False: matmul/attention recomputation
    qwen3_only: bool = False


# What the paper reports of each kind of rounding point
PAPER = {"projection": "near-uniform", "Q/K norm x*rsqrt": "near-uniform", "Q/K norm *weight": "near-uniform",
         "RoPE product": "clustered", "RoPE sum": "not reported", "attention": "near-uniform",
         "residual sum": "clustered", "RMSNorm x*rsqrt": "near-uniform", "RMSNorm *weight": "near-uniform",
         "SiLU": "clustered", "SwiGLU product": "not reported"}


def _table_order(point: Point) -> tuple[int, int]:
    """The layer's order, but the input norm listed with the residual stream's (after the attention sum it reads)."""
    if point.name.startswith("input_norm."):
        return POINTS.index("residual_attn"), 1
    return POINTS.index(point.name), 0


LOCATIONS = tuple(Location(p.name, p.kind, PAPER[p.kind], p.exact, p.qwen3_only)
                  for p in sorted(ROUNDING_POINTS, key=_table_order))
LOCATION_BY_NAME = {loc.name: loc for loc in LOCATIONS}


class _Recorder:
    """Collects (fp32, rounded) pairs per (location, layer) as `align(..., record=)` reports them, as (B, T, ...)."""

    def __init__(self, layers=None, locations=None):
        self.layers, self.locations = layers, locations
        self.fp32: dict[str, dict] = {loc.name: {} for loc in LOCATIONS}
        self.bf16: dict[str, dict] = {loc.name: {} for loc in LOCATIONS}

    def __call__(self, point: str, layer, fp32: torch.Tensor, rounded: torch.Tensor) -> None:
        if point not in LOCATION_BY_NAME or (self.layers is not None and layer not in self.layers) or (
                self.locations is not None and point not in self.locations):
            return  # the final norm (not a decoder layer's), or not asked for
        assert fp32.dtype == torch.float32 and fp32.shape == rounded.shape, (point, fp32.dtype, fp32.shape, rounded.shape)
        if point.startswith("rope."):  # (B, H, T, D) -> (B, T, H, D)
            fp32, rounded = fp32.transpose(1, 2), rounded.transpose(1, 2)
        self.fp32[point][layer] = fp32.contiguous()
        self.bf16[point][layer] = rounded.contiguous()


def _check_capturable(model) -> torch.nn.Module:
    base = getattr(model, "model", model)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise TypeError(f"capture_prerounding expects a Qwen2/Qwen3 *ForCausalLM or *Model, got {type(model).__name__}.")
    arch = type(base).__name__
    if arch not in ("Qwen2Model", "Qwen3Model"):
        raise TypeError(f"capture_prerounding supports Qwen2/Qwen3 only (rla_lib.align.modeling_qwen is their layer), got {arch}.")
    dtype = base.embed_tokens.weight.dtype
    if dtype != torch.bfloat16:
        raise TypeError(f"capture_prerounding needs a BF16 model (it records what BF16 rounds); this one is {dtype}.")
    if current(model) is not None:
        raise RuntimeError("capture_prerounding records the stock model's rounding; undo the alignment first.")
    for name, module in base.named_modules():
        if "forward" in module.__dict__ and not has_fp32_matmul(module):  # the BF16 GEMM's kernel is not a patch
            raise RuntimeError(f"{name or 'model'} has a patched forward; capture_prerounding needs the stock model.")
    return base


@torch.no_grad()
def capture_prerounding(model, input_ids, attention_mask=None, *, layers: Iterable[int] | None = None,
                        locations: Iterable[str] | None = None, return_bf16: bool = False):
    """FP32 values just before the stock model rounds them: {location: {layer: tensor (B, T, ...)}}.

    `input_ids` (B, T) and `attention_mask` as for the model (right padding: slice out the real tokens
    with the mask, e.g. `tensor[mask.bool()]`). The recording forward (see the module docstring) must equal the
    stock forward bitwise (else RuntimeError). With `return_bf16=True` also returns the stock BF16 tensors at the
    same locations: `(fp32, bf16)`.
    """
    base = _check_capturable(model)
    input_ids = torch.as_tensor(input_ids)
    n_layers = len(base.layers)
    wanted_layers = list(range(n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < n_layers for i in wanted_layers):
        raise ValueError(f"layers must be in 0..{n_layers - 1}, got {wanted_layers}.")
    wanted_locs = None if locations is None else set(locations)
    if wanted_locs is not None and not wanted_locs <= set(LOCATION_BY_NAME):
        raise ValueError(f"unknown location(s) {sorted(wanted_locs - set(LOCATION_BY_NAME))}; see LOCATIONS.")

    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    stock = base(**kwargs).last_hidden_state
    rec = _Recorder(set(wanted_layers), wanted_locs)
    handle = align(base, (), record=rec)  # every module through rla_lib.align.modeling_qwen, rounding where stock rounds
    try:
        recorded = base(**kwargs).last_hidden_state
    finally:
        handle.undo()
    if not torch.equal(recorded.view(torch.int16), stock.view(torch.int16)):
        raise RuntimeError("the recording forward differs from the stock one: the modeling code is not the one "
                           "rla_lib.align.modeling_qwen was written against (rla_lib.align.versions lists the verified releases).")
    fp32 = {k: v for k, v in rec.fp32.items() if v}
    bf16 = {k: v for k, v in rec.bf16.items() if v}
    return (fp32, bf16) if return_bf16 else fp32


ROPE_LOCATIONS = tuple(p for p in POINTS if p.startswith("rope."))


@torch.no_grad()
def capture_rope_inputs(model, input_ids, attention_mask=None, *, layers: Iterable[int] | None = None):
    """{layer: (q, k)}: the BF16 query and key the stock model feeds to RoPE, as (B, T, heads, head_dim).

    That is after the projections and, for Qwen3, after the per-head Q/K norms; recorded with forward
    hooks on one stock forward.
    """
    base = _check_capturable(model)
    n_layers = len(base.layers)
    wanted = list(range(n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= i < n_layers for i in wanted):
        raise ValueError(f"layers must be in 0..{n_layers - 1}, got {wanted}.")
    seen: dict = {}
    handles = []
    for i in wanted:
        attn = base.layers[i].self_attn
        has_qk_norm = hasattr(attn, "q_norm")  # Qwen3: per-head norms, output already (B, T, H, D)
        for tag in ("q", "k"):
            module = getattr(attn, f"{tag}_norm" if has_qk_norm else f"{tag}_proj")

            def record(m, a, out, key=(i, tag), d=attn.head_dim, per_head=has_qk_norm):
                seen[key] = out if per_head else out.unflatten(-1, (-1, d))

            handles.append(module.register_forward_hook(record))
    try:
        base(input_ids=torch.as_tensor(input_ids), attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: (seen[i, "q"], seen[i, "k"]) for i in wanted}


@torch.no_grad()
def rope_prerounding(model, rope_inputs: dict, position_ids) -> dict:
    """The FP32 RoPE products and sums (`ROPE_LOCATIONS`) the stock model would round if the tokens of
    `rope_inputs` (`capture_rope_inputs`) sat at `position_ids` (B, T): {location: {layer: (B, T, H, D)}}.

    cos and sin come from the model's own `rotary_emb` (its rope_theta and rope type) in BF16, as in the
    stock forward, and the arithmetic is the stock `apply_rotary_pos_emb`'s, op by op (`modeling_qwen.rotary`). The
    q/k values are the captured ones: what changes with position is the rotation, not the values rotated.
    """
    base = _check_capturable(model)
    modeling = sys.modules[type(base).__module__]
    position_ids = torch.as_tensor(position_ids)
    out = {name: {} for name in ROPE_LOCATIONS}
    for layer, (q, k) in rope_inputs.items():
        if tuple(position_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, the tokens {tuple(q.shape[:2])}.")
        cos, sin = base.rotary_emb(q, position_ids)
        rec = _Recorder()
        recording = Rounding(record=rec, layer=layer)
        rotary(q.transpose(1, 2), cos, sin, "q", modeling.rotate_half, recording, q.dtype)
        rotary(k.transpose(1, 2), cos, sin, "k", modeling.rotate_half, recording, k.dtype)
        for name in ROPE_LOCATIONS:
            out[name][layer] = rec.fp32[name][layer]
    return out


def task_positions(input_ids) -> torch.Tensor:
    """(B, T) positions 0..T-1: what the stock forward uses for right-padded rows without position_ids."""
    b, t = torch.as_tensor(input_ids).shape
    return torch.arange(t).expand(b, t)


def uniform_positions(shape, max_position: int, seed: int = 0) -> torch.Tensor:
    """(B, T) positions drawn independently and uniformly from [0, max_position): tokens of long contexts."""
    if max_position < 1:
        raise ValueError(f"max_position must be at least 1, got {max_position}.")
    return torch.randint(0, int(max_position), tuple(shape), generator=torch.Generator().manual_seed(seed))


def positions_label(positions) -> str:
    """'task' or 'uniform [0, 4096)': how a `positions` setting appears in tables."""
    return "task" if positions == "task" else f"uniform [0, {int(positions)})"


def capture_rope_at_positions(model, input_ids, attention_mask=None, positions="task", *,
                              layers: Iterable[int] | None = None) -> dict:
    """`rope_prerounding` of the task tokens' own q/k at `positions`: "task" (the positions the stock
    forward uses: with "task" the result equals `capture_prerounding`'s RoPE locations bitwise) or a (B, T)
    tensor of positions (e.g. `uniform_positions`)."""
    rope_inputs = capture_rope_inputs(model, input_ids, attention_mask, layers=layers)
    if isinstance(positions, str):
        if positions != "task":
            raise ValueError(f'positions must be "task" or a tensor of positions, got {positions!r}.')
        positions = task_positions(input_ids)
    return rope_prerounding(model, rope_inputs, torch.as_tensor(positions))


# The name under which `record_region_outputs` registers its recording attention function.
_PROBE_ATTENTION = "rla_rounding_probe"


@contextlib.contextmanager
def record_region_outputs(model, layer: int = 0):
    """Record the outputs of the three aligned regions in one decoder layer, stock or aligned alike.

    Yields a dict filled during the forward: "rope" -> (q, k) as the attention kernel receives them
    (rotated, BF16), "swiglu" -> the input of down_proj (the rounded SwiGLU product), "residual_norm" ->
    the output of post_attention_layernorm (the norm reading the residual sum). Uses forward hooks and a
    registered attention function that records its inputs and then calls the model's own attention.
    """
    base = getattr(model, "model", model)
    target = base.layers[layer]
    record: dict = {}
    original = base.config._attn_implementation
    modeling = sys.modules[type(target).__module__]
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(original, modeling.eager_attention_forward)

    def probe(module, query, key, value, attention_mask, **kw):
        if module is target.self_attn:
            record["rope"] = (query.detach().clone(), key.detach().clone())
        return inner(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(_PROBE_ATTENTION, probe)
    handles = [
        target.mlp.down_proj.register_forward_pre_hook(lambda m, args: record.__setitem__("swiglu", args[0].detach().clone())),
        target.post_attention_layernorm.register_forward_hook(
            lambda m, args, out: record.__setitem__("residual_norm", out.detach().clone())),
    ]
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    try:
        for c in configs.values():
            c._attn_implementation = _PROBE_ATTENTION
        yield record
    finally:
        for c in configs.values():
            c._attn_implementation = original
        for h in handles:
            h.remove()


def _region_outputs(model, input_ids, attention_mask, layer: int, regions: tuple[str, ...]) -> dict:
    """`record_region_outputs` of one forward, stock (`regions` empty) or with `regions` aligned."""
    with torch.no_grad(), record_region_outputs(model, layer=layer) as record:
        with aligned(model, regions) if regions else contextlib.nullcontext():
            model(input_ids=input_ids, attention_mask=attention_mask)
    return record


def _region_tensors(region: str, record: dict, token_mask: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, the region output's real tokens) for one region of a `record_region_outputs` record."""
    if region == "rope":  # (B, H, T, D) for Q and K
        return [(name, t.transpose(1, 2)[token_mask]) for name, t in zip(("rotated Q", "rotated K"), record["rope"])]
    name = {"swiglu": "SwiGLU product (down_proj input)", "residual_norm": "post-attention RMSNorm output"}[region]
    return [(name, record[region][token_mask])]


def region_differences(model, input_ids, attention_mask, layer: int = 0) -> pd.DataFrame:
    """Each region aligned alone vs stock: how its output in decoder layer `layer` differs on the real tokens.

    One row per (region, tensor) with the fields of `rounding.region_difference`. In layer 0 every region
    sees the same inputs in both runs, so a difference is that region's own rounding.
    """
    token_mask = torch.as_tensor(attention_mask).bool()
    stock = _region_outputs(model, input_ids, attention_mask, layer, ())
    rows = []
    for region in REGIONS:
        fused = _region_outputs(model, input_ids, attention_mask, layer, (region,))
        pairs = zip(_region_tensors(region, stock, token_mask), _region_tensors(region, fused, token_mask))
        rows += [{"region": region, "tensor": name, **region_difference(s, f)} for (name, s), (_, f) in pairs]
    return pd.DataFrame(rows).set_index(["region", "tensor"])


@torch.no_grad()
def layerwise_divergence(model, input_ids, attention_mask, regions, token_mask=None) -> pd.DataFrame:
    """Stock vs `regions` aligned: how far apart each decoder layer's output, the final norm and
    the logits are, on the tokens of `token_mask` (default: `attention_mask`).

    Returns a pandas DataFrame, one row per stage ("layer 0" .. "layer L-1", "final norm", "logits"):
    relative L2 difference and fraction of differing elements. Layer outputs are compared after rounding
    to BF16 (an aligned residual stream may be carried in FP32 between layers).
    """
    base = getattr(model, "model", model)
    modules = [(f"layer {i}", layer) for i, layer in enumerate(base.layers)] + [("final norm", base.norm)]

    def run():
        seen = {}
        handles = [m.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(
            name, (out[0] if isinstance(out, tuple) else out).to(torch.bfloat16).float())) for name, m in modules]
        try:
            seen["logits"] = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        finally:
            for h in handles:
                h.remove()
        return seen

    stock = run()
    with aligned(model, regions):
        other = run()
    mask = token_mask if token_mask is not None else attention_mask
    mask = torch.ones(input_ids.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    rows = []
    for name in [n for n, _ in modules] + ["logits"]:
        a, b = stock[name][mask], other[name][mask]
        rows.append(dict(stage=name, rel_diff=float((a - b).norm() / a.norm()), frac_differing=float((a != b).double().mean())))
    return pd.DataFrame(rows)
