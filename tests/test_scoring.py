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
    # one sequence alone: BF16 kernels for another batch shape may round differently, but only slightly
    alone = token_logprobs(model, seqs[:1])[0]
    np.testing.assert_allclose(alone, whole[0], atol=0.1)


def test_full_vocab_is_a_distribution_and_contains_the_token():
    model = load_model("qwen2-tiny")
    seqs = _sequences(4)
    for s, (lp, full) in zip(seqs, token_logprobs(model, seqs, full_vocab=True, chunk_size=5)):
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
