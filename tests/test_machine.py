"""rla_lib.machine: provenance, instruction-set caps, and the training side's BF16 matmul."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rla_lib import bf16_matmul, machine, memory
from rla_lib.align import REGIONS, align
from tiny_models import one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

BF16 = torch.bfloat16


def tiny_qwen3():
    return copy.deepcopy(tiny_model("qwen3"))  # the shared one must not be patched


def summation_bound(x, w, b):
    """A rigorous bound on |FP32 sum of the K products and the bias - exact| plus two roundings to BF16 (one of
    the result, one of the product before a bias is added in BF16): (K + 1) u sum|terms| + 2 * 2^-8 |result|."""
    terms = x.double().abs() @ w.double().abs().T + b.double().abs()
    exact = x.double() @ w.double().T + b.double()
    return (x.shape[1] + 1) * 2.0**-24 * terms + 2 * 2.0**-8 * (exact.abs() + terms * 2.0**-8), exact


# A differing output needs its FP32 sum within the accumulation error (about 1e-6 relative) of a BF16 rounding
# boundary (spacing 2^-8 relative): for random operands that is far below 1% of outputs.
MOST = 0.99


def operands(m=512, k=256, n=768, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(BF16), (torch.randn(n, k, generator=g) / 16).to(BF16), torch.randn(n, generator=g).to(BF16)


# ---- the BF16 GEMM at FP32 speed -------------------------------------------------------------------
def test_fp32_accumulate_linear_is_one_rounding_of_the_exact_products():
    x, w, b = operands()
    out = bf16_matmul.LinearFP32Accumulate.apply(x, w, b)
    bound, exact = summation_bound(x, w, b)  # BF16 products are exact in FP64; only the sum and rounding differ
    assert out.dtype == BF16
    assert ((out.double() - exact).abs() <= bound).all()
    assert (out == exact.to(BF16)).float().mean().item() > MOST


def test_fp32_accumulate_linear_matches_torch_bf16_gemm_up_to_summation_order():
    x, w, b = operands(seed=1)
    ours, torchs = bf16_matmul.LinearFP32Accumulate.apply(x, w, b), F.linear(x, w, b)
    # both sum FP32 products (torch may add the bias after rounding); orders differ, so a few outputs sit on
    # the other side of a rounding boundary
    bound, _ = summation_bound(x, w, b)
    assert ((ours.double() - torchs.double()).abs() <= 2 * bound).all()
    assert (ours == torchs).float().mean().item() > MOST


def test_fp32_accumulate_linear_gradients_are_the_fp32_products_rounded_once():
    x, w, b = operands(m=64, seed=2)
    x, w, b = x.requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    grad = torch.randn(64, w.shape[0], generator=torch.Generator().manual_seed(3)).to(BF16)
    bf16_matmul.LinearFP32Accumulate.apply(x, w, b).backward(grad)
    assert torch.equal(x.grad, (grad.float() @ w.detach().float()).to(BF16))
    assert torch.equal(w.grad, (grad.float().T @ x.detach().float()).to(BF16))
    assert torch.equal(b.grad, grad.float().sum(0).to(BF16))
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.linear(x2, w2, b2).backward(grad)  # torch's BF16 backward: the same math, another summation order
    for ours, torchs in [(x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)]:
        assert (ours == torchs).float().mean().item() > MOST


def test_fp32_accumulate_linear_rows_do_not_depend_on_the_batch():
    """A row's output (and its input gradient) has the same bits in any batch, as with torch's BF16 GEMM: scoring
    cut to a minibatch's rows or chunked over positions (rla_lib.exact_kl) must not move a bit."""
    x, w, b = operands(m=700, k=256, n=768, seed=4)
    grad = torch.randn(700, 768, generator=torch.Generator().manual_seed(5)).to(BF16)

    def forward_and_input_grad(rows):
        xs = x[rows].clone().requires_grad_()
        out = bf16_matmul.LinearFP32Accumulate.apply(xs, w, b)
        out.backward(grad[rows])
        return out.detach(), xs.grad

    whole = forward_and_input_grad(slice(None))
    for start, count in [(0, 1), (5, 3), (37, 17), (100, 64), (300, 65), (13, 250), (0, 699)]:
        part = forward_and_input_grad(slice(start, start + count))
        assert all(torch.equal(p, w_[start : start + count]) for p, w_ in zip(part, whole)), (start, count)
    batched = bf16_matmul.LinearFP32Accumulate.apply(x.view(7, 100, 256), w, b)  # leading dimensions are rows too
    assert torch.equal(batched.view(700, 768), whole[0])


@pytest.mark.parametrize("k, n", [(256, 16), (256, 64), (768, 256), (100, 300)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_at_every_place_in_a_row_block(k, n, threads):
    """MKL's row panels: a row at the end of a thread's share of a block can be summed in another order (AVX2,
    64-row blocks: rows 30, 31, 62, 63 with 16-64 outputs). A row block must hold whole panels on every thread."""
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(bf16_matmul.ROW_BLOCK + 1, k, generator=g), torch.randn(n, k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = bf16_matmul.rows_times(x[:1], w.T)
        moved = [place for place in range(bf16_matmul.ROW_BLOCK + 1)
                 if not torch.equal(bf16_matmul.rows_times(torch.cat([x[1 : 1 + place], x[:1]]), w.T)[-1:], alone)]
    finally:
        torch.set_num_threads(before)
    assert moved == []


@pytest.mark.parametrize("rows", [0, 1, 47, 48, 49, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_row_blocks_written_in_place_are_the_padded_blocks_products(rows, bias):
    """`rows_times` writes each block's product into its output: the bits of the padded blocks' products
    concatenated (how it computed them before, and so the FP32 control's committed histories)."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 256, generator=g), torch.randn(768, 256, generator=g), torch.randn(768, generator=g)
    b = b if bias else None
    padded = torch.nn.functional.pad(x, (0, 0, 0, -rows % bf16_matmul.ROW_BLOCK))
    blocks = padded.split(bf16_matmul.ROW_BLOCK) or [padded]
    expected = torch.cat([blk @ w.T if b is None else torch.addmm(b, blk, w.T) for blk in blocks])[:rows]
    assert torch.equal(bf16_matmul.rows_times(x, w.T, b), expected)


def test_the_fp32_control_multiplies_in_row_blocks_and_bf16_models_are_left_alone():
    model = tiny_qwen3().float().eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    bf16_matmul.use_fp32_row_blocks(model)
    with torch.no_grad():
        alone = model(input_ids=ids[1:2]).logits
        batched = model(input_ids=ids).logits
    assert torch.equal(alone[0], batched[1])
    bf16 = tiny_qwen3().to(BF16).eval()
    with torch.no_grad():
        before = bf16(input_ids=ids).logits
        bf16_matmul.use_fp32_row_blocks(bf16)  # BF16 inputs are not its job: torch's kernel, bitwise
        assert torch.equal(bf16(input_ids=ids).logits, before)


def test_fp32_accumulate_linear_backward_leaves_out_rows_without_gradient():
    """Padding rows get an all-zero gradient; the backward leaves them out. The result is exactly that of the live
    rows alone: their input gradients bit for bit, zeros for the rest, and the weight and bias gradients of the
    live rows' terms."""
    x, w, b = operands(m=300, k=256, n=768, seed=6)
    grad = torch.randn(300, 768, generator=torch.Generator().manual_seed(7)).to(BF16)
    dead = torch.zeros(300, dtype=torch.bool)
    dead[::3], dead[250:] = True, True  # scattered rows and a padded tail
    grad[dead] = 0

    def gradients(rows):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x[rows], w, b))
        bf16_matmul.LinearFP32Accumulate.apply(xs[None], ws, bs).backward(grad[rows][None])  # (1, rows, features)
        return xs.grad, ws.grad, bs.grad

    (gx, gw, gb), (lx, lw, lb) = gradients(slice(None)), gradients(~dead)
    assert torch.equal(gx[~dead], lx) and not gx[dead].any()
    assert torch.equal(gw, lw) and torch.equal(gb, lb)


def test_use_bf16_matmul_patches_every_linear_and_native_restores_torch_bitwise():
    model = tiny_qwen3().to(BF16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert bf16_matmul.use_bf16_matmul(model, "fp32") == "fp32"
        assert all(bf16_matmul.has_fp32_matmul(m) for m in linears)
        fast = model(input_ids=ids).logits
        assert bf16_matmul.use_bf16_matmul(model, "native") == "native"
        assert not any(bf16_matmul.has_fp32_matmul(m) for m in linears)
        assert torch.equal(model(input_ids=ids).logits, stock)
    assert (fast - stock).abs().max().item() < 0.1 * stock.abs().max().item()  # the same model, other summation order
    with pytest.raises(ValueError, match="native"):
        bf16_matmul.use_bf16_matmul(model, "bf16")


def test_fp32_matmul_leaves_fp32_models_bitwise_alone():
    model = tiny_qwen3().float().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        bf16_matmul.use_bf16_matmul(model, "fp32")
        assert torch.equal(model(input_ids=ids).logits, before)


def test_alignment_on_the_fp32_matmul_is_reversible_bitwise():
    model = tiny_qwen3().to(BF16).eval()
    bf16_matmul.use_bf16_matmul(model, "fp32")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        handle = align(model, REGIONS)
        aligned = model(input_ids=ids).logits
        handle.undo()
        assert torch.equal(model(input_ids=ids).logits, stock)
    assert not torch.equal(aligned, stock)  # alignment still acts on top of the kernel
    assert all(bf16_matmul.has_fp32_matmul(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_bf16_matmul_mode_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RLA_BF16_MATMUL", "fp32")
    assert machine.bf16_matmul_mode() == "fp32"
    monkeypatch.setenv("RLA_BF16_MATMUL", "native")
    assert machine.bf16_matmul_mode() == "native"
    monkeypatch.setenv("RLA_BF16_MATMUL", "auto")
    assert machine.bf16_matmul_mode() == ("native" if machine.native_bf16() else "fp32")
    monkeypatch.setenv("RLA_BF16_MATMUL", "fast")
    with pytest.raises(ValueError, match="auto, native, fp32"):
        machine.bf16_matmul_mode()


# ---- levels and caps ----------------------------------------------------------------------------------
def test_levels_resolve_and_refuse_clearly():
    supported = machine.isa_levels()
    assert machine.resolve_levels(None) == supported
    if supported:
        assert machine.resolve_levels(["native"]) == supported[:1]
    with pytest.raises(ValueError, match="cannot run"):
        machine.resolve_levels(["sse2"])


def test_a_capped_process_offers_only_the_levels_at_or_below_its_cap(monkeypatch):
    supported = machine.isa_levels()
    if "avx2" not in supported:
        pytest.skip("needs a CPU with AVX2")
    monkeypatch.setenv("RLA_CPU_ISA", "avx2")
    assert machine.isa_levels() == ["avx2"] and machine.resolve_levels(["native"]) == ["avx2"]
    if supported[0] != "avx2":
        with pytest.raises(ValueError, match="cannot run"):
            machine.resolve_levels([supported[0]])


def test_a_bad_cap_names_the_choices(monkeypatch):
    monkeypatch.setenv("RLA_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="avx512_bf16, avx512, avx2"):
        machine.isa_level()


def test_machine_records_what_bf16_numbers_depend_on():
    m = machine.machine()
    for key in ("cpu", "cpu_generation", "isa_flags", "isa_level", "cpu_capability", "bf16_matmul", "cpu_count",
                "cpu_threads", "torch", "onednn", "transformers", "vllm"):
        assert key in m
    assert set(m["isa_flags"]) <= set(machine.BF16_FLAGS)
    text = machine.describe(m)
    assert m["cpu"] in text and m["bf16_matmul"] in text and m["torch"] in text
    assert "?" in machine.describe({})  # an old sidecar without these fields still renders


@pytest.mark.skipif("avx2" not in machine.isa_levels(), reason="needs a CPU with AVX2 (every x86 machine of this kind)")
def test_a_capped_process_runs_the_avx2_kernels_vllm_and_torch_would_pick():
    code = ("import json, torch; from rla_lib import machine; "
            "print(json.dumps(dict(cap=torch.backends.cpu.get_cpu_capability(), avx512=torch.cpu._is_avx512_supported(), "
            "bf16=torch.cpu._is_avx512_bf16_supported(), level=machine.isa_level(), mode=machine.bf16_matmul_mode(), "
            "key=machine.machine_key())))")
    env = os.environ | machine.isa_environment("avx2")
    env.pop("RLA_BF16_MATMUL", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    capped = json.loads(out.stdout.strip().splitlines()[-1])
    assert capped == dict(cap="AVX2", avx512=False, bf16=False, level="avx2", mode="fp32", key=capped["key"])
    assert capped["key"] != machine.machine_key() or machine.isa_level() == "avx2"


def test_engines_side_by_side_get_cores_of_their_own_unless_a_binding_is_set(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {4, 6}, raising=False)
    assert [machine.engine_core_environment(slot) for slot in range(3)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "4"}, {"VLLM_CPU_OMP_THREADS_BIND": "6"}, {"VLLM_CPU_OMP_THREADS_BIND": "4"}]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert machine.engine_core_environment(0) == {}


ENGINE_LINEAR_CHECK = """
import json, torch
from rla_lib import bf16_matmul, machine
from rla_lib.engine_probes import vllm_linear
g = torch.Generator().manual_seed(0)
out = {}
# the embedded models' layers and the 0.6B shape's, at a scoring batch's row counts (see the docstring)
for m, k, n in [(512, 256, 768), (512, 768, 256), (600, 1024, 3072), (600, 3072, 1024)]:
    x, w, b = torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) / 16).bfloat16(), torch.randn(n, generator=g).bfloat16()
    name, engine = vllm_linear(w)
    ours = bf16_matmul.LinearFP32Accumulate.apply(x, w, None)
    fp32_library = bf16_matmul.rows_times(x.float(), w.float().T, None).bfloat16()
    out[f"{m}x{k}x{n}"] = dict(kernel=name, differing=int((ours != engine(x)).sum()), library_differing=int((fp32_library != engine(x)).sum()))
print(json.dumps(dict(level=machine.isa_level(), mode=machine.bf16_matmul_mode(), products=out)))
"""


@pytest.mark.engine
@pytest.mark.parametrize("level", ["avx512", "avx2"])
def test_the_training_forward_sums_as_the_engines_linear_at_levels_without_bf16_instructions(level):
    """Without BF16 instructions the training side multiplies as FP32 products rounded once, but its forward must sum in
    the order of the kernel vLLM runs there: oneDNN's `onednn_mm` in `_C_AVX512` (torch's own BF16 linear calls the same
    kernel), torch's dot-product loop in `_C_AVX2`. The FP32 library sums otherwise: without the dispatch, some outputs
    round differently (checked here, so the test can fail). Not held, so not tested: oneDNN's bits without BF16
    instructions depend on the row count in about one output for a few small row counts (1-3 rows at the embedded
    models' widths; also 17, 33, 37, 63, 65 at the 0.6B shape), for vLLM's kernel and torch's alike, each its own way:
    the engine's batch variance, which a training side scoring whole batches cannot follow (docs/guide.md)."""
    if level not in machine.isa_levels():
        pytest.skip(f"this CPU cannot run at {level}")
    env = os.environ | machine.isa_environment(level)
    env.pop("RLA_BF16_MATMUL", None)
    done = subprocess.run([sys.executable, "-c", ENGINE_LINEAR_CHECK], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["level"] == level and result["mode"] == "fp32"
    for shape, r in result["products"].items():
        assert r["differing"] == 0, (shape, r)
    if level == "avx512" or machine.isa_level() == "avx2":  # capped above AVX2, torch's linear may be oneDNN's (as MKL's order)
        assert sum(r["library_differing"] for r in result["products"].values()) > 0, result


FREED_MEMORY_PROBE = """
import json, os, torch
from rla_lib import memory
from rla_lib.memory import reuse_freed_memory, trim_freed_memory
size = 256 << 20
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def touch_and_free():
    x = torch.ones(size // 4)  # every page written
    del x
base = resident()
touch_and_free()
default = resident() - base
with reuse_freed_memory():
    touch_and_free()
    kept = resident() - base
    for _ in range(16):
        touch_and_free()
        trim_freed_memory(keep=0.5)
    after_steps = resident() - base
    heap = memory._glibc().mallinfo2().arena
left = resident() - base
print(json.dumps(dict(size=size, default=default, kept=kept, after_steps=after_steps, heap=heap, left=left)))
"""


@pytest.mark.skipif(memory._glibc() is None, reason="glibc 2.33 or later only")
def test_freed_memory_is_kept_for_reuse_inside_and_given_back_after():
    out = subprocess.run([sys.executable, "-c", FREED_MEMORY_PROBE], capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    small = r["size"] // 10  # the interpreter's own allocations meanwhile
    assert r["default"] < small  # glibc's default: a large block goes back to the system when it is freed
    assert r["kept"] > r["size"] - small  # inside: kept after it is freed ...
    # ... and 16 more allocations of the size leave the process larger by at most what the bound lets the heap grow
    # between trims and the blocks in flight (the live one, the one just freed), where each allocation would add its
    # own unbounded (glibc < 2.38 grows the heap for each aligned block)
    assert r["after_steps"] < (memory.HEAP_GROWTH - 1) * r["heap"] + 2 * r["size"] + small
    assert r["after_steps"] < 4 * r["size"]
    assert r["left"] < small  # after: given back


class FakeGlibc:
    """mallinfo2 and malloc_trim as `trim_freed_memory` reads them: a heap of `arena` bytes, `free` of them free."""

    def __init__(self):
        self.arena, self.free, self.trims = 0, 0, 0

    def mallinfo2(self):
        return memory._MallInfo2(arena=self.arena, fordblks=self.free, uordblks=self.arena - self.free)

    def malloc_trim(self, pad):
        self.trims += 1

    def mallopt(self, parameter, value):
        pass


def test_freed_memory_is_trimmed_at_first_and_then_only_where_the_heap_grew(monkeypatch):
    libc = FakeGlibc()
    monkeypatch.setattr(memory, "_glibc", lambda: libc)
    monkeypatch.setattr(memory, "_heap_base", None)
    libc.arena, libc.free = 8 << 30, 6 << 30  # a first step grew the heap, and freed three times what stays in use
    memory.trim_freed_memory(keep=0.5)
    assert libc.trims == 1
    libc.arena = int(libc.arena * (memory.HEAP_GROWTH - 0.05))  # later steps grew it a little, and found the rest kept
    for _ in range(3):
        memory.trim_freed_memory(keep=0.5)
    assert libc.trims == 1  # a trim would discard every kept page, and the next step fault them in again
    libc.arena = int((8 << 30) * (memory.HEAP_GROWTH + 0.05))  # grown past the bound (freed blocks that did not serve)
    memory.trim_freed_memory(keep=0.5)
    assert libc.trims == 2
    libc.arena, libc.free = libc.arena * 2, 1 << 30  # grown past it again, but what is kept is small next to what is used
    memory.trim_freed_memory(keep=0.5)
    assert libc.trims == 2
    with memory.reuse_freed_memory():  # a run that ends gives its heap back ...
        pass
    libc.free = libc.arena // 2
    memory.trim_freed_memory(keep=0.5)  # ... so the next run's first step trims and sets the bound afresh
    assert libc.trims == 3
