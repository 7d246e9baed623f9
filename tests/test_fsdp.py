"""GRPO under FSDP2 on 2 gloo processes against the single-process trainer (experiments/fsdp_grpo.py, issue 14).

The equivalence test runs the entry point under torchrun (25-30 s on 2 cores) with the clip off (max_grad_norm
inf): then FSDP2 must equal the single-process gradient accumulation over the ranks' rows bit for bit, and
one backward over the whole batch (grpo.Policy as it is) within the tolerances the script derives (see
`compare` there). A wrong launch must stop before training and leave no file behind.
"""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from rla_lib import distributed
from rla_lib.models import load_model

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "fsdp_grpo.py"


def torchrun(nproc: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT),
               "--table", str(tmp_path / "table.csv"), "--checkpoints", str(tmp_path / "checkpoints"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_check_launch_says_what_to_change():
    distributed.check_launch(2, expected=2, global_rows=32)
    with pytest.raises(ValueError, match="set up for 2 processes but torchrun started 3.*--nproc_per_node 2"):
        distributed.check_launch(3, expected=2, global_rows=32)
    with pytest.raises(ValueError, match="32 rows does not split evenly over 3 processes"):
        distributed.check_launch(3, expected=3, global_rows=32)
    blocks = [distributed.local_rows(32, r, 4) for r in range(4)]
    assert [i for b in blocks for i in range(32)[b]] == list(range(32))


@pytest.mark.engine  # 10-20 s: two processes importing torch and rla_lib (the message is checked above too)
def test_wrong_world_size_stops_before_training(tmp_path):
    result = torchrun(2, tmp_path, "--world-size", "3")
    assert result.returncode != 0
    assert "set up for 3 processes but torchrun started 2" in result.stdout + result.stderr
    assert not (tmp_path / "table.csv").exists() and not (tmp_path / "checkpoints").exists()


@pytest.mark.engine  # two processes for ~25 s
def test_fsdp_grpo_matches_single_process(tmp_path):
    result = torchrun(2, tmp_path, "--max-grad-norm", "inf")
    assert result.returncode == 0, result.stderr[-3000:]
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
        checkpoint = torch.load(tmp_path / "checkpoints" / f"{arm}_clip_inf" / "checkpoint.pt", weights_only=False)
        load_model("qwen3-tiny", dtype="float32").load_state_dict(checkpoint["master"], strict=True)
        assert checkpoint["step"] == 3 and checkpoint["opt"]["state"]
