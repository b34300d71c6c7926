"""The layering rule, read off the source ([docs/architecture.md](../../docs/architecture.md)): imports point down.

Every ``import`` the package runs (at module level or inside a function) is an edge of a graph over its modules:
the graph has no cycle, nothing under ``lightning_chunk/engine`` imports the Lightning side of the package
(``strategy``, ``precision``, ...) or Lightning itself, and the engine's sub-packages import only the layers below
their own (``LAYERS``). An import under ``if TYPE_CHECKING:`` is for annotations
only (a manager's reducer names the manager it serves) and runs nothing, so it is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_chunk"


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports when it runs (``TYPE_CHECKING`` blocks left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        for b in node.body
        for n in ast.walk(b)
    }
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            out.update(subs if len(subs) == len(node.names) else [*subs, base])
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_package_s_imports_have_no_cycle():
    assert cycles(graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_engine_imports_nothing_above_it():
    edges = graph()
    engine = {m for m in edges if m.startswith("lightning_chunk.engine")}
    upward = {m: sorted(t for t in edges[m] if t not in engine) for m in engine}
    assert {m: t for m, t in upward.items() if t} == {}
    for m in engine:
        tree = ast.parse(modules()[m].read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not {x for x in names if x.split(".")[0] in ("lightning", "pytorch_lightning")}, m


# The engine's layers, bottom first: a module imports modules of its own unit or of a lower layer only. Units that
# share a layer do not import each other. A new sub-package or a new module at the engine's root goes in here.
LAYERS: list[tuple[str, ...]] = [
    ("system",),
    ("errors",),
    ("config", "files"),
    ("chunks",),
    ("tiers",),
    ("comm",),
    ("schedule",),
    ("memory",),
    ("optim", "state"),
    ("runtime",),
]
RANK = {unit: n for n, units in enumerate(LAYERS) for unit in units}
ENGINE = "lightning_chunk.engine"


def unit(module: str) -> str:
    """``lightning_chunk.engine.chunks.repack`` -> ``chunks``; ``lightning_chunk.engine.config`` -> ``config``."""
    return module[len(ENGINE) + 1 :].split(".")[0]


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Each import of an engine module that does not point to its own unit or a lower layer."""
    bad = []
    for m, targets in edges.items():
        if not m.startswith(ENGINE + ".") or m == ENGINE:
            continue
        for t in sorted(targets):
            if t.startswith(ENGINE + ".") and unit(t) != unit(m) and RANK[unit(t)] >= RANK[unit(m)]:
                bad.append(f"{m} imports {t}: layer {RANK[unit(m)]} ({unit(m)}) reaching {RANK[unit(t)]} ({unit(t)})")
    return bad


def test_every_engine_module_belongs_to_a_layer():
    engine = [m for m in modules() if m.startswith(ENGINE + ".")]
    assert sorted({unit(m) for m in engine} - set(RANK)) == []
    assert sorted(set(RANK) - {unit(m) for m in engine}) == []  # no layer left empty


def test_the_engine_s_sub_packages_import_only_the_layers_below():
    assert upward(graph()) == []


def test_the_layer_check_sees_an_upward_or_sideways_import():
    edges = {
        f"{ENGINE}.chunks.chunk": {f"{ENGINE}.chunks.states", f"{ENGINE}.errors"},  # same unit, below: fine
        f"{ENGINE}.tiers.storage": {f"{ENGINE}.memory.manager"},  # up
        f"{ENGINE}.optim.binding": {f"{ENGINE}.state.checkpoint"},  # sideways
    }
    assert [b.split(":")[0] for b in upward(edges)] == [
        f"{ENGINE}.tiers.storage imports {ENGINE}.memory.manager",
        f"{ENGINE}.optim.binding imports {ENGINE}.state.checkpoint",
    ]
