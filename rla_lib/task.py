"""The task with verifiable answers: multi-term addition written as running sums.

    prompt:   "47+385+9="
    response: "432 441"          (each partial sum, the last one is the answer)

The running sums make responses several tokens long (so per-token mismatch can add up
over a response), and the reward is exact: 1.0 if the last number of the response is
the true sum, else 0.0. Problems come from a seeded generator, so every split is
reproducible; the held-out split ships as ``data/task/eval.jsonl``.
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


@dataclass(frozen=True)
class TaskConfig:
    min_terms: int = 2
    max_terms: int = 4
    max_digits: int = 2


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.terms)) + "="

    @property
    def answer(self) -> int:
        return sum(self.terms)

    @property
    def solution(self) -> str:
        """The reference response: running sums after the first term."""
        sums, total = [], self.terms[0]
        for t in self.terms[1:]:
            total += t
            sums.append(str(total))
        return " ".join(sums)


def sample_problem(rng: random.Random, config: TaskConfig = TaskConfig()) -> Problem:
    n_terms = rng.randint(config.min_terms, config.max_terms)
    # Draw the digit count first so short and long numbers are equally common.
    terms = []
    for _ in range(n_terms):
        digits = rng.randint(1, config.max_digits)
        terms.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    return Problem(tuple(terms))


def make_split(seed: int, size: int, config: TaskConfig = TaskConfig()) -> list[Problem]:
    rng = random.Random(seed)
    return [sample_problem(rng, config) for _ in range(size)]


def reward(problem: Problem, response: str) -> float:
    """1.0 if the response's last number is the correct sum, else 0.0."""
    words = response.strip().split(" ")
    return float(bool(words) and words[-1].isdigit() and int(words[-1]) == problem.answer)


def save_split(problems: list[Problem], path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text("".join(json.dumps(asdict(p)) + "\n" for p in problems)))


def load_split(path: Path = EVAL_SPLIT_PATH) -> list[Problem]:
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} is missing; regenerate it with `make models`.")
    return [Problem(tuple(json.loads(line)["terms"])) for line in Path(path).read_text().splitlines()]
