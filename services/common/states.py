"""Model and version states, Triton's names (ModelReadyState) as they go over the wire.

A StrEnum: each member *is* its name as a str, so msgspec encodes it as the plain string
(messages are byte-identical to plain strings), a decoded state compares equal to the
string, and str() / f-strings give the bare name. Member names equal their values, so a
member and its string also hash alike (Enum hashes by name) and find each other in dicts.
"""
from __future__ import annotations

import enum


class ModelState(enum.StrEnum):
    READY = "READY"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"
