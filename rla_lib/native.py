"""The kernel-order loops of `vector_sums.square_sum`, `attention.vllm_cpu_attention` and torch's BF16 dot-product GEMM
(`machine.torch_bf16_linear`) in C (native_kernels.c), for speed: the torch-op versions take a Python loop of small
tensor ops per element of the sum (+400% on a forward+backward at 8 layers, `benchmarks/align_overhead.py`); torch's
own BF16 GEMM without BF16 instructions runs at a third of the FP32 library's rate. And the GRPO update's memory-bound
parts: torch's for-loop AdamW (`AdamW`) in one pass over memory instead of seven, and torch's 2-norm of BF16 gradients
(`bf16_norms`, the clip's) without FP32 copies of them. Same operations in the same order, so the same bits
(tests/test_native.py).

Compiled once per machine with the system C compiler into `.cache/native/` (about a second). Where there is none or
the build fails (a warning says so), or with `RLA_NATIVE=0`, `library()` is None and the callers run their torch-op
loops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .paths import ROOT
from .settings import setting

SOURCE = Path(__file__).with_name("native_kernels.c")
CACHE_DIR = ROOT / ".cache" / "native"
# No contraction of a·b + c into a fused multiply-add unless the source writes fmaf, no reassociation: the order the
# source spells is the order the bits come from. -march=native makes fmaf one instruction (else a libm call);
# no traps or errno (flags only, never values) lets floorf vectorise.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fno-math-errno",
         "-std=c11", "-shared", "-fPIC"]


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None: no C compiler or a failed build (with a warning saying so), or RLA_NATIVE=0."""
    if setting("RLA_NATIVE") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        warnings.warn("rla_lib.native: no C compiler (cc): the kernel-order sums run as loops of torch ops, the same "
                      "bits, several times slower. Install gcc (apt-get install gcc) for the fast path.", stacklevel=2)
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"kernels-{key}.so"
    if not path.exists():  # built under a name of its own, then renamed: test workers or threads may build at once
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.so")
        try:
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                           text=True)
            os.replace(tmp, path)
        except (OSError, subprocess.CalledProcessError) as error:
            warnings.warn(f"rla_lib.native: building {SOURCE.name} into {CACHE_DIR} failed, the torch-op loops run "
                          f"instead (same bits, slower):\n{getattr(error, 'stderr', None) or error}", stacklevel=2)
            return None
        finally:
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.square_sum.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.square_sum.restype = None
    lib.attention_spans.argtypes = [ptr, i64, i64, ptr]
    lib.attention_spans.restype = None
    lib.vllm_cpu_attention.argtypes = [ptr] * 7 + [i64] * 9 + [ctypes.c_float] + [ptr] * 3
    lib.vllm_cpu_attention.restype = ctypes.c_int
    lib.torch_dot_linear.argtypes = [ptr] * 4 + [i64] * 5 + [ptr]
    lib.pack_dot_operand.argtypes = [ptr] + [i64] * 5 + [ptr]
    lib.pack_dot_operand.restype = None
    lib.torch_dot_linear.restype = None
    lib.adamw_moments.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float] * 3
    lib.adamw_moments.restype = None
    lib.adamw_moments_bf16.argtypes = [ptr, ctypes.c_float, ptr, ptr] + [i64] * 2 + [ctypes.c_float] * 3
    lib.adamw_moments_bf16.restype = None
    lib.adamw_parameters.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float] * 4
    lib.adamw_parameters.restype = None
    lib.adamw_step.argtypes = [ptr, ctypes.c_int, ctypes.c_float] + [ptr] * 4 + [i64] * 2 + [ctypes.c_float] * 7 + [
        ptr, ctypes.c_longlong, ptr]
    lib.adamw_step.restype = None
    lib.bf16_norm.argtypes = [ptr] + [i64] * 3
    lib.bf16_norm.restype = ctypes.c_float
    return lib


# torch's mode for MKL's vector math (ATen/cpu/vml.h): VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
TORCH_VML_MODE = 0x2 | 0x140000 | 0x100


@functools.cache
def torch_sqrt_kernel() -> tuple[int, int] | None:
    """The addresses of MKL's vmsSqrt and MKL_Set_Num_Threads_Local in torch's library where torch.sqrt of FP32 tensors
    is that very vmsSqrt: checked bit for bit on every kind of value (zeros, subnormals, every exponent), cut into
    blocks at odd offsets as `adamw_step` cuts them. None elsewhere (a torch without MKL, another sqrt): AdamW then
    calls torch.sqrt itself."""
    try:
        mkl = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        vml_sqrt, threads_local = mkl.vmsSqrt, mkl.MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    vml_sqrt.argtypes, vml_sqrt.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong], None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32)
    x[:64] = 0.0
    ours = torch.empty_like(x)
    for begin in range(0, len(x), 2047):
        end = min(len(x), begin + 2047)
        vml_sqrt(end - begin, x[begin:].data_ptr(), ours[begin:].data_ptr(), TORCH_VML_MODE)
    if not torch.equal(ours.view(torch.int32), torch.sqrt(x).view(torch.int32)):
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (vml_sqrt, threads_local))


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="rla-native")


def _parallel(n: int, run, grain: int = 1) -> None:
    """run(begin, end) over [0, n) split across torch's thread count, at least `grain` items a thread (ctypes releases
    the GIL during the call)."""
    threads = max(1, min(torch.get_num_threads(), n // grain))
    if threads == 1:
        return run(0, n)
    bounds = [n * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(run, bounds[:-1], bounds[1:]))


def square_sum(x: torch.Tensor, registers: int, width: int) -> torch.Tensor:
    """`vector_sums.square_sum` of an FP32 tensor over its last dim, in C (one thread: a single pass over memory)."""
    rows = x.detach().float().contiguous().view(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    library().square_sum(rows.data_ptr(), rows.shape[0], rows.shape[1], registers, width, out.data_ptr())
    return out.view(x.shape[:-1])


DOT_MR, DOT_NR, DOT_STEP = 6, 16, 64  # native_kernels.c's output tile and step


def torch_dot_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ weight (N, K)ᵀ of BF16 tensors, summed as torch's BF16 GEMM without BF16 instructions sums them (its
    dot product per output, native_kernels.c): the FP32 result before rounding."""
    (rows, k), cols = x.shape, weight.shape[0]
    steps = k // DOT_STEP
    tiles, blocks = -(-rows // DOT_MR), -(-cols // DOT_NR)
    x, weight = x.detach().contiguous(), weight.detach().contiguous()
    xw = torch.empty(tiles * DOT_STEP * steps * DOT_MR)
    ww = torch.empty(blocks * DOT_STEP * steps * DOT_NR)
    for packed, a, tile, n in ((xw, x, DOT_MR, tiles), (ww, weight, DOT_NR, blocks)):
        _parallel(n, lambda begin, end, packed=packed, a=a, tile=tile: library().pack_dot_operand(
            a.view(torch.int16).data_ptr(), a.shape[0], k, tile, begin, end, packed.data_ptr()))
    pad = torch.nn.functional.pad  # the last K - 64·steps columns, as they are (few)
    x_tail = pad(x[:, steps * DOT_STEP :].float(), (0, 0, 0, tiles * DOT_MR - rows)).contiguous()
    w_tail = pad(weight[:, steps * DOT_STEP :].float(), (0, 0, 0, blocks * DOT_NR - cols)).T.contiguous()
    out = torch.empty(tiles * DOT_MR, blocks * DOT_NR, dtype=torch.float32)
    _parallel(tiles, lambda begin, end: library().torch_dot_linear(
        xw.data_ptr(), ww.data_ptr(), x_tail.data_ptr(), w_tail.data_ptr(), steps, k - steps * DOT_STEP,
        blocks * DOT_NR, DOT_MR * begin, DOT_MR * end, out.data_ptr()))
    return out[:rows, :cols]


VLLM_CPU_LOOPS = ("avx512", "avx2", "amx")  # the loops of vLLM-CPU's attention kernels (native_kernels.c)


def vllm_cpu_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attended: torch.Tensor, scale: float,
                       weights: bool = False, loops: str = "avx512", tiles: torch.Tensor | None = None):
    """`attention._vllm_cpu_forward`'s loops in C: FP32 q (B, H, T, D), the softmax `scale`, FP32 k/v (B, KV, S, D) (KV
    divides H), `attended` (B, 1|H, T, S) bool, `loops` the vLLM-CPU kernel's (`VLLM_CPU_LOOPS`), `tiles` (B, T) the KV
    tile size of each query row (`attention.kv_tiles`; 0 or None: all keys in one tile). Returns the FP32 output before
    rounding, each row's log-sum-exp (+inf where it attends to nothing) and, with `weights`, p/Σp (B, H, T, S) (else
    None: writing it costs as much as the rest; for rows over several tiles each tile's p is relative to its own max,
    not rescaled)."""
    batch, heads, length, dim = q.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    mask = attended.contiguous()  # bool: one byte, 0 or 1
    span = torch.empty(mask.shape[:-1] + (2,), dtype=torch.int64)
    library().attention_spans(mask.data_ptr(), mask.numel() // keys, keys, span.data_ptr())
    # the row sum's 16 lanes count from the sequence's first position (its first slot in the KV cache)
    start = span[..., 0].flatten(1).amin(1).contiguous()
    out = torch.empty(batch, heads, length, dim, dtype=torch.float32)
    logsumexp = torch.empty(batch, heads, length, dtype=torch.float32)
    p = torch.empty(batch, heads, length, keys, dtype=torch.float32) if weights else None
    tiles = None if tiles is None else tiles.to(torch.int64).expand(batch, length).contiguous()

    def run(begin, end):
        failed = library().vllm_cpu_attention(
            q.data_ptr(), key.data_ptr(), value.data_ptr(), mask.data_ptr(), span.data_ptr(), start.data_ptr(),
            None if tiles is None else tiles.data_ptr(), heads,
            kv_heads, mask.shape[1], length, keys, dim, begin, end, VLLM_CPU_LOOPS.index(loops), scale, out.data_ptr(),
            logsumexp.data_ptr(),
            None if p is None else p.data_ptr())
        if failed:
            raise MemoryError("rla_lib.native.vllm_cpu_attention: out of memory for its buffers")

    _parallel(batch * heads, run)
    return out, logsumexp, p


# (lanes, tail) orders of torch's FP32 2-norm (native_kernels.c's bf16_norm), the likeliest first: AVX2's 8 lanes (torch
# registers its norm kernel for AVX2 alone) with the tail as GCC compiles it, then other builds'
TAIL_ROUNDED, TAIL_FUSED, TAIL_FOURS = 0, 1, 2
NORM_ORDERS = [(8, TAIL_FOURS), (8, TAIL_ROUNDED), (8, TAIL_FUSED), (16, TAIL_FOURS), (16, TAIL_ROUNDED),
               (16, TAIL_FUSED)]


@functools.cache
def torch_norm_order() -> tuple[int, int] | None:
    """The (lanes, tail) order in which `bf16_norm` gives torch.linalg.vector_norm(x, 2, dtype=torch.float32) of BF16
    tensors bit for bit: probed on every length up to 80 and some longer, each with values of every magnitude and with
    tiny ones alone (squares that round: they tell the orders apart). None: no order matches (another torch build) or
    no compiled library."""
    lib = library()
    if lib is None:
        return None
    g = torch.Generator().manual_seed(0)
    probes = [(torch.randn(n, generator=g) * 10.0 ** torch.randint(low, high, (n,), generator=g).double()).bfloat16()
              for n in [*range(1, 81), 1021, 65_539] for low, high in ((-30, 4), (-24, -18), (-24, -18))]  # tiny twice
    torchs = [torch.linalg.vector_norm(x, 2, dtype=torch.float32).view(torch.int32).item() for x in probes]
    for lanes, tail in NORM_ORDERS:
        if all(torch.tensor(lib.bf16_norm(x.data_ptr(), x.numel(), lanes, tail)).view(torch.int32).item() == expected
               for x, expected in zip(probes, torchs)):
            return lanes, tail
    return None


def bf16_norms(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The FP32 2-norm of each BF16 tensor as torch.linalg.vector_norm(t, 2, dtype=torch.float32) gives it, without
    its FP32 copy of each tensor, the tensors spread across torch's thread count. None where this does not apply (a
    tensor that is not a contiguous BF16 CPU one, or `torch_norm_order` is None): call torch."""
    order = torch_norm_order()
    if order is None or not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous()
                                for t in tensors):
        return None
    norms = _pool(torch.get_num_threads()).map(lambda t: library().bf16_norm(t.data_ptr(), t.numel(), *order), tensors)
    return torch.tensor(list(norms), dtype=torch.float32)


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 decay: float, lerp_weight: float, beta2: float, one_minus_beta2: float, bias_correction2_sqrt: float,
                 eps: float, neg_step_size: float, grad_scale: float = 1.0, copy: torch.Tensor | None = None,
                 root: torch.Tensor | None = None) -> None:
    """One AdamW step of contiguous FP32 tensors in place, each element as torch's for-loop AdamW computes it
    (native_kernels.c): one pass over memory instead of seven, and no fresh tensors. The scalars are rounded to FP32, as
    torch's kernels round them. A BF16 `grad` is taken as its FP32 copy multiplied by `grad_scale` (FP32 gradients are
    taken as they are). `copy` (BF16, as large as `param`), if given, receives the new parameters rounded to nearest
    even, as `copy.copy_(param)` rounds them. Where torch's sqrt cannot be called from C (`torch_sqrt_kernel`), two
    passes around torch.sqrt, which writes into `root` (FP32, as large as `param`; fresh if None)."""
    lib, n, grain = library(), param.numel(), 1 << 18  # below a grain, a thread costs more than it saves
    scalars, sqrt_kernel = (lerp_weight, beta2, one_minus_beta2), torch_sqrt_kernel()
    if sqrt_kernel is not None:
        vml_sqrt, mkl_threads_local = sqrt_kernel
        _parallel(n, lambda begin, end: lib.adamw_step(
            grad.data_ptr(), grad.dtype == torch.bfloat16, grad_scale, param.data_ptr(), exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(), None if copy is None else copy.data_ptr(), begin, end, *scalars, decay,
            bias_correction2_sqrt, eps, neg_step_size, vml_sqrt, TORCH_VML_MODE, mkl_threads_local), grain)
        return
    if grad.dtype == torch.bfloat16:  # a BF16 gradient times `grad_scale`, as if copied to FP32 and clipped first
        _parallel(n, lambda begin, end: lib.adamw_moments_bf16(grad.data_ptr(), grad_scale, exp_avg.data_ptr(),
                                                               exp_avg_sq.data_ptr(), begin, end, *scalars), grain)
    else:
        _parallel(n, lambda begin, end: lib.adamw_moments(grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                                          begin, end, *scalars), grain)
    root = torch.sqrt(exp_avg_sq, out=root if root is not None else torch.empty_like(exp_avg_sq))
    _parallel(n, lambda begin, end: lib.adamw_parameters(param.data_ptr(), exp_avg.data_ptr(), root.data_ptr(), begin,
                                                         end, decay, bias_correction2_sqrt, eps, neg_step_size), grain)
    if copy is not None:
        copy.copy_(param)


class AdamW(torch.optim.AdamW):
    """torch's AdamW with its for-loop implementation's bits (the default here: foreach=False), each tensor's step in
    `adamw_update`'s passes; twice as fast where optimizer state is large (a 0.6B model's takes seconds per step,
    benchmarks/adamw_step.py). The state is torch's (checkpoints load either way). Without the compiled library, or
    with options it does not cover (amsgrad, maximize, a parameter that is not a contiguous FP32 CPU tensor), torch's
    own step runs."""

    def __init__(self, params, **options):
        super().__init__(params, foreach=False, **options)
        self._root = torch.empty(0)  # torch.sqrt's output where it runs between passes, reused: no fresh memory

    def _covered(self) -> bool:
        unsupported = ("amsgrad", "maximize", "capturable", "differentiable", "fused")
        groups_covered = all(g["decoupled_weight_decay"] and not isinstance(g["lr"], torch.Tensor) and
                             not any(g[option] for option in unsupported) for g in self.param_groups)
        return library() is not None and groups_covered and all(
            p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() and
            (p.grad is None or (p.grad.dtype == torch.float32 and p.grad.is_contiguous() and not p.grad.is_sparse))
            for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not self._covered():
            return super().step(closure)
        self._step([p.grad for g in self.param_groups for p in g["params"]])

    @torch.no_grad()
    def step_with_grads(self, grads: list[torch.Tensor | None], grad_scale: torch.Tensor,
                        copies: list[torch.Tensor] | None = None) -> None:
        """A step with `grads` (one per parameter in the groups' order, None: none) in place of `.grad`, each first
        multiplied by `grad_scale` (an FP32 scalar tensor: the gradient-norm clip's coefficient). The bits of
        `p.grad = g.float()`, `p.grad.mul_(grad_scale)` and `step()`, without FP32 gradients: BF16 gradients (a mixed-
        precision model's) are read once, in the step's pass. `.grad` is left as it was. `copies` (one BF16 tensor per
        parameter: a mixed-precision model's compute copy) then hold the parameters rounded, as `copy_` rounds them,
        written in the same pass."""
        params = [p for g in self.param_groups for p in g["params"]]
        for name, given in (("gradient (or None)", grads), ("copy", copies)):
            if given is not None and len(given) != len(params):
                raise ValueError(f"step_with_grads needs one {name} per parameter: {len(params)}, got {len(given)}")
        native = self._covered() and all(g is None or (g.device.type == "cpu" and g.dtype == torch.bfloat16 and
                                                       g.is_contiguous() and g.shape == p.shape)
                                         for p, g in zip(params, grads))
        native_copies = copies is None or all(c.device.type == "cpu" and c.dtype == torch.bfloat16 and
                                              c.is_contiguous() and c.shape == p.shape for p, c in zip(params, copies))
        if not native:  # the torch ops it stands for
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.float().mul_(grad_scale)
            self.step()
        else:
            self._step(grads, float(grad_scale), copies if native_copies else None)
        if copies is not None and not (native and native_copies):
            torch._foreach_copy_(copies, params)

    def _step(self, grads: list[torch.Tensor | None], grad_scale: float = 1.0,
              copies: list[torch.Tensor] | None = None) -> None:
        """`adamw_update` of each parameter with its gradient in `grads` (the groups' order; None: skipped) and, if
        given, its BF16 copy in `copies`."""
        grads, copies = iter(grads), iter(copies or [])
        for group, p in ((group, p) for group in self.param_groups for p in group["params"]):
            grad, copy = next(grads), next(copies, None)
            if grad is None:
                if copy is not None:
                    copy.copy_(p)
                continue
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            state = self.state[p]
            if not state:  # as torch's _init_group makes it
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = state["step"].item()
            if torch_sqrt_kernel() is None and self._root.numel() < p.numel():
                self._root = torch.empty(max(p.numel() for g in self.param_groups for p in g["params"]))
            adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], copy=copy,
                         root=self._root[: p.numel()].view(p.shape) if self._root.numel() else None,
                         decay=1 - lr * weight_decay if weight_decay != 0 else 1.0, lerp_weight=1 - beta1,
                         beta2=beta2, one_minus_beta2=1 - beta2, bias_correction2_sqrt=(1 - beta2**step) ** 0.5,
                         eps=eps, neg_step_size=-(lr / (1 - beta1**step)), grad_scale=grad_scale)
