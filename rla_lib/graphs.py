"""Where each side rounds: read the engine's generated code and eager ops, diff them against Transformers.

The paper found its three regions by diffing vLLM's compiled and eager graphs by hand. This module does
the diff in code, for whatever engine version, backend and compile settings produced the code:

    cap = capture("qwen3-tiny", "compiled")              # real vLLM in a subprocess, fresh compile cache
    g = engine_graph(cap)                                # its inductor output code, parsed (or any cache dir)
    points = {"vllm:compiled": read_points(g),           # per layer: is each value rounded where it is read?
              "hf:eager": read_points(training_graph("qwen3-tiny"))}
    points_table(points); rounding_diff(points, "vllm:compiled"); kernel_table(g, points["vllm:compiled"])
    sched = schedule(points["vllm:compiled"])            # the rounding schedule (JSON: save_schedule)
    regions, options = schedule_to_align_kwargs(sched)   # -> rla_lib.align.align(model, regions, **options)
    align_to_schedule(model, sched)

`read_sides(model)` does this for vLLM compiled, vLLM eager, torch.compile of Transformers and stock
Transformers at once; `python -m rla_lib.graphs capture MODEL {vllm|hf} {compiled|eager} DIR` makes a capture
directory on another machine (e.g. a GPU) that `engine_graph(DIR)` reads here.

Every side becomes one `Graph` of value nodes in program order. A node is one computed value (one
inductor CSE temporary, one stored buffer, one aten op output) with a normalised op name, its inputs,
and whether producing it rounds to BF16 (`rounds`). Three front ends build graphs:

- inductor output code (`parse_output_code`): the wrapper's `call()` gives the order of fused kernels
  and extern calls (matmuls, attention) and which buffers each reads and writes; each kernel's body gives
  its values: C++ kernels `cpp_fused_*` (CPU: `auto tmpN = ...;`, `.store(out_ptrK ...)`,
  `at::vec::convert<at::BFloat16,...>` = a rounding inside a kernel, a store to an `at::BFloat16*`
  pointer = a rounding at the output) and Triton kernels `triton_{poi,per,red}_fused_*` (GPU:
  `tmpN = ...`, `tl.store`, `.to(tl.bfloat16)`, pointer dtypes from `triton_meta['signature']`).
  Values inside a kernel that are never converted or stored to BF16 stay FP32.
- an aten-level trace of an eager forward (`AtenTracer`, a TorchDispatchMode): every op whose BF16
  output is not an exact copy (views, cat, gather, neg) is a rounding. Used for Transformers (stock or
  aligned) and for eager vLLM inside its engine process, with vLLM IR ops (`vllm_ir.rms_norm`, ...)
  expanded into the aten ops of the implementation they dispatch to, and module paths recorded.
- opaque engine kernels (vLLM's C++ `rotary_embedding` in eager mode, attention) are kept as one node;
  the rotary kernel's internal rounding is measured by a bitwise probe in the engine process.

`read_points` then finds the decoder-layer structure from the values alone (rsqrt = a norm, its input a
sum of projection outputs = residual norm, its input a projection = Q/K norm, x·sigmoid(x)·up = SwiGLU,
products with a table gathered by position or with cos/sin = RoPE, matmul and attention nodes as
anchors) and reads, per layer, whether each value of the canonical chain (`LAYER_POINTS`, `FINAL_POINTS`) is held in BF16 or
FP32 where the next op reads it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from .paths import RESULTS_DIR, ROOT, atomic_write

GRAPHS_DIR = RESULTS_DIR / "graphs"
SCHEDULE_FORMAT = "rla-rounding-schedule/1"
GRAPH_FORMAT = "rla-value-graph/1"


class GraphParseError(RuntimeError):
    """Output code, a trace or a cache directory this module cannot read (the message names the file)."""


# ==================================================================================================
# The value graph
# ==================================================================================================

# ops whose result is exactly representable in the input's dtype: never a rounding, even in BF16
EXACT_OPS = {"view", "upcast", "copy", "cat", "index", "embedding", "neg", "load", "store", "join", "input",
             "const", "alloc", "where", "max", "min", "abs", "cast_int", "kv_cache", "broadcast"}
# ops a value passes through unchanged for the purpose of "is it rounded where it is read"
TRANSPARENT_OPS = {"view", "upcast", "copy", "load", "store", "join", "broadcast", "round"}


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
        g = cls(d["name"], [Node(**n) for n in d["nodes"]], d.get("kernels", {}), d.get("meta", {}))
        return g

    def save(self, path) -> Path:
        return _atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> Graph:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise GraphParseError(f"{path}: not a readable value graph ({e})") from e


def _atomic_write_json(path, obj) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1, default=str)))


# ==================================================================================================
# Front end 1: aten-level trace of an eager forward
# ==================================================================================================

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


def _dtype_name(dtype) -> str:
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


class AtenTracer:
    """Record every aten/custom op of a forward as value nodes, with module paths.

    Hooks on the `hooked` modules (default: `root`; e.g. also vLLM's logits processor, which runs outside
    the model's forward) switch a TorchDispatchMode on for the duration of their forward; hooks on every
    submodule of `root` record module paths. Only the first `max_forwards` hooked forwards are recorded.
    """

    def __init__(self, root, name="trace", hooked=None, max_forwards=None, expand_vllm_ir=True):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.graph = Graph(name)
        self.root = root
        self.hooked = list(hooked) if hooked is not None else [root]
        self.max_forwards = max_forwards
        self.expand_vllm_ir = expand_vllm_ir
        self._handles = []
        self._module_stack: list[str] = []
        self._active = 0
        self._forwards = 0
        self._values: dict = {}  # tensor key -> node id
        self._storage_writer: dict = {}  # storage ptr -> node id of the last value written there
        self._names: dict = {}  # storage ptr -> parameter/buffer name
        tracer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return tracer._dispatch(self, func, args, kwargs or {})

        self._mode = _Mode()
        self._torch = torch
        for mod_name, mod in root.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(mod_name or "<root>")))
            self._handles.append(mod.register_forward_hook(self._post_hook(mod_name or "<root>")))
        for p_name, p in list(root.named_parameters()) + list(root.named_buffers()):
            if p is not None and p.numel() > 0:
                self._names[p.untyped_storage().data_ptr()] = (p_name, p.storage_offset(), tuple(p.shape))

    # ---- module hooks: which module computes each op; when the mode is on ------------------------
    def _pre_hook(self, name):
        def hook(mod, args):
            if any(mod is h for h in self.hooked) and self._active == 0:
                if self.max_forwards is not None and self._forwards >= self.max_forwards:
                    return
                self._mode.__enter__()
                self._active_owner = mod
                self._active = 1
            self._module_stack.append(name)

        return hook

    def _post_hook(self, name):
        def hook(mod, args, out):
            if self._module_stack and self._module_stack[-1] == name:
                self._module_stack.pop()
            if self._active and mod is getattr(self, "_active_owner", None):
                self._mode.__exit__(None, None, None)
                self._active = 0
                self._forwards += 1

        return hook

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._active:
            self._mode.__exit__(None, None, None)
            self._active = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- recording --------------------------------------------------------------------------------
    def _key(self, t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _lookup(self, t) -> int:
        key = self._key(t)
        if key in self._values:
            return self._values[key]
        ptr = key[0]
        if ptr in self._storage_writer:  # a view of a recorded value
            src = self._storage_writer[ptr]
            nid = self.graph.add("view", [src], _dtype_name(t.dtype), text="view", module=self._module())
            self._values[key] = nid
            return nid
        name = self._names.get(ptr)
        label = name[0] if name else f"input{list(t.shape)}"
        nid = self.graph.add("input", [], _dtype_name(t.dtype), text=label, kernel="param" if name else "input")
        self._values[key] = nid
        self._storage_writer[ptr] = nid
        return nid

    def _module(self):
        return self._module_stack[-1] if self._module_stack else None

    def _register(self, t, nid):
        self._values[self._key(t)] = nid
        self._storage_writer[t.untyped_storage().data_ptr()] = nid

    def _dispatch(self, mode, func, args, kwargs):
        schema_name = func._schema.name
        if self.expand_vllm_ir and schema_name.startswith("vllm_ir::"):
            impl = self._vllm_ir_impl(func)
            if impl is not None:
                self.graph.meta.setdefault("expanded_ops", []).append(schema_name)
                with mode:
                    return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception as e:  # recording must never break the forward it watches
            self.graph.meta.setdefault("record_errors", []).append(f"{schema_name}: {type(e).__name__}: {e}")
        return out

    @staticmethod
    def _vllm_ir_impl(func):
        try:
            from vllm.ir.op import IrOp
        except ImportError:
            return None
        op = IrOp.registry.get(func._schema.name.split("::", 1)[1])
        if op is None:
            return None
        target = op if func._overloadname == "default" else getattr(op, func._overloadname, None)
        return getattr(target, "_inner_call", None)

    def _record(self, func, args, kwargs, out):
        torch = self._torch
        from torch.utils._pytree import tree_flatten

        name = func._schema.name
        op = normalize_op_name(name)
        base = name.rpartition("::")[2]
        flat_args, _ = tree_flatten((args, kwargs))
        in_tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
        inputs = [self._lookup(t) for t in in_tensors]
        outs, _ = tree_flatten(out)
        outs = [t for t in outs if isinstance(t, torch.Tensor)]
        # arguments the op writes into (out=, in-place, vLLM's custom ops)
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(val, torch.Tensor):
                    written.append(val)
        module = self._module()
        text = f"{name}.{func._overloadname}"
        results = outs + [w for w in written if all(w is not o for o in outs)]
        if len(outs) > 1 and op in ("attention", "mm"):  # e.g. sdpa's (output, logsumexp, ...): the rest is aux
            first = outs[0]
            nid = self.graph.add(op, inputs, _dtype_name(first.dtype), rounds=_dtype_name(first.dtype) in ("bf16", "fp16"),
                                 text=text, module=self._module(), kernel=text, stored=True)
            self._register(first, nid)
            for t in outs[1:]:
                self._register(t, self.graph.add("aux", [nid], _dtype_name(t.dtype), text=text, module=self._module()))
            return
        if op == "view" and len(inputs) >= 1:
            for t in results:
                self._register(t, self.graph.add("view", inputs[:1], _dtype_name(t.dtype), text=text, module=module,
                                                 kernel=text))
            return
        if base in ("_to_copy", "to", "copy", "copy_", "_copy_from", "type_as"):
            src = inputs[-1] if base in ("copy_", "copy") else inputs[0]
            src_dtype = self.graph[src].dtype
            for t in results:
                dt = _dtype_name(t.dtype)
                kind = "copy" if dt == src_dtype else ("round" if dt in ("bf16", "fp16") else "upcast")
                self._register(t, self.graph.add(kind, [src], dt, rounds=(kind == "round"), text=text,
                                                 module=module, kernel=text))
            return
        if op == "alloc":
            for t in results:
                self._register(t, self.graph.add("alloc", [], _dtype_name(t.dtype), text=text, module=module))
            return
        for t in results:
            dt = _dtype_name(t.dtype)
            rounds = dt in ("bf16", "fp16") and op not in EXACT_OPS
            nid = self.graph.add(op, inputs, dt, rounds=rounds, text=text, module=module, kernel=text, stored=True)
            self._register(t, nid)


def trace_forward(model, input_ids, name="hf:eager", **forward_kwargs) -> Graph:
    """Trace one eager forward of a Transformers causal LM (logits included) at the aten level."""
    import torch

    with torch.no_grad(), AtenTracer(model, name=name, max_forwards=1) as tr:
        model(input_ids=input_ids, **forward_kwargs)
    g = tr.graph
    g.meta.update(source="aten trace (TorchDispatchMode) of the eager forward", torch=torch.__version__)
    return g


def default_ids(n: int = 12):
    """A fixed short prompt for traces: the first held-out task prompt, padded with digits to n tokens."""
    from .tokenizer import VOCAB

    ids = [VOCAB.index(c) for c in "47+385+9=432"][:n]
    return ids + [1] * (n - len(ids))


def training_graph(model="qwen3-tiny", regions=None, options=None, name=None, ids=None) -> Graph:
    """The training side: stock (or aligned) Transformers BF16 forward, traced at the aten level."""
    import torch

    from .align import align
    from .models import load_model, resolve_model

    m = load_model(model, dtype="bfloat16") if isinstance(model, (str, Path)) else model
    handle = align(m, tuple(regions), **(options or {})) if regions is not None else None
    try:
        ids_t = torch.tensor([ids or default_ids()])
        g = trace_forward(m, ids_t, name=name or ("hf:eager" if handle is None else "hf:aligned"))
    finally:
        if handle is not None:
            handle.undo()
    if isinstance(model, (str, Path)):
        g.meta["model"] = str(resolve_model(model).path)
    g.meta["aligned"] = None if regions is None else {"regions": list(regions), "options": dict(options or {})}
    return g


# ==================================================================================================
# Front end 2: inductor output code (wrapper + C++ or Triton kernels)
# ==================================================================================================

_PTR_RE = re.compile(r"\b(in_out_ptr\d+|in_ptr\d+|out_ptr\d+)\b")
_TMP_RE = re.compile(r"\btmp(?:_acc)?\d+\b")
_ACC_RE = re.compile(r"\b(tmp_acc\d+)(?:_vec)?(?:_arr\[[^\]]*\])?")
# aten op names that appear in fused kernel names (longest first, for splitting `cpp_fused_<ops>_<n>`)
_KERNEL_NAME_OPS = sorted([
    "_to_copy", "add", "mul", "sub", "div", "neg", "rsqrt", "sqrt", "pow", "mean", "sum", "exp", "silu",
    "sigmoid", "cos", "sin", "embedding", "index_select", "index", "cat", "slice", "split_with_sizes", "split",
    "unsqueeze", "view", "clone", "onednn_mm", "mm", "bmm", "addmm", "where", "_softmax", "amax", "copy",
    "expand", "reciprocal", "select", "stack", "transpose", "permute", "squeeze", "_unsafe_view", "reshape",
    "t", "fill", "full", "arange", "lift_fresh", "_log_softmax", "logsumexp", "tanh", "gelu", "max", "min",
    "maximum", "minimum", "abs", "rsub", "unbind", "chunk", "masked_fill", "scalar_tensor", "alias", "gather",
    "unified_kv_cache_update", "unified_attention_with_output", "rms_norm", "fused_add_rms_norm",
], key=len, reverse=True)


def kernel_name_ops(name: str) -> list[str]:
    """The source ops a fused kernel's name lists: cpp_fused_<ops>_<n>, triton_{poi,per,red}_fused_<ops>_<n>."""
    m = re.match(r"^(?:cpp_fused|triton_(?:poi|per|red|tem|for)_fused|triton_fused|kernel_cpp)_?(.*?)(?:_\d+)?$", name)
    rest = m.group(1) if m else name
    ops = []
    while rest:
        rest = rest.lstrip("_") if not any(rest.startswith(o) for o in _KERNEL_NAME_OPS if o.startswith("_")) else rest
        for o in _KERNEL_NAME_OPS:
            if rest.startswith(o) and (len(rest) == len(o) or rest[len(o)] == "_"):
                ops.append(o)
                rest = rest[len(o):]
                break
        else:
            part, _, rest = rest.partition("_")
            if part:
                ops.append(part)
    return ops


def _ptr_dtype_cpp(ctype: str) -> str:
    c = ctype.replace("const", "").replace("*", "").strip()
    if "BFloat16" in c or c == "bfloat16":
        return "bf16"
    if c in ("float",):
        return "fp32"
    if "Half" in c:
        return "fp16"
    if c in ("double",):
        return "fp64"
    if "int" in c or c in ("bool", "long"):
        return "int"
    return "other"


def _ptr_dtype_triton(sig: str) -> str:
    s = sig.lstrip("*")
    return {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16", "fp64": "fp64"}.get(s, "int" if s.startswith(("i", "u")) else "other")


@dataclasses.dataclass
class _Kernel:
    """A parsed kernel body: parameters (name, dtype, is pointer) and statements to instantiate per call."""

    name: str
    lang: str  # "cpp" or "triton"
    params: list  # [(name, dtype, is_pointer)]
    stmts: list  # [("def", var, expr) | ("acc", acc, kind, var) | ("store", ptr, expr)]
    source_file: str = ""
    aliases: dict = dataclasses.field(default_factory=dict)  # pointer -> pointer it is (in-place kernels)

    @property
    def ops(self) -> list[str]:
        return kernel_name_ops(self.name)


def _strip_outer(expr: str) -> str:
    """Remove wrappers that do not change a value: parentheses, float(...), broadcasts to vectors."""
    prev = None
    while expr != prev:
        prev = expr
        expr = expr.strip()
        for w in ("float(", "at::vec::VectorizedN<float,2>(", "at::vec::Vectorized<float>(",
                  "at::vec::VectorizedN<float,1>(", "static_cast<float>("):
            if expr.startswith(w) and expr.endswith(")") and _balanced(expr[len(w):-1]):
                expr = expr[len(w):-1]
        if expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]):
            expr = expr[1:-1]
        m = re.match(r"^decltype\((tmp\d+)\)\((.*)\)$", expr)
        if m and _balanced(m.group(2)):
            expr = m.group(2)
    return expr


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


def _split_top(expr: str, ops=(" + ", " - ", " * ", " / ")):
    """Split at the lowest-precedence top-level binary operator (inductor prints them with spaces)."""
    for group in ((" + ", " - "), (" * ", " / ")):
        depth, last = 0, None
        i = 0
        while i < len(expr):
            ch = expr[i]
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif depth == 0:
                for op in group:
                    if op in ops and expr.startswith(op, i):
                        last = (i, op)
            i += 1
        if last:
            i, op = last
            return expr[:i], op.strip(), expr[i + len(op):]
    return None


def _classify_cpp(expr: str):
    """One C++ expression of an inductor kernel -> (op, tmp deps, ptr, index text)."""
    e = expr.strip()
    ptrs = _PTR_RE.findall(e)
    tmps = _TMP_RE.findall(e)
    if ptrs:
        idx = e.split(ptrs[0], 1)[1]
        return "load", [t for t in tmps if t in idx], ptrs[0], re.sub(r"\s+", "", idx)
    if re.search(r"convert<\s*(at::|c10::)?(BFloat16|bfloat16|Half)", e) or re.search(r"static_cast<(at::|c10::)?(BFloat16|Half)>", e):
        return "round", tmps, None, None
    if (re.search(r"convert<\s*(int64_t|int32_t|int|bool|uint8_t)", e) or re.search(r"static_cast<(int64_t|int32_t|int)>\(tmp", e)
            or re.match(r"^(int64_t|int32_t|int)\(", e)):
        return "cast_int", tmps, None, None
    if re.search(r" (<|>|<=|>=|==|!=|&&|\|\|) ", e) and " ? " not in e and "blendv" not in e:
        return "cmp", tmps, None, None
    if re.search(r"convert<\s*float", e):
        return "upcast", tmps, None, None
    if not tmps:
        return "const", [], None, None
    if ".rsqrt()" in e or "std::rsqrt" in e or re.search(r"^1 / std::sqrt\(", e) or re.search(r"\(1\)\s*/\s*.*sqrt", e):
        return "rsqrt", tmps, None, None
    if (".exp()" in e or "std::exp" in e) and ("neg()" in e or "-tmp" in e or "- tmp" in e) and "/" in e and len(set(tmps)) == 1:
        return "sigmoid", tmps, None, None
    for fn, op in (("exp", "exp"), ("cos", "cos"), ("sin", "sin"), ("tanh", "tanh"), ("log", "log"), ("sqrt", "sqrt")):
        if f".{fn}()" in e or f"std::{fn}(" in e:
            return op, tmps, None, None
    if "blendv" in e or " ? " in e:
        return "where", tmps, None, None
    if "max_propagate_nan" in e or "maximum(" in e or "std::max(" in e:
        return "max", tmps, None, None
    if "min_propagate_nan" in e or "minimum(" in e or "std::min(" in e:
        return "min", tmps, None, None
    inner = _strip_outer(e)
    if re.fullmatch(r"tmp(_acc)?\d+", inner):
        return ("copy" if e.startswith("(") or inner == e else "broadcast"), tmps, None, None
    if re.fullmatch(r"tmp\d+\.neg\(\)", inner) or re.fullmatch(r"-\s*tmp\d+", inner):
        return "neg", tmps, None, None
    split = _split_top(inner)
    if split:
        return {"+": "add", "-": "sub", "*": "mul", "/": "div"}[split[1]], tmps, None, None
    return f"unknown:{e[:60]}", tmps, None, None


_CPP_IGNORABLE = re.compile(
    r"^(#|\{|\}|for\s*\(|if\s*\(|else|#pragma|int tid|std::atomic|inductor_cpu_|TORCH_CHECK|extern \"C\"|"
    r"float tmp_acc|double tmp_acc|at::vec::Vectorized(N)?<[^>]*>\s+tmp_acc|Welford<|static WeightRecp|"
    r"auto tmp_acc|alignas|return|\)|[a-z_:0-9<>,]+\s+tmp_acc\d+(_vec)?(_arr)?(\[[^\]]*\])?\s*(=|;)|"
    r"const int64_t|int64_t x\d+_|const auto|int64_t [a-z_0-9]+ = |C10_|// |/\*|\*)"
)


def _parse_cpp_kernel(name: str, code: str, arg_types: list[str], source: str) -> _Kernel:
    m = re.search(r'extern\s+"C"\s+(?:__declspec\(dllexport\)\s+)?void\s+kernel\s*\((.*?)\)\s*\{', code, re.S)
    if not m:
        raise GraphParseError(f"{source}: kernel {name}: no `extern \"C\" void kernel(...)` header in its C++ code")
    params = []
    for p in [x.strip() for x in m.group(1).split(",") if x.strip()]:
        pm = re.match(r"^(.*?)(\w+)$", p)
        if not pm:
            raise GraphParseError(f"{source}: kernel {name}: cannot read parameter {p!r}")
        ctype, pname = pm.group(1).strip(), pm.group(2)
        params.append((pname, _ptr_dtype_cpp(ctype), "*" in ctype))
    body = code[m.end():]
    stmts = []
    aliases = {}
    for raw in body.splitlines():
        line = raw.strip()
        if not line:
            continue
        pa = re.match(r"^auto\s+(in_ptr\d+|out_ptr\d+|in_out_ptr\d+)\s*=\s*(in_ptr\d+|out_ptr\d+|in_out_ptr\d+)\s*;$", line)
        if pa:  # in-place reuse: `auto in_ptr0 = in_out_ptr0;`
            aliases[pa.group(1)] = pa.group(2)
            continue
        d = re.match(r"^auto\s+(tmp\d+)\s*=\s*(.*);$", line)
        if d:
            stmts.append(("def", d.group(1), d.group(2)))
            continue
        a = re.match(r"^(tmp_acc\d+)(?:_vec)?(?:_arr\[[^\]]*\])?\s*=\s*(.*);$", line)
        if a:
            acc, rhs = a.group(1), a.group(2)
            deps = [t for t in _TMP_RE.findall(rhs)]
            if "welford" in rhs.lower():
                kind = "welford"
            elif "max_propagate_nan" in rhs or "maximum" in rhs:
                kind = "max"
            elif "min_propagate_nan" in rhs or "minimum" in rhs:
                kind = "min"
            elif " + " in rhs or "vec_reduce_all" in rhs or "sum_masked_reduce" in rhs:
                kind = "sum"
            elif " * " in rhs:
                kind = "prod"
            else:
                kind = "acc"
            accs_in = [x for x in _ACC_RE.findall(rhs) if x != acc]
            if deps or accs_in:
                stmts.append(("acc", acc, kind, deps[0] if deps else accs_in[0]))
            continue
        s = re.match(r"^(tmp\d+|tmp_acc\d+(?:_vec)?)\.store\(\s*(in_out_ptr\d+|out_ptr\d+)\s*\+(.*)\);$", line)
        if s:
            stmts.append(("store", s.group(2), s.group(1), re.sub(r"\s+", "", s.group(3))))
            continue
        s = re.match(r"^(in_out_ptr\d+|out_ptr\d+)\[(.*)\]\s*=\s*(.*);$", line)
        if s:
            stmts.append(("store", s.group(1), s.group(3), re.sub(r"\s+", "", s.group(2))))
            continue
        if re.search(r"\b(in_out_ptr|out_ptr)\d+\b", line) and ("=" in line or ".store" in line) and not _CPP_IGNORABLE.match(line):
            raise GraphParseError(f"{source}: kernel {name}: cannot read this store: {line[:160]!r}")
        if re.match(r"^tmp\d+\s*=", line):
            raise GraphParseError(f"{source}: kernel {name}: cannot read this assignment: {line[:160]!r}")
    if not any(s[0] == "store" for s in stmts):
        raise GraphParseError(f"{source}: kernel {name}: found no stores in its C++ code")
    return _Kernel(name, "cpp", params, stmts, source, aliases)


def _triton_expr_op(node):
    """Classify one Triton kernel assignment's value (a Python AST expression)."""
    def names(n):
        return [x.id for x in ast.walk(n) if isinstance(x, ast.Name) and re.fullmatch(r"tmp\d+", x.id)]

    def ptrs(n):
        return [x.id for x in ast.walk(n) if isinstance(x, ast.Name) and _PTR_RE.fullmatch(x.id)]

    src = ast.unparse(node)
    # x.to(tl.float32) / x.to(tl.bfloat16)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        target = ast.unparse(node.args[0]) if node.args else ""
        inner = node.func.value
        inner_op = _triton_expr_op(inner)
        if "bfloat16" in target or "float16" in target:
            return ("round", [inner], None, None) if inner_op[0] != "load" else inner_op
        if inner_op[0] == "load":
            return inner_op[0], inner_op[1], inner_op[2], inner_op[3], "upcast"
        return "upcast", names(inner), None, None
    if isinstance(node, ast.Call):
        fn = ast.unparse(node.func)
        base = fn.rsplit(".", 1)[-1]
        if base == "load":
            p = ptrs(node.args[0])
            if not p:
                return f"unknown:{src[:60]}", names(node), None, None
            return "load", names(node.args[0]), p[0], re.sub(r"\s+", "", ast.unparse(node.args[0]))
        table = {"rsqrt": "rsqrt", "sqrt": "sqrt", "sigmoid": "sigmoid", "exp": "exp", "cos": "cos", "sin": "sin",
                 "tanh": "tanh", "log": "log", "where": "where", "maximum": "max", "minimum": "min", "sum": "sum",
                 "max2": "max", "min2": "min", "broadcast_to": "broadcast", "full": "const", "abs": "abs",
                 "promote_to_tensor": "broadcast", "welford_reduce": "welford", "welford": "welford"}
        if base in table:
            deps = names(node) if base != "where" else names(node)
            return table[base], deps, None, None
        return f"unknown:{src[:60]}", names(node), None, None
    if isinstance(node, ast.BinOp):
        op = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}.get(type(node.op))
        if op:
            return op, names(node), None, None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return "neg", names(node), None, None
    if isinstance(node, (ast.Compare, ast.BoolOp)) or isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
        return "cmp", names(node), None, None
    if isinstance(node, ast.Constant):
        return "const", [], None, None
    if isinstance(node, ast.Name):
        return ("copy", [node.id], None, None) if re.fullmatch(r"tmp\d+", node.id) else ("const", [], None, None)
    if isinstance(node, ast.Subscript):  # tl.sum(x, 1)[:, None]
        return _triton_expr_op(node.value)
    return f"unknown:{src[:60]}", names(node), None, None


def _parse_triton_kernel(name: str, code: str, source: str) -> _Kernel:
    try:
        mod = ast.parse(code)
    except SyntaxError as e:
        raise GraphParseError(f"{source}: Triton kernel {name}: not valid Python ({e})") from e
    fn = next((n for n in mod.body if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        raise GraphParseError(f"{source}: Triton kernel {name}: no kernel function")
    sig = {}
    for dec in fn.decorator_list:
        for kw in getattr(dec, "keywords", []):
            if kw.arg == "triton_meta":
                try:
                    meta_src = ast.unparse(kw.value)
                    m = re.search(r"'signature':\s*(\{[^}]*\})", meta_src)
                    sig = ast.literal_eval(m.group(1)) if m else {}
                except (ValueError, SyntaxError) as e:
                    raise GraphParseError(f"{source}: Triton kernel {name}: unreadable triton_meta signature ({e})") from e
    if not sig:
        raise GraphParseError(f"{source}: Triton kernel {name}: no pointer dtypes (triton_meta['signature']) found")
    params = []
    for a in fn.args.args:
        s = sig.get(a.arg, "constexpr")
        params.append((a.arg, _ptr_dtype_triton(s) if s.startswith("*") else "int", s.startswith("*")))
    stmts = []

    def walk(body):
        for st in body:
            if isinstance(st, (ast.For, ast.While, ast.If, ast.With)):
                walk(st.body)
                walk(getattr(st, "orelse", []))
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1:
                tgt = st.targets[0]
                if isinstance(tgt, ast.Tuple):  # welford: tmp3, tmp4, tmp5 = ...
                    for t in tgt.elts:
                        if isinstance(t, ast.Name) and re.fullmatch(r"tmp\d+(_mean|_m2|_weight)?", t.id):
                            stmts.append(("def", t.id.split("_")[0] if t.id.count("_") else t.id, st.value))
                    continue
                if isinstance(tgt, ast.Name) and re.fullmatch(r"tmp\d+|_tmp\d+", tgt.id):
                    stmts.append(("def", tgt.id.lstrip("_"), st.value))
                continue
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and ast.unparse(st.value.func).endswith("store"):
                args = st.value.args
                p = [x.id for x in ast.walk(args[0]) if isinstance(x, ast.Name) and _PTR_RE.fullmatch(x.id)]
                if not p or len(args) < 2:
                    raise GraphParseError(f"{source}: Triton kernel {name}: cannot read store {ast.unparse(st)[:120]!r}")
                stmts.append(("store", p[0], args[1], re.sub(r"\s+", "", ast.unparse(args[0]))))

    walk(fn.body)
    if not any(s[0] == "store" for s in stmts):
        raise GraphParseError(f"{source}: Triton kernel {name}: found no tl.store")
    return _Kernel(name, "triton", params, stmts, source)


class _Builder:
    """Instantiates parsed kernels and extern calls into a Graph while walking the wrapper's call()."""

    def __init__(self, graph: Graph, source: str):
        self.g = graph
        self.source = source
        self.values: dict[str, int] = {}  # buffer / arg name -> node id of its current value
        self.alias: dict[str, str] = {}  # buffer name -> the buffer whose storage it uses
        self.partial: set[str] = set()  # names that view part of their base (`# alias` in the wrapper)
        self.parts: dict[str, dict] = {}  # base -> {partial view name: node written through it}
        self.dtypes: dict[str, str] = {}
        self.calls = Counter()

    def value(self, name: str, dtype_hint="other") -> int:
        if name in self.values:
            return self.values[name]
        root = self.alias.get(name)
        if root is not None and root in self.values:
            nid = self.g.add("view", [self.values[root]], self.g[self.values[root]].dtype, text=f"{name} view of {root}")
            self.values[name] = nid
            return nid
        dtype = self.dtypes.get(name, dtype_hint)
        nid = self.g.add("input", [], dtype, text=name, kernel="input")
        self.values[name] = nid
        return nid

    def write(self, name: str, nid: int):
        """A kernel or extern call wrote `name`: through a partial view (`# alias`) it writes part of its base."""
        root = self.alias.get(name, name)
        self.values[name] = nid
        if name in self.partial:
            parts = self.parts.setdefault(root, {})
            parts[name] = nid
            self.values[root] = self.g.add("join", list(parts.values()), self.g[nid].dtype, kernel="partial",
                                           text=f"{root} <- {', '.join(parts)}")
        else:
            self.values[root] = nid
            self.parts[root] = {}
        for other, base in self.alias.items():  # other names of the same storage now read the new value
            if base == root and other != name:
                self.values.pop(other, None)

    def run_kernel(self, k: _Kernel, args: list[str | None]):
        self.calls[k.name] += 1
        kname = k.name if self.calls[k.name] == 1 else f"{k.name}#{self.calls[k.name]}"
        bind = {}
        for (p, dt, isptr), a in zip(k.params, args):
            if isptr:
                bind[p] = (a, dt)
        for p, target in k.aliases.items():
            if target in bind:
                bind[p] = bind[target]
        env: dict[str, int] = {}
        accs: dict[str, int] = {}
        local_ptr: dict[str, int] = {}  # ptr -> last stored node in this call
        stores: dict[str, list[int]] = defaultdict(list)
        memo: dict = {}
        g = self.g

        def mk(op, inputs, dtype, text, rounds=False, stored=False):
            key = (op, tuple(inputs), dtype, text if op in ("load", "index", "const") or op.startswith("unknown") else None)
            if key in memo:
                return memo[key]
            nid = g.add(op, inputs, dtype, rounds=rounds, kernel=kname, text=text, stored=stored)
            memo[key] = nid
            return nid

        def ptr_value(ptr):
            if ptr in local_ptr:
                return local_ptr[ptr]
            if ptr not in bind:
                raise GraphParseError(f"{self.source}: kernel {k.name} uses {ptr}, which is not one of its parameters")
            buf, dt = bind[ptr]
            return self.value(buf, dt)

        def dtype_of(nid):
            return g[nid].dtype

        def evaluate(var_or_expr, lang_expr=None):
            """The node of a tmp name, or of an expression (C++ text / Triton AST)."""
            if isinstance(var_or_expr, str) and var_or_expr in env:
                return env[var_or_expr]
            if isinstance(var_or_expr, str) and re.fullmatch(r"tmp_acc\d+(_vec)?", var_or_expr):
                return accs[var_or_expr.replace("_vec", "")]
            if k.lang == "cpp":
                info = _classify_cpp(var_or_expr)
            else:
                info = _triton_expr_op(var_or_expr)
            return build(info, var_or_expr if isinstance(var_or_expr, str) else ast.unparse(var_or_expr))

        def dep(t):
            if isinstance(t, ast.AST):
                return evaluate(t)
            if t in env:
                return env[t]
            if re.fullmatch(r"tmp_acc\d+", t) and t in accs:
                return accs[t]
            raise GraphParseError(f"{self.source}: kernel {k.name}: {t} is used before it is defined")

        def build(info, text):
            op, deps, ptr, idx = info[:4]
            if op == "load":
                src = ptr_value(ptr)
                dt = bind[ptr][1] if ptr in bind else dtype_of(src)
                ins = [src] + [dep(t) for t in deps]
                nid = mk("index" if deps else "load", ins, dt, f"{ptr}[{idx}]")
                if len(info) > 4 and info[4] == "upcast":
                    nid = mk("upcast", [nid], "fp32", "to fp32")
                return nid
            ins = [dep(t) for t in deps]
            if op == "const":
                return mk("const", [], "fp32", text)
            if op == "round":
                return mk("round", ins[:1], "bf16", text, rounds=True)
            if op == "upcast":
                return mk("upcast", ins[:1], "fp32", text)
            if op == "cast_int":
                return mk("cast_int", ins[:1], "int", text)
            if op in ("copy", "broadcast"):
                return mk(op, ins[:1], dtype_of(ins[0]) if ins else "fp32", text)
            if op == "cmp" or (ins and all(dtype_of(i) == "int" for i in ins)):
                return mk(op, ins, "int", text)
            dts = {dtype_of(i) for i in ins} - {"int", "other"}
            dt = "fp32" if ("fp32" in dts or not dts) else sorted(dts)[0]
            return mk(op, ins, dt, text, rounds=(dt in ("bf16", "fp16") and op not in EXACT_OPS))

        for st in k.stmts:
            if st[0] == "def":
                _, var, expr = st
                env[var] = evaluate(expr)
            elif st[0] == "acc":
                _, acc, kind, var = st
                src = env.get(var) if var in env else accs.get(var)
                if src is None:
                    raise GraphParseError(f"{self.source}: kernel {k.name}: reduction {acc} reads undefined {var}")
                if acc in accs and (g[accs[acc]].op == kind and src in g[accs[acc]].inputs or src == accs[acc]):
                    continue
                accs[acc] = mk(kind, [src], "fp32", f"{acc} ({kind} reduction)")
            elif st[0] == "store":
                _, ptr, val, idx = st
                nid = evaluate(val) if not (isinstance(val, str) and val in env) else env[val]
                if ptr not in bind:
                    raise GraphParseError(f"{self.source}: kernel {k.name} stores to {ptr}, not one of its parameters")
                pdt = bind[ptr][1]
                vdt = dtype_of(nid)
                rounds = pdt in ("bf16", "fp16") and vdt not in ("bf16", "fp16", "int")
                sid = mk("store", [nid], pdt, f"{ptr}[{idx}]", rounds=rounds, stored=True)
                g[sid].stored = True
                if sid not in stores[ptr]:
                    stores[ptr].append(sid)
                local_ptr[ptr] = sid
        for ptr, sids in stores.items():
            buf = bind[ptr][0]
            if buf is None:
                continue
            nid = sids[0] if len(sids) == 1 else g.add("join", sids, g[sids[0]].dtype, kernel=kname, text=f"{buf} ({len(sids)} stores)")
            self.write(buf, nid)
        self.g.kernels.setdefault(kname, {"kernel": k.name, "lang": k.lang, "ops": k.ops, "file": k.source_file})


# extern calls: (match on the callee text, op, index of the output argument or "return", indices of inputs)
_EXTERNS = [
    ("onednn_mm", "mm", 0, [1, 2]),
    ("weight_packed_linear", "mm", "return", [0, 1, 3]),
    ("extern_kernels.mm", "mm", "out", [0, 1]),
    ("extern_kernels.bmm", "mm", "out", [0, 1]),
    ("extern_kernels.addmm", "mm", "out", [0, 1, 2]),
    ("extern_kernels.baddbmm", "mm", "out", [0, 1, 2]),
    ("aten.mm", "mm", "return", [0, 1]),
    ("aten.addmm", "mm", "return", [0, 1, 2]),
    ("aten.bmm", "mm", "return", [0, 1]),
    ("unified_attention_with_output", "attention", 3, [0, 1, 2]),
    ("unified_attention", "attention", "return", [0, 1, 2]),
    ("scaled_dot_product", "attention", "return", [0, 1, 2]),
    ("flash_attn", "attention", "return", [0, 1, 2]),
    ("unified_kv_cache_update", "kv_cache", "return", [0, 1]),
]


def _call_name(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _arg_name(node) -> str | None:
    """Buffer name of a call argument: bufN / argN_1 / reinterpret_tensor(bufN, ...) -> the name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and _call_name(node) in ("reinterpret_tensor", "torch.as_strided") and node.args:
        return _arg_name(node.args[0])
    if isinstance(node, ast.Subscript):  # buf3[0] of a multi-output extern
        base = _arg_name(node.value)
        return f"{base}[{ast.unparse(node.slice)}]" if base else None
    return None


def parse_output_code(path, graph: Graph | None = None, name: str | None = None) -> Graph:
    """Parse one inductor output-code file (wrapper + kernels) into a value graph (or append to `graph`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise GraphParseError(f"{path}: cannot read ({e})") from e
    source = str(path)
    try:
        mod = ast.parse(text)
    except SyntaxError as e:
        raise GraphParseError(f"{source}: not Python source, so not inductor output code ({e.msg}, line {e.lineno})") from e
    kernels: dict[str, _Kernel] = {}
    call_fn = None
    for st in mod.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and isinstance(st.value, ast.Call):
            kname, fn = st.targets[0].id, _call_name(st.value)
            if fn.startswith("async_compile.cpp"):
                args = st.value.args
                code = next((a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
                types = next((ast.literal_eval(a) for a in args if isinstance(a, ast.List)), [])
                if code is None:
                    raise GraphParseError(f"{source}: kernel {kname}: no C++ source in async_compile call")
                kernels[kname] = _parse_cpp_kernel(kname, code, types, source)
            elif fn.startswith("async_compile.triton"):
                code = next((a.value for a in st.value.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
                if code is None:
                    raise GraphParseError(f"{source}: kernel {kname}: no Triton source in async_compile call")
                kernels[kname] = _parse_triton_kernel(kname, code, source)
        if isinstance(st, ast.FunctionDef) and st.name == "call":
            call_fn = st
        if isinstance(st, ast.ClassDef):
            for sub in st.body:
                if isinstance(sub, ast.FunctionDef) and sub.name == "call":
                    call_fn = sub
    if call_fn is None:
        raise GraphParseError(f"{source}: no `call` function: not an inductor output-code file")
    if not kernels:
        raise GraphParseError(f"{source}: no fused kernels (async_compile.cpp_pybinding / async_compile.triton) found")
    g = graph if graph is not None else Graph(name or path.stem)
    g.meta.setdefault("files", []).append(source)
    b = _Builder(g, source)
    n_extern = 0
    lines = text.splitlines()

    def line_of(st):
        return lines[st.lineno - 1] if 0 < st.lineno <= len(lines) else ""

    def handle(st):
        nonlocal n_extern
        if isinstance(st, (ast.With, ast.If, ast.For)):
            for s in st.body:
                handle(s)
            return
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            tgt = st.targets[0]
            if isinstance(tgt, ast.Tuple):  # argN_1, ... = args
                return
            if not isinstance(tgt, ast.Name):
                return
            name_ = tgt.id
            v = st.value
            if isinstance(v, ast.Call):
                fn = _call_name(v)
                if fn.startswith("empty_strided") or fn in ("torch.empty_strided", "empty", "torch.empty"):
                    dt = next((ast.unparse(a) for a in v.args if "torch." in ast.unparse(a)), "")
                    for kw in v.keywords:
                        if kw.arg == "dtype":
                            dt = ast.unparse(kw.value)
                    b.dtypes[name_] = _dtype_name(dt.removeprefix("torch."))
                    b.values.pop(name_, None)
                    b.alias.pop(name_, None)
                    b.partial.discard(name_)
                    b.parts[name_] = {}
                    for other, base in list(b.alias.items()):  # a fresh buffer under an old name
                        if base == name_:
                            del b.alias[other]
                    return
                if fn == "reinterpret_tensor":
                    # `# reuse`: the storage (and content) passes to a new name; `# alias`: a view of part of it
                    base = _arg_name(v.args[0])
                    root = b.alias.get(base, base)
                    b.dtypes[name_] = b.dtypes.get(base, "other")
                    b.alias[name_] = root
                    b.values.pop(name_, None)
                    if "# reuse" in line_of(st):
                        b.parts[root] = {}
                        b.partial.discard(name_)
                    else:
                        b.partial.add(name_)
                    return
                ext = _match_extern(fn)
                if ext:
                    n_extern += 1
                    _extern(b, fn, v, ext, out_name=name_)
                    return
                if fn.startswith("torch.ops.") or fn.startswith("aten.") or fn.startswith("extern_kernels."):
                    n_extern += 1
                    _extern(b, fn, v, (fn, f"opaque:{fn.split('.')[-2] if fn.endswith('.default') else fn.split('.')[-1]}", "return", list(range(len(v.args)))), out_name=name_)
                    return
                return
            if isinstance(v, ast.Name):  # bufX = bufY; del bufY  # reuse  |  buf15 = buf14  |  s80 = s72
                if v.id in b.values or v.id in b.dtypes:
                    root = b.alias.get(v.id, v.id)
                    b.dtypes[name_] = b.dtypes.get(v.id, "other")
                    b.alias[name_] = root
                    b.partial.discard(name_)
                    if v.id in b.partial:
                        b.partial.add(name_)
                    b.values.pop(name_, None)
                    if "# reuse" in line_of(st):
                        b.parts[root] = {}
                return
            if isinstance(v, ast.Subscript):  # buf3 = buf2[0]
                base = _arg_name(v)
                if base:
                    b.values[name_] = b.value(base)
                    b.dtypes[name_] = g[b.values[name_]].dtype
                    b.alias.pop(name_, None)
                return
            return
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            call = st.value
            fn = _call_name(call)
            kname = fn[:-4] if fn.endswith(".run") else fn
            if kname in kernels:
                args = [_arg_name(a) for a in call.args]
                b.run_kernel(kernels[kname], args)
                return
            ext = _match_extern(fn)
            if ext:
                n_extern += 1
                _extern(b, fn, call, ext)
                return
            if fn.startswith("torch.ops.") and not fn.startswith("torch.ops.inductor"):
                n_extern += 1
                _extern(b, fn, call, (fn, f"opaque:{fn.split('.')[-2]}", 0, list(range(1, len(call.args)))))
                return
        if isinstance(st, ast.Return) and st.value is not None:
            outs = st.value.elts if isinstance(st.value, ast.Tuple) else [st.value]
            for o in outs:
                nm = _arg_name(o)
                if nm:
                    g.meta.setdefault("outputs", []).append(b.value(nm))

    for st in call_fn.body:
        handle(st)
    used = {k for k in b.calls}
    if not used:
        raise GraphParseError(f"{source}: the call() function never runs any of the {len(kernels)} kernels it defines")
    g.meta["n_kernel_calls"] = g.meta.get("n_kernel_calls", 0) + sum(b.calls.values())
    g.meta["n_extern_calls"] = g.meta.get("n_extern_calls", 0) + n_extern
    return g


def _match_extern(fn: str):
    for key, op, out, ins in _EXTERNS:
        if key in fn:
            return (key, op, out, ins)
    return None


def _extern(b: _Builder, fn: str, call: ast.Call, ext, out_name=None):
    _, op, out, ins = ext
    args = call.args
    in_nodes = []
    for i in ins:
        if i < len(args):
            nm = _arg_name(args[i])
            if nm and nm != "None":
                in_nodes.append(b.value(nm))
    kname = fn.removeprefix("torch.ops.").removesuffix(".default")
    if out == "out":
        kw = next((k for k in call.keywords if k.arg == "out"), None)
        target = _arg_name(kw.value) if kw else out_name
    elif out == "return":
        target = out_name
    else:
        target = _arg_name(args[out]) if out < len(args) else out_name
    dtype = b.dtypes.get(target, "bf16") if target else "bf16"
    if b.alias.get(target) and b.dtypes.get(target) is None:
        dtype = b.dtypes.get(b.alias[target], "bf16")
    nid = b.g.add(op, in_nodes, dtype, rounds=(dtype in ("bf16", "fp16") and op not in EXACT_OPS), kernel=kname,
                  text=kname, stored=True)
    if target:
        b.dtypes.setdefault(target, dtype)
        b.write(target, nid)
        if op == "attention" and out == "return":  # sdpa returns (out, lse, ...): out is [0]
            b.values[f"{target}[0]"] = nid


# ==================================================================================================
# Reading the decoder-layer structure and its rounding points from a value graph
# ==================================================================================================

class AnalysisError(RuntimeError):
    """The graph does not show the decoder-layer structure this module reads (the message names the source)."""


BF16_DTYPES = ("bf16", "fp16")
# ops a value passes through unchanged (exact): "is it rounded between producer and consumer" walks them
_WALK_OPS = {"view", "upcast", "copy", "load", "store", "join", "broadcast", "round", "neg", "cat", "where"}

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


@dataclasses.dataclass
class Points:
    """Per (layer, point): "bf16" (rounded to BF16 there), "fp32" (kept in FP32), "n/a" or "opaque"."""

    name: str
    n_layers: int
    values: dict  # (layer, key) -> value; layer is an int or FINAL
    where: dict  # (layer, key) -> kernels/ops that compute the value
    labels: dict  # node id -> (layer, key)
    meta: dict = dataclasses.field(default_factory=dict)

    def get(self, key, layer=None):
        return self.values.get((FINAL if key.split(".")[0] in ("final_norm", "lm_head") else layer, key))

    def summary(self) -> dict:
        """One value per point over all layers ("mixed: ..." when layers differ; n/a ignored)."""
        out = {}
        for key, _, _ in LAYER_POINTS:
            vals = [self.values.get((i, key), "n/a") for i in range(self.n_layers)]
            out[key] = _combine(vals)
        for key, _, _ in FINAL_POINTS:
            out[key] = self.values.get((FINAL, key), "n/a")
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "n_layers": self.n_layers, "meta": self.meta,
                "values": [[l, k, v] for (l, k), v in self.values.items()],
                "where": [[l, k, v] for (l, k), v in self.where.items()]}

    @classmethod
    def from_json(cls, d) -> Points:
        return cls(d["name"], d["n_layers"], {(l, k): v for l, k, v in d["values"]},
                   {(l, k): v for l, k, v in d.get("where", [])}, {}, d.get("meta", {}))


def _combine(vals):
    real = [v for v in vals if v != "n/a"]
    if not real:
        return "n/a"
    c = Counter(real)
    if len(c) == 1:
        return real[0]
    return "mixed: " + ", ".join(f"{v}×{n}" for v, n in c.most_common())


class _Walker:
    def __init__(self, g: Graph):
        self.g = g
        self.users = g.users()

    def is_bf16(self, n: Node) -> bool:
        return n.dtype in BF16_DTYPES or n.op == "round"

    def back(self, nid, walk=_WALK_OPS, max_steps=200):
        """Sources of the value read at `nid`: [(source node id, rounded to BF16 on the way or at the source)]."""
        out, seen = [], set()
        stack = [(nid, False)]
        while stack and len(seen) < max_steps:
            i, flag = stack.pop()
            if (i, flag) in seen:
                continue
            seen.add((i, flag))
            n = self.g[i]
            f = flag or self.is_bf16(n)
            if n.op in walk and n.inputs:
                ins = [x for x in n.inputs if self.g[x].dtype != "int"] if n.op in ("where", "cat", "join") else n.inputs[:1]
                if n.op == "store" or n.op == "load":
                    ins = n.inputs[:1]
                for x in ins or n.inputs[:1]:
                    stack.append((x, f))
                continue
            out.append((i, f))
        return out

    def source(self, nid):
        """The single source of a value and whether it reaches `nid` rounded (any branch)."""
        srcs = self.back(nid)
        if not srcs:
            return None, False
        return max(srcs, key=lambda s: s[0])[0], any(f for _, f in srcs)

    def fwd(self, nid, walk=_WALK_OPS, max_steps=400):
        """Consumers of the value of `nid`: [(consumer node id, rounded to BF16 on the way, at nid included)]."""
        out, seen = [], set()
        stack = [(nid, self.is_bf16(self.g[nid]))]
        while stack and len(seen) < max_steps:
            i, flag = stack.pop()
            for u in self.users.get(i, []):
                if (u, flag) in seen:
                    continue
                seen.add((u, flag))
                un = self.g[u]
                if un.op in walk:
                    f = flag or self.is_bf16(un)
                    if not self.users.get(u):  # a kernel output nothing here reads (a graph output)
                        out.append((u, f))
                    stack.append((u, f))
                else:
                    out.append((u, flag))
        return out

    def ancestors_have(self, nid, pred, depth=12):
        seen, frontier = set(), [nid]
        for _ in range(depth):
            nxt = []
            for i in frontier:
                if i in seen:
                    continue
                seen.add(i)
                if pred(self.g[i]):
                    return True
                nxt.extend(self.g[i].inputs)
            frontier = nxt
        return False


def _bf(flag) -> str:
    return "bf16" if flag else "fp32"


def read_points(g: Graph, strict: bool = True) -> Points:
    """Find norms, residual adds, RoPE, SwiGLU, projections and attention; read where each value is rounded."""
    w = _Walker(g)
    src_desc = ", ".join(g.meta.get("files", [])) or g.name
    nodes = g.nodes
    values, where, labels = {}, {}, {}

    def put(layer, key, value, node_ids=()):
        kernels = sorted({nodes[i].kernel for i in node_ids if nodes[i].kernel and nodes[i].kernel not in ("input", "partial")})
        if (layer, key) in values and values[(layer, key)] != value:
            value = _combine([values[(layer, key)], value]) if not values[(layer, key)].startswith("mixed") else values[(layer, key)]
        values[(layer, key)] = value
        where.setdefault((layer, key), [])
        where[(layer, key)] = sorted(set(where[(layer, key)]) | set(kernels))
        for i in node_ids:
            labels.setdefault(i, (layer, key))

    # ---- norms: rsqrt -> normalize (x·rsqrt) -> ·weight -------------------------------------------
    norms = []
    for r in (n for n in nodes if n.op == "rsqrt"):
        normalize = [u for u, _ in w.fwd(r.id) if nodes[u].op == "mul"]
        if not normalize:
            continue
        info = {"rsqrt": r.id, "normalize": normalize, "weight_mul": [], "normalized_flags": [], "x_src": None}
        for nz in normalize:
            others = [i for i in nodes[nz].inputs if not w.ancestors_have(i, lambda n: n.id == r.id, depth=4)]
            if others:
                src, flag = w.source(others[0])
                info["x_src"], info["x_flag"] = src, flag
            for u, flag in w.fwd(nz):
                un = nodes[u]
                if un.op != "mul":
                    continue
                other = [i for i in un.inputs if not w.ancestors_have(i, lambda n: n.id == nz, depth=6)]
                if other and all(nodes[w.source(o)[0]].op in ("input",) for o in other if w.source(o)[0] is not None):
                    info["weight_mul"].append(u)
                    info["normalized_flags"].append(flag)
        if info["x_src"] is None:
            continue
        xs = nodes[info["x_src"]]
        info["kind"] = "qk" if xs.op == "mm" else "residual"
        norms.append(info)
    residual = [n for n in norms if n["kind"] == "residual"]
    qk = [n for n in norms if n["kind"] == "qk"]
    if len(residual) < 3 or len(residual) % 2 == 0:
        raise AnalysisError(f"{src_desc}: found {len(residual)} residual-stream RMSNorms (rsqrt whose input is not a "
                            "projection); a decoder of L layers has 2L+1 (input and post-attention norm per layer, "
                            "final norm). Not a Qwen2/Qwen3-style decoder graph, or an unfamiliar code pattern.")
    L = (len(residual) - 1) // 2
    bounds = [residual[2 * i]["rsqrt"] for i in range(L)]

    def layer_of(nid):
        lay = 0
        for i, b in enumerate(bounds):
            if nid >= b:
                lay = i
        return lay

    def norm_output(info):
        """Rounded where the next op reads the norm output (weight-mul output, or normalize if no weight)."""
        outs = info["weight_mul"] or info["normalize"]
        flags = [f for o in outs for _, f in w.fwd(o)]
        return _bf(any(flags)) if flags else "?"

    # residual norms: sums, carried residual, normalized, output
    for k, info in enumerate(residual):
        if k == 2 * L:
            layer, prefix = FINAL, "final_norm"
        else:
            layer, prefix = k // 2, ("input_norm" if k % 2 == 0 else "post_norm")
        xs = nodes[info["x_src"]]
        if xs.op in ("add",):
            put(layer, f"{prefix}.sum", _bf(info["x_flag"]), [xs.id])
            parts = [w.source(i) for i in xs.inputs]
            res = [(s, f) for s, f in parts if s is not None and nodes[s].op != "mm" and nodes[s].op != "const"]
            if any(s is not None and nodes[s].op == "mm" for s, _ in parts) and res:
                s, f = res[0]
                if nodes[s].op in ("index", "embedding", "input"):
                    put(layer, f"{prefix}.carried", "n/a", [s])
                else:
                    put(layer, f"{prefix}.carried", _bf(f), [s])
            else:
                put(layer, f"{prefix}.carried", "?", [xs.id])
        elif k == 0 and xs.op in ("index", "embedding", "input", "load"):
            put(layer, f"{prefix}.sum", "n/a", [xs.id])
            put(layer, f"{prefix}.carried", "n/a", [])
        else:
            put(layer, f"{prefix}.sum", "?", [xs.id])
            put(layer, f"{prefix}.carried", "?", [])
        flags = info["normalized_flags"]
        put(layer, f"{prefix}.normalized", _bf(any(flags)) if flags else "n/a", info["normalize"])
        put(layer, f"{prefix}.output", norm_output(info), info["weight_mul"] or info["normalize"])
        info["layer"], info["prefix"] = layer, prefix
    # Q/K norms
    for info in qk:
        lay = layer_of(info["rsqrt"])
        flags = info["normalized_flags"]
        put(lay, "qk_norm.normalized", _bf(any(flags)) if flags else "n/a", info["normalize"])
    qk_outputs = {o: layer_of(info["rsqrt"]) for info in qk for o in (info["weight_mul"] or info["normalize"])}

    # ---- RoPE ------------------------------------------------------------------------------------
    def is_const(nid):
        n = nodes[nid]
        return n.op == "const" or (n.op in ("broadcast", "copy", "upcast", "view") and n.inputs and is_const(n.inputs[0]))

    def trig_kind(nid, depth=4):
        """'cos'/'sin' (computed), 'table' (gathered by position from a parameter table), or None."""
        n = nodes[nid]
        if n.op in ("cos", "sin"):
            return n.op
        if n.op == "index":
            table = w.source(n.inputs[0])[0]
            ok = table is not None and nodes[table].op == "input" and nodes[table].dtype != "int"
            return "table" if ok else None
        if depth and n.op in ("mul", "round", "view", "upcast", "copy", "broadcast", "cat", "load", "store") and n.inputs:
            tensor_ins = [i for i in n.inputs if not is_const(i)]
            if n.op == "cat":
                kinds = {trig_kind(i, depth - 1) for i in tensor_ins}
                return kinds.pop() if len(kinds) == 1 else None
            if len(tensor_ins) == 1:
                return trig_kind(tensor_ins[0], depth - 1)
        return None

    def has_mm(nid):
        return w.ancestors_have(nid, lambda n: n.op == "mm", depth=24)

    products = {}
    for n in nodes:
        if n.op != "mul" or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        sa, fa = w.source(a)
        sb, fb = w.source(b)
        if sb is not None and trig_kind(sb) and sa is not None and not trig_kind(sa) and has_mm(a):
            products[n.id] = (a, b, sb, fb)
        elif sa is not None and trig_kind(sa) and sb is not None and not trig_kind(sb) and has_mm(b):
            products[n.id] = (b, a, sa, fa)
    rope_sums = []
    for n in nodes:
        if n.op in ("add", "sub") and len(n.inputs) == 2:
            srcs = [w.source(i) for i in n.inputs]
            if all(s is not None and s in products for s, _ in srcs):
                rope_sums.append((n.id, srcs))
    qk_reads = defaultdict(list)  # layer -> [(product kind, rounded)]
    for sid, srcs in rope_sums:
        lay = layer_of(sid)
        put(lay, "rope.products", _bf(any(f for _, f in srcs)), [s for s, _ in srcs])
        for m, _ in srcs:
            q, _, csrc, cflag = products[m]
            put(lay, "rope.cos_sin", _bf(cflag), [csrc])
            qs, _ = w.source(q)
            if any(s in qk_outputs for s, _ in w.back(q)):
                kind = trig_kind(csrc)
                qk_reads[lay].append((kind, any(f for s, f in w.back(q) if s in qk_outputs), qs))
        outs = [f for _, f in w.fwd(sid)]
        put(lay, "rope.output", _bf(any(outs)) if outs else "?", [sid])
    for lay, reads in qk_reads.items():
        flags = {f for _, f, _ in reads}
        if len(flags) == 1:
            put(lay, "qk_norm.output", _bf(flags.pop()), [q for _, _, q in reads])
        else:  # e.g. torch.compile of Transformers: q·cos reads FP32, rotate_half(q) was stored in BF16
            by_kind = sorted({f"{_bf(f)} into ·{k if k in ('cos', 'sin') else 'cos/sin'}" for k, f, _ in reads})
            put(lay, "qk_norm.output", "mixed: " + ", ".join(by_kind), [q for _, _, q in reads])
    # opaque rotary kernels (eager vLLM's C++ rotary_embedding): inputs read, internals from a probe
    probe = g.meta.get("probes", {}).get("rotary_embedding")
    for n in nodes:
        if n.op.startswith("opaque:") and "rotary" in n.op:
            lay = layer_of(n.id)
            ins = [w.source(i) for i in n.inputs]
            tables = [(s, f) for s, f in ins if s is not None and nodes[s].op == "input" and nodes[s].dtype not in ("int",)]
            acts = [(s, f) for s, f in ins if s is not None and (s, f) not in tables and nodes[s].dtype != "int"]
            if tables:
                put(lay, "rope.cos_sin", _bf(any(f for _, f in tables)), [tables[0][0]])
            for s, f in acts:
                if s in qk_outputs:
                    put(lay, "qk_norm.output", _bf(f), [s])
            if probe and probe.get("best"):
                put(lay, "rope.products", "fp32" if probe["best"] == "fp32_round_once" else "bf16", [n.id])
            else:
                put(lay, "rope.products", "opaque", [n.id])
            put(lay, "rope.output", _bf(nodes[n.id].dtype in BF16_DTYPES), [n.id])
    for lay in range(L):
        if (lay, "qk_norm.normalized") not in values:
            put(lay, "qk_norm.normalized", "n/a")
            put(lay, "qk_norm.output", "n/a")

    # ---- SwiGLU ----------------------------------------------------------------------------------
    def sigmoid_like(nid):
        n = nodes[nid]
        if n.op == "sigmoid":
            return True
        if n.op == "div" and len(n.inputs) == 2:  # 1 / (1 + exp(-x))
            return w.ancestors_have(n.inputs[1], lambda m: m.op == "exp", depth=3)
        if n.op == "recip":
            return w.ancestors_have(n.inputs[0], lambda m: m.op == "exp", depth=3)
        return False

    silus = []
    for n in nodes:
        if n.op == "silu":
            silus.append(n.id)
        elif n.op == "mul" and len(n.inputs) == 2 and any(sigmoid_like(w.source(i)[0]) for i in n.inputs if w.source(i)[0] is not None):
            silus.append(n.id)
        elif n.op == "div" and len(n.inputs) == 2 and w.ancestors_have(n.inputs[1], lambda m: m.op == "exp", depth=3) \
                and w.ancestors_have(n.inputs[1], lambda m: m.op == "neg", depth=4) and nodes[w.source(n.inputs[0])[0]].op != "const":
            silus.append(n.id)  # x / (1 + exp(-x)) = silu(x)
    swiglu_products = {}
    for s in silus:
        lay = layer_of(s)
        for u, flag in w.fwd(s):
            if nodes[u].op == "mul":
                put(lay, "swiglu.silu", _bf(flag), [s])
                outs = [f for _, f in w.fwd(u)]
                put(lay, "swiglu.output", _bf(any(outs)) if outs else "?", [u])
                swiglu_products[u] = lay

    # ---- projections, attention, lm_head ----------------------------------------------------------
    roles = {}
    for info in residual:
        for o in info["weight_mul"] or info["normalize"]:
            roles[o] = ({"input_norm": "qkv_proj", "post_norm": "gate_up_proj", "final_norm": "lm_head"}[info["prefix"]], info["layer"])
    attentions = [n.id for n in nodes if n.op == "attention"]
    for i, a in enumerate(attentions):
        lay = layer_of(a)
        roles[a] = ("o_proj", lay)
        put(lay, "attention.output", _bf(nodes[a].dtype in BF16_DTYPES), [a])
    for p, lay in swiglu_products.items():
        roles[p] = ("down_proj", lay)
    final_rsqrt = residual[-1]["rsqrt"]
    for n in nodes:
        if n.op != "mm":
            continue
        role = None
        for i in n.inputs:
            s, _ = w.source(i)
            if s in roles:
                role = roles[s]
                break
        if role is None and n.id > final_rsqrt:
            role = ("lm_head", FINAL)
        if role is None:
            continue
        name, lay = role
        put(FINAL if name == "lm_head" else lay, f"{name}.output", _bf(n.dtype in BF16_DTYPES), [n.id])

    # ---- completeness ------------------------------------------------------------------------------
    missing = []
    for lay in range(L):
        for key, _, _ in LAYER_POINTS:
            if (lay, key) not in values:
                if key == "attention.output" and not attentions:
                    put(lay, key, "n/a (between compiled pieces)")
                    continue
                if key in ("input_norm.sum", "input_norm.carried") and lay == 0:
                    continue
                values[(lay, key)] = "?"
            if values[(lay, key)] == "?":
                missing.append(f"layer {lay} {key}")
    for key, _, _ in FINAL_POINTS:
        if (FINAL, key) not in values:
            values[(FINAL, key)] = "n/a (not in this graph)" if key == "lm_head.output" else "?"
        if values[(FINAL, key)] == "?":
            missing.append(f"final {key}")
    pts = Points(g.name, L, values, where, labels,
                 meta={"source": src_desc, "n_attention": len(attentions), "has_qk_norm": bool(qk), "missing": missing,
                       **{k: v for k, v in g.meta.items() if k in ("engine", "vllm", "torch", "model", "mode", "device")}})
    if strict and missing:
        raise AnalysisError(f"{src_desc}: could not read {len(missing)} rounding point(s): {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''}. The code does not match the decoder patterns "
                            "this reader knows (see rla_lib.graphs.read_points).")
    return pts


# ==================================================================================================
# Rounding schedule (JSON) and its mapping to rla_lib.align options
# ==================================================================================================

def _major(value: str):
    """('bf16'|'fp32'|None, exact?) for a point value ('mixed: fp32×2, bf16×1' -> ('fp32', False))."""
    if value in ("bf16", "fp32"):
        return value, True
    if value.startswith("mixed"):
        counts = Counter()
        for part in value.removeprefix("mixed:").split(","):
            part = part.strip()
            kind = "bf16" if part.startswith("bf16") else "fp32" if part.startswith("fp32") else None
            if kind:
                m = re.search(r"×(\d+)", part)
                counts[kind] += int(m.group(1)) if m else 1
        if counts:
            top = counts.most_common()
            return (top[0][0] if len(top) == 1 or top[0][1] > top[1][1] else "bf16"), False
    return None, True


def _counts(value: str) -> Counter:
    c = Counter()
    if value.startswith("mixed"):
        for part in value.removeprefix("mixed:").split(","):
            part = part.strip()
            m = re.search(r"×(\d+)", part)
            c[part.split("×")[0].strip()] += int(m.group(1)) if m else 1
    elif value and not value.startswith("n/a"):
        c[value] += 1
    return c


def _combined(summary, keys):
    """One value for several points (e.g. all residual-stream norms), counting layers inside mixed values."""
    total = Counter()
    for k in keys:
        total += _counts(summary.get(k, "n/a"))
    if not total:
        return "n/a"
    if len(total) == 1:
        return next(iter(total))
    return "mixed: " + ", ".join(f"{v}×{n}" for v, n in total.most_common())


def _align_mapping(summary: dict, has_qk_norm: bool):
    """Map a schedule's point values to (regions, align options, notes on what does not map exactly)."""
    regions, options, notes = [], {}, []

    def pick(label, value, on, off, default=None):
        major, exact = _major(value)
        if major is None:
            notes.append(f"{label}: engine value {value!r} cannot be read as bf16/fp32; left at {default!r}")
            return default
        if not exact:
            notes.append(f"{label}: layers differ ({value}); nearest setting follows the majority ({major})")
        return on if major == "fp32" else off

    # residual_norm: the norm reads an unrounded sum; options: carried residual, weight multiply
    sums = _combined(summary, ["input_norm.sum", "post_norm.sum", "final_norm.sum"])
    res_on = pick("residual_norm: residual sum read by the norms", sums, True, False, False)
    carried = _combined(summary, ["input_norm.carried", "post_norm.carried", "final_norm.carried"])
    normalized = _combined(summary, ["input_norm.normalized", "post_norm.normalized", "final_norm.normalized"])
    if res_on:
        regions.append("residual_norm")
        options["residual_stream"] = pick("residual_stream", carried, "fp32", "bf16", "bf16")
        options["norm_weight"] = pick("norm_weight", normalized, "fp32", "stock", "stock")
    else:
        if _major(carried)[0] == "fp32":
            notes.append("residual carried in FP32 while the norms read a rounded sum: align has no such option "
                         "(residual_stream needs residual_norm); left stock")
        if _major(normalized)[0] == "fp32":
            notes.append("norm weight multiplied in FP32 while the norm reads a rounded sum: align's norm_weight "
                         "only exists inside residual_norm; left stock")
    # rope
    rope_on = pick("rope: q·cos and rotate(q)·sin", summary.get("rope.products", "n/a"), True, False, False)
    cos_sin = summary.get("rope.cos_sin", "n/a")
    if rope_on:
        regions.append("rope")
        options["rope_cos_sin"] = pick("rope_cos_sin", cos_sin, "fp32", "bf16", "fp32")
        if has_qk_norm:
            nz, out = summary.get("qk_norm.normalized", "n/a"), summary.get("qk_norm.output", "n/a")
            if "into ·" in out:  # e.g. rotate_half(q) stored in BF16, q·cos read in FP32
                notes.append(f"Q/K norm output reaches RoPE partly rounded ({out}): align has no such option; "
                             f"nearest follows the norm itself ({nz})")
                out = nz
            a, b = _major(nz)[0], _major(out)[0]
            if a is None or b is None:
                notes.append(f"Q/K norm: {nz!r}/{out!r} not readable; rope_qk_norm left at 'fp32'")
                options["rope_qk_norm"] = "fp32"
            else:
                if a != b:
                    notes.append(f"Q/K norm rounds {nz} before ·weight and {out} after it: align's rope_qk_norm is "
                                 f"all-FP32 or stock (two roundings); nearest follows the output ({b})")
                if not (_major(nz)[1] and _major(out)[1]):
                    notes.append(f"Q/K norm differs across layers ({nz} / {out}); nearest follows the majority")
                options["rope_qk_norm"] = "fp32" if b == "fp32" else "stock"
    else:
        if _major(cos_sin)[0] == "fp32":
            notes.append("FP32 cos/sin but rounded RoPE products: not expressible (rope_cos_sin exists only inside rope)")
        if has_qk_norm and _major(summary.get("qk_norm.output", "n/a"))[0] == "fp32":
            notes.append("unrounded Q/K norm output but rounded RoPE products: not expressible; left stock")
    # swiglu
    if pick("swiglu: silu(gate) before ·up", summary.get("swiglu.silu", "n/a"), True, False, False):
        regions.append("swiglu")
    # points align never changes: they must round as stock Transformers does
    for key in ("input_norm.output", "qkv_proj.output", "rope.output", "attention.output", "o_proj.output",
                "post_norm.output", "gate_up_proj.output", "swiglu.output", "down_proj.output", "final_norm.output",
                "lm_head.output"):
        v = summary.get(key, "n/a")
        if v not in ("bf16", "n/a") and not v.startswith("n/a"):
            notes.append(f"{key} is {v} in the engine, BF16 in Transformers, and no align option changes it")
    ordered = tuple(r for r in ("rope", "swiglu", "residual_norm") if r in regions)
    return ordered, options, notes


def schedule(points: Points, engine: str | None = None, meta: dict | None = None) -> dict:
    """A machine-readable rounding schedule from the points read off an engine's code or trace."""
    summary = points.summary()
    regions, options, notes = _align_mapping(summary, points.meta.get("has_qk_norm", True))
    per_layer = {}
    for key, region, what in LAYER_POINTS:
        per_layer[key] = {"region": region, "what": what, "value": summary[key],
                          "per_layer": [points.values.get((i, key), "n/a") for i in range(points.n_layers)],
                          "kernels": sorted({k for i in range(points.n_layers) for k in points.where.get((i, key), [])})}
    for key, region, what in FINAL_POINTS:
        per_layer[key] = {"region": region, "what": what, "value": summary[key], "per_layer": None,
                          "kernels": points.where.get((FINAL, key), [])}
    return {
        "format": SCHEDULE_FORMAT,
        "engine": engine or points.name,
        "n_layers": points.n_layers,
        "has_qk_norm": points.meta.get("has_qk_norm", True),
        "source": {k: v for k, v in {**points.meta, **(meta or {})}.items() if k != "missing"},
        "points": per_layer,
        "align": {"regions": list(regions), "options": options, "exact": not notes, "notes": notes},
        "values": "bf16 = the value is rounded to BF16 where the next op reads it; fp32 = kept in FP32 (fused); "
                  "n/a = no such value (e.g. no Q/K norm, layer 0's residual is the embedding)",
    }


def save_schedule(sched: dict, path) -> Path:
    return _atomic_write_json(path, sched)


def load_schedule(path) -> dict:
    d = json.loads(Path(path).read_text())
    if d.get("format") != SCHEDULE_FORMAT:
        raise GraphParseError(f"{path}: not a rounding schedule ({SCHEDULE_FORMAT})")
    return d


def schedule_to_align_kwargs(sched: dict):
    """(regions, options) for rla_lib.align.align from a schedule's points (its 'align' section is not read).

    Notes on what the options cannot express are in `schedule_notes(sched)`.
    """
    if sched.get("format") != SCHEDULE_FORMAT:
        raise ValueError(f"not a rounding schedule ({SCHEDULE_FORMAT}): format {sched.get('format')!r}")
    summary = {k: v["value"] for k, v in sched["points"].items()}
    regions, options, _ = _align_mapping(summary, sched.get("has_qk_norm", True))
    return regions, options


def schedule_notes(sched: dict) -> list[str]:
    summary = {k: v["value"] for k, v in sched["points"].items()}
    return _align_mapping(summary, sched.get("has_qk_norm", True))[2]


def align_to_schedule(model, sched: dict):
    """Make a Transformers Qwen2/Qwen3 model round where the schedule says (rla_lib.align.align)."""
    from .align import align

    regions, options = schedule_to_align_kwargs(sched)
    return align(model, regions, **options)


# ==================================================================================================
# Tables and the figure
# ==================================================================================================

def points_table(points: dict, per_layer: bool = False):
    """Rows: (layer, region, point); columns: one per side. Values bf16/fp32/n/a (see Points)."""
    import pandas as pd

    rows = []
    first = next(iter(points.values()))
    layers = list(range(first.n_layers)) if per_layer else ["all"]
    for lay in layers:
        for key, region, what in LAYER_POINTS:
            row = {"layer": lay, "region": region, "point": key, "what": what}
            for side, p in points.items():
                row[side] = p.summary()[key] if lay == "all" else p.values.get((lay, key), "n/a")
            rows.append(row)
    for key, region, what in FINAL_POINTS:
        row = {"layer": "final", "region": region, "point": key, "what": what}
        for side, p in points.items():
            row[side] = p.values.get((FINAL, key), "n/a")
        rows.append(row)
    return pd.DataFrame(rows).set_index(["layer", "region", "point"])


def rounding_diff(points: dict, reference: str, per_layer: bool = True):
    """Where each side rounds differently from `reference`: one row per (layer, point, side)."""
    import pandas as pd

    t = points_table(points, per_layer=per_layer)
    rows = []
    for idx, r in t.iterrows():
        ref = r[reference]
        for side in points:
            if side == reference or r[side] == ref:
                continue
            if r[side] == "bf16" and ref == "fp32":
                who = f"{side} rounds, {reference} keeps FP32"
            elif r[side] == "fp32" and ref == "bf16":
                who = f"{reference} rounds, {side} keeps FP32"
            else:
                who = f"{reference}: {ref}; {side}: {r[side]}"
            rows.append({"layer": idx[0], "region": idx[1], "point": idx[2], "side": side, reference: ref,
                         "side value": r[side], "difference": who})
    return pd.DataFrame(rows)


def _describe(g: Graph, points: Points, w: _Walker, nid: int) -> str:
    for src, _ in w.back(nid) + [(nid, False)]:
        lab = points.labels.get(src)
        if lab:
            return f"{'L' + str(lab[0]) if lab[0] != FINAL else 'final'} {lab[1]}"
    src, _ = w.source(nid)
    n = g[src] if src is not None else g[nid]
    if n.op in ("sum", "welford"):
        return "Σx² partial (for rsqrt)"
    if n.op == "neg" or any(g[s].op == "neg" for s, _ in w.back(nid, walk=_WALK_OPS - {"neg"})):
        return "rotate_half (−x2, x1)"
    return f"{n.op} value"


def kernel_table(g: Graph, points: Points):
    """One row per fused-kernel call: source ops from its name, BF16 stores (roundings), FP32 stores and the
    values it keeps in FP32 inside, and the decoder regions/layers its values belong to."""
    import pandas as pd

    w = _Walker(g)
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
        inside = sorted({f"{'L' + str(l) if l != FINAL else 'final'} {k}" for l, k in labs
                         if points.values.get((l, k)) == "fp32"})
        rows.append({
            "kernel": kname, "fused ops (from name)": ", ".join(info.get("ops", [])),
            "regions": ", ".join(sorted({POINT_INFO[k][0] for _, k in labs})),
            "layers": ", ".join(sorted({str(l) for l, _ in labs}, key=lambda x: (len(x), x))),
            "BF16 stores (roundings)": "; ".join(sorted(set(bf16_stores))),
            "FP32 stores": "; ".join(sorted(set(fp32_stores))),
            "kept FP32 inside": "; ".join(inside),
        })
    return pd.DataFrame(rows)


def plot_layer_chain(points: dict, layer: int = 1, reference: str | None = None, title: str | None = None, ax=None):
    """One decoder layer as its op chain (x) with each side's rounding points marked (rows)."""
    import matplotlib.pyplot as plt

    keys = [k for k, _, _ in LAYER_POINTS]
    sides = list(points)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(10, 0.62 * len(keys)), 0.55 * len(sides) + 2.6))
    else:
        fig = ax.figure
    ref = reference or sides[0]
    styles = {"bf16": dict(marker="s", color="#c0392b", ms=9), "fp32": dict(marker="o", mfc="white", color="#2471a3", ms=9)}
    for y, side in enumerate(sides):
        p = points[side]
        for x, key in enumerate(keys):
            v = p.values.get((layer, key), "n/a")
            major, exact = _major(v)
            if major is None:
                ax.plot(x, y, marker="x", color="0.6", ms=7, ls="none")
                continue
            ax.plot(x, y, ls="none", **styles[major])
            if not exact:
                ax.plot(x, y, marker="s", mfc="none", color="#8e44ad", ms=14, ls="none")
            rv = points[ref].values.get((layer, key), "n/a")
            if side != ref and _major(rv)[0] is not None and v != rv:
                ax.plot(x, y, marker="o", mfc="none", color="#f39c12", ms=17, mew=2, ls="none")
    ax.grid(False)
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
    ax.set_yticks(range(len(sides)), sides)
    ax.set_ylim(len(sides) - 0.4, -1.0)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="none", **styles["bf16"], label="rounded to BF16"),
               Line2D([], [], ls="none", **styles["fp32"], label="kept in FP32"),
               Line2D([], [], ls="none", marker="x", color="0.6", label="n/a"),
               Line2D([], [], ls="none", marker="o", mfc="none", color="#f39c12", ms=12, mew=2, label=f"differs from {ref}"),
               Line2D([], [], ls="none", marker="s", mfc="none", color="#8e44ad", ms=12, label="mixed across layers/paths")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.30), ncol=5, fontsize=8, frameon=False)
    ax.set_title(title or f"decoder layer {layer}: where each side rounds", fontsize=10)
    return fig


# ==================================================================================================
# Finding output code in a compile cache; capturing graphs from the real engine
# ==================================================================================================

def find_output_code(cache_dir) -> list[Path]:
    """Inductor output-code files under a compile cache (vLLM's VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, a
    capture directory, or a directory you copied them into), in compile order (inductor's AOT ID)."""
    cache_dir = Path(cache_dir)
    if not cache_dir.exists():
        raise GraphParseError(f"{cache_dir}: no such compile-cache directory")
    files = []
    for p in sorted(cache_dir.rglob("*.py")):
        try:
            head = p.read_text(errors="replace")
        except OSError:
            continue
        if "async_compile" in head and re.search(r"^\s*def call\(", head, re.M):
            m = re.search(r"# AOT ID: \['(\d+)_", head)
            files.append((int(m.group(1)) if m else 10**6, p.stat().st_mtime, p))
    return [p for _, _, p in sorted(files)]


def _is_decoder_code(path: Path) -> bool:
    text = path.read_text(errors="replace")
    return any(k in text for k in ("onednn_mm", "extern_kernels.mm", "extern_kernels.addmm", "aten.mm", "weight_packed_linear"))


def parse_cache(cache_dir, name="compiled") -> Graph:
    """The decoder graph from a compile cache: one complete graph (the first whole-model one when several
    shape-specialised compiles exist), else all decoder pieces concatenated in compile order (piecewise)."""
    files = [p for p in find_output_code(cache_dir) if _is_decoder_code(p)]
    if not files:
        raise GraphParseError(f"{cache_dir}: no inductor output code with matmuls (a decoder graph) found under it. "
                              "Point cache_dir at vLLM's VLLM_CACHE_ROOT (or its torch_compile_cache/...), a "
                              "TORCHINDUCTOR_CACHE_DIR, or a capture directory made by rla_lib.graphs.capture.")
    whole = []
    for p in files:
        g = parse_output_code(p, name=name)
        try:
            read_points(g)
            whole.append(g)
        except AnalysisError:
            continue
    if whole:
        g = whole[0]
        g.meta["alternatives"] = [x.meta["files"][0] for x in whole[1:]]
        return g
    g = Graph(name)
    for p in files:
        n0 = len(g.nodes)
        parse_output_code(p, graph=g)
        if n0:  # the engine runs attention between compiled pieces
            g.add("attention", [n0 - 1], "bf16", rounds=True, kernel="(outside the compiled pieces)",
                  text="piece boundary")
    g.meta["piecewise"] = True
    return g


def merge_graphs(first: Graph, second: Graph, name=None) -> Graph:
    """`second` appended after `first`; its non-parameter activation inputs read `first`'s last output."""
    g = Graph(name or first.name, [dataclasses.replace(n) for n in first.nodes], dict(first.kernels), dict(first.meta))
    outs = first.meta.get("outputs") or [len(first.nodes) - 1]
    off = len(g.nodes)
    for n in second.nodes:
        if n.op == "input" and n.kernel == "input" and n.dtype in BF16_DTYPES:
            g.nodes.append(Node(n.id + off, "view", [outs[-1]], n.dtype, text=f"{n.text} = {first.name} output",
                                kernel="link"))
        else:
            g.nodes.append(dataclasses.replace(n, id=n.id + off, inputs=[i + off for i in n.inputs]))
    g.kernels.update(second.kernels)
    for k, v in second.meta.items():
        g.meta.setdefault(k, v)
    return g


def _find_vllm_model(llm):
    """The nn.Module vLLM runs, from an in-process LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    paths = ["llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.model"]
    for path in paths:
        obj = llm
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        model = getattr(obj, "model", obj) if not hasattr(obj, "logits_processor") else obj
        if hasattr(model, "logits_processor"):
            return model
        if hasattr(obj, "logits_processor"):
            return obj
    raise RuntimeError("could not find vLLM's model object in the in-process engine (vLLM internals changed?)")


def probe_rotary_kernel(device="cpu", seed=0) -> dict:
    """Bitwise test of vLLM's compiled rotary kernel against two roundings: FP32 math rounded once, or BF16 ops."""
    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(seed)
    T, hq, hk, d, max_pos = 48, 4, 2, 64, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.einsum("i,j -> ij", torch.arange(max_pos, dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16).to(device)
    q = torch.randn(T, hq * d, generator=g).to(torch.bfloat16).to(device)
    k = torch.randn(T, hk * d, generator=g).to(torch.bfloat16).to(device)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(device)
    q_out, k_out = q.clone(), k.clone()
    ops.rotary_embedding(pos, q_out, k_out, d, cache, True)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def fp32_round_once(x, h):
        x = x.view(T, h, d).float()
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        c, s = cos.float(), sin.float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(torch.bfloat16).view(T, h * d)

    def bf16_every_op(x, h):
        x = x.view(T, h, d)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).view(T, h * d)

    res = {}
    for name, fn in (("fp32_round_once", fp32_round_once), ("bf16_every_op", bf16_every_op)):
        eq = torch.cat([(fn(q, hq) == q_out).flatten(), (fn(k, hk) == k_out).flatten()]).float().mean().item()
        res[name] = eq
    res["best"] = max(("fp32_round_once", "bf16_every_op"), key=lambda n: res[n])
    res["note"] = "fraction of q/k elements bitwise equal to each emulation (48 tokens, random q/k, BF16 cos_sin_cache)"
    return res


def _capture_main(model: str, engine: str, mode: str, out_dir: str) -> None:
    """Run in a fresh process (`python -m rla_lib.graphs capture ...`): the environment is set before imports."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    meta = {"model": model, "engine": engine, "mode": mode, "python": sys.version.split()[0]}
    if engine == "hf":
        import torch

        from .models import load_model, resolve_model

        m = load_model(model, dtype="bfloat16")
        compiled = torch.compile(m)
        with torch.no_grad():
            compiled(input_ids=torch.tensor([default_ids()]))
        meta.update(torch=torch.__version__, model_path=str(resolve_model(model).path),
                    inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    else:
        import torch

        from .engine import Engine

        eng = Engine(model, mode=mode, seed=0, max_model_len=64)
        vm = _find_vllm_model(eng.llm)
        hooked = [vm, vm.logits_processor] if mode == "eager" else [vm.logits_processor]
        tracer = AtenTracer(vm, name=f"vllm:{mode}", hooked=hooked, max_forwards=len(hooked))
        try:
            eng.score([default_ids()], full_vocab=False)
        finally:
            tracer.close()
        g = tracer.graph
        if mode == "eager":
            try:
                g.meta.setdefault("probes", {})["rotary_embedding"] = probe_rotary_kernel()
            except Exception as e:  # noqa: BLE001 - recorded, the analysis then reports the kernel as opaque
                g.meta.setdefault("probes", {})["rotary_embedding"] = {"error": f"{type(e).__name__}: {e}"}
        import vllm

        cc = eng.llm.llm_engine.vllm_config.compilation_config
        meta.update(vllm=vllm.__version__, torch=torch.__version__, model_path=str(eng.spec.path),
                    device=str(getattr(eng.llm.llm_engine.vllm_config.device_config, "device", "cpu")),
                    compilation={"mode": str(getattr(cc, "mode", "")), "backend": str(getattr(cc, "backend", "")),
                                 "custom_ops": list(getattr(cc, "custom_ops", []) or []),
                                 "splitting_ops": list(getattr(cc, "splitting_ops", []) or [])},
                    vllm_cache_root=os.environ.get("VLLM_CACHE_ROOT"))
        g.meta.update(meta)
        g.save(out / ("trace.json" if mode == "eager" else "lm_head_trace.json"))
        eng.close()
    from .machine import machine  # imports torch, which the graph readers do not need

    meta["seconds"] = round(time.time() - t0, 1)
    meta["machine"] = machine()  # the kernels, and so the graph, depend on it
    _atomic_write_json(out / "capture.json", meta)


def capture_dir(model, engine="vllm", mode="compiled") -> Path:
    from .machine import machine_key  # imports torch, which the graph readers do not need
    from .models import resolve_model

    spec = resolve_model(model)
    key = hashlib.sha1(str(spec.path).encode()).hexdigest()[:8]
    # The kernels, and so the graph, depend on the machine (rla_lib.machine): one capture per machine.
    return GRAPHS_DIR / "captures" / f"{spec.path.name}-{key}-{engine}-{mode}-{machine_key()}"


def capture(model="qwen3-tiny", mode="compiled", engine="vllm", out_dir=None, force=False, timeout=1800) -> Path:
    """Run the engine once in a subprocess with a known compile cache; returns the capture directory.

    engine="vllm": real vLLM (mode "compiled" or "eager"), in-process engine core, VLLM_CACHE_ROOT=<dir>/vllm_cache,
    TORCHINDUCTOR_CACHE_DIR=<dir>/inductor_cache, VLLM_USE_AOT_COMPILE=0 (fresh, so the compile is cold and
    writes its output code there); compiled mode also traces the logits processor (which vLLM runs eagerly,
    outside the compiled graph); eager mode traces the whole forward at the aten level.
    engine="hf": torch.compile of the Transformers model (mode "compiled"), TORCHINDUCTOR_CACHE_DIR=<dir>/inductor_cache.
    A finished capture (capture.json present) is reused unless force=True.
    """
    if engine == "vllm" and mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'compiled' or 'eager', got {mode!r}")
    if engine == "hf" and mode != "compiled":
        raise ValueError("engine='hf' captures torch.compile of Transformers: mode must be 'compiled' (the eager side "
                         "is traced in-process by training_graph)")
    out = Path(out_dir) if out_dir else capture_dir(model, engine, mode)
    if (out / "capture.json").exists() and not force:
        return out
    if out.exists() and force:
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        # On CPU vLLM compiles with plain torch.compile(backend="inductor") (DYNAMO_TRACE_ONCE): its output code
        # goes to TORCHINDUCTOR_CACHE_DIR. With VLLM_COMPILE (GPU) vLLM's backend puts it under VLLM_CACHE_ROOT.
        # Fresh directories make the compile cold, so the code is (re)generated here.
        env.update(VLLM_CACHE_ROOT=str(out / "vllm_cache"), TORCHINDUCTOR_CACHE_DIR=str(out / "inductor_cache"),
                   VLLM_USE_AOT_COMPILE="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        env.update(TORCHINDUCTOR_CACHE_DIR=str(out / "inductor_cache"))
    cmd = [sys.executable, "-m", "rla_lib.graphs", "capture", str(model), engine, mode, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    (out / "capture.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or not (out / "capture.json").exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"capture of {model} ({engine} {mode}) failed (exit {proc.returncode}); log: "
                           f"{out / 'capture.log'}\n{tail}")
    return out


def engine_graph(cap_or_cache, mode=None, name=None) -> Graph:
    """The engine's value graph from a capture directory or any compile cache.

    A capture made in eager mode holds an aten trace (trace.json); otherwise the inductor output code under
    the directory is parsed, and the lm_head trace of a vLLM capture (vLLM runs the logits processor
    outside the compiled graph) is appended.
    """
    d = Path(cap_or_cache)
    meta = json.loads((d / "capture.json").read_text()) if (d / "capture.json").exists() else {}
    mode = mode or meta.get("mode") or "compiled"
    if mode == "eager":
        if not (d / "trace.json").exists():
            raise GraphParseError(f"{d}: an eager engine leaves no compile cache; this needs the aten trace "
                                  "(trace.json) written by rla_lib.graphs.capture(..., mode='eager')")
        g = Graph.load(d / "trace.json")
    else:
        g = parse_cache(d, name=name or f"{meta.get('engine', 'vllm')}:compiled")
        if (d / "lm_head_trace.json").exists():
            g = merge_graphs(g, Graph.load(d / "lm_head_trace.json"))
    if name:
        g.name = name
    elif meta:
        g.name = f"{meta.get('engine', 'vllm')}:{mode}"
    g.meta.update({k: v for k, v in meta.items() if k not in ("seconds",)})
    return g


SIDES = ("vllm:compiled", "vllm:eager", "hf:compiled", "hf:eager")


def side_graph(model, side: str, force: bool = False) -> Graph:
    """The value graph of one side: 'vllm:compiled', 'vllm:eager', 'hf:compiled' (captured in a subprocess,
    cached under results/graphs/captures) or 'hf:eager' (traced in this process)."""
    if side == "hf:eager":
        return training_graph(model)
    engine, _, mode = side.partition(":")
    if engine not in ("vllm", "hf") or mode not in ("compiled", "eager"):
        raise ValueError(f"unknown side {side!r}; choose from {SIDES}")
    return engine_graph(capture(model, mode, engine=engine, force=force), name=side)


def read_sides(model, sides=SIDES, force: bool = False, progress: bool | None = None):
    """(points, graphs) per side for one model; the points are also saved as JSON under results/graphs/.

    progress: a bar over the sides, a capture (an engine start and compile, minutes) each when not cached
    (None: only in a Jupyter kernel, see `rla_lib.progress`).
    """
    from .models import resolve_model
    from .progress import bar

    graphs_, points = {}, {}
    sides_bar = bar(sides, progress, desc=f"{model} graphs", leave=False)
    for side in sides_bar:
        sides_bar.set_postfix_str(side)
        graphs_[side] = side_graph(model, side, force=force)
        points[side] = read_points(graphs_[side])
        out = GRAPHS_DIR / resolve_model(model).path.name / f"points-{side.replace(':', '-')}.json"
        _atomic_write_json(out, points[side].to_json())
    return points, graphs_


def export_schedule(points: Points, model, side: str, directory=None) -> Path:
    """Write the schedule JSON for one side to results/graphs/<model>/schedule-<side>.json."""
    from .models import resolve_model

    directory = Path(directory) if directory else GRAPHS_DIR / resolve_model(model).path.name
    return save_schedule(schedule(points, side), directory / f"schedule-{side.replace(':', '-')}.json")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 5 and argv[0] == "capture":
        _capture_main(*argv[1:])
        return
    print("usage: python -m rla_lib.graphs capture MODEL {vllm|hf} {compiled|eager} OUT_DIR", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
