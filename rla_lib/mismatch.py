"""One measurement run: vLLM samples responses, then every side scores the same tokens.

    run = measure("qwen3-tiny", modes=("compiled", "eager"))           # STANDARD sizes: 512 prompts x 2
    run.estimate("vllm:compiled", "hf:bf16:none", "exact")              # a kl.Estimate, prompt-level CI
    run.difference("vllm:compiled", "hf:bf16:none", "hf:bf16:rope+swiglu+residual_norm")   # paired change
    run.save(path); MismatchRun.load(path)

Sides are named as everywhere (`rla_lib.sides`): `vllm:<mode>` (the engine), `hf:bf16:<config>` (Transformers
BF16, stock when the config is `none`, else aligned with those regions) and `hf:fp32` (Transformers FP32). Only response
tokens are kept: they are what a policy-gradient update uses. Full next-token distributions are kept
where the vocabulary is small; otherwise only the scored tokens' logprobs, and the exact KL of each
(engine mode, training side) pair is computed with the engine running, chunk by chunk over positions
(`rla_lib.exact_kl`), and kept as per-token terms. Each sequence keeps the
index of the held-out prompt it answers: the prompt is the unit of every error bar (`rla_lib.kl`).

One shared measurement: `measure` caches in layers, so notebooks asking for the same (model, engine
mode, training configuration) get the same arrays. The sampled responses are keyed by the model, the
scoring code, the sampling mode (the first of `modes`) and the sizes; each engine mode's scores and
each training side are then separate files in that folder, keyed by what they depend on (a training
side by its regions and options, not its name). A later call scores only what is missing.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd

from . import kl, sides, task
from .align import ALL_REGIONS, REGIONS, AlignOptions, align
from .engine import Engine, default_context
from .exact_kl import exact_kl
from .machine import bf16_matmul_mode, machine, machine_key
from .models import load_model, load_tokenizer, resolve_model
from .paths import RESULTS_DIR, atomic_write
from .progress import bar
from .prompts import check_room, prompt_ids
from .scoring import response_tokens, token_logprobs

# Default sizes for a trustworthy headline: many distinct prompts (the whole held-out split, the
# independent unit of the error bars) and two responses each, rather than many samples of few prompts.
STANDARD = dict(n_prompts=512, n_samples=2, max_tokens=32, seed=0)
# Which regions each rla_lib.align option acts on (an option is inert without its regions): two
# configurations that differ only in inert options score identically, so they share a name and a cache file.
OPTION_REGIONS = {"rope_cos_sin": ("rope",), "rope_qk_norm": ("rope",), "rope_rounding": ("rope",), "norm_weight": ("residual_norm",),
                  "residual_stream": ("residual_norm",), "fused": ("rope", "swiglu"), "attention": ("attention",),
                  "rms_sum": ("rope", "residual_norm")}


def exact_key(inference: str, training: str) -> str:
    """The key of a pair's exact-KL terms in `MismatchRun.exact`."""
    return f"{inference}|{training}"


def fingerprint(model_dir: Path) -> str:
    """Changes when the checkpoint or the code that scores it changes (keys the results cache)."""
    h = hashlib.sha1()
    for f in sorted(Path(model_dir).glob("*.safetensors")) + [Path(model_dir) / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(core_digest().encode())
    return h.hexdigest()[:12]


PACKAGE = Path(__file__).parent


def core_digest() -> str:
    """A digest of every core source file (`core_sources`): part of the key of every cache of engine or training-side
    values, so a change to the code that computes them is never answered from the cache."""
    h = hashlib.sha1()
    for source in core_sources():
        h.update(f"{source.relative_to(PACKAGE)}:".encode() + source.read_bytes())
    return h.hexdigest()


def core_sources() -> list[Path]:
    """Every source file of the core (Python, the C kernels and their header, the child processes' start-up code): any of them can
    change a score. The studies (`rla_lib.studies`) only read scores."""
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".h")
                  and not {"studies", "__pycache__"} & set(p.relative_to(PACKAGE).parts))


def canonical_config(regions, options=None) -> tuple[tuple[str, ...], dict]:
    """(regions in `ALL_REGIONS` order, only the options that differ from their default and act on those regions)."""
    regions = tuple(regions)
    unknown = sorted(set(regions) - set(ALL_REGIONS)) + sorted(set(options or {}) - set(OPTION_REGIONS))
    if unknown:
        raise ValueError(f"unknown region(s) or option(s) {unknown}")
    defaults = AlignOptions()
    kept = {k: v for k, v in sorted((options or {}).items())
            if v != getattr(defaults, k) and set(OPTION_REGIONS[k]) & set(regions)}
    return tuple(r for r in ALL_REGIONS if r in regions), kept


def config_name(regions, **options) -> str:
    """A training configuration's name: regions joined by '+' ('none' for stock), then '|option=value' for
    each non-default option that acts on those regions (`config_name(("rope",), rope_cos_sin="bf16")`)."""
    name = "+".join(regions) if regions else "none"
    _, kept = canonical_config(regions, options) if options else ((), {})
    return name + "".join(f"|{k}={v}" for k, v in kept.items())


def all_configs(regions) -> list[tuple[str, ...]]:
    """Every subset of the regions, smallest first: the rows of the paper's Table 1."""
    return [c for r in range(len(regions) + 1) for c in combinations(regions, r)]


def paper_configs() -> dict[str, tuple[tuple[str, ...], dict]]:
    """The paper's Table 1 rows (every subset of the regions), RoPE in both cos/sin readings:
    FP32 (this project's reading of the paper) and BF16 (vLLM's cos/sin cache)."""
    configs = {config_name(c): (c, {}) for c in all_configs(REGIONS)}
    return configs | {config_name(c, rope_cos_sin="bf16"): (c, {"rope_cos_sin": "bf16"}) for c in all_configs(REGIONS) if "rope" in c}


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


# ---- the two cache layers: sampled responses, then one file per scored side --------------------
def sample_key(model_dir: Path, sampled_by: str, n_prompts: int, n_samples: int, max_tokens: int,
               temperature: float, seed: int, prompts: list[list[int]] | None = None) -> dict:
    """What the sampled responses depend on (the folder of every side scored on them): the engine's machine, not the
    training side's matmul mode (which keys each training side's file instead, `side_file`); the prompts' tokens
    where they are the caller's rather than the task's held-out split."""
    key = dict(model=str(model_dir), fingerprint=fingerprint(model_dir), machine=machine_key(engine_only=True),
               sampled_by=sampled_by, n_prompts=n_prompts, n_samples=n_samples, max_tokens=max_tokens,
               temperature=temperature, seed=seed)
    if prompts is not None:
        key["prompts"] = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:16]
    return key


def cache_folder(cache_dir: Path | None, key: dict) -> Path | None:
    if cache_dir is None:
        return None
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{Path(key['model']).name}-{digest}"


def side_file(folder: Path | None, dtype: str, regions=(), options=None) -> Path | None:
    """The cache file of a training side: named by what it computes (dtype, canonical regions and options, and how
    BF16 linear layers multiply: `machine.bf16_matmul_mode`)."""
    if folder is None:
        return None
    regions, options = canonical_config(regions, options)
    matmul = bf16_matmul_mode() if dtype == "bfloat16" else None
    digest = hashlib.sha1(json.dumps([dtype, regions, options] + ([matmul] if matmul != "native" else []),
                                     sort_keys=True).encode()).hexdigest()[:10]
    return folder / f"hf-{dtype}-{config_name(regions)}-{digest}.npz"


def load_side(run: MismatchRun, side: str, path: Path | None) -> bool:
    """Put a cached side into `run` if `path` holds scores of exactly these tokens; False otherwise."""
    if path is None or not path.exists():
        return False
    with np.load(path) as z:
        if str(z["tokens"]) != run.tokens_digest() or len(z["lp"]) != run.lengths.sum():
            return False  # scored on other tokens (samples regenerated): score again
        run.token_lp[side] = z["lp"]
        if "full" in z.files:
            run.full[side] = z["full"]
    return True


def save_side(run: MismatchRun, side: str, path: Path | None) -> None:
    if path is None:
        return
    arrays = dict(lp=run.token_lp[side]) | ({"full": run.full[side]} if side in run.full else {})
    atomic_write(path, lambda tmp: np.savez_compressed(tmp, tokens=np.array(run.tokens_digest()), **arrays))


def load_or_score_side(run: MismatchRun, side: str, path: Path | None, score) -> bool:
    """Load `side` from `path`, or call `score(run, side)` (which adds it to run) and save it there.
    Returns True when it was loaded from the cache."""
    if load_side(run, side, path):
        return True
    score(run, side)
    if side not in run.token_lp:
        raise RuntimeError(f"the scorer did not add side {side!r}")
    save_side(run, side, path)
    return False


def load_or_score_exact(run: MismatchRun, inference: str, side: str, path: Path | None, score) -> None:
    """The exact-KL terms of (inference, side) from `path` if they were computed on these tokens, else
    `score()` (per-token terms), saved there."""
    key = exact_key(inference, side)
    if path is not None and path.exists():
        with np.load(path) as z:
            if str(z["tokens"]) == run.tokens_digest() and len(z["exact"]) == run.lengths.sum():
                run.exact[key] = z["exact"]
                return
    run.exact[key] = score()
    if path is not None:
        atomic_write(path, lambda tmp: np.savez_compressed(tmp, tokens=np.array(run.tokens_digest()), exact=run.exact[key]))


def load_or_sample(folder: Path | None, sample) -> MismatchRun:
    """The sampled responses (no sides) from `folder`, or `sample()` saved there."""
    path = None if folder is None else folder / "samples.npz"
    if path is not None and path.exists():
        return MismatchRun.load(path)
    run = sample()
    if path is not None:
        MismatchRun(run.sequences, run.starts, run.rewards, run.prompts, meta=run.meta).save(path)
    return run


def copy_side(run: MismatchRun, source: str, side: str) -> None:
    """Another name for the same computation (same regions and options): the same arrays."""
    run.token_lp[side] = run.token_lp[source]
    if source in run.full:
        run.full[side] = run.full[source]
    for key in [k for k in run.exact if k.endswith("|" + source)]:
        run.exact[key.removesuffix(source) + side] = run.exact[key]


# ---- measuring ----------------------------------------------------------------------------------
def sample_responses(engine, n_prompts: int, n_samples: int, max_tokens: int, temperature: float, seed: int,
                     progress: bool | None = None, prompts: list[list[int]] | None = None):
    """Responses sampled by the engine: sequences, response starts, rewards, and the prompt each answers (its index
    into the held-out split, or into `prompts`, the caller's token ids: their rewards are NaN, nothing checks them)."""
    problems = task.load_split() if prompts is None else None
    if problems is not None and n_prompts > len(problems):
        raise ValueError(f"n_prompts={n_prompts}, but the held-out split has {len(problems)} problems")
    inputs = [p.prompt for p in problems[:n_prompts]] if prompts is None else prompts
    forced = {} if progress is None else {"progress": progress}  # None: the engine's default (bars in a kernel)
    groups = engine.sample(inputs, n=n_samples, max_tokens=max_tokens, temperature=temperature, seed=seed, **forced)
    samples = [(i, s) for i, g in enumerate(groups) for s in g if s.response_ids]
    rewards = [np.nan if problems is None else task.reward(problems[i], s.text) for i, s in samples]
    return ([s.ids for _, s in samples], [s.response_start for _, s in samples], np.array(rewards, np.float64),
            np.array([i for i, _ in samples], np.int64))


def _temperature_kwargs(temperature: float) -> dict:
    """Scorers get the sampling temperature only when it is not 1 (at 1 both score bit for bit as without it)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return {} if temperature == 1.0 else {"temperature": temperature}


def score_training_side(run: MismatchRun, model, side: str, full: bool, temperature: float = 1.0) -> None:
    res = token_logprobs(model, run.sequences, full_vocab=full, **_temperature_kwargs(temperature))
    run.add(side, [r[0] for r in res] if full else res, [r[1] for r in res] if full else None)


def _score_engine_modes(run, model, modes, folder, key, full, temperature, progress, prompts=None,
                        exact_scorers=None) -> MismatchRun:
    """Sample with the first mode (unless cached), then add every mode's scores (each cached on its own); with
    `exact_scorers` (a large vocabulary) also each mode's exact KL against those training sides, with the same
    engine. An engine starts once per mode, and only where something of that mode is not cached."""
    t_kwargs = _temperature_kwargs(temperature)
    for mode in bar(modes, progress, desc="vLLM modes", leave=False):
        side, path = sides.engine(mode), None if folder is None else folder / f"vllm-{mode}.npz"
        with ExitStack() as stack:
            running = []  # this mode's engine, once started: its scores and its exact KL share it

            def engine():
                if not running:
                    running.append(stack.enter_context(Engine(model, mode=mode, seed=key["seed"])))
                return running[0]

            if run is None:  # the first mode samples
                run = load_or_sample(folder, lambda: MismatchRun(
                    *sample_responses(engine(), key["n_prompts"], key["n_samples"], key["max_tokens"], temperature,
                                      key["seed"], progress, prompts),
                    meta=dict(key) | {"machine_info": machine()}))
            if not load_side(run, side, path):
                def score(run, side):
                    scores = engine().score(run.sequences, full_vocab=full, progress=progress, **t_kwargs)
                    run.add(side, [s.token_logprobs for s in scores], [s.full for s in scores] if full else None)

                load_or_score_side(run, side, path, score)
            if exact_scorers:
                _exact_at_large_vocab(run, model, mode, engine, exact_scorers, folder, temperature, progress)
    return run


def _score_training_sides(run, model, scorers: dict, folder, full, temperature, progress=None) -> None:
    """Add every training side (side -> (dtype, regions, options)); the model of a dtype is loaded only if some
    side of it must be scored."""
    loaded, done = {}, {}
    for side, (dtype, regions, options) in bar(scorers.items(), progress, total=len(scorers), desc="training sides", leave=False):
        path = side_file(folder, dtype, regions, options)
        identity = (dtype, json.dumps(canonical_config(regions, options)))
        if identity in done:
            copy_side(run, done[identity], side)
            continue

        def score(run, side):
            if dtype not in loaded:
                loaded[dtype] = load_model(model, dtype=dtype)
            handle = align(loaded[dtype], tuple(regions), **options) if dtype == "bfloat16" else None
            try:
                score_training_side(run, loaded[dtype], side, full, temperature)
            finally:
                if handle is not None:
                    handle.undo()

        load_or_score_side(run, side, path, score)
        done[identity] = side


def _exact_at_large_vocab(run, model, mode, engine, scorers: dict, folder, temperature, progress=None) -> None:
    """The exact KL of engine `mode` against every training side where whole distributions are too large to keep:
    the engine's hidden states once, then each training side chunk by chunk. `engine()`: that mode's engine (started
    on first use, so only if some pair is not cached)."""
    inference, hidden, loaded = sides.engine(mode), None, {}
    for side, (dtype, regions, options) in scorers.items():
        path = None if folder is None else folder / f"exact-{mode}-{side_file(folder, dtype, regions, options).name}"

        def score():
            nonlocal hidden
            if hidden is None:
                hidden = engine().prompt_hidden(run.sequences, progress)
            if dtype not in loaded:
                loaded[dtype] = load_model(model, dtype=dtype)
            handle = align(loaded[dtype], tuple(regions), **options) if dtype == "bfloat16" else None
            try:
                res = exact_kl(engine(), loaded[dtype], run.sequences, run.starts, temperature=temperature,
                               engine_hidden=hidden)
            finally:
                if handle is not None:
                    handle.undo()
            return np.concatenate(res.terms)  # exact_kl starts each sequence at its response

        load_or_score_exact(run, inference, side, path, score)


def measure(
    model: str = "qwen3-tiny",
    modes=("compiled", "eager"),
    training_configs: dict | None = None,
    n_prompts: int = STANDARD["n_prompts"],
    n_samples: int = STANDARD["n_samples"],
    max_tokens: int = STANDARD["max_tokens"],
    temperature: float = 1.0,
    seed: int = STANDARD["seed"],
    fp32_reference: bool = True,
    cache_dir: Path | None = RESULTS_DIR / "mismatch",
    progress: bool | None = None,
    prompts: list | None = None,
) -> MismatchRun:
    """Sample with the first engine mode, score with every mode and every training configuration.

    training_configs maps a name to (regions, align options); by default the 8 subsets of the three
    regions with the paper's options. With cache_dir set, the sampled responses, each engine mode's
    scores and each training side are cached separately (see the module docstring): a call with other
    modes or configurations reuses what is there and scores only what is missing. Two names with the
    same (regions, options) get the same arrays. cache_dir=None: no caching.
    temperature != 1: both the engine and Transformers score softmax(logits / T), the distribution the
    engine sampled from.
    progress: bars over the engine modes and training sides, and vLLM's own while it samples and scores
    (None: only in a Jupyter kernel, see `rla_lib.progress`).
    prompts: your own prompts instead of the task's held-out split (n_prompts is then their number): per prompt a
    text, a chat (a list of {"role", "content"} messages: the checkpoint's chat template applied) or token ids; see
    `rla_lib.prompts` (and `read_prompts` for a JSON-lines file). Their rewards are NaN.
    """
    _temperature_kwargs(temperature)  # fail before any engine starts
    spec = resolve_model(model)
    if prompts is not None:  # rendered and checked here, before any engine starts
        prompts = prompt_ids(prompts, load_tokenizer(spec), spec.name)
        check_room(prompts, max_tokens, default_context(spec))
        n_prompts = len(prompts)
    if training_configs is None:
        training_configs = {config_name(c): (c, {}) for c in all_configs(REGIONS)}
    key = sample_key(spec.path, sides.engine(modes[0]), n_prompts, n_samples, max_tokens, temperature, seed, prompts)
    folder = cache_folder(cache_dir, key)
    full = spec.small_vocab
    samples = None if folder is None else folder / "samples.npz"
    run = MismatchRun.load(samples) if samples is not None and samples.exists() else None
    scorers = {sides.training(name): ("bfloat16", tuple(regions), dict(options)) for name, (regions, options) in training_configs.items()}
    if fp32_reference:
        scorers[sides.FP32] = ("float32", (), {})
    # at a large vocabulary each mode's engine also gives the exact KL against every side, before it closes
    run = _score_engine_modes(run, spec, modes, folder, key, full, temperature, progress, prompts,
                              exact_scorers=None if full else scorers)
    _score_training_sides(run, spec, scorers, folder, full, temperature, progress)
    run.meta = dict(run.meta) | {"modes": list(modes), "fp32": fp32_reference,
                                 "configs": {k: [list(v[0]), dict(v[1])] for k, v in training_configs.items()}}
    return run


def table(run: MismatchRun, inference: str, trainings, estimators=("sampled", "k3", "exact"), n_boot: int = 2000, seed: int = 0):
    """One row per training side: each estimator's value, se and 95% CI (1e-4, prompt-level), tokens, prompts."""
    rows = []
    for side in trainings:
        est = kl.compare(run.pairs(inference, side), estimators=estimators, clusters=run.prompts, n_boot=n_boot, seed=seed)
        row = {"training side": side}
        for e, v in est.items():
            row |= {f"{e}": v.value, f"{e} se": v.se, f"{e} ci_low": v.ci_low, f"{e} ci_high": v.ci_high}
        first = next(iter(est.values()))
        row |= {"tokens": first.n_tokens, "prompts": first.n_clusters}
        rows.append(row)
    return pd.DataFrame(rows).set_index("training side")
