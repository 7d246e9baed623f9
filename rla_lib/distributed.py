"""GRPO under FSDP2 across processes: the pieces a data-parallel trainer adds to `grpo.Policy`'s update.

    torchrun --nproc_per_node 2 experiments/fsdp_grpo.py       # checks them against one process

- `init_process_group` joins the group torchrun set up, after checking that the launch fits the run (the
  world size asked for, a global batch that splits evenly): a wrong launch stops there, before any model is
  loaded or any file written.
- `shard` wraps a (stock or `align`ed) Qwen model with FSDP2's `fully_shard`: one unit per decoder layer,
  then the root (embeddings, final norm, tied head). `align` patches forwards per module instance and
  `fully_shard` only swaps the class and adds hooks, so the patches keep running (align first, then shard).
- `grpo_step` runs one clipped-GRPO update on this rank's rows of the global batch. Each rank's loss is its
  share of the global token mean (its tokens' surrogate sum over the global token count) and FSDP sums the
  shares' gradients across ranks, so the update is that of the global-batch loss.
- `full_state` gathers the unsharded FP32 weights and optimizer state onto rank 0 (for checkpoints, checks).

Mixed precision is `grpo.Policy`'s scheme in FSDP2's terms (`MIXED_PRECISION`): the sharded parameters are
the FP32 master and AdamW updates them; `param_dtype=bfloat16` rounds them to BF16 (round to nearest even, as
`Policy.refresh_compute`) before the all-gather, so forward and backward run on the same BF16 weights as
Policy's compute copy; `reduce_dtype=float32` upcasts each rank's BF16 weight gradient and sums the ranks in
FP32. The one difference from one process: a weight gradient is rounded to BF16 per rank (over the rank's
rows) before the FP32 sum, where Policy rounds it once over the whole batch. With two ranks the FP32 sum
has one addition, a + b = b + a, so the result does not depend on the order the ranks arrive in.
FSDP2's default `cast_forward_inputs=True` would round every floating input of a unit to BF16; aligned layers
pass FP32 on purpose, so it is off here (with it on, the aligned run drifted from the single-process one).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .scoring import log_softmax_at

# cast_forward_inputs=False: aligned layers hand each other FP32 tensors on purpose (the unrounded residual sum,
# FP32 cos/sin); FSDP2's default would round them to BF16 at every unit's entrance, undoing part of the alignment.
MIXED_PRECISION = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def check_launch(world_size: int, expected: int, global_rows: int) -> None:
    """Refuse a launch that does not fit the run, with what to change."""
    if world_size != expected:
        other = (f"or pass --world-size {world_size} (the global batch of {global_rows} rows splits evenly over it)"
                 if global_rows % world_size == 0 else
                 f"(the global batch of {global_rows} rows does not split evenly over {world_size})")
        raise ValueError(f"this run is set up for {expected} processes but torchrun started {world_size}: launch "
                         f"with `torchrun --nproc_per_node {expected}` {other}.")
    if global_rows % world_size:
        raise ValueError(
            f"the global batch of {global_rows} rows does not split evenly over {world_size} processes: "
            f"choose a world size that divides {global_rows}, or a batch (prompts x group size) that "
            f"{world_size} divides."
        )


def init_process_group(expected_world_size: int, global_rows: int, backend: str = "gloo") -> tuple[int, int]:
    """(rank, world size) of this process, after `check_launch`; the group is joined only if the launch fits."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError(
            f"no distributed launch found (RANK and WORLD_SIZE unset): start this with "
            f"`torchrun --nproc_per_node {expected_world_size} ...`."
        )
    check_launch(int(os.environ["WORLD_SIZE"]), expected_world_size, global_rows)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def local_rows(global_rows: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous block of the global batch (`check_launch` made the blocks equal)."""
    per_rank = global_rows // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard(model: torch.nn.Module, mixed_precision: MixedPrecisionPolicy = MIXED_PRECISION) -> torch.nn.Module:
    """FSDP2-wrap a Qwen *ForCausalLM in place (FP32 weights in, sharded FP32 master out); returns it.

    Gradients are summed across ranks, not averaged: each rank's loss is already its share of the global
    mean (`loss_share`), so the reduction is a plain sum, with no division before or after it.
    """
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed_precision)
    fully_shard(model, mp_policy=mixed_precision)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def token_logprobs(model, ids, attn, temperature: float = 1.0):
    """Per-token logprobs (B, T-1) of ids[:, 1:]: `grpo.Policy.logprobs`'s ops, for any model."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    return log_softmax_at(logits, temperature).gather(-1, ids[:, 1:, None])[..., 0]


def loss_share(new_lp, old_lp, advantages, mask, clip: float, global_tokens: int):
    """This rank's share of `grpo.clipped_loss` over the global batch: its tokens' clipped surrogate sum,
    divided by the global token count. The shares of all ranks add up to the global token-mean loss."""
    ratio = torch.exp(new_lp - old_lp)
    adv = advantages[:, None].expand_as(new_lp)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return -(surrogate * mask).sum() / global_tokens


def global_sum(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item()


def grpo_step(model, opt, batch: dict, old_lp, clip: float, max_grad_norm: float, global_tokens: int):
    """One update on this rank's rows; returns (global loss, global grad norm, new logprobs detached).

    `batch` holds this rank's `ids`, `attn`, `resp` (response mask over positions t -> token t+1) and
    `adv`; `old_lp` None takes the logprobs of this very forward (no update precedes it: the same bits),
    as `grpo.train_step` does for its first minibatch. The grad norm is clipped over the whole model.
    """
    opt.zero_grad(set_to_none=True)
    new_lp = token_logprobs(model, batch["ids"], batch["attn"])
    old_lp = new_lp.detach() if old_lp is None else old_lp
    loss = loss_share(new_lp, old_lp, batch["adv"], batch["resp"], clip, global_tokens)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).full_tensor().item()
    opt.step()
    return global_sum(loss), grad_norm, new_lp.detach()


def full_state(model, opt) -> dict:
    """The unsharded FP32 weights (`master`, Hugging Face names) and optimizer state (`opt`, keyed by
    parameter name) on rank 0, empty dicts on the other ranks. A collective: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    master, optim = get_state_dict(model, opt, options=options)
    return dict(master=master, opt=optim)
