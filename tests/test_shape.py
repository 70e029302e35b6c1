"""The rules of the code's shape (docs/architecture.md), checked on the source: no import circle in
``hpx/``, no module over 600 lines, the Engine facade under 400, the library never importing its
benchmarks, the engine importing no concrete backend, each route in its package, and the checkpoint
files importing neither route."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpx"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The hpx modules ``name`` imports, anywhere in it (a lazy import is still an arrow)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not t.startswith(name + "."):  # a package's own submodules aside
                found.add(t)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_circle_in_the_library() -> None:
    assert _circles(_graph()) == []
    # the check sees a circle when there is one
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_600_lines_and_the_engine_facade_under_400() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
    tree = ast.parse((PKG / "engine" / "facade.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno + 1 <= 400


def test_the_engine_imports_no_concrete_backend_and_the_library_no_benchmark() -> None:
    graph = _graph()
    for name in (n for n in graph if n == "hpx.engine" or n.startswith("hpx.engine.")):
        assert not {"hpx.backends.dist", "hpx.backends.local", "hpx.backends.mesh"} & graph[name], name
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        assert "import benchmarks" not in text and "from benchmarks" not in text, path


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_each_route_in_its_package_and_the_checkpoint_files_import_neither() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert [n for n in top if n.startswith("_fork") or n in ("forks.py", "engine.py")] == []
    assert (PKG / "forks" / "__init__.py").is_file() and (PKG / "engine" / "__init__.py").is_file()
    graph = _graph()
    routes = {n for n in graph if n.split(".")[:2] in (["hpx", "forks"], ["hpx", "engine"])}
    assert {"hpx.forks.search", "hpx.engine.facade"} <= routes
    assert _reach(graph, "hpx.checkpoint") & routes == set()
    # the check sees a route reached through another module
    chain = {"a": {"b"}, "b": {"hpx.forks.fork"}, "hpx.forks.fork": set()}
    assert _reach(chain, "a") == {"b", "hpx.forks.fork"}


def _spawns(fn: ast.FunctionDef, funcs: dict[str, ast.FunctionDef], seen: set[str]) -> bool:
    """Whether ``fn`` starts other processes: it calls ``run_distributed`` or ``subprocess``, or a
    function or fixture of the same file that does."""
    if any(s in ast.unparse(fn) for s in ("run_distributed(", "subprocess.")):
        return True
    called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    used = called | {a.arg for a in fn.args.args}  # a fixture is named by an argument
    return any(_spawns(funcs[n], funcs, seen | {n}) for n in used & funcs.keys() - seen)


def test_the_quick_subset_names_files_that_exist_and_starts_no_process() -> None:
    """``pytest -m quick`` (tests/conftest.py): every file it names exists, and every test there that
    starts other processes (``run_distributed``, a subprocess, or a fixture that does) is marked
    ``procs``, which keeps it out of the quick subset."""
    from tests.conftest import QUICK

    tests = ROOT / "tests"
    assert all((tests / name).is_file() for name in QUICK)
    for name in QUICK:
        tree = ast.parse((tests / name).read_text())
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for fn in funcs.values():
            if fn.name.startswith("test_") and _spawns(fn, funcs, {fn.name}):
                marks = {ast.unparse(d) for d in fn.decorator_list}
                assert "pytest.mark.procs" in marks, f"{name}::{fn.name} starts processes: mark it procs"
