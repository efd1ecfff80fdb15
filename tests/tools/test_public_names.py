"""tools/*.py use only the package's public names: no `from longstraw_jax... import _x`, no `import
longstraw_jax._x`, no `<package name>._x` attribute (nor `getattr(<package name>, "_x")`). What the tools lower ahead
of time is public for that reason (`train.jitted_train_step_donated`, `engine.capture.jitted_capture_on_mesh`,
`engine.local.jitted_grpo_grads`, ...). The checker itself is tested on synthetic sources first.

A "package name" is any name an import of `longstraw_jax` binds (module level or function-local, with or without
`as`), and any name or `self.<attr>` assigned from an expression rooted at one (`self.cap = capacity`). Dunder
attributes (`__wrapped__`, `__file__`) are Python's, not the package's, and are allowed. Strings and docstrings are
not code: a docstring may still tell the history of a renamed function.

Nor do the tools edit `sys.path`: they import the installed package (PYTHONPATH picks another checkout), their
siblings as `python tools/NAME.py` finds them (tools/ is first on sys.path), and tools/bench_step.py's children import
its snapshot through their PYTHONPATH.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = "longstraw_jax"
TOOLS = Path(ROOT) / "tools"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> tuple[str, ...] | None:
    """`a.b.c` -> ("a", "b", "c"); None unless the expression is a Name followed by attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return (node.id, *reversed(parts))


def _bound_prefix(chain: tuple[str, ...] | None, bound: set[tuple[str, ...]]) -> int:
    """Length of the longest prefix of `chain` that names a package object, 0 if none."""
    if chain is None:
        return 0
    return max((n for n in range(1, len(chain) + 1) if chain[:n] in bound), default=0)


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every use of a private name of the package in a Python source, as "file:line: what" (empty: none)."""
    tree = ast.parse(source, filename)
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != PACKAGE:
                    continue
                if any(_private(p) for p in parts):
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
                bound.add((alias.asname,) if alias.asname else (parts[0],))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == PACKAGE:
            if any(_private(p) for p in node.module.split(".")):
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
                bound.add((alias.asname or alias.name,))
    # names assigned from package objects are package objects too (to a fixpoint: assignments may chain)
    assignments = [node for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value]
    while True:
        before = len(bound)
        for node in assignments:
            if _bound_prefix(_chain(node.value), bound):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    elements = target.elts if isinstance(target, ast.Tuple) else [target]
                    bound.update(c for c in map(_chain, elements) if c is not None and len(c) <= 2)
        if len(bound) == before:
            break
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # the whole chain a.b.c, once
            chain = _chain(node)
            n = _bound_prefix(chain, bound)
            if n and any(_private(p) for p in chain[n:]):
                found.append(f"{filename}:{node.lineno}: {'.'.join(chain)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value) \
                and _bound_prefix(_chain(node.args[0]), bound):
            found.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return sorted(set(found))


@pytest.mark.parametrize("source", [
    "from longstraw_jax.engine import _grpo_grads",
    "from longstraw_jax import (\n    models,\n    _private as p,\n)",
    "import longstraw_jax._internal",
    "from longstraw_jax._internal import thing",
    "from longstraw_jax.sharding import prompt as api\napi._capture.lower(1)",
    "import longstraw_jax.train\nlongstraw_jax.train._STATIC",
    "import longstraw_jax as lj\nlj.train._train_step.__wrapped__",
    "def f():\n    from longstraw_jax import train\n    return jax.jit(train._step, static_argnums=train._STATIC)",
    "class C:\n    def __init__(self):\n        from longstraw_jax import capacity\n        self.cap = capacity\n"
    "    def f(self, c):\n        return self.cap._memory_total(c)",
    "from longstraw_jax import train\nstep = train.jitted_train_step\nalias = step\nalias._cache_size()",
    "from longstraw_jax import train\ngetattr(train, '_step')",
])
def test_checker_finds_a_private_use(source):
    found = private_uses(source, "offender.py")
    assert found and all(line.startswith("offender.py:") for line in found), found


@pytest.mark.parametrize("source", [
    "from longstraw_jax import train\ntrain.jitted_train_step_donated.lower(1)",
    "from longstraw_jax.engine.capture import jitted_capture_on_mesh\njitted_capture.__wrapped__",
    "import os\nos._exit(0)",  # not the package's
    "import jax\njax.jit(f)._cache_size()",
    "import numpy as np\nfrom longstraw_jax import models\nx = np.zeros(3)\nx._private",
    '"""History: this used `train._step`, now `train.jitted_train_step_donated`."""',
    "from longstraw_jax import train\nname = '_step'",
    "import longstraw_jax\nlongstraw_jax.__file__",
])
def test_checker_allows_public_and_foreign_names(source):
    assert private_uses(source) == []


def test_checker_reports_the_line():
    source = "import os\n\nfrom longstraw_jax.sharding import prompt\n\nprompt._capture\n"
    assert private_uses(source, "t.py") == ["t.py:5: prompt._capture"]


def _tool_files() -> list[Path]:
    files = sorted(TOOLS.glob("*.py"))
    names = {path.name for path in files}
    assert {"plan_capacity.py", "bench_harness.py", "bench_step.py", "bench_device.py"} <= names, names
    return files


_LIST_EDITS = ("append", "clear", "extend", "insert", "pop", "remove")


def sys_path_edits(source: str, filename: str = "<source>") -> list[str]:
    """Every change of `sys.path` in a Python source (a call of a list method that changes it, an assignment), as
    "file:line: what", in line order."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        chain = _chain(node.func) if isinstance(node, ast.Call) else None
        if chain and len(chain) == 3 and chain[:2] == ("sys", "path") and chain[2] in _LIST_EDITS:
            found.append((node.lineno, f"{'.'.join(chain)}(...)"))
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_chain(t) == ("sys", "path") for t in targets):
                found.append((node.lineno, "sys.path = ..."))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def test_tools_use_only_public_names():
    files = _tool_files()
    found = [line for path in files for line in private_uses(path.read_text(), f"tools/{path.name}")]
    assert found == [], "\n".join(found)


def test_tools_do_not_edit_sys_path():
    assert sys_path_edits("import sys, os\nsys.path.insert(0, os.getcwd())\nsys.path += ['x']", "t.py") == [
        "t.py:2: sys.path.insert(...)", "t.py:3: sys.path = ..."]
    assert sys_path_edits("import sys\nprint(sys.path[0], sys.path.index('x'))\nsys.argv.insert(1, 'x')") == []
    found = [line for path in _tool_files() for line in sys_path_edits(path.read_text(), f"tools/{path.name}")]
    assert found == [], "\n".join(found)
