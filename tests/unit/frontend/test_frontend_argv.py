"""`trireme serve` hands every frontend flag on to its frontend processes (frontend_argv),
derived from add_frontend_args rather than copied by hand."""
from __future__ import annotations

import argparse

import pytest

from services.frontend.main import add_frontend_args, frontend_argv, settings_from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_frontend_args(p)
    return p


@pytest.mark.parametrize("argv", [
    [],
    ["--no-shm", "--allow-grpc", "false", "--server-name", "triton", "--http-port", "0",
     "--grpc-port", "0", "--host", "::1", "--http-max-input-size", "5",
     "--inline-threshold", "0", "--grpc-impl", "aio", "--http-impl", "aiohttp"],
    ["--http-header-forward-pattern", "", "--grpc-header-forward-pattern", "my_.*|^x$"],
])
def test_round_trip(argv):
    p = _parser()
    args = p.parse_args(argv)
    forwarded = frontend_argv(args)
    assert vars(p.parse_args(forwarded)) == vars(args)
    assert settings_from_args(p.parse_args(forwarded), "unix:///s") == settings_from_args(args, "unix:///s")


def test_every_flag_is_forwarded():
    actions = add_frontend_args(argparse.ArgumentParser())
    # a repeatable flag forwards one copy per value given, one without a default only when
    # given: give each one a value
    forwarded = frontend_argv(_parser().parse_args(
        ["--no-shm", "--http-restricted-api", "health:k=v",
         "--grpc-restricted-protocol", "health:k=v", "--http-header-forward-pattern", "",
         "--grpc-header-forward-pattern=(?-i)X_.*"]))
    assert {a.option_strings[-1] for a in actions} == {f for f in forwarded if f.startswith("--")}


def test_serve_parser_forwards_the_same_flags():
    """The serve parser (scheduler flags + frontend flags) gives the frontend only its own."""
    from services.cli import _add_scheduler_args
    serve = argparse.ArgumentParser()
    _add_scheduler_args(serve)
    add_frontend_args(serve)
    args = serve.parse_args(["--model-repository", "/tmp", "--http-port", "9000"])
    forwarded = frontend_argv(args)
    assert "--model-repository" not in forwarded
    assert _parser().parse_args(forwarded).http_port == 9000
