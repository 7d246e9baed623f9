import numpy as np
import pytest

from rla_lib import mismatch


def _run(rng):
    seqs = [list(rng.integers(0, 16, n)) for n in (6, 9, 4)]
    starts = [2, 3, 1]
    run = mismatch.MismatchRun([list(map(int, s)) for s in seqs], starts, np.array([1.0, 0.0, 1.0]))
    for side in ("vllm:compiled", "hf:bf16:none"):
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


def test_save_load_roundtrip(tmp_path):
    run = _run(np.random.default_rng(1))
    run.meta = {"model": "x"}
    loaded = mismatch.MismatchRun.load(run.save(tmp_path / "r.npz"))
    assert loaded.sequences == run.sequences and loaded.starts == run.starts and loaded.meta == {"model": "x"}
    for side in run.sides:
        np.testing.assert_array_equal(loaded.token_lp[side], run.token_lp[side])
        np.testing.assert_array_equal(loaded.full[side], run.full[side])
    assert not list(tmp_path.glob("*.tmp*"))  # atomic: no temporary left behind


def test_configs_are_the_eight_subsets():
    cfgs = mismatch.all_configs(("rope", "swiglu", "residual_norm"))
    assert len(cfgs) == 8 and cfgs[0] == () and cfgs[-1] == ("rope", "swiglu", "residual_norm")
    assert mismatch.config_name(()) == "none" and mismatch.config_name(("rope", "swiglu")) == "rope+swiglu"
