"""No load in the repository turns data into code (issue 69): read from the source with `ast`, nothing is run.

A file read back (a checkpoint, a capture, a cached result) may come from a shared or copied folder, so every
`torch.load` says `weights_only=True`, and nothing unpickles (pickle, joblib, `read_pickle`, numpy's
`allow_pickle=True`), evaluates strings (`eval`, `exec`) or runs a model repository's own code
(`trust_remote_code=True`). The one exception is a test that shows what a planted checkpoint would do if unpickled.
"""

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("rla_lib", "experiments", "benchmarks", "tools", "tests")
UNPICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
ON_PURPOSE = {("tests/test_grpo.py", "test_resume_refuses_a_checkpoint_that_would_run_code")}  # shows the plant runs


def sources() -> dict[str, str]:
    """Every Python file of the repository and every notebook's code cells, by path."""
    files = {str(p.relative_to(ROOT)): p.read_text() for part in SOURCES for p in sorted((ROOT / part).rglob("*.py"))}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        files[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return files


def runs_code(call: ast.Call) -> str | None:
    """Why `call` may run what the data it reads holds (None: it cannot)."""
    func, keywords = call.func, {k.arg: k.value for k in call.keywords}
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
    torch_load = name == "load" and owner in ("torch", "torch.serialization")
    if torch_load and not is_constant(keywords.get("weights_only"), True):
        return "torch.load without weights_only=True"
    if owner.split(".")[0] in UNPICKLERS or name in ("read_pickle", "Unpickler", "unsafe_load"):
        return "unpickles"
    if name in ("eval", "exec") and not owner:
        return "evaluates a string"
    for key in ("allow_pickle", "trust_remote_code"):
        if key in keywords and not is_constant(keywords[key], False):
            return f"{key} not False"
    return None


def is_constant(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def test_no_load_runs_what_it_reads():
    found = []
    for path, source in sources().items():
        tree = ast.parse(source)
        for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, FUNCTIONS))]:
            inner = {id(c) for f in ast.walk(fn) if f is not fn and isinstance(f, FUNCTIONS)
                     for c in ast.walk(f)}  # a nested function's calls are its own
            where = getattr(fn, "name", "<module>")
            found += [f"{path}:{call.lineno} ({where}): {why}: {ast.unparse(call)}"
                      for call in ast.walk(fn) if isinstance(call, ast.Call) and id(call) not in inner
                      and (why := runs_code(call)) and (path, where) not in ON_PURPOSE]
    assert not found, "loads that can run code:\n" + "\n".join(found)


def test_the_check_sees_each_kind():
    flagged = [runs_code(ast.parse(line).body[0].value) for line in (
        "torch.load(p)", "torch.load(p, weights_only=False)", "pickle.loads(b)", "pd.read_pickle(p)", "eval(s)",
        "np.load(p, allow_pickle=True)", "AutoModel.from_pretrained(p, trust_remote_code=True)")]
    assert all(flagged), flagged
    assert runs_code(ast.parse("torch.load(p, weights_only=True)").body[0].value) is None
    assert runs_code(ast.parse("model.eval()").body[0].value) is None
