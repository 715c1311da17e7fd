"""The models loaded in explicit mode, kept in a small file (--model-state-file) so that a
scheduler that restarts loads them again, with the load parameters they came with.

Why a file and not the workers: a restarted scheduler starts from a clean slate on every
host (workers of the old one are stopped), and a model loaded from `file:` parameters or a
config override exists nowhere else. The file is rewritten whole (write, fsync, rename) on
each successful load and unload: a crash leaves the old or the new one, never half.
"""
from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("trireme.state")


class LoadedModels:
    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self.models: dict[str, dict] = {}   # name -> {"config": json text, "files": {key: b64}}
        if self.path is not None and self.path.exists():
            try:
                self.models = json.loads(self.path.read_text())["models"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("cannot read the model state file %s (%s): starting without it",
                          self.path, e)

    def entries(self) -> list[tuple[str, str, dict[str, bytes]]]:
        """(name, config override JSON, files) of each model to load again."""
        return [(name, rec.get("config", ""),
                 {k: base64.b64decode(v) for k, v in rec.get("files", {}).items()})
                for name, rec in sorted(self.models.items())]

    def loaded(self, name: str, config_json: str = "", files: dict[str, bytes] | None = None
               ) -> None:
        self.models[name] = {"config": config_json,
                             "files": {k: base64.b64encode(v).decode() for k, v in
                                       (files or {}).items()}}
        self._write()

    def unloaded(self, name: str) -> None:
        if self.models.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"models": self.models}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            log.error("cannot write the model state file %s: %s", self.path, e)
