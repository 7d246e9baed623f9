import getpass
import os
import tempfile

# Tests never reach the hub, and vLLM on CPU needs its KV-cache size set before it is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _separate_compile_caches_per_instruction_set() -> None:
    """With ATEN_CPU_CAPABILITY=avx2 (emulating an AVX2-only CPU on a newer one), keep compile caches apart.

    Inductor's FX-graph cache does not key on that setting: a graph compiled under one setting and loaded
    under the other returned garbage or crashed (free(): invalid pointer). vLLM's compile cache likewise.
    """
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if not capability:
        return
    root = os.path.join(tempfile.gettempdir(), f"rla-{getpass.getuser()}-{capability}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm"))


_separate_compile_caches_per_instruction_set()

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """A test that uses the shared engine starts vLLM: mark it `engine` even if its file forgot to."""
    for item in items:
        if "compiled_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def compiled_engine():
    from rla_lib.engine import Engine

    engine = Engine("qwen3-tiny", mode="compiled")
    yield engine
    engine.close()
