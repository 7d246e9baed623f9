"""Start-up of the Python processes rla_lib starts: vLLM's engine core and its workers, capped runs.

`rla_lib.engine.configure_environment` and `rla_lib.machine.isa_environment` put this folder on PYTHONPATH, so
Python runs this file first in those processes (a sitecustomize of your own elsewhere on the path is then not run
in them; nothing here is needed by anything else).
"""

import logging
import os
import warnings

# vLLM logs some import-time warnings before it configures its loggers, so they reach stderr bare and unfiltered
# (e.g. "Triton is installed, but doesn't include CPU backend"); apply its level first. VLLM_LOGGING_LEVEL=INFO
# shows everything again.
if os.environ.get("VLLM_LOGGING_LEVEL"):
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")

# A capped instruction set (rla_lib.machine.ISA_LEVELS): vLLM picks its kernel library (`_C`, `_C_AVX512`,
# `_C_AVX2`) and some kernel paths from torch's CPUID checks, which ignore ATEN_CPU_CAPABILITY and
# ONEDNN_MAX_CPU_ISA; here they answer as a CPU of level RLA_CPU_ISA would.
_level = os.environ.get("RLA_CPU_ISA")
if _level in ("avx512", "avx2"):
    import torch.cpu

    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    if _level == "avx2":
        torch.cpu._is_avx512_supported = lambda: False
