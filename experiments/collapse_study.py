"""The collapse study after its pilot (data/grpo_study/preregistration.json): each stage's runs follow from the last.

    .venv/bin/python experiments/collapse_study.py --plan     # every stage: planned, finished, what it waits for, and
                                                              # the core-hours of the largest plan per stage-0 candidate
    .venv/bin/python experiments/collapse_study.py            # run what the plan allows now (start one per core)
    .venv/bin/python experiments/collapse_study.py --hours 2.5   # take a run only if it can finish within 2.5 h
    .venv/bin/python experiments/collapse_study.py --tables   # tables/06_study_*.csv from the finished runs
    .venv/bin/python experiments/collapse_study.py --tables --close   # once the study ends: every test, missing named
    .venv/bin/python experiments/collapse_study.py --stage calibration   # only that stage's runs (one core on it)
    .venv/bin/python experiments/collapse_study.py --assume-regime TAG   # while stage 0 runs: the edge search and
                                                              # calibration of candidate TAG ahead, kept only if R = TAG

The stages, in the registration's order; a stage plans its runs only from finished runs of the stages it rests on:
0. the pilot (`experiments/grpo_sweep.py --only stage0`): the regime R (`collapse.stage0`), its step size lr_R.
1. edge: the FP32 control at lr_R x 1.5^k (k = 1..4), seeds 0-2, 100 steps, one k at a time, until at least 2 of 3
   collapse: that step size is lr_edge (none by k = 4: Q2 cannot run, and the plan says so).
2. calibration: every rung of Q1's ladder (default BF16, logit noise sigma, rollout mantissa bits), seed 0, one step:
   its dose, the exact KL(inference || training) summed over a response at the first step, nats.
3. Q1 (dose): the rungs in order of dose from default BF16 to the first past the paper-like 8.4 nats per response,
   without and with TIS, seeds 0-3 at lr_R for 150 steps; a rung above one whose every seed collapsed is not run;
   then seeds 4-7 at the two rungs that bracket the transition (the last with collapse rate <= 0.25, the first >= 0.75).
   Workers take seed 0 of every rung first, then seeds 1-3 rung by rung up the ladder (`order_for_workers`).
4. Q2 (edge): default BF16, the engine schedule, the FP32 control and RoPE-only at lr_edge x {0.67, 1, 1.5}, seeds
   0-7, 100 steps.
5. Q3 (long): default BF16 and the engine schedule, seeds 0-2, 500 steps at lr_R.

Workers share the list as the settings search's do (a lock per run folder, `grpo_sweep.claimed`): start one per core
and each takes the next run no other holds; every run checkpoints every 10 steps and resumes where it stopped. A
worker that finds nothing to run says what the study waits for. Runs live in results/collapse_study/<run>/; a
finished one is copied into data/grpo_runs/<run>/ (`grpo_sweep.ship_finished`): commit it, and no machine runs it
again, as results/ stays behind on the machine that ran it.
"""

import argparse
import importlib.util
import json
import math
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from rla_lib import grpo
from rla_lib.paths import RESULTS_DIR, ROOT, slug
from rla_lib.report import load_table, save_table
from rla_lib.studies import arms, confirmatory
from rla_lib.studies.arms import CONFIGURATIONS, ENGINE_SCHEDULE, TIS
from rla_lib.studies.collapse import (in_registered_order, preregistration, shipped_history, stage0_decision,
                                     stage0_runs)

_spec = importlib.util.spec_from_file_location("grpo_sweep", ROOT / "experiments" / "grpo_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

OUT = RESULTS_DIR / "collapse_study"
PAPER_LIKE_DOSE = 8.4  # nats per response: the paper-like mark of tables/06_dose_references.csv, as registered
EDGE_FACTOR, EDGE_LEVELS, EDGE_STEPS, EDGE_SEEDS = 1.5, 4, 100, (0, 1, 2)
Q1_SEEDS, Q1_BRACKET_SEEDS, Q1_STEPS = (0, 1, 2, 3), (4, 5, 6, 7), 150
Q2_FACTORS, Q2_SEEDS, Q2_STEPS = (0.67, 1.0, 1.5), tuple(range(8)), 100
Q2_ARMS = ("default BF16", ENGINE_SCHEDULE, "FP32 control", "rope")
Q3_ARMS, Q3_SEEDS, Q3_STEPS = ("default BF16", ENGINE_SCHEDULE), (0, 1, 2), 500
NOISE_LADDER, BITS_LADDER = (0.1, 0.3, 1, 2, 4, 8), (3, 2, 1, 0)
NATURAL = "default BF16"


@dataclass
class Run:
    """One planned run: its stage, the arm's name and settings, the step size, seed and length."""
    stage: str
    arm: str
    lr: float
    seed: int
    steps: int
    settings: dict = field(default_factory=dict)  # the arm's GRPOConfig settings (the engine schedule's: read later)
    rung: str | None = None  # Q1's ladder rung (the arm without TIS)
    tis: bool = False
    regime: dict | None = field(default=None, repr=False, compare=False)  # R, to check a finished run's settings

    @property
    def run_id(self) -> str:
        return f"{self.stage}-lr{self.lr:.3g}-{self.steps}steps-s{self.seed}-{slug(self.arm)}"


def ladder() -> dict[str, dict]:
    """Q1's rungs by name, as registered: default BF16 (the natural level), logit noise, coarse rollout weights."""
    rungs = {NATURAL: {}}
    rungs |= {f"default BF16, logit noise {s:g}": dict(rollout_logit_noise=float(s)) for s in NOISE_LADDER}
    return rungs | {f"default BF16, {b}-bit rollouts": dict(rollout_mantissa_bits=b) for b in BITS_LADDER}


def first_step_dose(history: pd.DataFrame) -> float:
    """The registered dose of a run: the exact KL summed over each response at its first training step, nats."""
    start = history.loc[history["step"] == 1, "seq_exact_kl"].dropna()
    return float(start.iloc[0]) if len(start) else math.nan


def q1_rungs(dose: dict[str, float]) -> list[str]:
    """The rungs Q1 runs, as registered: the natural level, then the others by calibrated dose up to the first past
    the paper-like dose (all of them if none is)."""
    order = sorted(dose, key=lambda name: (name != NATURAL, dose[name]))
    past = next((i for i, name in enumerate(order) if dose[name] > PAPER_LIKE_DOSE), len(order) - 1)
    return order[: past + 1]


def regime(reg: dict, stage0_table: pd.DataFrame) -> tuple[dict | None, str]:
    """Regime R's candidate and step size from stage 0's table (`grpo_sweep.stage0_so_far`), or None and why not."""
    if stage0_table.empty:
        return None, "stage 0 has not started (experiments/grpo_sweep.py --only stage0)"
    decision = stage0_decision(stage0_table, reg)
    if decision["decision"] == "incomplete":
        return None, f"stage 0 is still running: {', '.join(decision['left'])} unfinished"
    if decision["decision"] == "none learns":
        return None, "stage 0: no candidate learns; by the registration the study stops at stage 0"
    return regime_of(reg, decision["regime"]), f"regime R: {decision['regime']}"


def assumed_regime(reg: dict, stage0_table: pd.DataFrame, tag: str | None) -> tuple[dict | None, str, bool]:
    """(R, what it is, whether it is assumed): stage 0's choice; while stage 0 still runs, candidate `tag` if given
    (--assume-regime). A `tag` stage 0 did not choose, or one given after stage 0 ended without a choice, is refused."""
    r, note = regime(reg, stage0_table)
    if tag is None:
        return r, note, False
    if r is not None:
        if r["tag"] != tag:
            raise SystemExit(f"stage 0 chose {r['tag']}, not {tag}: start again without --assume-regime")
        return r, note, False
    if stage0_decision(stage0_table, reg)["decision"] != "incomplete":
        raise SystemExit(f"{note}: --assume-regime has nothing to run ahead of")
    return regime_of(reg, tag), f"assumed regime R: {tag} (stage 0 still runs)", True


def regime_of(reg: dict, tag: str) -> dict:
    """A stage-0 candidate as regime R: its settings, step size and sweep tag."""
    found = [dict(cand, lr=lr, tag=t) for t, cand, lr in stage0_runs(reg) if t == tag]
    if not found:
        raise SystemExit(f"{tag!r} is not a stage-0 candidate; they are: {', '.join(t for t, _, _ in stage0_runs(reg))}")
    return found[0]


def settings_for(r: dict, run: Run) -> dict:
    """The GRPOConfig settings of one run in regime R."""
    task = dict(sweep.STEPS_TASK, model=r["model"], task=r["task"], prompts_per_step=r["prompts_per_step"],
                group_size=r["group_size"], checkpoint_every=10)
    if "temperature" in r:
        task["temperature"] = r["temperature"]
    return dict(sweep.COMMON, **task, **run.settings, lr=run.lr, steps=run.steps, seed=run.seed)


def plan(reg: dict, r: dict | None, finished) -> tuple[list[Run], list[str]]:
    """Every run the study needs now, in the order workers take them, and what each later stage waits for.
    `finished(run)` is the run's history once it has all its steps, else None."""
    if r is None:
        return [], []
    runs, waits = [], []

    def outcome(run):
        h = finished(run)
        return None if h is None else confirmatory.outcomes(h.assign(run=run.run_id, sweep=run.stage, config=run.arm,
                                                                     seed=run.seed)).iloc[0]

    # 1. the edge: one multiplication at a time
    lr_edge = None
    for k in range(1, EDGE_LEVELS + 1):
        lr = r["lr"] * EDGE_FACTOR**k
        level = [Run("edge", "FP32 control", lr, s, EDGE_STEPS, CONFIGURATIONS["FP32 control"], regime=r)
                 for s in EDGE_SEEDS]
        runs += level
        done = [outcome(run) for run in level]
        if any(o is None for o in done):
            waits.append(f"Q2 waits for the edge search at lr {lr:.3g}")
            break
        if sum(bool(o["collapsed"]) for o in done) >= 2:
            lr_edge = lr
            break
    else:
        waits.append(f"no edge: the FP32 control collapsed in fewer than 2 of 3 seeds up to lr {lr:.3g}; Q2 cannot run")

    # 2-3. Q1: calibrate every rung, then the ladder up to the first past the paper-like dose
    rungs = ladder()
    calibration = [Run("calibration", name, r["lr"], 0, 1, s, rung=name, regime=r) for name, s in rungs.items()]
    runs += calibration
    doses = {run.rung: finished(run) for run in calibration}
    order = []  # the rungs Q1 runs, in order of dose, once calibrated
    if any(h is None for h in doses.values()):
        waits.append("Q1 waits for the calibration of every rung")
    else:
        order = q1_rungs({name: first_step_dose(h) for name, h in doses.items()})

        def rung_run(name, tis, seed):
            return Run("q1", name + (TIS if tis else ""), r["lr"], seed, Q1_STEPS,
                       rungs[name] | (dict(tis_cap=arms.TIS_CAP) if tis else {}), rung=name, tis=tis, regime=r)

        for tis in (False, True):
            base = [rung_run(name, tis, s) for s in Q1_SEEDS for name in order]
            by_rung = {name: [outcome(run) for run in base if run.rung == name] for name in order}
            top = next((i for i, name in enumerate(order)
                        if all(o is not None and o["collapsed"] for o in by_rung[name])), len(order) - 1)
            runs += [run for run in base if order.index(run.rung) <= top]  # none above a rung that always collapsed
            rates = {name: np.mean([o["collapsed"] for o in by_rung[name]]) for name in order[: top + 1]
                     if all(o is not None for o in by_rung[name])}
            if len(rates) < top + 1:
                waits.append(f"Q1's transition{' with TIS' if tis else ''} waits for seeds 0-3 of every rung")
                continue
            low = [name for name in order[: top + 1] if rates[name] <= 0.25]
            high = [name for name in order[: top + 1] if rates[name] >= 0.75]
            bracket = ([low[-1]] if low else []) + ([high[0]] if high else [])
            runs += [rung_run(name, tis, s) for s in Q1_BRACKET_SEEDS for name in dict.fromkeys(bracket)]

    # 4. Q2 at the edge; 5. Q3 at lr_R
    if lr_edge is not None:
        runs += [Run("q2", arm, lr_edge * f, s, Q2_STEPS, CONFIGURATIONS.get(arm, {}), regime=r)
                 for s in Q2_SEEDS for f in Q2_FACTORS for arm in Q2_ARMS]
    runs += [Run("q3", arm, r["lr"], s, Q3_STEPS, CONFIGURATIONS.get(arm, {}), regime=r)
             for s in Q3_SEEDS for arm in Q3_ARMS]
    return order_for_workers(runs, order), waits


STAGE_ORDER = {"edge": 0, "calibration": 1, "q1": 2, "q3": 3, "q2": 4}


def order_for_workers(runs: list[Run], rungs: list[str]) -> list[Run]:
    """The edge search and calibration first (later stages wait for them), then Q1 without TIS (the positive
    control), Q1 with TIS, Q3, Q2; within each, whole seeds first. Except in Q1 after seed 0 (a first look along the
    whole ladder): its seeds 1-3 go rung by rung up the ladder (`rungs`, in order of dose), so a rung whose every seed
    collapses is complete before the rungs above it start, and those are then never run. The order changes what the
    study costs, not what it finds: the plan drops a finished run above such a rung all the same."""
    rank = {name: i for i, name in enumerate(rungs)}

    def key(run):
        if run.stage != "q1":
            return STAGE_ORDER[run.stage], run.tis, 0, run.seed, 0
        if run.seed in Q1_SEEDS[1:]:
            return STAGE_ORDER[run.stage], run.tis, 1, rank[run.rung], run.seed
        return STAGE_ORDER[run.stage], run.tis, 0 if run.seed == 0 else 2, run.seed, rank[run.rung]
    return sorted(runs, key=key)


def steps_at_most() -> pd.DataFrame:
    """Per stage, the runs and training steps the plan can ask for at most (every edge level, every rung below the
    paper-like dose, both bracket rungs, with and without TIS), and the share of those steps in FP32: what bounds
    the study's cost before its outcomes are known."""
    rungs = len(ladder())
    stages = [("edge", EDGE_LEVELS * len(EDGE_SEEDS), EDGE_STEPS, 1.0),
              ("calibration", rungs, 1, 0.0),
              ("q1", 2 * (rungs * len(Q1_SEEDS) + 2 * len(Q1_BRACKET_SEEDS)), Q1_STEPS, 0.0),
              ("q2", len(Q2_ARMS) * len(Q2_FACTORS) * len(Q2_SEEDS), Q2_STEPS, Q2_ARMS.count("FP32 control") / len(Q2_ARMS)),
              ("q3", len(Q3_ARMS) * len(Q3_SEEDS), Q3_STEPS, 0.0)]
    return pd.DataFrame([dict(stage=stage, runs=runs, steps=runs * steps, fp32_share=share)
                         for stage, runs, steps, share in stages])


def cost_at_most(histories: pd.DataFrame | None, reg: dict, bf16_per_fp32: float | None) -> pd.DataFrame:
    """Core-hours of the largest plan (`steps_at_most`) for each stage-0 candidate, from the median core-seconds of a
    training step of its finished FP32-control runs (one run per core, as the study runs; evaluations not counted).
    The BF16 arms' step is the FP32 one times `bf16_per_fp32` (the GRPO-step benchmark's ratio on this machine), or
    the same where that was not measured."""
    if histories is None or histories.empty:
        return pd.DataFrame()
    steps = steps_at_most()
    rows = []
    for tag, _, _ in stage0_runs(reg):
        mine = histories[histories["sweep"] == tag]
        if mine.empty:
            continue
        per_step = float(mine.groupby("run")[["t_rollout", "t_score", "t_update", "t_sync"]].median().sum(axis=1).median())
        ratio = bf16_per_fp32 or 1.0
        seconds = steps["steps"] * per_step * (steps["fp32_share"] + (1 - steps["fp32_share"]) * ratio)
        rows.append(dict(candidate=tag, fp32_step_s=per_step, bf16_step_s=per_step * ratio,
                         bf16_measured=bf16_per_fp32 is not None,
                         **{f"{stage}_core_hours": h for stage, h in zip(steps["stage"], seconds / 3600)},
                         core_hours=float(seconds.sum() / 3600), source="runs"))
    return pd.DataFrame(rows)


STEP_BENCHMARK_MODEL = "qwen3-tiny-steps-hot"  # the model benchmarks/grpo_step.py times the study's step on


def bf16_per_fp32() -> float | None:
    """The study step's BF16/FP32 time ratio from `benchmarks/grpo_step.py`'s tables of the stage-0 model (this machine's,
    both written), else None."""
    try:
        bf16, fp32 = (load_table(f"bench_grpo_step_{p}_{STEP_BENCHMARK_MODEL}")[0] for p in ("bf16", "fp32"))
    except FileNotFoundError:
        return None
    return float(bf16["total"].iloc[0] / fp32["total"].iloc[0])


REGIME_SETTINGS = ("model", "task", "prompts_per_step", "group_size", "temperature", "lr", "steps", "seed")


def read_finished(run: Run) -> pd.DataFrame | None:
    """A run's history once it has all its steps, after checking it ran in regime R: a run of another candidate under
    the same name (one started with --assume-regime before stage 0 chose otherwise) stops the study with what to do."""
    history = sweep.finished(OUT / run.run_id, run.steps)
    if history is None or run.regime is None:
        return history
    expected = settings_for(run.regime, run)
    kept = shipped_history(run.run_id, sweep.SHIPPED_RUNS).parent
    for config in (OUT / run.run_id / "config.json", kept / "config.json"):
        if config.exists():
            ran = json.loads(config.read_text())
            if differ := {k: (ran.get(k), expected[k]) for k in REGIME_SETTINGS
                          if k in expected and ran.get(k) != expected[k]}:
                raise SystemExit(f"{config.parent} ran with other settings than regime R ({run.regime['tag']}): "
                                 + ", ".join(f"{k} {a!r}, R's {b!r}" for k, (a, b) in differ.items())
                                 + f". It belongs to another candidate: move the folder away (and {kept}, if there), "
                                 "then start again.")
            break
    return history


STEP_TIMES = ["t_rollout", "t_score", "t_update", "t_sync"]


def step_seconds(history: pd.DataFrame) -> pd.Series:
    """Seconds of each training step of a run (its evaluations are not timed)."""
    return history.loc[history["step"] >= 1, STEP_TIMES].sum(axis=1)


def finished_histories(runs: list[Run]) -> dict[str, pd.DataFrame | None]:
    """Each planned run's history once finished (else None), read once for the tables that count them."""
    return {run.run_id: read_finished(run) for run in runs}


EVALUATION_SHARE = 0.2  # a run's evaluations, not timed in its history, as a share of its steps' time (a margin)


def run_hours(run: Run, histories: dict[str, pd.DataFrame | None]) -> float:
    """Hours a run would take: its steps at the median step of its stage's finished runs (of all finished runs, none
    of its stage has finished), plus EVALUATION_SHARE; 0 where no run has finished (then it is taken)."""
    timed = {run_id: h for run_id, h in histories.items() if h is not None}
    stage = [h for run_id, h in timed.items() if run_id.startswith(f"{run.stage}-")] or list(timed.values())
    if not stage:
        return 0.0
    per_step = float(np.median([step_seconds(h).median() for h in stage]))
    return run.steps * per_step * (1 + EVALUATION_SHARE) / 3600


def ran_on(histories: dict[str, pd.DataFrame | None]) -> list[str]:
    """The CPUs the finished runs ran on (each start's, from its machine.json): what their core-hours are measured on."""
    cpus = set()
    for run_id in (run_id for run_id, h in histories.items() if h is not None):
        for folder in (OUT / run_id, shipped_history(run_id, sweep.SHIPPED_RUNS).parent):
            if (folder / "machine.json").exists():
                cpus |= {f"{m['machine']['cpu']} ({m['machine']['cpu_generation']})"
                         for m in json.loads((folder / "machine.json").read_text())}
                break
    return sorted(cpus)


def status(runs: list[Run], histories: dict[str, pd.DataFrame | None]) -> pd.DataFrame:
    """Per stage: runs planned now, finished and left; the core-hours its finished runs took (training steps, one run
    per core; evaluations not counted), and those its runs left would take at the median step of its finished ones
    (none finished: not known)."""
    rows = []
    for run in runs:
        h = histories[run.run_id]
        seconds = None if h is None else step_seconds(h)
        rows.append(dict(stage=run.stage, finished=h is not None, steps_left=0 if h is not None else run.steps,
                         core_hours=0.0 if h is None else seconds.sum() / 3600,
                         step_s=np.nan if h is None else seconds.median()))
    if not rows:
        return pd.DataFrame(columns=["stage", "planned", "finished", "left", "core_hours_spent", "core_hours_left"])
    t = pd.DataFrame(rows).groupby("stage", sort=False).agg(
        planned=("finished", "size"), finished=("finished", "sum"), core_hours_spent=("core_hours", "sum"),
        steps_left=("steps_left", "sum"), step_s=("step_s", "median")).reset_index()
    return t.assign(left=t["planned"] - t["finished"], core_hours_left=t["steps_left"] * t["step_s"] / 3600)[
        ["stage", "planned", "finished", "left", "core_hours_spent", "core_hours_left"]]


def outcomes_of(runs: list[Run], stage: str) -> tuple[pd.DataFrame, list[str]]:
    """The registered endpoints of a stage's finished runs, and the ids of its planned runs not finished (missing)."""
    rows, missing = [], []
    for run in runs:
        if run.stage != stage:
            continue
        h = read_finished(run)
        if h is None:
            missing.append(run.run_id)
            continue
        o = confirmatory.outcomes(h.assign(run=run.run_id, sweep=stage, config=run.arm, seed=run.seed)).iloc[0]
        rows.append(dict(o, arm=run.arm, lr=run.lr, rung=run.rung, tis=run.tis, dose=first_step_dose(h)))
    return pd.DataFrame(rows), missing


def edge_table(runs: list[Run]) -> tuple[pd.DataFrame, str]:
    """The edge search so far: its finished runs (step size, seed, held-out accuracy first, peak and last, collapsed),
    and what it found, in a sentence computed from them (the edge, the next step size, or where it is)."""
    done, missing = outcomes_of(runs, "edge")
    columns = ["lr", "seed", "first", "peak", "last", "collapsed", "collapse_step"]
    table = done[columns] if not done.empty else pd.DataFrame(columns=columns)
    levels = sorted({run.lr for run in runs if run.stage == "edge"})
    if not levels:
        return table, "The edge search has not started: stage 0 has not chosen regime R."
    said = []
    for lr in levels:
        level = table[np.isclose(table["lr"].astype(float), lr)]
        seeds = sum(run.lr == lr for run in runs if run.stage == "edge")
        collapses = int(level["collapsed"].astype(bool).sum())
        if level.empty:
            said.append(f"at lr {lr:.3g} none of its {seeds} seeds has finished yet")
        elif len(level) < seeds:
            said.append(f"at lr {lr:.3g} the FP32 control collapsed in {collapses} of the {len(level)} seeds finished "
                        f"of {seeds}; the search waits for the rest")
        elif collapses >= 2:
            said.append(f"at lr {lr:.3g} it collapsed in {collapses} of {seeds} seeds: lr_edge = {lr:.3g}, Q2's "
                        "step sizes are set")
        else:
            said.append(f"at lr {lr:.3g} it collapsed in {collapses} of {seeds} seeds (fewer than 2): not the edge")
    return table, "The edge search, " + "; ".join(said) + "."


def calibration_table(runs: list[Run]) -> pd.DataFrame:
    """Each rung's calibrated dose (nats per response at the first step), its multiple of the natural BF16 dose and of
    the paper-like one, and whether Q1 runs it."""
    done, _ = outcomes_of(runs, "calibration")
    if done.empty:
        return pd.DataFrame(columns=["rung", "dose", "times_natural", "times_paper_like", "in_q1"])
    dose = dict(zip(done["rung"], done["dose"]))
    ran = set(q1_rungs(dose)) if len(dose) == len(ladder()) else set()
    table = done[["rung", "dose"]].assign(times_natural=done["dose"] / dose.get(NATURAL, math.nan),
                                         times_paper_like=done["dose"] / PAPER_LIKE_DOSE,
                                         in_q1=done["rung"].isin(ran))
    return table.sort_values("dose", ignore_index=True)


QUESTIONS = {"q1": ("Q1 (dose)", "H1, H2"), "q2": ("Q2 (edge)", "H3-H5"), "q3": ("Q3 (long horizon)", "H6")}


def write_tables(reg: dict, runs: list[Run], waits: list[str], note: str, closed: bool = False) -> dict:
    """tables/06_study_plan.csv always; the edge search's and the calibration's; each question's table once its runs
    have started; the family of tests and the verdicts in the plan's provenance. Every row is pre-registered (this
    script runs nothing else).
    A question's registered test runs once every run planned for it has finished (a look at part of its runs is one
    the registration did not plan); until then its table counts the runs so far and its verdict says what it waits
    for. `closed`: the study has ended; each test runs over the runs that finished, the rest named as missing."""
    analyses = dict.fromkeys(QUESTIONS)
    edge, edge_found = edge_table(runs)
    save_table(edge.assign(preregistered=True), "06_study_edge", params=dict(regime=note, found=edge_found))
    save_table(calibration_table(runs).assign(preregistered=True), "06_study_calibration",
               params=dict(regime=note, paper_like_dose=PAPER_LIKE_DOSE))
    waiting = {}
    for stage, (question, tests) in QUESTIONS.items():
        done, missing = outcomes_of(runs, stage)
        if done.empty:
            continue
        if missing and not closed:
            table = {"q1": lambda: confirmatory.rung_table(done),
                     "q2": lambda: confirmatory.collapse_counts(done, ["arm", "lr"]),
                     "q3": lambda: confirmatory.long_horizon(done)["arms"].reset_index()}[stage]()
            waiting[stage] = (f"{question}: {len(done)} of its {len(done) + len(missing)} planned runs finished; its "
                              f"registered test ({tests}) waits for the rest")
        elif stage == "q1":
            analyses[stage] = confirmatory.dose_curve(done)
            table = analyses[stage]["rungs"]
        elif stage == "q2":
            margin = reg["questions"]["Q2_edge"]["equivalence_margin"]["log_step_size"]
            analyses[stage] = confirmatory.edge_shift(done, margin)
            table = analyses[stage]["arms"]
        else:
            analyses[stage] = confirmatory.long_horizon(done)
            table = analyses[stage]["arms"].reset_index()
        save_table(table.assign(preregistered=True), f"06_study_{stage}",
                   params=dict(missing=missing, test_run=stage not in waiting))
    family = confirmatory.holm_family(*analyses.values())
    verdicts = [waiting.get(stage) or verdict(analyses[stage], family) for stage, verdict in
                zip(QUESTIONS, (confirmatory.q1_verdict, confirmatory.q2_verdict, confirmatory.q3_verdict))]
    histories = finished_histories(runs)
    save_table(status(runs, histories), "06_study_plan", params=dict(
        regime=note, waits=waits, tests=family, verdicts=verdicts, closed=closed, ran_on=ran_on(histories)))
    return dict(regime=note, waits=waits, verdicts=verdicts)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print each stage's planned and finished runs, and waits")
    parser.add_argument("--tables", action="store_true", help="write tables/06_study_*.csv from the finished runs")
    parser.add_argument("--close", action="store_true",
                        help="with --tables, once the study has ended: run each question's registered test over the "
                             "runs that finished, naming the rest missing (without it a test waits for all its runs)")
    parser.add_argument("--hours", type=float, metavar="H",
                        help="stop taking runs that would not finish within H hours of the start (a machine that is "
                             "handed back loses its unfinished runs' checkpoints with results/)")
    parser.add_argument("--stage", action="append", choices=list(STAGE_ORDER),
                        help="run only this stage's runs (repeat for several)")
    parser.add_argument("--assume-regime", metavar="TAG",
                        help="while stage 0 still runs, run the stages that rest on R alone and gate the rest (the "
                             "edge search, the calibration) as if it chose candidate TAG: speculative runs, used only "
                             "if stage 0 then chooses TAG (its rule does not read them)")
    args = parser.parse_args()
    reg = preregistration()
    histories, stage0_table, _ = sweep.stage0_so_far(reg)
    if args.close and not args.tables:
        parser.error("--close goes with --tables")
    if args.assume_regime and args.tables:
        raise SystemExit("--tables reads stage 0's choice: start it without --assume-regime")
    r, note, speculative = assumed_regime(reg, stage0_table, args.assume_regime)

    def taken(planned):  # the stages asked for; nothing past the gating ones rests on a guessed regime
        stages = set(args.stage or STAGE_ORDER) & ({"edge", "calibration"} if speculative else set(STAGE_ORDER))
        return [run for run in planned if run.stage in stages]

    runs, waits = plan(reg, r, read_finished)
    if args.plan or args.tables:
        cost = cost_at_most(histories, reg, bf16_per_fp32())  # a candidate without histories here keeps its row
        kept = sweep.kept_rows("06_study_cost", "candidate", set(cost.get("candidate", [])))
        if kept is not None and len(kept):
            cost = in_registered_order(pd.concat([cost, kept], ignore_index=True), "candidate", reg)
        if not cost.empty:
            print("core-hours of the largest plan, per stage-0 candidate (training steps; evaluations not counted):")
            print(cost.round(2).to_string(index=False))
        print(note)
        print(status(runs, finished_histories(runs)).round(1).to_string(index=False) if runs else "no run is planned yet")
        print("\n".join(waits))
        if args.tables:
            if not cost.empty:
                save_table(cost, "06_study_cost", params=dict(steps_at_most=steps_at_most().to_dict("records")))
            print(write_tables(reg, runs, waits, note, closed=args.close))
        raise SystemExit(0)
    if r is None:
        raise SystemExit(f"nothing to run: {note}")
    runs = taken(runs)
    if copied := sweep.ship_finished((OUT / run.run_id, run.steps) for run in runs):  # finished before a crash
        print(f"copied to {sweep.SHIPPED_RUNS.relative_to(ROOT)}: {', '.join(copied)}", flush=True)
    done, failed, started, too_long = 0, set(), time.monotonic(), []
    while True:  # one run at a time, planned again after each: a finished stage unlocks the next
        histories = finished_histories(runs)
        unfinished = [run for run in runs if run.run_id not in failed and histories[run.run_id] is None]
        if args.hours is not None:
            hours_left = args.hours - (time.monotonic() - started) / 3600
            too_long = [run for run in unfinished if run_hours(run, histories) > hours_left]
            unfinished = [run for run in unfinished if run not in too_long]
        todo = [(grpo.GRPOConfig(**sweep.resolved(run.arm, settings_for(r, run))), OUT / run.run_id)
                for run in unfinished]
        claim = sweep.claimed(todo)
        mine = next(claim, None)
        if mine is None:
            break
        for cfg, out, h in arms.run_many([mine], progress=False, keep_going=True):
            done += 1
            if isinstance(h, Exception):  # kept with its checkpoint for the next start; not retried by this worker
                failed.add(out.name)
            else:
                sweep.ship_finished([(out, cfg.steps)])
            print(f"[{done}] {out.name}: " + (f"FAILED: {''.join(traceback.format_exception(h))}"
                                            if isinstance(h, Exception) else "done"), flush=True)
        claim.close()  # lets go of the run's lock
        if speculative:  # stage 0 may have chosen meanwhile: R is then its choice, or this worker stops
            r, note, speculative = assumed_regime(reg, sweep.stage0_so_far(reg)[1], args.assume_regime)
        runs, waits = plan(reg, r, read_finished)
        runs = taken(runs)
    print("nothing more to run now" + ("; " + "; ".join(waits) if waits else "") +
          (f"; {len(too_long)} runs would not finish within the {args.hours} h" if too_long else "") +
          " (other workers may hold runs; start this again when they finish)")
