"""The measurement's cache, in two layers: the sampled responses (a folder keyed by the model, the machine, the
sampling and the sizes), then one file per scored side in it, keyed by what it computes; every key holds a digest of
the code that computes scores (`core_digest`), so a change to it is never answered from the cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .machine import bf16_matmul_mode, machine_key
from .mismatch_run import MismatchRun, exact_key
from .paths import atomic_write
from .sides import canonical_config, config_name


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


def sample_key(model_dir: Path, sampled_by: str, n_prompts: int, n_samples: int, max_tokens: int,
               temperature: float, seed: int, prompts: list[list[int]] | None = None, top_p: float = 1.0,
               top_k: int = 0) -> dict:
    """What the sampled responses depend on (the folder of every side scored on them): the engine's machine, not the
    training side's matmul mode (which keys each training side's file instead, `side_file`); the prompts' tokens
    where they are the caller's rather than the task's held-out split; top_p and top_k where they truncate (so the
    folders of untruncated runs keep their names)."""
    key = dict(model=str(model_dir), fingerprint=fingerprint(model_dir), machine=machine_key(engine_only=True),
               sampled_by=sampled_by, n_prompts=n_prompts, n_samples=n_samples, max_tokens=max_tokens,
               temperature=temperature, seed=seed)
    if prompts is not None:
        key["prompts"] = hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:16]
    return key | ({"top_p": top_p} if top_p != 1.0 else {}) | ({"top_k": top_k} if top_k else {})


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


def load_or_sample(folder: Path | None, sample, keep=()) -> MismatchRun:
    """The sampled responses from `folder`, or `sample()` saved there without its scores, except the sides in `keep`
    (the sampler's own logprobs, known only when sampling)."""
    path = None if folder is None else folder / "samples.npz"
    if path is not None and path.exists():
        return MismatchRun.load(path)
    run = sample()
    if path is not None:
        MismatchRun(run.sequences, run.starts, run.rewards, run.prompts, meta=run.meta,
                    token_lp={side: lp for side, lp in run.token_lp.items() if side in keep}).save(path)
    return run


def copy_side(run: MismatchRun, source: str, side: str) -> None:
    """Another name for the same computation (same regions and options): the same arrays."""
    run.token_lp[side] = run.token_lp[source]
    if source in run.full:
        run.full[side] = run.full[source]
    for key in [k for k in run.exact if k.endswith("|" + source)]:
        run.exact[key.removesuffix(source) + side] = run.exact[key]
