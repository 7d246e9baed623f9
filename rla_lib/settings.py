"""Every environment variable rla_lib reads, in one place: its default and what it changes.

rla_lib reads these and sets none of them in your process: importing it changes no environment variable, and what
an engine needs in its own processes (vLLM's settings, this package's start-up code on PYTHONPATH) is set only
while vLLM reads it (`rla_lib.engine_process.engine_settings`). The settings table of docs/guide.md is rendered from `VARIABLES`.
"""

import os

# name: (default, what it changes). None: unset unless you set it.
VARIABLES = {
    "RLA_HOME": ("~/.cache/rla", "where an installed rla_lib writes caches, results, tables and figures "
                                 "(run from the repository: the repository)"),
    "RLA_RESULTS_DIR": ("<home>/results", "where runs cache their samples and scores"),
    "RLA_TABLES_DIR": ("<home>/tables", "where result tables and their provenance sidecars go"),
    "RLA_FIGURES_DIR": ("<home>/figures", "where notebooks save figures"),
    "RLA_PROGRESS": ("1", "0: no progress bars, even in a Jupyter kernel (batch runs set it)"),
    "RLA_PROCESSES": (None, "engines run side by side (default: 2 for the embedded models on 2+ cores, else 1)"),
    "RLA_NATIVE": ("1", "0: no compiled C kernels (the attention and GEMM replays run as torch-op loops)"),
    "RLA_CPU_ISA": (None, "run as a CPU of this level would (amx, avx512_bf16, avx512, avx2); set with the rest of a cap by "
                          "`python -m rla_lib.machine --level LEVEL COMMAND` (`make test ISA=avx2`), not alone"),
    "RLA_BF16_MATMUL": ("auto", "the training side's BF16 linear: native (torch's BF16 GEMM), fp32 (FP32 products "
                                "rounded once) or auto (native where the CPU has BF16 instructions)"),
    "RLA_VLLM_IDLE_SPIN_S": ("0.05", "seconds vLLM's worker spins on its queue after a message before it sleeps "
                                     "(read by the engine's processes)"),
    "RLA_ENGINE_LOG": (None, "a file every engine start appends a line to: the running test, model, mode and seconds "
                             "(benchmarks/fresh_clone_test.py's inventory of engine starts)"),
}
# Read by the tests and the Makefile, not by the package.
TEST_VARIABLES = {
    "RLA_REAL_SHAPE_MODEL": "the checkpoint `make test-real-shape` runs the notebooks on",
    "RLA_REAL_SHAPE_TABLES": "where `make test-real-shape` writes its tables (tables/real-shape)",
    "RLA_EXECUTED_DIR": "where the notebook tests keep executed copies",
}


def setting(name: str) -> str | None:
    """The value of rla_lib's environment variable `name` (one of `VARIABLES`), or None where unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of rla_lib's settings ({', '.join(VARIABLES)})")
    return os.environ.get(name)
