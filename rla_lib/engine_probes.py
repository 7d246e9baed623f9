"""What vLLM's kernels do on this machine, probed for the graph reader and the studies: which BF16 linear it runs
(`vllm_linear`), how its rotary kernel rounds (`probe_rotary_kernel`), and how an engine was compiled
(`compilation_info`)."""

from __future__ import annotations

import torch

from .engine_process import import_vllm


def vllm_linear(weight):
    """(name, fn): the BF16 linear vLLM-CPU runs for `weight` on this CPU, as its dispatch picks it
    (model_executor/layers/utils.py `dispatch_cpu_unquantized_gemm`): with AMX tiles, its packed-weight kernel for
    small weights; else oneDNN's `onednn_mm` if it accepts the BF16 matmul, else torch's linear."""
    import_vllm()
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if check_cpu_sgl_kernel(*weight.shape, weight.dtype):
        packed = torch.ops._C.convert_weight_packed(weight)
        return "AMX weight_packed_linear", lambda x: ops.weight_packed_linear_cpu(x, packed, weight.shape[0], None)
    try:
        handle = ops.create_onednn_mm(weight.t(), 32)
        return "oneDNN onednn_mm", lambda x: ops.onednn_mm(handle, x, None)
    except RuntimeError:  # e.g. without AVX-512 ("could not create a primitive descriptor")
        return "torch linear (oneDNN refused)", lambda x: torch.nn.functional.linear(x, weight)


def compilation_info(engine) -> dict:
    """The vLLM version, device and compilation settings this engine runs with."""
    config = engine.llm.llm_engine.vllm_config
    cc = config.compilation_config
    return {"vllm": engine._vllm.__version__, "device": str(getattr(config.device_config, "device", "cpu")),
            "compilation": {"mode": str(getattr(cc, "mode", "")), "backend": str(getattr(cc, "backend", "")),
                            "custom_ops": list(getattr(cc, "custom_ops", []) or []),
                            "splitting_ops": list(getattr(cc, "splitting_ops", []) or [])}}

def probe_rotary_kernel(device="cpu", seed=0) -> dict:
    """Bitwise test of vLLM's rotary kernel against two roundings: FP32 math rounded once, or BF16 ops (vLLM is
    imported: the kernel is its library's)."""
    import_vllm()
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
        res[name] = torch.cat([(fn(q, hq) == q_out).flatten(), (fn(k, hk) == k_out).flatten()]).float().mean().item()
    res["best"] = max(("fp32_round_once", "bf16_every_op"), key=lambda n: res[n])
    res["note"] = "fraction of q/k elements bitwise equal to each emulation (48 tokens, random q/k, BF16 cos_sin_cache)"
    return res
