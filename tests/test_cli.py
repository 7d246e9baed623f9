"""The `rla` command (rla_lib.cli): the machine record, a running engine's schedule written for align_to_engine, and
bad input refused before any engine starts."""

import json
import re

import numpy as np
import pandas as pd
import pytest

from rla_lib import cli, engine_align, mismatch_report
from rla_lib.engine_align import align_to_engine, exactness, kernel_numerics
from rla_lib.graphs import captures
from rla_lib.machine import describe, machine, vllm_cpu_attention_kernel
from rla_lib.models import load_model, load_tokenizer
from rla_lib.mismatch_run import MismatchRun
from test_engine_align import MEASURED_EXACT
from test_notebooks import engine_starts_of_this_test
from test_prompts import with_chat_template


def test_env_prints_the_machine_record(capsys):
    assert cli.main(["env"]) == 0
    assert capsys.readouterr().out.strip() == describe()
    assert cli.main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(machine()))


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/ckpt"], "not an embedded model"),
    (["--model", "qwen3-tiny", "--out", "/nonexistent/folder/s.json"], "the folder /nonexistent/folder does not exist"),
])
def test_schedule_refuses_bad_input_before_an_engine_starts(monkeypatch, capsys, args, message):
    monkeypatch.setattr(engine_align, "Engine", None)  # any engine start would fail loudly
    argv = ["schedule", "--out", "s.json", *args] if "--out" not in args else ["schedule", *args]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("env", "schedule", "measure"))


@pytest.mark.engine
def test_schedule_of_a_running_engine_is_what_align_to_engine_applies(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(captures, "GRAPHS_DIR", tmp_path / "graphs")  # no capture yet: the command makes one
    out = tmp_path / "schedule.json"
    with engine_starts_of_this_test(tmp_path, monkeypatch) as starts:
        assert cli.main(["schedule", "--model", "qwen3-tiny", "--out", str(out), "--probe-sequences", "8"]) == 0
    # its engine makes the capture its schedule is read from as it starts: no engine of the capture's own
    assert [start["mode"] for start in starts] == ["compiled"], starts
    assert (captures.capture_dir("qwen3-tiny", "vllm", "compiled") / "capture.json").exists()
    printed = capsys.readouterr().out
    sched = json.loads(out.read_text())
    assert sched["engine"] == "vllm:compiled" and "attention" in sched
    if kernel_numerics():  # vLLM-CPU on x86: the kernel's numerics, and the probe's verdict printed
        assert sched["attention"]["numerics"] == kernel_numerics() and exactness(sched) in printed
    handle = align_to_engine(load_model("qwen3-tiny"), out)
    assert handle.engine_schedule == sched
    handle.undo()


def chat_prompts(tmp_path, n: int):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+{2 * i + 1}"}]}) + "\n"
                            for i in range(n)))
    return path


@pytest.mark.parametrize("case, message", [
    ("no model", "not an embedded model"),
    ("no prompt file", "does not exist: give a JSON-lines file"),
    ("bad line", ":2: not JSON"),
    ("chat without a template", "has no chat template"),
    ("too long", "does not fit the engine's context of 64"),
    ("bad mode", "a comma-separated list of compiled, eager"),
    ("out is a file", "is a file: give a folder"),
    ("report not html", "an .html file in an existing folder"),
    ("negative gate", "--max-kl -1.0: a KL in nats per token, 0 or more"),
    ("unknown gate side", "--gate-side 'nope': one of 'stock BF16'"),
    ("top-p out of range", "top_p must be in (0, 1]"),
    ("negative top-k", "top_k must be a whole number >= 0"),
    ("greedy", "--temperature 0.0: a temperature above 0"),
])
def test_measure_refuses_bad_input_before_an_engine_starts(monkeypatch, capsys, tmp_path, case, message):
    monkeypatch.setattr(mismatch_report, "engine_schedule_from_code", None)  # any engine start would fail loudly
    monkeypatch.setattr(cli, "measure", None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text({"bad line": '"1+2="\n1+2=\n', "too long": json.dumps("1" * 40) + "\n"}.get(case, '"1+2="\n'))
    args = {"model": "qwen3-tiny", "prompts": str(prompts), "out": str(tmp_path / "out"), "modes": "compiled"}
    args |= {"no model": {"model": "/nonexistent/ckpt"}, "no prompt file": {"prompts": str(tmp_path / "none.jsonl")},
             "chat without a template": {"prompts": str(chat_prompts(tmp_path, 2))}, "bad mode": {"modes": "compiled,fast"},
             "out is a file": {"out": str(prompts)}, "negative gate": {"max-kl": "-1"},
             "report not html": {"report": str(tmp_path / "report.txt")},
             "unknown gate side": {"max-kl": "1e-4", "gate-side": "nope"}, "top-p out of range": {"top-p": "1.5"},
             "negative top-k": {"top-k": "-2"}, "greedy": {"temperature": "0"}}.get(case, {})
    assert cli.main(["measure", *[x for k, v in args.items() for x in (f"--{k}", v)]]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.engine
def test_measure_on_chat_prompts_of_a_checkpoint_with_a_template(tmp_path, capsys):
    """`rla measure` end to end on a checkpoint whose tokenizer has a chat template: every side scored on the same
    sampled tokens, written and printed, the advice computed from the rows; the engine-aligned side bit for bit
    where the engine's kernels were measured exact."""
    model = with_chat_template(tmp_path)
    prompts = chat_prompts(tmp_path, 8)
    out = tmp_path / "out"
    argv = ["measure", "--model", str(model), "--prompts", str(prompts), "--modes", "eager", "--samples", "2",
            "--max-tokens", "12", "--out", str(out), "--cache", str(tmp_path / "cache"), "--quiet", "--n-boot", "200"]
    assert cli.main([*argv, "--report", str(out / "report.html")]) == 0
    printed = capsys.readouterr().out
    df = pd.read_csv(out / "measure.csv")
    meta = json.loads((out / "measure.json").read_text())
    assert list(df["training side"]) == [*mismatch_report.SIDES, mismatch_report.ENGINE_ALIGNED]
    assert (df["prompts"] == 8).all() and df["tokens"].nunique() == 1 and meta["params"]["n_prompts"] == 8
    assert mismatch_report.text_table(df) in printed and all(line in printed for line in meta["params"]["advice"])
    assert meta["params"]["advice"] == mismatch_report.advice(df)
    assert (df["exact ci_low"] <= df["exact"]).all() and (df["exact"] <= df["exact ci_high"]).all()
    page = (out / "report.html").read_text()  # every response token once, each comparison's differences beside them
    assert page.count('<span class="tok"') == df["tokens"].iloc[0] and f"{out / 'report.html'}" in printed
    engine_aligned = df.set_index("training side").loc[mismatch_report.ENGINE_ALIGNED]
    if vllm_cpu_attention_kernel() in MEASURED_EXACT:
        assert engine_aligned["bitwise"] == 1 and engine_aligned["exact"] == 0, describe()
        assert "use engine-aligned" in meta["params"]["advice"][0]
    # as a CI gate on the same scores (cached): stock BF16's largest KL passes a threshold above it, fails one below
    stock = df[df["training side"] == "stock BF16"]["exact"].max()
    assert stock > 0
    gated = [*argv, "--gate-side", "stock BF16", "--max-kl"]
    assert cli.main([*gated, f"{stock * 1.01:.6g}"]) == 0 and "rla measure: PASS: stock BF16" in capsys.readouterr().out
    assert cli.main([*gated, f"{stock * 0.99:.6g}"]) == cli.GATE_FAILED
    assert "rla measure: FAIL: stock BF16 vs vLLM eager: exact KL" in capsys.readouterr().out
    # the engine answered the template's rendering of each chat (it ends in the "=" the template adds)
    run = MismatchRun.load(next((tmp_path / "cache").glob("*/samples.npz")))
    tokenizer = load_tokenizer(model)
    for sequence, start, prompt in zip(run.sequences, run.starts, run.prompts):
        assert tokenizer.decode(sequence[:start + 1]) == f"{prompt}+{2 * prompt + 1}="


def test_the_printed_table_shows_no_interval_of_zero_width():
    """Where every prompt is alike (no token bitwise, every token bitwise, KL 0 everywhere) the table says so with the
    exact bound, never "0.0% [0.0%, 0.0%]"."""
    row = dict(mode="eager", tokens=96, prompts=8, sampled=2e-4, k3=1e-4, exact=0.0, change=float("nan"),
               **{"change by": "exact", "sampled ci_low": 1e-4, "sampled ci_high": 3e-4, "k3 ci_low": 5e-5,
                  "k3 ci_high": 2e-4, "exact ci_low": 0.0, "exact ci_high": 0.0})
    stock = row | {"training side": "stock BF16", "bitwise": 0.0, "bitwise ci_low": 0.0, "bitwise ci_high": 0.0,
                   "k3": 3e-4, "k3 ci_low": 3e-4, "k3 ci_high": 3e-4}
    aligned = row | {"training side": mismatch_report.ENGINE_ALIGNED, "bitwise": 1.0, "bitwise ci_low": 1.0,
                     "bitwise ci_high": 1.0}
    printed = mismatch_report.text_table(pd.DataFrame([stock, aligned]))
    assert not re.search(r"\[([-+\d.e%]+), \1\]", printed), printed
    assert "none of 96 tokens of 8 prompts (prompt share <=" in printed and "all 96 tokens of 8 prompts" in printed
    assert "0 on all 96 tokens" in printed and "alike on every prompt" in printed


def test_the_ci_gate_passes_and_fails_on_either_side_of_its_threshold():
    """`mismatch_report.gate`: the gated side's KL in every mode against the threshold, exact KL where measured, else
    k3; one line saying which mode failed and by how much."""
    def row(mode, side, exact, k3=2e-4):
        return {"mode": mode, "training side": side, "exact": exact, "exact ci_low": exact / 2, "exact ci_high": exact * 2,
                "k3": k3, "k3 ci_low": k3 / 2, "k3 ci_high": k3 * 2}

    df = pd.DataFrame([row("compiled", "stock BF16", 1e-4), row("eager", "stock BF16", 3e-4),
                       row("compiled", mismatch_report.ENGINE_ALIGNED, 0.0)])
    passed, line = mismatch_report.gate(df, "stock BF16", 5e-4)
    assert passed and line.startswith("PASS: stock BF16 vs vLLM eager: exact KL 0.0003 [0.00015, 0.0006]")
    passed, line = mismatch_report.gate(df, "stock BF16", 2e-4)
    assert not passed and line == "FAIL: stock BF16 vs vLLM eager: exact KL 0.0003 [0.00015, 0.0006] nats per token > --max-kl 0.0002"
    passed, line = mismatch_report.gate(df, mismatch_report.ENGINE_ALIGNED, 0.0)  # 0 <= 0: an exact side passes a zero gate
    assert passed and "exact KL 0 nats per token (0 on every token)" in line and "[0, 0]" not in line  # no zero-width interval
    no_exact = pd.DataFrame([row("compiled", "stock BF16", float("nan"), k3=4e-4)])
    assert mismatch_report.gate(no_exact, "stock BF16", 1e-4) == (
        False, "FAIL: stock BF16 vs vLLM compiled: k3 0.0004 [0.0002, 0.0008] nats per token > --max-kl 0.0001")
    with pytest.raises(ValueError, match="no training side 'RoPE only'"):
        mismatch_report.gate(df, "RoPE only", 1e-4)


@pytest.mark.parametrize("case, message", [
    ("no model", "not an embedded model"),
    ("no prompt file", "does not exist: give a JSON-lines file"),
    ("no sequences", "--sequences and --max-tokens must be at least 1"),
    ("bad mode", "a comma-separated list of compiled, eager"),
])
def test_where_refuses_bad_input_before_an_engine_starts(monkeypatch, capsys, tmp_path, case, message):
    monkeypatch.setattr(cli.where, "parting", None)  # any measurement would fail loudly
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"1+2="\n')
    args = {"model": "qwen3-tiny", "prompts": str(prompts), "out": str(tmp_path / "out")}
    args |= {"no model": {"model": "/nonexistent/ckpt"}, "no prompt file": {"prompts": str(tmp_path / "none.jsonl")},
             "no sequences": {"sequences": "0"}, "bad mode": {"modes": "jit"}}[case]
    assert cli.main(["where", *[x for k, v in args.items() for x in (f"--{k}", v)]]) == 2
    assert message in capsys.readouterr().err


def test_the_first_parting_is_the_first_point_in_the_forwards_order():
    """`where.first_parting` takes the rows as the forward computes them: the first that differs, or none."""
    rows = [dict(mode="eager", side=side, reading="values", layer=layer, point=point, differing=d, elements=10,
                 share_differing=d / 10, max_abs_diff=0.5 * d)
            for side, diffs in (("stock BF16", (0, 3, 1)), ("engine-aligned", (0, 0, 0)))
            for (layer, point), d in zip((("0", "input_norm"), ("0", "attention"), ("1", "input_norm")), diffs)]
    firsts = cli.where.first_parting(pd.DataFrame(rows)).set_index("side")
    assert firsts.loc["stock BF16", ["layer", "point", "parted", "points"]].tolist() == ["0", "attention", 2, 3]
    assert firsts.loc["stock BF16", "share_differing"] == 0.3 and pd.isna(firsts.loc["engine-aligned", "layer"])
    lines = [cli.where.describe_first(r) for _, r in firsts.reset_index().iterrows()]
    assert lines == ["stock BF16 vs vLLM eager (values): first parts at layer 0, attention (30.0% of its elements "
                     "differ, by up to 1.5); 2 of 3 points read part",
                     "engine-aligned vs vLLM eager (values): follows the engine at all 3 points read"]


@pytest.mark.engine
@pytest.mark.parametrize("checkpoint", ["qwen3-tiny", "narrow"])
def test_where_finds_the_first_parting_of_stock_and_none_for_engine_aligned(checkpoint, tmp_path, capsys, request,
                                                                            monkeypatch):
    """`rla where` on a checkpoint with a chat template and chat prompts, the embedded qwen3-tiny and one of another
    configuration (the narrow full-vocabulary checkpoint: 2 layers, 1 KV head, a 151,936-token vocabulary): stock BF16
    parts from the engine at some (layer, point) in every mode and reading; engine-aligned at none read from the code,
    and at none of the ops teacher-forced where the engine's kernels were measured exact. The narrow checkpoint is read
    in eager mode only: compiling a new shape for the compiled reading takes minutes on a cold cache. The eager graph
    capture is made by the values reading's engine (one start for both), never by an engine of its own."""
    from rla_lib.graphs import captures

    own_capture = captures._capture

    def no_eager_engine_of_its_own(model, mode, engine, *args):
        assert (engine, mode) != ("vllm", "eager"), "an engine started for the eager graph capture alone"
        return own_capture(model, mode, engine, *args)

    monkeypatch.setattr(captures, "_capture", no_eager_engine_of_its_own)
    model = with_chat_template(tmp_path, "qwen3-tiny" if checkpoint == "qwen3-tiny" else request.getfixturevalue("narrow_model"))
    out, modes = tmp_path / "out", ("compiled", "eager") if checkpoint == "qwen3-tiny" else ("eager",)
    argv = ["where", "--model", str(model), "--prompts", str(chat_prompts(tmp_path, 4)), "--sequences", "3",
            "--max-tokens", "12", "--out", str(out), "--cache", str(tmp_path / "cache"), "--modes", ",".join(modes)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    table = pd.read_csv(out / "where.csv", dtype={"layer": str})
    firsts = cli.where.first_parting(table).set_index(["side", "mode", "reading"]).sort_index()
    readings = [(mode, reading) for mode, reading in (("compiled", "code"), ("eager", "code"), ("eager", "values"))
                if mode in modes]
    assert sorted(firsts.index) == sorted((side, mode, reading) for side in cli.where.SIDES for mode, reading in readings)
    assert (firsts.loc["stock BF16", "parted"] > 0).all()
    assert (firsts.loc[(mismatch_report.ENGINE_ALIGNED, slice(None), "code"), "parted"] == 0).all()
    if vllm_cpu_attention_kernel() in MEASURED_EXACT:
        assert firsts.loc[(mismatch_report.ENGINE_ALIGNED, "eager", "values"), "parted"] == 0, describe()
    values = table[table["reading"] == "values"]
    assert (values["elements"] > 0).all() and (values["differing"] <= values["elements"]).all()
    assert all(cli.where.describe_first(r) in printed for _, r in firsts.reset_index().iterrows())
    assert (out / "where.png").stat().st_size > 0 and json.loads((out / "where.json").read_text())["params"]["sequences"] == 3


def test_the_truncation_line_splits_the_gap_a_trainer_sees_into_truncation_and_the_rest():
    """By hand on a constructed run: the sampler's logprobs sit above the re-scored ones by the truncation; k1 is linear,
    so stock's gap against the sampler is its gap against the full distribution plus that. No line without truncation,
    and the masquerade checks read the re-scored logprobs, which truncation does not touch."""
    from rla_lib import sides

    gen = np.random.default_rng(0)
    n_prompts, length = 16, 40
    sequences = [[1, 2] + list(gen.integers(3, 50, length)) for _ in range(2 * n_prompts)]
    run = MismatchRun(sequences, [1] * len(sequences), np.full(len(sequences), np.nan), np.repeat(np.arange(n_prompts), 2))
    tokens = len(sequences) * length
    stock = -gen.exponential(1.0, tokens)
    rescored = stock + gen.normal(0, 1e-3, tokens)  # rounding: small, both signs
    removed = gen.uniform(0.0, 0.2, tokens)  # the mass top_p cut at each position
    run.token_lp = {sides.STOCK: stock.astype(np.float32), sides.engine("eager"): rescored.astype(np.float32),
                    sides.sampled("eager"): (rescored - np.log1p(-removed)).astype(np.float32)}
    assert mismatch_report.sampling_lines(run, ("eager",), n_boot=200) == []  # nothing truncated: nothing to say
    run.meta = {"top_p": 0.9}
    (line,) = mismatch_report.sampling_lines(run, ("eager",), n_boot=200)
    by_hand = [np.mean(a - b) for a, b in [(run.token_lp[sides.sampled("eager")], run.token_lp[sides.engine("eager")]),
                                          (run.token_lp[sides.sampled("eager")], stock.astype(np.float32)),
                                          (run.token_lp[sides.engine("eager")], stock.astype(np.float32))]]
    numbers = [float(x) for x in re.findall(r"(-?[\d.]+(?:e-?\d+)?) \[", line)]
    assert line.startswith("Sampled with top_p 0.9") and numbers == pytest.approx(by_hand, rel=2e-3)
    assert by_hand[1] == pytest.approx(by_hand[2] + by_hand[0], rel=1e-4)
    assert mismatch_report.masquerade_lines(run, ("eager",), 2) == []  # re-scored: nothing masquerades; truncation is said above
