"""rla_lib.plotting: figures are refused where tick labels overlap as they render, and kept where they do not."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from rla_lib.plotting import overlapping_tick_labels, save_figure  # noqa: E402

LONG = ["paper (3 regions)", "schedule (compiled)", "schedule (eager)", "engine-aligned (compiled)"]


def bars(width, rotation=0, ha="center"):
    fig, ax = plt.subplots(figsize=(width, 2))
    ax.bar(range(len(LONG)), [1, 2, 3, 4])
    ax.set_xticks(range(len(LONG)), LONG, rotation=rotation, ha=ha)
    return fig


def test_overlapping_labels_are_found_and_refused(tmp_path):
    crowded = bars(3)
    found = overlapping_tick_labels(crowded)
    assert found and "'paper (3 regions)' and 'schedule (compiled)'" in found[0]
    with pytest.raises(ValueError, match="figure crowded: tick labels overlap .*rotate them"):
        save_figure(crowded, "crowded", tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("rotation", [30, 45, 90, 150])
def test_rotated_labels_that_clear_each_other_pass(tmp_path, rotation):
    """Rotated labels' upright boxes overlap while their ink does not: the rotated boxes are what is compared."""
    fig = bars(4, rotation, "right" if rotation < 90 else "center")
    assert overlapping_tick_labels(fig) == []
    assert [p.suffix for p in save_figure(fig, "rotated", tmp_path)] == [".png", ".svg"]


def test_wide_enough_and_outside_the_view_pass():
    assert overlapping_tick_labels(bars(12)) == []
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    ax.set_xticks([0, 1, 5, 5.01], ["a", "b", "hidden", "hidden too"])  # beyond the limits: not drawn
    ax.set_xlim(-0.1, 1.1)
    assert overlapping_tick_labels(fig) == []
