import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from rla_lib.models import normalize_dtype
from rla_lib.models import EMBEDDED_MODELS, load_model, resolve_model


@pytest.mark.parametrize("name,arch", [("qwen3-tiny", "Qwen3ForCausalLM"), ("qwen2-tiny", "Qwen2ForCausalLM")])
def test_embedded_models_resolve_and_load(name, arch):
    spec = resolve_model(name)
    assert spec.architecture == arch and spec.path == EMBEDDED_MODELS[name]
    assert resolve_model(spec) is spec  # resolved once at the top, a spec passes through every callee unchanged
    model = load_model(spec)
    assert type(model).__name__ == arch
    assert next(model.parameters()).dtype == torch.bfloat16
    size_mb = sum(p.stat().st_size for p in spec.path.iterdir()) / 2**20
    assert size_mb < 20, f"embedded model should be a few MB, is {size_mb:.1f}"


def test_embedded_qwen2_has_the_r1_distill_features():
    cfg = json.loads((resolve_model("qwen2-tiny").path / "config.json").read_text())
    model = load_model("qwen2-tiny")
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # QKV bias
    assert not hasattr(model.model.layers[0].self_attn, "q_norm")  # no Q/K norm
    assert cfg["tie_word_embeddings"] is False


def test_local_path_works_like_the_name(tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(EMBEDDED_MODELS["qwen3-tiny"], dst)
    spec = resolve_model(str(dst))
    assert spec.architecture == "Qwen3ForCausalLM" and spec.path == dst.resolve()


def test_unknown_model_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an embedded model"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="not an embedded model"):
        resolve_model("qwen9-huge")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_hub_name_without_hub_access_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local directory"):
        resolve_model("Qwen/definitely-not-cached-here")


def test_other_architecture_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*supports Qwen2ForCausalLM and Qwen3ForCausalLM"):
        resolve_model(str(tmp_path))


def test_dtype_other_than_bf16_fp32_is_refused():
    assert normalize_dtype(torch.bfloat16) == "bfloat16" and normalize_dtype("fp32") == "float32"
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        normalize_dtype("float16")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        load_model("qwen3-tiny", dtype=torch.float16)


def test_missing_vllm_names_the_fix(monkeypatch):
    from rla_lib import engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="make setup"):
        engine.Engine("qwen3-tiny")


def test_weight_folders_of_dead_processes_are_removed(tmp_path):
    from rla_lib.engine_worker import remove_orphaned_weights
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"rla-weights-{dead.pid}-abc").mkdir()
    (tmp_path / f"rla-weights-{os.getpid()}-def").mkdir()
    remove_orphaned_weights(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"rla-weights-{os.getpid()}-def"]


def test_engine_processes_run_two_at_a_time_only_for_small_models(tmp_path, monkeypatch):
    from rla_lib import models

    monkeypatch.delenv("RLA_PROCESSES", raising=False)
    monkeypatch.setattr(models, "usable_cores", lambda: [0, 1])
    assert models.concurrent_processes(["qwen3-tiny", "qwen2-tiny"]) == 2
    big = tmp_path / "big"
    shutil.copytree(EMBEDDED_MODELS["qwen3-tiny"], big)
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(config | {"vocab_size": 151936}))  # a real vocabulary: one at a time
    assert models.concurrent_processes(["qwen3-tiny", big]) == 1
    monkeypatch.setattr(models, "usable_cores", lambda: [3])  # e.g. `taskset -c 3`: one core, however many the CPU has
    assert models.concurrent_processes(["qwen3-tiny"]) == 1
    monkeypatch.setenv("RLA_PROCESSES", "3")
    assert models.concurrent_processes([big]) == 3


def test_side_by_side_runs_each_job_in_a_slot_no_other_running_job_holds(monkeypatch):
    import threading
    import time

    from rla_lib import machine, models

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(machine, "usable_cores", lambda: [0, 1])  # whatever cores the test itself may use
    running, lock, seen = set(), threading.Lock(), []

    def job(n, env):
        core = env["VLLM_CPU_OMP_THREADS_BIND"]
        with lock:
            assert core not in running, "two running jobs were given the same core"
            running.add(core)
            seen.append(core)
        time.sleep(0.01 * (n % 3))
        with lock:
            running.remove(core)
        return n * n

    assert models.side_by_side(job, range(8), 2) == [n * n for n in range(8)]  # results in the order of the jobs
    assert len(set(seen)) == 2
    assert models.side_by_side(lambda n, env: env, [0, 1], 1) == [{}, {}]  # one at a time: vLLM's own binding
