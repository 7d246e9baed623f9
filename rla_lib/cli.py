"""The `rla` command: the library's one-call jobs from a shell.

    rla env                                                   # the machine record BF16 numbers depend on
    rla schedule --model DIR --mode compiled --out s.json     # the engine's rounding schedule, for align_to_engine
    rla measure --model DIR --prompts p.jsonl --out DIR       # the mismatch of each training side on your prompts
    rla where --model DIR --prompts p.jsonl --out DIR         # the first layer and op where each side parts from vLLM

`rla schedule` starts the engine where it runs (a GPU machine, say), reads where it rounds, takes or probes its
attention numerics and writes the schedule; the trainer elsewhere applies it with `align_to_engine(model, "s.json")`.
It prints how exact the aligned training side was on the probe (`engine_align.exactness`).

`rla measure` samples responses to your prompts (a JSON-lines file: `rla_lib.prompts`) with vLLM, scores the same
tokens with every training side (`rla_lib.mismatch_report`), prints the mismatch with 95% intervals over prompts, the
paired change against stock BF16 and the bitwise share, says which configuration to use, and writes the same as
`measure.csv` and `measure.json` in --out. Bad input (no such model, an architecture rla does not align, a missing
or malformed prompt file, a chat prompt for a tokenizer without a chat template, a prompt longer than the context) is
refused before any engine starts. Below the advice it names what only looks like mismatch (`align.monitor.masquerades`:
non-finite or placeholder logprobs, a one-sided gap, identical responses independent draws would rarely give).
`--temperature`, `--top-p` and `--top-k` sample as your trainer's rollouts do; with truncation it also says how far
the sampler's logprobs (truncated, renormalised) sit above the full softmax a trainer scores, and the gap against each.
`--max-kl X` makes it a CI gate: after the table, one line, PASS or FAIL with the
gated side's KL and interval per mode, and exit status 3 when that side's KL exceeds X in any mode (2 is bad input).
`--report FILE.html` also writes a self-contained page (`rla_lib.mismatch_html`): the table, the advice and every
response's tokens coloured by their logprob difference, per engine mode and training side, worst prompts first on a click.

`rla where` finds where the drift starts (`rla_lib.where`): per mode and training side (stock BF16, engine-aligned),
the first (layer, rounding point) at which it parts from the engine, read from the engine's code (both modes) and,
for eager, from the values of every op on one response to each of your first prompts; `where.csv`, `where.json` and
`where.png` / `.svg` (layers by points) in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import mismatch_html, mismatch_report, where
from .engine import MODES, check_truncation, default_context
from .engine_align import exactness, started_engine_schedule
from .align.schedule import save_schedule
from .machine import describe, machine
from .mismatch import measure
from .models import load_tokenizer, resolve_model
from .paths import RESULTS_DIR, atomic_write
from .plotting import save_figure
from .prompts import check_room, prompt_ids, read_prompts
from .report import save_table

GATE_FAILED = 3  # `rla measure --max-kl`: the mismatch is past the threshold (2: the input was refused)


def cmd_env(args) -> int:
    print(json.dumps(machine(), indent=1) if args.json else describe())
    return 0


def cmd_schedule(args) -> int:
    spec = resolve_model(args.model)  # a missing or unsupported model fails here, before the engine
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: the folder {out.parent} does not exist; create it or choose another")
    sched = started_engine_schedule(spec.path, args.mode, force=args.force, n_sequences=args.probe_sequences)
    save_schedule(sched, out)
    print(f"{out}: the rounding schedule of vLLM {args.mode} for {spec.path.name}; {exactness(sched)}")
    return 0


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes {text!r}: a comma-separated list of {', '.join(MODES)}")
    return modes


def checked_input(args, counts: dict[str, int], writes: str):
    """What `measure` and `where` read, checked before any engine starts: (model spec, modes, output folder, each
    prompt's token ids). `counts`: options that must be at least 1; `writes`: what goes into --out."""
    spec, modes = resolve_model(args.model), _modes(args.modes)
    if min(counts.values()) < 1:
        raise ValueError(f"{' and '.join(counts)} must be at least 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder for {writes}")
    return spec, modes, out, prompt_ids(read_prompts(args.prompts), load_tokenizer(spec.path), spec.name)


def cmd_measure(args) -> int:
    spec, modes, out, ids = checked_input(args, {"--samples": args.samples, "--max-tokens": args.max_tokens},
                                          "measure.csv and measure.json")
    report = Path(args.report) if args.report else None
    if report is not None and (report.suffix != ".html" or not (report.parent.is_dir() or report.parent.resolve() == out.resolve())):
        raise ValueError(f"--report {report}: an .html file in an existing folder (or in --out)")
    if not args.temperature > 0:
        raise ValueError(f"--temperature {args.temperature}: a temperature above 0 (vLLM samples greedily at 0, with no "
                         "distribution to compare)")
    check_truncation(args.top_p, args.top_k)
    if args.max_kl is not None and not args.max_kl >= 0:
        raise ValueError(f"--max-kl {args.max_kl}: a KL in nats per token, 0 or more")
    if args.max_kl is not None and args.gate_side not in gate_sides(args):
        raise ValueError(f"--gate-side {args.gate_side!r}: one of {', '.join(repr(s) for s in gate_sides(args))}")
    check_room(ids, args.max_tokens, default_context(spec))  # everything checked: engines start from here
    configs = mismatch_report.configs(spec.path, modes, engine_aligned=not args.no_engine_aligned)
    run = measure(spec.path, modes, configs, n_samples=args.samples, max_tokens=args.max_tokens, seed=args.seed,
                  fp32_reference=False, prompts=ids, cache_dir=None if args.no_cache else Path(args.cache),
                  progress=not args.quiet, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    df = mismatch_report.summary(run, modes, n_boot=args.n_boot, seed=args.seed)
    advice = (mismatch_report.advice(df) + mismatch_report.sampling_lines(run, modes, args.n_boot, args.seed)
              + mismatch_report.masquerade_lines(run, modes, args.samples))
    out.mkdir(parents=True, exist_ok=True)
    # the model and prompts as given (a checkpoint's path on this machine means nothing on another)
    params = dict(model=args.model, prompts=args.prompts, n_prompts=len(ids), modes=list(modes),
                  n_samples=args.samples, max_tokens=args.max_tokens, seed=args.seed, n_boot=args.n_boot,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, advice=advice)
    save_table(df, "measure", params, out)
    print(f"{spec.path.name}: {len(ids)} prompts x {args.samples} samples, up to {args.max_tokens} tokens; KL in nats per "
          "token, 95% intervals over prompts; change: paired, against stock BF16 on the same tokens\n")
    written = [out / "measure.csv", out / "measure.json"]
    if report is not None:
        text = mismatch_html.page(run, df, advice, modes, load_tokenizer(spec.path), f"{spec.path.name} on {args.prompts}")
        written.append(atomic_write(report, lambda tmp: tmp.write_text(text)))
    print(mismatch_report.text_table(df) + "\n\n" + "\n".join(advice) + "\n\nwritten: " + ", ".join(map(str, written)))
    if args.max_kl is None:
        return 0
    passed, reason = mismatch_report.gate(df, args.gate_side, args.max_kl)
    print(f"rla measure: {reason}")
    return 0 if passed else GATE_FAILED


def cmd_where(args) -> int:
    spec, modes, out, ids = checked_input(args, {"--sequences": args.sequences, "--max-tokens": args.max_tokens},
                                          "where.csv, where.json and where.png")
    ids = ids[: args.sequences]
    check_room(ids, args.max_tokens, default_context(spec))  # everything checked: engines start from here
    table = where.parting(spec.path, ids, modes, n=len(ids), max_tokens=args.max_tokens, seed=args.seed,
                          cache_dir=Path(args.cache) if args.cache else None)
    firsts = where.first_parting(table)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(model=args.model, prompts=args.prompts, sequences=len(ids), modes=list(modes),
                  max_tokens=args.max_tokens, seed=args.seed, first=[where.describe_first(r) for _, r in firsts.iterrows()])
    save_table(table, "where", params, out)
    save_figure(where.figure(table), "where", out)  # where.png and where.svg
    print(f"{spec.path.name}: where each training side first parts from vLLM (code: rounding read from the engine's code; "
          f"values: every op teacher-forced on {len(ids)} sequences)\n")
    print("\n".join(params["first"]) + f"\n\nwritten: {out / 'where.csv'}, {out / 'where.json'}, {out / 'where.png'}")
    return 0


def gate_sides(args) -> list[str]:
    return [*mismatch_report.SIDES, *([] if args.no_engine_aligned else [mismatch_report.ENGINE_ALIGNED])]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rla", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the machine record (CPU, instruction-set level, kernels, versions)")
    env.add_argument("--json", action="store_true", help="the whole record as JSON")
    env.set_defaults(run=cmd_env)
    sch = sub.add_parser("schedule", help="read a running engine's rounding schedule and write it as JSON")
    sch.add_argument("--model", required=True, help="an embedded model name or a Qwen2/Qwen3 checkpoint directory")
    sch.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    sch.add_argument("--out", required=True, help="the schedule file to write (align_to_engine(model, FILE) reads it)")
    sch.add_argument("--probe-sequences", type=int, default=64, help="task prompts the attention probe scores")
    sch.add_argument("--force", action="store_true", help="capture the engine's code again instead of the cached one")
    sch.set_defaults(run=cmd_schedule)
    inputs = argparse.ArgumentParser(add_help=False)  # what measure and where both read
    inputs.add_argument("--model", required=True, help="an embedded model name or a Qwen2/Qwen3 checkpoint directory")
    inputs.add_argument("--prompts", required=True, help='JSON lines: "text", {"prompt": text} or {"messages": [...]}')
    inputs.add_argument("--max-tokens", type=int, default=32, help="most tokens per response")
    inputs.add_argument("--seed", type=int, default=0)
    mea = sub.add_parser("measure", parents=[inputs],
                         help="the mismatch of stock, the paper's regions and engine-aligned on your prompts")
    mea.add_argument("--modes", default="compiled,eager", help="vLLM modes, comma-separated (the first samples)")
    mea.add_argument("--samples", type=int, default=2, help="responses per prompt")
    mea.add_argument("--temperature", type=float, default=1.0, help="sample (and score every side) at this temperature")
    mea.add_argument("--top-p", type=float, default=1.0, help="nucleus truncation as your sampler runs it; the report "
                     "shows what the sampler's truncated logprobs add to the gap a trainer sees")
    mea.add_argument("--top-k", type=int, default=0, help="top-k truncation as your sampler runs it (0: none)")
    mea.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples of prompts per interval")
    mea.add_argument("--out", required=True, help="folder for measure.csv and measure.json (made if missing)")
    mea.add_argument("--no-engine-aligned", action="store_true", help="leave out the engine-aligned side (no schedule read)")
    mea.add_argument("--cache", default=str(RESULTS_DIR / "mismatch"), help="scores kept here; a rerun scores only what is missing")
    mea.add_argument("--no-cache", action="store_true", help="keep nothing between runs")
    mea.add_argument("--quiet", action="store_true", help="no progress bars")
    mea.add_argument("--max-kl", type=float, help=f"a CI gate: exit {GATE_FAILED} when the gated side's KL (nats per token, "
                     "exact where measured, else k3) exceeds this in any mode")
    mea.add_argument("--report", help="also write a self-contained HTML page: the table, the advice and every response's "
                     "tokens coloured by their logprob difference per training side")
    mea.add_argument("--gate-side", default=mismatch_report.ENGINE_ALIGNED,
                     help="the training side --max-kl checks (default: engine-aligned; e.g. 'stock BF16')")
    mea.set_defaults(run=cmd_measure)
    whe = sub.add_parser("where", parents=[inputs],
                         help="the first layer and rounding point where each training side parts from vLLM")
    whe.add_argument("--modes", default="compiled,eager", help="vLLM modes, comma-separated (values: eager only)")
    whe.add_argument("--sequences", type=int, default=8, help="the first prompts, one response each, compared op by op")
    whe.add_argument("--out", required=True, help="folder for where.csv, where.json and where.png (made if missing)")
    whe.add_argument("--cache", help="keep the engine's op values here (default: results/op_check)")
    whe.set_defaults(run=cmd_where)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"rla {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
