"""Finding one decoder region in a value graph and reading its rounding points: one detector per region.

The structure comes from the values alone: rsqrt = a norm, its input a sum of projection outputs = residual
norm, its input a projection = Q/K norm; products with a table gathered by position or with cos/sin = RoPE;
x·sigmoid(x)·up = SwiGLU; matmul and attention nodes as anchors.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from .graph import BF16_DTYPES, Graph, Node
from .points import FINAL, Held, combine, held, is_mixed, split

# ops a value passes through unchanged (exact): "is it rounded between producer and consumer" walks them
WALK_OPS = {"view", "upcast", "copy", "load", "store", "join", "broadcast", "round", "neg", "cat", "where"}
_BACK_STEPS, _FORWARD_STEPS = 200, 400


class Walker:
    """Follows values through exact ops (WALK_OPS) to their producers or consumers, noting any BF16 on the way."""

    def __init__(self, g: Graph):
        self.g = g
        self.users = g.users()

    @staticmethod
    def is_bf16(n: Node) -> bool:
        return n.dtype in BF16_DTYPES or n.op == "round"

    def back(self, nid, walk=WALK_OPS):
        """Sources of the value read at `nid`: [(source node id, rounded to BF16 on the way or at the source)]."""
        out, seen = [], set()
        stack = [(nid, False)]
        while stack and len(seen) < _BACK_STEPS:
            i, flag = stack.pop()
            if (i, flag) in seen:
                continue
            seen.add((i, flag))
            n = self.g[i]
            f = flag or self.is_bf16(n)
            if n.op in walk and n.inputs:
                ins = [x for x in n.inputs if self.g[x].dtype != "int"] if n.op in ("where", "cat", "join") else n.inputs[:1]
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

    def fwd(self, nid):
        """Consumers of the value of `nid`: [(consumer node id, rounded to BF16 on the way, at nid included)]."""
        out, seen = [], set()
        stack = [(nid, self.is_bf16(self.g[nid]))]
        while stack and len(seen) < _FORWARD_STEPS:
            i, flag = stack.pop()
            for u in self.users.get(i, []):
                if (u, flag) in seen:
                    continue
                seen.add((u, flag))
                un = self.g[u]
                if un.op in WALK_OPS:
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


class Reading:
    """The points read so far from one graph: values, the kernels computing them, node labels, layer bounds."""

    def __init__(self, g: Graph):
        self.g, self.nodes, self.w = g, g.nodes, Walker(g)
        self.values, self.where, self.labels = {}, {}, {}
        self.bounds: list[int] = []  # the first node of each layer (its input norm's rsqrt)

    def put(self, layer, key, value, node_ids=()):
        """Record a reading; a second, different reading of the same point makes it mixed."""
        kernels = {self.nodes[i].kernel for i in node_ids} - {None, "", "input", "partial"}
        old = self.values.get((layer, key))
        if old is not None and old != value:
            value = old if is_mixed(old) else combine([old, value])
        self.values[(layer, key)] = value
        self.where[(layer, key)] = sorted(set(self.where.get((layer, key), [])) | kernels)
        for i in node_ids:
            self.labels.setdefault(i, (layer, key))

    def layer_of(self, nid) -> int:
        lay = 0
        for i, b in enumerate(self.bounds):
            if nid >= b:
                lay = i
        return lay


# ---- norms: rsqrt -> normalize (x·rsqrt) -> ·weight -------------------------------------------------------
@dataclasses.dataclass
class Norm:
    rsqrt: int
    normalize: list  # x·rsqrt
    weight_mul: list = dataclasses.field(default_factory=list)  # ·weight
    normalized_flags: list = dataclasses.field(default_factory=list)  # x·rsqrt rounded where ·weight reads it
    x_src: int | None = None  # the value normalised
    x_flag: bool = False  # rounded where the norm reads it
    layer: int | str | None = None
    prefix: str = ""  # input_norm, post_norm or final_norm (residual norms)

    @property
    def outputs(self) -> list:
        return self.weight_mul or self.normalize

    def is_qk(self, nodes) -> bool:
        return nodes[self.x_src].op == "mm"


def find_norms(r: Reading) -> list[Norm]:
    nodes, w = r.nodes, r.w
    norms = []
    for rs in (n for n in nodes if n.op == "rsqrt"):
        norm = Norm(rs.id, [u for u, _ in w.fwd(rs.id) if nodes[u].op == "mul"])
        if not norm.normalize:
            continue
        for nz in norm.normalize:
            others = [i for i in nodes[nz].inputs if not w.ancestors_have(i, lambda n: n.id == rs.id, depth=4)]
            if others:
                norm.x_src, norm.x_flag = w.source(others[0])
            for u, flag in w.fwd(nz):
                if nodes[u].op == "mul" and _is_weight_mul(r, u, nz):
                    norm.weight_mul.append(u)
                    norm.normalized_flags.append(flag)
        if norm.x_src is not None:
            norms.append(norm)
    return norms


def _is_weight_mul(r: Reading, u: int, nz: int) -> bool:
    """x·rsqrt multiplied by a parameter."""
    other = [i for i in r.nodes[u].inputs if not r.w.ancestors_have(i, lambda n: n.id == nz, depth=6)]
    return bool(other) and all(r.nodes[r.w.source(o)[0]].op in ("input",) for o in other if r.w.source(o)[0] is not None)


def _normalized(norm: Norm) -> Held:
    return held(any(norm.normalized_flags)) if norm.normalized_flags else Held.NA


def _norm_output(r: Reading, norm: Norm) -> Held:
    """Rounded where the next op reads the norm output (weight-mul output, or normalize if no weight)."""
    flags = [f for o in norm.outputs for _, f in r.w.fwd(o)]
    return held(any(flags)) if flags else Held.UNREAD


def is_opaque(n: Node) -> bool:
    """An engine op whose inside this graph does not show (e.g. vLLM's fused MoE)."""
    return n.op.startswith("opaque:")


def _is_branch_output(r: Reading, nid) -> bool:
    """What a sublayer adds to the residual stream: a projection, an opaque engine op (fused MoE), or a sum of
    opaque outputs (shared + routed experts, returned as a tuple and added by the graph)."""
    n = r.nodes[nid]
    if n.op == "mm" or is_opaque(n):
        return True
    srcs = [r.w.source(i)[0] for i in n.inputs] if n.op == "add" else []
    return len(srcs) == 2 and all(x is not None and is_opaque(r.nodes[x]) for x in srcs)


def _read_sum(r: Reading, norm: Norm, layer, prefix: str, first: bool):
    """The residual sum the norm reads, and the residual stream the add reads (carried to the next add)."""
    nodes, xs = r.nodes, r.nodes[norm.x_src]
    if xs.op == "add":
        r.put(layer, f"{prefix}.sum", held(norm.x_flag), [xs.id])
        parts = [r.w.source(i) for i in xs.inputs]
        branch = [s is not None and _is_branch_output(r, s) for s, _ in parts]
        res = [(s, f) for (s, f), b in zip(parts, branch) if s is not None and not b and nodes[s].op != "const"]
        if any(branch) and res:
            s, f = res[0]
            r.put(layer, f"{prefix}.carried", Held.NA if nodes[s].op in ("index", "embedding", "input") else held(f), [s])
        else:
            r.put(layer, f"{prefix}.carried", Held.UNREAD, [xs.id])
    elif first and xs.op in ("index", "embedding", "input", "load"):
        r.put(layer, f"{prefix}.sum", Held.NA, [xs.id])
        r.put(layer, f"{prefix}.carried", Held.NA, [])
    else:
        r.put(layer, f"{prefix}.sum", Held.UNREAD, [xs.id])
        r.put(layer, f"{prefix}.carried", Held.UNREAD, [])


def read_residual_norms(r: Reading, residual: list[Norm]):
    """2L+1 residual norms: input and post-attention norm of each layer, then the final norm."""
    n_layers = (len(residual) - 1) // 2
    for k, norm in enumerate(residual):
        if k == 2 * n_layers:
            layer, prefix = FINAL, "final_norm"
        else:
            layer, prefix = k // 2, ("input_norm" if k % 2 == 0 else "post_norm")
        _read_sum(r, norm, layer, prefix, first=(k == 0))
        r.put(layer, f"{prefix}.normalized", _normalized(norm), norm.normalize)
        r.put(layer, f"{prefix}.output", _norm_output(r, norm), norm.outputs)
        norm.layer, norm.prefix = layer, prefix


def read_qk_norms(r: Reading, qk: list[Norm]):
    for norm in qk:
        r.put(r.layer_of(norm.rsqrt), "qk_norm.normalized", _normalized(norm), norm.normalize)


# ---- an MLP inside one opaque op (vLLM's fused MoE) --------------------------------------------------------
MLP_POINTS = ("gate_up_proj.output", "swiglu.silu", "swiglu.output", "down_proj.output")


def read_opaque_mlps(r: Reading, residual: list[Norm]) -> dict:
    """A post-attention norm output read by an opaque engine op: that layer's MLP points are opaque, not guessed.
    Returns {layer: the op's node}."""
    found = {}
    for norm in (n for n in residual if n.prefix == "post_norm"):
        ops = sorted({u for o in norm.outputs for u, _ in r.w.fwd(o) if is_opaque(r.nodes[u])})
        if ops:
            found[norm.layer] = ops[0]
            for key in MLP_POINTS:
                r.put(norm.layer, key, Held.OPAQUE, [ops[0]])
    return found


# ---- RoPE -----------------------------------------------------------------------------------------------
def _is_const(nodes, nid) -> bool:
    n = nodes[nid]
    return n.op == "const" or (n.op in ("broadcast", "copy", "upcast", "view") and n.inputs and _is_const(nodes, n.inputs[0]))


def _trig_kind(r: Reading, nid, depth=4):
    """'cos'/'sin' (computed), 'table' (gathered by position from a parameter table), or None."""
    n = r.nodes[nid]
    if n.op in ("cos", "sin"):
        return n.op
    if n.op == "index":
        table = r.w.source(n.inputs[0])[0]
        ok = table is not None and r.nodes[table].op == "input" and r.nodes[table].dtype != "int"
        return "table" if ok else None
    if depth and n.op in ("mul", "round", "view", "upcast", "copy", "broadcast", "cat", "load", "store") and n.inputs:
        tensor_ins = [i for i in n.inputs if not _is_const(r.nodes, i)]
        if n.op == "cat":
            kinds = {_trig_kind(r, i, depth - 1) for i in tensor_ins}
            return kinds.pop() if len(kinds) == 1 else None
        if len(tensor_ins) == 1:
            return _trig_kind(r, tensor_ins[0], depth - 1)
    return None


def _rope_products(r: Reading) -> dict:
    """Products of a projected value with cos/sin: node -> (q input, cos/sin input, cos/sin source, its rounding)."""
    w, products = r.w, {}
    for n in r.nodes:
        if n.op != "mul" or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        sa, fa = w.source(a)
        sb, fb = w.source(b)
        if sb is not None and _trig_kind(r, sb) and sa is not None and not _trig_kind(r, sa) and _has_mm(r, a):
            products[n.id] = (a, b, sb, fb)
        elif sa is not None and _trig_kind(r, sa) and sb is not None and not _trig_kind(r, sb) and _has_mm(r, b):
            products[n.id] = (b, a, sa, fa)
    return products


def _has_mm(r: Reading, nid) -> bool:
    return r.w.ancestors_have(nid, lambda n: n.op == "mm", depth=24)


def read_rope(r: Reading, qk_outputs: set):
    """q·cos ± rotate(q)·sin: the products, cos/sin as they read it, the output; the Q/K norm output as RoPE reads it."""
    w, products = r.w, _rope_products(r)
    qk_reads = defaultdict(list)  # layer -> [(cos/sin kind, rounded, q source)]
    for n in r.nodes:
        if n.op not in ("add", "sub") or len(n.inputs) != 2:
            continue
        srcs = [w.source(i) for i in n.inputs]
        if not all(s is not None and s in products for s, _ in srcs):
            continue
        lay = r.layer_of(n.id)
        r.put(lay, "rope.products", held(any(f for _, f in srcs)), [s for s, _ in srcs])
        for m, _ in srcs:
            q, _, csrc, cflag = products[m]
            r.put(lay, "rope.cos_sin", held(cflag), [csrc])
            if any(s in qk_outputs for s, _ in w.back(q)):
                rounded = any(f for s, f in w.back(q) if s in qk_outputs)
                qk_reads[lay].append((_trig_kind(r, csrc), rounded, w.source(q)[0]))
        outs = [f for _, f in w.fwd(n.id)]
        r.put(lay, "rope.output", held(any(outs)) if outs else Held.UNREAD, [n.id])
    for lay, reads in qk_reads.items():
        flags = {f for _, f, _ in reads}
        if len(flags) == 1:
            r.put(lay, "qk_norm.output", held(flags.pop()), [q for _, _, q in reads])
        else:  # e.g. torch.compile of Transformers: q·cos reads FP32, rotate_half(q) was stored in BF16
            value = split((held(f), k if k in ("cos", "sin") else "cos/sin") for k, f, _ in reads)
            r.put(lay, "qk_norm.output", value, [q for _, _, q in reads])


def read_rotary_kernels(r: Reading, qk_outputs: set):
    """Opaque rotary kernels (eager vLLM's C++ rotary_embedding): inputs read, internals from a bitwise probe."""
    nodes, w = r.nodes, r.w
    probe = r.g.meta.get("probes", {}).get("rotary_embedding")
    for n in nodes:
        if not (n.op.startswith("opaque:") and "rotary" in n.op):
            continue
        lay = r.layer_of(n.id)
        ins = [w.source(i) for i in n.inputs]
        tables = [(s, f) for s, f in ins if s is not None and nodes[s].op == "input" and nodes[s].dtype != "int"]
        acts = [(s, f) for s, f in ins if s is not None and (s, f) not in tables and nodes[s].dtype != "int"]
        if tables:
            r.put(lay, "rope.cos_sin", held(any(f for _, f in tables)), [tables[0][0]])
        for s, f in acts:
            if s in qk_outputs:
                r.put(lay, "qk_norm.output", held(f), [s])
        if probe and probe.get("best"):
            r.put(lay, "rope.products", Held.FP32 if probe["best"] == "fp32_round_once" else Held.BF16, [n.id])
        else:
            r.put(lay, "rope.products", Held.OPAQUE, [n.id])
        r.put(lay, "rope.output", held(n.dtype in BF16_DTYPES), [n.id])


# ---- SwiGLU ---------------------------------------------------------------------------------------------
def _sigmoid_like(r: Reading, nid) -> bool:
    n = r.nodes[nid]
    if n.op == "sigmoid":
        return True
    if n.op == "div" and len(n.inputs) == 2:  # 1 / (1 + exp(-x))
        return r.w.ancestors_have(n.inputs[1], lambda m: m.op == "exp", depth=3)
    if n.op == "recip":
        return r.w.ancestors_have(n.inputs[0], lambda m: m.op == "exp", depth=3)
    return False


def _is_silu(r: Reading, n: Node) -> bool:
    w = r.w
    if n.op == "silu":
        return True
    if n.op == "mul" and len(n.inputs) == 2:
        return any(_sigmoid_like(r, w.source(i)[0]) for i in n.inputs if w.source(i)[0] is not None)
    return (n.op == "div" and len(n.inputs) == 2  # x / (1 + exp(-x)) = silu(x)
            and w.ancestors_have(n.inputs[1], lambda m: m.op == "exp", depth=3)
            and w.ancestors_have(n.inputs[1], lambda m: m.op == "neg", depth=4)
            and r.nodes[w.source(n.inputs[0])[0]].op != "const")


def read_swiglu(r: Reading) -> dict:
    """silu(gate)·up: silu as the product reads it, the product as down_proj reads it. Returns product -> layer."""
    products = {}
    for s in (n.id for n in r.nodes if _is_silu(r, n)):
        lay = r.layer_of(s)
        for u, flag in r.w.fwd(s):
            if r.nodes[u].op == "mul":
                r.put(lay, "swiglu.silu", held(flag), [s])
                outs = [f for _, f in r.w.fwd(u)]
                r.put(lay, "swiglu.output", held(any(outs)) if outs else Held.UNREAD, [u])
                products[u] = lay
    return products


# ---- attention and projections --------------------------------------------------------------------------
def read_attention(r: Reading) -> list[int]:
    attentions = [n.id for n in r.nodes if n.op == "attention"]
    for a in attentions:
        r.put(r.layer_of(a), "attention.output", held(r.nodes[a].dtype in BF16_DTYPES), [a])
    return attentions


_NORM_READERS = {"input_norm": "qkv_proj", "post_norm": "gate_up_proj", "final_norm": "lm_head"}


def read_projections(r: Reading, residual: list[Norm], attentions: list[int], swiglu_products: dict,
                     opaque_mlps: dict):
    """Each matmul's role from what it reads (a norm output, attention, the SwiGLU product), its output rounding.
    In a layer whose MLP is opaque, a matmul reading the post-attention norm is the MoE router, not gate/up."""
    roles = {}
    for norm in residual:
        for o in norm.outputs:
            roles[o] = (_NORM_READERS[norm.prefix], norm.layer)
    for a in attentions:
        roles[a] = ("o_proj", r.layer_of(a))
    for p, lay in swiglu_products.items():
        roles[p] = ("down_proj", lay)
    final_rsqrt = residual[-1].rsqrt
    for n in r.nodes:
        if n.op != "mm":
            continue
        role = next((roles[s] for s in (r.w.source(i)[0] for i in n.inputs) if s in roles), None)
        if role is None and n.id > final_rsqrt:
            role = ("lm_head", FINAL)
        if role is not None and not (role[0] == "gate_up_proj" and role[1] in opaque_mlps):
            name, lay = role
            # FP32 products rounded once before any reader (the training side's BF16 linear without BF16
            # instructions, `bf16_matmul`) is a BF16 projection output, as a BF16 GEMM's
            readers = r.w.fwd(n.id)
            rounded = n.dtype in BF16_DTYPES or bool(readers) and all(flag for _, flag in readers)
            r.put(FINAL if name == "lm_head" else lay, f"{name}.output", held(rounded), [n.id])
