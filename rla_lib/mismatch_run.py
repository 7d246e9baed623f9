"""One measurement's result: every side's scores of the same response tokens, with the prompt each answers, and the
estimates and paired differences read from them (`rla_lib.kl`); saved and loaded as one file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import kl
from .paths import atomic_write
from .scoring import response_tokens


def exact_key(inference: str, training: str) -> str:
    """The key of a pair's exact-KL terms in `MismatchRun.exact`."""
    return f"{inference}|{training}"


@dataclass
class MismatchRun:
    """Per-side scores of the same response tokens, stored flat with per-sequence offsets."""

    sequences: list[list[int]]
    starts: list[int]  # index into a sequence's per-position scores where its response begins
    rewards: np.ndarray
    prompts: np.ndarray  # index (into the held-out split) of the prompt each sequence answers: the cluster
    token_lp: dict[str, np.ndarray] = field(default_factory=dict)  # side -> (n_tokens,)
    full: dict[str, np.ndarray] = field(default_factory=dict)  # side -> (n_tokens, vocab)
    exact: dict[str, np.ndarray] = field(default_factory=dict)  # exact_key(inference, training) -> (n_tokens,) FP64
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.prompts = np.asarray(self.prompts, dtype=np.int64)
        if len(self.prompts) != len(self.sequences):
            raise ValueError(f"one prompt index per sequence: {len(self.prompts)} for {len(self.sequences)} sequences")

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
        """The KL estimators this run supports: exact needs full distributions (small vocabulary) or its terms."""
        return ("sampled", "k3", "exact") if self.full or self.exact else ("sampled", "k3")

    def estimators_for(self, inference: str, training: str) -> tuple[str, ...]:
        """The estimators one pair supports: at a large vocabulary the exact KL exists for the (engine, training
        side) pairs `measure` computed it for, not e.g. between two engine modes."""
        full = (inference in self.full and training in self.full) or exact_key(inference, training) in self.exact
        return ("sampled", "k3", "exact") if full else ("sampled", "k3")

    def add(self, side: str, per_sequence_lp, per_sequence_full=None) -> None:
        """Keep the response part of per-position scores (entry t scores token t+1)."""
        self.token_lp[side] = response_tokens(per_sequence_lp, self.starts).astype(np.float32)
        if per_sequence_full is not None:
            self.full[side] = response_tokens(per_sequence_full, self.starts).astype(np.float32)

    def subset(self, keep) -> MismatchRun:
        """The run of the sequences where `keep` (one bool per sequence) is true, every side's scores with them."""
        keep = np.asarray(keep, dtype=bool)
        o = self.offsets
        tokens = np.concatenate([np.arange(a, b) for a, b, k in zip(o[:-1], o[1:], keep) if k] or [np.arange(0)])
        return MismatchRun([s for s, k in zip(self.sequences, keep) if k], [st for st, k in zip(self.starts, keep) if k],
                           self.rewards[keep], self.prompts[keep], {s: v[tokens] for s, v in self.token_lp.items()},
                           {s: v[tokens] for s, v in self.full.items()}, {s: v[tokens] for s, v in self.exact.items()},
                           dict(self.meta))

    def split_prompts(self, share: float = 0.5, seed: int = 0) -> tuple[MismatchRun, MismatchRun]:
        """(probe, held-out): the prompts shuffled (seeded) and cut at `share`, each with all of its responses. A
        choice made on the probe run (e.g. the attention numerics closest to the engine) is then reported on prompts
        it was not made on."""
        prompts = np.unique(self.prompts)
        if len(prompts) < 2:
            raise ValueError(f"a split needs two prompts or more; this run has {len(prompts)}")
        shuffled = np.random.default_rng(seed).permutation(prompts)
        cut = min(max(1, round(share * len(prompts))), len(prompts) - 1)
        probe = np.isin(self.prompts, shuffled[:cut])
        return self.subset(probe), self.subset(~probe)

    def pairs(self, inference: str, training: str) -> list[dict]:
        """Per-sequence inputs for `rla_lib.kl` estimators."""
        for side in (inference, training):
            if side not in self.token_lp:
                raise KeyError(f"side {side!r} was not measured; have {self.sides}")
        o = self.offsets
        has_full = inference in self.full and training in self.full
        exact = self.exact.get(exact_key(inference, training))
        return [
            dict(inf_lp=self.token_lp[inference][a:b], train_lp=self.token_lp[training][a:b],
                 inf_full=self.full[inference][a:b] if has_full else None,
                 train_full=self.full[training][a:b] if has_full else None,
                 exact=None if exact is None else exact[a:b])
            for a, b in zip(o[:-1], o[1:])
        ]

    def per_sequence_sums(self, inference: str, training: str, estimator: str):
        """(sums, counts) of an estimator's per-token terms per sequence: what bootstraps resample
        (together with `prompts`, the cluster of each sequence)."""
        t = [kl.terms(estimator, p) for p in self.pairs(inference, training)]
        return np.array([x.sum() for x in t]), np.array([len(x) for x in t])

    def estimate(self, inference: str, training: str, estimator: str, n_boot: int = 2000, seed: int = 0) -> kl.Estimate:
        """One estimator's mismatch between two sides, with prompt-level error bars."""
        return kl.estimate([kl.terms(estimator, p) for p in self.pairs(inference, training)], clusters=self.prompts,
                           n_boot=n_boot, seed=seed)

    def difference(self, inference: str, a: str, b: str, estimator: str = "exact", n_boot: int = 2000,
                   seed: int = 0) -> kl.Difference:
        """The paired change in mismatch against `inference` from training side a to side b
        (e.g. a="hf:bf16:none", b="hf:bf16:rope+swiglu+residual_norm"), prompts resampled together."""
        a_sums, counts = self.per_sequence_sums(inference, a, estimator)
        b_sums, _ = self.per_sequence_sums(inference, b, estimator)
        return kl.paired_difference(a_sums, b_sums, counts, clusters=self.prompts, n_boot=n_boot, seed=seed)

    def bitwise_share(self, inference: str, training: str, n_boot: int = 2000, seed: int = 0) -> kl.Estimate:
        """The share of response tokens whose logprob on `training` is bit for bit the engine's, with a
        prompt-level CI (unit 1: a fraction)."""
        o, eq = self.offsets, (self.token_lp[inference] == self.token_lp[training]).astype(np.float64)
        return kl.estimate([eq[a:b] for a, b in zip(o[:-1], o[1:])], clusters=self.prompts, n_boot=n_boot, seed=seed, unit=1.0)

    def tokens_digest(self) -> str:
        """Identifies the sampled tokens: a cached side is only valid for the tokens it scored."""
        h = hashlib.sha1(np.concatenate([np.asarray(s, np.int64) for s in self.sequences]).tobytes())
        h.update(np.array([len(s) for s in self.sequences] + list(self.starts), np.int64).tobytes())
        return h.hexdigest()[:16]

    # ---- persistence (atomic) ------------------------------------------------------------
    def save(self, path: Path) -> Path:
        arrays = ({f"lp::{k}": v for k, v in self.token_lp.items()} | {f"full::{k}": v for k, v in self.full.items()}
                  | {f"exact::{k}": v for k, v in self.exact.items()})
        lengths = np.array([len(s) for s in self.sequences])
        return atomic_write(path, lambda tmp: np.savez_compressed(
            tmp, ids=np.concatenate(self.sequences), seq_lengths=lengths, starts=np.array(self.starts),
            rewards=self.rewards, prompts=self.prompts, meta=np.array(json.dumps(self.meta)), **arrays))

    @classmethod
    def load(cls, path: Path) -> "MismatchRun":
        with np.load(path) as z:
            if "prompts" not in z.files:
                raise ValueError(f"{path} was saved without the prompt of each sequence (an older rla_lib), so its error "
                                 "bars cannot resample prompts: delete this cache file and rerun the measurement.")
            bounds = np.concatenate([[0], np.cumsum(z["seq_lengths"])])
            seqs = [z["ids"][a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
            run = cls(seqs, z["starts"].tolist(), z["rewards"], z["prompts"], meta=json.loads(str(z["meta"])))
            for key in z.files:
                if key.startswith("lp::"):
                    run.token_lp[key[4:]] = z[key]
                elif key.startswith("full::"):
                    run.full[key[6:]] = z[key]
                elif key.startswith("exact::"):
                    run.exact[key[7:]] = z[key]
        return run
