"""vLLM-CPU's split-KV decode (rla_lib.engine_probes): when its scheduler cuts a decoded token's keys among threads,
and that a cut changes the attention output's bits where an uncut row's bits do not depend on the thread count."""

import torch

from rla_lib.engine_probes import decode_kv_splits, paged_decode_attention

TINY, SMALL = (4, 2, 64), (16, 8, 128)  # query heads, KV heads, head dim: qwen3-tiny's and Qwen3-0.6B's


def test_a_long_request_alone_splits_on_several_threads_and_a_batch_of_equals_does_not():
    """The scheduler's even share of the step's keys per thread, cut in parts of at least 32 keys (vLLM's own
    metadata, read back): on one thread, or with splitting off, never."""
    for shape in (TINY, SMALL):
        assert decode_kv_splits([2048], 1, *shape) == 0
        assert decode_kv_splits([2048], 2, *shape, enable_kv_split=False) == 0
        assert decode_kv_splits([64], 2, *shape) == 0  # too short to cut in two parts of 32 keys past a share
        assert decode_kv_splits([2048], 2, *shape) == 2 and decode_kv_splits([2048], 8, *shape) == 8
        assert decode_kv_splits([2048, 2048], 2, *shape) == 0  # one request per thread: nothing to cut
        assert decode_kv_splits([2048, 64], 2, *shape) == 2  # the long one passes its share: it is cut


def test_uncut_rows_have_the_same_bits_on_any_thread_count_and_cuts_change_some():
    """What the training side relies on: a row computed whole gives the same bits on 1, 2 or 8 threads. Cut into
    parts (split on, 8 threads), its partial softmaxes merge in another order: over 40 random rows of 512 keys at
    Qwen3-0.6B's head shape, some output differs (a few bits of BF16 rounding; measured by benchmarks/split_kv.py)."""
    gen = torch.Generator().manual_seed(0)
    differing = 0
    for _ in range(40):
        q = torch.randn(1, SMALL[0], SMALL[2], generator=gen) * 2
        k, v = ([torch.randn(512, SMALL[1], SMALL[2], generator=gen)] for _ in range(2))
        whole = [paged_decode_attention(q, k, v, threads, enable_kv_split=False) for threads in (1, 2, 8)]
        assert all(torch.equal(w.view(torch.int16), whole[0].view(torch.int16)) for w in whole)
        cut = paged_decode_attention(q, k, v, 8, enable_kv_split=True)
        differing += not torch.equal(cut.view(torch.int16), whole[0].view(torch.int16))
        torch.testing.assert_close(cut.float(), whole[0].float(), rtol=2 ** -7, atol=1e-3)  # BF16 rounding, no more
    assert differing > 0
