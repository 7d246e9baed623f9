"""Logit noise in the engine: a second, controlled kind of inference-side mismatch (issue 15).

vLLM loads this module inside its engine process (`Engine` registers the class by name), so it may
import vLLM at the top; nothing else imports it.
"""

import zlib

import numpy as np
import torch
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


class LogitNoise(LogitsProcessor):
    """Gaussian noise of a set size on every logit, for requests that ask (`Engine.sample(logit_noise=sigma)`).

    A second, controlled kind of inference-side mismatch next to coarser rollout weights (issue 15): the
    sampler draws from softmax((logits + sigma * z) / T), z ~ N(0, 1) per vocabulary entry, and returns that
    distribution's logprobs. z is drawn from a generator seeded by the request's seed, its prompt and the
    position, so a request gets the same noise whatever else is in the batch, and a rerun gets the same bits.
    """

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple[float, int, list[int]]] = {}  # batch row -> (sigma, key, output token ids)

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _state(params, prompt_ids, output_ids):
        sigma = (params.extra_args or {}).get("logit_noise")
        if not sigma:
            return None
        key = zlib.crc32(np.asarray(prompt_ids or [], np.int64).tobytes(), params.seed or 0)
        return float(sigma), key, output_ids

    def update_state(self, batch_update) -> None:
        process_dict_updates(self.rows, batch_update, self._state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (sigma, key, output_ids) in self.rows.items():
            g = torch.Generator().manual_seed(key * 100_003 + len(output_ids))
            logits[row] += sigma * torch.randn(logits.shape[1], generator=g, dtype=torch.float32).to(logits.device)
        return logits
