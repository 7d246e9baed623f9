import inspect
from types import SimpleNamespace

import numpy as np
import pytest

from rla_lib import graphs, kl, mismatch, mismatch_cache, mismatch_run, sides, task
from rla_lib.engine import Sample
from rla_lib.models import resolve_model


def _run(rng, prompts=(0, 0, 1)):
    seqs = [list(rng.integers(0, 16, n)) for n in (6, 9, 4)]
    starts = [2, 3, 1]
    run = mismatch_run.MismatchRun([list(map(int, s)) for s in seqs], starts, np.array([1.0, 0.0, 1.0]), np.array(prompts))
    for side in ("vllm:compiled", "hf:bf16:none", "hf:bf16:rope"):
        full = [np.log(rng.dirichlet(np.ones(16), len(s) - 1)) for s in seqs]
        run.add(side, [f[np.arange(len(s) - 1), s[1:]] for f, s in zip(full, seqs)], full)
    return run


def test_add_keeps_response_tokens_and_pairs_line_up(tmp_path):
    run = _run(np.random.default_rng(0))
    assert list(run.lengths) == [3, 5, 2] and run.token_lp["vllm:compiled"].shape == (10,)
    pairs = run.pairs("vllm:compiled", "hf:bf16:none")
    assert [len(p["inf_lp"]) for p in pairs] == [3, 5, 2] and pairs[1]["inf_full"].shape == (5, 16)
    sums, counts = run.per_sequence_sums("vllm:compiled", "hf:bf16:none", "exact")
    assert list(counts) == [3, 5, 2] and np.all(sums > 0)
    with pytest.raises(KeyError, match="was not measured"):
        run.pairs("vllm:eager", "hf:bf16:none")
    with pytest.raises(ValueError, match="one prompt index per sequence"):
        mismatch_run.MismatchRun(run.sequences, run.starts, run.rewards, np.array([0, 1]))


def test_save_load_roundtrip(tmp_path):
    run = _run(np.random.default_rng(1))
    run.meta = {"model": "x"}
    loaded = mismatch_run.MismatchRun.load(run.save(tmp_path / "r.npz"))
    assert loaded.sequences == run.sequences and loaded.starts == run.starts and loaded.meta == {"model": "x"}
    np.testing.assert_array_equal(loaded.prompts, run.prompts)
    assert loaded.prompts.dtype == np.int64
    for side in run.sides:
        np.testing.assert_array_equal(loaded.token_lp[side], run.token_lp[side])
        np.testing.assert_array_equal(loaded.full[side], run.full[side])
    assert not list(tmp_path.glob("*.tmp*"))  # atomic: no temporary left behind


def test_a_file_without_prompts_is_refused(tmp_path):
    run = _run(np.random.default_rng(1))
    path = run.save(tmp_path / "old.npz")
    z = dict(np.load(path))
    del z["prompts"]
    np.savez_compressed(path, **z)
    with pytest.raises(ValueError, match="delete this cache file"):
        mismatch_run.MismatchRun.load(path)


def test_estimate_difference_and_table_resample_prompts():
    run = _run(np.random.default_rng(2), prompts=(3, 3, 5))
    e = run.estimate("vllm:compiled", "hf:bf16:none", "exact", n_boot=50)
    terms = [kl.terms("exact", p) for p in run.pairs("vllm:compiled", "hf:bf16:none")]
    assert e == kl.estimate(terms, clusters=[3, 3, 5], n_boot=50)
    assert (e.n_sequences, e.n_clusters, e.n_tokens) == (3, 2, 10)
    d = run.difference("vllm:compiled", "hf:bf16:none", "hf:bf16:rope", n_boot=50)
    assert d.a == pytest.approx(e.value) and d.n_clusters == 2
    assert d.b == pytest.approx(run.estimate("vllm:compiled", "hf:bf16:rope", "exact", n_boot=50).value)
    assert d.relative == pytest.approx(d.b / d.a - 1)
    same = run.difference("vllm:compiled", "hf:bf16:none", "hf:bf16:none", "k3", n_boot=50)
    assert same.diff == 0 and not same.separated
    t = mismatch.table(run, "vllm:compiled", ["hf:bf16:none", "hf:bf16:rope"], ("k3", "exact"), n_boot=50)
    assert list(t["prompts"]) == [2, 2] and list(t["tokens"]) == [10, 10]
    assert t.loc["hf:bf16:none", "exact"] == pytest.approx(e.value)


def test_configs_are_the_eight_subsets():
    cfgs = sides.all_configs(("rope", "swiglu", "residual_norm"))
    assert len(cfgs) == 8 and cfgs[0] == () and cfgs[-1] == ("rope", "swiglu", "residual_norm")
    assert sides.config_name(()) == "none" and sides.config_name(("rope", "swiglu")) == "rope+swiglu"


def test_config_names_carry_only_options_that_act():
    assert sides.config_name(("rope",), rope_cos_sin="bf16") == "rope|rope_cos_sin=bf16"
    assert sides.config_name(("swiglu",), rope_cos_sin="bf16") == "swiglu"  # no RoPE: the option is inert
    assert sides.config_name(("rope",), rope_cos_sin="fp32") == "rope"  # the default
    paper = sides.paper_configs()
    assert len(paper) == 12 and paper["rope+swiglu+residual_norm|rope_cos_sin=bf16"][1] == {"rope_cos_sin": "bf16"}
    other = {"rope_cos_sin": "bf16", "rope_qk_norm": "stock", "rope_rounding": "truncate", "norm_weight": "fp32",
             "residual_stream": "fp32", "fused": True, "attention": "flash", "rms_sum": "vec2x16"}
    assert set(other) == set(sides.OPTION_REGIONS)
    for name, value in other.items():  # each option, in its regions, changes what `align` is given; outside, nothing
        regions = sides.OPTION_REGIONS[name]
        assert sides.schedule_of(regions, {name: value}) != sides.schedule_of(regions), name
        rest = tuple(r for r in sides.ALL_REGIONS if r not in regions)
        if name != "fused":
            assert sides.schedule_of(rest, {name: value}) == sides.schedule_of(rest), name


def test_standard_sizes_are_the_measure_defaults():
    assert mismatch.STANDARD["n_prompts"] == len(task.load_split())
    params = inspect.signature(mismatch.measure).parameters
    assert {k: params[k].default for k in mismatch.STANDARD} == mismatch.STANDARD


def test_temperature_is_passed_to_the_scorers_only_when_not_one():
    assert mismatch._temperature_kwargs(1.0) == {}
    assert mismatch._temperature_kwargs(0.7) == {"temperature": 0.7}
    with pytest.raises(ValueError, match="temperature"):
        mismatch.measure(temperature=0.0, cache_dir=None)  # refused before any engine starts


# ---- the two cache layers -----------------------------------------------------------------------
def test_side_files_are_named_by_what_they_compute(tmp_path):
    f = lambda *a: mismatch_cache.side_file(tmp_path, *a)
    assert f("bfloat16", ("swiglu", "rope"), {}) == f("bfloat16", ("rope", "swiglu"), {"rope_cos_sin": "fp32"})
    assert f("bfloat16", ("swiglu",), {"rope_cos_sin": "bf16"}) == f("bfloat16", ("swiglu",), {})
    assert f("bfloat16", ("rope",), {"rope_cos_sin": "bf16"}) != f("bfloat16", ("rope",), {})
    assert f("bfloat16", (), {}) != f("float32", (), {})
    assert mismatch_cache.side_file(None, "bfloat16", (), {}) is None


def test_the_training_matmul_mode_keys_training_sides_not_the_engines_samples(tmp_path, monkeypatch):
    """`RLA_BF16_MATMUL` changes only the training side: the engine's samples, scores and captures are shared (notebook
    07's matmul control reuses them), while each BF16 training side gets a file per matmul mode."""
    model_dir = mismatch.resolve_model("qwen3-tiny").path
    found = {}
    for mode in ("native", "fp32"):
        monkeypatch.setenv("RLA_BF16_MATMUL", mode)
        found[mode] = dict(samples=mismatch_cache.sample_key(model_dir, "vllm:compiled", 4, 2, 8, 1.0, 0),
                           bf16=mismatch_cache.side_file(tmp_path, "bfloat16", ("rope",), {}),
                           fp32=mismatch_cache.side_file(tmp_path, "float32", (), {}),
                           vllm=graphs.capture_dir("qwen3-tiny", "vllm", "compiled"), hf=graphs.capture_dir("qwen3-tiny", "hf", "compiled"))
    native, fp32 = found["native"], found["fp32"]
    assert native["samples"] == fp32["samples"] and native["vllm"] == fp32["vllm"] and native["fp32"] == fp32["fp32"]
    assert native["bf16"] != fp32["bf16"] and native["hf"] != fp32["hf"]


def test_load_or_score_side_scores_once_and_checks_the_tokens(tmp_path):
    run = _run(np.random.default_rng(3))
    calls = []

    def score(run, side):
        calls.append(side)
        run.token_lp[side] = run.token_lp["hf:bf16:rope"] + len(calls)
        run.full[side] = run.full["hf:bf16:rope"]

    path = tmp_path / "side.npz"
    assert not mismatch_cache.load_or_score_side(run, "x", path, score)
    first = run.token_lp.pop("x").copy()
    run.full.pop("x")
    assert mismatch_cache.load_or_score_side(run, "x", path, score) and calls == ["x"]
    np.testing.assert_array_equal(run.token_lp["x"], first)
    np.testing.assert_array_equal(run.full["x"], run.full["hf:bf16:rope"])
    other = _run(np.random.default_rng(4))  # other tokens: the cached side does not apply
    assert not mismatch_cache.load_or_score_side(other, "x", path, score) and calls == ["x", "x"]
    assert not mismatch_cache.load_or_score_side(run, "y", None, score) and len(calls) == 3  # no cache: always scores


def test_load_or_sample(tmp_path):
    run = _run(np.random.default_rng(5))
    drawn = []
    sample = lambda: drawn.append(1) or run
    assert mismatch_cache.load_or_sample(tmp_path, sample) is run
    again = mismatch_cache.load_or_sample(tmp_path, sample)
    assert len(drawn) == 1 and again.sequences == run.sequences and not again.sides  # samples only, no scores
    np.testing.assert_array_equal(again.prompts, run.prompts)


class FakeEngine:
    """Stands in for vLLM: deterministic samples and scores, and a log of which modes were started."""

    started, score_temperatures, given = [], [], []
    in_process = False  # no engine code to capture a graph from (graphs.capturing makes nothing)

    def __init__(self, model, mode="compiled", seed=0):
        self.mode = mode
        FakeEngine.started.append(mode)
        FakeEngine.given.append(model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def sample(self, prompts, n, max_tokens, temperature, seed, **truncation):
        FakeEngine.truncation = truncation
        rng = np.random.default_rng(seed)
        groups = []
        for i, _ in enumerate(prompts):
            group = []
            for _ in range(n):
                response = [] if i == 1 else list(map(int, rng.integers(3, 16, rng.integers(1, 5))))  # prompt 1: empty
                group.append(Sample([1, 2, 3 + i % 5], response, np.zeros(len(response), np.float32), "1", True))
            groups.append(group)
        return groups

    def score(self, sequences, full_vocab=False, progress=False, temperature=1.0):
        self.temperature = temperature
        FakeEngine.score_temperatures.append(temperature)
        out = []
        for s in sequences:
            rng = np.random.default_rng([*s, 1 if self.mode == "compiled" else 2])
            full = np.log(rng.dirichlet(np.ones(16), len(s) - 1)).astype(np.float32)
            out.append(SimpleNamespace(token_logprobs=full[np.arange(len(s) - 1), s[1:]], full=full))
        return out


def test_measure_reuses_samples_engine_scores_and_training_sides(tmp_path, monkeypatch):
    """Two calls with other modes and configurations: only what is missing is computed (real
    Transformers for the training side, a fake engine for vLLM)."""
    FakeEngine.started, FakeEngine.given = [], []
    monkeypatch.setattr(mismatch, "Engine", FakeEngine)
    scored = []
    real_scorer = mismatch.score_training_side
    monkeypatch.setattr(mismatch, "score_training_side",
                        lambda run, model, side, *a: scored.append(side) or real_scorer(run, model, side, *a))
    sizes = dict(n_prompts=6, n_samples=2, max_tokens=4, seed=0, cache_dir=tmp_path)

    first = mismatch.measure("qwen3-tiny", modes=("compiled",), training_configs={"none": ((), {}), "stock": ((), {})}, **sizes)
    assert FakeEngine.started == ["compiled"] and scored == ["hf:bf16:none", "hf:fp32"]
    assert FakeEngine.given == [resolve_model("qwen3-tiny")]  # the name is resolved once, at the top, and handed down
    np.testing.assert_array_equal(first.token_lp["hf:bf16:none"], first.token_lp["hf:bf16:stock"])  # same computation
    assert set(first.prompts) == {0, 2, 3, 4, 5} and len(first.sequences) == 10  # empty responses dropped
    assert first.sides == ["vllm:compiled:sampled", "vllm:compiled", "hf:bf16:none", "hf:bf16:stock", "hf:fp32"]

    second = mismatch.measure("qwen3-tiny", modes=("compiled", "eager"),
                              training_configs={"stock again": ((), {}), "swiglu": (("swiglu",), {"rope_cos_sin": "bf16"})}, **sizes)
    assert FakeEngine.started == ["compiled", "eager"]  # samples and compiled scores came from the cache
    assert scored == ["hf:bf16:none", "hf:fp32", "hf:bf16:swiglu"]  # only the new training side was scored
    assert second.sequences == first.sequences
    np.testing.assert_array_equal(second.prompts, first.prompts)
    for a, b in [("vllm:compiled", "vllm:compiled"), ("hf:bf16:none", "hf:bf16:stock again"), ("hf:fp32", "hf:fp32")]:
        np.testing.assert_array_equal(first.token_lp[a], second.token_lp[b])
        np.testing.assert_array_equal(first.full[a], second.full[b])
    assert not np.array_equal(second.token_lp["hf:bf16:swiglu"], second.token_lp["hf:bf16:stock again"])

    fresh = mismatch.measure("qwen3-tiny", modes=("compiled",), training_configs={"none": ((), {})}, **(sizes | {"cache_dir": None}))
    np.testing.assert_array_equal(fresh.token_lp["hf:bf16:none"], first.token_lp["hf:bf16:none"])  # the cache changes nothing
    assert FakeEngine.started == ["compiled", "eager", "compiled"]


def test_measure_at_a_temperature_scores_both_sides_at_it(tmp_path, monkeypatch):
    FakeEngine.started, FakeEngine.score_temperatures = [], []
    monkeypatch.setattr(mismatch, "Engine", FakeEngine)
    sizes = dict(modes=("compiled",), training_configs={"none": ((), {})}, n_prompts=4, n_samples=2, max_tokens=4,
                 fp32_reference=False, cache_dir=tmp_path)
    hot = mismatch.measure("qwen3-tiny", temperature=0.7, **sizes)
    cold = mismatch.measure("qwen3-tiny", **sizes)
    assert FakeEngine.score_temperatures == [0.7, 1.0] and hot.meta["temperature"] == 0.7
    assert hot.sequences == cold.sequences  # the fake samples the same tokens: only the scoring differs
    lse = np.logaddexp.reduce(hot.full["hf:bf16:none"].astype(np.float64), axis=-1)
    np.testing.assert_allclose(lse, 0, atol=1e-5)  # still normalised distributions
    tempered = cold.full["hf:bf16:none"].astype(np.float64) / 0.7  # softmax(logits / T) from the T=1 distribution
    tempered -= np.logaddexp.reduce(tempered, -1, keepdims=True)
    np.testing.assert_allclose(hot.full["hf:bf16:none"], tempered, atol=1e-4)  # FP32 rounding of logits ~40 in size


def test_the_results_cache_key_covers_every_core_source_and_no_study(tmp_path, monkeypatch):
    """The key follows the package's files, not a hand list: the C kernels, the child processes' start-up code and
    every core module can change a score (a study cannot); editing one changes the key."""
    names = {str(p.relative_to(mismatch_cache.PACKAGE)) for p in mismatch_cache.core_sources()}
    assert {"native_kernels.c", "native.py", "align/vector_sums.py", "engine_process.py", "logit_noise.py", "align/versions.py",
            "child_site/sitecustomize.py", "graphs/reader.py", "align/patch.py", "align/kernels.c", "align/vector.h",
            "scoring.py"} <= names
    assert not any(n.startswith("studies/") for n in names)
    package = tmp_path / "rla_lib"
    for name in names:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_bytes((mismatch_cache.PACKAGE / name).read_bytes())
    monkeypatch.setattr(mismatch_cache, "PACKAGE", package)
    model = mismatch.resolve_model("qwen3-tiny").path
    before = mismatch_cache.fingerprint(model)
    (package / "native_kernels.c").write_text((package / "native_kernels.c").read_text() + "\n/* changed */\n")
    assert mismatch_cache.fingerprint(model) != before


def test_split_prompts_keeps_each_prompts_responses_together_and_their_scores():
    rng = np.random.default_rng(3)
    seqs = [list(map(int, rng.integers(0, 16, n))) for n in (6, 9, 4, 7, 5, 8)]
    run = mismatch_run.MismatchRun(seqs, [2, 3, 1, 2, 1, 3], np.arange(6.0), np.array([0, 0, 1, 1, 2, 2]))
    for side in ("vllm:compiled", "hf:bf16:none"):
        run.add(side, [rng.normal(size=len(s) - 1) for s in seqs])
    probe, held_out = run.split_prompts(seed=1)
    assert set(probe.prompts) | set(held_out.prompts) == {0, 1, 2} and not set(probe.prompts) & set(held_out.prompts)
    assert len(probe.sequences) + len(held_out.sequences) == 6
    for part in (probe, held_out):  # each sequence keeps its own scores
        for seq, lp in zip(part.sequences, np.split(part.token_lp["hf:bf16:none"], part.offsets[1:-1])):
            i = seqs.index(seq)
            assert np.array_equal(lp, run.token_lp["hf:bf16:none"][run.offsets[i]:run.offsets[i + 1]])
    assert run.split_prompts(seed=1)[0].sequences == probe.sequences  # seeded
    with pytest.raises(ValueError, match="two prompts"):
        run.subset(run.prompts == 0).split_prompts()


def test_truncated_sampling_is_its_own_cache_folder_and_keeps_the_samplers_logprobs(tmp_path, monkeypatch):
    """top_p / top_k reach the engine only when they truncate, key the samples' folder only then (untruncated runs keep
    their folders), and the sampler's logprobs come back from the cache as their own side."""
    FakeEngine.started = []
    monkeypatch.setattr(mismatch, "Engine", FakeEngine)
    sizes = dict(modes=("compiled",), training_configs={"none": ((), {})}, n_prompts=4, n_samples=2, max_tokens=4,
                 fp32_reference=False, cache_dir=tmp_path)
    plain = mismatch.measure("qwen3-tiny", **sizes)
    assert FakeEngine.truncation == {} and "top_p" not in plain.meta
    nucleus = mismatch.measure("qwen3-tiny", top_p=0.9, top_k=20, **sizes)
    assert FakeEngine.truncation == {"top_p": 0.9, "top_k": 20} and (nucleus.meta["top_p"], nucleus.meta["top_k"]) == (0.9, 20)
    assert len(list(tmp_path.glob("*/samples.npz"))) == 2
    again = mismatch.measure("qwen3-tiny", top_p=0.9, top_k=20, **sizes)
    assert FakeEngine.started == ["compiled", "compiled"]  # the second truncated call read everything from the cache
    np.testing.assert_array_equal(again.token_lp["vllm:compiled:sampled"], nucleus.token_lp["vllm:compiled:sampled"])
    with pytest.raises(ValueError, match="top_p must be in"):
        mismatch.measure("qwen3-tiny", top_p=0.0, **sizes)
    with pytest.raises(ValueError, match="top_k must be a whole number"):
        mismatch.measure("qwen3-tiny", top_k=-1, **sizes)
