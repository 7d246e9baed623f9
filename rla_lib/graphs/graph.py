"""The value graph every front end builds: one node per computed value, in program order."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from ..paths import RESULTS_DIR, atomic_write

GRAPHS_DIR = RESULTS_DIR / "graphs"
GRAPH_FORMAT = "rla-value-graph/1"
BF16_DTYPES = ("bf16", "fp16")
# ops whose result is exactly representable in the input's dtype: never a rounding, even in BF16
EXACT_OPS = {"view", "upcast", "copy", "cat", "index", "embedding", "neg", "load", "store", "join", "input",
             "const", "alloc", "where", "max", "min", "abs", "cast_int", "kv_cache", "broadcast"}


class GraphParseError(RuntimeError):
    """Output code, a trace or a cache directory this package cannot read (the message names the file)."""


@dataclasses.dataclass
class Node:
    id: int
    op: str  # normalised op (see EXACT_OPS and the front ends)
    inputs: list[int]
    dtype: str  # "bf16", "fp32", "int", "other": how the value is held
    rounds: bool = False  # producing this value rounds to BF16
    kernel: str | None = None  # the fused kernel, extern call or aten op that computes it
    module: str | None = None  # module path (eager traces)
    text: str = ""  # source line / op name, for humans
    stored: bool = False  # written to memory by its kernel (a kernel output)


@dataclasses.dataclass
class Graph:
    """Values of one forward in program order (node ids increase in program order)."""

    name: str
    nodes: list[Node] = dataclasses.field(default_factory=list)
    kernels: dict = dataclasses.field(default_factory=dict)  # kernel name -> info (fused ops, file, ...)
    meta: dict = dataclasses.field(default_factory=dict)

    def add(self, op, inputs=(), dtype="fp32", **kw) -> int:
        node = Node(len(self.nodes), op, [int(i) for i in inputs], dtype, **kw)
        self.nodes.append(node)
        return node.id

    def __getitem__(self, i) -> Node:
        return self.nodes[i]

    def users(self) -> dict[int, list[int]]:
        u = defaultdict(list)
        for n in self.nodes:
            for i in n.inputs:
                u[i].append(n.id)
        return u

    def to_json(self) -> dict:
        return {"format": GRAPH_FORMAT, "name": self.name, "meta": self.meta, "kernels": self.kernels,
                "nodes": [dataclasses.asdict(n) for n in self.nodes]}

    @classmethod
    def from_json(cls, d: dict) -> Graph:
        if d.get("format") != GRAPH_FORMAT:
            raise GraphParseError(f"not a value graph ({GRAPH_FORMAT}): format {d.get('format')!r}")
        return cls(d["name"], [Node(**n) for n in d["nodes"]], d.get("kernels", {}), d.get("meta", {}))

    def save(self, path) -> Path:
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> Graph:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise GraphParseError(f"{path}: not a readable value graph ({e})") from e


def atomic_write_json(path, obj) -> Path:
    """JSON as this package saves it (points, schedules, graphs); typed point values are written as their text."""
    return atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1, default=str)))


# ---- op names -------------------------------------------------------------------------------------------
_ATEN_OPS = {
    "add": "add", "sub": "sub", "rsub": "sub", "mul": "mul", "div": "div", "neg": "neg", "rsqrt": "rsqrt",
    "sqrt": "sqrt", "reciprocal": "recip", "pow": "pow", "mean": "mean", "sum": "sum", "exp": "exp",
    "silu": "silu", "sigmoid": "sigmoid", "cos": "cos", "sin": "sin", "tanh": "tanh", "abs": "abs",
    "mm": "mm", "bmm": "mm", "addmm": "mm", "matmul": "mm", "linear": "mm", "baddbmm": "mm",
    "embedding": "embedding", "index_select": "index", "index": "index", "gather": "index",
    "cat": "cat", "stack": "cat", "where": "where", "maximum": "max", "minimum": "min", "amax": "max",
    "max": "max", "min": "min", "_softmax": "softmax", "softmax": "softmax", "_log_softmax": "log_softmax",
    "log_softmax": "log_softmax", "logsumexp": "logsumexp", "clamp": "where", "masked_fill": "where",
    "empty": "alloc", "empty_like": "alloc", "zeros": "alloc", "zeros_like": "alloc", "ones": "alloc",
    "full": "alloc", "arange": "alloc", "new_empty": "alloc", "new_zeros": "alloc", "empty_strided": "alloc",
    "scalar_tensor": "const", "lift_fresh": "view", "fill": "alloc",
}
_ATEN_VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
               "slice", "select", "split", "split_with_sizes", "chunk", "alias", "detach", "as_strided", "unbind",
               "narrow", "contiguous", "clone", "_reshape_alias", "flatten", "unflatten", "view_as", "expand_as",
               "_unsafe_index", "movedim"}
_ATTENTION_OPS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "scaled_dot_product_attention", "unified_attention_with_output", "unified_attention",
                  "_flash_attention_forward"}
_MM_OPS = {"onednn_mm", "weight_packed_linear", "cutlass_scaled_mm", "gemm", "int8_scaled_mm"}


def normalize_op_name(name: str) -> str:
    """aten/custom op name ('aten::mul', '_C::onednn_mm', 'vllm::unified_attention_with_output') -> op."""
    ns, _, base = name.rpartition("::")
    base = base.rstrip("_") if base.endswith("_") and not base.startswith("_") else base
    if base in _ATTENTION_OPS:
        return "attention"
    if base in _MM_OPS:
        return "mm"
    if base == "unified_kv_cache_update":
        return "kv_cache"
    if ns in ("aten", "prims", ""):
        if base in _ATEN_VIEWS:
            return "view"
        return _ATEN_OPS.get(base, f"other:{base}")
    return f"opaque:{base}"


def dtype_name(dtype) -> str:
    """torch dtype (or its name) -> how a node holds its value: bf16, fp32, fp16, fp64, int, other."""
    s = str(dtype).removeprefix("torch.")
    if s in ("bfloat16", "bf16"):
        return "bf16"
    if s in ("float32", "float", "fp32"):
        return "fp32"
    if s in ("float16", "half", "fp16"):
        return "fp16"
    if s.startswith(("int", "uint", "long", "bool")):
        return "int"
    if s in ("float64", "double"):
        return "fp64"
    return "other"
