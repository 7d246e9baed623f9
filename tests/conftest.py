import os

# Tests never reach the hub, and vLLM on CPU needs its KV-cache size set before it is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# With ATEN_CPU_CAPABILITY=avx2 (emulating an AVX2-only CPU on a newer one) compile caches must be kept apart.
from rla_lib.machine import compile_cache_environment, engine_core_environment  # noqa: E402

os.environ.update(compile_cache_environment())
# `make test` runs test processes side by side (pytest-xdist): each one's engines get a core of their own
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.update(engine_core_environment(int(os.environ["PYTEST_XDIST_WORKER"][2:])))

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """A test that uses the shared engine starts vLLM: mark it `engine` even if its file forgot to."""
    for item in items:
        if "compiled_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def compiled_engine():
    from rla_lib.engine import Engine

    engine = Engine("qwen3-tiny", mode="compiled", in_process=False)  # leaves this process to the tests' own engines
    yield engine
    engine.close()
