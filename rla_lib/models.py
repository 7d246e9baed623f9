"""Finding a model (embedded name, local path or hub name) and loading the training side.

Every notebook's `model` parameter goes through `resolve_model`, so the embedded default,
a local checkpoint directory and a hub name (where the hub is reachable) work unchanged.
"""

from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .bf16_matmul import use_bf16_matmul
from .machine import engine_core_environment, usable_cores
from .paths import MODELS_DIR
from .settings import setting

EMBEDDED_MODELS = {"qwen3-tiny": MODELS_DIR / "qwen3-tiny", "qwen2-tiny": MODELS_DIR / "qwen2-tiny",
                   "qwen3-tiny-steps": MODELS_DIR / "qwen3-tiny-steps",  # long answers (task "steps")
                   "qwen3-tiny-steps-hot": MODELS_DIR / "qwen3-tiny-steps-hot"}  # the same at temperature 2 (pretrain.py)
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The two precisions this project compares, by every name they go by (torch dtypes included, via str()).
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
# Full next-token distributions (exact KL, temperature) are kept only up to this vocabulary size.
FULL_VOCAB_LIMIT = 4096


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path
    architecture: str
    vocab_size: int
    eos_token_id: int
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def family(self) -> str:
        return "qwen3" if self.architecture == "Qwen3ForCausalLM" else "qwen2"

    @property
    def parameters(self) -> int:
        """The checkpoint's parameter count, from its safetensors headers (no weight is read)."""
        n = 0
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                n += sum(int(torch.Size(st.get_slice(k).get_shape()).numel()) for k in st.keys())
        return n

    @property
    def small_vocab(self) -> bool:
        """Small enough to keep whole next-token distributions (`FULL_VOCAB_LIMIT`)."""
        return self.vocab_size <= FULL_VOCAB_LIMIT


def _local_dir(model: str | Path) -> Path:
    model = str(model)
    if model in EMBEDDED_MODELS:
        path = EMBEDDED_MODELS[model]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the embedded model {model!r} is missing at {path}; rebuild it with `make models`.")
        return path
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: point `model` at a Hugging Face checkpoint directory.")
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model {model!r} is not an embedded model ({', '.join(EMBEDDED_MODELS)}), not a checkpoint "
            "directory, and not a hub name of the form 'org/name'."
        )
    try:  # a hub name: works only where the hub is reachable (or the files are already cached)
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise FileNotFoundError(
            f"could not fetch {model!r} from the Hugging Face hub ({type(e).__name__}: {e}). Without hub access, "
            "download the checkpoint elsewhere and pass its local directory as `model`."
        ) from e


def resolve_model(model: str | Path | ModelSpec) -> ModelSpec:
    """Find the checkpoint and check it is an architecture this project patches (a spec, resolved once, passes
    through: callers resolve a name at the top and hand the spec down)."""
    if isinstance(model, ModelSpec):
        return model
    path = _local_dir(model)
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{model!r} is a {arch}; rla supports {' and '.join(SUPPORTED_ARCHITECTURES)} (the models whose "
            "rounding locations it aligns). Other architectures need their own graph comparison first."
        )
    text = config.get("text_config", config)
    eos = text.get("eos_token_id")
    return ModelSpec(
        name=str(model),
        path=path,
        architecture=arch,
        vocab_size=int(text["vocab_size"]),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
    )


def torch_dtype(dtype) -> torch.dtype:
    """torch.bfloat16 or torch.float32 from any of their names (or the dtype itself)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be bfloat16 or float32 (the two this project compares), got {dtype!r}")
    return DTYPES[name]


def normalize_dtype(dtype) -> str:
    """'bfloat16' or 'float32': the name vLLM takes."""
    return str(torch_dtype(dtype)).removeprefix("torch.")


def available_memory() -> int | None:
    """Bytes this machine can still give a process (Linux MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def concurrent_processes(models) -> int:
    """How many engine processes (captures, measurement workers) rla_lib runs at once for `models`.

    An engine start and compile is mostly single-threaded, so on two or more cores two overlap well; each holds
    the KV cache (VLLM_CPU_KVCACHE_SPACE) and a copy of the model. So 2 for the small embedded models, 1 for
    anything with a real vocabulary (a real checkpoint's engine can take most of the memory). Concurrency changes
    no bit: a cold `make run-all` with it gave every result table of notebooks 02-07 bitwise as one at a time did.
    RLA_PROCESSES=<n> overrides (1: one at a time; `make test` sets it, its test processes already fill the cores).
    The cores counted are those this process may use (`machine.usable_cores`: under `taskset -c 0`, one)."""
    if setting("RLA_PROCESSES"):
        return max(1, int(setting("RLA_PROCESSES")))
    small = all(resolve_model(m).small_vocab for m in models)
    return 2 if small and len(usable_cores()) >= 2 else 1


def side_by_side(function, jobs, processes: int) -> list:
    """[function(job, environment) for job in jobs], `processes` at a time (threads, each waiting on the subprocess
    it starts). `environment` binds the engines of the slot a job runs in to a core of their own
    (`machine.engine_core_environment`): pass it to that subprocess."""
    slots = queue.SimpleQueue()
    for slot in range(processes):
        slots.put(slot)

    def run(job):
        slot = slots.get()
        try:
            return function(job, engine_core_environment(slot) if processes > 1 else {})
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(processes) as pool:
        return list(pool.map(run, jobs))


def check_memory(spec: ModelSpec, bytes_per_parameter: float, what: str, advice: str) -> None:
    """Refuse before any long work when `what` needs more memory than this machine has free."""
    need, free = spec.parameters * bytes_per_parameter, available_memory()
    if free is not None and need > free:
        raise MemoryError(f"{what} needs about {need / 2**30:.1f} GiB ({spec.parameters / 1e9:.2f}B parameters x "
                          f"{bytes_per_parameter:g} bytes) and this machine has {free / 2**30:.1f} GiB free. {advice}")


def load_model(model: str | Path | ModelSpec = "qwen3-tiny", dtype="bfloat16", device="cpu"):
    """The training side: the stock Transformers model (eager PyTorch, no compilation)."""
    spec = resolve_model(model)
    check_memory(spec, torch_dtype(dtype).itemsize, f"loading {spec.name} in {normalize_dtype(dtype)}",
                 "Pass a smaller checkpoint as `model` (e.g. a narrower `rla_lib.real_shape` one) or use a larger machine.")
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per load is noise in a GRPO loop or a notebook
    try:
        m = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch_dtype(dtype)).to(device)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    use_bf16_matmul(m)  # FP32-speed BF16 GEMMs where the CPU has no BF16 instructions
    m.eval()
    return m


def load_tokenizer(model: str | Path | ModelSpec = "qwen3-tiny"):
    return AutoTokenizer.from_pretrained(resolve_model(model).path)
