"""services.common.states.ModelState on the wire: a member encodes exactly as its plain
string did, and a decoded state compares (and hashes) equal to the string."""

from __future__ import annotations

import msgspec

from services.common import messages as m
from services.common.states import ModelState


def test_states_encode_as_their_plain_strings():
    for s in ModelState:
        assert s == s.name and str(s) == f"{s}" == s.name
        assert m.encode(m.Index(1, [m.IndexEntry("a", "1", s, "why")])) == \
            m.encode(m.Index(1, [m.IndexEntry("a", "1", s.name, "why")]))
        assert m.encode(m.ModelInfo(3, "a", versions={1: s})) == \
            m.encode(m.ModelInfo(3, "a", versions={1: s.name}))


def test_decoded_states_compare_equal_to_strings():
    info, _ = m.decode(m.encode(m.ModelInfo(3, "a", versions={1: "READY", 2: "LOADING"})))
    assert info.versions == {1: ModelState.READY, 2: ModelState.LOADING}
    assert info.versions[1] == "READY" and info.versions[1] is ModelState.READY
    assert {"READY": 1}[info.versions[1]] == 1
    idx, _ = m.decode(m.encode(m.Index(1, [m.IndexEntry("a", "1", ModelState.UNAVAILABLE),
                                           m.IndexEntry("b")])))
    assert [(e.state, e.reason) for e in idx.entries] == [("UNAVAILABLE", ""), ("", "")]
    assert msgspec.json.encode({"s": ModelState.READY}) == b'{"s":"READY"}'
