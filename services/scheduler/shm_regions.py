"""The registry of client shared-memory regions (Triton's SharedMemoryManager), kept by the
scheduler so that every frontend sees every region, and the resolution of the regions a
request names into the objects and offsets its worker maps.

Checks and texts follow Triton's server src/shared_memory_manager.cc and http_server.cc.
Registering is refused unless the server runs with --allow-client-shm=true (Triton's
default is false too); status answers either way, as Triton's does.

A region that requests in flight still use is not removed by unregister: it is marked, stays
listed and usable, and goes when the last of them finishes (Triton's awaiting_unregister_):
``resolve`` holds each region a request names, ``release`` lets go when it has its answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common import client_shm
from services.common import messages as m
from services.common.errors import Code, TriremeError, invalid_arg, not_found, unsupported

SYSTEM, CUDA = "system", "cuda"
_SIZE_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    kind: str
    key: str = ""
    offset: int = 0
    byte_size: int = 0
    device_id: int = 0

    def status(self) -> dict[str, Any]:
        if self.kind == SYSTEM:
            return {"name": self.name, "key": self.key, "offset": self.offset,
                    "byte_size": self.byte_size}
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


def _other(kind: str) -> str:
    return "CUDA" if kind == CUDA else "system"


class Registry:
    def __init__(self, allowed: bool, gpus: int = 0) -> None:
        self.allowed = allowed
        self.gpus = gpus                 # CUDA regions need a GPU (none: Triton's CPU build text)
        self.regions: dict[str, Region] = {}
        self.held: dict[str, int] = {}            # region name -> requests in flight using it
        self.awaiting: set[str] = set()           # unregistered while held

    # ------------------------------------------------------------------ the extension
    def answer(self, msg: m.ShmRegister | m.ShmUnregister | m.ShmStatus
               ) -> tuple[m.ShmRegions | m.ControlDone, list[str]]:
        """The reply to a frontend's request, and the keys every worker must unmap."""
        try:
            if isinstance(msg, m.ShmStatus):
                return m.ShmRegions(msg.ctl_id, self.status(msg)), []
            if isinstance(msg, m.ShmRegister):
                self.register(msg)
                return m.ControlDone(msg.ctl_id), []
            return m.ControlDone(msg.ctl_id), self.unregister(msg)
        except TriremeError as e:
            err = m.ErrorRecord(int(e.code), e.message)
            if isinstance(msg, m.ShmStatus):
                return m.ShmRegions(msg.ctl_id, error=err), []
            return m.ControlDone(msg.ctl_id, err), []

    def register(self, msg: m.ShmRegister) -> None:
        if not self.allowed:
            raise unsupported(client_shm.DISABLED_TEXT)
        kind, name = msg.kind, msg.name
        if not name:
            raise invalid_arg(f"'region name' is necessary to register {kind} shared memory "
                              f"region")
        if kind == CUDA:
            # CUDA IPC needs a GPU in the worker that opens the handle; without one this is
            # Triton's answer from a build without GPU support.
            raise invalid_arg(f"failed to register CUDA shared memory region: '{name}', GPUs "
                              f"not supported")
        client_shm.check_key(name, msg.key)
        if name in self.regions:
            raise TriremeError(Code.ALREADY_EXISTS,
                               f"shared memory region '{name}' already in manager")
        client_shm.check_region(name, msg.key, msg.offset, msg.byte_size)
        self.regions[name] = Region(name, SYSTEM, msg.key, msg.offset, msg.byte_size)

    def unregister(self, msg: m.ShmUnregister) -> list[str]:
        """Returns the keys of the system regions gone (workers unmap them)."""
        if not self.allowed:
            raise unsupported(client_shm.DISABLED_TEXT)
        names = [msg.name] if msg.name else [n for n, r in self.regions.items()
                                             if r.kind == msg.kind]
        gone = []
        for name in names:
            r = self.regions.get(name)
            if r is None or r.kind != msg.kind:        # unknown names are no error (Triton)
                continue
            if self.held.get(name):
                self.awaiting.add(name)                 # goes when its requests are answered
            else:
                gone.append(self._remove(name))
        return self._unmappable(gone)

    def _remove(self, name: str) -> str:
        self.awaiting.discard(name)
        return self.regions.pop(name).key

    def _unmappable(self, keys: list[str]) -> list[str]:
        """Of these keys, those no region uses any more (one registered again under another
        name stays mapped)."""
        live = {r.key for r in self.regions.values()}
        return [k for k in keys if k and k not in live]

    def status(self, msg: m.ShmStatus) -> list[dict[str, Any]]:
        if not msg.name:
            return [r.status() for r in self.regions.values() if r.kind == msg.kind]
        r = self.regions.get(msg.name)
        if r is None:
            raise not_found(f"Unable to find {'cuda' if msg.kind == CUDA else 'system'} "
                            f"shared memory region: '{msg.name}'")
        if r.kind != msg.kind:
            raise not_found(f"The region named '{msg.name}' is registered as "
                            f"{_other(r.kind)} shared memory, not {_other(msg.kind)} shared "
                            f"memory")
        return [r.status()]

    # ------------------------------------------------------------------ requests
    def resolve(self, req: m.InferRequest) -> tuple[str, ...]:
        """Turn the regions ``req`` names into keys and object offsets (in place), with
        Triton's GetMemoryInfo checks; raises TriremeError for the request. Returns the
        region names it holds until ``release``."""
        names = []
        for t in req.inputs:
            if t.region:
                names.append(t.region)
                t.key, t.offset = self._locate(t.region, t.offset, t.nbytes)
                t.region = ""
        for o in req.out_regions.values():
            if o.region:
                names.append(o.region)
                o.key, o.offset = self._locate(o.region, o.offset, o.nbytes)
                o.region = ""
        for name in names:
            self.held[name] = self.held.get(name, 0) + 1
        return tuple(names)

    def release(self, names: tuple[str, ...]) -> list[str]:
        """A request that held these regions has its answer; returns the keys workers may
        now unmap (regions unregistered meanwhile, held by no other request)."""
        gone = []
        for name in names:
            n = self.held.get(name, 0) - 1
            if n > 0:
                self.held[name] = n
                continue
            self.held.pop(name, None)
            if name in self.awaiting:
                gone.append(self._remove(name))
        return self._unmappable(gone)

    def _locate(self, name: str, offset: int, nbytes: int) -> tuple[str, int]:
        r = self.regions.get(name)
        if r is None:
            raise client_shm.unknown_region(name)
        if offset < 0 or offset >= r.byte_size:   # (gRPC's int64 is unsigned to Triton)
            raise invalid_arg(f"Invalid offset for shared memory region: '{name}'")
        if nbytes > _SIZE_MAX - offset:
            raise invalid_arg(f"Integer overflow detected: byte_size ({nbytes}) + offset "
                              f"({offset}) exceeds maximum value ({_SIZE_MAX}) for region "
                              f"'{name}'")
        if nbytes < 0 or offset + nbytes > r.byte_size:
            raise invalid_arg(f"Invalid offset + byte size for shared memory region: "
                              f"'{name}'")
        return r.key, r.offset + offset
