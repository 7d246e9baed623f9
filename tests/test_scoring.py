import random

import numpy as np
import torch

from rla_lib import task
from rla_lib.models import load_model, load_tokenizer
from rla_lib.scoring import pad_batch, token_logprobs


def _sequences(n=12, seed=0):
    tok = load_tokenizer("qwen3-tiny")
    rng = random.Random(seed)
    return [tok.encode(p.prompt + p.solution) + [tok.eos_token_id] for p in (task.sample_problem(rng) for _ in range(n))]


def test_chunked_equals_unchunked_and_matches_plain_forward():
    model = load_model("qwen3-tiny")
    seqs = _sequences()
    whole = token_logprobs(model, seqs, chunk_size=10**6)
    chunked = token_logprobs(model, seqs, chunk_size=7)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    # the same numbers as the model's own forward on the same padded batch
    ids, mask = pad_batch(seqs)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    for i, (s, lp) in enumerate(zip(seqs, whole)):
        ref = logp[i, : len(s) - 1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy()
        np.testing.assert_array_equal(lp, ref)


def test_padding_does_not_change_a_sequence():
    """Each sequence scored alone equals its row of the padded batch, up to FP32 summation-order noise.

    In FP32 (BF16 kernels for another batch shape round differently, by up to ~0.1 nat here: noise that would hide
    a real error) the kernels' reordering moves a logprob by about u * |logit| * sqrt(n) per op, ~1e-5 at logits of
    |30| (measured <= 9e-6); 1e-3 leaves 100x margin, while a padding or position error moves logprobs by nats.
    """
    model = load_model("qwen2-tiny", dtype="float32")
    seqs = _sequences()
    whole = token_logprobs(model, seqs)
    for s, row in zip(seqs, whole):
        np.testing.assert_allclose(token_logprobs(model, [s])[0], row, rtol=0, atol=1e-3)


def test_full_vocab_is_a_distribution_and_contains_the_token():
    model = load_model("qwen2-tiny")
    seqs = _sequences(4)
    for s, (lp, full) in zip(seqs, token_logprobs(model, seqs, full_vocab=True, chunk_size=5)):
        # FP32 log_softmax over 16 tokens: each logprob off by <= a few u*|logprob| (|logprob| <= ~30, u = 6e-8),
        # so the sum of probabilities is 1 within ~2e-6; 1e-5 is a 5x margin
        np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, atol=1e-5)
        np.testing.assert_array_equal(full[np.arange(len(s) - 1), s[1:]], lp)


def test_grad_mode_keeps_the_graph():
    model = load_model("qwen3-tiny", dtype="float32")
    lps = token_logprobs(model, _sequences(3), grad=True)
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_response_tokens_keeps_what_follows_each_prompt():
    from rla_lib.scoring import response_tokens

    per_seq = [np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0])]
    np.testing.assert_array_equal(response_tokens(per_seq, [1, 0]), [2.0, 3.0, 4.0, 5.0])


def test_head_logprobs_checkpoints_chunks_with_the_same_values_and_gradients():
    """Chunked + checkpointed LM head: the logprobs and the hidden-state gradient are the unchunked path's bit for
    bit (the same ops on the same rows); the head's weight gradient is a sum over chunks instead of one matmul, so
    in FP32 it differs by summation order only: a few ulps of its largest entry (1e-5 relative is a wide margin).
    Autograd keeps only the chunk inputs, not a (tokens x vocab) log-softmax."""
    from rla_lib.scoring import head_logprobs, log_softmax_at

    torch.manual_seed(0)
    head = torch.nn.Linear(32, 5000, bias=False)
    hidden = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 5000, (300,))
    saved = []

    def run(fn):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel() * x.element_size()) or x, lambda x: x):
            out = fn()
        return out, sum(saved)

    naive, naive_bytes = run(lambda: log_softmax_at(head(hidden)).gather(-1, targets[:, None])[:, 0])
    chunked, chunked_bytes = run(lambda: head_logprobs(head, hidden, targets, chunk_size=64))
    assert torch.equal(naive, chunked)
    assert naive_bytes >= 300 * 5000 * 4 and chunked_bytes <= hidden.numel() * 4 + targets.numel() * 8
    (h_naive, w_naive), (h_chunked, w_chunked) = (torch.autograd.grad(lp.sum(), (hidden, head.weight)) for lp in (naive, chunked))
    assert torch.equal(h_naive, h_chunked)
    torch.testing.assert_close(w_chunked, w_naive, rtol=0, atol=1e-5 * w_naive.abs().max().item())


def test_grad_logprobs_equal_no_grad_logprobs():
    model = load_model("qwen3-tiny", dtype="float32")
    seqs = _sequences(3)
    for a, b in zip(token_logprobs(model, seqs, grad=True, chunk_size=7), token_logprobs(model, seqs, chunk_size=7)):
        np.testing.assert_array_equal(a.detach().numpy(), b)
