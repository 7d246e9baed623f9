"""The notebooks that reuse no other notebook's results, under papermill as tests/test_notebooks.py runs the others: a
file of their own, so `make test`'s two test processes run notebooks side by side."""

import pytest
from test_notebooks import APART, FAST, NOTEBOOKS, execute


def test_every_notebook_is_run_by_one_of_the_two_files():
    assert set(APART) <= {p.stem for p in NOTEBOOKS}, "APART names a notebook that does not exist"


@pytest.mark.engine
@pytest.mark.parametrize("name", APART)
def test_notebook_executes(name, tmp_path, monkeypatch):
    nb_path = next(p for p in NOTEBOOKS if p.stem == name)
    execute(nb_path, FAST[name], tmp_path, monkeypatch, tmp_path / "results")
