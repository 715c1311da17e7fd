"""Ensemble configs written as pbtxt, for the ensemble_config tests (test_ensemble_config.py:
Triton's qa cases; test_ensemble_graphs.py: our own graphs and labels)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest
from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.common import config as C
from services.common.errors import Code, TriremeError
from services.scheduler.ensemble_config import is_decoupled, validate_ensemble, validate_steps

Pairs = dict[str, str] | Iterable[tuple[str, str]]


def parse(text: str) -> mc.ModelConfig:
    cfg = text_format.Parse(text, mc.ModelConfig())
    C.normalize(cfg)  # the module sees configs services.common.config has normalized
    return cfg


def io(name: str, dtype: str = "FP32", dims: Iterable[int] = (16,), extra: str = "") -> str:
    return f'{{ name: "{name}" data_type: TYPE_{dtype} dims: {list(dims)} {extra} }}'


def model(name: str, mbs: int, inputs: list[str], outputs: list[str], extra: str = "") -> mc.ModelConfig:
    return parse(f'name: "{name}" backend: "identity" max_batch_size: {mbs} '
                 f'input [ {", ".join(inputs)} ] output [ {", ".join(outputs)} ] {extra}')


def identity(name: str, mbs: int, n_in: int = 1, n_out: int = 1, dtype: str = "FP32",
             dims: Iterable[int] = (16,)) -> mc.ModelConfig:
    return model(name, mbs, [io(f"INPUT{i}", dtype, dims) for i in range(n_in)],
                 [io(f"OUTPUT{i}", dtype, dims) for i in range(n_out)])


def step(name: str, inputs: Pairs, outputs: Pairs, version: int = -1) -> str:
    def maps(kind: str, pairs: Pairs) -> str:
        items = pairs.items() if isinstance(pairs, dict) else pairs
        return "".join(f' {kind} {{ key: "{k}" value: "{v}" }}' for k, v in items)
    head = f'model_name: "{name}" ' if name else ""
    return f"{{ {head}model_version: {version}{maps('input_map', inputs)}{maps('output_map', outputs)} }}"


def ensemble(name: str, steps: list[str], inputs: Iterable[str] = (io("data"),),
             outputs: Iterable[str] = (io("prob"),), mbs: int = 2, extra: str = "",
             platform: str = "ensemble") -> mc.ModelConfig:
    return parse(f'name: "{name}" platform: "{platform}" max_batch_size: {mbs} '
                 f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }} '
                 f'input [ {", ".join(inputs)} ] output [ {", ".join(outputs)} ] {extra}')


def error(fn, *args) -> str:
    with pytest.raises(TriremeError) as ei:
        fn(*args)
    assert ei.value.code == Code.INVALID_ARG
    return str(ei.value)


def assert_qa(text: str, full: str, *expected: str) -> None:
    """Our whole text, then the qa `expected` pattern(s) as test.sh greps them."""
    assert text == full
    assert any(re.search(e, text) for e in expected), (text, expected)


def passes(cfg: mc.ModelConfig, composing: dict) -> None:
    C.validate(cfg)
    validate_ensemble(cfg)
    validate_steps(cfg, composing)
    assert is_decoupled(cfg, composing) is False  # Triton's expected: model_transaction_policy {}
