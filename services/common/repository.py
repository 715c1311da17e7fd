"""Model repository layout: which folders are models, which are versions, which versions a
policy selects, where a version's model file is, labels, and a cheap change detector.

Pure filesystem logic, shared by the scheduler (repository state, poll mode) and workers.
Behaviour follows Triton core's model_repository_manager.cc (Poll, duplicate models) and
model_lifecycle.cc (VersionsToLoad); messages are Triton's.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import Code, TriremeError, invalid_arg

if TYPE_CHECKING:
    from protos import model_config_pb2 as mc

log = logging.getLogger(__name__)

# Folders inside a model directory that are never versions (Triton: kWarmupDataFolder,
# kInitialStateFolder; "configs" holds --model-config-name files).
NON_VERSION_DIRS = frozenset({"warmup", "initial_state", "configs"})

# Triton's repository-index reason for a model found in more than one repository
# (MODEL_READY_REASON_DUPLICATE) and its poll-time error text.
DUPLICATE_REASON = "model appears in two or more repositories"
DUPLICATE_POLL_ERROR = "failed to poll model '{name}': not unique across all model repositories"


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path
    namespace: str = ""   # its repository, with --model-namespacing (Triton's namespace)

    @property
    def key(self) -> str:
        return model_key(self.namespace, self.name)


def model_key(namespace: str, name: str) -> str:
    """The identity of a model: its name, or with --model-namespacing Triton's
    ModelIdentifier text "<repository>::<name>" (what Triton's own messages show)."""
    return f"{namespace}::{name}" if namespace else name


def scan(repositories: list[Path], namespacing: bool = False
         ) -> tuple[dict[str, ModelSource], dict[str, str]]:
    """Every non-hidden subdirectory of every repository is a model, by its key.

    Returns (models, duplicates): without namespacing a name found in two or more
    repositories is not served; it goes into `duplicates` with the reason the repository
    index shows for it. With namespacing each repository's models are keyed apart.
    Raises INVALID_ARG "failed to stat file <path>" for a repository that does not exist.
    """
    found: dict[str, ModelSource] = {}
    dups: dict[str, str] = {}
    for repo in dict.fromkeys(Path(r) for r in repositories):   # (a set, as Triton's)
        try:
            is_dir = repo.is_dir()
            exists = is_dir or repo.exists()
        except OSError:
            exists = is_dir = False
        if not exists:
            raise invalid_arg(f"failed to stat file {repo}")
        if not is_dir:
            raise invalid_arg(f"failed to open directory {repo}")
        try:
            entries = sorted(os.scandir(repo), key=lambda e: e.name)
        except OSError as e:
            raise invalid_arg(f"failed to open directory {repo}: {e.strerror}") from None
        for entry in entries:
            # Hidden folders (.git, .ipynb_checkpoints) are skipped; Triton would try them.
            if entry.name.startswith("."):
                continue
            try:
                if not entry.is_dir():  # follows symlinks, like Triton's stat()
                    continue
            except OSError:
                continue
            name = entry.name
            if namespacing:
                src = ModelSource(name, repo / name, str(repo))
                found[src.key] = src
                continue
            if name in dups:
                continue
            if name in found:
                del found[name]
                dups[name] = DUPLICATE_REASON   # the caller logs it, once
                continue
            found[name] = ModelSource(name, repo / name)
    return found, dups


def parse_version(dirname: str) -> int | None:
    """A version folder name -> its number, or None if it is not a version."""
    if dirname in NON_VERSION_DIRS or not dirname.isascii() or not dirname.isdigit():
        return None
    if len(dirname) > 1 and dirname[0] == "0":
        return None  # Triton ignores names with leading zeros
    return int(dirname)


def available_versions(model_dir: Path) -> list[int]:
    """Numeric version subfolders of a model, ascending."""
    versions = []
    try:
        entries = list(os.scandir(model_dir))
    except OSError:
        return []
    for entry in entries:
        v = parse_version(entry.name)
        if v is None:
            continue
        try:
            if entry.is_dir():
                versions.append(v)
        except OSError:
            continue
    return sorted(versions)


def select_versions(cfg: mc.ModelConfig, available: list[int]) -> list[int]:
    """Versions to serve under cfg.version_policy (default latest 1), ascending.
    Specific versions that have no folder are skipped (logged), as Triton does."""
    have = sorted(set(available))
    policy = cfg.version_policy
    which = policy.WhichOneof("policy_choice") if cfg.HasField("version_policy") else None
    if which == "specific":
        chosen = []
        for v in policy.specific.versions:
            if v in have:
                chosen.append(int(v))
            else:
                log.error("version %d is specified for model '%s', but the version directory "
                          "is not present", v, cfg.name)
        chosen = sorted(set(chosen))
    elif which == "all":
        chosen = have
    else:
        n = policy.latest.num_versions if which == "latest" else 1
        chosen = have[len(have) - n:] if n > 0 else []
    if not chosen:
        raise invalid_arg("at least one version must be available under the version policy of "
                         f"model '{cfg.name}'")
    return chosen


def _default_file(backend: str, platform: str) -> str:
    """Triton's file for a backend when the config names none (auto-complete off)."""
    if platform == "torch_aoti":
        return "model.pt2"
    if platform == "tensorflow_graphdef":
        return "model.graphdef"
    known = {"pytorch": "model.pt", "onnxruntime": "model.onnx", "tensorflow": "model.savedmodel",
             "tensorrt": "model.plan", "openvino": "model.xml", "python": "model.py"}
    return known.get(backend, f"model.{backend}" if backend else "")


def model_file(cfg, model_dir: Path, version: int, cc: str | None = None) -> Path:
    """Path of the model artifact of one version: `cc_model_filenames[cc]` when the compute
    capability has one, else `default_model_filename` (ONNX: a directory means
    `<dir>/model.onnx`, Triton's large-model layout)."""
    vdir = Path(model_dir) / str(version)
    filename = cfg.cc_model_filenames.get(cc, "") if cc else ""
    filename = filename or cfg.default_model_filename
    if not filename:
        if cfg.platform == "ensemble":
            raise invalid_arg(f"ensemble '{cfg.name}' has no model file")
        filename = _default_file(cfg.backend, cfg.platform)
    path = vdir / filename if filename else vdir
    if not filename or not path.exists():
        raise invalid_arg(f"unable to find '{path}' for model '{cfg.name}'")
    if cfg.backend == "onnxruntime" and path.is_dir():
        inner = path / "model.onnx"
        if not inner.exists():
            raise invalid_arg(f"unable to find '{inner}' for model '{cfg.name}'")
        return inner
    return path


def read_labels(model_dir: Path, cfg) -> dict[str, list[str]]:
    """Output name -> labels (one per line) from each output's label_filename, relative to
    the model directory."""
    labels: dict[str, list[str]] = {}
    for out in cfg.output:
        if not out.label_filename:
            continue
        path = Path(model_dir) / out.label_filename
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise TriremeError(Code.INTERNAL,   # (Triton's code: its load error names it)
                               f"failed to open text file for read {path}: {e.strerror}") from None
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        labels[out.name] = [line.rstrip("\r") for line in lines]
    return labels


def fingerprint(model_dir: Path) -> str:
    """Cheap change detector for poll mode: a digest of every entry's relative path, size
    and max(mtime, ctime) (Triton compares both times), recursively. "" if it is gone."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    try:
        st = root.stat()
    except OSError:
        return ""
    h.update(f".:{max(st.st_mtime_ns, st.st_ctime_ns)}\n".encode())
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames) + [d + "/" for d in dirnames]:
            full = os.path.join(dirpath, name.rstrip("/"))
            try:
                st = os.stat(full)
            except OSError:
                continue  # dangling link or vanished mid-walk
            h.update(f"{rel_dir}/{name}:{st.st_size}:"
                     f"{max(st.st_mtime_ns, st.st_ctime_ns)}\n".encode())
    return h.hexdigest()
