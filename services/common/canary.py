"""A canary split (beyond Triton): requests that name no version are spread over a model's
loaded versions by weight, set in its config's parameters:

    parameters { key: "trireme.version_split" value { string_value: "1:90,2:10" } }
    parameters { key: "trireme.sticky_parameter" value { string_value: "user" } }

With a sticky parameter, a request carrying it goes where every request with the same
value goes (the hash of the value picks the version); a header forwarded with
--http-header-forward-pattern / --grpc-header-forward-pattern arrives as such a parameter.
Only READY versions with a weight above 0 take requests; with none of them ready, the
default version (the latest ready) does. A request that names a version gets that one.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from typing import Any

from services.common.errors import invalid_arg

SPLIT = "trireme.version_split"
STICKY = "trireme.sticky_parameter"


def version_split(cfg: Any) -> tuple[dict[int, int], str]:
    """(version -> weight, sticky parameter name) of a model config; ({}, "") without a
    split. Raises INVALID_ARG for a value that is not '<version>:<weight>,...'."""
    params = cfg.parameters
    sticky = params[STICKY].string_value if STICKY in params else ""
    if SPLIT not in params:
        if sticky:
            raise invalid_arg(f"parameter '{STICKY}' of {cfg.name} needs '{SPLIT}'")
        return {}, ""
    text = params[SPLIT].string_value
    split: dict[int, int] = {}
    try:
        for part in text.split(","):
            version, weight = part.split(":")
            v, w = int(version), int(weight)
            if v <= 0 or w < 0 or v in split:
                raise ValueError
            split[v] = w
    except ValueError:
        raise invalid_arg(f"parameter '{SPLIT}' of {cfg.name} must be "
                          f"'<version>:<weight>,...' (versions > 0, weights >= 0, each version "
                          f"once), got '{text}'") from None
    if not any(split.values()):
        raise invalid_arg(f"parameter '{SPLIT}' of {cfg.name} gives every version weight 0")
    return split, sticky


def choose(split: dict[int, int], ready: Iterable[int], key: str | None) -> int | None:
    """The version a request goes to; None: no weighted version is ready. ``key``: the
    sticky parameter's value (None: chosen at random, by weight)."""
    up = set(ready)
    weighted = [(v, w) for v, w in sorted(split.items()) if w > 0 and v in up]
    if not weighted:
        return None
    total = sum(w for _, w in weighted)
    if key is None:
        r = random.randrange(total)
    else:
        r = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % total
    for v, w in weighted:
        if r < w:
            return v
        r -= w
    return weighted[-1][0]
