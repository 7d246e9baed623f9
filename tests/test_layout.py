"""The library's shape (issue 16): no import cycles between rla_lib modules, imports at the top, modules and
functions of a readable size. Read from the source with `ast`; nothing is imported or run."""

import ast
from pathlib import Path

import rla_lib

PACKAGE = Path(rla_lib.__file__).parent
MAX_MODULE_LINES = 650  # "no module over ~600 lines"
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


def part(name: str) -> str:
    return "tools" if name.split(".")[0] == "tools" else "studies" if name.startswith("rla_lib.studies") else "core"


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
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
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


def test_the_core_imports_no_study_and_no_tool():
    """What a user imports (`rla_lib`) stands alone: the studies behind single notebooks (`rla_lib.studies`) and the
    project's tools (`tools/`) build on it, never the other way; a study imports no tool."""
    names = modules()
    assert {part(n) for n in names} == {"core", "studies", "tools"}
    wrong = [f"{name} -> {dep}" for name, path in names.items()
             for dep in sorted(imported(name, path, top_level_only=False))
             if (part(name), part(dep)) in {("core", "studies"), ("core", "tools"), ("studies", "tools")}]
    assert not wrong, "imports across the parts' order (core <- studies <- tools):\n" + "\n".join(wrong)


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


def test_modules_and_functions_have_a_readable_size():
    too_long = []
    for name, path in modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {source.count(chr(10))} lines")
        for fn in (n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES:
                too_long.append(f"function {name}.{fn.name}: {fn.end_lineno - fn.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)
