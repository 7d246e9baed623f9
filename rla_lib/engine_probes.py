"""What vLLM's kernels do on this machine, probed for the graph reader and the studies: which BF16 linear it runs
(`vllm_linear`), how its rotary kernel rounds (`probe_rotary_kernel`), how an engine was compiled
(`compilation_info`), and how vLLM-CPU's attention splits a decoded token's keys among its threads (`decode_kv_splits`,
`paged_decode_attention`: benchmarks/split_kv.py)."""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
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


# ---- split-KV decode: vLLM-CPU's AttentionScheduler, asked directly ------------------------------------------------
KV_BLOCK = 32  # the paged KV cache's block size the "vec" kernels take (a multiple of 32)


@contextlib.contextmanager
def _on_threads(threads: int):
    """torch's (and so vLLM-CPU's OpenMP) thread count set to `threads` for the block, then put back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _decode_schedule(ops, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     enable_kv_split: bool) -> torch.Tensor:
    """vLLM-CPU's scheduler metadata for one decoded token per request (BF16, causal, "vec" kernels)."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32), causal=True,
        sliding_window_size=-1, isa="vec", enable_kv_split=enable_kv_split)


def decode_kv_splits(seq_lens, threads: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     enable_kv_split: bool = True) -> int:
    """How many parts vLLM-CPU's attention scheduler (csrc/cpu/cpu_attn_impl.hpp `AttentionScheduler::schedule`)
    cuts the keys of one decode step into, for requests of these lengths each decoding one token on `threads` OpenMP
    threads: 0 where every request's keys stay whole. It gives each thread an even share of the step's keys (all
    requests together) and cuts a one-token query's keys where they pass a share, in parts of at least 32 keys: so
    whether a request splits depends on the step's whole batch. Read from vLLM's own scheduler metadata."""
    import_vllm()
    from vllm import _custom_ops as ops

    with _on_threads(threads):
        meta = _decode_schedule(ops, torch.tensor(seq_lens, dtype=torch.int32), num_heads, num_kv_heads, head_dim,
                                enable_kv_split)
    header = meta.numpy().view(np.int32)  # AttentionMetadata: an int64 counter and 56 bytes of padding, then int32s
    if header[20] != threads:
        raise RuntimeError(f"vLLM's scheduler ran on {header[20]} threads, not {threads}: its metadata layout changed?")
    return int(header[19])  # reduction_split_num


def paged_decode_attention(query, keys, values, threads: int, enable_kv_split: bool = True, timed_rounds: int = 0):
    """vLLM-CPU's attention output for one decoded token per request ("vec" kernels, BF16), on `threads` threads:
    query (requests, heads, head_dim); keys and values, one (length, kv_heads, head_dim) tensor per request, written
    into a paged cache of `KV_BLOCK`-token blocks as vLLM writes them. timed_rounds > 0: (output, the median seconds of
    that many calls of the kernel alone, scheduling included)."""
    import_vllm()
    from vllm import _custom_ops as ops

    n, (num_heads, head_dim), kv_heads = len(keys), query.shape[1:], keys[0].shape[1]
    lengths = [len(k) for k in keys]
    blocks = [(length + KV_BLOCK - 1) // KV_BLOCK for length in lengths]
    cache = torch.zeros(sum(blocks), kv_heads, 2 * KV_BLOCK, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table, first = torch.zeros(n, max(blocks), dtype=torch.int32), 0
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first, first + b)
        first += b
    for i, (k, v) in enumerate(zip(keys, values)):
        positions = torch.arange(len(k))
        slots = (table[i, positions // KV_BLOCK].long() * KV_BLOCK + positions % KV_BLOCK)
        ops.cpu_attn_reshape_and_cache(k.bfloat16(), v.bfloat16(), key_cache, value_cache, slots, "vec")
    seq_lens, starts = torch.tensor(lengths, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32)
    query, out = query.bfloat16().contiguous(), torch.empty(n, num_heads, head_dim, dtype=torch.bfloat16)

    def attend():
        meta = _decode_schedule(ops, seq_lens, num_heads, kv_heads, head_dim, enable_kv_split)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=head_dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)

    with _on_threads(threads):
        attend()
        times = []
        for _ in range(timed_rounds):
            started = time.perf_counter()
            attend()
            times.append(time.perf_counter() - started)
    return (out, statistics.median(times)) if timed_rounds else out

