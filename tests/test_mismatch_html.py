"""`rla measure --report`: the page holds the table, the advice and every response token once, coloured per comparison;
in the browser (tests/test_browser.py) every token is painted and the worst prompts come first on a click."""

import html
import json
import re

import numpy as np
import pytest

from rla_lib import mismatch_html, mismatch_report, sides
from rla_lib.mismatch_run import MismatchRun
from rla_lib.models import load_tokenizer

MODE = "eager"


def synthetic_run(seed: int = 0, duplicate_first: bool = False) -> MismatchRun:
    """Four prompts x two responses of the embedded tokenizer's digits, every training side scored: stock off by
    noise that grows with the prompt, engine-aligned bit for bit the engine. `duplicate_first`: the first prompt's two
    responses the same improbable answer (each token's engine logprob -4)."""
    rng = np.random.default_rng(seed)
    tok = load_tokenizer("qwen3-tiny")
    prompts = ["1+2=", "30+4=", "5+6+7=", "80+9="]
    sequences, starts, prompt_of = [], [], []
    for k, text in enumerate(prompts):
        ids = tok.encode(text)
        for j in range(2):
            answer = sequences[-1][len(ids):] if duplicate_first and k == 0 and j == 1 else tok.encode(str(rng.integers(10, 999)))
            sequences.append(ids + answer)
            starts.append(len(ids) - 1)
            prompt_of.append(k)
    run = MismatchRun(sequences, starts, rewards=np.zeros(len(sequences)), prompts=prompt_of)
    n = int(run.lengths.sum())
    token_prompt = np.repeat(prompt_of, run.lengths)
    engine = -rng.random(n).astype(np.float32)
    if duplicate_first:
        engine[: run.offsets[2]] = -4.0
    run.token_lp[sides.engine(MODE)] = engine
    for label, config in mismatch_report.SIDES.items():
        noise = rng.normal(0, 1e-3, n) * (token_prompt + 1)  # prompt 4 the worst
        run.token_lp[sides.training(config)] = (engine + noise).astype(np.float32)
    run.token_lp[sides.training(mismatch_report.engine_config(MODE))] = engine.copy()
    return run


def report(tmp_path=None):
    run = synthetic_run()
    df = mismatch_report.summary(run, [MODE], n_boot=50)
    text = mismatch_html.page(run, df, mismatch_report.advice(df), [MODE], load_tokenizer("qwen3-tiny"), "a <test> run")
    if tmp_path is not None:
        (tmp_path / "report.html").write_text(text)
    return run, df, text


def test_the_page_holds_every_token_once_and_each_comparison():
    run, df, text = report()
    assert len(re.findall(r'<span class="tok" data-i="\d+">', text)) == int(run.lengths.sum())
    assert "a &lt;test&gt; run" in text and "<test>" not in text  # escaped
    data = json.loads(re.search(r"<script type='application/json' id='diffs'>(.*?)</script>", text, re.S).group(1))
    keys = [f"vLLM {MODE} vs {label}" for label in [*mismatch_report.SIDES, mismatch_report.ENGINE_ALIGNED]]
    assert list(data["comparisons"]) == keys
    aligned = data["comparisons"][f"vLLM {MODE} vs {mismatch_report.ENGINE_ALIGNED}"]
    assert set(aligned["diff"]) == {0.0} and aligned["worst"] == [0.0] * 4
    stock = data["comparisons"][f"vLLM {MODE} vs stock BF16"]
    d = run.token_lp[sides.engine(MODE)].astype(np.float64) - run.token_lp[sides.training("none")].astype(np.float64)
    assert stock["diff"] == d.tolist() and stock["scale"] == np.abs(d).max()
    assert all(mismatch_report.row_cells(r)[1] in text for _, r in df.iterrows())
    assert all(f"<li>{html.escape(line)}</li>" in text for line in mismatch_report.advice(df))


def test_rla_measure_names_what_only_masquerades_as_mismatch():
    """`masquerade_lines` on a measurement: quiet on a clean one; a line per mode on one whose engine logprobs hold
    placeholder zeros, or whose two responses to a prompt repeat an answer the engine gives little probability (a seed
    reused for both)."""
    run = synthetic_run()
    assert mismatch_report.masquerade_lines(run, [MODE], group_size=2) == []
    engine = run.token_lp[sides.engine(MODE)]
    engine[:3] = 0.0  # the trainer gives these tokens under 99%: placeholders
    assert mismatch_report.masquerade_lines(run, [MODE], group_size=2) == [
        f"vLLM {MODE}: not rounding: 3 of {len(engine)} response tokens have an engine logprob of exactly 0 where the "
        "trainer gives them under 99%: placeholder logprobs (padding or masked positions filled with 0?), not rounding"]
    run = synthetic_run(duplicate_first=True)
    (line,) = mismatch_report.masquerade_lines(run, [MODE], group_size=2)
    assert line.startswith(f"vLLM {MODE}: not rounding: 1 of 4 groups hold 2 identical responses")
