"""The import graph of `src/gradsolve` has no cycle, every module imports on its
own, and the only imports inside functions are the deliberate lazy ones."""

import ast
import pathlib
import subprocess
import sys

import pytest


SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "gradsolve"
# The imports allowed inside functions, each for a stated reason (a one-line comment
# at the import): optional dependencies and platform modules.
LAZY = {"warp": "Warp loads only when a fused engine runs",
        "diffrax": "optional: the baseline engine",
        "matplotlib": "optional: the plot extra",
        "fcntl": "POSIX only",
        "petab": "optional: the petab extra", "libsbml": "optional: the petab extra",
        "sbmlmath": "optional: the petab extra",
        "": "gs.petab's modules need SymPy (the petab extra): loaded by gs.petab.load",
        "_problem": "as ''", "_sbml": "as ''", "_tables": "as ''"}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node) -> set[str]:
    """The package modules an import statement needs initialised (a package's
    __init__ counts as the package): `from pkg import sub` needs the submodule only
    (Python initialises the parent package first in any case), `from pkg import
    name` needs pkg's __init__ to have defined `name`."""
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    else:
        base = _resolve(module, node)
        subs = {f"{base}.{a.name}" for a in node.names}
        names = subs if subs <= MODULES.keys() else {base} | subs
    return {n for n in names if n in MODULES}


def _top_level_imports(tree):
    """Import statements that run when the module is imported (not inside a def)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _graph():
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        edges = set()
        for node in _top_level_imports(tree):
            edges |= _targets(name, node)
        graph[name] = edges - {name}
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = _graph()
    # A parent package importing its children is how packages work; a child importing
    # its parent's __init__ back is a cycle.
    assert _cycles(graph) == []
    # and the layers: no core module imports the router, the engines or the API
    core = {"gradsolve.control", "gradsolve.mesh", "gradsolve.problem", "gradsolve.status",
            "gradsolve.config", "gradsolve.recorder", "gradsolve.replay"}
    upper = {"gradsolve.router", "gradsolve.engines", "gradsolve.solve", "gradsolve.grad",
             "gradsolve.record", "gradsolve.calibrate"}
    for name in core | {m for m in MODULES if m.startswith(("gradsolve.warp",
                                                           "gradsolve.methods",
                                                           "gradsolve.fields"))}:
        assert not graph[name] & upper, (name, graph[name] & upper)
    # and the generic core knows nothing of Warp (issue 22): the in-kernel adjoint's
    # replay registers itself with replay.py from engines/kernel_adjoint.py, and the
    # Warp engines' routing rules live with them (engines/fused.py)
    for name in ("gradsolve.replay", "gradsolve.config", "gradsolve.engines._base",
                 "gradsolve.router"):
        assert not {m for m in graph[name] if m.startswith("gradsolve.warp")}, \
            (name, graph[name])


def test_lazy_imports_are_the_deliberate_ones():
    found = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        top = set(map(id, _top_level_imports(tree)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                root = (node.names[0].name if isinstance(node, ast.Import)
                        else node.module or "").split(".")[0]
                found.append((name, root, "#" in lines[node.lineno - 1]))
    assert {root for _, root, _ in found} <= set(LAZY), found
    assert all(commented for *_, commented in found), found


@pytest.mark.parametrize("chunk", [0, 1])
def test_every_module_imports_in_a_fresh_interpreter(chunk):
    # Each module first, in an interpreter where no gradsolve module is loaded yet:
    # the modules are split over two interpreters (the test's time is JAX's import),
    # and every gradsolve module is dropped from sys.modules before the next one.
    names = sorted(MODULES)[chunk::2]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'gradsolve' or m.startswith('gradsolve.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
