"""GRPO under FSDP2 on 2 gloo processes against the single-process trainer (experiments/fsdp_grpo.py, issue 14).

The equivalence test runs the entry point under torchrun (25-30 s on 2 cores) with the clip off (max_grad_norm
inf): then FSDP2 must equal the single-process gradient accumulation over the ranks' rows bit for bit, and
one backward over the whole batch (grpo.Policy as it is) within the tolerances the script derives (see
`compare` there). A wrong launch must stop before training and leave no file behind.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from rla_lib import distributed
from rla_lib.models import load_model

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "fsdp_grpo.py"


HANG_GUARD_S = 600  # two processes importing torch and rla_lib and running 3 steps take 25-60 s on a loaded 2-core machine


def torchrun(nproc: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The entry point under torchrun. If it hangs, each worker's Python stack (faulthandler on SIGABRT) and kernel
    stack go into the failure, then the whole session is killed: a worker torchrun has lost (its parent gone) would
    otherwise hold the output pipes open and the test with them. Seen under load on a 2-core VM: a rank stuck in
    `sched_setaffinity` inside MKL's core count at `import torch` (it pins the process to each CPU in turn), the
    kernel not running it on the core a busy loop held."""
    import psutil

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT),
               "--table", str(tmp_path / "table.csv"), "--checkpoints", str(tmp_path / "checkpoints"), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    try:
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        workers = psutil.Process(proc.pid).children(recursive=True)
        kernel = "\n".join(f"pid {w.pid} kernel stack:\n{kernel_stack(w.pid)}" for w in workers)
        for worker in workers:
            worker.send_signal(signal.SIGABRT)  # faulthandler prints its stack
        time.sleep(5)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its workers and any worker it lost
        stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"torchrun hung for {HANG_GUARD_S} s; the workers' stacks:\n{stderr[-8000:]}\n"
                             f"{kernel}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


ROOT_CAUSE = re.compile(r"Fatal Python error|terminate called|what\(\):|Error:|Aborted|File \"")


def failure_of(stderr: str) -> str:
    """What a failed torchrun printed, for the assertion: the lines naming a root cause (a rank's fatal signal and
    its Python stack, an uncaught C++ exception, a Python error), which torchrun's own traceback pushes out of the
    tail, then the tail."""
    causes = [line for line in stderr.splitlines() if ROOT_CAUSE.search(line)]
    return "\n".join(causes[:60]) + "\n...\n" + stderr[-3000:]


def kernel_stack(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stack").read_text()
    except OSError as error:  # not Linux, or not allowed
        return f"(unreadable: {error})"


def launched_alone(tmp_path: Path, world_size: int, *args: str) -> subprocess.CompletedProcess:
    """The entry point as rank 0 of a torchrun launch of `world_size` processes would start it (torchrun's
    environment), in one process: a refusal that comes before any process group is joined needs no second worker."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    command = [sys.executable, str(SCRIPT), "--table", str(tmp_path / "table.csv"),
               "--checkpoints", str(tmp_path / "checkpoints"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)


def test_check_launch_says_what_to_change():
    distributed.check_launch(2, expected=2, global_rows=32)
    with pytest.raises(ValueError, match="set up for 2 processes but torchrun started 3.*--nproc_per_node 2"):
        distributed.check_launch(3, expected=2, global_rows=32)
    with pytest.raises(ValueError, match="32 rows does not split evenly over 3 processes"):
        distributed.check_launch(3, expected=3, global_rows=32)
    blocks = [distributed.local_rows(32, r, 4) for r in range(4)]
    assert [i for b in blocks for i in range(32)[b]] == list(range(32))


@pytest.mark.engine  # 10-20 s: a process importing torch and rla_lib (the message is checked above too)
def test_wrong_world_size_stops_before_training(tmp_path):
    result = launched_alone(tmp_path, 2, "--world-size", "3")
    assert result.returncode != 0
    assert "set up for 3 processes but torchrun started 2" in result.stdout + result.stderr
    assert not (tmp_path / "table.csv").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.engine  # two processes for ~25 s
def test_fsdp_grpo_matches_single_process(tmp_path):
    result = torchrun(2, tmp_path, "--max-grad-norm", "inf")
    assert result.returncode == 0, failure_of(result.stderr)
    table = pd.read_csv(tmp_path / "table.csv")
    references = table[table.compared_with != "stock"]
    assert len(references) == 4
    # The first forward under FSDP2 (aligned patches and all) gives the single-process logprobs bit for bit.
    assert (references.max_abs_logprob_diff == 0).all()
    assert (references.step1_abs_loss_diff <= references.step1_loss_tolerance).all()
    accumulated = references[references.compared_with == "accumulated"]
    assert (accumulated[["max_abs_loss_diff", "max_abs_param_diff", "param_tolerance"]] == 0).all().all()
    whole_batch = references[references.compared_with == "global_batch"]
    assert (whole_batch.max_abs_param_diff <= whole_batch.param_tolerance).all()
    # Aligned and stock still differ under FSDP2: in the forward (where alignment acts) and in the weights.
    aligned_vs_stock = table[table.compared_with == "stock"].iloc[0]
    assert aligned_vs_stock.max_abs_logprob_diff > 0 and aligned_vs_stock.max_abs_param_diff > 0
    # The checkpoints hold the whole FP32 model, loadable without FSDP.
    for arm in ("stock", "aligned"):
        checkpoint = torch.load(tmp_path / "checkpoints" / f"{arm}_clip_inf" / "checkpoint.pt", weights_only=True)
        load_model("qwen3-tiny", dtype="float32").load_state_dict(checkpoint["master"], strict=True)
        assert checkpoint["step"] == 3 and checkpoint["opt"]["state"]


@pytest.mark.engine  # the schedule (cached), two FSDP processes, then one engine: about 2 minutes
def test_fsdp_engine_aligned_is_the_engine_at_every_step(tmp_path):
    """FSDP2 on 2 processes, the training side aligned to the engine's schedule: at each step, with the step's weights
    in the engine, every response token's logprob is the engine's bit for bit (on the CPUs where engine-aligned
    exactness is measured); the stock arm is not, on the same tokens and steps."""
    from rla_lib.engine_align import kernel_numerics
    from rla_lib.machine import vllm_cpu_attention_kernel
    from test_engine_align import MEASURED_EXACT

    table_path = tmp_path / "fsdp_engine.csv"
    result = subprocess.run([sys.executable, str(SCRIPT), "--engine", "--steps", "2", "--max-grad-norm", "inf",
                             "--checkpoints", str(tmp_path / "checkpoints"), "--engine-table", str(table_path)],
                            capture_output=True, text=True, timeout=HANG_GUARD_S * 2,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"))  # a rank's fatal signal prints its stack
    assert result.returncode == 0, failure_of(result.stderr)
    table = pd.read_csv(table_path).set_index(["arm", "step"])
    assert list(table.index) == [("stock", 1), ("stock", 2), ("engine-aligned", 1), ("engine-aligned", 2)]
    assert (table.response_tokens > 0).all()
    assert (table.loc["stock", "bitwise"] < 1).all()  # the check bites: stock BF16 under FSDP is not the engine's
    if kernel_numerics() is not None and vllm_cpu_attention_kernel() in MEASURED_EXACT:
        aligned = table.loc["engine-aligned"]
        assert (aligned.bitwise == 1).all() and (aligned.max_abs_diff == 0).all(), aligned
