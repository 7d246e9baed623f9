import random

import numpy as np

import pytest

from rla_lib import task
from rla_lib.tokenizer import VOCAB, build_tokenizer


def test_problem_solution_and_reward():
    p = task.Problem((47, 385, 9))
    assert p.prompt == "47+385+9="
    assert p.solution == "432 441"
    assert p.answer == 441
    assert task.reward(p, "432 441") == 1.0
    assert task.reward(p, " 432 441 ") == 1.0
    assert task.reward(p, "441 432") == 0.0  # the last number is the answer
    assert task.reward(p, "") == 0.0
    assert task.reward(p, "432 44") == 0.0
    assert task.reward(p, "432 4+41") == 0.0


def test_splits_are_reproducible_and_in_range():
    a, b = task.make_split(7, 200), task.make_split(7, 200)
    assert a == b and a != task.make_split(8, 200)
    cfg = task.TaskConfig()
    for p in a:
        assert cfg.min_terms <= len(p.terms) <= cfg.max_terms
        assert all(0 <= t < 10**cfg.max_digits for t in p.terms)
        assert task.reward(p, p.solution) == 1.0


def test_shipped_eval_split_matches_generator():
    shipped = task.load_split()
    assert shipped == task.make_split(task.EVAL_SPLIT_SEED, task.EVAL_SPLIT_SIZE)


def test_save_load_roundtrip(tmp_path):
    probs = task.make_split(1, 10)
    task.save_split(probs, tmp_path / "x.jsonl")
    assert task.load_split(tmp_path / "x.jsonl") == probs
    with pytest.raises(FileNotFoundError, match="make models"):
        task.load_split(tmp_path / "missing.jsonl")


def test_tokenizer_round_trip_one_token_per_char():
    tok = build_tokenizer()
    rng = random.Random(0)
    for _ in range(100):
        p = task.sample_problem(rng)
        text = p.prompt + p.solution
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.eos_token_id == VOCAB.index("<|endoftext|>") == tok.pad_token_id
    assert len(tok) == len(VOCAB)


def test_shipped_tokenizer_matches_builder():
    from rla_lib.models import load_tokenizer

    shipped, built = load_tokenizer("qwen3-tiny"), build_tokenizer()
    text = "12+3=15 99"
    assert shipped.encode(text) == built.encode(text)
    assert shipped.decode(shipped.encode(text) + [shipped.eos_token_id], skip_special_tokens=True) == text



def test_long_answer_variant_writes_every_addition():
    p = task.Problem((47, 38, 9), "steps")
    assert p.prompt == "47+38+9=" and p.solution == "47+38=85 85+9=94" and p.answer == 94
    assert task.reward(p, p.solution) == 1.0
    assert task.reward(p, "47+38=85 85+9=95") == 0.0
    assert task.reward(p, "47+38=85 94") == 1.0  # the last number is the answer, as in the short format
    assert task.reward(task.Problem((47, 38, 9)), "47+38=85 85+9=94") == 0.0  # the short format has no "="
    problems = task.make_split(3, 300, task.TASKS["steps"])
    lengths = [len(p.solution) + 1 for p in problems]  # one token per character, plus end-of-text
    assert 30 <= min(lengths) and max(lengths) <= 100 and 50 <= np.median(lengths) <= 80
    assert all(p.format == "steps" and task.reward(p, p.solution) == 1.0 for p in problems)
    with pytest.raises(ValueError, match="format"):
        task.TaskConfig(format="words")


def test_shipped_long_answer_split_matches_generator():
    shipped = task.load_split(task.eval_split_path("steps"))
    assert shipped == task.make_split(task.EVAL_SPLIT_SEED, task.EVAL_SPLIT_SIZE, task.TASKS["steps"])
