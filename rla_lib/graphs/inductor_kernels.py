"""Inductor kernel bodies -> statements: C++ kernels `cpp_fused_*` (CPU) and Triton kernels `triton_*_fused_*` (GPU).

C++: `auto tmpN = ...;`, `.store(out_ptrK ...)`, `at::vec::convert<at::BFloat16,...>` = a rounding inside a
kernel, a store to an `at::BFloat16*` pointer = a rounding at the output. Triton: `tmpN = ...`, `tl.store`,
`.to(tl.bfloat16)`, pointer dtypes from `triton_meta['signature']`. Values inside a kernel that are never
converted or stored to BF16 stay FP32. No torch here: this reads text.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from .graph import GraphParseError

PTR_RE = re.compile(r"\b(in_out_ptr\d+|in_ptr\d+|out_ptr\d+)\b")
TMP_RE = re.compile(r"\btmp(?:_acc)?\d+\b")
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
    if rest.isdigit():  # triton_red_fused_1: a fused kernel that lists no source ops
        return []
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


@dataclasses.dataclass
class Kernel:
    """A parsed kernel body: parameters (name, dtype, is pointer) and statements to instantiate per call."""

    name: str
    lang: str  # "cpp" or "triton"
    params: list  # [(name, dtype, is_pointer)]
    stmts: list  # [("def", var, expr) | ("acc", acc, kind, var) | ("store", ptr, expr, index)]
    source_file: str = ""
    aliases: dict = dataclasses.field(default_factory=dict)  # pointer -> pointer it is (in-place kernels)

    @property
    def ops(self) -> list[str]:
        return kernel_name_ops(self.name)


# ==================================================================================================
# C++ kernels
# ==================================================================================================

def _ptr_dtype_cpp(ctype: str) -> str:
    c = ctype.replace("const", "").replace("*", "").strip()
    if "BFloat16" in c or c == "bfloat16":
        return "bf16"
    if c == "float":
        return "fp32"
    if "Half" in c:
        return "fp16"
    if c == "double":
        return "fp64"
    if "int" in c or c in ("bool", "long"):
        return "int"
    return "other"


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


def _split_top(expr: str):
    """Split at the lowest-precedence top-level binary operator (inductor prints them with spaces)."""
    for group in ((" + ", " - "), (" * ", " / ")):
        depth, last = 0, None
        for i, ch in enumerate(expr):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            elif depth == 0:
                for op in group:
                    if expr.startswith(op, i):
                        last = (i, op)
        if last:
            i, op = last
            return expr[:i], op.strip(), expr[i + len(op):]
    return None


_CPP_FUNCTIONS = (("exp", "exp"), ("cos", "cos"), ("sin", "sin"), ("tanh", "tanh"), ("log", "log"), ("sqrt", "sqrt"))


def _classify_cpp_call(e: str, tmps: list) -> str | None:
    """Op of a C++ expression that calls a math function, selects or compares; None for arithmetic."""
    if ".rsqrt()" in e or "std::rsqrt" in e or re.search(r"^1 / std::sqrt\(", e) or re.search(r"\(1\)\s*/\s*.*sqrt", e):
        return "rsqrt"
    if (".exp()" in e or "std::exp" in e) and ("neg()" in e or "-tmp" in e or "- tmp" in e) and "/" in e and len(set(tmps)) == 1:
        return "sigmoid"
    for fn, op in _CPP_FUNCTIONS:
        if f".{fn}()" in e or f"std::{fn}(" in e:
            return op
    if "blendv" in e or " ? " in e:
        return "where"
    if "max_propagate_nan" in e or "maximum(" in e or "std::max(" in e:
        return "max"
    if "min_propagate_nan" in e or "minimum(" in e or "std::min(" in e:
        return "min"
    return None


def classify_cpp(expr: str):
    """One C++ expression of an inductor kernel -> (op, tmp deps, ptr, index text)."""
    e = expr.strip()
    ptrs = PTR_RE.findall(e)
    tmps = TMP_RE.findall(e)
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
    op = _classify_cpp_call(e, tmps)
    if op:
        return op, tmps, None, None
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


def _reduction_kind(rhs: str) -> str:
    if "welford" in rhs.lower():
        return "welford"
    if "max_propagate_nan" in rhs or "maximum" in rhs:
        return "max"
    if "min_propagate_nan" in rhs or "minimum" in rhs:
        return "min"
    if " + " in rhs or "vec_reduce_all" in rhs or "sum_masked_reduce" in rhs:
        return "sum"
    if " * " in rhs:
        return "prod"
    return "acc"


def _cpp_statement(line: str, stmts: list, aliases: dict) -> bool:
    """Read one line of a C++ kernel body into `stmts`/`aliases`; False if it is none of the known forms."""
    pa = re.match(r"^auto\s+(in_ptr\d+|out_ptr\d+|in_out_ptr\d+)\s*=\s*(in_ptr\d+|out_ptr\d+|in_out_ptr\d+)\s*;$", line)
    if pa:  # in-place reuse: `auto in_ptr0 = in_out_ptr0;`
        aliases[pa.group(1)] = pa.group(2)
        return True
    d = re.match(r"^auto\s+(tmp\d+)\s*=\s*(.*);$", line)
    if d:
        stmts.append(("def", d.group(1), d.group(2)))
        return True
    a = re.match(r"^(tmp_acc\d+)(?:_vec)?(?:_arr\[[^\]]*\])?\s*=\s*(.*);$", line)
    if a:
        acc, rhs = a.group(1), a.group(2)
        deps = TMP_RE.findall(rhs)
        accs_in = [x for x in _ACC_RE.findall(rhs) if x != acc]
        if deps or accs_in:
            stmts.append(("acc", acc, _reduction_kind(rhs), deps[0] if deps else accs_in[0]))
        return True
    s = re.match(r"^(tmp\d+|tmp_acc\d+(?:_vec)?)\.store\(\s*(in_out_ptr\d+|out_ptr\d+)\s*\+(.*)\);$", line)
    if s:
        stmts.append(("store", s.group(2), s.group(1), re.sub(r"\s+", "", s.group(3))))
        return True
    s = re.match(r"^(in_out_ptr\d+|out_ptr\d+)\[(.*)\]\s*=\s*(.*);$", line)
    if s:
        stmts.append(("store", s.group(1), s.group(3), re.sub(r"\s+", "", s.group(2))))
        return True
    return False


def parse_cpp_kernel(name: str, code: str, source: str) -> Kernel:
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
    stmts, aliases = [], {}
    for raw in code[m.end():].splitlines():
        line = raw.strip()
        if not line or _cpp_statement(line, stmts, aliases):
            continue
        if re.search(r"\b(in_out_ptr|out_ptr)\d+\b", line) and ("=" in line or ".store" in line) and not _CPP_IGNORABLE.match(line):
            raise GraphParseError(f"{source}: kernel {name}: cannot read this store: {line[:160]!r}")
        if re.match(r"^tmp\d+\s*=", line):
            raise GraphParseError(f"{source}: kernel {name}: cannot read this assignment: {line[:160]!r}")
    if not any(s[0] == "store" for s in stmts):
        raise GraphParseError(f"{source}: kernel {name}: found no stores in its C++ code")
    return Kernel(name, "cpp", params, stmts, source, aliases)


# ==================================================================================================
# Triton kernels
# ==================================================================================================

def _ptr_dtype_triton(sig: str) -> str:
    s = sig.lstrip("*")
    return {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16", "fp64": "fp64"}.get(s, "int" if s.startswith(("i", "u")) else "other")


_TRITON_FUNCTIONS = {
    "rsqrt": "rsqrt", "sqrt": "sqrt", "sigmoid": "sigmoid", "exp": "exp", "cos": "cos", "sin": "sin", "tanh": "tanh",
    "log": "log", "where": "where", "maximum": "max", "minimum": "min", "sum": "sum", "max2": "max", "min2": "min",
    "broadcast_to": "broadcast", "full": "const", "abs": "abs", "promote_to_tensor": "broadcast",
    "welford_reduce": "welford", "welford": "welford"}
_TRITON_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}


def _tmp_names(n) -> list[str]:
    """tmpN values and _tmpN accumulators (looped reductions: `_tmp7 = tl.where(mask, _tmp7 + x, _tmp7)`)."""
    return [x.id for x in ast.walk(n) if isinstance(x, ast.Name) and re.fullmatch(r"_?tmp\d+", x.id)]


def _ptr_names(n) -> list[str]:
    return [x.id for x in ast.walk(n) if isinstance(x, ast.Name) and PTR_RE.fullmatch(x.id)]


def _triton_cast(node: ast.Call):
    """x.to(tl.float32) / x.to(tl.bfloat16): a rounding, an upcast, or a load read in another dtype."""
    target = ast.unparse(node.args[0]) if node.args else ""
    inner = node.func.value
    inner_op = triton_expr_op(inner)
    if "bfloat16" in target or "float16" in target:
        return ("round", [inner], None, None) if inner_op[0] != "load" else inner_op
    if re.search(r"\b(u?int\d+|int1)\b", target):  # x.to(tl.int64): an index, never a rounding
        return "cast_int", [inner], None, None
    if inner_op[0] == "load":
        return inner_op[0], inner_op[1], inner_op[2], inner_op[3], "upcast"
    return "upcast", _tmp_names(inner), None, None


def _triton_call(node: ast.Call, src: str):
    base = ast.unparse(node.func).rsplit(".", 1)[-1]
    if base == "load":
        p = _ptr_names(node.args[0])
        if not p:
            return f"unknown:{src[:60]}", _tmp_names(node), None, None
        return "load", _tmp_names(node.args[0]), p[0], re.sub(r"\s+", "", ast.unparse(node.args[0]))
    if base in _TRITON_FUNCTIONS:
        return _TRITON_FUNCTIONS[base], _tmp_names(node), None, None
    return f"unknown:{src[:60]}", _tmp_names(node), None, None


def triton_expr_op(node):
    """Classify one Triton kernel assignment's value (a Python AST expression) -> (op, deps, ptr, index[, upcast])."""
    src = ast.unparse(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to":
        return _triton_cast(node)
    if isinstance(node, ast.Call):
        return _triton_call(node, src)
    if isinstance(node, ast.BinOp) and type(node.op) in _TRITON_BINOPS:
        return _TRITON_BINOPS[type(node.op)], _tmp_names(node), None, None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return "neg", _tmp_names(node), None, None
    if isinstance(node, (ast.Compare, ast.BoolOp)) or isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert)):
        return "cmp", _tmp_names(node), None, None
    if isinstance(node, ast.Constant):
        return "const", [], None, None
    if isinstance(node, ast.Name):
        return ("copy", [node.id], None, None) if re.fullmatch(r"_?tmp\d+", node.id) else ("const", [], None, None)
    if isinstance(node, ast.Subscript):  # tl.sum(x, 1)[:, None]
        return triton_expr_op(node.value)
    return f"unknown:{src[:60]}", _tmp_names(node), None, None


def _triton_signature(fn: ast.FunctionDef, name: str, source: str) -> dict:
    sig = {}
    for dec in fn.decorator_list:
        for kw in getattr(dec, "keywords", []):
            if kw.arg == "triton_meta":
                try:
                    m = re.search(r"'signature':\s*(\{[^}]*\})", ast.unparse(kw.value))
                    sig = ast.literal_eval(m.group(1)) if m else {}
                except (ValueError, SyntaxError) as e:
                    raise GraphParseError(f"{source}: Triton kernel {name}: unreadable triton_meta signature ({e})") from e
    if not sig:
        raise GraphParseError(f"{source}: Triton kernel {name}: no pointer dtypes (triton_meta['signature']) found")
    return sig


def _triton_statements(body, stmts: list, name: str, source: str):
    for st in body:
        if isinstance(st, (ast.For, ast.While, ast.If, ast.With)):
            _triton_statements(st.body, stmts, name, source)
            _triton_statements(getattr(st, "orelse", []), stmts, name, source)
        elif isinstance(st, ast.Assign) and len(st.targets) == 1:
            tgt = st.targets[0]
            if isinstance(tgt, ast.Tuple):  # welford: tmp3, tmp4, tmp5 = ...
                for t in tgt.elts:
                    if isinstance(t, ast.Name) and re.fullmatch(r"tmp\d+(_mean|_m2|_weight)?", t.id):
                        stmts.append(("def", t.id.split("_")[0] if t.id.count("_") else t.id, st.value))
            elif isinstance(tgt, ast.Name) and re.fullmatch(r"_?tmp\d+", tgt.id):
                stmts.append(("def", tgt.id, st.value))
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and ast.unparse(st.value.func).endswith("store"):
            args = st.value.args
            p = _ptr_names(args[0])
            if not p or len(args) < 2:
                raise GraphParseError(f"{source}: Triton kernel {name}: cannot read store {ast.unparse(st)[:120]!r}")
            stmts.append(("store", p[0], args[1], re.sub(r"\s+", "", ast.unparse(args[0]))))


def parse_triton_kernel(name: str, code: str, source: str) -> Kernel:
    try:
        mod = ast.parse(code)
    except SyntaxError as e:
        raise GraphParseError(f"{source}: Triton kernel {name}: not valid Python ({e})") from e
    fn = next((n for n in mod.body if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        raise GraphParseError(f"{source}: Triton kernel {name}: no kernel function")
    sig = _triton_signature(fn, name, source)
    params = []
    for a in fn.args.args:
        s = sig.get(a.arg, "constexpr")
        params.append((a.arg, _ptr_dtype_triton(s) if s.startswith("*") else "int", s.startswith("*")))
    stmts = []
    _triton_statements(fn.body, stmts, name, source)
    if not any(s[0] == "store" for s in stmts):
        raise GraphParseError(f"{source}: Triton kernel {name}: found no tl.store")
    return Kernel(name, "triton", params, stmts, source)
