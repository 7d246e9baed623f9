"""The GRPO studies behind notebook 06b: the settings search (does default BF16 GRPO degrade where aligned
training does not?) and the dose-response study (how much mismatch does uncorrected GRPO tolerate?).

    make grpo-sweep                                  # everything below, on every CPU core
    .venv/bin/python experiments/grpo_sweep.py --only lr3e-4 --seeds 0   # a slice
    .venv/bin/python experiments/grpo_sweep.py --only dose               # start one per core: they share the list
    .venv/bin/python experiments/grpo_sweep.py --only stage0 --seeds 0   # the collapse study's pilot, seed 0 first
    .venv/bin/python experiments/grpo_sweep.py --stage0-table            # its table and decision so far

The collapse study's stage 0 (data/grpo_study/preregistration.json: which regime learns) is read from the
pre-registration (`stage0_grid`): one tag per candidate and step size, `stage0-...` (`--only stage0`: all of them),
the FP32 control, seeds 0-2.

Any number of workers can run the same list at once: each run folder is locked (`claim.lock`, an flock) by
the one worker running it, and the others move on to the next. The lock dies with its process, so a worker
that crashes or is killed leaves its run to be resumed from its last checkpoint by whichever worker reaches
it next (or by starting the sweep again), and every other run's results as they were.

Each run is a `grpo.run` in `results/grpo_sweep/<run>/` (checkpointed: stop and start again, it resumes; the
checkpoint is read as data only, `torch.load(weights_only=True)`, so a file put in a shared run folder never runs).
results/ stays on the machine that ran it, so a finished run is copied at once into `data/grpo_runs/<run>/` (history,
config, machine): committed, it counts as finished everywhere and is never run again (`ship_finished`).
When all are done, one file collects the per-step histories of every run,
`data/grpo_sweep/histories.csv.gz` (shipped, so notebook 06b can show the search without re-running it),
written atomically, with a sidecar `histories.json`: when it was written, from which commit, the grid.
For the file collected before sidecars existed, `--sidecar-from-git` rebuilds its sidecar from git. The runs are ordered so that an interrupted search has whole seeds done first.

The grid, for the embedded qwen3-tiny (16 prompts x 8 samples, 32 tokens, 2 minibatches, clip 0.2):
- lr 3e-4 (15x the notebook's default), 300 steps, seeds 0-2: default BF16, all three aligned,
  FP32 control, and default BF16 with rollout weights rounded to 3 mantissa bits (a deliberately larger
  mismatch, as lower-precision rollouts give: is there a mismatch size at which this model degrades?)
- lr 4e-4 and 6e-4, 150 steps, seeds 0-2: the same four (added after lr 1e-3 sent every configuration,
  the FP32 control included, to zero accuracy: between stable and always-collapsing is where a small
  mismatch could tip a run over)
- lr 1e-3, 150 steps, seeds 0-2: default BF16, all three aligned, FP32 control

The dose-response study (`arms.dose_configurations`), lr 3e-4, 150 steps, every held-out prompt (512) every 25:
- "dose": qwen3-tiny on the short task, seeds 0-2: default BF16; rollout weights rounded to 3, 2, 1 mantissa
  bits; logit noise 0.1, 0.3, 1.0 in the engine's sampler; each with and without truncated importance sampling
  (cap 2); and the zero-mismatch arms: aligned to the engine's schedule, and FP32 (the settings search above
  has all three regions aligned at this learning rate).
- "dose-steps": qwen3-tiny-steps on the long-answer task (45-100-token responses), seed 0, lr 3e-5, 60 steps:
  default BF16, 3-bit rollouts with and without TIS, FP32: where per-sequence mismatch grows with length. (At
  lr 3e-4 default BF16 fell from 0.39 to 0 held-out accuracy within 25 steps, its mismatch rising tenfold on the
  way: too hot for this model to say anything about the mismatch; a tenth of it is used.)
"""

import argparse
import datetime
import fcntl
import gzip
import json
import subprocess
import traceback
from pathlib import Path

import pandas as pd

from rla_lib import grpo
from rla_lib.studies import arms, collapse
from rla_lib.studies.arms import CONFIGURATIONS, ENGINE_SCHEDULE, TIS
from rla_lib.studies.collapse import preregistration, stage0, stage0_runs
from rla_lib.studies.stability import summarize, sweep_sidecar_path
from rla_lib.report import git_commit, load_table, save_table
from rla_lib.paths import DATA_DIR, RESULTS_DIR, ROOT, atomic_write

OUT = RESULTS_DIR / "grpo_sweep"
SHIPPED = DATA_DIR / "grpo_sweep" / "histories.csv.gz"
SHIPPED_RUNS = collapse.RUNS_DIR  # every finished run, one folder each (`ship_finished`)
CONFIGS = ["default BF16", "all three", "FP32 control", "default BF16, 3-bit rollouts"]
COMMON = dict(model="qwen3-tiny", prompts_per_step=16, group_size=8, max_tokens=32, eval_every=25, eval_prompts=256,
              checkpoint_every=25)
DOSES = list(arms.dose_configurations())
NAMED = CONFIGURATIONS | arms.dose_configurations()
# The collapse study's search for a regime that learns (issue: does BF16 mismatch cause the collapse?): the long-answer
# task, every held-out problem every 10 steps; the FP32 control first, since without learning nothing can collapse.
# lr 3e-4 sent both arms to zero within 10 steps; edge-steps sits between it and lr 1e-4, with the exactly
# on-policy BF16 arm (aligned to the engine's schedule: bitwise on this CPU) beside them; slow-steps is below lr 1e-4,
# where dose-steps (lr 3e-5) rose from 0.39 to 0.45-0.51 in 60 steps. slow-steps' FP32 control plateaued near 0.5;
# wide-steps halves its gradient variance (32 prompts per step), and since its sampling entropy is only about 0.03
# nats per token, t1.5-steps explores by sampling its rollouts at temperature 1.5 (evaluated at 1.0, as every run),
# and group16-steps by drawing 16 responses per prompt; wide-1e-4-steps doubles wide-steps' step size, which at 16
# prompts per step (learn-steps) learned nothing. Every one of these stopped at 0.46-0.49, near the model's greedy
# accuracy (0.525): sharpening was all there was to learn. t2start-1e-4 starts instead from qwen3-tiny-steps-hot
# (the same model at temperature 2: right about 7% of the time at temperature 1), with room to rise; its FP32 control
# rose from 0.07 to 0.13-0.14 in 100 steps at lr 1e-4 (seed 0; seed 1's did not rise), default BF16 and the exactly
# on-policy BF16 arm to about 0.11 (seed 1's BF16 arms are still to run): slow. t2start-1.5e-4 runs longer with a larger
# step. Larger still, the FP32 control fell from 0.07 to 0.01 or below within 10 steps at lr 2e-4 and 3e-4 (seed 0,
# first started for 100 steps): the step size alone collapses it there. t2start-2e-4 asks, with 5 seeds and 30 steps,
# whether default BF16 and the exactly on-policy arm collapse there as often as FP32 does; then the paper's arms (RoPE
# only, all three regions) and default BF16 with TIS (cap 2, as TRL and verl default) on the same seeds;
# t2start-1.5e-4-30steps asks the same with every arm one step size below, on the same seeds and schedule
STEPS_TASK = dict(model="qwen3-tiny-steps", task="steps", max_tokens=112, eval_every=10, eval_prompts=512)
LEARN = ["FP32 control", "default BF16"]
PAPER_ARMS = ["rope", "all three", "default BF16" + TIS]  # the paper's regions, and the usual off-policy correction
DOSE_STEPS = ["default BF16", "default BF16, 3-bit rollouts", "default BF16, 3-bit rollouts" + TIS, "FP32 control"]
GRID = [  # (tag, settings, seeds, configs)
    ("lr3e-4", dict(lr=3e-4, steps=300), (0, 1, 2), CONFIGS),
    ("lr4e-4", dict(lr=4e-4, steps=150), (0, 1, 2), CONFIGS),
    ("lr6e-4", dict(lr=6e-4, steps=150), (0, 1, 2), CONFIGS),
    ("lr1e-3", dict(lr=1e-3, steps=150), (0, 1, 2), ["default BF16", "all three", "FP32 control"]),
    ("dose", dict(lr=3e-4, steps=150, eval_prompts=512), (0, 1, 2), DOSES + [ENGINE_SCHEDULE, "FP32 control"]),
    ("dose-steps", dict(model="qwen3-tiny-steps", task="steps", max_tokens=112, lr=3e-5, steps=60, eval_every=20,
                        eval_prompts=256),
     (0,), DOSE_STEPS),
    ("hot-steps", dict(STEPS_TASK, lr=3e-4, steps=40), (0,), LEARN),
    ("learn-steps", dict(STEPS_TASK, lr=1e-4, steps=100), (0,), LEARN),
    ("edge-steps", dict(STEPS_TASK, lr=2e-4, steps=60), (0, 1), LEARN + [ENGINE_SCHEDULE]),
    ("slow-steps", dict(STEPS_TASK, lr=5e-5, steps=100), (0,), LEARN),
    ("wide-steps", dict(STEPS_TASK, lr=5e-5, steps=100, prompts_per_step=32), (0,), ["FP32 control"]),
    ("t1.5-steps", dict(STEPS_TASK, lr=5e-5, steps=100, temperature=1.5), (0,), ["FP32 control"]),
    ("group16-steps", dict(STEPS_TASK, lr=5e-5, steps=100, group_size=16), (0,), ["FP32 control"]),
    ("wide-1e-4-steps", dict(STEPS_TASK, lr=1e-4, steps=100, prompts_per_step=32), (0,), ["FP32 control"]),
    ("t2start-1e-4", dict(STEPS_TASK, model="qwen3-tiny-steps-hot", lr=1e-4, steps=100), (0, 1), LEARN + [ENGINE_SCHEDULE]),
    ("t2start-1.5e-4", dict(STEPS_TASK, model="qwen3-tiny-steps-hot", lr=1.5e-4, steps=200), (0,), LEARN),
    ("t2start-2e-4", dict(STEPS_TASK, model="qwen3-tiny-steps-hot", lr=2e-4, steps=30), (0, 1, 2, 3, 4),
     LEARN + [ENGINE_SCHEDULE] + PAPER_ARMS),
    ("t2start-1.5e-4-30steps", dict(STEPS_TASK, model="qwen3-tiny-steps-hot", lr=1.5e-4, steps=30), (0, 1, 2, 3, 4),
     LEARN + [ENGINE_SCHEDULE] + PAPER_ARMS),
    ("t2start-3e-4", dict(STEPS_TASK, model="qwen3-tiny-steps-hot", lr=3e-4, steps=30), (0,), ["FP32 control"]),
]



def stage0_grid() -> list:
    """Stage 0 of the pre-registered collapse study (data/grpo_study/preregistration.json), read from the file so the
    runs are the registered ones: one tag per candidate regime and step size (`collapse.stage0_runs`)."""
    stage = preregistration()["stage_0_regime"]
    grid = []
    for tag, cand, lr in stage0_runs():
        settings = dict(STEPS_TASK, model=cand["model"], task=cand["task"], steps=cand["steps"], checkpoint_every=10,
                        prompts_per_step=cand["prompts_per_step"], group_size=cand["group_size"], lr=lr)
        if "temperature" in cand:
            settings["temperature"] = cand["temperature"]
        grid.append((tag, settings, tuple(stage["seeds"]), [stage["arm"]]))
    return grid


GRID += stage0_grid()


def claimed(runs):
    """The runs of `[(cfg, out_dir), ...]` this process takes, lazily: a run is skipped while another live process
    holds its folder's lock (`claim.lock`, an flock, released when the next run is asked for or the process dies),
    or once it has all its steps (another process finished it), so any number of processes can share one list; a
    killed one's run is resumed by the next that reaches it."""
    for cfg, out in runs:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "claim.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if finished(out, cfg.steps) is None:
                yield cfg, out


def planned_runs(only=None, seeds=None, configs=None):
    for tag, settings, tag_seeds, names in GRID:
        if only and tag not in only:
            continue
        for seed in tag_seeds:
            if seeds is not None and seed not in seeds:
                continue
            for name in names:
                if configs and name not in configs:
                    continue
                yield collapse.run_id(tag, seed, name), dict(sweep=tag, config=name, seed=seed), dict(COMMON, **settings, **NAMED.get(name, {}), seed=seed)


def resolved(name: str, settings: dict) -> dict:
    """A run's GRPOConfig settings; the engine schedule's are read from the engine (cached), only when it runs."""
    if name != ENGINE_SCHEDULE:
        return settings
    return settings | arms.configuration(name, settings["model"], settings.get("engine_mode", "compiled"))


def grid() -> dict:
    """The search's settings, as the sidecar records them."""
    names = dict.fromkeys(name for *_, names in GRID for name in names)
    return dict(common=COMMON, grid=[dict(tag=tag, settings=settings, seeds=list(seeds), configs=list(names))
                                     for tag, settings, seeds, names in GRID],
                configurations={name: NAMED.get(name, "read from the engine") for name in names})


def write_sidecar(written: str, commit: str | None, runs: int, note: str | None = None) -> None:
    """`histories.json` next to the shipped histories: when they were collected, from which commit, the grid."""
    meta = dict(file=SHIPPED.name, written=written, commit=commit, runs=runs, **grid()) | ({"note": note} if note else {})
    atomic_write(sweep_sidecar_path(SHIPPED), lambda tmp: tmp.write_text(json.dumps(meta, indent=1, default=list) + "\n"))


def stage0_histories(reg: dict | None = None) -> pd.DataFrame | None:
    """Every stage-0 run's history so far: a finished run's (here or in the repository), else as far as it ran here."""
    frames = []
    for run_id, labels, settings in planned_runs(only=[tag for tag, _, _ in stage0_runs(reg)]):
        history = finished(OUT / run_id, settings["steps"])
        if history is None and (partial := OUT / run_id / "history.csv").exists():
            history = pd.read_csv(partial)
        if history is not None:
            frames.append(history.assign(run=run_id, **labels))
    return pd.concat(frames, ignore_index=True) if frames else None


def kept_rows(name: str, key: str, at_hand: set) -> pd.DataFrame | None:
    """The rows of committed table `name` whose `key` is not in `at_hand`, each with its `source`: the table and
    commit it was computed at, for rows computed from runs (kept rows keep theirs). None without the table."""
    try:
        table, meta = load_table(name)
    except FileNotFoundError:
        return None
    computed_at = f"tables/{name}.csv of {meta['commit']}"
    source = table["source"].where(table["source"] != "runs", computed_at) if "source" in table else computed_at
    return table.assign(source=source)[lambda t: ~t[key].isin(at_hand)]


def stage0_so_far(reg: dict | None = None) -> tuple[pd.DataFrame | None, pd.DataFrame, dict]:
    """Stage 0 by its registered rule (`collapse.stage0`) from its runs here and in the repository; a candidate none of
    whose runs is at hand keeps its row of the committed tables/06_stage0.csv (its runs finished on a machine whose
    results/ is gone, before finished runs were copied into the repository). Returns the histories, table, decision."""
    histories = stage0_histories(reg)
    at_hand = set() if histories is None else set(histories["sweep"])
    kept = kept_rows("06_stage0", "sweep", at_hand)
    table, decision = stage0(pd.DataFrame(columns=["run", "sweep", "config", "seed", "step", "eval_accuracy"])
                             if histories is None else histories, reg, kept)
    return histories, table, decision


def write_stage0_table() -> dict:
    """Stage 0 of the collapse study so far (`stage0_so_far`; an unfinished run is not counted): tables/06_stage0.csv,
    with the decision in its provenance."""
    _, table, decision = stage0_so_far()
    if table.empty:
        raise SystemExit("no stage-0 run has started: run `experiments/grpo_sweep.py --only stage0` first")
    save_table(table, "06_stage0", params=dict(decision=decision, rule=preregistration()["stage_0_regime"]["rule"]))
    return decision


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def sidecar_from_git() -> None:
    """The sidecar of a histories file collected before sidecars existed: date and commit of the commit that
    last changed it (a54ec1f for the shipped one, whose grid is the one above)."""
    path = str(SHIPPED.relative_to(ROOT))
    written, commit = git("log", "-1", "--format=%cI", "--", path), git("log", "-1", "--format=%h", "--", path)
    write_sidecar(written, commit, runs=pd.read_csv(SHIPPED)["run"].nunique(),
                  note="rebuilt from git (`git log -1 -- data/grpo_sweep/histories.csv.gz`): written = the commit date")


def finished(folder: Path, steps: int) -> pd.DataFrame | None:
    """A run's history once it has all its steps: from its folder in results/, else from the repository's copy (a run
    finished on another machine). A run checkpoints its history on the way: an unfinished one is still running, or
    was stopped, and is not collected."""
    for path in (Path(folder) / "history.csv", collapse.shipped_history(Path(folder).name, SHIPPED_RUNS)):
        if path.exists() and (history := pd.read_csv(path))["step"].max() >= steps:
            return history
    return None


def ship_finished(runs) -> list[str]:
    """Copy each run of `[(out_dir, steps), ...]` that finished in results/ into `data/grpo_runs/<run>/` (its history,
    gzipped, and the config and machine it ran with), unless it is there already. results/ stays on the machine that
    ran it; a run committed from here is never run again. Returns the runs copied."""
    copied = []
    for out, steps in runs:
        out = Path(out)
        kept = collapse.shipped_history(out.name, SHIPPED_RUNS)
        if kept.exists() or finished(out, steps) is None:
            continue
        for name in ("config.json", "machine.json"):
            if (out / name).exists():
                atomic_write(kept.parent / name, lambda tmp: tmp.write_bytes((out / name).read_bytes()))
        history = gzip.compress((out / "history.csv").read_bytes(), mtime=0)  # the same bytes for the same run
        atomic_write(kept, lambda tmp: tmp.write_bytes(history))  # last: it marks the copy whole
        copied.append(out.name)
    return copied


def collect(runs) -> tuple[pd.DataFrame, list[str]]:
    """Histories of every planned run: from `results/grpo_sweep/` where it finished here, else kept from the shipped
    file (so re-running one arm, e.g. `--configs "default BF16, 3-bit rollouts"`, replaces just that arm).
    Returns the histories and the ids of the runs taken from `results/`."""
    shipped = pd.read_csv(SHIPPED) if SHIPPED.exists() else pd.DataFrame(columns=["run"])
    frames, fresh = [], []
    for run_id, labels, settings in runs:
        if (history := finished(OUT / run_id, settings["steps"])) is not None:
            frames.append(history.assign(run=run_id, **labels))
            fresh.append(run_id)
        elif run_id in set(shipped["run"]):
            frames.append(shipped[shipped["run"] == run_id])
    return pd.concat(frames, ignore_index=True), fresh


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="sweep tags to run (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, help="seeds to run (default: each tag's own)")
    parser.add_argument("--configs", nargs="*", help="configurations to run (default: each tag's own)")
    parser.add_argument("--collect-only", action="store_true", help="just rebuild the shipped file from finished runs")
    parser.add_argument("--sidecar-from-git", action="store_true", help="only write the shipped file's sidecar from git history")
    parser.add_argument("--stage0-table", action="store_true",
                        help="only write tables/06_stage0.csv: the collapse study's stage 0 so far, by its rule")
    args = parser.parse_args()
    if args.stage0_table:
        raise SystemExit(f"stage 0: {write_stage0_table()}")
    if args.sidecar_from_git:
        sidecar_from_git()
        raise SystemExit(f"wrote {sweep_sidecar_path(SHIPPED).relative_to(ROOT)}")

    if args.only and "stage0" in args.only:  # the pilot's tags, as a group
        args.only = [t for t in args.only if t != "stage0"] + [tag for tag, _, _ in stage0_runs()]
    known = list(dict.fromkeys(name for *_, names in GRID for name in names))
    if args.configs and set(args.configs) - set(known):
        parser.error(f"unknown configuration(s) {sorted(set(args.configs) - set(known))}; choose from {known}")
    if args.only and set(args.only) - {tag for tag, *_ in GRID}:
        parser.error(f"unknown tag(s) {sorted(set(args.only) - {tag for tag, *_ in GRID})}; choose from {[t for t, *_ in GRID]}")
    runs = list(planned_runs(args.only, set(args.seeds) if args.seeds else None, args.configs))
    stage0_table = stage0_so_far()[1]
    if decided := set(stage0_table.query("source != 'runs' and complete")["sweep"]) if len(stage0_table) else set():
        runs = [run for run in runs if run[1]["sweep"] not in decided]  # its row is kept: its runs are not run again
        print(f"stage 0, kept from tables/06_stage0.csv (not run again): {', '.join(sorted(decided))}", flush=True)
    todo = [] if args.collect_only else [
        (grpo.GRPOConfig(**resolved(labels["config"], settings)), OUT / run_id) for run_id, labels, settings in runs]
    if copied := ship_finished((OUT / run_id, settings["steps"]) for run_id, _, settings in runs):  # before a crash
        print(f"copied to {SHIPPED_RUNS.relative_to(ROOT)}: {', '.join(copied)}", flush=True)
    failed = []
    for i, (cfg, out, h) in enumerate(arms.run_many(claimed(todo), progress=False, keep_going=True), 1):  # engines shared
        if isinstance(h, Exception):
            print(f"[{i}] {out.name}: FAILED: {''.join(traceback.format_exception(h))}", flush=True)
            failed.append(out.name)
            continue
        ship_finished([(out, cfg.steps)])
        s = summarize(h, eval_prompts=cfg.eval_prompts)
        print(f"[{i}] {out.name}: eval acc {s['eval acc first']:.3f} -> peak {s['eval acc peak']:.3f} -> last "
              f"{s['eval acc last']:.3f}   k3 {s['k3 mean (1e-4)']:.3g} x 1e-4   {s['step seconds']:.2f} s/step", flush=True)

    if failed:  # the finished runs are kept; start the sweep again to retry these (each resumes from its checkpoint)
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")
    if not args.collect_only and any(finished(OUT / run_id, settings["steps"]) is None for run_id, _, settings in runs):
        print("other workers still hold runs of this list: the last one to finish collects")
        raise SystemExit(0)
    every = list(planned_runs())
    data, fresh = collect(every)
    atomic_write(SHIPPED, lambda tmp: data.to_csv(tmp, index=False, float_format="%.6g", compression="gzip"))
    kept = data["run"].nunique() - len(fresh)
    write_sidecar(datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), git_commit(), data["run"].nunique(),
                  note=None if not kept else f"{len(fresh)} runs collected from results/grpo_sweep now ({', '.join(fresh)}); "
                  f"{kept} kept from the previously shipped file (see git history of histories.json)")
    print(f"{data['run'].nunique()} of {len(every)} runs collected in {SHIPPED.relative_to(ROOT)}")
