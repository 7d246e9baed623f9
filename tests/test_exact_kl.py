"""The exact KL at a real Qwen's vocabulary (151,936 tokens), from the engine's hidden states chunk by chunk
(rla_lib.exact_kl), against vLLM's own full prompt logprobs, compiled and eager.

The model is the Qwen3-0.6B shape shrunk in depth and width but not in vocabulary (rla_lib.real_shape.NARROW), so the
engine starts in seconds while every vocabulary-sized path runs at full size."""

from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rla_lib import kl, mismatch, mismatch_run, sides, task
from rla_lib.align import REGIONS
from rla_lib.engine import Engine
from rla_lib.engine_worker import pack_tensor, unpack_tensor
from rla_lib.exact_kl import exact_kl, kl_terms
from rla_lib.models import load_model, resolve_model
from rla_lib.scoring import token_logprobs


def test_tensors_cross_the_rpc_boundary_intact():
    for t in (torch.randn(3, 5).to(torch.bfloat16), torch.randn(2, 7), torch.arange(6).view(2, 3)):
        back = unpack_tensor(pack_tensor(t))
        assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_kl_terms_match_the_numpy_estimator():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(6, 50, generator=g) * 3, -1)
    q = torch.log_softmax(torch.randn(6, 50, generator=g) * 3, -1)
    p[0, :10] = -torch.inf  # tokens the inference side never gives
    assert np.allclose(kl_terms(p, q).numpy(), kl.exact_terms(p.numpy(), q.numpy()), rtol=1e-12, atol=0)
    assert (kl_terms(p, p) == 0).all()


@pytest.fixture(scope="module")
def eager_engine(narrow_model):
    """The narrow model's eager engine in vLLM's own processes, as a real checkpoint's runs, shared by this file's eager
    tests (a start there is about a minute on an AVX2-only CPU). Each test gets it with an empty prefix cache, so no test
    reads KV another computed. max_logprobs=-1 only to get vLLM's own full lists for the check below."""
    with Engine(narrow_model, mode="eager", max_logprobs=-1, in_process=False) as engine:
        yield engine


def fresh(engine):
    engine.llm.reset_prefix_cache()
    return engine


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_full_vocab_logprobs_and_exact_kl_equal_vllm_prompt_logprobs(narrow_model, mode, request):
    prompts = [p.prompt for p in task.load_split()[:3]]
    # eager: the shared engine, across vLLM's process boundary; compiled: in this process (a spawn saved; the same bits)
    with (nullcontext(fresh(request.getfixturevalue("eager_engine"))) if mode == "eager" else
          Engine(narrow_model, mode=mode, max_logprobs=-1, in_process=True)) as engine:
        samples = [s for g in engine.sample(prompts, n=2, max_tokens=6, seed=3) for s in g]
        sequences, starts = [s.ids for s in samples], [s.response_start for s in samples]
        direct = [engine.score([ids], top_k=-1)[0] for ids in sequences[:2]]  # every token's logprob, vLLM's lists
        hidden = engine.prompt_hidden(sequences)
        for ids, d, h in zip(sequences, direct, hidden):
            assert torch.equal(engine.logprobs_from_hidden(h), torch.from_numpy(d.full))
            chunked = torch.cat([engine.logprobs_from_hidden(h[a : a + 2]) for a in range(0, len(h), 2)])
            assert torch.equal(chunked, torch.from_numpy(d.full))  # chunking changes no bit
        model = load_model(narrow_model)
        res = exact_kl(engine, model, sequences, starts, chunk_size=3)
    assert len(res.terms) == len(sequences)
    train = token_logprobs(model, sequences, full_vocab=True)  # the same batch as exact_kl's: the same bits
    for i, (ids, start, d) in enumerate(zip(sequences, starts, direct)):
        train_full = train[i][1]
        want = kl.exact_terms(d.full[start:], train_full[start:])
        assert np.allclose(res.terms[i], want, rtol=1e-9, atol=1e-15)  # FP64 sums in another order
        assert np.array_equal(res.inference_lp[i], d.token_logprobs[start:])
        assert np.array_equal(res.training_lp[i], train_full[start:][np.arange(len(want)), ids[start + 1:]])
    assert res.mean() > 0  # BF16 engine vs BF16 Transformers: a real, positive gap


def test_refuses_a_pair_it_cannot_compare(narrow_model):
    engine = SimpleNamespace(spec=resolve_model(narrow_model))  # refused before the engine is used
    with pytest.raises(ValueError, match="vocabulary of 151936 tokens, the training model 16"):
        exact_kl(engine, load_model("qwen3-tiny"), [[1, 2, 3]])
    with pytest.raises(ValueError, match="response start"):
        exact_kl(engine, load_model(narrow_model), [[1, 2, 3]], starts=[2])


@pytest.mark.engine
def test_mismatch_runs_carry_the_exact_kl_at_full_vocab(narrow_model, eager_engine, tmp_path, monkeypatch):
    configs = {"none": ((), {}), "all three": (REGIONS, {})}
    kwargs = dict(modes=("eager",), training_configs=configs, n_prompts=3, n_samples=2, max_tokens=6, fp32_reference=False,
                  cache_dir=tmp_path)
    started = []  # each engine measure starts, given the file's running one (the same model, mode and seed)

    def start(model, mode, seed):
        assert (resolve_model(model).path, mode, seed) == (resolve_model(narrow_model).path, "eager", 0)
        started.append(mode)
        return nullcontext(fresh(eager_engine))

    monkeypatch.setattr(mismatch, "Engine", start)
    run = mismatch.measure(narrow_model, **kwargs)
    assert started == ["eager"]  # one engine for the mode: it samples, scores and gives the exact KL
    assert run.estimators == ("sampled", "k3", "exact") and not run.full  # no distribution kept, the terms are
    for name in configs:
        terms = run.exact[mismatch_run.exact_key(sides.engine("eager"), sides.training(name))]
        # a KL per position is >= 0; FP32 logprobs (each ~1e-6 off at |logp| ~ 20) allow about -1e-6, 10x margin
        assert len(terms) == run.lengths.sum() and (terms > -1e-5).all() and terms.mean() > 0
        assert np.isfinite(run.estimate(sides.engine("eager"), sides.training(name), "exact").value)
    again = mismatch.measure(narrow_model, **kwargs)  # from the cache: the same terms, and no engine started
    assert started == ["eager"]
    assert again.exact.keys() == run.exact.keys()
    assert all(np.array_equal(again.exact[k], run.exact[k]) for k in run.exact)


def test_too_big_and_too_long_are_refused_before_work(narrow_model, monkeypatch):
    from rla_lib import grpo, models
    monkeypatch.setattr(models, "available_memory", lambda: 2**20)  # a machine with 1 MiB free
    with pytest.raises(MemoryError, match="loading .* needs about .* GiB .* and this machine has 0.0 GiB free"):
        models.load_model(narrow_model)
    with pytest.raises(MemoryError, match="GRPO on .* bytes\\) and this machine has 0.0 GiB free"):
        grpo.run(grpo.GRPOConfig(model=str(narrow_model)), "/nonexistent/never-written")
    engine = SimpleNamespace(max_model_len=8, spec=resolve_model(narrow_model), _to_ids=list)
    with pytest.raises(ValueError, match="does not fit this engine's context of 8 tokens: start it with a larger max_model_len"):
        Engine._fit(engine, [[1] * 8], 1)
