"""The library's shape: the fix (`rla_lib.align`) stands alone, the parts import only downwards (fix <- lab <- studies <-
tools), no import cycles, imports at the top, every module says its job, functions of a readable size. Read from the
source with `ast`; nothing is imported or run."""

import ast
from pathlib import Path

import rla_lib

PACKAGE = Path(rla_lib.__file__).parent
MAX_FUNCTION_LINES = 85  # "no function over ~80"
# Imported inside functions on purpose: heavy and optional (vLLM only where the engine runs; inductor's ISA
# probe, 1.5 s to import, only in notebook 07's capped workers; IPython and jupyter_client only where a notebook
# or JupyterLab is in use; matplotlib only where a figure is drawn and pandas only where the kl monitor makes a table,
# so a trainer importing the monitor or align loads neither: the core's dependencies are torch, transformers, numpy).
LAZY_IMPORTS = ("vllm", "torch._inductor", "IPython", "jupyter_client", "matplotlib", "pandas")


TOOLS = PACKAGE.parent / "tools"  # the README renderer and the lab launcher, outside the package


def modules():
    """Every module of the package (core and studies) and of tools/, by dotted name."""
    files = sorted(PACKAGE.rglob("*.py")) + sorted(TOOLS.glob("*.py"))
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in files if "child_site" not in p.parts}


FIX = "rla_lib.align"
BASE = {"rla_lib", "rla_lib.settings", "rla_lib.paths"}  # what the fix may stand on: the package, its settings and paths
# What a trainer's environment may lack: the fix imports none of it, not even inside a function
NOT_IN_THE_FIX = ("vllm", "pandas", "matplotlib", "seaborn", "IPython", "jupyter_client", "trl", "datasets")
PARTS = ("fix", "lab", "studies", "tools")  # each imports only the parts before it


def part(name: str) -> str:
    if name.split(".")[0] == "tools":
        return "tools"
    if name.startswith("rla_lib.studies"):
        return "studies"
    return "fix" if name == FIX or name.startswith(FIX + ".") else "lab"


def imported(name: str, path: Path, top_level_only: bool) -> set[str]:
    """rla_lib modules that `name` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules())
            out |= submodules or {base}  # `from . import native` loads a sibling, not its package anew
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in modules()} - {name}


def test_no_import_cycles():
    graph = {name: imported(name, path, top_level_only=False) for name, path in modules().items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph[node]:
            if state.get(dep) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_parts_import_only_downwards():
    """The fix (`rla_lib.align`) stands alone; the lab (the rest of `rla_lib`: engine, measurement, graph reader, GRPO)
    builds on it; the studies behind single notebooks (`rla_lib.studies`) on both; the project's tools (`tools/`) on
    all three, never the other way."""
    names = modules()
    assert {part(n) for n in names} == set(PARTS)
    wrong = [f"{name} -> {dep}" for name, path in names.items()
             for dep in sorted(imported(name, path, top_level_only=False))
             if dep not in BASE and PARTS.index(part(dep)) > PARTS.index(part(name))]
    assert not wrong, "imports against the parts' order (fix <- lab <- studies <- tools):\n" + "\n".join(wrong)


def test_the_fix_imports_nothing_a_trainer_may_lack():
    """`rla_lib.align` loads with torch, Transformers and numpy alone: no vLLM, graph reader, pandas or matplotlib, at
    the top or inside a function (`make test-install` imports and applies it where none of them is installed)."""
    wrong = []
    for name, path in modules().items():
        if part(name) != "fix":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                wrong += [f"{name}: {n}" for n in names if n.split(".")[0] in NOT_IN_THE_FIX]
        wrong += [f"{name} -> {dep}" for dep in imported(name, path, top_level_only=False)
                  if part(dep) != "fix" and dep not in BASE]
    assert not wrong, "the fix imports what a trainer may not have:\n" + "\n".join(wrong)


def test_every_module_says_its_job():
    """Each module opens with a docstring, the job it does (a reader finds the right file from its first line)."""
    silent = [name for name, path in modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not silent, "modules without a docstring: " + ", ".join(silent)


def test_imports_are_at_the_top():
    late = []
    for name, path in modules().items():
        for fn in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.module else [a.name for a in node.names]
                    lazy = all(any(n == p or n.startswith(p + ".") for p in LAZY_IMPORTS) for n in names)
                    if not lazy or getattr(node, "level", 0):
                        late.append(f"{name}.{fn.name}: {ast.unparse(node)}")
    assert not late, "imports inside functions:\n" + "\n".join(late)


def test_functions_have_a_readable_size():
    too_long = []
    for name, path in modules().items():
        for fn in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                too_long.append(f"function {name}.{fn.name}: {fn.end_lineno - fn.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)
