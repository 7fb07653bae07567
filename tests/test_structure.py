"""The layout the architecture doc promises: no import circles in autopar, and a runtime that only runs
Programs (it imports none of capture, passes, solver, api or the compiler driver)."""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for base, pkg in ((ROOT / "autopar", "autopar"), (ROOT / "passes", "autopar.passes")):
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """autopar modules `path` imports, at module level or inside functions (lazy imports count: a circle
    through them is still a circle in the design)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != name:
                found.add(n)
    return found


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for dep in _imports(path, name, set(mods)):
            g.add_edge(name, dep)
    return g


# The data modules' thin views: `print(plan)`, plan.explain/diff/report/compare and `print(program)` call into
# the inspection package and recipes, lazily, inside the method. Every other edge counts.
VIEWS = {"autopar.plan": ("autopar.inspect", "autopar.recipes"), "autopar.program": ("autopar.inspect",)}


def test_no_import_circles():
    g = _graph()
    # A package's __init__ re-exporting its own submodules is not a circle of the design.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".") or a == "autopar"])
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(VIEWS.get(a, ("-",)))])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_runtime_only_runs_programs():
    g = _graph()
    forbidden = ("autopar.capture", "autopar.passes", "autopar.solver", "autopar.api", "autopar.compiler",
                 "autopar.plan_check")
    for mod in g.nodes:
        if mod.startswith("autopar.runtime"):
            bad = [d for d in g.successors(mod) if d.startswith(forbidden)]
            assert not bad, f"{mod} imports {bad}"


def test_plan_data_modules_import_no_pass():
    """rules, cost, plan, program, capture and codegen never import a pass (the passes depend on them)."""
    g = _graph()
    for mod in g.nodes:
        if mod.startswith(("autopar.rules", "autopar.cost", "autopar.plan", "autopar.program", "autopar.capture",
                           "autopar.codegen")) and mod != "autopar.plan_check":
            bad = [d for d in g.successors(mod) if d.startswith("autopar.passes")]
            assert not bad, f"{mod} imports {bad}"
