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

from rla_lib.paths import ROOT  # noqa: E402


def pytest_collection_modifyitems(items):
    """A test that uses the shared engine starts vLLM: mark it `engine` even if its file forgot to. Under `make test`'s
    test processes (each file whole in one, in the order collected), the files that took longest in the last timed run
    go first, so no long one starts last while the other process idles."""
    for item in items:
        if "compiled_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        seconds = file_seconds([item.nodeid for item in items])
        items.sort(key=lambda item: -seconds[item.nodeid.split("::")[0]])  # stable: a file keeps its order


def file_seconds(nodeids: list[str]) -> dict[str, float]:
    """Each test file's seconds in the newest run of tables/bench_test_times.csv (benchmarks/fresh_clone_test.py): the
    sum of its tests' times, a test moved from another file by its name there, a new one 0 (all 0 without the table)."""
    import pandas as pd

    path = ROOT / "tables" / "bench_test_times.csv"
    times = pd.read_csv(path, index_col="test").iloc[:, -1].dropna().to_dict() if path.exists() else {}
    by_name = {test.split("::", 1)[-1]: s for test, s in times.items()}
    seconds: dict[str, float] = {}
    for nodeid in nodeids:
        file, name = nodeid.split("::", 1)
        seconds[file] = seconds.get(file, 0.0) + times.get(nodeid, by_name.get(name, 0.0))
    return seconds


@pytest.fixture(scope="session")
def narrow_model(tmp_path_factory):
    """The narrow full-vocabulary checkpoint (rla_lib.real_shape.NARROW), written once for the whole run: the test
    processes share it (writing it takes half a minute on a slow CPU)."""
    from filelock import FileLock

    from rla_lib import real_shape

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-xdist's processes share the parent of their base folders
    with FileLock(shared / "narrow-model.lock"):
        return real_shape.make_narrow(shared)


@pytest.fixture(scope="session")
def compiled_engine():
    from rla_lib.engine import Engine

    engine = Engine("qwen3-tiny", mode="compiled", in_process=False)  # leaves this process to the tests' own engines
    yield engine
    engine.close()
