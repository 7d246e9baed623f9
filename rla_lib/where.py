"""Where a training side parts from the engine: the first layer and rounding point at which they differ.

    table = where.parting("qwen3-tiny", prompt_ids, modes=("compiled", "eager"))
    where.first_parting(table)    # per (mode, side, reading): that (layer, point), or none

`rla where` runs it on a checkpoint and prompts of your own. Two readings, by what can be seen of the engine:

- **code** (both modes): where the engine holds each value in BF16 or FP32, read from its compiled code or its eager
  trace (`rla_lib.graphs`), against the training side's own trace. A point parts where one side rounds and the other
  keeps FP32. It says where rounding differs, not by how much; attention's inner numerics are the values' to check.
- **values** (eager only): eager vLLM answers the prompts and scores each sequence with every op's input and output
  kept (`op_check`); the training side is then fed the engine's inputs at every op (teacher forcing), so
  each op's count of differing elements is its own, not carried in from the layers before. A compiled engine runs
  fused kernels whose intermediates no hook sees: its reading is the code's alone.

The training sides: stock BF16 Transformers and engine-aligned (the engine's schedule for that mode, read from its code
with the attention kernel it loads, `engine_align.engine_schedule_from_code`: no engine is started to probe it, since
the values reading is itself the check). On a CUDA machine the same calls read the CUDA engine; only CPU vLLM is tested.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import graphs, op_check, sides
from .align.schedule import schedule_to_align_kwargs
from .engine_align import code_schedule, engine_schedule_from_code
from .mismatch_report import ENGINE_ALIGNED
from .models import load_model, resolve_model

STOCK = "stock BF16"
SIDES = (STOCK, ENGINE_ALIGNED)
COLUMNS = ["mode", "side", "reading", "layer", "point", "engine", "training", "differing", "elements",
           "share_differing", "max_abs_diff"]


def rounding_kwargs(model, mode: str) -> tuple[tuple, dict]:
    """The engine-aligned side's `align` arguments for `mode` (its code's rounding points) without attention numerics:
    the code reading compares rounding points, and traces attention as the model's own."""
    regions, options = schedule_to_align_kwargs(code_schedule(model, mode))
    return tuple(r for r in regions if r != "attention"), {k: v for k, v in options.items() if k != "attention"}


def in_code(model, mode: str) -> pd.DataFrame:
    """Every (layer, point) the engine's code holds in BF16 or FP32, with each training side's value there (one row per
    side and point read on both; `differing` 1 where they part). Rows in the order the forward computes them."""
    engine = sides.engine(mode)
    points, _ = graphs.read_sides(model, (engine,), progress=False)
    regions, options = rounding_kwargs(model, mode)
    training = {STOCK: graphs.read_points(graphs.training_graph(model)),
                ENGINE_ALIGNED: graphs.read_points(graphs.training_graph(model, regions, options))}
    table = graphs.points_table({engine: points[engine], **training}, per_layer=True).reset_index()
    read = table[table[engine].isin([str(graphs.Held.BF16), str(graphs.Held.FP32)])]
    rows = [dict(mode=mode, side=side, reading="code", layer=r["layer"], point=r["point"], engine=r[engine],
                 training=r[side], differing=int(r[side] != r[engine]), elements=1)
            for side in SIDES for _, r in read.iterrows()]
    return pd.DataFrame(rows)


def in_values(model, prompts, n: int = 8, max_tokens: int = 32, seed: int = 0, cache_dir=None) -> pd.DataFrame:
    """Eager vLLM's value at every op against each training side's, teacher-forced, on one response to each of the
    first `n` prompts (token-id lists): per (layer, point) the elements that differ and the largest difference."""
    captures = op_check.captured(model, n=n, prompts=prompts, max_tokens=max_tokens, seed=seed, cache_dir=cache_dir,
                                 graph_dir=graphs.capture_dir(model, "vllm", "eager"))  # one engine start for both
    stock = load_model(model, dtype="bfloat16")
    tables = {STOCK: op_check.teacher_forced(stock, captures),
              ENGINE_ALIGNED: op_check.teacher_forced(stock, captures, engine_schedule_from_code(model, "eager"))}
    return pd.concat([t.assign(mode="eager", side=side, reading="values") for side, t in tables.items()], ignore_index=True)


def parting(model, prompts, modes=("compiled", "eager"), n: int = 8, max_tokens: int = 32, seed: int = 0,
            cache_dir=None) -> pd.DataFrame:
    """Both readings for each mode (values for eager only), one table (`COLUMNS`)."""
    model = resolve_model(model).path
    values = [in_values(model, prompts, n, max_tokens, seed, cache_dir)] if "eager" in modes else []  # first: its
    # engine also makes the eager graph capture the code reading needs
    table = pd.concat([*(in_code(model, mode) for mode in modes), *values], ignore_index=True).reindex(columns=COLUMNS)
    table["layer"] = [str(layer) if isinstance(layer, str) else str(int(layer)) for layer in table["layer"]]  # 0.., "final"
    table["share_differing"] = table["differing"] / table["elements"]
    return table


def first_parting(table: pd.DataFrame) -> pd.DataFrame:
    """Per (mode, side, reading): the first (layer, point) in the forward's order where the side parts from the engine
    (None where it follows the engine at every point read), and how many of the points read part."""
    rows = []
    for (mode, side, reading), t in table.groupby(["mode", "side", "reading"], sort=False):
        parted = t[t["differing"] > 0]
        first = parted.iloc[0] if len(parted) else None
        rows.append(dict(mode=mode, side=side, reading=reading, points=len(t), parted=len(parted),
                         layer=None if first is None else first["layer"], point=None if first is None else first["point"],
                         share_differing=np.nan if first is None or reading == "code" else first["share_differing"],
                         max_abs_diff=np.nan if first is None or reading == "code" else first["max_abs_diff"]))
    return pd.DataFrame(rows)


def describe_first(row) -> str:
    """One line of `first_parting`'s table."""
    head = f"{row['side']} vs vLLM {row['mode']} ({row['reading']}):"
    if not isinstance(row["layer"], str):
        return f"{head} follows the engine at all {row['points']} points read"
    where = f"layer {row['layer']}, {row['point']}" if row["layer"] != "final" else f"after the last layer, {row['point']}"
    size = (f" ({row['share_differing']:.1%} of its elements differ, by up to {row['max_abs_diff']:.3g})"
            if row["reading"] == "values" else "")
    return f"{head} first parts at {where}{size}; {row['parted']} of {row['points']} points read part"


def figure(table: pd.DataFrame):
    """Layers down, points across, coloured by the share of elements that differ (code: 1 where the rounding differs):
    a row of panels per (mode, reading), a column per training side."""
    rows, cols = list(dict.fromkeys(zip(table["mode"], table["reading"]))), list(dict.fromkeys(table["side"]))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(8 * len(cols), 3.6 * len(rows)), squeeze=False,
                             layout="constrained")
    for (mode, reading), row in zip(rows, axes):
        for side, ax in zip(cols, row):
            t = table[(table["mode"] == mode) & (table["reading"] == reading) & (table["side"] == side)]
            grid = t.pivot_table(index="layer", columns="point", values="share_differing", aggfunc="max", sort=False)
            image = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", cmap="Reds", vmin=0, vmax=1,
                              interpolation="nearest")
            ax.set_yticks(range(len(grid.index)), list(grid.index), fontsize=7)
            ax.set_xticks(range(len(grid.columns)), grid.columns, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{side} vs vLLM {mode}, from its {reading}", fontsize=9)
            ax.set_ylabel("layer", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="share of elements that differ (code: 1 where rounding differs)")
    return fig
