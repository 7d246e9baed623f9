"""The `rla` command: the library's one-call jobs from a shell.

    rla env                                                   # the machine record BF16 numbers depend on
    rla schedule --model DIR --mode compiled --out s.json     # the engine's rounding schedule, for align_to_engine

`rla schedule` starts the engine where it runs (a GPU machine, say), reads where it rounds, takes or probes its
attention numerics and writes the schedule; the trainer elsewhere applies it with `align_to_engine(model, "s.json")`.
It prints how exact the aligned training side was on the probe (`engine_align.exactness`). Bad input (no such model,
an architecture rla does not align, an output folder that does not exist) is refused before any engine starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .engine import Engine
from .engine_align import engine_schedule, exactness
from .graphs import save_schedule
from .machine import describe, machine
from .models import resolve_model


def cmd_env(args) -> int:
    print(json.dumps(machine(), indent=1) if args.json else describe())
    return 0


def cmd_schedule(args) -> int:
    spec = resolve_model(args.model)  # a missing or unsupported model fails here, before the engine
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: the folder {out.parent} does not exist; create it or choose another")
    with Engine(spec.path, mode=args.mode) as engine:
        sched = engine_schedule(engine, n_sequences=args.probe_sequences, force=args.force)
    save_schedule(sched, out)
    print(f"{out}: the rounding schedule of vLLM {args.mode} for {spec.path.name}; {exactness(sched)}")
    return 0


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
