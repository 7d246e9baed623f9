"""rla_lib.studies.location_clustering: clustering tables per location, their classes against the floor and the paper's
range, and the paper's claims judged from them."""

import math

import pandas as pd
import pytest
import torch

from rla_lib.studies import location_clustering as LC
from rla_lib.studies import prerounding as P
from rla_lib.models import EMBEDDED_MODELS
from tiny_models import batch, one_thread, tiny_model  # noqa: F401 (one_thread: an autouse fixture)

K_FLOOR, CLUSTERED_MIN = 3, 0.038  # the notebook's defaults: 3x the floor, the paper's lower bound


# ------------------------------------------------------------------------------------------------ tables


def test_distinct_prefix_mask():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    assert LC.distinct_prefix_mask(ids, mask).tolist() == [[True, True, True], [False, False, True], [False, True, False]]


def test_clustering_table_on_a_capture():
    model = tiny_model("qwen2", layers=1, seed=2)
    ids, mask = batch()
    table = LC.clustering_table(P.capture_prerounding(model, ids, mask), mask)
    assert set(table.columns) >= {"location", "layer", "n", "score", "floor"}
    assert bool((table.score <= 1 + 1e-12).all()) and bool((table.score > 0).all())
    row = table.set_index("location").loc["o_proj"]
    # the score and its floor count the values that round (n of n_all): exact ones are a separate share
    assert row.n_all == int(mask.sum()) * 256 and row.n == round(row.n_all * (1 - row.exact_frac))
    assert row.floor == pytest.approx(1 / math.sqrt(row.n))
    summary = LC.summarize_clustering(table)
    assert list(summary.index) == list(dict.fromkeys(table.location))


def test_clustering_table_counts_rounding_values_only():
    model = tiny_model("qwen2")
    ids, mask = batch()
    table = LC.clustering_table(P.capture_rope_at_positions(model, ids, mask, "task"), mask)
    assert table.location.tolist() == [n for n in P.ROPE_LOCATIONS for _ in (0, 1)]
    cfg = model.config
    heads = table.location.str.startswith("rope.q").map({True: cfg.num_attention_heads, False: cfg.num_key_value_heads})
    assert (table.n_all == int(mask.sum()) * heads * cfg.head_dim).all()
    assert (table.n == (table.n_all * (1 - table.exact_frac)).round()).all()
    assert ((table.floor * table.n ** 0.5 - 1).abs() < 1e-12).all()
    summary = LC.summarize_clustering(table)
    assert list(summary.index) == list(P.ROPE_LOCATIONS) and (summary.layers_without_rounding == 0).all()


def test_calibration_samples_give_their_known_answers():
    samples = LC.calibration_samples(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(samples.values(), LC.calibration_samples(seed=0).values()))
    t = LC.calibration_table(samples)
    assert list(t.index) == list(samples)
    for label in ("uniform positions, n=10,000", "uniform positions, n=1,000,000"):
        r = t.loc[label]
        assert r["exact share"] == 0 and r["floor 1/√n"] / 3 < r["score (rounding values)"] < 3 * r["floor 1/√n"]
    grid = t.loc["all on the grid"]
    assert grid["exact share"] == 1 and math.isnan(grid["score (rounding values)"]) and grid["earlier score (all values)"] == 1
    mixed = t.loc["80% on the grid, rest uniform"]
    assert mixed["exact share"] == 0.8 and mixed["score (rounding values)"] < 3 * mixed["floor 1/√n"]
    assert mixed["earlier score (all values)"] > 0.5  # what counting the grid values made of it
    ties = t.loc["exact ties only"]
    assert ties["tie share"] == 1 and ties["mean error (ulp)"] == 0
    assert ties["score (rounding values)"] == pytest.approx(1, abs=1e-12)
    half = t.loc["half on the grid, half ties"]
    assert (half["exact share"], half["tie share"], half["mean error (ulp)"]) == (0.5, 0.5, 0)


@pytest.mark.skipif(not (EMBEDDED_MODELS["qwen2-tiny"] / "config.json").exists(), reason="embedded model missing")
def test_capture_model_tabulates_task_and_realistic_positions():
    run = LC.capture_model("qwen2-tiny", 6, max_position=4096, seed=1)
    assert run.name == "qwen2-tiny" and run.token_mask.dtype == torch.bool
    task_rows, long_rows = run.table[run.table.positions == "task"], run.table[run.table.positions == "uniform [0, 4096)"]
    assert list(dict.fromkeys(task_rows.location)) == list(run.captures)
    assert list(dict.fromkeys(long_rows.location)) == list(P.ROPE_LOCATIONS) == list(run.rope_captures)
    assert (run.table.model == "qwen2-tiny").all()
    assert (task_rows.n_all[task_rows.location == "q_proj"] == int(run.token_mask.sum()) * 256).all()
    lines = run.description.split("\n")
    assert len(lines) == 2 and lines[0].startswith("qwen2-tiny: Qwen2ForCausalLM") and "uniform [0, 4096) positions" in lines[1]
    assert not LC.capture_model("qwen2-tiny", 2).rope_captures


# ------------------------------------------------------------------------------------------------ classes and claims


def test_classify_score():
    classify = lambda median, floor=1e-3: LC.classify_score(median, floor, K_FLOOR, CLUSTERED_MIN)  # noqa: E731
    assert classify(float("nan")) == "nothing rounds"
    assert classify(3e-3) == classify(1e-4) == "at the floor"
    assert classify(3.1e-3) == classify(0.030) == "above the floor"
    assert classify(0.031) == classify(0.047) == "borderline"  # 0.8 .. 1.25 x 0.038
    assert classify(0.048) == classify(0.47) == "clustered (paper's range)"


def test_paper_verdict():
    verdict = LC.paper_verdict
    assert verdict("not reported", "clustered (paper's range)") == "—"
    assert verdict("near-uniform", "at the floor") == "yes"
    assert verdict("near-uniform", "above the floor") == verdict("near-uniform", "clustered (paper's range)") == "no"
    assert [verdict("clustered", m) for m in ("clustered (paper's range)", "borderline", "above the floor", "at the floor",
                                              "nothing rounds")] == ["yes", "borderline", "weaker", "no", "no"]


def test_claim_outcome():
    assert LC.claim_outcome(["yes", "yes"]) == "reproduces"
    assert LC.claim_outcome(["no"]) == "does not reproduce"
    assert LC.claim_outcome(["yes", "borderline"]) == "is borderline"
    assert LC.claim_outcome(["weaker", "borderline"]) == LC.claim_outcome(["weaker"]) == \
        "holds only weakly (above the floor, below the paper's range)"
    assert LC.claim_outcome(["yes", "weaker", "no"]) == "is mixed (no, weaker, yes)"


def synthetic_table(model: str, positions: str, scores: dict, floor: float = 1e-4, tie_frac: float = 0.0) -> pd.DataFrame:
    """`capture_model`-like rows: each location's two layers at the given median score, n = 1/floor**2."""
    rows = []
    for loc, score in scores.items():
        info = P.LOCATION_BY_NAME[loc]
        for layer, spread in enumerate((0.9, 1.1)):
            rows.append(dict(location=loc, group=info.group, paper=info.paper, exact=info.exact, layer=layer,
                             n_all=int(1 / floor**2), n=int(1 / floor**2), exact_frac=0.0, tie_frac=tie_frac,
                             score=score * spread, floor=floor, distinct=int(1 / floor**2), distinct_floor=floor,
                             score_without_ties=score, mean_error=0.0, mean_error_se=floor / math.sqrt(12),
                             score_all_values=score, model=model, positions=positions))
    return pd.DataFrame(rows)


# The paper: 1.5e-5 .. 8e-4 at projections, attention and norms; 0.038 .. 0.472 at SiLU, RoPE products and residual sums.
PAPER_LIKE = {"q_proj": 1e-4, "attention": 2e-4, "input_norm.rsqrt": 1e-4, "silu": 0.2, "rope.q_cos": 0.3, "rope.k_cos": 0.05,
              "residual_attn": 0.4, "residual_mlp": 0.1, "rope.q_sum": 0.3}
# Weaker than the paper: RoPE products an order below its range, SiLU borderline, attention above the floor.
WEAKER = {"q_proj": 1e-4, "attention": 5e-3, "silu": 0.035, "rope.q_cos": 0.02, "rope.k_cos": 0.3, "rope.q_sin": 0.02,
          "residual_attn": 0.3}


def test_claims_are_judged_from_the_scores():
    table = pd.concat([synthetic_table("paper-like", "task", PAPER_LIKE), synthetic_table("weaker", "task", WEAKER),
                       synthetic_table("weaker", "uniform [0, 4096)", {"rope.q_cos": 0.02, "rope.k_cos": 0.02})])
    summary = LC.summarize_models(table, K_FLOOR, CLUSTERED_MIN)
    assert summary.set_index(["model", "location"]).loc[("weaker", "silu"), "measured"] == "borderline"
    results = LC.claim_results(summary).set_index(["claim", "positions", "model"])
    outcome = results.outcome
    assert outcome[("projections near-uniform", "task", "paper-like")] == "reproduces"
    assert outcome[("RoPE products clustered (q*cos)", "task", "paper-like")] == "reproduces"
    assert outcome[("residual sums clustered", "task", "paper-like")] == "reproduces"
    assert outcome[("attention output near-uniform", "task", "weaker")] == "does not reproduce"
    assert outcome[("SiLU output clustered", "task", "weaker")] == "is borderline"
    assert outcome[("RoPE products clustered (q*cos)", "task", "weaker")] == "is mixed (weaker, yes)"
    assert outcome[("RoPE products clustered (q*cos)", "uniform [0, 4096)", "weaker")] == \
        "holds only weakly (above the floor, below the paper's range)"
    # the score range is that of the claim's locations' medians (over layers)
    r = results.loc[("RoPE products clustered (q*cos)", "task", "paper-like")]
    assert (r.score_min, r.score_max) == pytest.approx((0.05, 0.3))
    # only claims with measured locations appear: the sin products were measured for "weaker" only
    assert ("RoPE products clustered (rotate_half(q)*sin)", "task", "paper-like") not in results.index
    words = LC.claims_table(LC.claim_results(summary))
    assert list(words.columns) == ["paper-like", "weaker"]
    assert words.loc[("RoPE products clustered (q*cos)", "task"), "paper-like"] == "reproduces (0.05–0.3; 0% exact)"
    assert pd.isna(words.loc[("RoPE products clustered (rotate_half(q)*sin)", "task"), "paper-like"])
    assert LC.saved_summary(summary).index.names == ["model", "location", "positions"]


def test_verdict_tables_follow_the_numbers():
    long_context = synthetic_table("weaker", "uniform [0, 4096)", {"rope.q_cos": 0.02, "rope.q_sum": 0.3})
    summary = LC.summarize_models(pd.concat([synthetic_table("weaker", "task", WEAKER), long_context]), K_FLOOR, CLUSTERED_MIN)
    verdicts = LC.location_verdicts(summary)
    assert verdicts.loc[("weaker", "task", "q_proj"), "measured"] == "at the floor"
    assert verdicts.loc[("weaker", "task", "attention"), "reproduces paper"] == "no"
    assert verdicts.loc[("weaker", "task", "q_proj"), "why"] == LC.score_explanation(
        summary.set_index(["model", "positions", "location"]).loc[("weaker", "task", "q_proj")])
    assert LC.tie_error_line(summary) is None  # no ties in these rows
    tied = summary.assign(tie_frac=0.1, mean_error=summary.mean_error_se * 4)
    assert " at 0 of " in LC.tie_error_line(tied) and "4.0x its spread" in LC.tie_error_line(tied)
    rope = LC.rope_claims(summary)
    at_long = rope.loc[("weaker", "q*cos and k*cos", "uniform [0, 4096)")]
    assert at_long["score over rounding values"] == "0.02" and at_long["verdict"].startswith("the paper's claim holds only weakly")
    assert rope.loc[("weaker", "RoPE sums (not in the paper)", "uniform [0, 4096)"), "verdict"] == "clustered (paper's range)"
    # only measured (values, positions) appear: the sin products were measured at task positions only
    assert ("weaker", "rotate_half*sin", "uniform [0, 4096)") not in rope.index
    sentence = LC.rope_verdict(summary, (CLUSTERED_MIN, 0.472))
    assert sentence.startswith("At uniform [0, 4096) positions, the paper's claim 'RoPE products are clustered' holds only weakly")
    assert "are clustered (paper's range) (0.3)" in sentence


def test_rope_table_has_a_column_per_positions():
    summary = LC.summarize_models(pd.concat([synthetic_table("m", "task", {"rope.q_cos": 0.02, "q_proj": 1e-4}),
                                             synthetic_table("m", "uniform [0, 4096)", {"rope.q_cos": 0.3})]),
                                  K_FLOOR, CLUSTERED_MIN)
    view = LC.rope_table(summary)
    assert list(view.index) == [("m", "rope.q_cos")]
    assert list(view.columns) == [(f, p) for f in ("exact_frac", "score_all_values", "median", "floor", "x_floor")
                                  for p in ("task", "uniform [0, 4096)")]
    assert view.loc[("m", "rope.q_cos"), ("median", "uniform [0, 4096)")] == pytest.approx(0.3)
