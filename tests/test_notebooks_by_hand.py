"""Every numbered notebook works its chapter's key step by hand, without the library, and asserts it equal to what
`rla_lib` computes: a code cell whose first line is `# by hand: <what>`, after a markdown cell saying what and why.

The check reads the notebooks' JSON (it runs nothing; test_notebooks.py executes them). A name is from the library if
the notebook imports it from rla_lib, or assigns it from an expression that reads such a name (also inside a `with`
whose context manager does, or as a function whose body does). The marked cell must hold an `assert` that reads one.
Statically this cannot tell a hand value from a library value (both may start from the library's data): the marker,
the markdown and review say which side is which.
"""

import ast
import json

import pytest

from rla_lib.paths import CHAPTERS, ROOT

MARKER = "# by hand:"
NOTEBOOKS = sorted((ROOT / "notebooks").glob(CHAPTERS))


def code_cells(nb_path) -> list[tuple[int, str]]:
    """(index, source) of each code cell, IPython magics and shell lines left out so that `ast` reads the rest."""
    cells = json.loads(nb_path.read_text())["cells"]
    return [(i, "".join(line for line in c["source"] if not line.lstrip().startswith(("%", "!"))))
            for i, c in enumerate(cells) if c["cell_type"] == "code"]


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound(target) -> set[str]:
    """The names an assignment target binds (`x`, `a, b`, and the base of `x[i]` or `x.y`)."""
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def library_names(sources: list[str]) -> set[str]:
    """Names holding something rla_lib made, followed through the notebook's code in order."""
    tainted: set[str] = set()

    def visit(statements, inside_library_context=False):
        for st in statements:
            if isinstance(st, ast.ImportFrom) and (st.module or "").split(".")[0] == "rla_lib":
                tainted.update(a.asname or a.name for a in st.names)
            elif isinstance(st, ast.Import):
                tainted.update(a.asname or a.name.split(".")[0] for a in st.names if a.name.split(".")[0] == "rla_lib")
            elif isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and st.value is not None:
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                if inside_library_context or _names(st.value) & tainted:
                    for t in targets:
                        tainted.update(_bound(t))
            elif isinstance(st, (ast.FunctionDef, ast.ClassDef)):
                if _names(st) & tainted:
                    tainted.add(st.name)
            elif isinstance(st, (ast.For, ast.AsyncFor)):
                if _names(st.iter) & tainted:
                    tainted.update(_bound(st.target))
                visit(st.body, inside_library_context)
                visit(st.orelse, inside_library_context)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                library_context = any(_names(item.context_expr) & tainted for item in st.items)
                for item in st.items:
                    if item.optional_vars is not None and _names(item.context_expr) & tainted:
                        tainted.update(_bound(item.optional_vars))
                visit(st.body, inside_library_context or library_context)
            elif isinstance(st, (ast.If, ast.While, ast.Try)):
                for block in (st.body, st.orelse, getattr(st, "finalbody", []),
                              *[h.body for h in getattr(st, "handlers", [])]):
                    visit(block, inside_library_context)

    for source in sources:
        visit(ast.parse(source).body)
    return tainted


def asserts(source: str) -> list[ast.Assert]:
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assert)]


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) >= 9, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_a_hand_worked_step_checked_against_the_library(nb_path):
    cells = json.loads(nb_path.read_text())["cells"]
    code = code_cells(nb_path)
    marked = [(i, src) for i, src in code if src.lstrip().startswith(MARKER)]
    assert marked, f"{nb_path.name}: no code cell starts with {MARKER!r} (the chapter's key step worked by hand)"
    for i, src in marked:
        assert i > 0 and cells[i - 1]["cell_type"] == "markdown", \
            f"{nb_path.name}: the {MARKER!r} cell (cell {i}) needs a markdown cell before it saying what and why"
        # the library's names as they stand when this cell runs: the cells before it, then the cell itself
        names = library_names([s for j, s in code if j <= i])
        checks = [a for a in asserts(src) if _names(a.test) & names]
        assert checks, (f"{nb_path.name}: the {MARKER!r} cell (cell {i}) has no `assert` comparing with a value from "
                        f"rla_lib (asserts found: {len(asserts(src))})")


def test_the_check_sees_a_cell_without_the_library():
    """A hand-worked cell that asserts only on its own numbers does not pass."""
    hand_only = "x = 1.003 * 3\nassert x > 3\n"
    with_library = "from rla_lib import rounding\nr = rounding.chain_rounding(1.003, '*3')\nassert r.fused == 3.015625\n"
    assert not [a for a in asserts(hand_only) if _names(a.test) & library_names([hand_only])]
    assert [a for a in asserts(with_library) if _names(a.test) & library_names([with_library])]


def prose_calls(sources: list[str]) -> list[str]:
    """The calls, outside an `assert`, of a library function marked `rla_lib.report.prose` (one that words results as
    sentences): resolved through the notebook's own `from rla_lib... import` and `import rla_lib...` lines."""
    import importlib

    bound: dict[str, object] = {}
    found = []
    for source in sources:
        tree = ast.parse(source)
        for st in ast.walk(tree):
            if isinstance(st, ast.ImportFrom) and (st.module or "").split(".")[0] == "rla_lib":
                module = importlib.import_module(st.module)
                for a in st.names:
                    bound[a.asname or a.name] = getattr(module, a.name, None) or importlib.import_module(f"{st.module}.{a.name}")
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.name.split(".")[0] == "rla_lib":
                        bound[a.asname or a.name] = importlib.import_module(a.name)
        checked = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or id(call) in checked:
                continue
            f, target = call.func, None
            if isinstance(f, ast.Name):
                target = bound.get(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in bound:
                target = getattr(bound[f.value.id], f.attr, None)
            if getattr(target, "builds_prose", False):
                found.append(ast.unparse(f))
    return found


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_prints_no_sentence_built_by_the_library(nb_path):
    """Conclusions are computed in the open: the numbers, then the notebook's own rule that words them."""
    calls = prose_calls([s for _, s in code_cells(nb_path)])
    assert not calls, (f"{nb_path.name} words its conclusions with {sorted(set(calls))}: show the numbers they rest "
                       f"on and write the rule in the notebook (it may assert its words equal the library's)")


def test_the_prose_check_sees_a_library_sentence():
    printed = "from rla_lib.studies import collapse\nprint(collapse.verdict(rates, 'x'))\n"
    checked = "from rla_lib.studies import collapse\nassert mine == collapse.verdict(rates, 'x')\n"
    numbers = "from rla_lib.studies import collapse\nrates = collapse.collapse_rates(h)\n"
    assert prose_calls([printed]) == ["collapse.verdict"]
    assert prose_calls([checked]) == prose_calls([numbers]) == []
