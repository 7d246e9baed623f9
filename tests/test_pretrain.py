"""`make models` regenerates the embedded models; a few steps here check it runs and is reproducible."""

import json

from safetensors.torch import load_file

from rla_lib import pretrain
from rla_lib.models import resolve_model


def test_pretrain_is_reproducible_and_writes_a_loadable_model(tmp_path):
    for run in ("a", "b"):
        pretrain.main(["--arch", "qwen2", "--steps", "3", "--eval-size", "8", "--out", str(tmp_path / run)])
    a, b = (load_file(tmp_path / r / "qwen2-tiny" / "model.safetensors") for r in ("a", "b"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    spec = resolve_model(str(tmp_path / "a" / "qwen2-tiny"))
    assert spec.architecture == "Qwen2ForCausalLM"
    meta = json.loads((spec.path / "training.json").read_text())
    assert meta["steps"] == 3 and 0.0 <= meta["eval_accuracy_t1_fp32"] <= 1.0


def test_shipped_models_record_how_they_were_trained():
    for name in ("qwen3-tiny", "qwen2-tiny", "qwen3-tiny-steps"):
        meta = json.loads((resolve_model(name).path / "training.json").read_text())
        assert meta["steps"] > 0 and meta["parameters"] > 1e6
    assert meta["task_name"] == "steps" and meta["schedule"]["init"] == "qwen3" and meta["task"]["format"] == "steps"


def test_long_answer_model_starts_from_qwen3_tiny_with_a_longer_context(tmp_path):
    pretrain.main(["--arch", "qwen3-steps", "--steps", "2", "--eval-size", "4", "--out", str(tmp_path)])
    spec = resolve_model(str(tmp_path / "qwen3-tiny-steps"))
    assert spec.architecture == "Qwen3ForCausalLM" and spec.max_position_embeddings == 160
    assert json.loads((spec.path / "training.json").read_text())["task"]["format"] == "steps"


def test_hot_model_is_the_long_answer_model_with_its_logits_halved(tmp_path):
    # regenerated without training: the shipped one is what `make models` writes, bit for bit
    pretrain.main(["--arch", "qwen3-steps-hot", "--eval-size", "4", "--out", str(tmp_path)])
    made, shipped, base = (load_file(p / "model.safetensors") for p in
                           (tmp_path / "qwen3-tiny-steps-hot", resolve_model("qwen3-tiny-steps-hot").path,
                            resolve_model("qwen3-tiny-steps").path))
    assert made.keys() == shipped.keys() == base.keys() and all(made[k].equal(shipped[k]) for k in made)
    assert [k for k in made if not made[k].equal(base[k])] == ["model.norm.weight"]
    assert made["model.norm.weight"].equal(base["model.norm.weight"] * 0.5)  # a power of 2: exact in BF16
    meta = json.loads((resolve_model("qwen3-tiny-steps-hot").path / "training.json").read_text())
    assert meta["schedule"]["logit_scale"] == 0.5 and meta["task_name"] == "steps"
    # the point of it: far less often right at temperature 1 than greedy, where the sharp model is close to greedy
    assert meta["eval_accuracy_t1_fp32"] < meta["eval_accuracy_greedy_fp32"] / 3
