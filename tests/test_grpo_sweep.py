"""experiments/grpo_sweep.py: workers share one list of runs through a lock per run folder."""

import importlib.util
import subprocess
import sys
import time
from types import SimpleNamespace

import pandas as pd
import pytest

from rla_lib.studies import dose_response
from rla_lib.paths import ROOT


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("grpo_sweep", ROOT / "experiments" / "grpo_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workers_share_the_list_and_a_dead_workers_run_is_taken_over(sweep, tmp_path):
    runs = [(SimpleNamespace(steps=2), tmp_path / f"run{i}") for i in range(3)]
    a, b = sweep.claimed(runs), sweep.claimed(runs)
    assert next(a)[1].name == "run0"          # worker A runs run0 ...
    assert next(b)[1].name == "run1"          # ... so worker B skips it
    assert next(a)[1].name == "run2"          # A is done with run0 (lock released) and skips B's run1
    assert list(b) == []                      # B done with run1: run2 is A's (held), nothing is left for B
    # a worker killed while it holds a run leaves it to the next worker
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, time
f = open({str(tmp_path / 'run0' / 'claim.lock')!r}, 'w')
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
print('held', flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert [out.name for _, out in sweep.claimed(runs[:1])] == []  # held by a live process: skipped
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    assert [out.name for _, out in sweep.claimed(runs[:1])] == ["run0"]  # its lock died with it
    (tmp_path / "run0" / "history.csv").write_text("step,reward\n0,\n1,0.5\n2,0.6\n")
    a.close()  # A lets go of run2
    assert [out.name for _, out in sweep.claimed(runs)] == ["run1", "run2"]  # finished by another worker: not taken


def test_the_study_grid_names_known_arms(sweep):
    planned = list(sweep.planned_runs(only=["dose", "dose-steps"]))
    assert len({run_id for run_id, *_ in planned}) == len(planned)
    for run_id, labels, settings in planned:
        arm = dose_response.arm_of(labels["config"])  # every arm has a kind the analysis knows
        assert arm["tis"] == ("tis_cap" in settings and settings["tis_cap"] is not None)
    kinds = {dose_response.arm_of(labels["config"])["kind"] for _, labels, _ in planned}
    assert {"none", "bits", "noise", "fp32", "aligned"} <= kinds


def test_only_finished_runs_are_collected(sweep, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "OUT", tmp_path)
    monkeypatch.setattr(sweep, "SHIPPED", tmp_path / "shipped.csv.gz")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "history.csv").write_text("step,reward\n0,\n1,0.5\n2,0.6\n")
    (tmp_path / "running").mkdir()  # checkpointed on the way: its history stops short of its steps
    (tmp_path / "running" / "history.csv").write_text("step,reward\n0,\n1,0.5\n")
    runs = [("done", dict(sweep="s", config="c", seed=0), dict(steps=2)),
            ("running", dict(sweep="s", config="c", seed=1), dict(steps=2))]
    data, fresh = sweep.collect(runs)
    assert fresh == ["done"] and set(data["run"]) == {"done"}
    assert sweep.finished(tmp_path / "running", 2) is None and sweep.finished(tmp_path / "absent", 2) is None


def test_stage0_runs_are_the_registered_ones(sweep):
    """The pilot's runs come from the pre-registration: each candidate at each step size, the arm and seeds it names,
    evaluated every 10 steps on every held-out problem, as the collapse definition requires."""
    from rla_lib.studies.collapse import preregistration, stage0_runs

    stage = preregistration()["stage_0_regime"]
    tags = [tag for tag, _, _ in stage0_runs()]
    runs = list(sweep.planned_runs(only=tags))
    assert len(runs) == len(tags) * len(stage["seeds"]) == sum(len(c["lr"]) for c in stage["candidates"]) * 3
    for run_id, labels, settings in runs:
        cand = next(c for tag, c, lr in stage0_runs() if tag == labels["sweep"] and lr == settings["lr"])
        assert labels["config"] == stage["arm"] and settings["precision"] == "fp32"
        assert {k: settings[k] for k in ("model", "task", "steps", "prompts_per_step", "group_size")} == \
            {k: cand[k] for k in ("model", "task", "steps", "prompts_per_step", "group_size")}
        assert settings.get("temperature", 1.0) == cand.get("temperature", 1.0)
        assert (settings["eval_every"], settings["eval_prompts"]) == (10, 512)


def test_a_finished_run_is_copied_to_the_repository_and_never_run_again(sweep, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "SHIPPED_RUNS", tmp_path / "shipped")
    machine, elsewhere = tmp_path / "results", tmp_path / "other-machine"
    for folder, history in [(machine / "done", "step,reward\n0,\n1,0.5\n2,0.6\n"), (machine / "running", "step,reward\n0,\n1,0.5\n")]:
        folder.mkdir(parents=True)
        (folder / "history.csv").write_text(history)
        (folder / "machine.json").write_text('{"cpu": "here"}')
    runs = [(machine / "done", 2), (machine / "running", 2)]
    assert sweep.ship_finished(runs) == ["done"]  # the unfinished run stays on this machine
    assert sweep.ship_finished(runs) == []  # copied once
    copy = tmp_path / "shipped" / "done"
    assert (copy / "machine.json").read_text() == '{"cpu": "here"}' and not (copy / "config.json").exists()
    # another machine, with an empty results/, has the run as finished and does not take it
    assert sweep.finished(elsewhere / "done", 2)["reward"].tolist()[1:] == [0.5, 0.6]
    assert sweep.finished(elsewhere / "running", 2) is None
    assert [out.name for _, out in sweep.claimed([(SimpleNamespace(steps=2), elsewhere / n) for n in ("done", "running")])] == ["running"]
    # the same history gives the same bytes (a re-run that reproduces its run changes nothing in git)
    before = (copy / "history.csv.gz").read_bytes()
    (copy / "history.csv.gz").unlink()
    assert sweep.ship_finished(runs) == ["done"] and (copy / "history.csv.gz").read_bytes() == before


def test_stage0_reads_runs_finished_elsewhere_and_runs_in_progress_here(sweep, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "OUT", tmp_path / "results")
    monkeypatch.setattr(sweep, "SHIPPED_RUNS", tmp_path / "shipped")
    (first, _, settings), (second, *_) = list(sweep.planned_runs(only=[sweep.stage0_runs()[0][0]]))[:2]
    steps = settings["steps"]
    done = "step,eval_accuracy\n" + "".join(f"{s},{0.1 + s / 1000}\n" for s in range(0, steps + 1, 10))
    (tmp_path / "results" / first).mkdir(parents=True)
    (tmp_path / "results" / first / "history.csv").write_text(done)
    assert sweep.ship_finished([(tmp_path / "results" / first, steps)]) == [first]
    (tmp_path / "results" / first / "history.csv").unlink()  # this machine is gone; the copy is not
    (tmp_path / "results" / second).mkdir()
    (tmp_path / "results" / second / "history.csv").write_text("step,eval_accuracy\n0,0.1\n10,0.2\n")
    histories = sweep.stage0_histories()
    assert histories.groupby("run")["step"].max().to_dict() == {first: steps, second: 10}


def test_stage0_keeps_the_committed_row_of_a_candidate_whose_runs_are_gone(sweep, tmp_path, monkeypatch):
    from rla_lib import report

    monkeypatch.setattr(sweep, "OUT", tmp_path / "results")
    monkeypatch.setattr(sweep, "SHIPPED_RUNS", tmp_path / "shipped")
    monkeypatch.setattr(report, "TABLES_DIR", tmp_path / "tables")
    assert sweep.stage0_so_far()[1].empty and sweep.kept_rows("06_stage0", "sweep", set()) is None  # nothing yet
    tags = [tag for tag, _, _ in sweep.stage0_runs()]
    row = dict(seeds_done=3, seeds_registered=3, learned=3, collapsed=0, mean_gain=0.2, step_core_hours=1.0,
               complete=True, learns=True, source="runs")
    report.save_table(pd.DataFrame([dict(row, sweep=tag) for tag in tags]), "06_stage0")
    commit = report.load_table("06_stage0")[1]["commit"]
    histories, table, decision = sweep.stage0_so_far()
    assert histories is None and decision == dict(decision="regime", regime=tags[0])  # the tie goes to the first
    assert set(table["source"]) == {f"tables/06_stage0.csv of {commit}"}
    # a run of the second candidate at hand: that candidate is computed from its runs, the others kept
    (run_id, _, settings), = sweep.planned_runs(only=[tags[1]], seeds={0})
    (tmp_path / "results" / run_id).mkdir(parents=True)
    (tmp_path / "results" / run_id / "history.csv").write_text("step,eval_accuracy,eval_prompts\n0,0.1,512\n10,0.2,512\n")
    _, table, decision = sweep.stage0_so_far()
    assert table.set_index("sweep").loc[tags[1], ["seeds_done", "source"]].tolist() == [0, "runs"]
    assert decision == dict(decision="incomplete", left=[tags[1]])
    report.save_table(table, "06_stage0")  # written again: a kept row keeps where it came from
    assert sweep.kept_rows("06_stage0", "sweep", set()).set_index("sweep").loc[tags[0], "source"] == \
        f"tables/06_stage0.csv of {commit}"
