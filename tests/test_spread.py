"""rla_lib.studies.spread: the per-level verdicts come from the paired CIs (the measurement itself runs in notebook 07's test)."""

import pytest

from rla_lib.studies import spread


def row(stock_paper, paper_schedule, stock_schedule=(-0.5, -0.6, -0.4)):
    r = {}
    for name, (value, low, high) in [("stock->paper", stock_paper), ("paper->schedule", paper_schedule),
                                     ("stock->schedule", stock_schedule)]:
        r |= {name: value, f"{name} ci_low": low, f"{name} ci_high": high, f"{name} separated": low > 0 or high < 0}
    return r


def test_effect_is_a_cut_a_rise_or_nothing_by_the_paired_ci():
    assert spread.effect(row((-0.2, -0.3, -0.1), (0, -0.1, 0.1)), "stock", "paper") == "cut"
    assert spread.effect(row((0.2, 0.1, 0.3), (0, -0.1, 0.1)), "stock", "paper") == "rise"
    assert spread.effect(row((-0.2, -0.5, 0.1), (0, -0.1, 0.1)), "stock", "paper") == "none"  # CI includes zero


def test_verdict_words_follow_the_intervals():
    text = spread.verdict(row((-0.2, -0.3, -0.1), (-0.4, -0.5, -0.3)))
    assert "paper's regions: a cut of 20%" in text and "beats the paper's regions" in text
    text = spread.verdict(row((0.03, -0.1, 0.2), (0.1, -0.2, 0.3), stock_schedule=(0.1, -0.1, 0.3)))
    assert text.count("no distinguishable change") == 2 and "indistinguishable from the paper's regions" in text


def test_measure_refuses_a_level_this_cpu_cannot_run():
    with pytest.raises(ValueError, match="cannot run"):
        spread.measure(["qwen3-tiny"], levels=["avx10"])


def test_the_worker_refuses_to_run_uncapped_as_another_level(monkeypatch):
    monkeypatch.delenv("RLA_CPU_ISA", raising=False)
    from rla_lib import machine

    other = [level for level in machine.ISA_LEVELS if level != machine.isa_level()][0]
    with pytest.raises(SystemExit, match="isa_environment"):
        spread.main(["qwen3-tiny", "--level", other])


def test_the_matmul_control_runs_only_where_it_differs_from_its_level(monkeypatch):
    """The control is the first level with FP32 products: at a level without BF16 instructions (avx2, every machine
    of this kind has it) or with RLA_BF16_MATMUL=fp32 it would repeat that level, so it is left out."""
    import pandas as pd

    phases = []
    monkeypatch.setattr(spread, "side_by_side", lambda run, jobs, processes: phases.append(jobs) or [pd.DataFrame()])
    spread.measure(["qwen3-tiny"], levels=["avx2"], matmul_control=True)
    assert [[label for _, _, label, _ in jobs] for jobs in phases] == [["avx2"]]
    phases.clear()
    monkeypatch.setattr(spread.machine, "resolve_levels", lambda levels: ["avx512_bf16"])  # no process is started here
    spread.measure(["qwen3-tiny"], levels=["avx512_bf16"], matmul_control=True)
    assert [[label for _, _, label, _ in jobs] for jobs in phases] == [["avx512_bf16"], ["avx512_bf16+fp32 matmul"]]
    phases.clear()
    monkeypatch.setenv("RLA_BF16_MATMUL", "fp32")
    spread.measure(["qwen3-tiny"], levels=["avx512_bf16"], matmul_control=True)
    assert len(phases) == 1
