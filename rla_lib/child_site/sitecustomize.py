"""Start-up of the Python processes rla_lib starts: vLLM's engine core and its workers, capped runs.

`rla_lib.engine_process.engine_settings` (an engine's processes) and `rla_lib.machine.isa_environment` put this folder on PYTHONPATH, so
Python runs this file first in those processes (a sitecustomize of your own elsewhere on the path is then not run
in them; nothing here is needed by anything else).
"""

import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import warnings

# Die with the process that started this one. An engine core or worker whose parent was killed (SIGKILL, the
# out-of-memory killer, a stopped notebook kernel) otherwise lives on with its model and KV cache in memory.
if sys.platform.startswith("linux"):
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

# vLLM logs some import-time warnings before it configures its loggers, so they reach stderr bare and unfiltered
# (e.g. "Triton is installed, but doesn't include CPU backend"); apply its level first. VLLM_LOGGING_LEVEL=INFO
# shows everything again.
if os.environ.get("VLLM_LOGGING_LEVEL"):
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` once `name` has been imported (its loader executes it, then the patch)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module

        def execute_and_patch(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = execute_and_patch
        return spec


# A capped instruction set (rla_lib.machine.ISA_LEVELS): vLLM picks its kernel library (`_C`, `_C_AVX512`,
# `_C_AVX2`) and some kernel paths from torch's CPUID checks, which ignore ATEN_CPU_CAPABILITY and
# ONEDNN_MAX_CPU_ISA; here they answer as a CPU of level RLA_CPU_ISA would.
# Patched once torch.cpu is imported, not here: importing torch at start-up would cost every capped process
# (a notebook, a reader of copied output code) torch's import whether it uses torch or not.
def _answer_as_level(module, level=os.environ.get("RLA_CPU_ISA")):
    module._is_amx_tile_supported = lambda: False
    if level in ("avx512", "avx2"):
        module._is_avx512_bf16_supported = lambda: False
    if level == "avx2":
        module._is_avx512_supported = lambda: False


if os.environ.get("RLA_CPU_ISA") in ("avx512_bf16", "avx512", "avx2"):
    sys.meta_path.insert(0, _PatchAfterImport("torch.cpu", _answer_as_level))

# vLLM's worker keeps spinning on its message queue for `busy_loop_s` (1 s) after every message, a full core
# taken from whatever runs next: in an RL loop, the training step that follows each rollout. With
# RLA_VLLM_IDLE_SPIN_S set (rla_lib.engine sets 0.05) the worker waits on its socket instead once that long has
# passed since its last message: same results; decode steps, milliseconds apart, still find it spinning.
_spin = os.environ.get("RLA_VLLM_IDLE_SPIN_S")
if _spin is not None:
    def _shorter_spin(module, seconds=float(_spin)):
        init = module.SpinCondition.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self.is_reader:
                self.busy_loop_s = seconds

        module.SpinCondition.__init__ = __init__

    sys.meta_path.insert(0, _PatchAfterImport("vllm.distributed.device_communicators.shm_broadcast", _shorter_spin))
