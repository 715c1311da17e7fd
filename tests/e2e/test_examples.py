"""examples/ as a new user meets it: every client snippet of examples/README.md, run as it is
against `trireme serve` on the example repositories, prints what the README shows under it.

The snippets are read from the README itself, so it cannot drift: each ```python or ```bash
block followed by a ```text block is a snippet and that block is its expected output (other
bash blocks are the install and serve commands). They are run in a fresh interpreter (curl
for bash) with the default ports (localhost:8000, :8001) replaced by the test server's.
One server serves examples/model_repository and the examples/frameworks/ folders whose
framework is installed here; a snippet using a model of a framework that is not installed
is skipped, saying which extra would run it.

Also checked without a server: every example model has a snippet; model_repository/ needs
no framework beyond the quick start's `.[onnx]` and each frameworks/ folder only its own;
binary model files stay small; and examples/make_models.py, run outside the tree (it must
not import tests/), writes exactly the committed model files.
"""
from __future__ import annotations

import filecmp
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, start_server

EXAMPLES = ROOT / "examples"
README = EXAMPLES / "README.md"
CORE = EXAMPLES / "model_repository"
# frameworks/<folder>: (the module its backend imports, the extra that installs it, backends)
FRAMEWORKS = {"pytorch": ("torch", "torch", {"pytorch"}),
              "tensorflow": ("tensorflow", "tensorflow", {"tensorflow"}),
              "openvino": ("openvino", "openvino", {"openvino"})}
# What the quick start's install (pip install -e ".[onnx]") serves.
CORE_BACKENDS = {"onnxruntime", "python", "ensemble"}
PLATFORMS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch",
             "tensorflow_savedmodel": "tensorflow", "ensemble": "ensemble"}
MAX_MODEL_BYTES = 16 * 1024
SNIPPET_TIMEOUT_S = 60


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def models_in(repo: Path) -> list[str]:
    return sorted(d.name for d in repo.iterdir() if d.is_dir())


REPOSITORIES = {CORE: None, **{EXAMPLES / "frameworks" / f: f for f in FRAMEWORKS}}
FRAMEWORK_OF = {m: f for repo, f in REPOSITORIES.items() if f for m in models_in(repo)}
ALL_MODELS = [m for repo in REPOSITORIES for m in models_in(repo)]


@dataclass
class Snippet:
    lang: str
    code: str
    expected: str
    line: int      # where its block starts in the README
    section: str   # the heading above it

    @property
    def models(self) -> set[str]:
        return {m for m in ALL_MODELS if re.search(rf"(?<!\w){re.escape(m)}(?!\w)", self.code)}


def read_blocks(text: str) -> list[tuple[str, str, int, str]]:
    """(language, body, line, heading) of each fenced block, in order."""
    blocks, heading, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("```"):
            lang, start, body = line[3:].strip(), i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((lang, "\n".join(body) + "\n", start, heading))
        i += 1
    return blocks


def read_snippets() -> tuple[list[Snippet], list[tuple[str, int]]]:
    """The snippets, and (language, line) of each python block without an expected output."""
    blocks = read_blocks(README.read_text())
    snippets, orphans = [], []
    for n, (lang, body, line, heading) in enumerate(blocks):
        if lang not in ("python", "bash"):
            continue
        follower = blocks[n + 1] if n + 1 < len(blocks) else None
        if follower is not None and follower[0] == "text":
            snippets.append(Snippet(lang, body, follower[1], line, heading))
        elif lang == "python":
            orphans.append((lang, line))
    return snippets, orphans


SNIPPETS, ORPHANS = read_snippets()


def snippet_id(s: Snippet) -> str:
    name = re.search(r"`([^`]+)`", s.section)
    return f"{name.group(1) if name else s.section}-{s.lang}-L{s.line}"


# ---------------------------------------------------------------- the README and the folders

def test_the_readme_has_a_snippet_for_every_example_model():
    assert len(SNIPPETS) >= len(ALL_MODELS)
    assert not ORPHANS, f"python blocks with no ```text block of expected output: {ORPHANS}"
    shown = set().union(*(s.models for s in SNIPPETS))
    shown |= {step for m in shown for step in steps_of(m)}   # run by an ensemble shown
    assert set(ALL_MODELS) - shown == set(), "example models no snippet of examples/README.md runs"


def steps_of(model: str) -> list[str]:
    """The models an ensemble's steps run (none for a model that is not an ensemble)."""
    config = next(repo / model / "config.pbtxt" for repo in REPOSITORIES
                  if (repo / model).is_dir())
    text = config.read_text() if config.exists() else ""
    if not re.search(r'^platform:\s*"ensemble"', text, re.M):
        return []
    return re.findall(r'model_name:\s*"([^"]+)"', text)


def backend_of(model_dir: Path) -> str:
    config = model_dir / "config.pbtxt"
    text = config.read_text() if config.exists() else ""
    backend = re.search(r'^backend:\s*"([^"]+)"', text, re.M)
    if backend:
        return backend.group(1)
    platform = re.search(r'^platform:\s*"([^"]+)"', text, re.M)
    if platform:
        return PLATFORMS[platform.group(1)]
    files = {p.suffix for p in model_dir.glob("*/model.*")}   # auto-completed from the file
    assert files == {".onnx"}, f"{model_dir}: no backend in its config, files {files}"
    return "onnxruntime"


def test_each_repository_needs_only_its_own_framework():
    """model_repository/ serves after the quick start's install (a model whose framework is
    missing would stop the server: --exit-on-error); frameworks/<f>/ needs only <f>."""
    for repo, framework in REPOSITORIES.items():
        allowed = FRAMEWORKS[framework][2] if framework else CORE_BACKENDS
        for model in models_in(repo):
            assert backend_of(repo / model) in allowed, f"{repo / model} in {repo.name}/"


def committed_model_files() -> set[Path]:
    """The binary files (make_models.py's): all but configurations, Python models, and the
    empty version folder's placeholder."""
    return {p.relative_to(EXAMPLES) for repo in REPOSITORIES for p in repo.rglob("*")
            if p.is_file() and p.name not in ("config.pbtxt", ".gitkeep") and p.suffix != ".py"
            and "__pycache__" not in p.parts}


def test_the_committed_model_files_are_small():
    files = committed_model_files()
    assert files, "no model file under examples/"
    big = {str(p): (EXAMPLES / p).stat().st_size for p in files
           if (EXAMPLES / p).stat().st_size > MAX_MODEL_BYTES}
    assert not big, f"model files over {MAX_MODEL_BYTES} bytes: generate them instead: {big}"


def test_make_models_writes_the_committed_files(tmp_path):
    """Run from outside the tree with -I (no PYTHONPATH, no current folder on the path), so
    an import from tests/ would fail. Files of a framework not installed are not written."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-I", str(EXAMPLES / "make_models.py"), "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    # the module each folder's files are written with
    needs = {"onnx": "model_repository/",
             **{module: f"frameworks/{f}/" for f, (module, _, _) in FRAMEWORKS.items()}}
    expected = {p for p in committed_model_files()
                if not any(str(p).startswith(folder) and not installed(module)
                           for module, folder in needs.items())}
    assert written == expected, proc.stdout
    for module in needs:
        assert installed(module) or f"{module} is not installed" in proc.stdout, proc.stdout
    # byte for byte, but for the SavedModel (its fingerprint holds a fresh UUID each time)
    # and the TorchScript file (its debug records name the script's path): that one by its
    # code
    differ = [str(p) for p in written if ".savedmodel" not in str(p) and p.suffix != ".pt"
              and not filecmp.cmp(out / p, EXAMPLES / p, shallow=False)]
    assert not differ, f"committed files that make_models.py no longer writes: {differ}"
    for p in (p for p in written if p.suffix == ".pt"):
        import torch
        assert torch.jit.load(str(out / p)).code == torch.jit.load(str(EXAMPLES / p)).code, p


# ---------------------------------------------------------------- the snippets, served

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A copy of examples/ (the server's log goes beside the repository; Python models
    leave __pycache__), the core repository and the installed frameworks' folders."""
    root = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    extra = [arg for folder, (module, _, _) in FRAMEWORKS.items() if installed(module)
             for arg in ("--model-repository", str(root / "examples" / "frameworks" / folder))]
    with start_server(root / "examples" / "model_repository", *extra) as srv:
        yield srv


@pytest.mark.parametrize("snippet", SNIPPETS, ids=snippet_id)
def test_snippet(server, snippet: Snippet):
    for model in sorted(snippet.models):
        framework = FRAMEWORK_OF.get(model)
        if framework and not installed(FRAMEWORKS[framework][0]):
            pytest.skip(f"{model} needs {FRAMEWORKS[framework][0]}, not installed "
                        f"(pip install -e \".[{FRAMEWORKS[framework][1]}]\")")
    code = (snippet.code.replace("localhost:8000", server.http_url)
            .replace("localhost:8001", server.grpc_url))
    assert code != snippet.code, "the snippet talks to no default port"
    if snippet.lang == "bash":
        if shutil.which("curl") is None:
            pytest.skip("the README's bash snippets use curl, not installed here")
        cmd = ["bash", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S,
                          cwd=server.repo.parent)
    assert proc.returncode == 0, f"README line {snippet.line}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.rstrip("\n") == snippet.expected.rstrip("\n"), \
        f"README line {snippet.line} printed:\n{proc.stdout}"
