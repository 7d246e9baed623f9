"""Where each side rounds: read the engine's generated code and eager ops, diff them against Transformers.

The paper found its three regions by diffing vLLM's compiled and eager graphs by hand. This package does
the diff in code, for whatever engine version, backend and compile settings produced the code:

    cap = capture("qwen3-tiny", "compiled")              # real vLLM in a subprocess, fresh compile cache
    g = engine_graph(cap)                                # its inductor output code, parsed (or any cache dir)
    points = {"vllm:compiled": read_points(g),           # per layer: is each value rounded where it is read?
              "hf:bf16:none": read_points(training_graph("qwen3-tiny"))}
    points_table(points); rounding_diff(points, "vllm:compiled"); kernel_table(g, points["vllm:compiled"])
    sched = schedule(points["vllm:compiled"])            # the rounding schedule (JSON: rla_lib.align.save_schedule)
    handle = align_to_engine(model, sched)               # rla_lib.align: round where that engine rounds

`read_sides(model)` does this for vLLM compiled, vLLM eager, torch.compile of Transformers and stock
Transformers at once; `python -m rla_lib.graphs capture MODEL {vllm|hf} {compiled|eager} DIR` makes a capture
directory on another machine (e.g. a GPU) that `engine_graph(DIR)` reads here. An engine started in this process
for something else makes its mode's capture as it starts (`capturing`: `mismatch.measure`, `rla schedule`), so a
capture rarely needs an engine of its own.

Every side becomes one `Graph` of value nodes in program order. A node is one computed value (one
inductor CSE temporary, one stored buffer, one aten op output) with a normalised op name, its inputs,
and whether producing it rounds to BF16 (`rounds`). Modules, in reading order:

- `graph`: the value graph (`Node`, `Graph`, its JSON), op names, `GraphParseError`.
- `inductor_kernels`, `inductor`: inductor output code (`parse_output_code`). The wrapper's `call()` gives
  the order of fused kernels and extern calls (matmuls, attention) and the buffers each reads and writes;
  each kernel's body (C++ `cpp_fused_*` on CPU, Triton `triton_*_fused_*` on GPU) gives its values. A
  conversion to BF16 inside a kernel, or a store to a BF16 pointer, is a rounding; values never converted
  or stored to BF16 stay FP32. A piecewise compile (vLLM runs attention between the pieces) is one graph
  (`parse_pieces`): each piece's inputs linked to what the piece before returns, an attention node between.
  No torch: these read text from any machine.
- `aten`: an aten-level trace of an eager forward (`AtenTracer`, a TorchDispatchMode): every op whose BF16
  output is not an exact copy is a rounding. Used for Transformers (`training_graph`, stock or aligned) and
  for eager vLLM inside its engine process, with vLLM IR ops expanded into the aten ops they dispatch to.
  Opaque engine kernels (eager vLLM's C++ `rotary_embedding`, attention) stay one node each; the rotary
  kernel's internal rounding is measured by a bitwise probe in the engine process.
- `points`: the canonical chain of a decoder layer (`LAYER_POINTS`, `FINAL_POINTS`) and the typed value of
  each point (`Held`: bf16, fp32, n/a, ...; `Mixed`; `Split`), collected in `Points`.
- `detectors`, `reader`: `read_points` finds the decoder-layer structure from the values alone (rsqrt = a
  norm, its input a sum of projection outputs = residual norm, its input a projection = Q/K norm,
  x·sigmoid(x)·up = SwiGLU, products with a table gathered by position or with cos/sin = RoPE, matmul and
  attention nodes as anchors), one detector per region, and reads per layer whether each value is held in
  BF16 or FP32 where the next op reads it.
- `schedules`: the rounding schedule written from the points, their mapping to `rla_lib.align` options (the file
  format and applying it are `rla_lib.align.schedule`'s).
- `tables`: `points_table`, `rounding_diff`, `kernel_table`, `plot_layer_chain`.
- `captures`: compile caches found and parsed, engine runs captured in a subprocess, `read_sides`.

The names below are loaded from their module on first use, so importing the torch-free front ends
(`rla_lib.graphs.inductor`) does not import torch through this package.
"""

from importlib import import_module

_EXPORTS = {
    "graph": ("GRAPHS_DIR", "GRAPH_FORMAT", "Graph", "GraphParseError", "Node", "normalize_op_name"),
    "inductor_kernels": ("kernel_name_ops",),
    "inductor": ("parse_output_code", "parse_pieces"),
    "aten": ("AtenTracer", "default_ids", "trace_forward", "training_graph"),
    "points": ("FINAL", "FINAL_POINTS", "LAYER_POINTS", "POINT_INFO", "Held", "Mixed", "Points", "Split"),
    "reader": ("AnalysisError", "read_points"),
    "schedules": ("export_schedule", "schedule", "schedule_notes"),
    "tables": ("kernel_table", "plot_layer_chain", "points_match", "points_table", "rounding_diff"),
    "captures": ("SIDES", "capture", "capture_dir", "capture_eager_with", "capturing", "capturing_compiled", "engine_graph",
                 "find_output_code", "merge_graphs", "parse_cache", "model_key", "read_sides", "capture_sides",
                 "keep_output_code", "side_graph"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
