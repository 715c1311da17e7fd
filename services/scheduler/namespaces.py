"""Which model a name means, for --model-namespacing (Triton's model namespacing, core
model_repository_manager.cc). ModelNames is an object the ModelManager (lifecycle.py)
owns: it reads the ModelManager's entries and owns the index of their keys by name.

A model's identity is its key (repository.model_key): its name, or with namespacing
Triton's ModelIdentifier text "<repository>::<name>", so that the same name in two
repositories makes two entries, two sets of workers, two statistics records. The key is
what ModelManager.models, Instance.model, the queues and the statistics are keyed by.
Clients name models by name only:

    request / control call for NAME ─▶ resolve(): the one entry of that name loaded (or
        tried); none: unknown; several: Triton's ambiguity error (INVALID_ARG)
    ensemble step for NAME ─▶ step_entry(): its own repository's model while ready,
        else the only ready one of that name

Without namespacing a key is the name and every method here is a dictionary lookup.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.errors import TriremeError, ambiguous_model
from services.common.repository import model_key
from services.scheduler.entries import ModelEntry, is_unloaded


class ModelNames:
    """Name resolution over the ModelManager's ``models`` (read only here)."""

    def __init__(self, models: dict[str, ModelEntry], repositories: list[Path],
                 namespacing: bool) -> None:
        self.models = models
        self.repositories = repositories
        self.namespacing = namespacing
        self._keys: dict[str, list[str]] = {}   # name -> the keys of its entries (reindex())

    def reindex(self) -> None:
        """Rebuild the keys-by-name index from the entries (with namespacing; the
        ModelManager adds entries only in its scan(), which calls this after)."""
        if self.namespacing:
            self._keys = {}
            for key, e in self.models.items():
                self._keys.setdefault(e.name, []).append(key)

    def keys_of(self, name: str) -> list[str]:
        """The keys of the entries named ``name`` (with namespacing; else none)."""
        return list(self._keys.get(name, ()))

    def split_key(self, key: str) -> tuple[str, str]:
        """(name, namespace) of a model key."""
        if self.namespacing:
            for r in self.repositories:
                if key.startswith(prefix := f"{r}::"):
                    return key[len(prefix):], str(r)
        return key, ""

    def resolve(self, name: str) -> ModelEntry | None:
        """The entry a request for ``name`` (or a key) means. With namespacing (Triton's
        FindModelIdentifier): the one entry of that name that is loaded or was tried (those
        not unloaded first); several: Triton's ambiguity error."""
        e = self.models.get(name)
        if e is not None or not self.namespacing:
            return e
        known = [e for k in self._keys.get(name, ()) if (e := self.models.get(k)) is not None
                 and (e.state is not None or e.versions)]
        live = [e for e in known if not all(is_unloaded(v.reason) for v in e.versions.values())]
        if len(live) > 1:
            raise ambiguous_model(name, len(live))
        return live[0] if live else (known[0] if known else None)

    def lookup(self, name: str) -> ModelEntry | None:
        """resolve(), None for an ambiguous name."""
        try:
            return self.resolve(name)
        except TriremeError:
            return None

    def step_source(self, ensemble: ModelEntry, name: str, available: dict[str, Any]) -> str:
        """The key of the model an ensemble's step names at its load, "" if none: with
        namespacing the one in the ensemble's repository, else the only one of that name
        (Triton's DependencyGraph::FindNode, fuzzy)."""
        if not self.namespacing:
            return name if name in available else ""
        own = model_key(ensemble.namespace, name)
        if own in available:
            return own
        found = [k for k, s in available.items() if s.name == name]
        return found[0] if len(found) == 1 else ""

    def step_entry(self, ensemble_key: str, name: str) -> ModelEntry | None:
        """With namespacing, the entry an ensemble's step request for ``name`` goes to now:
        the ensemble's own repository's model while it is ready, else the only ready one of
        that name (Triton re-links its ensembles as models come and go). None otherwise:
        the caller looks the name up."""
        if not self.namespacing:
            return None
        own = self.models.get(model_key(self.split_key(ensemble_key)[1], name))
        if own is not None and own.ready_version(0) is not None:
            return own
        ready = [e for k in self._keys.get(name, ()) if (e := self.models.get(k)) is not None
                 and e.ready_version(0) is not None]
        return ready[0] if len(ready) == 1 else own
