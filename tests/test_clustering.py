"""rla_lib.rounding: the clustering score over values that actually round, and RoPE at chosen positions."""

import math

import pytest
import torch

from rla_lib import rounding as R
from tiny_models import batch, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)


def grid_values(n, seed=0):
    """n FP32 values that are BF16 numbers (no rounding error)."""
    return R.round_bf16(torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10).float()


def off_grid_values(n, seed=1):
    """n FP32 values with uniformly random nonzero low 16 bits: uniform rounding positions, none exact."""
    g = torch.Generator().manual_seed(seed)
    high = grid_values(n, seed).view(torch.int32)
    low = torch.randint(1, 65536, (n,), generator=g, dtype=torch.int32)
    return (high | low).view(torch.float32)


# ------------------------------------------------------------------------------------------------ the statistic


def test_uniform_positions_sit_at_the_floor():
    v = off_grid_values(100_000)
    c = R.rounding_clustering(v)
    assert c.n == c.n_all == v.numel() and c.exact_frac == 0.0
    assert c.floor == 1 / math.sqrt(c.n)
    # n * score**2 is a mean of 16 independent Exp(1) variables (sd 0.25): a factor 3 is far outside it
    assert c.floor / 3 < c.score < 3 * c.floor
    assert c.floor / 3 < c.score_without_ties < 3 * c.floor
    # the mean signed error of uniform positions: within 5 standard errors of zero
    assert c.mean_error_se == pytest.approx(1 / math.sqrt(12 * c.distinct), rel=0.05)
    assert abs(c.mean_error) < 5 * c.mean_error_se


def test_grid_values_are_excluded_and_floors_use_the_filtered_sample():
    on, off = grid_values(30_000, seed=2), off_grid_values(10_000, seed=3)
    c = R.rounding_clustering(torch.cat([on, off]))
    assert (c.n_all, c.n) == (40_000, 10_000) and c.exact_frac == 0.75
    # bitwise the score, floors and distinct count of the off-grid part alone
    alone = R.rounding_clustering(off)
    for field in ("score", "floor", "distinct", "distinct_floor", "score_without_ties", "mean_error"):
        assert getattr(c, field) == getattr(alone, field), field
    assert c.floor / 3 < c.score < 3 * c.floor
    # counting the grid values as well is what made such a sample look clustered
    assert R.fourier_clustering(R.rounding_position(torch.cat([on, off]))) > 0.5
    assert R.clustering_score(torch.cat([on, off])) == c.score


def test_a_sample_of_grid_values_only_gives_nan():
    c = R.rounding_clustering(grid_values(1000))
    assert c.n == 0 and c.n_all == 1000 and c.exact_frac == 1.0 and c.tie_frac == 0.0
    assert all(math.isnan(getattr(c, f)) for f in ("score", "floor", "distinct_floor", "score_without_ties", "mean_error"))
    assert math.isnan(R.clustering_score(torch.zeros(10)))
    with pytest.raises(ValueError, match="no finite values"):
        R.rounding_clustering(torch.tensor([float("nan"), float("inf")]))


def test_ties_round_to_the_even_neighbour_both_ways():
    # 1 + (2j+1) 2**-8 lies halfway between 1 + j 2**-7 and the next BF16 value: even j rounds down, odd j up
    ties = 1 + (2 * torch.arange(128, dtype=torch.float32) + 1) * 2.0**-8
    c = R.rounding_clustering(torch.cat([ties, -ties]))
    assert c.n == 256 and c.tie_frac == 1.0 and c.exact_frac == 0.0
    assert c.score == pytest.approx(1.0, abs=1e-12)  # all at one position: the score counts them as clustered
    assert c.mean_error == 0.0  # ... but their errors cancel exactly: half +1/2, half -1/2
    assert math.isnan(c.score_without_ties)
    # mixed with uniform positions, the tie share is reported and removing the ties restores the floor
    off = off_grid_values(20_000, seed=4)
    mixed = R.rounding_clustering(torch.cat([off, ties.repeat(40)]))
    assert mixed.tie_frac == pytest.approx((5120 + int((R.rounding_position(off) == 0.5).sum())) / mixed.n_all)
    assert mixed.score > 5 * mixed.floor and mixed.score_without_ties < 3 / math.sqrt(20_000)


# ------------------------------------------------------------------------------------------------ RoPE at positions


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_task_positions_reproduce_the_capture_bitwise(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    full = R.capture_prerounding(model, ids, mask)
    rope = R.capture_rope_at_positions(model, ids, mask, "task")
    assert list(rope) == list(R.ROPE_LOCATIONS)
    for name in R.ROPE_LOCATIONS:
        for layer in (0, 1):
            assert torch.equal(rope[name][layer], full[name][layer]), (name, layer)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_position_zero_is_exact_and_excluded(arch):
    model = tiny_model(arch)
    ids, mask = batch()
    q, k = R.capture_rope_inputs(model, ids, mask)[0]
    at_zero = R.capture_rope_at_positions(model, ids, mask, torch.zeros_like(ids))
    # cos = 1 and sin = 0 exactly: q*cos is q itself, the sin product is zero, the sum is q
    assert torch.equal(at_zero["rope.q_cos"][0], q.float()) and torch.equal(at_zero["rope.k_sum"][0], k.float())
    assert not bool(at_zero["rope.q_sin"][0].any())
    for name in R.ROPE_LOCATIONS:
        c = R.rounding_clustering(at_zero[name][0])
        assert c.exact_frac == 1.0 and c.n == 0, name
    # at task positions the first token (position 0) is all exact, so none of it is in the sample
    task = R.capture_rope_at_positions(model, ids, mask, "task")["rope.q_cos"][0]
    assert bool((R.rounding_position(task[:, 0]) == 0).all())
    c = R.rounding_clustering(task)
    assert c.n == int((R.rounding_position(task[:, 1:]) != 0).sum())


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_long_positions_match_a_stock_forward_at_those_positions(arch):
    """Layer 0's q/k do not depend on position, so the stock model run with position_ids far beyond
    max_position_embeddings must rotate them to round_bf16 of the captured sums, bit for bit."""
    model = tiny_model(arch)
    ids, mask = batch()
    positions = R.uniform_positions(ids.shape, 4096, seed=5)
    assert int(positions.max()) >= model.config.max_position_embeddings  # the test means something
    rope = R.capture_rope_at_positions(model, ids, mask, positions, layers=[0])
    with torch.no_grad(), R.record_region_outputs(model, layer=0) as record:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    q, k = (t.transpose(1, 2) for t in record["rope"])  # (B, H, T, D) -> (B, T, H, D)
    assert torch.equal(R.round_bf16(rope["rope.q_sum"][0]).view(torch.int16), q.contiguous().view(torch.int16))
    assert torch.equal(R.round_bf16(rope["rope.k_sum"][0]).view(torch.int16), k.contiguous().view(torch.int16))


def test_positions_settings():
    a = R.uniform_positions((3, 5), 4096, seed=1)
    assert torch.equal(a, R.uniform_positions((3, 5), 4096, seed=1)) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 4096
    assert R.task_positions(torch.zeros(2, 4)).tolist() == [[0, 1, 2, 3]] * 2
    assert (R.positions_label("task"), R.positions_label(4096)) == ("task", "uniform [0, 4096)")
    model = tiny_model("qwen2")
    ids, mask = batch()
    with pytest.raises(ValueError, match="positions must be"):
        R.capture_rope_at_positions(model, ids, mask, "long")
    with pytest.raises(ValueError, match="position_ids has shape"):
        R.rope_prerounding(model, R.capture_rope_inputs(model, ids, mask, layers=[0]), torch.zeros(1, 2, dtype=torch.long))


def test_clustering_table_counts_rounding_values_only():
    model = tiny_model("qwen2")
    ids, mask = batch()
    table = R.clustering_table(R.capture_rope_at_positions(model, ids, mask, "task"), mask)
    assert table.location.tolist() == [n for n in R.ROPE_LOCATIONS for _ in (0, 1)]
    cfg = model.config
    heads = table.location.str.startswith("rope.q").map({True: cfg.num_attention_heads, False: cfg.num_key_value_heads})
    assert (table.n_all == int(mask.sum()) * heads * cfg.head_dim).all()
    assert (table.n == (table.n_all * (1 - table.exact_frac)).round()).all()
    assert ((table.floor * table.n ** 0.5 - 1).abs() < 1e-12).all()
    summary = R.summarize_clustering(table)
    assert list(summary.index) == list(R.ROPE_LOCATIONS) and (summary.layers_without_rounding == 0).all()
