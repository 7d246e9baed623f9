"""The training side's kernel-order loops outside the aligned layer, in C (native_kernels.c), for speed: torch's BF16
dot-product GEMM without BF16 instructions (`bf16_matmul.torch_bf16_linear`), which torch runs at a third of the FP32
library's rate; and the GRPO update's memory-bound parts: torch's for-loop AdamW (`AdamW`) in one pass over memory
instead of seven, and torch's 2-norm of BF16 gradients (`bf16_norms`, the clip's) without FP32 copies of them. Same
operations in the same order, so the same bits (tests/test_native.py).

Built as the aligned layer's kernels are (`rla_lib.align.native.build`: once per machine, None without a C compiler or
with `RLA_NATIVE=0`, and the callers then run torch's own ops).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .align.native import build, parallel, pool

SOURCE = Path(__file__).with_name("native_kernels.c")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (`rla_lib.align.native.build`)."""
    lib = build(SOURCE, SOURCE.parent)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
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
        parallel(n, lambda begin, end, packed=packed, a=a, tile=tile: library().pack_dot_operand(
            a.view(torch.int16).data_ptr(), a.shape[0], k, tile, begin, end, packed.data_ptr()))
    pad = torch.nn.functional.pad  # the last K - 64·steps columns, as they are (few)
    x_tail = pad(x[:, steps * DOT_STEP :].float(), (0, 0, 0, tiles * DOT_MR - rows)).contiguous()
    w_tail = pad(weight[:, steps * DOT_STEP :].float(), (0, 0, 0, blocks * DOT_NR - cols)).T.contiguous()
    out = torch.empty(tiles * DOT_MR, blocks * DOT_NR, dtype=torch.float32)
    parallel(tiles, lambda begin, end: library().torch_dot_linear(
        xw.data_ptr(), ww.data_ptr(), x_tail.data_ptr(), w_tail.data_ptr(), steps, k - steps * DOT_STEP,
        blocks * DOT_NR, DOT_MR * begin, DOT_MR * end, out.data_ptr()))
    return out[:rows, :cols]



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
    norms = pool(torch.get_num_threads()).map(lambda t: library().bf16_norm(t.data_ptr(), t.numel(), *order), tensors)
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
        parallel(n, lambda begin, end: lib.adamw_step(
            grad.data_ptr(), grad.dtype == torch.bfloat16, grad_scale, param.data_ptr(), exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(), None if copy is None else copy.data_ptr(), begin, end, *scalars, decay,
            bias_correction2_sqrt, eps, neg_step_size, vml_sqrt, TORCH_VML_MODE, mkl_threads_local), grain)
        return
    if grad.dtype == torch.bfloat16:  # a BF16 gradient times `grad_scale`, as if copied to FP32 and clipped first
        parallel(n, lambda begin, end: lib.adamw_moments_bf16(grad.data_ptr(), grad_scale, exp_avg.data_ptr(),
                                                               exp_avg_sq.data_ptr(), begin, end, *scalars), grain)
    else:
        parallel(n, lambda begin, end: lib.adamw_moments(grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                                          begin, end, *scalars), grain)
    root = torch.sqrt(exp_avg_sq, out=root if root is not None else torch.empty_like(exp_avg_sq))
    parallel(n, lambda begin, end: lib.adamw_parameters(param.data_ptr(), exp_avg.data_ptr(), root.data_ptr(), begin,
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
