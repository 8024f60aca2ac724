"""Import graph of `autoparallel/` and `solver/`: modules and packages import downwards only.

Every module is parsed with `ast` and every import it can run is collected: at module level and inside
functions alike (a function-level import that exists to break a circle is still a circle). Relative imports are
resolved; `from pkg import name` where `pkg.name` is a module imports that module, otherwise it imports
`pkg/__init__.py`. Importing `a.b.c` also runs the `__init__` of the packages `a.b` and `a` that hold it, so
it counts as importing them too, except those that hold the importing module itself (they are already running).
A package `__init__` that re-exports its submodules therefore closes a circle with every module outside the
package that it reaches and that imports any of the package's submodules.

Imports under `if TYPE_CHECKING:` count too: they never run, but they are a dependency all the same (the type
checker and the reader follow them), and a circle through them is a layering circle. A module that annotates with
something from above it uses a Protocol defined at or below its own level instead.

Two checks:
- the module graph has no strongly connected component of more than one module (nor a module importing itself);
- within every package, the graph between its direct children (submodules, subpackages and its own
  `__init__`) is a DAG: an import of `a` from `b` is an edge between the children of their nearest common
  package that hold them. This is the package order (capture, options, problem, ...), on top of the module one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autoparallel", "solver")
INIT = "__init__"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == INIT:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom anywhere in the module: module level, functions, `if TYPE_CHECKING:` bodies."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _imported_modules(name: str, source: str, is_package: bool, modules) -> set[str]:
    """The project modules (names in `modules`) that module `name`, whose text is `source`, imports."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
            continue
        if node.level:
            base_parts = package.split(".")
            if node.level > 1:
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                found.add(sub)
            elif base in modules:
                found.add(base)
    return found


def _holding_packages(module: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]: the packages whose `__init__` runs before `a.b.c` does."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(sources: dict[str, tuple[str, bool]] | None = None) -> nx.DiGraph:
    """Module -> the modules it imports. ``sources``: module name -> (text, is a package's __init__);
    default: every module of PACKAGES."""
    if sources is None:
        sources = {name: (path.read_text(), path.name == f"{INIT}.py") for name, path in _modules().items()}
    modules = set(sources)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, (source, is_package) in sources.items():
        for target in _imported_modules(name, source, is_package, modules):
            graph.add_edge(name, target)
            for package in _holding_packages(target):
                if package in modules and not (name == package or name.startswith(package + ".")):
                    graph.add_edge(name, package)
    return graph


def _is_package(name: str, modules: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in modules)


def _child_under(package: str, module: str) -> str:
    """The direct child of `package` that holds `module` (`package.__init__` for the package itself)."""
    if module == package:
        return f"{package}.{INIT}"
    if not package:
        return module.split(".")[0]
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def _holding_package(a: str, b: str, modules: set[str]) -> str:
    """The nearest package holding both modules ('' above the top-level packages)."""
    pa, pb = a.split("."), b.split(".")
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    while common and not _is_package(".".join(common), modules):
        common.pop()
    return ".".join(common)


def package_graphs(graph: nx.DiGraph) -> dict[str, nx.DiGraph]:
    """Per package, the graph between its direct children induced by the module imports."""
    modules = set(graph.nodes)
    per_package: dict[str, nx.DiGraph] = {}
    for a, b in graph.edges:
        holder = _holding_package(a, b, modules)
        ca, cb = _child_under(holder, a), _child_under(holder, b)
        if ca != cb:
            per_package.setdefault(holder or "<root>", nx.DiGraph()).add_edge(ca, cb, via=(a, b))
    return per_package


def _describe(component: set[str], graph: nx.DiGraph) -> str:
    members = sorted(component)
    cycle = nx.find_cycle(graph.subgraph(component))
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    return f"{len(members)} modules: {', '.join(members)}\n    e.g. {path}"


def module_circles(graph: nx.DiGraph) -> list[set[str]]:
    circles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    circles += [{n} for n in graph.nodes if graph.has_edge(n, n)]
    return sorted(circles, key=lambda c: sorted(c))


def test_no_module_import_circles():
    graph = import_graph()
    circles = module_circles(graph)
    report = "\n".join(f"  {_describe(c, graph)}" for c in circles)
    assert not circles, f"{len(circles)} import circles between modules:\n{report}"


def test_packages_import_downwards():
    graph = import_graph()
    problems = []
    for package, children in sorted(package_graphs(graph).items()):
        for component in nx.strongly_connected_components(children):
            if len(component) < 2:
                continue
            cycle = nx.find_cycle(children.subgraph(component))
            edges = "; ".join(f"{u} -> {v} (via {children.edges[u, v]['via'][0]})" for u, v in cycle)
            problems.append(f"  in {package}: {', '.join(sorted(component))}\n    e.g. {edges}")
    assert not problems, f"{len(problems)} import circles between packages:\n" + "\n".join(problems)


def test_checker_sees_function_level_and_relative_imports():
    """The collector counts imports inside functions and `if TYPE_CHECKING:` bodies and resolves relative
    imports (a submodule when the name is one, the package's __init__ otherwise)."""
    modules = {"p", "p.errors", "p.cost_model", "p.cost_model.comm", "p.x", "p.x.y", "p.late"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ..cost_model import comm, CONSTANT\n"
        "if TYPE_CHECKING:\n"
        "    from .. import late\n"
        "def f():\n"
        "    from .. import errors\n"
        "    import torch\n"
    )
    assert _imported_modules("p.x.y", source, False, modules) == {
        "p.cost_model.comm",
        "p.cost_model",
        "p.errors",
        "p.late",
    }
    assert _imported_modules("p.x", "from . import y\nfrom .y import z\n", True, modules) == {"p.x.y"}


def test_checker_finds_circles_through_package_inits_and_functions():
    """A package whose __init__ re-exports a module that imports (in a function) something that imports
    another of the package's modules: a circle through the __init__, and one between the packages."""
    sources = {
        "p": ("", True),
        "p.apply": ("from .fold import fold\nfrom .. import passes\n", True),
        "p.apply.fold": ("def fold():\n    pass\n", False),
        "p.passes": ("from .apply.fold import fold\n", False),
        "p.ok": ("def f():\n    from p.apply import fold\n", False),
    }
    graph = import_graph(sources)
    assert graph.has_edge("p.passes", "p.apply.fold") and graph.has_edge("p.passes", "p.apply")
    assert not graph.has_edge("p.apply.fold", "p.apply")  # a package's own modules do not re-run its __init__
    assert module_circles(graph) == [{"p.apply", "p.passes"}]
    assert set(package_graphs(graph)["p"].edges) == {
        ("p.apply", "p.passes"),
        ("p.passes", "p.apply"),
        ("p.ok", "p.apply"),
    }
    # The real tree has the edges the package order is about: the problem builder reads the options.
    real = import_graph()
    assert any(a.startswith("autoparallel.problem.") and b.startswith("autoparallel.options") for a, b in real.edges)
