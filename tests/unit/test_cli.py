"""The command line as a new user meets it: `trireme --version`, and every flag of every
command says what it does and its default."""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_version():
    r = subprocess.run([sys.executable, "-m", "services.cli", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, f"trireme {version('trireme')}"), r


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_every_flag_has_help_and_shows_its_default(command):
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subs.choices[command]
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.dest != "help" and not a.help]
    assert missing == [], missing
    text = parser.format_help()
    assert "(default: 8002)" in text and "(default: True)" in text   # --metrics-port, booleans


@pytest.mark.parametrize("module", ["services.frontend.main", "services.workers.host",
                                    "services.workers.main"])
def test_every_flag_of_the_pieces_has_help_and_shows_its_default(module):
    """`trireme frontend`, `trireme workers` and `trireme worker` parse their own flags."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.dest != "help" and not a.help]
    assert missing == [], missing
    assert isinstance(parser.formatter_class, type) and issubclass(
        parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    assert "(default: " in parser.format_help()
