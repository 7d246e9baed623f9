import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from rla_lib import grpo
from rla_lib.studies import arms, stability
from rla_lib.models import load_model
from rla_lib.scoring import pad_batch


def test_group_advantages_hand_case():
    adv = grpo.group_advantages(np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    np.testing.assert_allclose(adv[:4], np.array([3.0, -1.0, -1.0, -1.0]) / np.sqrt(3), rtol=1e-5)
    np.testing.assert_array_equal(adv[4:], 0.0)  # a group where every answer is alike teaches nothing


def test_clipped_loss_hand_case_both_sides():
    old = torch.zeros(2, 3)
    # ratios: token 0 inside the clip range, token 1 above 1+eps, token 2 below 1-eps
    new = torch.log(torch.tensor([[1.1, 1.5, 0.5], [1.1, 1.5, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, clip_frac = grpo.clipped_loss(new, old, adv, mask, clip=0.2)
    # A=+1: min(r, clip(r)) = 1.1, 1.2, 0.5 ; A=-1: min(-r, -clip(r)) = -1.1, -1.5 (masked: third)
    expected = -(1.1 + 1.2 + 0.5 - 1.1 - 1.5) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert clip_frac == pytest.approx(3 / 5)
    # truncated importance weights multiply each token's term
    w = torch.full((2, 3), 0.5)
    loss_w, _ = grpo.clipped_loss(new, old, adv, mask, clip=0.2, tis_weight=w)
    assert loss_w.item() == pytest.approx(expected * 0.5, rel=1e-6)


def test_clipped_loss_gradient_vanishes_where_clipped():
    new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = grpo.clipped_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip=0.2)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0


def test_config_validation():
    with pytest.raises(ValueError, match="precision"):
        grpo.GRPOConfig(precision="fp16")
    with pytest.raises(ValueError, match="FP32"):
        grpo.GRPOConfig(precision="fp32", regions=("rope",))
    with pytest.raises(ValueError, match="rollout_mantissa_bits"):
        grpo.GRPOConfig(rollout_mantissa_bits=7)
    with pytest.raises(ValueError, match="rollout_mantissa_bits"):
        grpo.GRPOConfig(precision="fp32", rollout_mantissa_bits=3)


def test_coarser_rollout_weights():
    policy = grpo.Policy(grpo.GRPOConfig(rollout_mantissa_bits=3))
    coarse = policy.rollout_weights()
    master = policy.master.state_dict()
    assert set(coarse) == set(master)
    w, c = master["model.layers.0.mlp.up_proj.weight"], coarse["model.layers.0.mlp.up_proj.weight"]
    assert not (c.view(torch.int32) & (2**20 - 1)).any() and not torch.equal(c, w)


def test_the_engine_gets_the_master_rounded_once_to_bf16():
    """Plain BF16 pushes the compute copy: bit for bit what the engine's own rounding of the FP32 master gives
    (`Engine.load_weights` converts with `.to`, round to nearest even), also after updates have moved the master."""
    plain = grpo.Policy(grpo.GRPOConfig(lr=1e-2))
    ids, attn = pad_batch([[1, 2, 3, 4, 5], [6, 7, 8]])
    for _ in range(2):
        lp, _ = plain.logprobs(ids, attn, grad=True)
        plain.step(-lp.sum())
    pushed, master = plain.rollout_weights().state_dict(), plain.master.state_dict()
    assert set(pushed) == set(master)
    assert all(torch.equal(pushed[k], master[k].to(torch.bfloat16)) for k in master)
    assert not all(torch.equal(pushed[k].float(), master[k]) for k in master)  # the master holds more than BF16
    control = grpo.Policy(grpo.GRPOConfig(precision="fp32"))
    assert control.rollout_weights() is control.master


def test_weight_file_reads_back_bit_for_bit_and_is_rewritten_in_place(tmp_path):
    """The file `Engine.load_weights` hands to vLLM's worker: safetensors' own reader and the worker's kept mapping get
    every tensor back exactly; the next push of the same layout is copied into the pusher's kept mapping and reads
    back as the new values through the same mappings; a new layout, even of the same size, is written anew."""
    from safetensors.torch import load_file

    from rla_lib.engine_worker import MappedWeights, write_safetensors

    path = str(tmp_path / "model.safetensors")
    state = {k: v.detach().clone() for k, v in load_model("qwen3-tiny").state_dict().items() if k != "lm_head.weight"}
    state["an.fp32.vector"] = torch.randn(5)
    state["an.empty.one"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    pusher, worker, mappings = MappedWeights(), MappedWeights(), []
    for _ in range(3):
        write_safetensors(state, path, pusher)
        for back in load_file(path), dict(worker.tensors(path)):
            assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
            assert all(back[k].dtype == state[k].dtype and back[k].shape == state[k].shape for k in state)
        mappings.append((pusher._map, worker._map))
        state = {k: v + 1 for k, v in state.items()}  # the next push: new values, same layout
    assert mappings[0][0] is None and mappings[0][1] is mappings[2][1]  # the first push is written, the worker maps once
    assert mappings[1][0] is not None and mappings[1][0] is mappings[2][0]  # the next ones copied into one kept mapping
    renamed = {k.replace("an.fp32", "an.fp33"): v for k, v in state.items()}  # same size, another header
    write_safetensors(renamed, path, pusher)
    assert list(load_file(path)) == list(renamed) and dict(worker.tensors(path)).keys() == renamed.keys()
    write_safetensors({"one": torch.ones(3, dtype=torch.bfloat16)}, path, pusher)
    assert load_file(path).keys() == {"one"} and list(dict(worker.tensors(path))) == ["one"]


@pytest.mark.engine
def test_coarser_rollouts_make_a_larger_mismatch(compiled_engine):
    """A paired design instead of a ratio threshold (the BF16 gap itself varies between CPUs: larger
    without AVX512-BF16). Both comparisons pit a change of the weights against BF16 compute rounding:
    3 mantissa bits move each weight by up to 2^-4 of itself, BF16 rounds each op's output by up to
    2^-9, so the weight change dominates by a wide natural margin wherever the kernels run (mean |diff|:
    0.083 vs 0.012-0.013 here, both comparisons; 0.082 vs a 0.019 BF16 gap on a CPU without AVX512-BF16)."""
    from rla_lib.scoring import token_logprobs

    policy = grpo.Policy(grpo.GRPOConfig(rollout_mantissa_bits=3))
    coarse_weights = policy.rollout_weights()
    coarse_model = load_model("qwen3-tiny")
    coarse_model.load_state_dict(coarse_weights)  # 3 mantissa bits are exact in BF16: the same weights as the engine's
    seqs = [s.ids for g in compiled_engine.sample(["12+34=", "5+67+8=", "91+3+40+7="], n=4, max_tokens=24) for s in g]
    train_plain, train_coarse = token_logprobs(policy.compute, seqs), token_logprobs(coarse_model, seqs)

    def mean_abs_gap(engine_scores, train):
        return np.mean(np.concatenate([np.abs(e.token_logprobs - t) for e, t in zip(engine_scores, train)]))

    try:
        engine_plain = compiled_engine.score(seqs)
        compiled_engine.load_weights(coarse_weights)
        engine_coarse = compiled_engine.score(seqs)
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))
    # the engine holding 3-bit weights is closer to Transformers with the same 3-bit weights than to the BF16 policy
    assert mean_abs_gap(engine_coarse, train_coarse) < mean_abs_gap(engine_coarse, train_plain)
    # and its gap to the BF16 policy is larger than with plain weights
    assert mean_abs_gap(engine_coarse, train_plain) > mean_abs_gap(engine_plain, train_plain) > 0


@pytest.mark.engine
def test_coarse_rollout_run_evaluates_the_policy_too(compiled_engine, tmp_path):
    """With coarse rollouts each evaluation also scores the trained BF16 policy, then pushes the coarse copy back."""
    cfg = grpo.GRPOConfig(rollout_mantissa_bits=3, **(TINY | dict(steps=1, eval_every=1, checkpoint_every=1)))
    seqs = [s.ids for g in compiled_engine.sample(["12+34=", "5+67+8="], n=2, max_tokens=16) for s in g]
    try:
        h = grpo.run(cfg, tmp_path / "coarse", engine=compiled_engine, progress=False)
        after_run = [s.token_logprobs for s in compiled_engine.score(seqs)]
        policy = grpo.Policy(cfg)
        policy.master.load_state_dict(torch.load(tmp_path / "coarse" / "checkpoint.pt", weights_only=True)["master"])
        compiled_engine.load_weights(policy.rollout_weights())
        coarse = [s.token_logprobs for s in compiled_engine.score(seqs)]
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))
    assert h["eval_accuracy_policy"].notna().tolist() == h["eval_accuracy"].notna().tolist() == [True, True]
    assert (h["eval_prompts"] == TINY["eval_prompts"]).all()
    assert all(np.array_equal(a, b) for a, b in zip(after_run, coarse))  # the engine was left with the coarse copy
    s = stability.summarize(h)
    assert s["eval acc policy last"] == h["eval_accuracy_policy"].iloc[-1]


def test_prompts_are_a_function_of_seed_and_step():
    a = grpo.training_prompts(3, 5, seed=0, exclude=set())
    assert a == grpo.training_prompts(3, 5, seed=0, exclude=set()) and a != grpo.training_prompts(4, 5, seed=0, exclude=set())
    assert not {p.prompt for p in grpo.training_prompts(3, 50, 0, {a[0].prompt})} & {a[0].prompt}


TINY = dict(steps=4, prompts_per_step=4, group_size=4, max_tokens=24, eval_every=2, eval_prompts=8, checkpoint_every=2, lr=1e-4)
TIMING = ["t_rollout", "t_score", "t_update", "t_sync"]


def write_as_before_checkpoint_json(run: Path, copy: Path) -> None:
    """A copy of `run` whose checkpoint is in the format of earlier versions: one .pt, the history (numpy scalars
    where train_step makes them) inside it."""
    shutil.copytree(run, copy)
    state = torch.load(copy / "checkpoint.pt", weights_only=True)
    history = json.loads((copy / "checkpoint.json").read_text())["history"]
    state["history"] = [{k: np.float64(v) if isinstance(v, float) else v for k, v in row.items()} for row in history]
    torch.save(state, copy / "checkpoint.pt")
    (copy / "checkpoint.json").unlink()


@pytest.mark.engine
def test_resume_equals_uninterrupted(compiled_engine, tmp_path):
    try:
        cfg = grpo.GRPOConfig(regions=("rope",), **TINY)
        full = grpo.run(cfg, tmp_path / "full", engine=compiled_engine, progress=False)
        grpo.run(grpo.GRPOConfig(regions=("rope",), **(TINY | dict(steps=2))), tmp_path / "resumed", engine=compiled_engine, progress=False)
        write_as_before_checkpoint_json(tmp_path / "resumed", tmp_path / "legacy")
        resumed = grpo.run(cfg, tmp_path / "resumed", engine=compiled_engine, progress=False)
        pd.testing.assert_frame_equal(full.drop(columns=TIMING), resumed.drop(columns=TIMING))
        from_legacy = grpo.run(cfg, tmp_path / "legacy", engine=compiled_engine, progress=False)
        pd.testing.assert_frame_equal(full.drop(columns=TIMING), from_legacy.drop(columns=TIMING))
        assert "history" not in torch.load(tmp_path / "legacy" / "checkpoint.pt", weights_only=True)  # saved anew
        assert full["exact_kl"].iloc[1:].notna().all()  # small vocabulary: the exact KL is logged
        assert full["step"].tolist() == [0, 1, 2, 3, 4] and full["eval_accuracy"].notna().sum() == 3  # step 0: before training
        a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["master"]
        b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["master"]
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((tmp_path / "resumed" / "checkpoint.json").read_text())["step"] == 4  # the history beside it
        starts = json.loads((tmp_path / "resumed" / "machine.json").read_text())  # each start records its machine
        assert len(starts) == 2 and starts[-1]["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], load_model("qwen3-tiny", dtype="float32").state_dict()["model.layers.0.mlp.up_proj.weight"])
        with pytest.raises(ValueError, match="different settings"):
            grpo.run(grpo.GRPOConfig(**TINY), tmp_path / "full", engine=compiled_engine, progress=False)
        # a run started before a setting existed (absent from its config.json) resumes: it ran with the default
        config = json.loads((tmp_path / "full" / "config.json").read_text())
        del config["rollout_logit_noise"], config["task"]
        (tmp_path / "full" / "config.json").write_text(json.dumps(config))
        again = grpo.run(cfg, tmp_path / "full", engine=compiled_engine, progress=False)
        pd.testing.assert_frame_equal(full.drop(columns=TIMING), again.drop(columns=TIMING))
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))  # the shared engine goes back to the shipped weights


class Payload:
    """What a planted checkpoint could hold: unpickling it calls `Path.touch(marker)` (any callable would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """A checkpoint.pt whose unpickling runs code, planted in a run folder beside the run's config.json: resuming
    refuses it before building any of it (and before an engine starts), and nothing runs."""
    cfg = grpo.GRPOConfig(**TINY)
    folder, marker = tmp_path / "run", tmp_path / "ran"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(cfg) | {"regions": []}))
    planted = dict(step=2, master=Payload(marker), opt={}, history=[dict(step=0)])
    torch.save(planted, folder / "checkpoint.pt")
    torch.save(planted, tmp_path / "unsafe.pt")
    torch.load(tmp_path / "unsafe.pt", weights_only=False)  # the plant works: unpickled, it runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(grpo.CheckpointError, match="more than tensors.*GLOBAL.*was not loaded.*start the run over"):
        grpo.run(cfg, folder, engine=object(), progress=False)  # no engine method is reached
    assert not marker.exists()


def test_checkpoints_from_before_checkpoint_json_resume_safely(tmp_path):
    """A checkpoint.pt that kept the history itself (numpy scalars and all) loads with weights_only=True."""
    history = [dict(step=0, eval_accuracy=np.float64(0.25)),
               dict(step=1, reward=np.float64(0.5), tokens=np.int64(12), k3=np.float64(np.nan), padded_tokens=40)]
    master = dict(w=torch.arange(3.0))
    opt = dict(state={0: dict(step=torch.tensor(1.0))}, param_groups=[dict(betas=(0.9, 0.999), params=[0])])
    torch.save(dict(step=1, master=master, opt=opt, history=history), tmp_path / "checkpoint.pt")
    state, loaded = grpo.load_checkpoint(tmp_path)
    assert state["step"] == 1 and torch.equal(state["master"]["w"], master["w"]) and state["opt"] == opt
    pd.testing.assert_frame_equal(pd.DataFrame(loaded), pd.DataFrame(history))


def test_checkpoint_pair_after_a_crash_between_its_writes(tmp_path):
    """checkpoint.json is written before checkpoint.pt: ahead of the .pt, its history is cut at the .pt's step; behind
    it or missing, the history of the .pt's steps is lost and resuming is refused."""
    rows = [dict(step=s, reward=s / 3) for s in range(5)]
    torch.save(dict(step=2, master={}, opt={}), tmp_path / "checkpoint.pt")
    (tmp_path / "checkpoint.json").write_text(json.dumps(dict(step=4, history=rows)))
    assert grpo.load_checkpoint(tmp_path)[1] == rows[:3]
    (tmp_path / "checkpoint.json").write_text(json.dumps(dict(step=1, history=rows[:2])))
    with pytest.raises(grpo.CheckpointError, match="step 2 but checkpoint.json stops at step 1"):
        grpo.load_checkpoint(tmp_path)
    (tmp_path / "checkpoint.json").unlink()
    with pytest.raises(grpo.CheckpointError, match="checkpoint.json is missing"):
        grpo.load_checkpoint(tmp_path)
    assert grpo.load_checkpoint(tmp_path / "fresh") is None


@pytest.mark.engine
def test_weight_sync_matches_fp32_training_side(tmp_path):
    """After a push, the FP32 engine scores tokens like the FP32 training side (the control's premise)."""
    from rla_lib.engine import Engine
    from rla_lib.scoring import token_logprobs

    model = load_model("qwen3-tiny", dtype="float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    with Engine("qwen3-tiny", dtype="float32") as engine:
        seqs = [s.ids for g in engine.sample(["12+34=", "5+67+8="], n=4, max_tokens=16) for s in g]
        before = engine.score(seqs)
        engine.load_weights(model)
        after = engine.score(seqs)
    ours = token_logprobs(model, seqs)
    diff_after = max(np.abs(a.token_logprobs - b).max() for a, b in zip(after, ours))
    diff_before = max(np.abs(a.token_logprobs - b).max() for a, b in zip(before, ours))
    assert diff_after < 1e-4 < diff_before


def test_run_names_keep_plain_configurations_and_key_the_engine_schedule():
    assert arms.run_name("default BF16 + TIS", {}) == "default_BF16_plus_TIS"
    a = arms.run_name(arms.ENGINE_SCHEDULE, dict(regions=("rope",), align_options={"attention": "fp32"}))
    b = arms.run_name(arms.ENGINE_SCHEDULE, dict(regions=("rope",), align_options={"attention": "flash"}))
    assert a.startswith("engine_schedule-") and a != b


@pytest.mark.engine
def test_dose_run_interrupted_mid_run_resumes_identically(compiled_engine, tmp_path, monkeypatch):
    """A dose arm (logit noise in the engine, TIS) killed in the middle of step 3, one step after its last
    checkpoint, resumes from that checkpoint and ends bit for bit where an uninterrupted run does."""
    cfg = grpo.GRPOConfig(rollout_logit_noise=0.3, tis_cap=2.0, **TINY)
    try:
        full = grpo.run(cfg, tmp_path / "full", engine=compiled_engine, progress=False)
        step = grpo.train_step

        def crash_at_step_3(cfg, n, *args):
            if n == 3:
                raise KeyboardInterrupt("killed")
            return step(cfg, n, *args)

        monkeypatch.setattr(grpo, "train_step", crash_at_step_3)
        with pytest.raises(KeyboardInterrupt):
            grpo.run(cfg, tmp_path / "resumed", engine=compiled_engine, progress=False)
        monkeypatch.setattr(grpo, "train_step", step)
        resumed = grpo.run(cfg, tmp_path / "resumed", engine=compiled_engine, progress=False)
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))
    pd.testing.assert_frame_equal(full.drop(columns=TIMING), resumed.drop(columns=TIMING))
    h = full[full["step"] > 0]
    # per response: the exact KL summed over the response, averaged; nats (exact_kl is per token, in 1e-4)
    assert (h["seq_exact_kl"] > 0).all() and (h["seq_k3"] > 0).all()
    np.testing.assert_allclose(h["seq_exact_kl"], h["exact_kl"] * 1e-4 * h["response_len"], rtol=1e-9)


def test_run_many_closes_an_engine_once_no_later_run_needs_it(monkeypatch, tmp_path):
    """Given a list, the BF16 engine closes before the FP32 one starts (which then runs in this process); a lazy
    iterable, whose later runs are unknown, keeps every engine to the end."""
    events = []

    class Recorded:
        def __init__(self, model, mode, dtype, seed):
            self.dtype = dtype
            events.append(("start", dtype))

        def close(self):
            events.append(("close", self.dtype))

    monkeypatch.setattr(arms, "Engine", Recorded)
    monkeypatch.setattr(arms, "run", lambda cfg, out, engine, progress: events.append(("run", engine.dtype)) or pd.DataFrame())
    bf16, fp32 = grpo.GRPOConfig(**TINY), grpo.GRPOConfig(**TINY, precision="fp32")
    runs = [(bf16, tmp_path / "a"), (bf16, tmp_path / "b"), (fp32, tmp_path / "c")]
    b, f = bf16.engine_dtype, fp32.engine_dtype
    assert len(list(arms.run_many(runs))) == 3
    assert events == [("start", b), ("run", b), ("run", b), ("close", b), ("start", f), ("run", f), ("close", f)]
    events.clear()
    assert len(list(arms.run_many(iter(runs)))) == 3
    assert events == [("start", b), ("run", b), ("run", b), ("start", f), ("run", f), ("close", b), ("close", f)]


@pytest.mark.engine
def test_run_many_keeps_going_past_a_failed_run(compiled_engine, tmp_path, monkeypatch):
    """One bad run of a sweep (here: a folder holding another run's settings) is reported and the next runs."""
    class Shared:  # the session's engine, never closed by run_many
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):
            return getattr(compiled_engine, name)

        def close(self):
            pass

    monkeypatch.setattr(arms, "Engine", Shared)  # run_many's engines
    cfg = grpo.GRPOConfig(**(TINY | dict(steps=1, eval_every=1, checkpoint_every=1)))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"lr": 1.0}))
    try:
        out = list(arms.run_many([(cfg, tmp_path / "bad"), (cfg, tmp_path / "good")], progress=False, keep_going=True))
        with pytest.raises(ValueError, match="different settings"):
            list(arms.run_many([(cfg, tmp_path / "bad")], progress=False))
    finally:
        compiled_engine.load_weights(load_model("qwen3-tiny"))
    assert isinstance(out[0][2], ValueError) and "different settings" in str(out[0][2])
    assert isinstance(out[1][2], pd.DataFrame) and (tmp_path / "good" / "history.csv").exists()
