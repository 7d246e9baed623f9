import os

# Tests never reach the hub, and vLLM on CPU needs its KV-cache size set before it is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def compiled_engine():
    from rla_lib.engine import Engine

    engine = Engine("qwen3-tiny", mode="compiled")
    yield engine
    engine.close()
