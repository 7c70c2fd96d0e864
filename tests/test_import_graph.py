"""The import graph of `modular` and `planners`: no cycles, and `planners` stays pure; and the
benchmarks and examples stand apart from the tests.

Pure and single-process: the graph is read from the source with `ast`, nothing is imported. An
edge A -> B is an import in A's file of module B (`from pkg import name` is an edge to
`pkg.name` when that is a module, else to `pkg`), wherever it stands: inside a function or under
`if TYPE_CHECKING` too, since a lazy import that only dodges a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("modular", "planners")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` names module a.b.c; keep the longest prefix that is one of ours
            parts = target.split(".")
            for k in range(len(parts), 0, -1):
                candidate = ".".join(parts[:k])
                if candidate in modules:
                    if candidate != name:
                        found.add(candidate)
                    break
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _graph()
    assert len(graph) > 30, f"read only {len(graph)} modules: the walk is broken"
    cycles = _cycles(graph)
    described = [
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_importing_planners_imports_no_torch() -> None:
    """The planner is pure Python data: `import planners` (and its CLI) loads neither torch nor
    modular; only the TorchRec conversions import torchrec's types, inside the call."""
    code = (
        "import sys, planners, planners.__main__; "
        "print(sorted(m for m in ('torch', 'torch.distributed', 'torchrec', 'modular') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"import planners loaded {out.stdout.strip()}"


def test_modular_never_imported_by_planners() -> None:
    bad = []
    for path in sorted((ROOT / "planners").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "modular" or n.startswith("modular.") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"planners imports modular at {bad}: plans are data, modular applies them"


def _lines_importing(source: str, packages: tuple[str, ...]) -> list[int]:
    """The lines of `source` that import a module of one of `packages`, wherever they stand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        if any(n.split(".")[0] in packages for n in names):
            found.append(node.lineno)
    return found


def test_benchmarks_and_examples_import_no_test_module() -> None:
    """A benchmark or an example that imports tests/ runs only from a checkout with the test suite
    and drifts with it; what both need (a reference, a helper) lives outside tests/, which may
    import it. The examples stand alone: they import no benchmark either."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder, packages in (("benchmarks", ("tests",)), ("examples", ("tests", "benchmarks")))
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in _lines_importing(path.read_text(), packages)
    ]
    assert not bad, f"imports of tests/ (or, in examples/, of benchmarks/) at {bad}: move what they need out of tests/"


def test_the_import_finder_finds_imports_anywhere() -> None:
    source = (
        "import os\nfrom testsuite import x\nfrom tests.modular.ebc_cases import make_ebc\n"
        "def f():\n    import tests.dist as d\n    from . import tests\n"
    )
    assert _lines_importing(source, ("tests",)) == [3, 5]


def test_modular_files_stay_small() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "modular").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"files over 400 lines (split them by idea): {long}"


def _clashing_names(paths: list[Path]) -> dict[str, list[str]]:
    """File names (a leading underscore ignored, `__init__.py` apart) that two modules share."""
    seen: dict[str, list[str]] = {}
    for p in paths:
        if p.name != "__init__.py":
            seen.setdefault(p.name.lstrip("_"), []).append(str(p.relative_to(ROOT)))
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_modular_files_share_a_name() -> None:
    """A file name says one idea: `kernels/adam.py` beside `fused/adam.py` made a reader open both
    to learn which was the kernel and which the update (issue 50)."""
    clashes = _clashing_names(sorted((ROOT / "modular").rglob("*.py")))
    assert not clashes, f"modules sharing a file name (name each for its idea): {clashes}"


def test_the_name_check_finds_a_clash() -> None:
    paths = [ROOT / "modular/a/x.py", ROOT / "modular/b/_x.py", ROOT / "modular/a/__init__.py",
             ROOT / "modular/b/__init__.py", ROOT / "modular/y.py"]  # fmt: skip
    assert _clashing_names(paths) == {"x.py": ["modular/a/x.py", "modular/b/_x.py"]}
