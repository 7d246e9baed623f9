"""experiments/collapse_study.py: each stage of the registered study plans its runs from the finished runs of the
stages it rests on, by the registration's rules."""

import importlib.util
import math

import numpy as np
import pandas as pd
import pytest

from rla_lib.paths import ROOT
from rla_lib.studies.collapse import preregistration


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("collapse_study", ROOT / "experiments" / "collapse_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


R = dict(model="qwen3-tiny-steps-hot", task="steps", prompts_per_step=16, group_size=16, steps=150, lr=1e-4, tag="t")
RISES, FALLS = [0.07, 0.15, 0.2, 0.21, 0.2], [0.07, 0.15, 0.2, 0.02, 0.01]


def history(steps, accuracies=RISES, dose=1e-3):
    every = steps // (len(accuracies) - 1) if steps > 1 else 1
    evals = pd.DataFrame([dict(step=i * every, eval_accuracy=a, eval_prompts=512) for i, a in enumerate(accuracies)])
    trained = pd.DataFrame(dict(step=range(1, steps + 1), seq_exact_kl=[dose] + [np.nan] * (steps - 1), t_rollout=1.0,
                                t_score=0.5, t_update=2.0, t_sync=0.5))  # a step: 4 s on one core
    return evals.merge(trained, on="step", how="outer").sort_values("step").reset_index(drop=True)


class Finished:
    """A stand-in for results/: the runs given are finished with the histories given."""
    def __init__(self):
        self.done = {}

    def __call__(self, run):
        return self.done.get(run.run_id)

    def finish(self, runs, make):
        for run in runs:
            self.done[run.run_id] = make(run)


def of(runs, stage):
    return [run for run in runs if run.stage == stage]


def test_no_regime_no_runs_and_the_reason(study):
    reg = preregistration()
    assert study.plan(reg, None, Finished()) == ([], [])
    r, why = study.regime(reg, pd.DataFrame())
    assert r is None and "stage 0 has not started" in why


def test_first_the_edge_search_the_calibration_and_the_long_runs(study):
    runs, waits = study.plan(preregistration(), R, Finished())
    assert [run.stage for run in runs[:3]] == ["edge"] * 3  # workers take the gating stages first
    edge = of(runs, "edge")
    assert [run.lr for run in edge] == pytest.approx([1.5e-4] * 3) and {run.seed for run in edge} == {0, 1, 2}
    assert all(run.arm == "FP32 control" and run.steps == 100 for run in edge)
    assert len(of(runs, "calibration")) == 1 + 6 + 4 and all(run.steps == 1 for run in of(runs, "calibration"))
    assert len(of(runs, "q3")) == 6 and {run.steps for run in of(runs, "q3")} == {500}
    assert not of(runs, "q1") and not of(runs, "q2")
    assert any("edge search" in w for w in waits) and any("calibration" in w for w in waits)


def test_the_edge_is_the_first_step_size_where_two_of_three_collapse(study):
    reg, done = preregistration(), Finished()
    runs, _ = study.plan(reg, R, done)
    done.finish(of(runs, "edge"), lambda run: history(100, FALLS if run.seed == 0 else RISES))  # 1 of 3
    runs, _ = study.plan(reg, R, done)
    second = [run for run in of(runs, "edge") if run.lr > 2e-4]
    assert [run.lr for run in second] == pytest.approx([1e-4 * 1.5**2] * 3) and not of(runs, "q2")
    done.finish(second, lambda run: history(100, FALLS if run.seed < 2 else RISES))  # 2 of 3
    runs, waits = study.plan(reg, R, done)
    q2 = of(runs, "q2")
    assert len(q2) == 4 * 3 * 8 and not any("edge" in w for w in waits)
    assert sorted({round(run.lr / (1e-4 * 1.5**2), 2) for run in q2}) == [0.67, 1.0, 1.5]
    assert {run.arm for run in q2} == {"default BF16", "engine schedule", "FP32 control", "rope"}
    assert set(reg["questions"]["Q2_edge"]["arms"]) == {run.arm for run in q2}


def test_no_edge_after_four_multiplications_says_q2_cannot_run(study):
    reg, done = preregistration(), Finished()
    for _ in range(4):
        runs, _ = study.plan(reg, R, done)
        done.finish(of(runs, "edge"), lambda run: history(100))
    runs, waits = study.plan(reg, R, done)
    assert len(of(runs, "edge")) == 12 and not of(runs, "q2") and any("Q2 cannot run" in w for w in waits)


DOSES = {"default BF16": 1e-3, "default BF16, logit noise 0.1": 0.05, "default BF16, logit noise 0.3": 0.4,
         "default BF16, logit noise 1": 3.0, "default BF16, logit noise 2": 9.0, "default BF16, logit noise 4": 20.0,
         "default BF16, logit noise 8": 50.0, "default BF16, 3-bit rollouts": 0.5, "default BF16, 2-bit rollouts": 2.0,
         "default BF16, 1-bit rollouts": 6.0, "default BF16, 0-bit rollouts": 30.0}


def calibrated(study):
    reg, done = preregistration(), Finished()
    runs, _ = study.plan(reg, R, done)
    done.finish(of(runs, "calibration"), lambda run: history(1, [0.07, 0.07], dose=DOSES[run.rung]))
    return reg, done


def test_the_ladder_runs_from_the_natural_level_to_the_first_dose_past_the_paper_like_one(study):
    reg, done = calibrated(study)
    runs, _ = study.plan(reg, R, done)
    q1 = of(runs, "q1")
    rungs = {run.rung for run in q1}
    assert rungs == {name for name, d in DOSES.items() if d <= 9.0}  # 9 nats is the first past 8.4
    assert len(q1) == len(rungs) * 4 * 2 and {run.tis for run in q1} == {False, True}
    assert all(("tis_cap" in run.settings) == run.tis for run in q1)
    assert [run.stage for run in runs].index("q1") < [run.stage for run in runs].index("q3")  # the positive control first


def test_a_rung_whose_every_seed_collapsed_ends_the_ladder_and_the_bracket_gets_eight_seeds(study):
    reg, done = calibrated(study)
    runs, waits = study.plan(reg, R, done)
    order = sorted((name for name in DOSES if DOSES[name] <= 9.0), key=lambda n: (n != "default BF16", DOSES[n]))
    # without TIS: nothing collapses below 0.5 nats, half at 0.5, every seed from 2 nats on
    rate = lambda name: 0.0 if DOSES[name] < 0.5 else 0.5 if DOSES[name] < 2 else 1.0
    done.finish([run for run in of(runs, "q1") if not run.tis],
                lambda run: history(150, FALLS if run.seed < 4 * rate(run.rung) else RISES))
    runs, waits = study.plan(reg, R, done)
    plain = [run for run in of(runs, "q1") if not run.tis]
    top = max(order.index(run.rung) for run in plain)
    assert order[top] == "default BF16, 2-bit rollouts"  # the first rung that always collapsed; none above it
    bracket = {run.rung for run in plain if run.seed >= 4}
    assert bracket == {"default BF16, logit noise 0.3", "default BF16, 2-bit rollouts"}  # last <= 0.25, first >= 0.75
    assert len([run for run in plain if run.seed >= 4]) == 2 * 4
    assert any("with TIS" in w for w in waits) and not any(w.startswith("Q1's transition waits") for w in waits)


def test_run_ids_are_unique_and_settings_are_the_regimes(study):
    reg, done = calibrated(study)
    runs, _ = study.plan(reg, R, done)
    assert len({run.run_id for run in runs}) == len(runs)
    s = study.settings_for(R, of(runs, "q3")[0])
    assert (s["model"], s["prompts_per_step"], s["group_size"], s["eval_every"], s["eval_prompts"]) == \
        (R["model"], 16, 16, 10, 512) and s["steps"] == 500 and s["lr"] == R["lr"]


def test_tables_name_missing_runs_and_no_cause_from_three_seeds(study, tmp_path, monkeypatch):
    """Q3 with default BF16 rising then collapsing in all 3 seeds and the on-policy arm in none of 2, the study closed
    with the third missing: the table marks its rows pre-registered and names the missing run; three seeds cannot pass
    Holm, so no cause."""
    from rla_lib import report

    monkeypatch.setattr(study, "OUT", tmp_path / "runs")
    monkeypatch.setattr(study.sweep, "SHIPPED_RUNS", tmp_path / "kept")  # not the repository's runs
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path / "tables")
    reg = preregistration()
    runs, waits = study.plan(reg, R, Finished())
    for run in of(runs, "q3"):
        if run.arm == "engine schedule" and run.seed == 2:
            continue  # still running
        folder = tmp_path / "runs" / run.run_id
        folder.mkdir(parents=True)
        history(500, FALLS if run.arm == "default BF16" else RISES).to_csv(folder / "history.csv", index=False)
    out = study.write_tables(reg, runs, waits, "regime R: t", closed=True)
    q3, meta = report.load_table("06_study_q3")
    assert q3.set_index("arm")["rises_then_collapses"].to_dict() == {"default BF16": 3, "engine schedule": 0}
    assert q3["preregistered"].all() and meta["params"]["missing"] == [r.run_id for r in of(runs, "q3")
                                                                       if r.arm == "engine schedule" and r.seed == 2]
    assert out["verdicts"][0] == "Q1 (dose): not run" and out["verdicts"][2].startswith("Q3 (long horizon): cannot tell")
    plan, meta = report.load_table("06_study_plan")
    assert plan.set_index("stage").loc["q3", "finished"] == 5 and meta["params"]["waits"] == waits
    q3_plan = plan.set_index("stage").loc["q3"]  # 5 runs of 500 steps of 4 s done, one left
    assert q3_plan["core_hours_spent"] == pytest.approx(5 * 500 * 4 / 3600, rel=1e-6)  # tables keep 6 digits
    assert q3_plan["core_hours_left"] == pytest.approx(500 * 4 / 3600, rel=1e-6)
    assert math.isnan(plan.set_index("stage").loc["edge", "core_hours_left"])  # no edge run finished: not known


def test_a_question_s_test_waits_for_all_its_planned_runs_until_the_study_closes(study, tmp_path, monkeypatch):
    """Q1 with the seed-0 run of its first two rungs finished, one collapsed: its table counts them (no test), its
    verdict says what it waits for and H1 and H2 have no p in the family; closed, the same runs get the test."""
    from rla_lib import report
    from tools import readme

    monkeypatch.setattr(study, "OUT", tmp_path / "runs")
    monkeypatch.setattr(study.sweep, "SHIPPED_RUNS", tmp_path / "kept")
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path / "tables")
    reg = preregistration()
    finished = Finished()
    runs, _ = study.plan(reg, R, finished)
    finished.finish(of(runs, "calibration"), lambda run: history(1, [0.07, 0.07], dose=DOSES[run.rung]))
    runs, waits = study.plan(reg, R, finished)
    first = [run for run in of(runs, "q1") if run.seed == 0 and not run.tis][:2]
    for run, accuracies in zip(first, (RISES, FALLS)):
        (tmp_path / "runs" / run.run_id).mkdir(parents=True)
        history(150, accuracies, dose=DOSES[run.rung]).to_csv(tmp_path / "runs" / run.run_id / "history.csv", index=False)
    planned = len(of(runs, "q1"))
    out = study.write_tables(reg, runs, waits, "regime R: t")
    assert out["verdicts"][0] == (f"Q1 (dose): 2 of its {planned} planned runs finished; its registered test (H1, H2) "
                                  "waits for the rest")
    table, meta = report.load_table("06_study_q1")
    assert table["collapses"].tolist() == [0, 1] and table["seeds"].tolist() == [1, 1] and not meta["params"]["test_run"]
    assert len(meta["params"]["missing"]) == planned - 2
    tests = report.load_table("06_study_plan")[1]["params"]["tests"]
    assert tests["H1"]["p"] is None and tests["H2"]["p"] is None
    page = readme.block_study_progress()  # the results page counts them, and says the test waits
    assert f"Q1's runs so far: 2 finished, {planned - 2} planned still to run; counts only" in page
    assert "| default BF16, logit noise 0.1 | no | 1 | 0.05 | 1 of 1 [" in page
    hours = lambda runs: f"{runs * 150 * 4 / 3600:.1f}"  # 150 steps of 4 s
    assert f"| q1 | {planned} | 2 | {hours(2)} | {hours(planned - 2)} |" in page  # what they took, what is left
    dose_curve = study.confirmatory.dose_curve  # the registered 2000 bootstrap refits take half a minute here
    monkeypatch.setattr(study.confirmatory, "dose_curve", lambda runs: dose_curve(runs, n_boot=50))
    closed = study.write_tables(reg, runs, waits, "regime R: t", closed=True)
    assert closed["verdicts"][0].startswith("Q1 (dose): cannot tell") and report.load_table("06_study_q1")[1]["params"]["test_run"]
    assert report.load_table("06_study_plan")[1]["params"]["tests"]["H1"]["p"] is not None


def test_every_planned_run_makes_a_valid_grpo_config(study):
    """The arms' settings meet GRPOConfig's checks (0-bit rollouts, noise 8, TIS, FP32) before any core is spent."""
    from rla_lib.grpo import GRPOConfig

    reg, done = calibrated(study)
    runs, _ = study.plan(reg, R, done)
    done.finish(of(runs, "edge"), lambda run: history(100, FALLS))
    runs, _ = study.plan(reg, R, done)
    assert {"edge", "calibration", "q1", "q2", "q3"} == {run.stage for run in runs}
    for run in runs:
        if run.arm != "engine schedule":  # read from the engine when it runs
            GRPOConfig(**study.settings_for(R, run))


def test_the_cost_bound_is_the_largest_plan_the_rules_can_reach(study):
    """`steps_at_most` is what the plan asks for when every stage goes as far as its rules let it: the edge found at
    the last multiplication, every rung below the paper-like dose, and a transition bracketed by two rungs. The
    cost per candidate is those steps at each precision's measured step."""
    reg, done = preregistration(), Finished()
    order = list(study.ladder())

    def outcome(run):
        if run.stage == "calibration":
            return history(1, dose=1e-3 * (1 + order.index(run.rung)))  # all below the paper-like dose, in ladder order
        if run.stage == "edge":  # 2 of 3 collapse only at the last multiplication
            last = run.lr > R["lr"] * study.EDGE_FACTOR ** (study.EDGE_LEVELS - 0.5)
            return history(run.steps, FALLS if last and run.seed < 2 else RISES)
        if run.stage == "q1":  # the top rung collapses in 3 of 4 seeds, the others never
            return history(run.steps, FALLS if run.rung == order[-1] and run.seed % 4 < 3 else RISES)
        return history(run.steps)

    for _ in range(10):  # each round finishes what the plan asks for, until it asks for nothing new
        runs, _ = study.plan(reg, R, done)
        new = [run for run in runs if done(run) is None]
        if not new:
            break
        done.finish(new, outcome)
    planned = pd.DataFrame([dict(stage=run.stage, steps=run.steps) for run in runs])
    reached = planned.groupby("stage").agg(runs=("steps", "size"), steps=("steps", "sum"))
    bound = study.steps_at_most().set_index("stage")
    assert reached.loc[bound.index, "runs"].tolist() == bound["runs"].tolist()
    assert reached.loc[bound.index, "steps"].tolist() == bound["steps"].tolist()

    histories = pd.DataFrame(dict(sweep=R["tag"], run=["a"] * 2 + ["b"] * 2, t_rollout=[1.0, 3.0, 2.0, 2.0],
                                  t_score=1.0, t_update=5.0, t_sync=0.0))
    reg_one = dict(reg, stage_0_regime=dict(reg["stage_0_regime"], candidates=[dict(R, lr=[R["lr"]])]))
    study_tag = study.stage0_runs(reg_one)[0][0]
    cost = study.cost_at_most(histories.assign(sweep=study_tag), reg_one, 0.5).iloc[0]
    fp32 = bound["steps"] * bound["fp32_share"]
    assert cost["fp32_step_s"] == 8.0  # each run's median step (8 s and 8 s), their median
    assert cost["core_hours"] == pytest.approx((fp32.sum() * 8.0 + (bound["steps"].sum() - fp32.sum()) * 4.0) / 3600)


def test_a_finished_run_of_another_regime_stops_the_study_with_what_to_do(study, tmp_path, monkeypatch):
    """A run started with --assume-regime for a candidate stage 0 did not choose has the same name as R's run when
    their step sizes agree: its settings are read back, and it is not taken as R's."""
    import json

    monkeypatch.setattr(study, "OUT", tmp_path / "runs")
    monkeypatch.setattr(study.sweep, "SHIPPED_RUNS", tmp_path / "kept")
    edge = of(study.plan(preregistration(), R, Finished())[0], "edge")[0]
    folder = tmp_path / "runs" / edge.run_id
    folder.mkdir(parents=True)
    history(100).to_csv(folder / "history.csv", index=False)
    settings = study.settings_for(R, edge)
    (folder / "config.json").write_text(json.dumps(settings))
    assert study.read_finished(edge) is not None  # R's own run
    (folder / "config.json").write_text(json.dumps(dict(settings, prompts_per_step=32)))
    with pytest.raises(SystemExit, match="prompts_per_step 32, R's 16.*move the folder away"):
        study.read_finished(edge)


def test_an_assumed_regime_must_be_a_stage0_candidate(study):
    reg = preregistration()
    tag, cand, lr = study.stage0_runs(reg)[0]
    assert study.regime_of(reg, tag) == dict(cand, lr=lr, tag=tag)
    with pytest.raises(SystemExit, match="not a stage-0 candidate; they are: " + tag):
        study.regime_of(reg, "stage0-nonesuch")


def test_a_regime_is_assumed_only_while_stage0_runs_and_never_against_its_choice(study):
    reg = preregistration()
    tags = [tag for tag, _, _ in study.stage0_runs(reg)]
    table = pd.DataFrame(dict(sweep=tags, complete=True, learns=[t == tags[1] for t in tags],
                              mean_gain=[0.2 if t == tags[1] else 0.0 for t in tags], step_core_hours=1.0))
    running = table.assign(complete=[t != tags[-1] for t in tags])
    r, note, assumed = study.assumed_regime(reg, running, tags[0])
    assert assumed and r["tag"] == tags[0] and note.startswith("assumed")
    assert study.assumed_regime(reg, running, None)[0] is None  # nothing assumed, nothing runs
    r, note, assumed = study.assumed_regime(reg, table, tags[1])  # stage 0 chose it: no longer an assumption
    assert not assumed and r["tag"] == tags[1]
    with pytest.raises(SystemExit, match=f"stage 0 chose {tags[1]}, not {tags[0]}"):
        study.assumed_regime(reg, table, tags[0])
    with pytest.raises(SystemExit, match="no candidate learns.*nothing to run ahead of"):
        study.assumed_regime(reg, table.assign(learns=False), tags[0])


def test_the_edge_search_and_calibration_tables_say_what_their_runs_found(study, tmp_path, monkeypatch):
    """The edge search collapses in 1 of 3 seeds at the first step size, then in 2 of 2 finished at the second (the
    third still running), then in 2 of 3: the sentence follows each state, and names lr_edge only at the last. Every
    rung's calibrated dose, Q1's rungs marked (up to the first past 8.4); the results page renders both tables."""
    from rla_lib import report
    from tools import readme

    monkeypatch.setattr(study, "OUT", tmp_path / "runs")
    monkeypatch.setattr(study.sweep, "SHIPPED_RUNS", tmp_path / "kept")
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path / "tables")
    reg = preregistration()

    def finish(run, h):
        (tmp_path / "runs" / run.run_id).mkdir(parents=True)
        h.to_csv(tmp_path / "runs" / run.run_id / "history.csv", index=False)

    def found():
        runs, waits = study.plan(reg, R, study.read_finished)
        study.write_tables(reg, runs, waits, "regime R: t")
        return runs, report.load_table("06_study_edge")[1]["params"]["found"]

    runs, _ = found()
    for run in of(runs, "edge"):
        finish(run, history(100, FALLS if run.seed == 0 else RISES))
    for run in of(runs, "calibration"):
        finish(run, history(1, [0.07, 0.07], dose=DOSES[run.rung]))
    runs, said = found()
    second = [run for run in of(runs, "edge") if run.lr > 2e-4]
    assert said == ("The edge search, at lr 0.00015 it collapsed in 1 of 3 seeds (fewer than 2): not the edge; at lr "
                    "0.000225 none of its 3 seeds has finished yet.")
    for run in second[:2]:
        finish(run, history(100, FALLS))
    assert found()[1].endswith("at lr 0.000225 the FP32 control collapsed in 2 of the 2 seeds finished of 3; the "
                               "search waits for the rest.")
    finish(second[2], history(100, RISES))
    assert found()[1].endswith("at lr 0.000225 it collapsed in 2 of 3 seeds: lr_edge = 0.000225, Q2's step sizes "
                               "are set.")
    edge, _ = report.load_table("06_study_edge")
    assert len(edge) == 6 and edge["preregistered"].all() and edge["collapsed"].sum() == 1 + 2
    calibration, _ = report.load_table("06_study_calibration")
    assert set(calibration.loc[calibration["in_q1"], "rung"]) == {name for name, d in DOSES.items() if d <= 9.0}
    assert calibration["dose"].is_monotonic_increasing and calibration["times_natural"].iloc[0] == 1.0
    page = readme.block_study_progress()
    assert "lr_edge = 0.000225" in page and "Q1 runs 8 of the 11 rungs, up to “default BF16, logit noise 2” (9 nats" in page
    assert "The natural BF16 mismatch is 0.00012 of the paper-like dose." in page



def test_workers_look_along_the_ladder_then_finish_it_rung_by_rung(study):
    """Seed 0 of every rung first, then seeds 1-3 a rung at a time in order of dose: when a rung's every seed
    collapses, seeds 1-3 of the rungs above it have not begun, and the plan then drops them."""
    reg, done = calibrated(study)
    runs, _ = study.plan(reg, R, done)
    order = sorted((name for name in DOSES if DOSES[name] <= 9.0), key=lambda n: (n != "default BF16", DOSES[n]))
    plain = [(run.rung, run.seed) for run in of(runs, "q1") if not run.tis]
    assert plain == [(name, 0) for name in order] + [(name, s) for name in order for s in (1, 2, 3)]
    assert [run.tis for run in of(runs, "q1")] == sorted(run.tis for run in of(runs, "q1"))  # TIS after
    third = order[2]  # collapses in every seed; nothing else does
    taken = []
    while True:  # a worker takes the first run of the plan not finished, until seeds 0-3 without TIS have none left
        runs, _ = study.plan(reg, R, done)
        left = [run for run in of(runs, "q1") if not run.tis and run.seed < 4 and done(run) is None]
        if not left:
            break
        taken.append((left[0].rung, left[0].seed))
        done.finish(left[:1], lambda run: history(150, FALLS if run.rung == third else RISES))
    assert taken == [(name, 0) for name in order] + [(name, s) for name in order[:3] for s in (1, 2, 3)]
    assert len(taken) < 3 * len(order) + 3  # whole seeds first: seeds 0-2 of every rung, then seed 3 of the first 3
    assert {(run.rung, run.seed) for run in of(runs, "q1") if not run.tis and run.seed >= 4} == {
        (name, s) for name in order[1:3] for s in (4, 5, 6, 7)}  # and the bracket's seeds follow


def test_a_run_s_hours_come_from_its_stage_s_finished_steps_with_a_margin_for_evaluations(study):
    """--hours takes a run only if it would finish: the estimate is the run's steps at its stage's median step (4 s in
    `history`) plus the evaluations' margin; another stage's steps where its own has none; none finished, 0."""
    reg, done = calibrated(study)
    runs, _ = study.plan(reg, R, done)
    q1 = of(runs, "q1")
    histories = {run.run_id: done(run) for run in runs}
    assert all(h is None for run_id, h in histories.items() if run_id.startswith("q1-"))
    from_calibration = study.run_hours(q1[0], histories)  # no Q1 run finished: the other stages' 4 s step
    assert from_calibration == pytest.approx(150 * 4.0 * (1 + study.EVALUATION_SHARE) / 3600)
    slow = history(150)
    slow[study.STEP_TIMES] *= 2  # Q1's own runs take 8 s a step: they decide
    done.finish(q1[:1], lambda run: slow)
    histories = {run.run_id: done(run) for run in runs}
    assert study.run_hours(q1[1], histories) == pytest.approx(2 * from_calibration)
    assert study.run_hours(q1[1], dict.fromkeys(histories)) == 0.0
