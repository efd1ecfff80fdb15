"""The package's import structure: no import cycles, and the layers (`LAYERS`: each module imports only from its own
floor or lower ones, plus the named rules the architecture states); the checkers themselves on tiny synthetic
packages.

Every module is parsed with `ast`; its imports anywhere in the file count (module level and function-local: a
function-local import hides a cycle rather than removing it), except those under `if TYPE_CHECKING:`. An import
becomes edges of the package-internal graph as Python executes it:

- `import a.b.c` / `from a.b import c`: runs a/__init__.py, a/b/__init__.py, then a/b/c.py (if c is a module), so
  there are edges to each of those packages and modules, but
- not to the importer's own ancestor packages: those are already running when the importer runs, and a package's
  __init__ importing its children is the normal structure, not a cycle. Except when the importer takes a name
  from an ancestor's __init__ (`from longstraw_jax.tasks import Prompt` in tasks/retrieval.py): a name defined in
  that __init__ is an edge to it; a name it re-exports from elsewhere (`from x import Prompt` there) is an edge to
  where it comes from, followed through further re-exports.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "longstraw_jax"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE


@dataclass
class Module:
    name: str
    path: str  # relative to the package's parent directory, for messages
    is_package: bool
    tree: ast.Module = field(repr=False)

    def ancestors(self) -> list[str]:
        """The packages above this module, outermost first (not the module itself, even for a package)."""
        parts = self.name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]


def load_package(package_dir: Path, package: str) -> dict[str, Module]:
    """Every .py file under package_dir (a package named `package`), parsed: {dotted name: Module}."""
    modules = {}
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if (Path(root) / d / "__init__.py").exists())
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = Path(root) / file
            parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            rel = path.relative_to(package_dir.parent).as_posix()
            modules[".".join(parts)] = Module(".".join(parts), rel, is_package, ast.parse(path.read_text(), rel))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(nodes):
    """Every Import / ImportFrom node in or below `nodes` (function bodies included), but not in the body of an
    `if TYPE_CHECKING:` (its else branch counts)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The module an ImportFrom reads from, relative imports resolved."""
    if not node.level:
        return node.module
    parts = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_bindings(module: Module, package: str) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """(names the module binds itself, {name: (module, name) it re-exports by `from module import name`}),
    from the module body and the bodies of top-level if / try / with blocks (not of functions or classes); `module`
    is `package` or inside it, re-exports from outside `package` count as the module's own names."""
    defined, reexported = set(), {}

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import):
                defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                for alias in node.names:
                    if alias.name == "*" or source.split(".")[0] != package:
                        defined.add(alias.asname or alias.name)
                    else:
                        reexported[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(module.tree.body)
    return defined, reexported


def import_graph(modules: dict[str, Module], package: str) -> dict[str, dict[str, str]]:
    """{importer: {imported: where (file:line of the first import that makes the edge)}} over the modules of
    `package` (from load_package)."""
    bindings = {name: _top_level_bindings(m, package) for name, m in modules.items() if m.is_package}

    def name_source(package_name: str, name: str, seen=()) -> str:
        """The module that a name taken from a package's __init__ really comes from (re-exports followed)."""
        defined, reexported = bindings[package_name]
        if name in defined or name not in reexported or package_name in seen:
            return package_name
        source, original = reexported[name]
        if f"{source}.{original}" in modules:
            return f"{source}.{original}"
        if source in bindings:
            return name_source(source, original, (*seen, package_name))
        return source

    graph = {name: {} for name in modules}
    for name, module in modules.items():
        own_ancestors = set(module.ancestors())

        def add(target: str, node: ast.AST):
            """An edge to `target` (an internal module) and to its packages that are not already running."""
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in modules and step != name and step not in own_ancestors:
                    graph[name].setdefault(step, f"{module.path}:{node.lineno}")

        for node in _imports(module.tree.body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        add(alias.name, node)
                continue
            source = _absolute(module, node)
            if source.split(".")[0] != package:
                continue
            add(source, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:  # a submodule
                    add(f"{source}.{alias.name}", node)
                elif source in own_ancestors and alias.name != "*":  # a name from a running ancestor's __init__
                    origin = name_source(source, alias.name)
                    if origin == source:
                        graph[name].setdefault(source, f"{module.path}:{node.lineno}")
                    else:
                        add(origin, node)
                elif source in own_ancestors:
                    graph[name].setdefault(source, f"{module.path}:{node.lineno}")
    return graph


def cyclic_components(graph: dict[str, dict[str, str]]) -> list[set[str]]:
    """The strongly connected components that hold a cycle (Tarjan's algorithm, iterative), by smallest name."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(component)
    return sorted(components, key=min)


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] per strongly connected component that has one."""
    return [_cycle_in(graph, component) for component in cyclic_components(graph)]


def _cycle_in(graph, component) -> list[str]:
    """A shortest cycle through the component's smallest name (breadth-first search back to it)."""
    start = min(component)
    parent, frontier = {}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def describe(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def cycles_of(package_dir: Path, package: str) -> list[list[str]]:
    return find_cycles(import_graph(load_package(package_dir, package), package))


# ----- the package -------------------------------------------------------------------------------------------------


def test_longstraw_jax_has_no_import_cycles():
    modules = load_package(PACKAGE_DIR, PACKAGE)
    assert f"{PACKAGE}.engine.mesh" in modules and f"{PACKAGE}.models.hf" in modules
    graph = import_graph(modules, PACKAGE)
    report = []
    for component in cyclic_components(graph):
        cycle = _cycle_in(graph, component)
        others = sorted(component - set(cycle))
        report.append(describe(graph, cycle) + (f"\n    (same cycle group: {', '.join(others)})" if others else ""))
    assert not report, "import cycles, as module (file:line of the import) -> ...:\n" + "\n".join(report)


# ----- layers ------------------------------------------------------------------------------------------------------

# Floors of the package, bottom to top (docs/architecture.md 3). A module belongs to the floor of the longest entry
# that is its dotted name or a package above it ("" is the package's own __init__.py). A module may import from its
# own floor and the floors below; an import of a higher floor points upward.
LAYERS = (
    ("ops", "common"),                   # kernels; host-side checks and progress ticks from compiled loops
    ("adapters",),                       # the trainable / frozen split of a parameter tree, LoRA
    ("sharding",),                       # mesh primitives
    ("grpo",),                           # the objective
    ("engine",),                         # the method: capture, replay, block-by-block backward, grpo_grads, oracle
    ("models",),                         # the families (plugged into the engine), their HF I/O, mesh adapters
    ("agents",),                         # the environment protocol of agent branches, called from the host
    ("sampling", "train"),               # sampling from a captured state (agent branches too); the optimizer step
    ("tasks",),                          # prompts and rewards
    ("capacity", "plan"),                # the capacity planner (plan: its `python -m` entry)
    ("io",),                             # conversion, checkpoints, PEFT export
    ("trainer",),                        # the command-line application
    ("", "run", "evaluate", "launch", "convert", "pretrain"),  # the package's __init__, the `python -m` entries
)
# Named rules, each (importer prefix, forbidden imported prefix, why); implied by LAYERS, stated as the architecture
# states them so that a change of LAYERS cannot silently drop one.
FORBIDDEN = (
    ("ops", "", "ops imports nothing of ours outside ops"),
    ("sharding", "engine", "mesh primitives know no engine"),
    ("sharding", "models", "mesh primitives know no model family"),
    ("engine", "models", "the engine never imports a model: families plug in through models/base.py's protocols"),
    ("models", "trainer", "models never import the trainer"),
    ("models", "io", "models never import io"),
    ("io", "trainer", "io never imports the trainer"),
)
# may import trainer; the rest of the library not
LIBRARY_EXCEPTIONS = ("trainer", "", "run", "evaluate", "launch", "pretrain")


def _within(name: str, prefix: str, package: str) -> bool:
    full = f"{package}.{prefix}" if prefix else package
    return name == full or (name.startswith(full + ".") if prefix else True)


def floor_of(name: str, package: str, layers=LAYERS) -> int:
    """The floor of module `name` (dotted, starting with `package`): the longest matching entry wins."""
    relative = name[len(package) + 1:] if name != package else ""
    best, floor = -1, None
    for level, entries in enumerate(layers):
        for entry in entries:
            hit = relative == entry or (entry and relative.startswith(entry + "."))
            if hit and len(entry) > best:
                best, floor = len(entry), level
    if floor is None:
        raise AssertionError(f"{name} is on no floor of LAYERS: add it")
    return floor


def layer_violations(graph: dict[str, dict[str, str]], package: str, layers=LAYERS, forbidden=FORBIDDEN,
                     library_exceptions=LIBRARY_EXCEPTIONS) -> list[str]:
    """Every import that points upward, breaks a named rule, or brings the trainer into the library, as lines
    `importer -> imported (file:line): why`."""
    problems = []
    for importer, edges in sorted(graph.items()):
        for imported, where in sorted(edges.items()):
            up, down = floor_of(importer, package, layers), floor_of(imported, package, layers)
            if down > up:
                problems.append(f"{importer} -> {imported} ({where}): points upward (floor {up} imports floor {down})")
            for src, dst, why in forbidden:
                outside_own = not (src and _within(imported, src, package))
                if _within(importer, src, package) and _within(imported, dst, package) and outside_own:
                    problems.append(f"{importer} -> {imported} ({where}): {why}")
            if (_within(imported, "trainer", package)
                    and not any(_within(importer, e, package) if e else importer == package
                                for e in library_exceptions)):
                problems.append(f"{importer} -> {imported} ({where}): the library never imports the trainer")
    return problems


def test_longstraw_jax_layers():
    modules = load_package(PACKAGE_DIR, PACKAGE)
    graph = import_graph(modules, PACKAGE)
    for name in modules:
        floor_of(name, PACKAGE)  # every module is on a floor
    problems = layer_violations(graph, PACKAGE)
    assert not problems, "layering broken:\n" + "\n".join(problems)


ROOT_MODULES = {"__init__", "grpo", "train", "run", "evaluate", "launch", "convert", "plan", "pretrain"}


def test_the_package_root_holds_the_objective_the_step_and_the_entry_modules_only():
    """`ls longstraw_jax` shows the architecture: everything else lives in a folder (docs/architecture.md 3)."""
    assert {path.stem for path in PACKAGE_DIR.glob("*.py")} == ROOT_MODULES


# ----- the cycle finder on synthetic packages -----------------------------------------------------------------------


def write(root: Path, files: dict[str, str]) -> Path:
    """Files under root/pkg (with an empty __init__.py wherever one is not given); returns root/pkg."""
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for parent in [path.parent, *path.parent.parents]:
            if parent == root:
                break
            (parent / "__init__.py").touch()
    return root / "pkg"


def test_finds_a_cycle_through_a_function_local_import(tmp_path):
    pkg = write(tmp_path, {
        "a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from pkg import a  # function-local: still a cycle\n    return a\n",
        "c.py": "import pkg.a\n",
    })
    assert cycles_of(pkg, "pkg") == [["pkg.a", "pkg.b", "pkg.a"]]


def test_acyclic_package_with_its_init_importing_its_children_is_not_flagged(tmp_path):
    pkg = write(tmp_path, {
        "__init__.py": "from pkg.core import Thing\nfrom pkg import sub\nVERSION = 1\n",
        "core.py": "import numpy as np\n\nclass Thing: ...\n",
        "sub/__init__.py": "from .leaf import leaf\nfrom . import other\n",
        "sub/leaf.py": "from pkg import Thing  # re-exported by pkg/__init__.py from pkg.core\n"
                       "from ..core import Thing as T\nfrom pkg.sub import other\n\ndef leaf(): ...\n",
        "sub/other.py": "import pkg.core\n",
    })
    graph = import_graph(load_package(pkg, "pkg"), "pkg")
    assert graph["pkg.sub.leaf"] == {"pkg.core": "pkg/sub/leaf.py:1", "pkg.sub.other": "pkg/sub/leaf.py:3"}
    assert graph["pkg.sub"] == {"pkg.sub.leaf": "pkg/sub/__init__.py:1",
                              "pkg.sub.other": "pkg/sub/__init__.py:2"}
    assert find_cycles(graph) == []


def test_a_name_defined_in_an_ancestor_init_that_imports_the_child_is_a_cycle(tmp_path):
    """The tasks/__init__.py <-> tasks/retrieval.py shape: the child needs a class defined in the __init__, which
    imports the child (here in a function); and the child's parent package reached through a sibling."""
    pkg = write(tmp_path, {
        "tasks/__init__.py": "class Prompt: ...\n\ndef build():\n    from pkg.tasks.retrieval import Task\n",
        "tasks/retrieval.py": "from . import Prompt\n\nclass Task: ...\n",
        "x/__init__.py": "from pkg.y import z\n",
        "x/w.py": "",
        "y.py": "import pkg.x.w  # runs pkg/x/__init__.py first, which imports pkg.y\n\nz = 1\n",
    })
    cycles = cycles_of(pkg, "pkg")
    assert cycles == [["pkg.tasks", "pkg.tasks.retrieval", "pkg.tasks"], ["pkg.x", "pkg.y", "pkg.x"]]


def test_type_checking_imports_and_external_imports_are_not_edges(tmp_path):
    pkg = write(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from pkg import b\n"
                "else:\n    import json\n",
        "b.py": "from pkg import a\n",
    })
    graph = import_graph(load_package(pkg, "pkg"), "pkg")
    assert graph["pkg.a"] == {} and graph["pkg.b"] == {"pkg.a": "pkg/b.py:1"}
    assert find_cycles(graph) == []


# ----- the layer checker on a synthetic package ---------------------------------------------------------------------


SYNTHETIC_LAYERS = (("ops", "validation"), ("engine",), ("models",), ("io",), ("trainer",), ("",))


def test_layer_checker_accepts_a_package_that_keeps_its_floors(tmp_path):
    pkg = write(tmp_path, {
        "ops/kernel.py": "from pkg.ops import other\n", "ops/other.py": "import numpy\n",
        "validation.py": "", "engine.py": "from pkg.ops.kernel import f\nfrom pkg import validation\n",
        "models/net.py": "from pkg import engine\n", "io/save.py": "from pkg.models.net import Net\n",
        "trainer/cli.py": "from pkg import engine\nfrom pkg.io import save\n",
        "__init__.py": "from pkg import engine\n",
    })
    graph = import_graph(load_package(pkg, "pkg"), "pkg")
    assert layer_violations(graph, "pkg", SYNTHETIC_LAYERS) == []


def test_layer_checker_flags_each_broken_rule(tmp_path):
    pkg = write(tmp_path, {
        "ops/kernel.py": "from pkg import validation\n",         # same floor, but ops imports nothing of ours
        "validation.py": "",
        "engine.py": "def f():\n    from pkg.models.net import g  # upward, function-local\n",
        "models/net.py": "from pkg.trainer import cli\n",        # the library imports the trainer
        "io/save.py": "import pkg.trainer.cli\n",                # io imports the trainer
        "trainer/cli.py": "",
    })
    graph = import_graph(load_package(pkg, "pkg"), "pkg")
    problems = layer_violations(graph, "pkg", SYNTHETIC_LAYERS)
    text = "\n".join(problems)
    assert "pkg.ops.kernel -> pkg.validation (pkg/ops/kernel.py:1): ops imports nothing of ours outside ops" in text
    assert "pkg.engine -> pkg.models.net (pkg/engine.py:2): points upward (floor 1 imports floor 2)" in text
    assert "pkg.engine -> pkg.models.net (pkg/engine.py:2): the engine never imports a model" in text
    assert "pkg.models.net -> pkg.trainer.cli (pkg/models/net.py:1): points upward" in text
    assert "pkg.models.net -> pkg.trainer.cli (pkg/models/net.py:1): models never import the trainer" in text
    assert "pkg.models.net -> pkg.trainer.cli (pkg/models/net.py:1): the library never imports the trainer" in text
    assert "pkg.io.save -> pkg.trainer.cli (pkg/io/save.py:1): io never imports the trainer" in text
    assert len([p for p in problems if "pkg.trainer (" in p or "-> pkg.trainer.cli" in p]) >= 4


def test_a_module_on_no_floor_is_an_error(tmp_path):
    pkg = write(tmp_path, {"stray.py": ""})
    modules = load_package(pkg, "pkg")
    with pytest.raises(AssertionError, match="pkg.stray is on no floor"):
        floor_of("pkg.stray", "pkg", SYNTHETIC_LAYERS)
    assert set(modules) == {"pkg", "pkg.stray"}
