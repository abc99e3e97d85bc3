"""jgraph's modules stand in layers and import only downward (STYLE rule 11).

`LAYERS` is the module map of docs/modules.md as data, bottom to top. Every `import` and
`from ... import` of every module of `jgraph/` (top-level and function-local, read with `ast`,
nothing imported) must name a module of a lower row; inside a package (`memory/`, `planner/`,
`vjp_rules/`, ...) its modules may import each other, but never in a circle and never the
package's own `__init__` (which sits above them and re-exports). A function-local import is
allowed only for an optional or heavy third-party package, each listed in `LOCAL_IMPORTS` with
its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "jgraph"

# Bottom to top. A name is a module or a package of `jgraph` (a package covers its modules); the
# most specific name applies (`training.demo` sits above `training`).
LAYERS = [
    ["errors", "config", "_jax_internals", "checkpoint"],   # nothing of jgraph
    ["ir"],                        # Var, Literal, Eqn, Graph; field checks; the text form
    ["ops", "opkinds", "plot", "target", "naming", "roles", "digest"],  # op tables; XLA per op;
    # targets; errors; which input each output updates; a graph's digest
    ["passes", "policies", "custom_lowering"],
    ["builder"],                   # the tracer's eqn builder and its handler table
    ["control_flow", "effects", "custom_derivatives"],   # tracer handlers and their ops
    ["check", "hi_primitives"],
    ["trace", "interpreter", "backward", "dot"],   # backward owns the VJP rule tables
    ["lower"],
    ["memory"],
    ["regions"],                   # the remat engine
    ["planner"],
    ["vjp_rules"],                 # rules registering into backward's tables
    ["fuse", "chunk"],             # below the floor: updates where gradients are made; rows chunked
    ["remat", "to_jax"],           # the public jg.remat, above the planner it drives
    ["dropin", "training", "testing"],
    ["__init__"],                  # the public names
    ["training.demo"],             # the demo: a user of `import jgraph as jg`
    ["__main__"],                  # python -m jgraph demo
]

# Function-local imports allowed: third-party packages that are optional or slow to import.
LOCAL_IMPORTS = {
    "scipy": "heavy: the exact planner's MILP only",
    "matplotlib": "optional (the demo extra): memory pictures",
    "hypothesis": "optional (the test extra): jg.testing's strategies",
    "equinox": "optional: jg.filter_value_and_grad",
    "sklearn": "optional (the demo extra): the digits data",
    "tqdm": "jg.fit's progress bar, imported when it is drawn",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> int:
    """The row of `name` (a module of jgraph, without the `jgraph.` prefix)."""
    best = None
    for row, names in enumerate(LAYERS):
        for entry in names:
            if name == entry or name.startswith(entry + "."):
                if best is None or len(entry) > len(best[1]):
                    best = (row, entry)
    if best is None:
        raise AssertionError(f"jgraph.{name} is in no row of LAYERS: add it to the table (and "
                             f"to docs/modules.md's module map)")
    return best[0]


def package_of(name: str) -> str | None:
    return name.split(".")[0] if "." in name else (name if name in _PACKAGES else None)


_PACKAGES = {n for n, p in MODULES.items() if p.name == "__init__.py" and n != "__init__"}


def _function_local(tree: ast.AST) -> set[int]:
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    return local


def jgraph_imports(source: str, name: str, is_package: bool):
    """(target module without `jgraph.`, line, function-local) for each import of jgraph."""
    tree = ast.parse(source)
    local = _function_local(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        is_local = id(node) in local
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = ["jgraph"] + ([] if name == "__init__" else name.split("."))
                base = base if is_package else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}".removeprefix("jgraph.")
                       in MODULES else module for a in node.names]
        for t in targets:
            found.append((t, node.lineno, is_local))
    return found


def edges_and_problems(sources: dict[str, tuple[str, bool]]):
    """({module: {imported jgraph modules}}, [problem text]) for modules given as
    {name: (source, is_package)}."""
    edges: dict[str, set[str]] = {n: set() for n in sources}
    problems = []
    for name, (source, is_package) in sources.items():
        where = f"jgraph/{name.replace('.', '/')}{'/__init__' if is_package else ''}.py"
        for target, line, local in jgraph_imports(source, name, is_package):
            top = target.split(".")[0]
            if top != "jgraph":
                if local and not any(target == m or target.startswith(m + ".")
                                     for m in LOCAL_IMPORTS):
                    problems.append(f"{where}:{line}: function-local import of {target} (move it "
                                    "to the top, or list it in LOCAL_IMPORTS with a reason)")
                continue
            if local:
                problems.append(f"{where}:{line}: function-local import of {target}: a jgraph "
                                "import goes at the top of the module (STYLE rule 11)")
            mod = target.removeprefix("jgraph").removeprefix(".") or "__init__"
            while mod not in sources and "." in mod:
                mod = mod.rsplit(".", 1)[0]
            if mod == name or mod not in sources:
                continue
            edges[name].add(mod)
            same_package = package_of(name) is not None and package_of(name) == package_of(mod)
            if same_package:
                if mod == package_of(name):
                    problems.append(f"{where}:{line}: imports its own package's __init__ "
                                    f"(jgraph.{mod}), which sits above its modules")
                continue
            if layer_of(mod) >= layer_of(name):
                problems.append(
                    f"{where}:{line}: imports jgraph.{mod} (row {layer_of(mod)} of LAYERS) "
                    f"from row {layer_of(name)}: imports go to lower rows only")
    return edges, problems


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _sources():
    return {n: (p.read_text(), p.name == "__init__.py") for n, p in MODULES.items()}


def test_every_module_has_a_row():
    for name in MODULES:
        layer_of(name)


def test_imports_go_down_the_layers_with_no_circles():
    edges, problems = edges_and_problems(_sources())
    problems += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, planted, expected", [
    ("ir", "from jgraph.backward import backward", "imports jgraph.backward (row 7"),
    ("planner.fast", "from jgraph.remat import remat", "imports jgraph.remat (row 14"),
    ("lower", "def f():\n    from jgraph import memory", "function-local import of jgraph.memory"),
    ("memory.step", "from jgraph.memory import memory", "its own package's __init__"),
    ("plot", "def f():\n    import pandas", "function-local import of pandas"),
], ids=["upward", "upward-from-package", "function-local", "own-package", "local-third-party"])
def test_a_planted_bad_import_fails(module, planted, expected):
    sources = _sources()
    _, problems = edges_and_problems(sources)
    assert not any(expected in p for p in problems)
    source, is_package = sources[module]
    sources[module] = (source + "\n" + planted + "\n", is_package)
    _, problems = edges_and_problems(sources)
    assert any(expected in p for p in problems), problems


def test_a_planted_circle_inside_a_package_is_found():
    sources = _sources()
    source, is_package = sources["planner.cost"]
    sources["planner.cost"] = (source + "\nfrom jgraph.planner import search\n", is_package)
    edges, _ = edges_and_problems(sources)
    assert any("planner.cost" in c and "planner.search" in c for c in circles(edges))
