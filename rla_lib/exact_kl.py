"""Exact KL(engine || training) at any vocabulary, chunk by chunk over positions.

    from rla_lib.exact_kl import exact_kl
    res = exact_kl(engine, model, sequences, starts)   # per-position terms of the response tokens
    res.terms[i]                                        # KL(p_engine || p_training) at each response position

At 151,936 tokens the whole next-token distribution cannot be returned as vLLM prompt logprobs (Python
lists of 151,936 entries per position) nor kept for every position (4,096 positions x 151,936 x 4 bytes =
2.5 GB per side). The engine instead hands back its final hidden states (positions x hidden, small:
`Engine.prompt_hidden`), and for each chunk of positions computes its own logits from them
(`Engine.logprobs_from_hidden`: the engine's LM head, the sampler's FP32 log-softmax). The result is
bitwise the distribution its `prompt_logprobs` returns (tests/test_exact_kl.py checks it at vocabulary
151,936, compiled and eager). The training side's logits for the same chunk come from its own decoder
pass, and the chunk's KL terms are summed in FP64, as `kl.exact_terms` does. Peak memory holds one
chunk of both distributions (FP32, and FP64 for the sum): about `chunk_size x vocab x 24` bytes, 0.47 GB
for the default 128 positions at 151,936 tokens, whatever the number of positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scoring import hidden_states, log_softmax_at, pad_batch

CHUNK_SIZE = 128  # positions per chunk: 128 x 151,936 x 24 bytes = 0.47 GB at a real Qwen's vocabulary


@dataclass
class ExactKL:
    """Per sequence, at each response position t: the exact KL and both sides' logprob of token t+1."""

    terms: list[np.ndarray]  # FP64
    inference_lp: list[np.ndarray]  # FP32, the engine's logprob of the scored token
    training_lp: list[np.ndarray]

    def mean(self) -> float:
        """Mean over all response tokens (the tokens of every sequence pooled)."""
        return float(np.concatenate(self.terms).mean())


def kl_terms(inference_logp: torch.Tensor, training_logp: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || q) from (n, vocab) log-probabilities, in FP64 (-inf on the p side contributes 0)."""
    p, q = inference_logp.double(), training_logp.double()
    return torch.where(torch.isneginf(p), 0.0, p.exp() * (p - q)).sum(-1)


def check_inputs(engine, model, sequences, starts) -> None:
    """Fail before any work on a pair that cannot be compared."""
    vocab = model.config.vocab_size
    if engine.spec.vocab_size != vocab:
        raise ValueError(f"the engine's model has a vocabulary of {engine.spec.vocab_size} tokens, the training "
                         f"model {vocab}: score with the same checkpoint on both sides")
    if len(starts) != len(sequences):
        raise ValueError(f"one response start per sequence: {len(starts)} for {len(sequences)} sequences")
    for ids, start in zip(sequences, starts):
        if not 0 <= start < len(ids) - 1:
            raise ValueError(f"a response start of {start} does not fit a sequence of {len(ids)} tokens "
                             "(entry t scores token t+1: use Sample.response_start)")
        if max(ids) >= vocab:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary of {vocab}")


def training_hidden(model, sequences, batch_size: int) -> list[torch.Tensor]:
    """The training side's final hidden states at every position but the last, per sequence."""
    device, out = next(model.parameters()).device, []
    for b in range(0, len(sequences), batch_size):
        batch = [list(s) for s in sequences[b : b + batch_size]]
        ids, mask = pad_batch(batch)
        with torch.no_grad():
            h = hidden_states(model, ids.to(device), mask.to(device))
        out += [h[i, : len(s) - 1] for i, s in enumerate(batch)]
    return out


def exact_kl(engine, model, sequences, starts=None, chunk_size: int = CHUNK_SIZE, batch_size: int = 64,
             temperature: float = 1.0, engine_hidden=None) -> ExactKL:
    """Exact KL(engine || training) at every response position of each sequence (from `starts[i]`, an
    index into the per-position scores; None scores every position), chunked over positions.

    temperature=T compares softmax(logits / T) on both sides, what an engine sampling at T draws from.
    batch_size: sequences per training-side forward; the default is `scoring.token_logprobs`'s, so the training
    logprobs are bitwise those it gives (BF16 bits can depend on the batch a row is computed in).
    engine_hidden: `engine.prompt_hidden(sequences)` computed once for several training sides.
    """
    sequences = [[int(t) for t in s] for s in sequences]
    starts = [0] * len(sequences) if starts is None else list(starts)
    check_inputs(engine, model, sequences, starts)
    if engine_hidden is None:
        engine_hidden = engine.prompt_hidden(sequences)
    train_hidden = training_hidden(model, sequences, batch_size)
    res = ExactKL([], [], [])
    for ids, start, e_h, t_h in zip(sequences, starts, engine_hidden, train_hidden):
        targets = torch.tensor(ids[1:])
        parts = []
        for a in range(start, len(ids) - 1, chunk_size):
            b = min(a + chunk_size, len(ids) - 1)
            e_lp = engine.logprobs_from_hidden(e_h[a:b], temperature)
            with torch.no_grad():
                t_lp = log_softmax_at(model.lm_head(t_h[a:b]), temperature).cpu()
            rows = torch.arange(b - a)
            parts.append((kl_terms(e_lp, t_lp), e_lp[rows, targets[a:b]], t_lp[rows, targets[a:b]]))
        for field_, k in ((res.terms, 0), (res.inference_lp, 1), (res.training_lp, 2)):
            field_.append(torch.cat([p[k] for p in parts]).numpy())
    return res
