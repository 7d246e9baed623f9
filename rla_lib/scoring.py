"""The training side's per-token logprobs, as an RL trainer recomputes them.

The decoder runs once over the batch; the LM head and log-softmax then run over chunks of
positions, so peak memory is bounded by `chunk_size x vocab` rather than `tokens x vocab`
(151,936 columns for a real Qwen). With gradients each chunk is checkpointed: backward recomputes
its logits instead of keeping every chunk's FP32 log-softmax alive, so the bound holds there too.
The logprobs and the gradient reaching the hidden states (hence every decoder weight) are bit for
bit those of the unchunked path; the LM head's weight gradient is summed chunk by chunk, so it
differs from one big matmul by summation order only. Logits come out of the model in its dtype (BF16) and the
log-softmax is taken in FP32, as vLLM does. At a sampling temperature T != 1 the engine samples
softmax(logits / T): `temperature=T` scores that distribution, dividing in vLLM's order.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from .align.attention import prefilled as attention_prefilled
from .real_shape import VOCAB_SIZE as REAL_VOCAB_SIZE

HEAD_CHUNK = 1024  # positions per chunk of the LM head and its log-softmax (`head_logprobs`)
# The chunked path's peak memory over the naive one's, with gradients, that scoring at a real vocabulary must meet
# (benchmarks/scoring_memory.py). It keeps one chunk's logits where the naive path keeps every position's, so the
# ratio cannot fall much below HEAD_CHUNK / positions: the target applies from HEAD_CHUNK / target positions on.
CHUNKED_PEAK_TARGET = 0.25


def chunked_peak_target_applies(positions: int, vocab: int) -> bool:
    """Whether `CHUNKED_PEAK_TARGET` holds at this size: one chunk a small part of the positions, a real vocabulary."""
    return positions >= HEAD_CHUNK / CHUNKED_PEAK_TARGET and vocab == REAL_VOCAB_SIZE


def pad_batch(sequences, pad_id: int = 0):
    """Right-pad token-id lists: positions then start at 0 in every row, as in vLLM."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def response_tokens(per_sequence, starts):
    """Concatenate the response part of per-position scores (entry t scores token t+1, so a response
    whose prompt has P tokens starts at entry P - 1)."""
    return np.concatenate([np.asarray(x)[s:] for x, s in zip(per_sequence, starts)])


def log_softmax_at(logits, temperature: float = 1.0):
    """FP32 log-softmax of logits / temperature, in vLLM's sampler's order: cast the model's logits to
    FP32, divide by T in FP32, normalise. At T=1 nothing is divided (bitwise the plain log-softmax).

    Dividing by the Python float equals vLLM's in-place division by its FP32 temperature tensor bit for bit.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def hidden_states(model, ids, mask):
    return model.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _chunk_logprobs(lm_head, hidden, targets, temperature: float):
    return log_softmax_at(lm_head(hidden), temperature).gather(-1, targets[:, None])[:, 0]


def head_logprobs(lm_head, hidden, targets, chunk_size: int = HEAD_CHUNK, temperature: float = 1.0):
    """log p(target | position) for (N, H) hidden states, chunk by chunk; under autograd each chunk is
    checkpointed, so at most one chunk's (chunk_size, vocab) logits exist at a time, forward or backward."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    chunks = []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (lm_head, hidden[s : s + chunk_size], targets[s : s + chunk_size], temperature)
        chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args))
    return torch.cat(chunks)


def token_logprobs(model, sequences, chunk_size: int = HEAD_CHUNK, full_vocab: bool = False, batch_size: int = 64, grad: bool = False,
                   temperature: float = 1.0, prefilled=None):
    """Logprob of each token given its prefix, for each sequence (entry t scores ids[t+1]).

    `temperature`: score softmax(logits / T), the distribution an engine sampling at T draws from.
    `prefilled`: per sequence, how many leading tokens the engine prefilled in one go (the prompt, for the logprobs it
    returned while sampling); default all, as it re-scores. Only the engine-numerics attention kernels read it, and
    only sequences longer than one of the engine's KV tiles depend on it (`attention.prefilled`).

    Returns a list of float32 numpy arrays (or a list of (logprobs, full) pairs with
    full_vocab=True). With grad=True returns torch tensors that keep the graph.
    """
    device = next(model.parameters()).device
    out = []
    for b in range(0, len(sequences), batch_size):
        batch = [list(s) for s in sequences[b : b + batch_size]]
        ids, mask = pad_batch(batch)
        ids, mask = ids.to(device), mask.to(device)
        lengths = None if prefilled is None else prefilled[b : b + batch_size]
        with torch.set_grad_enabled(grad), attention_prefilled(lengths):
            h = hidden_states(model, ids, mask)[:, :-1]  # position t predicts token t+1
            targets = ids[:, 1:]
            flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
            if full_vocab:  # the whole distribution is the output: nothing to save by recomputing
                logp = torch.cat([log_softmax_at(model.lm_head(flat_h[s : s + chunk_size]), temperature)
                                  for s in range(0, flat_h.shape[0], chunk_size)])
                lp = logp.gather(-1, flat_t[:, None])[:, 0].view(targets.shape)
                full = logp.detach().view(*targets.shape, -1)
            else:
                lp = head_logprobs(model.lm_head, flat_h, flat_t, chunk_size, temperature).view(targets.shape)
        for i, s in enumerate(batch):
            n = len(s) - 1
            row = lp[i, :n] if grad else lp[i, :n].detach().cpu().numpy()
            out.append((row, full[i, :n].cpu().numpy()) if full_vocab else row)
    return out
