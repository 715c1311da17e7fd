"""The model table the server logs once its start-up loads are done, as Triton logs it
(server.cc): one row per model version, its state and, when it is not READY, why; a reason
of several lines continues on rows of its own."""
from __future__ import annotations

from collections.abc import Sequence

from services.common import messages as m


def status_table(entries: Sequence[m.IndexEntry]) -> str:
    rows = []
    for e in entries:
        status = e.state or "UNAVAILABLE"
        lines = (f"{status}: {e.reason}" if e.reason and status != "READY" else status).split("\n")
        rows.append((e.name, e.version or "-", lines[0]))
        rows += [("", "", line) for line in lines[1:]]
    header = ("Model", "Version", "Status")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def row(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([rule, row(header), rule, *(row(r) for r in rows), rule])
