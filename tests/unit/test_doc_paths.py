"""Every repository path that the docs and the code's comments cite exists.

Collected from the comments and docstrings of services/**/*.py, the comments of
pyproject.toml, and the whole text of docs/*.md and README.md (code blocks too: a command
names a script):
- paths that start with one of this repository's top-level folders: services/, tests/,
  benchmarks/, docs/, examples/, deploy/, protos/, .ci/. Each must exist relative to the
  repository root. A trailing ``:line`` or ``.attribute`` (``procutil.tune_gc``) is
  dropped, a ``*`` glob must match something, and a ``<placeholder>`` ends the path;
- dotted module names, ``services.common.shm``: each must name a package or module here;
- partial paths of Python files, ``grpc/h2.py``: some file in the tree must end with one;
- relative Markdown link targets of a doc (``](../benchmarks/compat/README.md)``),
  resolved from the doc's folder, without their ``#anchor``;
- bare module names, ``name.py``: in a doc only inside backticks, in the code anywhere in
  a comment or docstring. Each must be the name of a file somewhere in the tree.

Not checked, because they are not files of this repository:
- paths outside it: anything after ``../`` (``../shared/tools/triton.sh``) or ``/``
  (``/proc/...``, ``/dev/shm``), URLs, and link targets that leave the repository;
- Triton's own files. Its server repository's ``qa/L0_*``, ``src/...`` and
  ``docs/protocol/...`` paths start with none of our folders, except those in
  TRITON_PATHS; partial paths that start with ``qa/`` or ``L0_`` are its QA tests; the
  bare names of its scripts and example clients that the docs cite are in TRITON_FILES.
  Both lists hold only what the docs cite today;
- paths a user creates that the repository git-ignores on purpose (a literal entry of a
  .gitignore, e.g. deploy/docker/wheels/: build inputs the docs tell a user to put there);
- GENERIC names that stand for any file of that name (``model.py``: a Python model).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
              ".import_linter_cache", ".hypothesis", "build", "dist", "out"}

_PREFIX = r"(?:services|tests|benchmarks|docs|examples|deploy|protos|\.ci)/"
# A path starts at one of our folders and is not the tail of a longer path or of a URL.
_PATH = re.compile(r"(?<![\w./~-])(" + _PREFIX + r"[\w./*-]*)")
_PARTIAL = re.compile(r"(?<![\w./~-])((?:[A-Za-z_][\w-]*/)+[A-Za-z_]\w*\.py)\b")
_TRITON_QA = re.compile(r"^(?:qa/|L0_)")
_DOTTED = re.compile(r"(?<![\w./-])services(?:\.[A-Za-z_]\w*)+")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_TICKED = re.compile(r"`([^`\n]+)`")
_BARE = re.compile(r"(?<![\w./*-])([A-Za-z_]\w*\.py)\b")

# Paths in Triton's repositories that start like ours.
TRITON_PATHS = {
    "docs/examples/model_repository/simple",   # triton-inference-server/server
    "docs/cli.md",                             # triton-inference-server/perf_analyzer
}
# Triton's scripts, tests and example clients, cited by their bare names.
TRITON_FILES = {
    "gen_qa_models.py", "gen_qa_identity_models.py", "grpc_client_plugin_test.py",
    "reuse_infer_objects_client.py", "simple_http_shm_client.py", "simple_grpc_shm_client.py",
}
# Names that stand for any file of that name, not one module of ours.
GENERIC = {"model.py", "__init__.py", "conftest.py"}


def _tree() -> tuple[set[str], set[str], set[str]]:
    """Every file and folder under the root (relative, '/'-separated), every file name, and
    every path a .gitignore names literally."""
    paths: set[str] = set()
    names: set[str] = set()
    ignored: set[str] = set()
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.name in _SKIP_DIRS or entry.name.endswith(".egg-info"):
                continue
            rel = entry.relative_to(ROOT).as_posix()
            paths.add(rel)
            if entry.is_dir():
                stack.append(entry)
                continue
            names.add(entry.name)
            if entry.name == ".gitignore":
                base = entry.parent.relative_to(ROOT).as_posix()
                for line in entry.read_text(encoding="utf-8").splitlines():
                    line = line.strip().strip("/")
                    if line and not line.startswith(("#", "!")) and not re.search(r"[*?\[]", line):
                        ignored.add(line if base == "." else f"{base}/{line}")
    return paths, names, ignored


def _docstring_rows(source: str) -> set[int]:
    rows = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                rows.add(first.lineno)
    return rows


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python file."""
    source = path.read_text(encoding="utf-8")
    docstrings = _docstring_rows(source)
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                            and tok.start[0] in docstrings):
            out.extend((tok.start[0] + i, text) for i, text in enumerate(tok.string.split("\n")))
    return out


def _toml_comment_lines(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text(encoding="utf-8").split("\n")
    return [(n, line[line.index("#"):]) for n, line in enumerate(lines, start=1) if "#" in line]


def _doc_lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text(encoding="utf-8").split("\n"), start=1))


def _path_exists(cited: str, paths: set[str], ignored: set[str]) -> bool:
    cited = cited.rstrip("/")
    if any(cited == i or cited.startswith(i + "/") for i in ignored):
        return True
    if "*" in cited:
        return any(ROOT.glob(cited))
    if cited in paths:
        return True
    folder, _, last = cited.rpartition("/")
    stem = last.split(".", 1)[0]
    # a module named with an attribute (procutil.tune_gc), or without its .py
    return any(f"{folder}/{name}" in paths for name in (f"{last}.py", f"{stem}.py", stem))


def _module_exists(dotted: str, paths: set[str]) -> bool:
    """services.a.b.attr: walk the packages; the first part that is no package must be a
    module (the rest are its attributes) or a name the package's __init__.py defines."""
    parts = dotted.split(".")
    folder = parts[0]
    for part in parts[1:]:
        if f"{folder}/{part}" in paths and f"{folder}/{part}.py" not in paths:
            folder = f"{folder}/{part}"
            continue
        if f"{folder}/{part}.py" in paths:
            return True
        init = ROOT / folder / "__init__.py"
        return init.is_file() and re.search(rf"\b{part}\b", init.read_text(encoding="utf-8")) is not None
    return True


def _citations(source: Path, lines: list[tuple[int, str]], is_doc: bool):
    """(line, cited, kind) for every citation in a file: kind 'path', 'partial', 'module' or
    'name'."""
    for number, line in lines:
        for match in _PATH.finditer(line):
            cited = match.group(1).rstrip(".,;:")
            if not cited.startswith(tuple(TRITON_PATHS)):
                yield number, cited, "path"
        for match in _PARTIAL.finditer(line):
            cited = match.group(1)
            if not re.match(_PREFIX, cited) and not _TRITON_QA.match(cited):
                yield number, cited, "partial"
        for match in _DOTTED.finditer(line):
            yield number, match.group(0), "module"
        if is_doc:
            for match in _LINK.finditer(line):
                target = match.group(1).split("#", 1)[0]
                if not target or re.match(r"^[a-z]+:", target):
                    continue
                resolved = (source.parent / target).resolve()
                if resolved.is_relative_to(ROOT):
                    yield number, resolved.relative_to(ROOT).as_posix(), "path"
            spans = [m.group(1) for m in _TICKED.finditer(line)]
        else:
            spans = [line]
        for span in spans:
            for match in _BARE.finditer(span):
                name = match.group(1)
                if name not in GENERIC and name not in TRITON_FILES:
                    yield number, name, "name"


def _sources() -> list[tuple[Path, str]]:
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    code = sorted((ROOT / "services").rglob("*.py"))
    return ([(p, "doc") for p in docs] + [(p, "code") for p in code]
            + [(ROOT / "pyproject.toml", "toml")])


def missing_citations() -> list[str]:
    """'file:line: cited' for every cited path that does not exist."""
    paths, names, ignored = _tree()
    read = {"doc": _doc_lines, "code": _code_lines, "toml": _toml_comment_lines}
    missing = []
    for source, kind in _sources():
        for number, cited, what in _citations(source, read[kind](source), kind == "doc"):
            if what == "name":
                found = cited in names
            elif what == "module":
                found = _module_exists(cited, paths)
            elif what == "partial":
                found = any(p.endswith("/" + cited) for p in paths)
            else:
                found = _path_exists(cited, paths, ignored)
            if not found:
                missing.append(f"{source.relative_to(ROOT).as_posix()}:{number}: {cited}")
    return missing


def test_every_cited_path_exists():
    missing = missing_citations()
    assert not missing, ("paths cited that do not exist in the repository (file:line: path):\n"
                         + "\n".join(missing))
