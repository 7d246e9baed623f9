"""Small random-init Qwen models, a padded batch and a one-thread fixture, shared by the rounding, capture and clustering tests."""

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from rla_lib.pretrain import make_config
from rla_lib.scoring import pad_batch


@pytest.fixture(autouse=True)
def one_thread():
    """The machine is shared: two threads on busy cores make these small ops 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def tiny_model(arch, layers=2, seed=0):
    """A random-init BF16 model of the embedded shape (shared between tests: do not modify it)."""
    torch.manual_seed(seed)
    cfg = make_config(arch)
    cfg.num_hidden_layers = layers
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights and biases (init gives ones / zeros)
        for _, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return m.to(torch.bfloat16).eval()


def batch():
    return pad_batch([[1, 2, 3, 11, 4, 5, 14, 6, 0], [3, 3, 11, 2, 14, 5, 0], [1, 2, 3], [9, 9, 12, 1, 14, 10, 8]])
