"""Front end for eager forwards: every aten/custom op, traced with a TorchDispatchMode, becomes a value node.

Every op whose BF16 output is not an exact copy (views, cat, gather, neg) is a rounding. Used for Transformers
(stock or aligned) and for eager vLLM inside its engine process, with vLLM IR ops (`vllm_ir.rms_norm`, ...)
expanded into the aten ops of the implementation they dispatch to, and module paths recorded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import sides
from ..sides import align_config
from ..models import load_model, resolve_model
from ..tokenizer import VOCAB
from .graph import EXACT_OPS, Graph, dtype_name, normalize_op_name

_COPY_OPS = ("_to_copy", "to", "copy", "copy_", "_copy_from", "type_as")


class _Mode(TorchDispatchMode):
    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.tracer.dispatch(self, func, args, kwargs or {})


class AtenTracer:
    """Record every aten/custom op of a forward as value nodes, with module paths.

    Hooks on the `hooked` modules (default: `root`; e.g. also vLLM's logits processor, which runs outside
    the model's forward) switch a TorchDispatchMode on for the duration of their forward; hooks on every
    submodule of `root` record module paths. Only the first `max_forwards` hooked forwards are recorded.
    """

    def __init__(self, root, name="trace", hooked=None, max_forwards=None, expand_vllm_ir=True):
        self.graph = Graph(name)
        self.hooked = list(hooked) if hooked is not None else [root]
        self.max_forwards = max_forwards
        self.expand_vllm_ir = expand_vllm_ir
        self._handles = []
        self._module_stack: list[str] = []
        self._active_owner = None  # the hooked module whose forward is being recorded
        self._forwards = 0
        self._values: dict = {}  # tensor key -> node id
        self._storage_writer: dict = {}  # storage ptr -> node id of the last value written there
        self._names: dict = {}  # storage ptr -> parameter/buffer name
        self._mode = _Mode(self)
        for mod_name, mod in root.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(mod_name or "<root>")))
            self._handles.append(mod.register_forward_hook(self._post_hook(mod_name or "<root>")))
        for p_name, p in list(root.named_parameters()) + list(root.named_buffers()):
            if p is not None and p.numel() > 0:
                self._names[p.untyped_storage().data_ptr()] = (p_name, p.storage_offset(), tuple(p.shape))

    # ---- module hooks: which module computes each op; when the mode is on ------------------------
    def _pre_hook(self, name):
        def hook(mod, args):
            if any(mod is h for h in self.hooked) and self._active_owner is None:
                if self.max_forwards is not None and self._forwards >= self.max_forwards:
                    return
                self._mode.__enter__()
                self._active_owner = mod
            self._module_stack.append(name)

        return hook

    def _post_hook(self, name):
        def hook(mod, args, out):
            if self._module_stack and self._module_stack[-1] == name:
                self._module_stack.pop()
            if self._active_owner is not None and mod is self._active_owner:
                self._mode.__exit__(None, None, None)
                self._active_owner = None
                self._forwards += 1

        return hook

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._active_owner is not None:
            self._mode.__exit__(None, None, None)
            self._active_owner = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- recording --------------------------------------------------------------------------------
    @staticmethod
    def _key(t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def _lookup(self, t) -> int:
        key = self._key(t)
        if key in self._values:
            return self._values[key]
        ptr = key[0]
        if ptr in self._storage_writer:  # a view of a recorded value
            src = self._storage_writer[ptr]
            nid = self.graph.add("view", [src], dtype_name(t.dtype), text="view", module=self._module())
            self._values[key] = nid
            return nid
        name = self._names.get(ptr)
        label = name[0] if name else f"input{list(t.shape)}"
        nid = self.graph.add("input", [], dtype_name(t.dtype), text=label, kernel="param" if name else "input")
        self._values[key] = nid
        self._storage_writer[ptr] = nid
        return nid

    def _module(self):
        return self._module_stack[-1] if self._module_stack else None

    def _register(self, t, nid):
        self._values[self._key(t)] = nid
        self._storage_writer[t.untyped_storage().data_ptr()] = nid

    def dispatch(self, mode, func, args, kwargs):
        """Run one op (a vLLM IR op as the ops it dispatches to) and record it."""
        schema_name = func._schema.name
        if self.expand_vllm_ir and schema_name.startswith("vllm_ir::"):
            impl = _vllm_ir_impl(func)
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

    def _record(self, func, args, kwargs, out):
        name = func._schema.name
        op = normalize_op_name(name)
        flat_args, _ = tree_flatten((args, kwargs))
        inputs = [self._lookup(a) for a in flat_args if isinstance(a, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        text = f"{name}.{func._overloadname}"
        if len(outs) > 1 and op in ("attention", "mm"):  # e.g. sdpa's (output, logsumexp, ...): the rest is aux
            self._record_with_aux(op, inputs, outs, text)
            return
        results = outs + [w for w in _written(func, args, kwargs) if all(w is not o for o in outs)]
        base = name.rpartition("::")[2]
        if op == "view" and inputs:
            self._record_each(results, "view", inputs[:1], text)
        elif base in _COPY_OPS:
            self._record_copies(results, inputs[-1] if base in ("copy_", "copy") else inputs[0], text)
        elif op == "alloc":
            for t in results:
                self._register(t, self.graph.add("alloc", [], dtype_name(t.dtype), text=text, module=self._module()))
        else:
            self._record_each(results, op, inputs, text, stored=True)

    def _record_each(self, results, op, inputs, text, stored=False):
        for t in results:
            dt = dtype_name(t.dtype)
            rounds = dt in ("bf16", "fp16") and op not in EXACT_OPS
            self._register(t, self.graph.add(op, inputs, dt, rounds=rounds, text=text, module=self._module(),
                                             kernel=text, stored=stored))

    def _record_copies(self, results, src, text):
        src_dtype = self.graph[src].dtype
        for t in results:
            dt = dtype_name(t.dtype)
            kind = "copy" if dt == src_dtype else ("round" if dt in ("bf16", "fp16") else "upcast")
            self._register(t, self.graph.add(kind, [src], dt, rounds=(kind == "round"), text=text,
                                             module=self._module(), kernel=text))

    def _record_with_aux(self, op, inputs, outs, text):
        first = outs[0]
        dt = dtype_name(first.dtype)
        nid = self.graph.add(op, inputs, dt, rounds=dt in ("bf16", "fp16"), text=text, module=self._module(),
                             kernel=text, stored=True)
        self._register(first, nid)
        for t in outs[1:]:
            self._register(t, self.graph.add("aux", [nid], dtype_name(t.dtype), text=text, module=self._module()))


def _written(func, args, kwargs) -> list:
    """Arguments the op writes into (out=, in-place, vLLM's custom ops)."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            val = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(val, torch.Tensor):
                written.append(val)
    return written


def _vllm_ir_impl(func):
    """The implementation a vLLM IR op dispatches to (traced op by op), or None without vLLM."""
    try:
        from vllm.ir.op import IrOp
    except ImportError:
        return None
    op = IrOp.registry.get(func._schema.name.split("::", 1)[1])
    if op is None:
        return None
    target = op if func._overloadname == "default" else getattr(op, func._overloadname, None)
    return getattr(target, "_inner_call", None)


def trace_forward(model, input_ids, name=sides.STOCK, **forward_kwargs) -> Graph:
    """Trace one eager forward of a Transformers causal LM (logits included) at the aten level."""
    with torch.no_grad(), AtenTracer(model, name=name, max_forwards=1) as tr:
        model(input_ids=input_ids, **forward_kwargs)
    g = tr.graph
    g.meta.update(source="aten trace (TorchDispatchMode) of the eager forward", torch=torch.__version__)
    return g


def default_ids(n: int = 12):
    """A fixed short prompt for traces: the first held-out task prompt, padded with digits to n tokens."""
    ids = [VOCAB.index(c) for c in "47+385+9=432"][:n]
    return ids + [1] * (n - len(ids))


def training_graph(model="qwen3-tiny", regions=None, options=None, name=None, ids=None) -> Graph:
    """The training side: stock (or aligned) Transformers BF16 forward, traced at the aten level."""
    m = load_model(model, dtype="bfloat16") if isinstance(model, (str, Path)) else model
    handle = align_config(m, tuple(regions), options) if regions is not None else None
    try:
        ids_t = torch.tensor([ids or default_ids()])
        g = trace_forward(m, ids_t, name=name or (sides.STOCK if handle is None else sides.training("aligned")))
    finally:
        if handle is not None:
            handle.undo()
    if isinstance(model, (str, Path)):
        g.meta["model"] = str(resolve_model(model).path)
    g.meta["aligned"] = None if regions is None else {"regions": list(regions), "options": dict(options or {})}
    return g
