"""One measurement run: vLLM samples responses, then every side scores the same tokens.

    run = measure("qwen3-tiny", modes=("compiled", "eager"), n_prompts=128, n_samples=8)
    run.pairs("vllm:compiled", "hf:bf16:none")       # input for rla_lib.kl.compare
    run.save(path); MismatchRun.load(path)

Sides are named `vllm:<mode>` (the engine), `hf:bf16:<config>` (Transformers BF16, stock when the
config is `none`, else aligned with those regions) and `hf:fp32` (Transformers FP32). Only response
tokens are kept: they are what a policy-gradient update uses. Full next-token distributions are kept
where the vocabulary is small; otherwise only the scored tokens' logprobs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np

from . import kl, task
from .models import load_model, resolve_model
from .paths import RESULTS_DIR, atomic_write
from .scoring import response_tokens, token_logprobs

FULL_VOCAB_LIMIT = 4096


def fingerprint(model_dir: Path) -> str:
    """Changes when the checkpoint or the code that scores it changes (keys the results cache)."""
    h = hashlib.sha1()
    for f in sorted(Path(model_dir).glob("*.safetensors")) + [Path(model_dir) / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for module in ("align.py", "scoring.py", "engine.py", "mismatch.py"):
        h.update((Path(__file__).parent / module).read_bytes())
    return h.hexdigest()[:12]


def config_name(regions) -> str:
    return "+".join(regions) if regions else "none"


def all_configs(regions) -> list[tuple[str, ...]]:
    """Every subset of the regions, smallest first: the rows of the paper's Table 1."""
    return [c for r in range(len(regions) + 1) for c in combinations(regions, r)]


@dataclass
class MismatchRun:
    """Per-side scores of the same response tokens, stored flat with per-sequence offsets."""

    sequences: list[list[int]]
    starts: list[int]  # index into a sequence's per-position scores where its response begins
    rewards: np.ndarray
    token_lp: dict[str, np.ndarray] = field(default_factory=dict)  # side -> (n_tokens,)
    full: dict[str, np.ndarray] = field(default_factory=dict)  # side -> (n_tokens, vocab)
    meta: dict = field(default_factory=dict)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) - 1 - st for s, st in zip(self.sequences, self.starts)])

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)])

    @property
    def sides(self) -> list[str]:
        return list(self.token_lp)

    @property
    def estimators(self) -> tuple[str, ...]:
        """The KL estimators this run supports: exact needs full distributions (small vocabulary)."""
        return ("sampled", "k3", "exact") if self.full else ("sampled", "k3")

    def add(self, side: str, per_sequence_lp, per_sequence_full=None) -> None:
        """Keep the response part of per-position scores (entry t scores token t+1)."""
        self.token_lp[side] = response_tokens(per_sequence_lp, self.starts).astype(np.float32)
        if per_sequence_full is not None:
            self.full[side] = response_tokens(per_sequence_full, self.starts).astype(np.float32)

    def pairs(self, inference: str, training: str) -> list[dict]:
        """Per-sequence inputs for `rla_lib.kl` estimators."""
        for side in (inference, training):
            if side not in self.token_lp:
                raise KeyError(f"side {side!r} was not measured; have {self.sides}")
        o = self.offsets
        has_full = inference in self.full and training in self.full
        return [
            dict(inf_lp=self.token_lp[inference][a:b], train_lp=self.token_lp[training][a:b],
                 inf_full=self.full[inference][a:b] if has_full else None,
                 train_full=self.full[training][a:b] if has_full else None)
            for a, b in zip(o[:-1], o[1:])
        ]

    def per_sequence_sums(self, inference: str, training: str, estimator: str):
        """(sums, counts) of an estimator's per-token terms per sequence: what bootstraps resample."""
        t = [kl.terms(estimator, p) for p in self.pairs(inference, training)]
        return np.array([x.sum() for x in t]), np.array([len(x) for x in t])

    # ---- persistence (atomic) ------------------------------------------------------------
    def save(self, path: Path) -> Path:
        arrays = {f"lp::{k}": v for k, v in self.token_lp.items()} | {f"full::{k}": v for k, v in self.full.items()}
        lengths = np.array([len(s) for s in self.sequences])
        return atomic_write(path, lambda tmp: np.savez_compressed(
            tmp, ids=np.concatenate(self.sequences), seq_lengths=lengths, starts=np.array(self.starts),
            rewards=self.rewards, meta=np.array(json.dumps(self.meta)), **arrays))

    @classmethod
    def load(cls, path: Path) -> "MismatchRun":
        z = np.load(path)
        bounds = np.concatenate([[0], np.cumsum(z["seq_lengths"])])
        seqs = [z["ids"][a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        run = cls(seqs, z["starts"].tolist(), z["rewards"], meta=json.loads(str(z["meta"])))
        for key in z.files:
            if key.startswith("lp::"):
                run.token_lp[key[4:]] = z[key]
            elif key.startswith("full::"):
                run.full[key[6:]] = z[key]
        return run


def sample_responses(engine, n_prompts: int, n_samples: int, max_tokens: int, temperature: float, seed: int):
    """Responses to held-out task prompts, sampled by the engine: sequences, response starts, rewards."""
    problems = task.load_split()[:n_prompts]
    groups = engine.sample([p.prompt for p in problems], n=n_samples, max_tokens=max_tokens, temperature=temperature, seed=seed)
    samples = [(p, s) for p, g in zip(problems, groups) for s in g if s.response_ids]
    return ([s.ids for _, s in samples], [len(s.prompt_ids) - 1 for _, s in samples],
            np.array([task.reward(p, s.text) for p, s in samples]))


def score_training_side(run: MismatchRun, model, side: str, full: bool) -> None:
    res = token_logprobs(model, run.sequences, full_vocab=full)
    run.add(side, [r[0] for r in res] if full else res, [r[1] for r in res] if full else None)


def measure(
    model: str = "qwen3-tiny",
    modes=("compiled", "eager"),
    training_configs: dict | None = None,
    n_prompts: int = 128,
    n_samples: int = 8,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    fp32_reference: bool = True,
    cache_dir: Path | None = RESULTS_DIR / "mismatch",
    progress: bool = False,
) -> MismatchRun:
    """Sample with the first engine mode, score with every mode and every training configuration.

    training_configs maps a name to (regions, align options); by default the 8 subsets of the three
    regions with the paper's options. With cache_dir set, a finished run is saved under a key of all
    arguments, the checkpoint and the scoring code, and loaded instead of recomputed.
    """
    from .align import REGIONS, align

    spec = resolve_model(model)
    if training_configs is None:
        training_configs = {config_name(c): (c, {}) for c in all_configs(REGIONS)}
    key_src = json.dumps(dict(model=str(spec.path), modes=list(modes), configs={k: [list(v[0]), v[1]] for k, v in training_configs.items()},
                              n_prompts=n_prompts, n_samples=n_samples, max_tokens=max_tokens, temperature=temperature,
                              seed=seed, fp32=fp32_reference, fingerprint=fingerprint(spec.path)), sort_keys=True)
    cache = Path(cache_dir) / f"{spec.path.name}-{hashlib.sha1(key_src.encode()).hexdigest()[:12]}.npz" if cache_dir else None
    if cache is not None and cache.exists():
        return MismatchRun.load(cache)

    from .engine import Engine

    full = spec.vocab_size <= FULL_VOCAB_LIMIT
    run = None
    for i, mode in enumerate(modes):
        with Engine(model, mode=mode, seed=seed) as engine:
            if run is None:
                seqs, starts, rewards = sample_responses(engine, n_prompts, n_samples, max_tokens, temperature, seed)
                run = MismatchRun(seqs, starts, rewards, meta=json.loads(key_src) | {"sampled_by": f"vllm:{mode}"})
            scores = engine.score(run.sequences, full_vocab=full, progress=progress)
            run.add(f"vllm:{mode}", [s.token_logprobs for s in scores], [s.full for s in scores] if full else None)
    train = load_model(model, dtype="bfloat16")
    for name, (regions, options) in training_configs.items():
        handle = align(train, tuple(regions), **options)
        score_training_side(run, train, f"hf:bf16:{name}", full)
        handle.undo()
    if fp32_reference:
        score_training_side(run, load_model(model, dtype="float32"), "hf:fp32", full)
    if cache is not None:
        run.save(cache)
    return run


def table(run: MismatchRun, inference: str, trainings, estimators=("sampled", "k3", "exact"), n_boot: int = 2000, seed: int = 0):
    """One row per training side: each estimator's value, se and 95% CI (1e-4), tokens."""
    import pandas as pd

    rows = []
    for side in trainings:
        est = kl.compare(run.pairs(inference, side), estimators=estimators, n_boot=n_boot, seed=seed)
        row = {"training side": side}
        for e, v in est.items():
            row |= {f"{e}": v.value, f"{e} se": v.se, f"{e} ci_low": v.ci_low, f"{e} ci_high": v.ci_high}
        row["tokens"] = next(iter(est.values())).n_tokens
        rows.append(row)
    return pd.DataFrame(rows).set_index("training side")
