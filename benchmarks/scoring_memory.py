"""Peak memory at a real Qwen's vocabulary (151,936): training-side logprobs with and without gradients,
chunked (`rla_lib.scoring.head_logprobs`) against the naive full-logits path, and the exact-KL path
(`rla_lib.exact_kl`) on the Qwen3-0.6B-shaped checkpoint.

    .venv/bin/python benchmarks/scoring_memory.py [--tokens 8192] [--exact-kl-tokens 4096] [--no-exact-kl] [--no-save]
    .venv/bin/python benchmarks/scoring_memory.py --tokens 256 --vocab 4096 --no-exact-kl --no-save   # quickest

Each case runs in a fresh process; its peak is the rise of the process's resident set above what it held
before the case started (Linux VmHWM, reset through /proc/self/clear_refs), so the inputs themselves are not
counted. The LM head cases start from the hidden states (tokens x 1,024, as the 0.6B shape's decoder gives
them): the decoder's own activations are the same on both paths. The exact-KL case counts this process only
(vLLM's engine runs in its own process; its memory is the engine's and does not grow with the vocabulary
chunks). Writes tables/bench_scoring_memory.csv (not with `--no-save`). Needs `make real-shape` for the exact-KL case.
`--vocab` shrinks the LM head cases' vocabulary (a check that the script runs: the peaks it gives are not the point).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from rla_lib.real_shape import REAL_SHAPE_DIR, VOCAB_SIZE
from rla_lib.report import save_table
from rla_lib.scoring import (CHUNKED_PEAK_TARGET, HEAD_CHUNK, chunked_peak_target_applies, head_logprobs,
                             log_softmax_at)

HIDDEN = 1024  # Qwen3-0.6B
REAL_SHAPE = REAL_SHAPE_DIR / "qwen3-0.6b-shape"


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_peak(fn) -> tuple[float, float]:
    """(peak GB above the resident set before `fn`, seconds)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before, t = status_kib("VmRSS"), time.perf_counter()
    fn()
    return (status_kib("VmHWM") - before) / 2**20, time.perf_counter() - t


def head_case(path: str, grad: bool, tokens: int, vocab: int = VOCAB_SIZE) -> dict:
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(HIDDEN, vocab, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, HIDDEN, generator=g) * 0.02)
    head.weight.requires_grad_(grad)
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16).requires_grad_(grad)
    targets = torch.randint(0, vocab, (tokens,), generator=g)

    def run():
        with torch.set_grad_enabled(grad):
            if path == "naive":
                lp = log_softmax_at(head(hidden)).gather(-1, targets[:, None])[:, 0]
            else:
                lp = head_logprobs(head, hidden, targets, chunk_size=HEAD_CHUNK)
            if grad:
                lp.sum().backward()

    peak, seconds = measure_peak(run)
    return dict(case=f"LM head + log-softmax, {path}", grad=grad, tokens=tokens, peak_gb=peak, seconds=seconds)


def exact_kl_case(tokens: int) -> dict:
    from rla_lib.engine import Engine
    from rla_lib.exact_kl import exact_kl
    from rla_lib.models import load_model

    rows, length = 4, tokens // 4 + 1  # 4 sequences, `tokens` scored positions in all
    g = torch.Generator().manual_seed(0)
    sequences = torch.randint(1, 64, (rows, length), generator=g).tolist()  # the task's characters
    model = load_model(REAL_SHAPE)
    with Engine(REAL_SHAPE, mode="eager", max_model_len=length + 1) as engine:
        res = {}
        peak, seconds = measure_peak(lambda: res.setdefault("kl", exact_kl(engine, model, sequences)))
    return dict(case="exact KL, qwen3-0.6b-shape vs vLLM eager (this process)", grad=False, tokens=tokens,
                peak_gb=peak, seconds=seconds, mean_exact_kl=res["kl"].mean())


def child(args) -> None:
    case = json.loads(args.child)
    row = (exact_kl_case(case["tokens"]) if case["kind"] == "exact_kl"
           else head_case(case["kind"], case["grad"], case["tokens"], case["vocab"]))
    print("RESULT " + json.dumps(row))


def run_child(case: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8 * 1024)
    parser.add_argument("--exact-kl-tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE, help="the LM head cases' vocabulary (a real Qwen's)")
    parser.add_argument("--no-exact-kl", action="store_true")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        raise SystemExit(0)
    cases = [dict(kind=k, grad=g, tokens=args.tokens, vocab=args.vocab) for g in (False, True) for k in ("naive", "chunked")]
    if not args.no_exact_kl:
        if not (REAL_SHAPE / "config.json").exists():
            raise SystemExit(f"{REAL_SHAPE} is missing: run `make real-shape` first, or pass --no-exact-kl")
        cases.append(dict(kind="exact_kl", grad=False, tokens=args.exact_kl_tokens))
    rows = []
    for case in cases:
        rows.append(run_child(case))
        print(f"{rows[-1]['case']:<60} grad={rows[-1]['grad']!s:<5} {rows[-1]['tokens']:>6} tokens: "
              f"peak {rows[-1]['peak_gb']:.2f} GB, {rows[-1]['seconds']:.1f} s", flush=True)
    table = pd.DataFrame(rows)
    for grad in (False, True):
        naive, chunked = (table[(table.case.str.endswith(p)) & (table.grad == grad)].peak_gb.iloc[0] for p in ("naive", "chunked"))
        where = "" if chunked_peak_target_applies(args.tokens, args.vocab) else (
            f"; this run is below where it holds: {HEAD_CHUNK / CHUNKED_PEAK_TARGET:,.0f} tokens or more at the "
            f"{VOCAB_SIZE:,}-token vocabulary")
        print(f"chunked / naive peak, grad={grad}: {chunked / naive:.3f} (target with gradients: <= "
              f"{CHUNKED_PEAK_TARGET}{where})")
    if args.save:
        save_table(table, "bench_scoring_memory", vars(args) | {"hidden": HIDDEN, "threads": torch.get_num_threads()})
