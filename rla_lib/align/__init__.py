"""Rounding-location alignment (RLA) of Transformers' Qwen2/Qwen3 with a compiled inference engine.

An engine such as vLLM compiles the model so that chains of pointwise ops run as one kernel that keeps
its intermediates in FP32 and rounds to BF16 only at the kernel's output. Eager Transformers rounds to
BF16 after every op. `align(model)` makes the training side round where the engine rounds, in the
paper's three regions (`REGIONS`), without touching matmuls, attention kernels or the objective:

- `"rope"`: Qwen3's per-head Q/K RMSNorm (weight multiply included) and the rotary products and their
  sum stay in FP32, with cos/sin recomputed in FP32 (not the BF16-cast ones) from FP32 frequencies (if
  `model.to(torch.bfloat16)` rounded the `inv_freq` buffer, FP32 values are put back while aligned).
  Only the rotated Q and K are rounded, once each. On Qwen2 (no Q/K norm) the region is the rotary part
  alone.
- `"swiglu"`: SiLU(gate) stays in FP32 through the multiply with `up`; the product is rounded once
  before `down_proj`.
- `"residual_norm"`: `residual + sublayer output` is computed in FP32 and the RMSNorm that follows reads
  this unrounded sum; the residual carried on is the sum rounded to BF16. This covers every
  `post_attention_layernorm`, the next layer's `input_layernorm` and the final `model.norm`, so decoder
  layers pass FP32 tensors to each other (also what `output_hidden_states` then records); the final
  norm outputs the model dtype for `lm_head`.

Each of the three is a preset of a `Schedule`, the data `align` applies: the set of the model's named rounding points
(`modeling_qwen.ROUNDING_POINTS`, the one list of them) it keeps in FP32, those it rounds toward zero, the engine's
attention kernel and the order its norms sum in. An engine's schedule is read from its code into the same data
(`align_to_engine`). The layer's ops and forwards are written once, in `modeling_qwen`, and bound into the model's
modules by `patch`. `align(model, (), record=...)` runs the stock model
through the same code and reports the FP32 value at every point it rounds (`rla_lib.studies.prerounding`);
`align(model, regions, replay=...)` feeds every point another value, the engine's own in `rla_lib.op_check`,
so each op is checked from the engine's inputs.

A fourth region, `"attention"` (in `ALL_REGIONS`, not in `REGIONS`: asked for by name), replaces the attention
kernel of the model's `attn_implementation` with the engine's numerics (`rla_lib.align.attention`), per module
instance (nothing is registered globally). It reads the mask Transformers built for the model (eager or
sdpa), so padding and sliding windows are kept; it refuses attention dropout (the engine has none).

This package is the fix alone, what a trainer takes home: it imports torch, Transformers and numpy, never vLLM, the
graph reader, pandas or matplotlib (tests/test_layout.py holds it; `make test-install` runs it where none is installed).

- `modeling_qwen`: the Qwen2/Qwen3 decoder layer, ops and forwards, with its rounding points named (`POINTS`), and
  `Schedule`, where it rounds, with the paper's regions as presets (`preset`);
- `attention`: the engines' attention numerics (the "attention" region's kernels);
- `vector_sums`: sums in the order CPU kernels add them (vLLM's attention row sum, inductor's RMSNorm Σx²);
- `native`: their loops in C (`kernels.c`), built once per machine;
- `patch`: `align` and `undo`, bound per module instance under the source-hash guard;
- `versions`: the Transformers releases `align` supports and what differs between them;
- `schedule`: the rounding schedule file an engine's code is read into, and `align_to_engine` applying it;
- `monitor`: the mismatch metrics any trainer can log (TRL's and verl's names too).

    handle = align(model)                                  # all three regions, paper semantics
    handle = align(model, ("rope",))                       # RoPE only (`preset("rope")`)
    handle = align(model, Schedule(keep={"silu"}), fused=True)  # any set of points, compiled where it can be
    handle = align_to_engine(model, "schedule.json")       # round where the engine rounds (`rla schedule` writes it)
    handle.undo()                                          # stock again, bit for bit
    with aligned(model, ("swiglu",)):
        ...
    metrics = mismatch_metrics(inference_lp, training_lp, mask)
"""

from .modeling_qwen import FINAL_POINTS, KEEPABLE, POINTS, Schedule, preset
from .monitor import MismatchCallback, MismatchMeter, mismatch_metrics
from .patch import ALL_REGIONS, REGIONS, Alignment, align, aligned, current, refuse_if_aligned, unalign
from .schedule import (SCHEDULE_FORMAT, align_to_engine, load_schedule, save_schedule, schedule_from_file,
                       schedule_from_options, schedule_to_align_kwargs)

__all__ = ["ALL_REGIONS", "FINAL_POINTS", "KEEPABLE", "POINTS", "REGIONS", "SCHEDULE_FORMAT", "Alignment",
           "MismatchCallback", "MismatchMeter", "Schedule", "align", "align_to_engine", "aligned", "current",
           "load_schedule", "mismatch_metrics", "preset", "refuse_if_aligned", "save_schedule", "schedule_from_file",
           "schedule_from_options", "schedule_to_align_kwargs", "unalign"]
