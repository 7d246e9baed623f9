"""A mismatch monitor any trainer can call: per-token logprobs as torch tensors in, plain floats out.

RL trainers hold the two sides' logprobs of the sampled tokens as (B, T) tensors with a response mask:
TRL `sampling_per_token_logps` (inference) and `old_per_token_logps` (training) with `completion_mask`;
verl `rollout_log_probs` and `old_log_probs` with `response_mask`; OpenRLHF the same shape. Give them to
`mismatch_metrics` (one batch) or to a `MismatchMeter` (collects steps between two logs), or let the
`MismatchCallback` add the metrics to a `transformers.Trainer`'s logs. Padding (mask 0) is ignored, whatever
it holds (NaN included); every tensor is converted to float64 first, so BF16 logprobs lose nothing to the
arithmetic. The formulas are `mismatch_summary`'s, shared with `rla_lib.kl`'s estimators and the GRPO loop's history.

Metrics, with d = logp_inf - logp_train per response token and rho = exp(-d) = p_train / p_inf. Units: nats
per token (not the 1e-4 units of `kl`'s tables and the GRPO history's), nats per response for the
`_per_sequence` keys; ratios and fractions have none. Token statistics pool every token of the batch.

    mismatch/k1                      mean d: the paper's KL(inference || training) estimator (unbiased, noisy)
    mismatch/k3                      mean(rho - 1 - log rho): unbiased too, never negative, less noisy
    mismatch/exact_kl                mean over positions of the full-vocabulary KL(p_inf || p_train); only when
                                     both sides' (B, T, V) log-probs are given (small vocabularies)
    mismatch/exact_kl_per_sequence   mean over responses of the exact KL summed over the response (with the above)
    mismatch/abs_diff_mean, _max     mean and max |d|
    mismatch/k1_per_sequence         mean over responses of sum_t d = log(p_inf(y) / p_train(y)): what a
                                     sequence-level importance ratio sees (it grows with length)
    mismatch/k3_per_sequence         mean over responses of the summed k3 terms
    mismatch/is_ratio_mean, _min, _max   of rho per token, untruncated (E[rho] is 1 when no mass is missing)
    mismatch/chi2_token              mean(rho^2) - 1: the chi-squared divergence, the spread of the token weights
    mismatch/tis_weight_mean         mean min(rho, tis_cap): the token weight truncated importance sampling applies
    mismatch/is_ratio_above_cap      fraction of tokens with rho > tis_cap (the weights TIS truncates)
    mismatch/seq_is_ratio_above_cap  fraction of responses with prod_t rho > tis_cap (what sequence-level IS
                                     clips or masks: TRL's default `sequence_mask`)
    mismatch/tokens, mismatch/sequences  tokens and non-empty responses measured
    mismatch/nonfinite               response tokens left out because a side's token logprob there is NaN or
                                     infinite (or a full distribution holds a NaN): counted, not averaged into NaN

`tis_cap` defaults to 2.0 (verl's `rollout_is_threshold`); TRL's `vllm_importance_sampling_clip_max` is 3.0.

Across processes (FSDP, DDP, any `torch.distributed` trainer): where a process group is running with more than one
rank, every rank's metrics are those of all ranks' tokens together (`across_ranks`): token means weighted by each
rank's tokens, response means by its responses, counts summed, maxima and minima over ranks. It is a collective:
every rank calls it (as every rank computes its loss); `across_ranks=False` keeps a rank's own.

Next to TRL's own keys (logged when `vllm_importance_sampling_correction` is on):
`sampling/sampling_logp_difference/mean` and `/max` are mismatch/abs_diff_mean and _max (TRL averages
per-process values across processes);
`sampling/importance_sampling_ratio/{min,mean,max}` are taken after TRL's clip or mask (default: sequence-level
ratios, masked above 3), so they equal ours only in `token_truncate` mode with no lower clip, where
TRL's mean is mismatch/tis_weight_mean with tis_cap = clip_max.

verl's `rollout_corr/*` metrics (`verl/trainer/ppo/rollout_corr_helper.py`, `compute_offpolicy_metrics` and
`compute_is_metrics`; its `old_log_prob` is our training side, `rollout_log_prob` our inference side, and its
log_ratio is -d). Equal means equal by definition on the same masked tokens; verl computes in the input dtype.

    verl                                 ours                          relation
    rollout_corr/kl                      mismatch/k1                   equal: token mean of d
    rollout_corr/k3_kl                   mismatch/k3                   equal: token mean of rho - log rho - 1
    rollout_corr/log_ppl_diff            (mismatch/k1)                 differs: mean over responses of each
                                                                       response's mean d (one vote per response);
                                                                       equals k1 only if all lengths are equal
    rollout_corr/log_ppl_abs_diff        (mismatch/abs_diff_mean)      differs: mean over responses of |mean d|,
                                                                       ours is the token mean of |d| (never smaller
                                                                       at equal lengths)
    rollout_corr/log_ppl_diff_max, _min  -                             max / min over responses of their mean d
    rollout_corr/ppl_ratio               -                             mean over responses of exp(mean d)
    rollout_corr/training_ppl, _log_ppl, rollout_ppl, rollout_log_ppl   -   each side's perplexity, not a gap
    rollout_corr/chi2_token              mismatch/chi2_token           equal: token mean of rho^2, minus 1
    rollout_corr/chi2_seq                mismatch/chi2_seq             equal: mean over responses of prod rho^2, minus 1
                                                                       (verl clamps the log of the product to [-20, 20])
    rollout_corr/rollout_is_mean         mismatch/is_ratio_mean        equal with rollout_is="token" (verl clamps
                                                                       log rho to [-20, 20] first); with "sequence"
                                                                       verl averages sequence weights: differs
    rollout_corr/rollout_is_max, _min    mismatch/is_ratio_max, _min   equal with rollout_is="token" (same clamp)
    rollout_corr/rollout_is_ratio_fraction_high   mismatch/is_ratio_above_cap (rollout_is="token") or
                                         mismatch/seq_is_ratio_above_cap ("sequence"): equal with
                                         tis_cap = rollout_is_threshold
    rollout_corr/rollout_is_ratio_fraction_low   mismatch/is_ratio_below_floor   equal with rollout_is="token" and
                                         tis_cap = rollout_is_threshold (the floor is its reciprocal)
    rollout_corr/rollout_is_std          mismatch/is_ratio_std         equal with rollout_is="token" (both clamp the
                                                                       weights to [1 / cap, cap] first)
    rollout_corr/rollout_is_eff_sample_size   mismatch/is_ess          equal with rollout_is="token": 1 / mean of the
                                         squared clamped weights over their mean (a share: 1 when every weight is equal)
    rollout_corr/rollout_is_seq_*        -                             not computed here
    -                                    mismatch/exact_kl, k1_per_sequence, k3_per_sequence, abs_diff_max,
                                         tis_weight_mean   (verl has no counterpart)

`also_as=("verl",)` (or "trl") logs the keys that are the same quantity under that trainer's names too (`ALSO_AS`):
verl's rollout_corr/kl, k3_kl, chi2_token and chi2_seq (equal while no |d| exceeds 20, where some verl releases clamp log rho),
TRL's sampling/sampling_logp_difference/mean and /max (equal on one process; across processes TRL averages each
process's mean, these pool the tokens).

verl's documented warning levels (its rollout-correction guide, `check_rollout_correction_health`) as alerts on the
same numbers (`alerts(metrics)`, or `MismatchMeter(alerts=True)`, which warns when one starts to fire):
|mismatch/k1| > 0.1 (rollout_corr/kl), mismatch/chi2_token > 1 (rollout_corr/chi2_token), and the mean importance
weight outside [0.5, 2] (rollout_corr/rollout_is_mean: verl's after its truncation at rollout_is_threshold, which is
mismatch/tis_weight_mean with tis_cap set to that threshold).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
import torch.distributed as dist
from transformers import TrainerCallback


# ---- the formulas, on per-response arrays (also `rla_lib.kl`'s estimators and the GRPO loop's history) ------------
def sampled_terms(inf_lp, train_lp):
    return np.asarray(inf_lp, np.float64) - np.asarray(train_lp, np.float64)


def k3_terms(inf_lp, train_lp):
    d = sampled_terms(inf_lp, train_lp)
    return np.expm1(-d) + d  # r - 1 - log r with log r = -d; expm1 keeps tiny values exact


def exact_terms(inf_full, train_full):
    """Per-position KL(p_inf || p_train) from (T, V) log-probability arrays (-inf allowed)."""
    p, q = np.asarray(inf_full, np.float64), np.asarray(train_full, np.float64)
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(p), 0.0, np.exp(p) * (p - q))
    return terms.sum(-1)


TIS_CAP = 2.0  # the importance-weight cap of the statistics below: verl's default, and this project's TIS setting
MISMATCH_STATS = ("k1", "k3", "abs_diff_mean", "abs_diff_max", "k1_per_sequence", "k3_per_sequence", "is_ratio_mean",
                  "is_ratio_min", "is_ratio_max", "chi2_token", "chi2_seq", "tis_weight_mean", "is_ratio_above_cap",
                  "is_ratio_below_floor", "seq_is_ratio_above_cap", "is_ratio_clamped_mean", "is_ratio_clamped_sq_mean",
                  "is_ratio_std", "is_ess")
LOG_RATIO_BOUND = 20.0  # verl clamps log rho (and a response's sum of them) to [-20, 20] before exponentiating


def mismatch_summary(inference_logprobs, training_logprobs, inference_full=None, training_full=None,
                     tis_cap: float = TIS_CAP) -> dict:
    """One batch's mismatch, in nats: the formulas behind `mismatch_metrics` and the GRPO loop's history.

    Inputs are lists with one array per response: each sampled token's logprob on each side, and
    optionally both sides' full (T, V) log-distributions for the exact KL. With d = logp_inf - logp_train
    per token and rho = exp(-d) = p_train / p_inf, the weight that corrects the training loss for
    sampling from the inference side, the statistics pool every token of the batch:
    k1 = mean d (the paper's estimator); k3 = mean(rho - 1 - log rho); exact_kl = mean per-position
    KL(p_inf || p_train) (only with the full distributions), exact_kl_per_sequence = its sum over each
    response, averaged over responses; abs_diff_mean / abs_diff_max = mean / max |d|;
    k1_per_sequence / k3_per_sequence = each response's sum of terms, averaged over responses (nats per
    response: the log of a sequence-level importance ratio is a sum); is_ratio_mean / min / max = of rho,
    untruncated; chi2_token = mean(rho^2) - 1; chi2_seq = the mean over responses of (prod rho)^2, minus 1 (log of the
    product clamped to [-20, 20], as verl); tis_weight_mean = mean min(rho, tis_cap), the weight truncated importance sampling applies;
    is_ratio_above_cap / is_ratio_below_floor = the fraction of tokens with rho > tis_cap / rho < 1 / tis_cap;
    seq_is_ratio_above_cap = the fraction of responses whose product of rho exceeds tis_cap; with w = rho clamped
    to [1 / tis_cap, tis_cap], is_ratio_clamped_mean and is_ratio_clamped_sq_mean = mean w and mean w^2 (what the
    next two are made of, so ranks pool them exactly), is_ratio_std = their standard deviation and is_ess =
    mean(w)^2 / mean(w^2), the effective sample size per token (verl's, with its 1e-8 guard).
    Also `tokens` and `sequences` (non-empty responses).
    With no tokens every statistic is nan.
    """
    inf = [np.asarray(a, np.float64) for a in inference_logprobs]
    train = [np.asarray(b, np.float64).reshape(-1) for b in training_logprobs]
    lengths = np.array([len(a) for a in inf], dtype=int)
    if list(lengths) != [len(b) for b in train]:
        raise ValueError("inference and training logprobs must cover the same tokens (same lengths per response)")
    d = np.concatenate([a - b for a, b in zip(inf, train)]) if inf else np.zeros(0)
    out = {"tokens": len(d), "sequences": int((lengths > 0).sum())}
    if not len(d):
        return out | dict.fromkeys(MISMATCH_STATS + (("exact_kl", "exact_kl_per_sequence") if inference_full is not None else ()), np.nan)
    k3 = k3_terms(d, 0.0)
    ends = np.cumsum(lengths)[:-1]
    seq_d = np.array([t.sum() for t in np.split(d, ends)])[lengths > 0]
    seq_k3 = np.array([t.sum() for t in np.split(k3, ends)])[lengths > 0]
    rho = np.exp(-d)
    clamped = np.clip(np.exp(np.clip(-d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)), 1 / tis_cap, tis_cap)
    out |= {"chi2_seq": np.mean(np.exp(2 * np.clip(-seq_d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))) - 1,
            "is_ratio_below_floor": (rho < 1 / tis_cap).mean(), "is_ratio_clamped_mean": clamped.mean(),
            "is_ratio_clamped_sq_mean": np.mean(clamped**2)}
    out |= _spread(out["is_ratio_clamped_mean"], out["is_ratio_clamped_sq_mean"])
    out |= {"k1": d.mean(), "k3": k3.mean(), "abs_diff_mean": np.abs(d).mean(), "abs_diff_max": np.abs(d).max(),
            "k1_per_sequence": seq_d.mean(), "k3_per_sequence": seq_k3.mean(), "is_ratio_mean": rho.mean(),
            "is_ratio_min": rho.min(), "is_ratio_max": rho.max(), "chi2_token": np.mean(rho**2) - 1, "tis_weight_mean": np.minimum(rho, tis_cap).mean(),
            "is_ratio_above_cap": (rho > tis_cap).mean(), "seq_is_ratio_above_cap": (-seq_d > np.log(tis_cap)).mean()}
    if inference_full is not None:
        if training_full is None or len(inference_full) != len(inf) or len(training_full) != len(inf):
            raise ValueError("the exact KL needs both sides' full distributions, one (T, V) array per response")
        exact = [exact_terms(p, q) for p, q in zip(inference_full, training_full)]
        if [len(e) for e in exact] != list(lengths):
            raise ValueError("full distributions must have one row per sampled token of their response")
        out["exact_kl"] = np.concatenate(exact).mean()
        out["exact_kl_per_sequence"] = np.array([e.sum() for e in exact])[lengths > 0].mean()
    return {k: v if k in ("tokens", "sequences") else float(v) for k, v in out.items()}


def _spread(mean: float, sq_mean: float) -> dict:
    """verl's rollout_is_std and rollout_is_eff_sample_size from the clamped weights' first two moments."""
    return {"is_ratio_std": math.sqrt(max(sq_mean - mean**2, 0.0)), "is_ess": (mean + 1e-8) ** 2 / sq_mean}


PREFIX = "mismatch/"
_COUNTS = ("tokens", "sequences", "nonfinite")
# how each statistic pools: a mean over tokens, a mean over responses, a maximum, a minimum (`across_ranks`)
_TOKEN_MEANS = ("k1", "k3", "abs_diff_mean", "is_ratio_mean", "chi2_token", "tis_weight_mean", "is_ratio_above_cap",
                "is_ratio_below_floor", "is_ratio_clamped_mean", "is_ratio_clamped_sq_mean", "exact_kl")
_SEQUENCE_MEANS = ("k1_per_sequence", "k3_per_sequence", "seq_is_ratio_above_cap", "exact_kl_per_sequence", "chi2_seq")
_MAXIMA, _MINIMA = ("abs_diff_max", "is_ratio_max"), ("is_ratio_min",)
# our key -> another trainer's key for the same quantity on the same masked tokens (the tables above: "equal")
ALSO_AS = {
    "verl": {"k1": "rollout_corr/kl", "k3": "rollout_corr/k3_kl", "chi2_token": "rollout_corr/chi2_token",
             "chi2_seq": "rollout_corr/chi2_seq"},
    "trl": {"abs_diff_mean": "sampling/sampling_logp_difference/mean",
            "abs_diff_max": "sampling/sampling_logp_difference/max"},
}


# verl's documented warning levels: our key -> (verl's key, whether the value is healthy, what verl says past it)
VERL_WARNING_LEVELS = {
    "k1": ("rollout_corr/kl", lambda v: abs(v) <= 0.1, "KL divergence indicates significant off-policy gap"),
    "chi2_token": ("rollout_corr/chi2_token", lambda v: v <= 1.0, "chi-squared divergence indicates severe distribution shift"),
    "tis_weight_mean": ("rollout_corr/rollout_is_mean", lambda v: 0.5 <= v <= 2.0, "mean IS weight is far from 1.0"),
}


def alerts(metrics: dict[str, float]) -> list[str]:
    """verl's warning levels past which `metrics` (from `mismatch_metrics`) are: one line each, naming our key, verl's
    and the value; none for a batch without tokens."""
    return [f"{PREFIX}{key} ({theirs}) = {metrics[PREFIX + key]:.3g}: {what}"
            for key, (theirs, healthy, what) in VERL_WARNING_LEVELS.items()
            if PREFIX + key in metrics and np.isfinite(metrics[PREFIX + key]) and not healthy(metrics[PREFIX + key])]


PLACEHOLDER_BELOW = math.log(0.99)  # a token the trainer gives under 99% that the engine calls certain (logprob 0)
ONE_SIDED_SHARE, ONE_SIDED_K1, ONE_SIDED_TOKENS = 0.9, 0.01, 32  # rounding moves both ways; a truncated sampler, one
DUPLICATE_CHANCE = 1e-3  # a group of identical responses is suspect where independent draws agree this rarely


def masquerades(inference_logprobs: torch.Tensor, training_logprobs: torch.Tensor, mask: torch.Tensor,
                token_ids: torch.Tensor | None = None, group_size: int | None = None) -> dict[str, str]:
    """What looks like mismatch but is not rounding, a message per kind found (none on a clean batch; inputs as
    `mismatch_metrics`'s, `token_ids` (B, T) the responses' tokens, groups of `group_size` consecutive responses):

    - non-finite logprobs on response tokens (a side returned NaN or inf: a failed scoring, not a gap);
    - placeholder logprobs: the engine says exactly 0 (certain) where the trainer gives the token under 99%, as a
      padded or masked position filled with 0 does;
    - a one-sided gap: the engine's logprob above the trainer's on at least 90% of at least 32 tokens, k1 above 0.01
      nats: what logprobs of a top-p/top-k-truncated or temperature-scaled distribution give against the trainer's full
      softmax (rounding moves both ways); a heuristic, stated as such;
    - duplicated samples: groups whose responses are all the same tokens although independent draws would rarely agree
      (the engine gives the response probability p; G alike, p^(G-1) < DUPLICATE_CHANCE): a seed reused across a
      group's requests. Every advantage is 0, which stalls learning without any mismatch.
    """
    keep = mask.detach().cpu() != 0
    inf, train = inference_logprobs.detach().cpu().double(), training_logprobs.detach().cpu().double()
    found = {}
    nonfinite = int((keep & ~(torch.isfinite(inf) & torch.isfinite(train))).sum())
    if nonfinite:
        found["nonfinite"] = (f"{nonfinite} response tokens have a non-finite logprob on one side: a scoring failure, "
                              "left out of the mismatch (mismatch/nonfinite)")
    keep &= torch.isfinite(inf) & torch.isfinite(train)
    placeholders = int((keep & (inf == 0) & (train < PLACEHOLDER_BELOW)).sum())
    if placeholders:
        found["placeholder"] = (f"{placeholders} of {int(keep.sum())} response tokens have an engine logprob of exactly 0 "
                                "where the trainer gives them under 99%: placeholder logprobs (padding or masked "
                                "positions filled with 0?), not rounding")
    d = (inf - train)[keep]
    above = float((d > 0).double().mean()) if len(d) else 0.0
    if len(d) >= ONE_SIDED_TOKENS and above >= ONE_SIDED_SHARE and float(d.mean()) > ONE_SIDED_K1:
        found["one-sided"] = (f"the engine's logprob is above the trainer's on {above:.0%} of {len(d)} tokens (k1 "
                              f"{float(d.mean()):.3g} nats): logprobs of a truncated (top-p/top-k) or temperature-scaled "
                              "sampling distribution against the trainer's full softmax? Rounding moves both ways")
    if token_ids is not None and group_size and group_size > 1:
        rows = [tuple(t[k].tolist()) for t, k in zip(token_ids.detach().cpu(), mask.detach().cpu() != 0)]
        logp = [float(row[k].sum()) for row, k in zip(inf.nan_to_num(0.0), keep)]  # each response's engine logprob
        starts = range(0, len(rows) - group_size + 1, group_size)
        # A confident model draws one response again and again; a reused seed draws any response again. Flag a group
        # only where independent draws would agree rarely: the response's probability p, all alike with p^(G-1).
        alike = [i for i in starts if len(set(rows[i:i + group_size])) == 1
                 and (group_size - 1) * logp[i] < math.log(DUPLICATE_CHANCE)]
        if alike:
            found["duplicates"] = (f"{len(alike)} of {len(starts)} groups hold {group_size} identical responses that "
                                   f"independent draws would give together with probability under {DUPLICATE_CHANCE:g}: "
                                   "every advantage 0 (one seed for the whole group?), no learning signal, whatever "
                                   "the mismatch")
    return found


def with_names_of(metrics: dict[str, float], trainers=()) -> dict[str, float]:
    """`metrics` and, for each trainer in `trainers` ("verl", "trl"), its keys that are the same quantity."""
    unknown = set(trainers) - set(ALSO_AS)
    if unknown or isinstance(trainers, str):
        raise ValueError(f"also_as takes a tuple of {', '.join(ALSO_AS)}; got {trainers!r}")
    aliases = {theirs: metrics[PREFIX + ours] for name in trainers for ours, theirs in ALSO_AS[name].items()
               if PREFIX + ours in metrics}
    return metrics | aliases


def _masked_rows(x: torch.Tensor, keep: torch.Tensor) -> list[np.ndarray]:
    """The kept entries of each row of a (B, T) or (B, T, V) tensor, as float64 arrays."""
    return [row[k].detach().to("cpu", torch.float64).numpy() for row, k in zip(x, keep)]


def _without_nan(full: torch.Tensor) -> torch.Tensor:
    """(B, T): whether each position's (V,) log-distribution holds no NaN (-inf is a zero probability), one row of
    the batch at a time (memory T * V)."""
    rows = [~torch.isnan(row.detach()).any(-1).cpu() for row in full]
    return torch.stack(rows) if rows else torch.zeros(full.shape[:2], dtype=torch.bool)  # an empty batch (a rank's)


def distributed() -> bool:
    """A process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def across_ranks(metrics: dict[str, float], group=None) -> dict[str, float]:
    """One rank's `mismatch_metrics` made those of every rank's tokens together (a collective: every rank calls it
    with the same keys). Means are pooled from each rank's sums (its mean times its tokens or responses), so the
    result equals one process's metrics of the whole batch up to float64 rounding."""
    stats = {k.removeprefix(PREFIX): v for k, v in metrics.items()}
    n = {"tokens": stats["tokens"], "sequences": stats["sequences"]}
    token_keys, seq_keys = [k for k in _TOKEN_MEANS if k in stats], [k for k in _SEQUENCE_MEANS if k in stats]
    sums = [stats[k] * n["tokens"] if n["tokens"] else 0.0 for k in token_keys]
    sums += [stats[k] * n["sequences"] if n["sequences"] else 0.0 for k in seq_keys]
    totals = torch.tensor([stats[k] for k in _COUNTS] + sums, dtype=torch.float64)
    extremes = torch.tensor([stats[k] if n["tokens"] else -np.inf for k in _MAXIMA]
                            + [-stats[k] if n["tokens"] else -np.inf for k in _MINIMA], dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    counts, sums = dict(zip(_COUNTS, totals[:len(_COUNTS)].tolist())), totals[len(_COUNTS):].tolist()
    out = dict(counts)
    for key, total in zip(token_keys + seq_keys, sums):
        by = counts["tokens"] if key in token_keys else counts["sequences"]
        out[key] = total / by if by else np.nan
    for i, key in enumerate(_MAXIMA + _MINIMA):
        value = extremes[i].item() if counts["tokens"] else np.nan
        out[key] = -value if key in _MINIMA else value
    if "is_ratio_std" in stats:  # made of pooled moments, not pooled themselves
        out |= (_spread(out["is_ratio_clamped_mean"], out["is_ratio_clamped_sq_mean"]) if counts["tokens"]
                else {"is_ratio_std": np.nan, "is_ess": np.nan})
    return {PREFIX + k: float(v) for k, v in out.items()}


def mismatch_metrics(inference_logprobs: torch.Tensor, training_logprobs: torch.Tensor, mask: torch.Tensor,
                     inference_full: torch.Tensor | None = None, training_full: torch.Tensor | None = None,
                     tis_cap: float = TIS_CAP, across: bool | None = None, also_as=()) -> dict[str, float]:
    """The mismatch metrics of one batch (keys and units in the module docstring).

    inference_logprobs, training_logprobs, mask: (B, T), the logprob of each sampled token on each side and
    which positions are response tokens (bool or 0/1). inference_full, training_full: optional (B, T, V)
    log-probabilities over the vocabulary from both sides, for mismatch/exact_kl; they are converted one
    response at a time, so memory grows with T * V, not B * T * V.
    across: pool every rank's tokens (`across_ranks`, a collective); None: where a process group of more than one
    rank is running. also_as: trainers ("verl", "trl") whose keys for the same quantities are added (`ALSO_AS`).
    """
    with_names_of({}, also_as)  # a bad name fails before any work
    if not (inference_logprobs.shape == training_logprobs.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(f"logprobs and mask must share one (B, T) shape: {tuple(inference_logprobs.shape)}, "
                         f"{tuple(training_logprobs.shape)}, {tuple(mask.shape)}")
    keep = mask.detach().cpu() != 0
    finite = torch.isfinite(inference_logprobs.detach().cpu()) & torch.isfinite(training_logprobs.detach().cpu())
    full = None
    if (inference_full is None) != (training_full is None):
        raise ValueError("the exact KL needs both sides' full distributions")
    if inference_full is not None:
        if inference_full.shape != training_full.shape or inference_full.shape[:2] != mask.shape:
            raise ValueError(f"full distributions must be (B, T, V) on both sides: {tuple(inference_full.shape)}, "
                             f"{tuple(training_full.shape)} for a mask of {tuple(mask.shape)}")
        finite &= _without_nan(inference_full) & _without_nan(training_full)
    nonfinite = int((keep & ~finite).sum())
    keep &= finite
    if inference_full is not None:
        full = _masked_rows(inference_full, keep), _masked_rows(training_full, keep)
    summary = mismatch_summary(_masked_rows(inference_logprobs, keep), _masked_rows(training_logprobs, keep),
                               *(full or (None, None)), tis_cap=tis_cap)
    metrics = {PREFIX + k: float(v) for k, v in summary.items()} | {PREFIX + "nonfinite": float(nonfinite)}
    metrics = across_ranks(metrics) if (distributed() if across is None else across) else metrics
    return with_names_of(metrics, also_as)


def combine(records: list[dict[str, float]]) -> dict[str, float]:
    """Several steps' metrics as one: counts summed, `_max` / `_min` keys by max / min, the rest averaged
    over steps (each step one vote, as TRL averages its own metrics between logs). Steps without tokens
    are left out."""
    records = [r for r in records if r.get(PREFIX + "tokens", 0) > 0]
    out = {}
    for key in dict.fromkeys(k for r in records for k in r):
        values = [r[key] for r in records if key in r]
        reduce = (sum if key.removeprefix(PREFIX) in _COUNTS else max if key.endswith("_max")
                  else min if key.endswith("_min") else np.mean)
        out[key] = float(reduce(values))
    return out


class MismatchMeter:
    """Collects the metrics of each step until the next log, for any training loop:

        meter = MismatchMeter()
        meter.record(rollout_log_probs, old_log_probs, response_mask)   # every step; returns that step's metrics
        logger.log(meter.flush())                                       # every logging step: combined, then reset

    It warns (once per rise) when the recent steps' k3 climbs above `warn_ratio` times its early level: the paper's
    first advice to a team is to log this gap and watch it before a collapse. With `alerts=True` it also warns when a
    step passes one of verl's warning levels (`alerts`), once until that step's value is healthy again.
    """

    def __init__(self, tis_cap: float = TIS_CAP, across: bool | None = None, also_as=(), warn_ratio: float = 3.0,
                 baseline_steps: int = 5, window: int = 5, alerts: bool = False):
        with_names_of({}, also_as)
        self.tis_cap, self.across, self.also_as = tis_cap, across, tuple(also_as)  # as in `mismatch_metrics`
        self.alerts, self.firing = alerts, set()  # verl's warning levels: warn when one starts to fire
        self.masquerading: set[str] = set()  # the kinds of `masquerades` warned of (once each)
        self.warn_ratio, self.baseline_steps, self.window = warn_ratio, baseline_steps, window
        self.pending: list[dict[str, float]] = []
        self.k3_steps: list[float] = []  # every recorded step's k3, nats per token
        self.rising = False

    def record(self, inference_logprobs, training_logprobs, mask, inference_full=None, training_full=None,
               token_ids=None, group_size: int | None = None) -> dict:
        """One step's metrics (`mismatch_metrics`); warns, once per kind, of what only masquerades as mismatch
        (`masquerades`; duplicated samples need the responses' `token_ids` and the `group_size`)."""
        metrics = mismatch_metrics(inference_logprobs, training_logprobs, mask, inference_full, training_full,
                                   self.tis_cap, self.across)
        for kind, message in masquerades(inference_logprobs, training_logprobs, mask, token_ids, group_size).items():
            if kind not in self.masquerading:
                warnings.warn(f"not rounding: {message}", RuntimeWarning, stacklevel=2)
                self.masquerading.add(kind)
        self.pending.append(metrics)
        self.watch(metrics.get(f"{PREFIX}k3", np.nan))
        if self.alerts:
            lines = alerts(metrics)
            for line in lines:
                if line.split(" ", 1)[0] not in self.firing:
                    warnings.warn(f"verl's warning level passed: {line}", RuntimeWarning, stacklevel=2)
            self.firing = {line.split(" ", 1)[0] for line in lines}
        return metrics

    def watch(self, k3: float) -> None:
        """One more step's k3 (nats per token; a loop that computes it itself calls this): warns when the mean of the
        last `window` steps exceeds `warn_ratio` times the median of the first `baseline_steps`."""
        self.k3_steps.append(k3)
        if len(self.k3_steps) < self.baseline_steps + self.window:
            return
        baseline = np.nanmedian(self.k3_steps[: self.baseline_steps])
        recent = np.nanmean(self.k3_steps[-self.window :])
        rising = bool(baseline > 0 and recent > self.warn_ratio * baseline)
        if rising and not self.rising:
            warnings.warn(f"mismatch rising: recent k3 {recent:.3g} nats per token is {recent / baseline:.1f}x its "
                          f"early level {baseline:.3g} (step {len(self.k3_steps)} recorded)", RuntimeWarning, stacklevel=3)
        self.rising = rising

    def flush(self) -> dict[str, float]:
        """The steps recorded since the last flush, combined (`combine`), with the `also_as` names; empty if none
        had tokens."""
        out, self.pending = combine(self.pending), []
        return with_names_of(out, self.also_as) if out else out


class MismatchCallback(MismatchMeter, TrainerCallback):
    """A `transformers.TrainerCallback` that adds the recorded mismatch metrics to the Trainer's logs.

        MismatchCallback().attach(trainer)     # a TRL GRPOTrainer: every rollout recorded, every log gets mismatch/*

    `attach` puts this callback first (the Trainer calls its reporting callbacks, wandb, tensorboard, ..., before the
    ones passed as `callbacks=[...]`, and they would log before these keys are added) and, on a trainer with TRL's
    `_generate_and_score_completions`, records each training rollout by itself: its `sampling_per_token_logps`
    (the engine's), `old_per_token_logps` (the trainer's) and `completion_mask`. TRL computes both only with
    `use_vllm=True` and `vllm_importance_sampling_correction=True` (its default); without them it warns once and
    logs nothing. Any other loop calls `callback.record(...)` where it holds both sides' logprobs. At each log the
    steps recorded since the previous one are combined into `logs` and into the entry the Trainer has just
    appended to `state.log_history`.
    """

    def attach(self, trainer, record_rollouts: bool = True) -> MismatchCallback:
        trainer.callback_handler.callbacks.insert(0, self)
        self.group_size = getattr(trainer, "num_generations", None)  # TRL: a prompt's responses are consecutive
        generate = getattr(trainer, "_generate_and_score_completions", None)
        if record_rollouts and generate is not None:
            def generate_and_record(*args, **kwargs):
                out = generate(*args, **kwargs)
                if trainer.model.training:
                    self._record_rollout(out)
                return out

            trainer._generate_and_score_completions = generate_and_record
        return self

    def _record_rollout(self, out: dict) -> None:
        if not {"sampling_per_token_logps", "old_per_token_logps"} <= out.keys():
            if not getattr(self, "_warned", False):
                warnings.warn("the rollout has no engine and trainer logprobs to compare: run TRL with use_vllm=True and "
                              "vllm_importance_sampling_correction=True, or call MismatchCallback.record yourself",
                              RuntimeWarning, stacklevel=3)
                self._warned = True
            return
        self.record(out["sampling_per_token_logps"], out["old_per_token_logps"],
                    out["completion_mask"] * out.get("tool_mask", 1), token_ids=out.get("completion_ids"),
                    group_size=self.group_size)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or any(k.startswith("eval_") for k in logs):
            return  # an evaluation's log: the training steps' metrics wait for the next training log
        metrics = self.flush()
        if not metrics:
            return
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
