"""The task with verifiable answers: multi-term addition written as running sums.

    prompt:   "47+385+9="
    response: "432 441"          (each partial sum, the last one is the answer)

The running sums make responses several tokens long (so per-token mismatch can add up
over a response), and the reward is exact: 1.0 if the last number of the response is
the true sum, else 0.0. Problems come from a seeded generator, so every split is
reproducible; the held-out split ships as ``data/task/eval.jsonl``.

A second variant, ``"steps"`` (`TASKS`), has long answers: 6-10 terms, every addition written out,

    prompt:   "47+38+9+60+5+12="
    response: "47+38=85 85+9=94 94+60=154 154+5=159 159+12=171"

45-100 response tokens, so the mismatch summed over a response grows with its length as it does at
scale. Its held-out split is ``data/task/eval-steps.jsonl``; ``qwen3-tiny-steps`` is trained on it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from .paths import DATA_DIR, atomic_write

EVAL_SPLIT_PATH = DATA_DIR / "task" / "eval.jsonl"
EVAL_SPLIT_SEED = 20261129
EVAL_SPLIT_SIZE = 512
FORMATS = ("sums", "steps")


@dataclass(frozen=True)
class TaskConfig:
    min_terms: int = 2
    max_terms: int = 4
    max_digits: int = 2
    format: str = "sums"  # "sums": the running sums; "steps": every addition written out ("a+b=c c+d=e ...")

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")


# The task variants by name: the short default and the long-answer one (`GRPOConfig.task`, `rla_lib.pretrain`).
TASKS = {"sums": TaskConfig(), "steps": TaskConfig(min_terms=6, max_terms=10, max_digits=2, format="steps")}


def eval_split_path(name: str = "sums") -> Path:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {list(TASKS)}")
    return EVAL_SPLIT_PATH if name == "sums" else EVAL_SPLIT_PATH.with_name(f"eval-{name}.jsonl")


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]
    format: str = "sums"

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.terms)) + "="

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def solution(self) -> str:
        """The reference response: the running sums after the first term ("sums"), or each addition ("steps")."""
        words, total = [], self.terms[0]
        for t in self.terms[1:]:
            words.append(f"{total}+{t}={total + t}" if self.format == "steps" else str(total + t))
            total += t
        return " ".join(words)


def sample_problem(rng: random.Random, config: TaskConfig = TaskConfig()) -> Problem:
    n_terms = rng.randint(config.min_terms, config.max_terms)
    # Draw the digit count first so short and long numbers are equally common.
    terms = []
    for _ in range(n_terms):
        digits = rng.randint(1, config.max_digits)
        terms.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    return Problem(tuple(terms), config.format)


def make_split(seed: int, size: int, config: TaskConfig = TaskConfig()) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng, config) for _ in range(size)]


def reward(problem: Problem, response: str) -> float:
    """1.0 if the response's last number (after its last "=" in the "steps" format) is the correct sum, else 0.0."""
    last = response.strip().split(" ")[-1]
    if problem.format == "steps":
        last = last.rpartition("=")[2]
    return float(last.isdigit() and int(last) == problem.answer)


def save_split(problems: list[Problem], path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(asdict(p)) + "\n" for p in problems)))


def load_split(path: Path = EVAL_SPLIT_PATH) -> list[Problem]:
    """A saved split (the held-out one by default; `eval_split_path(name)` for a task variant's)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing; regenerate it with `make models`.")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [Problem(tuple(r["terms"]), r.get("format", "sums")) for r in rows]
