"""The server the attacks share: `add_sub` with dynamic batching, default limits. A module
that needs other flags defines its own `server` fixture."""
from __future__ import annotations

import models
import pytest
from conftest import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("adversarial") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", "max_batch_size: 8\ndynamic_batching {}\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    with start_server(root) as srv:
        yield srv
