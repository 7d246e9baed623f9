"""What is left between the aligned training side and the engine, op by op (teacher forcing).

    caps = op_check.captured("qwen3-tiny")                    # eager vLLM scores a few sequences (a subprocess)
    table = op_check.teacher_forced(model, caps, schedule)    # model: a stock Transformers Qwen; aligned to `schedule`
    kernels = op_check.attention_kernels(caps, model.config)  # each attention numerics on the engine's q/k/v

The engine runs in eager mode (its modules one by one, so forward hooks see each op), in-process in a subprocess,
and scores the sequences one at a time: hooks keep the input and output of every linear layer and of attention,
the final norm's output and the engine's token logprobs. The training side then scores the same sequences through
the layer's own rounding points (`rla_lib.align.modeling_qwen`, `align(..., replay=...)`): at each point where the engine
hands a value over, its value is compared with the engine's and the engine's is put in its place. Every op so
starts from the engine's own inputs and each count of differing elements is that op's own, not carried in from
earlier layers. A compiled engine runs its graph as one kernel per fusion, which hooks cannot
see into; its remainder is read from its code instead (`rla_lib.graphs`).

The points, per layer: `input_norm` (the input of q/k/v_proj), `q_proj`, `k_proj`, `v_proj`, `attention` (Q/K
norm, RoPE and attention: the input of o_proj), `o_proj`, `post_norm` (the input of gate/up_proj), `gate_proj`,
`up_proj`, `swiglu` (the input of down_proj), `down_proj`; then `final_norm` and `token_logprobs` (LM head and
log-softmax).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

from . import graphs  # its modules load on first use
from .sides import align_config
from .align.attention import KERNELS as ATTENTION_KERNELS
from .align.modeling_qwen import FINAL_ROUNDING_POINTS, ROUNDING_POINTS
from .align.schedule import load_schedule, schedule_to_align_kwargs
from .engine import Engine
from .bf16_matmul import has_fp32_matmul, use_bf16_matmul
from .machine import compile_cache_environment, machine_key
from .mismatch_cache import core_digest
from .models import resolve_model
from .paths import PACKAGE_DIR, RESULTS_DIR, atomic_write
from .scoring import head_logprobs, pad_batch
from .task import load_split

OP_CHECK_DIR = RESULTS_DIR / "op_check"


# ---- the engine side: in-process vLLM with hooks (run by `captured` in a subprocess) ------------------------------
def _keep(store: dict, name: str):
    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        store[name] = (args[0].detach().clone(), out.detach().clone())
    return hook


def _keep_attention_inputs(store: dict, name: str):
    return lambda module, args, output: store.__setitem__(name, tuple(a.detach().clone() for a in args[:3]))


def capture(model, n: int = 8, max_tokens: int = 32, seed: int = 0, prompts=None, graph_dir=None) -> dict:
    """Eager vLLM's values at every point for `n` sampled sequences (needs VLLM_ENABLE_V1_MULTIPROCESSING=0), one response
    to each of the first `n` `prompts` (token-id lists; None: the task's held-out prompts). `graph_dir`: also the
    engine's eager graph capture there (`graphs.capture_eager_with`), where it is not made yet."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("op_check.capture needs the engine in this process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                           "(op_check.captured does, in a subprocess).")
    with Engine(model, mode="eager") as engine:
        if graph_dir is not None:  # first, on the fresh engine, as its own capture would trace it
            graphs.capture_eager_with(engine, model, graph_dir)
        vllm_model = engine.model_module()
        store, hooks = {}, []
        for i, layer in enumerate(vllm_model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                hooks.append(module.register_forward_hook(_keep(store, f"{i}.{name}")))
            hooks.append(attn.attn.register_forward_hook(_keep_attention_inputs(store, f"{i}.attention_inputs")))
        hooks.append(vllm_model.model.norm.register_forward_hook(_keep(store, "final_norm")))
        prompts = [p.prompt for p in load_split()[:n]] if prompts is None else [list(p) for p in prompts[:n]]
        sequences = [g[0].ids for g in engine.sample(prompts, n=1, max_tokens=max_tokens, seed=seed, progress=False)]
        points, logprobs = [], []
        for s in sequences:  # one at a time: each engine call is then one forward of this sequence alone
            store.clear()
            logprobs.append(torch.from_numpy(engine.score([s], progress=False)[0].token_logprobs))
            points.append(dict(store))
        for h in hooks:
            h.remove()
    return dict(model=str(resolve_model(model).path), sequences=sequences, points=points, token_logprobs=logprobs,
                machine=machine_key(engine_only=True))


def captured(model="qwen3-tiny", n: int = 8, force: bool = False, timeout: int = 1800, prompts=None,
             max_tokens: int = 32, seed: int = 0, cache_dir: Path | None = None, graph_dir: Path | None = None) -> dict:
    """`capture`'s result, kept under `cache_dir` (default results/op_check; one engine start in a subprocess when not
    kept yet). `prompts`: token-id lists to answer instead of the task's (part of the kept file's name, as a digest).
    `graph_dir`: where that engine start also leaves the eager graph capture, if it is not there yet."""
    spec = resolve_model(model)
    code = hashlib.sha1(core_digest().encode() + Path(__file__).read_bytes()).hexdigest()[:8]  # a capture is code's too
    asked = "" if prompts is None else "-" + hashlib.sha1(json.dumps([list(map(int, p)) for p in prompts[:n]]).encode()
                                                          + f"{max_tokens},{seed}".encode()).hexdigest()[:8]
    path = Path(cache_dir or OP_CHECK_DIR) / f"{spec.path.name}-eager-{n}{asked}-{machine_key(engine_only=True)}-{code}.pt"
    if force or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
                   TOKENIZERS_PARALLELISM="false") | compile_cache_environment()  # a capped level's own caches
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        command = [sys.executable, "-m", "rla_lib.op_check", str(spec.path), "--n", str(n), "--out", str(path),
                   "--max-tokens", str(max_tokens), "--seed", str(seed)]
        if prompts is not None:
            asked_file = path.with_suffix(".prompts.json")
            atomic_write(asked_file, lambda tmp: tmp.write_text(json.dumps([list(map(int, p)) for p in prompts[:n]])))
            command += ["--prompts", str(asked_file)]
        if graph_dir is not None:
            command += ["--graph-dir", str(graph_dir)]
        proc = subprocess.run(command, env=env, cwd=str(PACKAGE_DIR.parent), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"op_check capture of {model} failed (exit {proc.returncode}):\n{tail}")
    return torch.load(path, weights_only=True)  # tensors, lists of token ids and strings: nothing to unpickle


# ---- the training side, teacher-forced ----------------------------------------------------------------------------
class _Tally:
    def __init__(self):
        self.rows = defaultdict(lambda: [0, 0, 0.0])

    def compare(self, key, mine: torch.Tensor, engines: torch.Tensor):
        mine = mine.reshape(engines.shape).to(engines.dtype)
        row = self.rows[key]
        row[0] += int((mine != engines).sum())
        row[1] += engines.numel()
        row[2] = max(row[2], float((mine.float() - engines.float()).abs().max()))

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([dict(layer=layer, point=point, differing=d, elements=n, share_differing=d / n, max_abs_diff=m)
                             for (layer, point), (d, n, m) in self.rows.items()])


# The layer's rounding points at which the engine's modules hand over a value (`modeling_qwen.Point.handed_over`), by
# the name this check reports them under (a norm's output by the norm's name): the norms' outputs are the inputs of the
# projections after them, attention's the input of o_proj, the SwiGLU product the input of down_proj.
CHECKED = {p.name: p.name.removesuffix(".weight") for p in ROUNDING_POINTS + FINAL_ROUNDING_POINTS if p.handed_over}
LAYER_POINTS = tuple(CHECKED[p.name] for p in ROUNDING_POINTS if p.handed_over)  # in the order the layer computes


def engine_values(points: dict, config) -> dict:
    """The engine's value at each checked point of one sequence's capture, by (layer, name)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    values = {("final", "final_norm"): points["final_norm"][1]}
    for i in range(config.num_hidden_layers):
        qkv_in, qkv_out = points[f"{i}.qkv"]
        (gate_up_in, gate_up_out), (o_in, o_out), (down_in, down_out) = (points[f"{i}.{m}"] for m in ("gate_up", "o", "down"))
        q, k, v = qkv_out.split([q_size, kv_size, kv_size], -1)
        gate, up = gate_up_out.chunk(2, -1)
        values |= {(i, name): value for name, value in zip(LAYER_POINTS, (
            qkv_in, q, k, v, o_in, o_out, gate_up_in, gate, up, down_in, down_out))}
    return values


class _Forcing:
    """A `replay` for `align`: compare each checked point's value with the engine's, then carry on with the engine's."""

    def __init__(self, tally: _Tally):
        self.tally, self.engines = tally, {}

    def __call__(self, point: str, layer, rounded: torch.Tensor) -> torch.Tensor:
        if point not in CHECKED:
            return rounded
        engines = self.engines[(layer, CHECKED[point])]
        self.tally.compare((layer, CHECKED[point]), rounded, engines)
        return engines.reshape(rounded.shape).to(rounded.dtype)


def teacher_forced(model, captures: dict, schedule: dict | str | Path | None = None, regions=(), **options) -> pd.DataFrame:
    """Per layer and point: how many elements of the training side's value differ from the engine's, when every
    op is fed the engine's inputs. The training side is `model` (stock) run through `rla_lib.align.modeling_qwen`, aligned to
    an engine `schedule` (a dict or its file) or to `regions` with `options` as `align` takes them.

    The linear layers run torch's BF16 GEMM here whatever the CPU: it is the engine's own kernel at every level
    (`benchmarks/bf16_matmul.py`: bitwise equal), while the FP32-products path `load_model` picks without BF16
    instructions sums in another order (about 0.01% of outputs differ). So the check counts alignment, not GEMMs."""
    if schedule is not None:
        regions, options = schedule_to_align_kwargs(schedule if isinstance(schedule, dict) else load_schedule(schedule))
    tally = _Tally()
    forcing = _Forcing(tally)
    handle = align_config(model, regions, options, replay=forcing)  # (refuses a model already aligned, saying so)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and has_fp32_matmul(m)]
    use_bf16_matmul(model, "native")
    try:
        for sequence, points, engine_logprobs in zip(captures["sequences"], captures["points"], captures["token_logprobs"]):
            forcing.engines = engine_values(points, model.config)
            ids, mask = pad_batch([sequence])
            with torch.no_grad():
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :-1]
                mine = head_logprobs(model.lm_head, hidden, ids[0, 1:])
            tally.compare(("final", "token_logprobs"), mine.float(), engine_logprobs)
    finally:
        handle.undo()
        for m in linears:
            use_bf16_matmul(m, "fp32")
    return tally.frame()


def attention_kernels(captures: dict, config) -> pd.DataFrame:
    """Each attention numerics of `rla_lib.align.attention` on the engine's own post-RoPE q/k/v, against its output."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)  # what the kernels read
    rows = []
    for name, kernel in ATTENTION_KERNELS.items():
        if name == "eager":  # Transformers' eager attention needs a real attention module; it rounds P, far off
            continue
        differing = elements = 0
        for points in captures["points"]:
            for i in range(config.num_hidden_layers):
                q, k, v = (x.view(x.shape[0], -1, head_dim).transpose(0, 1)[None] for x in points[f"{i}.attention_inputs"])
                out, _ = kernel(module, q, k, v, None, head_dim**-0.5)
                engines = points[f"{i}.o"][0].view_as(out[0])
                differing += int((out[0] != engines).sum())
                elements += engines.numel()
        rows.append(dict(numerics=name, differing=differing, elements=elements, share_differing=differing / elements))
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="capture eager vLLM's values at every op (rla_lib.op_check)")
    parser.add_argument("model")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", help="a JSON file of token-id lists (default: the task's held-out prompts)")
    parser.add_argument("--graph-dir", help="also the engine's eager graph capture in this folder, if not made yet")
    args = parser.parse_args(argv)
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    result = capture(args.model, n=args.n, max_tokens=args.max_tokens, seed=args.seed, prompts=prompts,
                     graph_dir=args.graph_dir)
    atomic_write(Path(args.out), lambda tmp: torch.save(result, tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
