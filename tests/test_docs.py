"""Every file reference in the docs resolves: `path.py` names a file of the repository (from its root or from the
package's folder; a bare name must be one file only) or of Python's standard library, and `path.py:name` (or
`path.py:Class.method`) names something the file defines. The docs are docs/*.md and the README; a moved or
renamed file or function fails here until the docs follow it.

The code map of docs/architecture.md (section 3, one line per module) is checked the other way too: it lists every
module of the package and of tools/, and nothing that is not there.

The checkers themselves are tested on synthetic input."""
from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "longstraw_jax"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# a path of word characters and slashes ending in .py, optionally `:name` or `:Class.attr` (not part of a longer word,
# a URL or a dotted module name)
REFERENCE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?(?![\w/])")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "build", "out", "data"}
PLACEHOLDERS = {"myrewards.py"}  # a user's own file in an example, not one of ours
CODE_MAP = ROOT / "docs" / "architecture.md"
NAME_COLUMN = 20  # a code-map line whose text starts before this column names a file or folder; later: a description


def code_map_lines(text: str) -> range:
    """The line numbers (1-based) of the code map: the fenced block whose first line is `longstraw_jax/`."""
    lines = text.splitlines()
    start = lines.index("longstraw_jax/") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    return range(start, end + 1)


def code_map(text: str) -> set[str]:
    """The files the code map lists, as paths from the repository root (`run.py, plan.py` on one line: each)."""
    lines = text.splitlines()
    listed, folders = set(), []
    for number in code_map_lines(text):
        line = lines[number - 1]
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= NAME_COLUMN:
            continue
        names = re.match(r"[\w.-]+/|[\w.-]+\.py(?:, [\w.-]+\.py)*", line.strip()).group(0)
        depth = indent // 2
        folders = folders[:depth]
        if names.endswith("/"):
            folders.append(names.rstrip("/"))
            continue
        for name in names.split(","):
            listed.add("/".join([*folders, name.strip()]))
    return listed


def modules(root: Path) -> set[str]:
    """Every module of the package and of tools/, from the repository root; a package's `__init__.py` only when it
    defines something (a re-exporting `__init__.py` is its folder's line)."""
    found = set()
    for base in ("longstraw_jax", "tools"):
        for path in python_files(root / base):
            if path.name == "__init__.py" and path.parent != root / "longstraw_jax" and not any(
                    isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.parse(path.read_text()).body):
                continue
            found.add(path.relative_to(root).as_posix())
    return found


def references(text: str) -> list[tuple[int, str, str | None]]:
    """(line, path, name or None) for every reference in a document, outside the code map (checked on its own)."""
    found = []
    skip = code_map_lines(text) if "\nlongstraw_jax/\n" in text else range(0)
    for number, line in enumerate(text.splitlines(), 1):
        if number in skip:
            continue
        for match in REFERENCE.finditer(line):
            if match.group(1) in PLACEHOLDERS:
                continue
            found.append((number, match.group(1), match.group(2)))
    return found


def python_files(root: Path) -> list[Path]:
    files = []
    for path in root.rglob("*.py"):
        if not SKIPPED_DIRS & set(path.relative_to(root).parts[:-1]):
            files.append(path)
    return files


def resolve(path: str, root: Path, package: Path, files: list[Path]) -> Path | None:
    """The file a reference names: root/path, package/path, a standard-library module, or the one file whose
    trailing components are `path` (a bare `cost.py` in a section about capacity/); None if none or ambiguous."""
    for base in (root, package, Path(sysconfig.get_paths()["stdlib"])):
        if (base / path).is_file():
            return base / path
    parts = Path(path).parts
    matches = [f for f in files if f.parts[-len(parts):] == parts]
    return matches[0] if len(matches) == 1 else None


def defines(file: Path, name: str) -> bool:
    """Whether `file` defines `name` at module level (a function, class or assigned name), or `Class.attr`: a class
    with that method, property or class-level assignment."""
    tree = ast.parse(file.read_text())
    head, _, attr = name.partition(".")

    def names(body):
        out = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            out[n.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
        return out

    top = names(tree.body)
    if head not in top:
        return False
    if not attr:
        return True
    node = top[head]
    return isinstance(node, ast.ClassDef) and attr in names(node.body)


def broken_references(docs: list[Path], root: Path, package: Path) -> list[str]:
    files = python_files(root)
    problems = []
    for doc in docs:
        for line, path, name in references(doc.read_text()):
            where = f"{doc.relative_to(root)}:{line}"
            file = resolve(path, root, package, files)
            if file is None:
                problems.append(f"{where}: {path} is no file (or names several)")
            elif name and not defines(file, name):
                problems.append(f"{where}: {path} defines no {name}")
    return problems


def test_every_file_reference_in_the_docs_resolves():
    assert len(DOCS) >= 5
    problems = broken_references(DOCS, ROOT, PACKAGE)
    assert not problems, "stale references in the docs:\n" + "\n".join(problems)


def test_the_code_map_lists_every_module_and_only_those():
    listed, present = code_map(CODE_MAP.read_text()), modules(ROOT)
    assert len(present) > 100
    assert not present - listed, f"modules missing from the code map of {CODE_MAP.name}: {sorted(present - listed)}"
    assert not listed - present, f"the code map of {CODE_MAP.name} lists what is not there: {sorted(listed - present)}"


def test_the_code_map_parser():
    text = """# x
```
longstraw_jax/
  __init__.py           the API
  ops/                  numerics:
    attention.py        attention, continued on
                        the next line: not/a/file.py
  models/               models:
    qwen36/             one family:
      model.py          the model
  run.py, plan.py
                        entry modules
tools/
  bench.py              a benchmark
  a_very_long_name.py a name longer than its column
```
"""
    assert code_map(text) == {"longstraw_jax/__init__.py", "longstraw_jax/ops/attention.py",
                              "longstraw_jax/models/qwen36/model.py", "longstraw_jax/run.py", "longstraw_jax/plan.py",
                              "tools/bench.py", "tools/a_very_long_name.py"}
    assert references(text) == []


def test_the_checker_finds_stale_references(tmp_path):
    package = tmp_path / "pkg"
    (package / "engine").mkdir(parents=True)
    source = "class Engine:\n    def run(self): ...\n\nMODES = ()\n\ndef go(): ...\n"
    (package / "engine" / "local.py").write_text(source)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "bench.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "a.md"
    doc.write_text("`engine/local.py:go`, engine/local.py:Engine.run, `local.py:MODES`, tools/bench.py,\n"
                   "json/decoder.py, https://x.org/y.py, a.b.py\n"
                   "`engine.py`, engine/local.py:gone, engine/local.py:Engine.stop\n")
    assert [ref[1:] for ref in references(doc.read_text())[:3]] == [("engine/local.py", "go"),
                                                                    ("engine/local.py", "Engine.run"),
                                                                    ("local.py", "MODES")]
    problems = broken_references([doc], tmp_path, package)
    assert problems == ["docs/a.md:3: engine.py is no file (or names several)",
                        "docs/a.md:3: engine/local.py defines no gone",
                        "docs/a.md:3: engine/local.py defines no Engine.stop"]
