"""What a trainer's environment gets from the rla wheel: run by `make test-install` with `python -I` from a folder
outside the repository, in an environment where the wheel was installed by pip (no repository on the path).

    python -I installed_check.py REPO [--engine]

Checks, each failing with what went wrong: rla_lib comes from site-packages; importing the library, align and the
monitor changes no environment variable; the shipped data (embedded models, task split) is found inside the package
and what rla writes goes to the user's folder, not site-packages; `align` on hidden-config Qwen3 and Qwen2 models
(and the embedded qwen3-tiny) rounds otherwise and `undo` gives stock back bit for bit; the monitor's metrics of
stock against aligned logprobs. With --engine (an environment with the CPU engine extra): `measure` on an embedded
model, the engine-aligned side exact where vLLM's kernel was measured exact.
"""

import json
import os
import sys
import sysconfig
from pathlib import Path


import transformers.models.qwen2.modeling_qwen2  # noqa: E402, F401  (sets TORCHINDUCTOR_CACHE_DIR itself)
import transformers.models.qwen3.modeling_qwen3  # noqa: E402, F401

repo = Path(sys.argv[1]).resolve()
environment = dict(os.environ)  # after Transformers' own imports: what rla_lib changes, if anything

import rla_lib  # noqa: E402
from rla_lib import paths  # noqa: E402
from rla_lib.align import monitor  # noqa: E402
from rla_lib.align import REGIONS, align, current  # noqa: E402

assert Path(rla_lib.__file__).is_relative_to(sysconfig.get_paths()["purelib"]), rla_lib.__file__
assert not Path.cwd().is_relative_to(repo), "run it from a folder outside the repository"
assert repo not in {Path(p or ".").resolve() for p in sys.path}, sys.path  # the package only from site-packages
assert dict(os.environ) == environment, "importing rla_lib, align or the monitor changed the environment"
assert not paths.IN_CHECKOUT and paths.DATA_DIR.is_relative_to(paths.PACKAGE_DIR), paths.DATA_DIR
assert not paths.ROOT.is_relative_to(sysconfig.get_paths()["purelib"]), paths.ROOT

import torch  # noqa: E402
import transformers  # noqa: E402

from rla_lib import task  # noqa: E402
from rla_lib.models import load_model, resolve_model  # noqa: E402
from rla_lib.scoring import token_logprobs  # noqa: E402


def hidden_config_model(family: str):
    """A small Qwen of the real layer code, random weights (no checkpoint: the config alone)."""
    kind = transformers.Qwen3Config if family == "qwen3" else transformers.Qwen2Config
    config = kind(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    torch.manual_seed(0)
    model_class = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.Qwen2ForCausalLM
    return model_class(config).to(torch.bfloat16).eval()


def aligned_and_back(model, ids) -> dict:
    with torch.no_grad():
        stock = model(ids).logits
        handle = align(model, REGIONS)
        assert current(model).schedule.regions() == REGIONS
        aligned = model(ids).logits
        handle.undo()
        again = model(ids).logits
    assert torch.isfinite(aligned).all() and torch.equal(stock, again), "undo did not give stock back bit for bit"
    return {"logits differing": int((aligned != stock).sum()), "of": aligned.numel()}


report = {"transformers": transformers.__version__, "torch": torch.__version__, "rla_lib": rla_lib.__file__,
          "writes to": str(paths.ROOT)}
ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
for family in ("qwen3", "qwen2"):
    report[f"hidden-config {family}"] = aligned_and_back(hidden_config_model(family), ids)
    assert report[f"hidden-config {family}"]["logits differing"] > 0, "aligning changed no rounding"

spec = resolve_model("qwen3-tiny")  # the shipped embedded model, found by name
model = load_model("qwen3-tiny")
generator = torch.Generator().manual_seed(2)
sequences = [torch.randint(1, spec.vocab_size, (24,), generator=generator).tolist() for _ in range(4)]
stock = token_logprobs(model, sequences)
with rla_lib.aligned(model, REGIONS):
    aligned = token_logprobs(model, sequences)
lp = lambda rows: torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r) for r in rows], batch_first=True)  # noqa: E731
mask = lp([torch.ones(len(r)) for r in stock])
metrics = monitor.mismatch_metrics(lp(stock), lp(aligned), mask)
assert metrics["mismatch/tokens"] == sum(map(len, stock)) and metrics["mismatch/k3"] >= 0, metrics
report["monitor, qwen3-tiny stock vs aligned"] = {k: metrics[k] for k in ("mismatch/tokens", "mismatch/k1", "mismatch/k3")}
report["task split"] = len(task.load_split())

# The fix alone, as a trainer takes it home: a schedule file (compiled vLLM-CPU's, with its attention kernel's numerics,
# written as `rla schedule` writes one) applied by `rla_lib.align`, where neither vLLM nor pandas nor matplotlib is
# installed (the environments of the other Transformers releases) or, with the engine extra, where none was loaded.
import importlib.util  # noqa: E402
import tempfile  # noqa: E402

from rla_lib.align import align_to_engine, save_schedule  # noqa: E402

lab_only = ("vllm", "pandas", "matplotlib")
if "--engine" not in sys.argv:
    assert all(importlib.util.find_spec(m) is None for m in lab_only), "this environment should lack the lab's packages"
schedule = {"format": rla_lib.align.SCHEDULE_FORMAT, "engine": "vllm:compiled",
            "align": {"regions": list(REGIONS), "options": {"rope_cos_sin": "bf16", "rope_qk_norm": "fp32",
                                                             "norm_weight": "fp32", "residual_stream": "fp32"}},
            "attention": {"numerics": "vllm_cpu_avx2"}}
with tempfile.TemporaryDirectory() as folder, torch.no_grad():
    handle = align_to_engine(model, save_schedule(schedule, Path(folder) / "schedule.json"))
    engine_aligned = token_logprobs(model, sequences)
    handle.undo()
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(token_logprobs(model, sequences), stock))
differing = sum(int((torch.as_tensor(a) != torch.as_tensor(b)).sum()) for a, b in zip(engine_aligned, stock))
assert differing > 0, "the schedule changed no logprob"
assert not [m for m in sys.modules if m.split(".")[0] in lab_only], "the fix loaded a package of the lab's"
report["schedule file applied by rla_lib.align"] = {"logprobs differing from stock": differing}

if "--engine" in sys.argv:
    from rla_lib.machine import vllm_cpu_attention_kernel
    from rla_lib.mismatch_report import ENGINE_ALIGNED, advice, configs, summary

    modes = ("eager",)
    run = rla_lib.measure("qwen2-tiny", modes, configs("qwen2-tiny", modes), n_prompts=8, n_samples=1, max_tokens=12,
                          fp32_reference=False, cache_dir=None, progress=False)
    table = summary(run, modes, n_boot=200)
    row = table.set_index("training side").loc[ENGINE_ALIGNED]
    report["measure, qwen2-tiny eager"] = {"engine-aligned bitwise": row["bitwise"], "advice": advice(table)}
    if vllm_cpu_attention_kernel() in ("avx512_bf16", "avx2"):  # measured exact end to end (tests/test_engine_align.py)
        assert row["bitwise"] == 1 and row["exact"] == 0, report

print(json.dumps(report, indent=1, default=str))
