"""Graphs of the real engines: compile caches found and parsed, engine runs captured in a subprocess, each side's
graph and points (`read_sides`), and the `python -m rla_lib.graphs capture ...` entry point of that subprocess."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock, Timeout  # a dependency of torch

from .. import sides
from ..engine import Engine
from ..engine_process import engine_environment
from ..engine_probes import compilation_info, probe_rotary_kernel
from ..machine import compile_cache_environment, machine, machine_key
from ..models import concurrent_processes, load_model, resolve_model, side_by_side
from ..paths import PACKAGE_DIR, atomic_write
from ..progress import bar
from .aten import AtenTracer, default_ids, training_graph
from .graph import BF16_DTYPES, GRAPHS_DIR, Graph, GraphParseError, Node, atomic_write_json
from .inductor import parse_output_code, parse_pieces
from .reader import AnalysisError, read_points

SIDES = (sides.engine("compiled"), sides.engine("eager"), sides.HF_COMPILED, sides.STOCK)
STOCK_SIDE = sides.STOCK  # traced in-process; every other side is captured (read_sides' argument shadows `sides`)
_MATMUL_CALLS = ("onednn_mm", "extern_kernels.mm", "extern_kernels.addmm", "aten.mm", "weight_packed_linear")


# ---- compile caches -------------------------------------------------------------------------------------
def find_output_code(cache_dir) -> list[Path]:
    """Inductor output-code files under a compile cache (vLLM's VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, a
    capture directory, or a directory you copied them into), in compile order: a capture's (`compile_N.py`), vLLM's
    piece index (its `artifact_shape_*_subgraph_N` directories), else inductor's AOT ID."""
    cache_dir = Path(cache_dir)
    if not cache_dir.exists():
        raise GraphParseError(f"{cache_dir}: no such compile-cache directory")
    files = []
    for p in sorted(cache_dir.rglob("*.py")):
        try:
            head = p.read_text(errors="replace")
        except OSError:
            continue
        if "async_compile" in head and re.search(r"^\s*def call\(", head, re.M):
            m = (re.search(r"(?:compile|subgraph)_(\d+)", str(p.relative_to(cache_dir)))
                 or re.search(r"# AOT ID: \['(\d+)_", head))
            files.append((int(m.group(1)) if m else 10**6, p.stat().st_mtime, p))
    return [p for _, _, p in sorted(files)]


def _is_decoder_code(path: Path) -> bool:
    text = path.read_text(errors="replace")
    return any(k in text for k in _MATMUL_CALLS)


def parse_cache(cache_dir, name="compiled") -> Graph:
    """The decoder graph from a compile cache: one complete graph (the first whole-model one when several
    shape-specialised compiles exist), else all decoder pieces in piece order, linked across the attention vLLM
    runs between them (piecewise: `parse_pieces`)."""
    files = [p for p in find_output_code(cache_dir) if _is_decoder_code(p)]
    if not files:
        raise GraphParseError(f"{cache_dir}: no inductor output code with matmuls (a decoder graph) found under it. "
                              "Point cache_dir at vLLM's VLLM_CACHE_ROOT (or its torch_compile_cache/...), a "
                              "TORCHINDUCTOR_CACHE_DIR, or a capture directory made by rla_lib.graphs.capture.")
    whole = []
    for p in files:
        g = parse_output_code(p, name=name)
        try:
            read_points(g)
            whole.append(g)
        except AnalysisError:
            continue
    if whole:
        g = whole[0]
        g.meta["alternatives"] = [x.meta["files"][0] for x in whole[1:]]
        return g
    return parse_pieces(files, name=name)  # the engine runs attention between the compiled pieces


def merge_graphs(first: Graph, second: Graph, name=None) -> Graph:
    """`second` appended after `first`; its non-parameter activation inputs read `first`'s last output."""
    g = Graph(name or first.name, [dataclasses.replace(n) for n in first.nodes], dict(first.kernels), dict(first.meta))
    outs = first.meta.get("outputs") or [len(first.nodes) - 1]
    off = len(g.nodes)
    for n in second.nodes:
        if n.op == "input" and n.kernel == "input" and n.dtype in BF16_DTYPES:
            g.nodes.append(Node(n.id + off, "view", [outs[-1]], n.dtype, text=f"{n.text} = {first.name} output",
                                kernel="link"))
        else:
            g.nodes.append(dataclasses.replace(n, id=n.id + off, inputs=[i + off for i in n.inputs]))
    g.kernels.update(second.kernels)
    for k, v in second.meta.items():
        g.meta.setdefault(k, v)
    return g


# ---- capturing an engine run (in a fresh process) -------------------------------------------------------
def keep_output_code(out: Path):
    """From now on, the output code of every inductor compile of this process goes to `out` as compile_N.py, in compile
    order, whether inductor generates it or finds it in its cache (the code is the same either way: the cache is keyed
    by everything the code depends on). So a capture compiles in the engines' own cache: warm where an engine of that
    model compiled before, and a cold compile warms it for the next engine. Returns what stops it."""
    from torch._inductor.graph import GraphLowering

    count, before = iter(range(10**6)), GraphLowering.__dict__.get("save_output_code")
    GraphLowering.save_output_code = staticmethod(
        lambda code: atomic_write(out / f"compile_{next(count)}.py", lambda tmp: tmp.write_text(code)))
    return lambda: setattr(GraphLowering, "save_output_code", before)


def _capture_hf(model: str, out: Path) -> dict:
    """torch.compile of the Transformers model, run once (its output code kept in `out`)."""
    keep_output_code(out)
    compiled = torch.compile(load_model(model, dtype="bfloat16"))
    with torch.no_grad():
        compiled(input_ids=torch.tensor([default_ids()]))
    return dict(torch=torch.__version__, model_path=str(resolve_model(model).path),
                inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def _capture_vllm(model: str, mode: str, out: Path, meta: dict) -> dict:
    """vLLM scores one prompt, traced (`trace_engine`), its compiled graph's output code kept in `out`; then samples,
    so the sampler's compiled op is in the engines' cache too."""
    if mode == "compiled":
        keep_output_code(out)
    eng = Engine(model, mode=mode, seed=0, max_model_len=64)
    found = trace_engine(eng, mode, out, meta)
    eng.sample([default_ids()], max_tokens=2)  # compiles the sampler's logprob ranking (torch.compile'd in both modes)
    eng.close()
    return found


def trace_engine(eng: Engine, mode: str, out: Path, meta: dict) -> dict:
    """A running in-process engine scores one prompt; the aten trace of what runs eagerly (all of it in eager mode, else
    the logits processor, which vLLM runs outside the compiled graph) is saved in `out`. Returns what was found of the
    engine (versions, compilation)."""
    vm = eng.model_module()
    hooked = [vm, vm.logits_processor] if mode == "eager" else [vm.logits_processor]
    tracer = AtenTracer(vm, name=f"vllm:{mode}", hooked=hooked, max_forwards=len(hooked))
    try:
        eng.score([default_ids()], full_vocab=False)
    finally:
        tracer.close()
    g = tracer.graph
    if mode == "eager":
        try:
            g.meta.setdefault("probes", {})["rotary_embedding"] = probe_rotary_kernel()
        except Exception as e:  # noqa: BLE001 - recorded, the analysis then reports the kernel as opaque
            g.meta.setdefault("probes", {})["rotary_embedding"] = {"error": f"{type(e).__name__}: {e}"}
    info = compilation_info(eng)
    found = dict(vllm=info["vllm"], torch=torch.__version__, model_path=str(eng.spec.path), device=info["device"],
                 compilation=info["compilation"], vllm_cache_root=os.environ.get("VLLM_CACHE_ROOT"))
    g.meta.update({**meta, **found})
    g.save(out / ("trace.json" if mode == "eager" else "lm_head_trace.json"))
    return found


def capture_eager_with(eng: Engine, model, out: Path | None = None) -> bool:
    """The eager capture of `model` (what `capture(model, "eager")` makes with an engine of its own), made with `eng`, a
    fresh in-process eager engine of that model another job started anyway (`rla where`'s values reading, a level of
    notebook 07 as it measures): one engine start for both.
    Call it before the engine runs anything else. False, making nothing, where the capture exists, another process
    is making it, or `eng` is not an eager engine in this process (its model cannot be traced from here)."""
    out = Path(out) if out else capture_dir(model, "vllm", "eager")
    if eng.mode != "eager" or not eng.in_process or (out / "capture.json").exists():
        return False
    out.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(out.with_name(out.name + ".lock"), timeout=0):
            if (out / "capture.json").exists():
                return False
            _finish_capture(out, {"model": str(model), "engine": "vllm", "mode": "eager"},
                            lambda meta: trace_engine(eng, "eager", out, meta))
    except Timeout:
        return False
    return True


@contextmanager
def capturing_compiled(model, out_dir=None):
    """The compiled capture of `model` (what `capture(model, "compiled")` makes with an engine of its own), made from a
    compiled engine the caller starts in this process anyway (a level of notebook 07 as it measures): one engine start
    and compile for both. Yields `finish(eng)`: call it once that engine has started (its compile is then done and its
    output code kept); it traces the logits processor and marks the capture made (True). It makes nothing (False) where
    the capture exists, another process is making it, `eng` is not a compiled engine in this process, or no decoder
    code was compiled while the engine started; `read_sides` then captures as before. `out_dir` as in `capture`."""
    out = Path(out_dir) if out_dir else capture_dir(model, "vllm", "compiled")
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out.with_name(out.name + ".lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:  # another process is making it
        yield lambda eng: False
        return
    made, stop, ended = [], None, []

    def end():  # once: the hook off, an unfinished capture's files gone, the lock released for whoever waits
        if not ended:
            ended.append(True)
            if stop is not None:
                stop()
                if not made:
                    shutil.rmtree(out, ignore_errors=True)
            lock.release()

    def finish(eng: Engine) -> bool:
        if stop is None or ended or eng.mode != "compiled" or not eng.in_process:
            return False
        stop()
        if any(_is_decoder_code(p) for p in find_output_code(out)):
            _finish_capture(out, {"model": str(model), "engine": "vllm", "mode": "compiled"},
                            lambda meta: trace_engine(eng, "compiled", out, meta))
            made.append(out)
        end()  # as soon as the engine has started
        return bool(made)

    try:
        if not (out / "capture.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # an unfinished capture's files would join this one's
            out.mkdir()
            stop = keep_output_code(out)
        yield finish
    finally:
        end()


@contextmanager
def capturing(model, modes=("compiled", "eager")):
    """The captures of `model` in `modes` made by the engines the caller starts in this process anyway, one start
    for both: yields `capture(eng)`, to call as soon as each engine has started (`capturing_compiled`,
    `capture_eager_with`); True where it made one."""
    if "compiled" not in modes:
        yield lambda eng: "eager" in modes and capture_eager_with(eng, model)
        return
    with capturing_compiled(model) as capture_compiled:
        yield lambda eng: capture_compiled(eng) or ("eager" in modes and capture_eager_with(eng, model))


def _finish_capture(out: Path, meta: dict, make) -> None:
    """Run `make(meta)` (what it found joins the meta) and write capture.json, the mark of a finished capture."""
    t0 = time.time()
    meta = meta | {"python": sys.version.split()[0]}
    meta.update(make(meta))
    meta["seconds"] = round(time.time() - t0, 1)
    meta["machine"] = machine()  # the kernels, and so the graph, depend on it
    atomic_write_json(out / "capture.json", meta)


def _capture_main(model: str, engine: str, mode: str, out_dir: str) -> None:
    """Run in a fresh process (`python -m rla_lib.graphs capture ...`): the environment is set before imports."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _finish_capture(out, {"model": model, "engine": engine, "mode": mode},
                    lambda meta: _capture_hf(model, out) if engine == "hf" else _capture_vllm(model, mode, out, meta))


def model_key(model) -> str:
    """A checkpoint's name with a digest of its folder: two checkpoints of one name (`checkpoint-100` of two runs) are
    kept apart in what is kept of them."""
    path = resolve_model(model).path
    return f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def architecture_key(model) -> str:
    """A checkpoint's name with a digest of its config.json: the engine's code depends on the architecture, not the
    weights, so checkpoints of one architecture (a copy, a fine-tune, the steps of one run) share a capture."""
    path = resolve_model(model).path
    return f"{path.name}-{hashlib.sha1((path / 'config.json').read_bytes()).hexdigest()[:8]}"


def capture_dir(model, engine="vllm", mode="compiled") -> Path:
    # The kernels, and so the graph, depend on the machine (rla_lib.machine): one capture per machine. The engine's
    # do not depend on the training side's matmul mode.
    key = f"{architecture_key(model)}-{engine}-{mode}-{machine_key(engine_only=engine == 'vllm')}"
    return GRAPHS_DIR / "captures" / key


def _copy_model_infos(engines_cache: Path, capture_cache: Path) -> None:
    """vLLM's records of the model classes its engines ran (`modelinfos`, each checked against its class's source when
    read), copied into a capture's fresh vLLM cache: without them vLLM inspects the class in a process of its own at
    the capture's engine start (5-15 s here)."""
    if (engines_cache / "modelinfos").is_dir():
        shutil.copytree(engines_cache / "modelinfos", capture_cache / "modelinfos", dirs_exist_ok=True)


def _capture_env(engine: str, mode: str, out: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ) | compile_cache_environment() | (extra or {})  # a capped level's own caches
    env.update(HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        # On CPU vLLM compiles with plain torch.compile(backend="inductor") (DYNAMO_TRACE_ONCE) into the engines'
        # inductor cache, where `keep_output_code` reads it; vLLM's own cache is the capture's, so vLLM compiles.
        env.update(VLLM_CACHE_ROOT=str(out / "vllm_cache"), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_AOT_COMPILE="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def capture(model="qwen3-tiny", mode="compiled", engine="vllm", out_dir=None, force=False, timeout=1800,
            env: dict | None = None) -> Path:
    """Run the engine once in a subprocess with a known compile cache; returns the capture directory.

    engine="vllm": real vLLM (mode "compiled" or "eager"), in-process engine core, VLLM_CACHE_ROOT=<dir>/vllm_cache;
    compiled mode keeps its graph's output code (`keep_output_code`: <dir>/compile_N.py) and also traces the logits
    processor (which vLLM runs eagerly, outside the compiled graph); eager mode traces the whole forward at the aten
    level. engine="hf": torch.compile of the Transformers model (mode "compiled"), its output code kept the same way.
    Both compile in the engines' inductor cache (warm if an engine of the model compiled before; a cold compile warms
    it for the next engine). A finished capture (capture.json present) is reused unless force=True. `env`: more
    environment variables for the subprocess.
    """
    if engine == "vllm" and mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'compiled' or 'eager', got {mode!r}")
    if engine == "hf" and mode != "compiled":
        raise ValueError("engine='hf' captures torch.compile of Transformers: mode must be 'compiled' (the eager side "
                         "is traced in-process by training_graph)")
    out = Path(out_dir) if out_dir else capture_dir(model, engine, mode)
    if (out / "capture.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out.with_name(out.name + ".lock")):  # two processes asking for one capture: the second waits, reuses it
        if (out / "capture.json").exists() and not force:
            return out
        _capture(model, mode, engine, out, force, timeout, env)
    return out


def _capture(model, mode: str, engine: str, out: Path, force: bool, timeout: int, env: dict | None) -> None:
    if out.exists() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rla_lib.graphs", "capture", str(model), engine, mode, str(out)]
    env = _capture_env(engine, mode, out, env)
    if engine == "vllm":
        engines_cache = (os.environ | engine_environment())["VLLM_CACHE_ROOT"]  # this process's engines' cache
        _copy_model_infos(Path(engines_cache), Path(env["VLLM_CACHE_ROOT"]))
    proc = subprocess.run(cmd, env=env, cwd=str(PACKAGE_DIR.parent), capture_output=True, text=True, timeout=timeout)
    (out / "capture.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or not (out / "capture.json").exists():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"capture of {model} ({engine} {mode}) failed (exit {proc.returncode}); log: "
                           f"{out / 'capture.log'}\n{tail}")


# ---- each side's graph and points ----------------------------------------------------------------------
def engine_graph(cap_or_cache, mode=None, name=None) -> Graph:
    """The engine's value graph from a capture directory or any compile cache.

    A capture made in eager mode holds an aten trace (trace.json); otherwise the inductor output code under
    the directory is parsed, and the lm_head trace of a vLLM capture (vLLM runs the logits processor
    outside the compiled graph) is appended.
    """
    d = Path(cap_or_cache)
    meta = json.loads((d / "capture.json").read_text()) if (d / "capture.json").exists() else {}
    mode = mode or meta.get("mode") or "compiled"
    if mode == "eager":
        if not (d / "trace.json").exists():
            raise GraphParseError(f"{d}: an eager engine leaves no compile cache; this needs the aten trace "
                                  "(trace.json) written by rla_lib.graphs.capture(..., mode='eager')")
        g = Graph.load(d / "trace.json")
    else:
        g = parse_cache(d, name=name or f"{meta.get('engine', 'vllm')}:compiled")
        if (d / "lm_head_trace.json").exists():
            g = merge_graphs(g, Graph.load(d / "lm_head_trace.json"))
    if name:
        g.name = name
    elif meta:
        g.name = f"{meta.get('engine', 'vllm')}:{mode}"
    g.meta.update({k: v for k, v in meta.items() if k != "seconds"})
    return g


def side_graph(model, side: str, force: bool = False) -> Graph:
    """The value graph of one side (`rla_lib.sides`): 'vllm:compiled', 'vllm:eager', 'hf:compiled' (captured in a
    subprocess, cached under results/graphs/captures) or 'hf:bf16:none', stock Transformers (traced in this process)."""
    if side == sides.STOCK:
        return training_graph(model)
    engine, mode = _engine_and_mode(side)
    return engine_graph(capture(model, mode, engine=engine, force=force), name=side)


def _engine_and_mode(side: str) -> tuple[str, str]:
    engine, _, mode = side.partition(":")
    if engine not in ("vllm", "hf") or mode not in ("compiled", "eager"):
        raise ValueError(f"unknown side {side!r}; choose from {SIDES}")
    return engine, mode


# Captures by their length (seconds here: vLLM compiled 25-30, vLLM eager 15-20 with its aten trace, torch.compile of
# Transformers 12-15)
LONGEST_FIRST = (("vllm", "compiled"), ("vllm", "eager"), ("hf", "compiled"))


def capture_sides(models, sides=SIDES, force: bool = False) -> None:
    """Capture every engine side of every model that is not captured yet (all of them with force=True), side by
    side (`models.concurrent_processes`, subprocesses). Stock Transformers is traced in-process, when read."""
    jobs = [(m, *_engine_and_mode(side)) for m in models for side in sides if side != STOCK_SIDE]
    jobs.sort(key=lambda job: LONGEST_FIRST.index(job[1:]))  # cold compiles first: the slots finish together
    side_by_side(lambda job, env: capture(job[0], job[2], engine=job[1], force=force, env=env), jobs,
                 concurrent_processes(models))


def read_sides(model, sides=SIDES, force: bool = False, progress: bool | None = None):
    """(points, graphs) per side for one model; the points are also saved as JSON under results/graphs/.

    progress: a bar over the sides, a capture (an engine start and compile, minutes) each when not cached
    (None: only in a Jupyter kernel, see `rla_lib.progress`).
    """
    capture_sides([model], sides, force=force)
    graphs_, points = {}, {}
    sides_bar = bar(sides, progress, desc=f"{model} graphs", leave=False)
    for side in sides_bar:
        sides_bar.set_postfix_str(side)
        graphs_[side] = side_graph(model, side)  # captured above
        points[side] = read_points(graphs_[side])
        out = GRAPHS_DIR / resolve_model(model).path.name / f"points-{side.replace(':', '-')}.json"
        atomic_write_json(out, points[side].to_json())
    return points, graphs_


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 5 and argv[0] == "capture":
        _capture_main(*argv[1:])
        return
    print("usage: python -m rla_lib.graphs capture MODEL {vllm|hf} {compiled|eager} OUT_DIR", file=sys.stderr)
    sys.exit(2)
