"""The `rla` command (rla_lib.cli): the machine record, a running engine's schedule written for align_to_engine, and
bad input refused before any engine starts."""

import json

import pytest

from rla_lib import cli
from rla_lib.engine_align import align_to_engine, exactness, kernel_numerics
from rla_lib.machine import describe, machine
from rla_lib.models import load_model


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
    monkeypatch.setattr(cli, "Engine", None)  # any engine start would fail loudly
    argv = ["schedule", "--out", "s.json", *args] if "--out" not in args else ["schedule", *args]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("env", "schedule"))


@pytest.mark.engine
def test_schedule_of_a_running_engine_is_what_align_to_engine_applies(compiled_engine, monkeypatch, tmp_path, capsys):
    class Borrowed:  # the session's compiled engine, not closed on exit (it is shared)
        def __init__(self, model, mode):
            assert mode == "compiled" and str(model) == str(compiled_engine.spec.path)

        def __enter__(self):
            return compiled_engine

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cli, "Engine", Borrowed)
    out = tmp_path / "schedule.json"
    assert cli.main(["schedule", "--model", "qwen3-tiny", "--out", str(out), "--probe-sequences", "8"]) == 0
    printed = capsys.readouterr().out
    sched = json.loads(out.read_text())
    assert sched["engine"] == "vllm:compiled" and "attention" in sched
    if kernel_numerics():  # vLLM-CPU on x86: the kernel's numerics, and the probe's verdict printed
        assert sched["attention"]["numerics"] == kernel_numerics() and exactness(sched) in printed
    handle = align_to_engine(load_model("qwen3-tiny"), out)
    assert handle.schedule == sched
    handle.undo()
