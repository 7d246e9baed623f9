"""Front end for inductor output code: the wrapper's `call()` gives the order of fused kernels and extern calls
(matmuls, attention) and which buffers each reads and writes; each kernel's body (`inductor_kernels`) gives its
values. No torch here: this reads text, so it runs on output code copied from any machine.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import Counter, defaultdict
from pathlib import Path

from .graph import BF16_DTYPES, EXACT_OPS, Graph, GraphParseError, Node, dtype_name
from .inductor_kernels import Kernel, classify_cpp, parse_cpp_kernel, parse_triton_kernel, triton_expr_op

# extern calls: (match on the callee text, op, index of the output argument or "return"/"out", indices of inputs)
_EXTERNS = [
    ("onednn_mm", "mm", 0, [1, 2]),
    ("weight_packed_linear", "mm", 0, [1, 2, 3]),  # vLLM-CPU's AMX linear (small weights): out, x, packed weight, bias
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


def _match_extern(fn: str):
    return next((ext for ext in _EXTERNS if ext[0] in fn), None)


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


def _shape(size, stride) -> tuple:
    """(size, stride) of a buffer as text with every symbol written `s`: `(s72, 9, 64)` -> `(s, 9, 64)`."""
    return tuple(re.sub(r"[A-Za-z_]\w*", "s", ast.unparse(x).replace(" ", "")) for x in (size, stride))


class _Buffers:
    """The wrapper's buffers while walking call(): which node holds each buffer's current value."""

    def __init__(self, graph: Graph, source: str):
        self.g = graph
        self.source = source
        self.values: dict[str, int] = {}  # buffer / arg name -> node id of its current value
        self.alias: dict[str, str] = {}  # buffer name -> the buffer whose storage it uses
        self.partial: set[str] = set()  # names that view part of their base (`# alias` in the wrapper)
        self.parts: dict[str, dict] = {}  # base -> {partial view name: node written through it}
        self.dtypes: dict[str, str] = {}
        self.calls = Counter()
        self.shapes: dict[str, tuple] = {}  # buffer / arg name -> (size, stride), symbols as "s" (`_shape`)
        self.args: set[str] = set()  # the graph inputs call() checks with assert_size_stride
        self.returned: list[tuple] = []  # call()'s return values: (node id, (size, stride) or None)

    def value(self, name: str, dtype_hint="other") -> int:
        if name in self.values:
            return self.values[name]
        item = re.fullmatch(r"(\w+)\[(\d+)\]", name)
        if item and item.group(1) in self.values:  # buf6 = buf5[1]: one output of an extern returning a tuple
            src = self.g[self.values[item.group(1)]]
            nid = self.g.add("view", [src.id], src.dtype, kernel=src.kernel, text=f"{name}: output {item.group(2)} of {src.kernel}")
            self.values[name] = nid
            return nid
        root = self.alias.get(name)
        if root is not None and root in self.values:
            nid = self.g.add("view", [self.values[root]], self.g[self.values[root]].dtype, text=f"{name} view of {root}")
            self.values[name] = nid
            return nid
        nid = self.g.add("input", [], self.dtypes.get(name, dtype_hint), text=name, kernel="input")
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

    def run_kernel(self, k: Kernel, args: list[str | None]):
        self.calls[k.name] += 1
        kname = k.name if self.calls[k.name] == 1 else f"{k.name}#{self.calls[k.name]}"
        _KernelCall(self, k, args, kname).run()
        self.g.kernels.setdefault(kname, {"kernel": k.name, "lang": k.lang, "ops": k.ops, "file": k.source_file})

    def extern(self, fn: str, call: ast.Call, ext, out_name=None):
        """A matmul, attention or other extern call: one node, rounding if its output buffer is BF16."""
        _, op, out, ins = ext
        args = call.args
        in_nodes = [self.value(nm) for nm in (_arg_name(args[i]) for i in ins if i < len(args)) if nm and nm != "None"]
        kname = fn.removeprefix("torch.ops.").removesuffix(".default")
        if out == "out":
            kw = next((k for k in call.keywords if k.arg == "out"), None)
            target = _arg_name(kw.value) if kw else out_name
        elif out == "return":
            target = out_name
        else:
            target = _arg_name(args[out]) if out < len(args) else out_name
        dtype = self.dtypes.get(target, "bf16") if target else "bf16"
        if self.alias.get(target) and self.dtypes.get(target) is None:
            dtype = self.dtypes.get(self.alias[target], "bf16")
        nid = self.g.add(op, in_nodes, dtype, rounds=(dtype in BF16_DTYPES and op not in EXACT_OPS), kernel=kname,
                         text=kname, stored=True)
        if target:
            self.dtypes.setdefault(target, dtype)
            self.write(target, nid)
            if op == "attention" and out == "return":  # sdpa returns (out, lse, ...): out is [0]
                self.values[f"{target}[0]"] = nid


class _KernelCall:
    """One call of a parsed kernel: its statements become nodes; its stores become the buffers' new values."""

    def __init__(self, buffers: _Buffers, k: Kernel, args: list[str | None], kname: str):
        self.b, self.k, self.g, self.kname = buffers, k, buffers.g, kname
        self.bind = {p: (a, dt) for (p, dt, isptr), a in zip(k.params, args) if isptr}  # pointer -> (buffer, dtype)
        for p, target in k.aliases.items():
            if target in self.bind:
                self.bind[p] = self.bind[target]
        self.env: dict[str, int] = {}  # tmp name -> node
        self.accs: dict[str, int] = {}  # reduction accumulator -> node
        self.local_ptr: dict[str, int] = {}  # ptr -> last stored node in this call
        self.stores: dict[str, list[int]] = defaultdict(list)
        self.memo: dict = {}  # one node per distinct value (inductor repeats loads and casts per loop)

    def mk(self, op, inputs, dtype, text, rounds=False, stored=False):
        key = (op, tuple(inputs), dtype, text if op in ("load", "index", "const") or op.startswith("unknown") else None)
        if key not in self.memo:
            self.memo[key] = self.g.add(op, inputs, dtype, rounds=rounds, kernel=self.kname, text=text, stored=stored)
        return self.memo[key]

    def fail(self, what: str):
        raise GraphParseError(f"{self.b.source}: kernel {self.k.name}{what}")

    def ptr_value(self, ptr):
        if ptr in self.local_ptr:
            return self.local_ptr[ptr]
        if ptr not in self.bind:
            self.fail(f" uses {ptr}, which is not one of its parameters")
        buf, dt = self.bind[ptr]
        return self.b.value(buf, dt)

    def evaluate(self, x):
        """The node of a tmp name, or of an expression (C++ text / Triton AST)."""
        if isinstance(x, str) and x in self.env:
            return self.env[x]
        if isinstance(x, str) and re.fullmatch(r"tmp_acc\d+(_vec)?", x):
            return self.accs[x.replace("_vec", "")]
        info = classify_cpp(x) if self.k.lang == "cpp" else triton_expr_op(x)
        return self.build(info, x if isinstance(x, str) else ast.unparse(x))

    def dep(self, t):
        if isinstance(t, ast.AST):
            return self.evaluate(t)
        if t in self.env:
            return self.env[t]
        if re.fullmatch(r"tmp_acc\d+", t) and t in self.accs:
            return self.accs[t]
        self.fail(f": {t} is used before it is defined")

    def load(self, info):
        _, deps, ptr, idx = info[:4]
        src = self.ptr_value(ptr)
        dt = self.bind[ptr][1] if ptr in self.bind else self.g[src].dtype
        nid = self.mk("index" if deps else "load", [src] + [self.dep(t) for t in deps], dt, f"{ptr}[{idx}]")
        if len(info) > 4 and info[4] == "upcast":
            nid = self.mk("upcast", [nid], "fp32", "to fp32")
        return nid

    def build(self, info, text):
        op, deps = info[:2]
        if op == "load":
            return self.load(info)
        ins = [self.dep(t) for t in deps]
        if op == "const":
            return self.mk("const", [], "fp32", text)
        if op == "round":
            return self.mk("round", ins[:1], "bf16", text, rounds=True)
        if op == "upcast":
            return self.mk("upcast", ins[:1], "fp32", text)
        if op == "cast_int":
            return self.mk("cast_int", ins[:1], "int", text)
        if op in ("copy", "broadcast"):
            return self.mk(op, ins[:1], self.g[ins[0]].dtype if ins else "fp32", text)
        if op == "cmp" or (ins and all(self.g[i].dtype == "int" for i in ins)):
            return self.mk(op, ins, "int", text)
        dts = {self.g[i].dtype for i in ins} - {"int", "other"}
        dt = "fp32" if ("fp32" in dts or not dts) else sorted(dts)[0]
        return self.mk(op, ins, dt, text, rounds=(dt in BF16_DTYPES and op not in EXACT_OPS))

    def reduce(self, acc, kind, var):
        src = self.env.get(var) if var in self.env else self.accs.get(var)
        if src is None:
            self.fail(f": reduction {acc} reads undefined {var}")
        prev = self.accs.get(acc)
        if prev is not None and (self.g[prev].op == kind and src in self.g[prev].inputs or src == prev):
            return
        self.accs[acc] = self.mk(kind, [src], "fp32", f"{acc} ({kind} reduction)")

    def store(self, ptr, val, idx):
        nid = self.evaluate(val)
        if ptr not in self.bind:
            self.fail(f" stores to {ptr}, not one of its parameters")
        pdt = self.bind[ptr][1]
        rounds = pdt in BF16_DTYPES and self.g[nid].dtype not in ("bf16", "fp16", "int")
        sid = self.mk("store", [nid], pdt, f"{ptr}[{idx}]", rounds=rounds, stored=True)
        if sid not in self.stores[ptr]:
            self.stores[ptr].append(sid)
        self.local_ptr[ptr] = sid

    def run(self):
        for st in self.k.stmts:
            if st[0] == "def":
                self.env[st[1]] = self.evaluate(st[2])
            elif st[0] == "acc":
                self.reduce(*st[1:])
            elif st[0] == "store":
                self.store(*st[1:])
        for ptr, sids in self.stores.items():
            buf = self.bind[ptr][0]
            if buf is None:
                continue
            nid = sids[0] if len(sids) == 1 else self.g.add("join", sids, self.g[sids[0]].dtype, kernel=self.kname,
                                                            text=f"{buf} ({len(sids)} stores)")
            self.b.write(buf, nid)


# A float sum reduction in inductor's C++ (an RMSNorm's Σx²): N vector registers of accumulators, then a loop over the
# row in steps of N·(lanes per register). The order of its additions is what `rla_lib.align`'s `rms_sum` copies.
_FLOAT_SUM_RE = re.compile(
    r"at::vec::Vectorized(?:N<float,(?P<n>\d+)>|<float>) tmp_acc\d+_vec = [^;]*;\s*"
    r"for\(int64_t \w+=static_cast<int64_t>\(0L\); \w+<static_cast<int64_t>\(\w+\); "
    r"\w+\+=static_cast<int64_t>\((?P<step>\d+)L\)\)")


def float_sum_layout(code: str) -> str | None:
    """How a C++ kernel's float sum reduction accumulates: "vec<N>x<W>" (N registers of W lanes), None if it has none."""
    m = _FLOAT_SUM_RE.search(code)
    if m is None:
        return None
    registers = int(m["n"] or 1)
    return f"vec{registers}x{int(m['step']) // registers}"


def _kernels_and_call(mod: ast.Module, source: str):
    """The kernels the file compiles (name -> parsed body), its `call` function, and the layout of each C++ kernel's
    float sum reduction (name -> `float_sum_layout`, kernels that have one)."""
    kernels: dict[str, Kernel] = {}
    sums: dict[str, str] = {}
    call_fn = None
    for st in mod.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and isinstance(st.value, ast.Call):
            kname, fn, args = st.targets[0].id, _call_name(st.value), st.value.args
            if fn.startswith("async_compile.cpp"):
                code = next((a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
                if code is None:
                    raise GraphParseError(f"{source}: kernel {kname}: no C++ source in async_compile call")
                kernels[kname] = parse_cpp_kernel(kname, code, source)
                if layout := float_sum_layout(code):
                    sums[kname] = layout
            elif fn.startswith("async_compile.triton"):
                code = next((a.value for a in args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
                if code is None:
                    raise GraphParseError(f"{source}: kernel {kname}: no Triton source in async_compile call")
                kernels[kname] = parse_triton_kernel(kname, code, source)
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
    return kernels, call_fn, sums


class _Wrapper:
    """Walks the statements of the wrapper's call(): buffer allocations, reuses and views, kernel and extern calls."""

    def __init__(self, buffers: _Buffers, kernels: dict, lines: list[str]):
        self.b, self.kernels, self.lines = buffers, kernels, lines
        self.n_extern = 0

    def reused(self, st) -> bool:
        """`# reuse` on the line: the storage (and content) passes to the new name."""
        return "# reuse" in (self.lines[st.lineno - 1] if 0 < st.lineno <= len(self.lines) else "")

    def statement(self, st):
        if isinstance(st, (ast.With, ast.If, ast.For)):
            for s in st.body:
                self.statement(s)
        elif isinstance(st, ast.Assign) and len(st.targets) == 1:
            if isinstance(st.targets[0], ast.Name):  # not `argN_1, ... = args`
                self.assign(st, st.targets[0].id, st.value)
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            self.call(st.value)
        elif isinstance(st, ast.Return) and st.value is not None:
            outs = st.value.elts if isinstance(st.value, ast.Tuple) else [st.value]
            for out in outs:
                nm = _arg_name(out)
                if not nm:
                    continue
                nid = self.b.value(nm)
                self.b.g.meta.setdefault("outputs", []).append(nid)
                inline = isinstance(out, ast.Call) and _call_name(out) == "reinterpret_tensor" and len(out.args) > 2
                self.b.returned.append((nid, _shape(*out.args[1:3]) if inline else self.b.shapes.get(nm)))

    def assign(self, st, name: str, v):
        if isinstance(v, ast.Call):
            fn = _call_name(v)
            if fn.startswith("empty_strided") or fn in ("torch.empty_strided", "empty", "torch.empty"):
                self.allocate(name, v)
            elif fn == "reinterpret_tensor":
                self.reinterpret(st, name, v)
            elif _match_extern(fn):
                self.n_extern += 1
                self.b.extern(fn, v, _match_extern(fn), out_name=name)
            elif fn.startswith(("torch.ops.", "aten.", "extern_kernels.")):
                self.n_extern += 1
                op = f"opaque:{fn.split('.')[-2] if fn.endswith('.default') else fn.split('.')[-1]}"
                self.b.extern(fn, v, (fn, op, "return", list(range(len(v.args)))), out_name=name)
        elif isinstance(v, ast.Name):  # bufX = bufY; del bufY  # reuse  |  buf15 = buf14  |  s80 = s72
            self.rename(st, name, v.id)
        elif isinstance(v, ast.Subscript):  # buf3 = buf2[0]
            base = _arg_name(v)
            if base:
                b = self.b
                b.values[name] = b.value(base)
                b.dtypes[name] = b.g[b.values[name]].dtype
                b.alias.pop(name, None)

    def allocate(self, name: str, v: ast.Call):
        b = self.b
        dt = next((ast.unparse(a) for a in v.args if "torch." in ast.unparse(a)), "")
        for kw in v.keywords:
            if kw.arg == "dtype":
                dt = ast.unparse(kw.value)
        b.dtypes[name] = dtype_name(dt.removeprefix("torch."))
        if len(v.args) > 1:
            b.shapes[name] = _shape(*v.args[:2])
        b.values.pop(name, None)
        b.alias.pop(name, None)
        b.partial.discard(name)
        b.parts[name] = {}
        for other, base in list(b.alias.items()):  # a fresh buffer under an old name
            if base == name:
                del b.alias[other]

    def reinterpret(self, st, name: str, v: ast.Call):
        """`# reuse`: the storage (and content) passes to a new name; `# alias`: a view of part of it."""
        b = self.b
        base = _arg_name(v.args[0])
        root = b.alias.get(base, base)
        b.dtypes[name] = b.dtypes.get(base, "other")
        if len(v.args) > 2:
            b.shapes[name] = _shape(*v.args[1:3])
        b.alias[name] = root
        b.values.pop(name, None)
        if self.reused(st):
            b.parts[root] = {}
            b.partial.discard(name)
        else:
            b.partial.add(name)

    def rename(self, st, name: str, src: str):
        b = self.b
        if src not in b.values and src not in b.dtypes:
            return
        root = b.alias.get(src, src)
        b.dtypes[name] = b.dtypes.get(src, "other")
        if src in b.shapes:
            b.shapes[name] = b.shapes[src]
        b.alias[name] = root
        b.partial.discard(name)
        if src in b.partial:
            b.partial.add(name)
        b.values.pop(name, None)
        if self.reused(st):
            b.parts[root] = {}

    def call(self, call: ast.Call):
        fn = _call_name(call)
        kname = fn[:-4] if fn.endswith(".run") else fn
        if fn == "assert_size_stride" and len(call.args) > 2 and isinstance(call.args[0], ast.Name):
            self.b.args.add(call.args[0].id)
            self.b.shapes[call.args[0].id] = _shape(*call.args[1:3])
        elif kname in self.kernels:
            self.b.run_kernel(self.kernels[kname], [_arg_name(a) for a in call.args])
        elif _match_extern(fn):
            self.n_extern += 1
            self.b.extern(fn, call, _match_extern(fn))
        elif fn.startswith("torch.ops.") and not fn.startswith("torch.ops.inductor"):
            self.n_extern += 1
            self.b.extern(fn, call, (fn, f"opaque:{fn.split('.')[-2]}", 0, list(range(1, len(call.args)))))


def parse_output_code(path, graph: Graph | None = None, name: str | None = None) -> Graph:
    """Parse one inductor output-code file (wrapper + kernels) into a value graph (or append to `graph`)."""
    return _parse(path, graph, name)[0]


def _parse(path, graph: Graph | None = None, name: str | None = None) -> tuple[Graph, _Buffers]:
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise GraphParseError(f"{path}: cannot read ({e})") from e
    try:
        mod = ast.parse(text)
    except SyntaxError as e:
        raise GraphParseError(f"{source}: not Python source, so not inductor output code ({e.msg}, line {e.lineno})") from e
    kernels, call_fn, sums = _kernels_and_call(mod, source)
    g = graph if graph is not None else Graph(name or path.stem)
    g.meta.setdefault("files", []).append(source)
    g.meta.setdefault("float_sums", {}).update(sums)
    wrapper = _Wrapper(_Buffers(g, source), kernels, text.splitlines())
    for st in call_fn.body:
        wrapper.statement(st)
    if not wrapper.b.calls:
        raise GraphParseError(f"{source}: the call() function never runs any of the {len(kernels)} kernels it defines")
    g.meta["n_kernel_calls"] = g.meta.get("n_kernel_calls", 0) + sum(wrapper.b.calls.values())
    g.meta["n_extern_calls"] = g.meta.get("n_extern_calls", 0) + wrapper.n_extern
    return g, wrapper.b


# ---- piecewise compiles: vLLM splits the graph at attention, which runs between the compiled pieces ------------
def parse_pieces(paths, name: str = "compiled") -> Graph:
    """The output code of one piecewise compile, one file per piece in piece order, as one graph.

    Between two pieces one attention node stands for the attention vLLM runs there. Each piece's activation
    inputs are linked to the values the piece before returns, matched by (size, stride): vLLM passes q, k, v and
    the attention output buffer, which the previous piece allocates (empty or zero-filled, computed from no input)
    and attention fills in place, and the residual stream. An input that matches that fresh buffer reads the
    attention node; q, k and v (returned, not read by the next piece) are the attention node's inputs. An input
    that matches no returned value (positions, parameters) stays a graph input; one that matches several is
    left unlinked and named in meta["unlinked"]. Kernel names are qualified by their piece (`subgraph_1:triton_...`):
    every piece numbers its kernels from 0."""
    g = Graph(name)
    g.meta["piecewise"] = True
    prev = None  # (node offset in g, piece graph, its buffers)
    for k, path in enumerate(map(Path, paths)):
        piece, b = _parse(path, name=path.stem)
        m = re.search(r"subgraph_(\d+)", str(path))
        label = f"subgraph_{m.group(1)}" if m else f"piece{k}"
        links = _link_piece(g, prev, piece, b) if prev is not None else {}
        off = len(g.nodes)
        for n in piece.nodes:
            if n.id in links:
                src = g[links[n.id]]
                what = "the attention output" if src.op == "attention" else "a value the piece before returns"
                g.nodes.append(Node(n.id + off, "view", [src.id], src.dtype, kernel="link",
                                    text=f"{n.text} of {label}: {what}"))
            else:
                kernel = f"{label}:{n.kernel}" if n.kernel in piece.kernels else n.kernel
                g.nodes.append(dataclasses.replace(n, id=n.id + off, inputs=[i + off for i in n.inputs],
                                                   kernel=kernel))
        g.kernels.update({f"{label}:{kname}": info for kname, info in piece.kernels.items()})
        g.meta.setdefault("float_sums", {}).update({f"{label}:{k}": v for k, v in piece.meta.get("float_sums", {}).items()})
        for key in ("files", "unlinked"):
            g.meta.setdefault(key, []).extend(piece.meta.get(key, []))
        for key in ("n_kernel_calls", "n_extern_calls"):
            g.meta[key] = g.meta.get(key, 0) + piece.meta.get(key, 0)
        g.meta["outputs"] = [i + off for i in piece.meta.get("outputs", [])]
        prev = (off, piece, b)
    return g


def _link_piece(g: Graph, prev, piece: Graph, b: _Buffers) -> dict:
    """Add the attention node between the previous piece and `piece`; {input node of piece: node of g it reads}."""
    off, prev_piece, prev_b = prev
    outs = [(nid + off, shape) for nid, shape in prev_b.returned]
    fresh = {o for o, _ in outs if _computed_from_nothing(prev_piece, o - off, prev_b.args)}
    matches = {}  # input node -> (fresh candidates, other candidates)
    for n in piece.nodes:
        if n.op == "input" and n.text in b.args and "s" in b.shapes[n.text][0]:  # an activation: sized by tokens
            cands = [o for o, shape in outs if shape == b.shapes[n.text]]
            matches[n.id] = ([o for o in cands if o in fresh], [o for o in cands if o not in fresh])
    linked = {other[0] for fr, other in matches.values() if len(fr) != 1 and len(other) == 1}
    written = [fr[0] for fr, _ in matches.values() if len(fr) == 1]
    qkv = [o for o, _ in outs if o not in fresh and o not in linked]
    dtype = g[written[0]].dtype if written else "bf16"
    attention = g.add("attention", qkv or [off + len(prev_piece.nodes) - 1], dtype, rounds=dtype in BF16_DTYPES,
                      kernel="(outside the compiled pieces)", text="attention between compiled pieces")
    links = {}
    for nid, (fr, other) in matches.items():
        if len(fr) == 1:
            links[nid] = attention
        elif len(other) == 1:
            links[nid] = other[0]
        elif other:
            piece.meta.setdefault("unlinked", []).append(f"{piece.meta['files'][0]}: {piece[nid].text} matches "
                                                         f"{len(other)} values the previous piece returns")
    return links


def _computed_from_nothing(piece: Graph, nid: int, args: set) -> bool:
    """No graph input and no matmul behind the value: an allocation, empty or filled with a constant."""
    seen, stack = set(), [nid]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        n = piece[i]
        if n.op == "mm" or (n.op == "input" and n.text in args):
            return False
        stack.extend(n.inputs)
    return True
