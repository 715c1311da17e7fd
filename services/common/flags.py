"""Command-line value parsers shared by every service's flags."""
from __future__ import annotations

import argparse


def parse_bool(v: str) -> bool:
    """Triton's boolean flag values: true/false, 1/0, yes/no, on/off (any case)."""
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{v}'")
