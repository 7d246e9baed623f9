"""rla_lib.graphs on the real engine: a compile cache produced in this test run (one compiled engine start,
in a subprocess)."""

import pytest

from rla_lib import graphs
from rla_lib.align import REGIONS
from test_graphs_inductor import COMPILED_CPU


@pytest.mark.engine
def test_real_compiled_cache_from_this_run(tmp_path):
    out = graphs.capture("qwen3-tiny", "compiled", out_dir=tmp_path / "capture")
    files = graphs.find_output_code(out)
    assert files and all(tmp_path in f.parents for f in files)
    g = graphs.engine_graph(out)
    points = graphs.read_points(g)
    summary = points.summary()
    assert {k: summary[k] for k in COMPILED_CPU} == COMPILED_CPU
    assert summary["lm_head.output"] == "bf16"  # the logits processor, traced: vLLM runs it outside the graph
    sched = graphs.schedule(points, "vllm:compiled")
    assert graphs.schedule_to_align_kwargs(sched)[0] == REGIONS and sched["align"]["exact"]
