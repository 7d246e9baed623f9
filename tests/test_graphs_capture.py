"""rla_lib.graphs on the real engine: a compile cache produced in this test run (a compiled engine start in a
subprocess, then one in this process), and how captures are kept."""

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rla_lib.align.schedule import schedule_to_align_kwargs
from rla_lib import graphs
from rla_lib.align import REGIONS
from rla_lib.engine import Engine
from rla_lib.engine_align import engine_schedule_path
from rla_lib.graphs import captures
from test_graphs_inductor import COMPILED_CPU
from test_prompts import with_chat_template


@pytest.mark.engine
def test_a_capture_reads_the_same_code_from_a_cold_or_a_warm_engine_cache(tmp_path, monkeypatch):
    engine_cache = tmp_path / "engine_inductor_cache"  # where this process's engines compile: empty, so the first is cold
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(engine_cache))

    def cached() -> set:
        return {p.relative_to(engine_cache) for p in engine_cache.rglob("*") if p.is_file() and "locks" not in p.parts}

    cold = graphs.capture("qwen3-tiny", "compiled", out_dir=tmp_path / "cold")
    compiled = cached()
    assert compiled  # the capture compiled in the engines' cache: the next engine of the model starts warm
    # the warm one made in this process from an engine started as a measurement starts it (notebook 07's levels)
    with graphs.capturing_compiled("qwen3-tiny", out_dir=tmp_path / "warm") as finish:
        with Engine("qwen3-tiny", mode="compiled", seed=0) as engine:
            assert engine.in_process and finish(engine)
            assert not finish(engine)  # made once
            assert engine.score([[1, 2, 3]])[0].token_logprobs.size == 2  # the engine goes on measuring
    warm = tmp_path / "warm"
    assert (warm / "capture.json").exists()
    # the decoder's code (the cold capture also keeps the sampler's op it compiled as it sampled after its trace)
    code = [[f for f in graphs.find_output_code(out) if captures._is_decoder_code(f)] for out in (cold, warm)]
    assert code[0] and all(tmp_path / "cold" in f.parents for f in code[0])
    assert [f.read_text() for f in code[1]] == [f.read_text() for f in code[0]]  # found in the cache: the same code
    assert cached() == compiled, "the warm capture compiled again"
    g = graphs.engine_graph(warm)
    points = graphs.read_points(g)
    summary = points.summary()
    assert {k: summary[k] for k in COMPILED_CPU} == COMPILED_CPU
    assert summary["lm_head.output"] == "bf16"  # the logits processor, traced: vLLM runs it outside the graph
    sched = graphs.schedule(points, "vllm:compiled")
    assert schedule_to_align_kwargs(sched)[0] == REGIONS and sched["align"]["exact"]


def test_checkpoints_of_one_architecture_share_a_capture_and_not_a_schedule(tmp_path):
    """The engine's code depends on the architecture, not the weights: a copy of a checkpoint in another folder reads
    the capture already made, and one whose config differs gets its own. The kept engine schedule (its probe measured
    those weights) stays per folder, even for two folders of one name."""
    copy = with_chat_template(tmp_path)  # another folder, the same name and config.json
    assert graphs.capture_dir(copy, "vllm", "eager") == graphs.capture_dir("qwen3-tiny", "vllm", "eager")
    assert engine_schedule_path(copy, "eager") != engine_schedule_path("qwen3-tiny", "eager")
    other = Path(shutil.copytree(copy, tmp_path / "other" / copy.name))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rms_norm_eps": config["rms_norm_eps"] * 2}))
    assert graphs.capture_dir(other, "vllm", "eager") != graphs.capture_dir(copy, "vllm", "eager")


def test_two_processes_asking_for_one_capture_make_it_once(tmp_path, monkeypatch):
    """A capture asked for twice at once (two test processes, two notebooks) is made by the first; the second waits
    for it and reuses it instead of writing into the same folder."""
    made = []

    def slow_capture(model, mode, engine, out, force, timeout, env):
        made.append(out)
        time.sleep(0.5)
        (out / "capture.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "capture.json").write_text("{}")

    monkeypatch.setattr(captures, "_capture", slow_capture)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: graphs.capture("qwen3-tiny", "eager", out_dir=tmp_path / "cap"), range(2)))
    assert outs == [tmp_path / "cap"] * 2 and made == [tmp_path / "cap"]


def test_an_engine_that_compiled_nothing_leaves_no_capture_and_frees_its_lock_at_once(tmp_path):
    """capturing_compiled holds the capture's lock from before the engine starts until `finish`, not until the caller's
    block ends (a measurement goes on for minutes after its engine started): another process waiting for that capture
    goes on at once, and finds no half-made folder where the engine compiled no decoder (its code was cached elsewhere)."""
    out = tmp_path / "cap"

    def lock_is_free() -> bool:  # asked from another process (one process's own locks never block it)
        return subprocess.run([sys.executable, "-c", f"from filelock import FileLock; FileLock({str(out) + '.lock'!r}, "
                               "timeout=0).acquire()"], capture_output=True).returncode == 0

    class Started:  # an in-process compiled engine whose start compiled nothing here
        mode, in_process = "compiled", True

    with captures.capturing_compiled("qwen3-tiny", out_dir=out) as finish:
        assert not lock_is_free() and out.is_dir()
        assert not finish(Started())
        assert lock_is_free() and not out.exists()
        assert not finish(Started())  # once
