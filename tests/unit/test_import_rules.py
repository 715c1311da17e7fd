"""The house's import rules (pyproject.toml [tool.importlinter], docs/architecture.md):
services.common imports no service, nothing but the CLI imports services.frontend, the
scheduler and the frontends import no framework, and frameworks are imported only under
services/workers/backends and services/workers/python."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)   # grimp finds the root packages on sys.path; the config is read from here
    try:
        with contextlib.redirect_stdout(out):
            code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                                no_logo=True)
    finally:
        os.chdir(cwd)
    assert code == 0, out.getvalue()
    assert "0 broken" in out.getvalue()
