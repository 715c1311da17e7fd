"""services/common/logsettings.py: Triton's log settings applied to a process's Python
logging — the line formats (triton common src/logging.cc), the three switches and the
verbose levels, the log file, the scheduler's answer to an update, the flags."""
from __future__ import annotations

import argparse
import calendar
import json
import logging
import os
import sys

import msgspec
import pytest

from services.common import logsettings
from services.common import messages as m
from services.common.errors import Code
from services.common.logsettings import TritonFormatter

# 2025-11-24 08:00:00.123456 UTC
WHEN = calendar.timegm((2025, 11, 24, 8, 0, 0)) + 0.123456


def record(msg: str = "hello", level: int = logging.INFO, name: str = "trireme.test",
           args: tuple = (), exc_info=None) -> logging.LogRecord:
    r = logging.LogRecord(name, level, "/x/services/scheduler/main.py", 42, msg, args, exc_info)
    r.created, r.process = WHEN, 1234
    return r


@pytest.fixture
def fresh():
    """configure() changes the root logger and the environment: undone after each test."""
    logsettings.reset()
    yield
    logsettings.reset()


# ---- line formats --------------------------------------------------------------------------

@pytest.mark.parametrize("level, letter", [
    (logging.DEBUG, "I"), (logging.INFO, "I"), (logging.WARNING, "W"), (logging.ERROR, "E"),
    (logging.CRITICAL, "E")])
def test_default_format_is_tritons(level, letter):
    line = TritonFormatter("default", escape=True).format(record("a %s", level, args=("b",)))
    assert line == f'{letter}1124 08:00:00.123456 1234 main.py:42] "a b"'


def test_iso8601_format_is_tritons():
    line = TritonFormatter("ISO8601", escape=True).format(record(level=logging.WARNING))
    assert line == '2025-11-24T08:00:00Z W 1234 main.py:42] "hello"'


def test_messages_are_written_as_json_strings_one_line_per_record():
    """Triton 2.51 escapes messages (TritonJson::SerializeString): quotes, backslashes and
    newlines escaped, other text as it is; a traceback stays on its record's line."""
    try:
        raise ValueError("boom")
    except ValueError:
        exc = sys.exc_info()
    line = TritonFormatter("default", escape=True).format(
        record('say "hi"\\ é\tend', level=logging.ERROR, exc_info=exc))
    assert "\n" not in line
    prefix, _, text = line.partition("] ")
    assert prefix == "E1124 08:00:00.123456 1234 main.py:42"
    decoded = json.loads(text)
    assert decoded.startswith('say "hi"\\ é\tend\nTraceback (most recent call last):')
    assert decoded.endswith("ValueError: boom")
    assert 'say \\"hi\\"\\\\ é\\tend\\nTraceback' in text


def test_escaping_off_as_tritons_environment_variable_says(monkeypatch):
    monkeypatch.setenv(logsettings.ESCAPE_ENV, "0")
    assert TritonFormatter("default").format(record('a "b"')).endswith('] a "b"')
    monkeypatch.setenv(logsettings.ESCAPE_ENV, "1")
    assert TritonFormatter("default").format(record('a "b"')).endswith('] "a \\"b\\""')


# ---- the switches, the levels, the file -------------------------------------------------

def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def emit_all(tag: str) -> None:
    own, lib = logging.getLogger("trireme.test"), logging.getLogger("somelibrary")
    own.log(5, f"{tag} own-below-debug")
    own.debug(f"{tag} own-debug")
    own.info(f"{tag} own-info")
    own.warning(f"{tag} own-warning")
    own.error(f"{tag} own-error")
    logging.getLogger("services.frontend.x").debug(f"{tag} services-debug")
    lib.debug(f"{tag} lib-debug")
    lib.info(f"{tag} lib-info")


def written(path, tag: str) -> set[str]:
    return {json.loads(line.partition("] ")[2]).split(" ", 1)[1]
            for line in lines(path) if f'"{tag} ' in line}


def test_switches_and_verbose_levels(fresh, tmp_path):
    path = tmp_path / "log.txt"
    base = m.LogConfig(log_file=str(path))
    cases = {
        "defaults": (base, {"own-info", "own-warning", "own-error", "lib-info"}),
        "no-info": (msgspec.structs.replace(base, log_info=False),
                    {"own-warning", "own-error"}),
        "no-warning": (msgspec.structs.replace(base, log_warning=False),
                       {"own-info", "own-error", "lib-info"}),
        "errors-only": (msgspec.structs.replace(base, log_info=False, log_warning=False),
                        {"own-error"}),
        "nothing": (msgspec.structs.replace(base, log_info=False, log_warning=False,
                                            log_error=False), set()),
        "verbose-1": (msgspec.structs.replace(base, log_verbose_level=1),
                      {"own-debug", "services-debug", "own-info", "own-warning",
                       "own-error", "lib-info"}),
        # verbose lines are written whether info lines are or not (Triton's LOG_VERBOSE)
        "verbose-1-no-info": (msgspec.structs.replace(base, log_verbose_level=1,
                                                      log_info=False),
                              {"own-debug", "services-debug", "own-warning", "own-error"}),
        "verbose-2": (msgspec.structs.replace(base, log_verbose_level=2),
                      {"own-below-debug", "own-debug", "services-debug", "lib-debug",
                       "own-info", "own-warning", "own-error", "lib-info"}),
    }
    for tag, (settings, expected) in cases.items():
        assert logsettings.configure(settings) == settings
        emit_all(tag)
        assert written(path, tag) == expected, tag


def test_verbose_lines_are_info_lines(fresh, tmp_path):
    path = tmp_path / "log.txt"
    logsettings.configure(m.LogConfig(log_file=str(path), log_verbose_level=1,
                                      log_format="ISO8601"))
    logging.getLogger("trireme.test").debug("verbose one")
    line = next(x for x in lines(path) if "verbose one" in x)
    when, letter, pid, where, text = line.split(" ", 4)
    assert (letter, pid, text) == ("I", str(os.getpid()), '"verbose one"')
    assert where.startswith("test_logsettings.py:") and when.endswith("Z")


def test_log_file_is_appended_to_and_stderr_is_the_default(fresh, tmp_path, capsys):
    path = tmp_path / "log.txt"
    path.write_text("before\n")
    log = logging.getLogger("trireme.test")
    logsettings.configure(m.LogConfig())
    log.warning("to stderr")
    logsettings.configure(m.LogConfig(log_file=str(path)))
    log.warning("to the file")
    logsettings.configure(m.LogConfig())
    log.warning("to stderr again")
    err = capsys.readouterr().err
    assert '"to stderr"' in err and '"to stderr again"' in err and "to the file" not in err
    assert lines(path)[0] == "before" and lines(path)[1].endswith('"to the file"')
    assert len(lines(path)) == 2


def test_a_log_file_that_cannot_be_opened_keeps_the_destination(fresh, tmp_path, capsys):
    """As Triton's SetLogFile: the previous file stays (at start: stderr, log_file "")."""
    bad = str(tmp_path / "no" / "such" / "dir" / "x.log")
    applied = logsettings.configure(m.LogConfig(log_file=bad))
    assert applied.log_file == "" and logsettings.current().log_file == ""
    err = capsys.readouterr().err
    assert f"cannot open the log file '{bad}'" in err and "logging to stderr" in err
    good = tmp_path / "good.log"
    logsettings.configure(m.LogConfig(log_file=str(good)))
    assert logsettings.configure(m.LogConfig(log_file=bad)).log_file == str(good)
    assert "logging to '" + str(good) + "'" in good.read_text()


def test_apply_keeps_the_process_own_log_file(fresh, tmp_path):
    own = tmp_path / "own.log"
    logsettings.configure(m.LogConfig(log_file=str(own)))
    applied = logsettings.apply(m.LogConfig(log_file="/elsewhere.log", log_info=False,
                                            log_format="ISO8601", log_verbose_level=3))
    assert applied == m.LogConfig(log_file=str(own), log_info=False, log_format="ISO8601",
                                  log_verbose_level=3)


def test_children_inherit_the_settings_through_the_environment(fresh, tmp_path):
    settings = m.LogConfig(log_file=str(tmp_path / "x.log"), log_warning=False,
                           log_verbose_level=2, log_format="ISO8601")
    logsettings.configure(settings)
    assert logsettings.inherited() == settings
    p = argparse.ArgumentParser()
    logsettings.add_log_args(p)
    assert logsettings.from_args(p.parse_args([])) == settings
    assert logsettings.from_args(p.parse_args(["--log-warning", "on"])).log_warning is True
    logsettings.reset()
    assert logsettings.LOG_ENV not in os.environ
    assert logsettings.inherited() == m.LogConfig()


def test_inherited_ignores_a_malformed_environment(monkeypatch):
    monkeypatch.setenv(logsettings.LOG_ENV, '{"log_file": 3}')
    assert logsettings.inherited() == m.LogConfig()


# ---- Triton's verbose level arithmetic and the scheduler's answer -------------------------

@pytest.mark.parametrize("value, level", [
    (0, 0), (1, 1), (2**31 - 1, 2**31 - 1), (2**31, 0), (2**32 - 1, 0), (2**32, 0),
    (2**32 + 1, 1), (2**64 - 1, 0)])
def test_verbose_level_is_tritons_int32_cast(value, level):
    """LOG_SET_VERBOSE(static_cast<int32_t>(v)) with max(0, L): tritonserver 2.51 answers
    0 for 2147483648, 4294967295 and 18446744073709551615."""
    assert logsettings.verbose_level(value) == level


def test_answer_reads_and_applies_whole_updates(fresh, tmp_path):
    path = str(tmp_path / "s.log")
    logsettings.configure(m.LogConfig(log_file=path))
    got = logsettings.answer(m.GetLogSettings(7))
    assert got == m.LogSettings(7, m.LogConfig(log_file=path))
    done = logsettings.answer(m.SetLogSettings(8, log_info=False, log_verbose_level=2))
    assert done.error is None and done.ctl_id == 8
    assert done.settings == m.LogConfig(log_file=path, log_info=False, log_verbose_level=2)
    assert logsettings.current() == done.settings
    assert logsettings.changed() == m.LogSettingsChanged(done.settings)
    # a bad value (the frontends refuse it first): nothing changes
    for bad, text in (({"log_format": "iso"}, "invalid argument for log_format, got: iso"),
                      ({"log_verbose_level": -1}, "expect int32 for 'log_verbose_level'")):
        refused = logsettings.answer(m.SetLogSettings(9, log_warning=False, **bad))
        assert refused.error == m.ErrorRecord(int(Code.INVALID_ARG), text)
        assert refused.settings == done.settings == logsettings.current()


def test_messages_round_trip():
    for msg in (m.GetLogSettings(1), m.SetLogSettings(2, log_error=False, log_format="ISO8601"),
                m.LogSettings(3, m.LogConfig(log_file="f", log_verbose_level=4),
                              m.ErrorRecord(3, "x")),
                m.LogSettingsChanged(m.LogConfig(log_info=False))):
        assert m.decode(m.encode(msg))[0] == msg
        assert m.decode(m.encode(msg), for_worker=True)[0] == msg


# ---- flags ---------------------------------------------------------------------------------

def parse(*argv: str) -> m.LogConfig:
    p = argparse.ArgumentParser()
    logsettings.add_log_args(p)
    return logsettings.from_args(p.parse_args(list(argv)))


def test_flags_as_triton_parses_them(fresh):
    assert parse() == m.LogConfig()
    assert parse("--log-verbose", "true", "--log-info", "false", "--log-warning", "OFF",
                 "--log-error", "0", "--log-format", "ISO8601", "--log-file", "f.log") == \
        m.LogConfig(log_file="f.log", log_info=False, log_warning=False, log_error=False,
                    log_verbose_level=1, log_format="ISO8601")
    assert parse("--log-verbose=false").log_verbose_level == 0
    assert parse("--log-verbose=-3").log_verbose_level == 0          # max(0, L)
    assert parse("--log-verbose", "7").log_verbose_level == 7
    assert parse("--log-warn=false").log_warning is False            # getopt's prefixes too


@pytest.mark.parametrize("argv", [["--log-verbose", "x"], ["--log-verbose", "2147483648"],
                                  ["--log-info", "maybe"], ["--log-format", "iso8601"]])
def test_bad_flags_are_refused(fresh, argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_every_command_takes_the_flags(fresh, capsys):
    """serve and scheduler (services.cli), frontend and workers (their own parsers)."""
    from services.cli import build_parser
    from services.frontend.main import main as frontend_main
    from services.workers.host import main as host_main
    for command in ("serve", "scheduler"):
        args = build_parser().parse_args([command, "--model-repository", "/tmp",
                                          "--log-format", "ISO8601", "--log-verbose", "2",
                                          "--log-file", "x.log", "--log-info", "false"])
        assert logsettings.from_args(args) == m.LogConfig(
            log_file="x.log", log_info=False, log_verbose_level=2, log_format="ISO8601")
    for main in (frontend_main, host_main):
        with pytest.raises(SystemExit) as info:
            main(["--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        for flag in ("--log-verbose", "--log-info", "--log-warning", "--log-error",
                     "--log-format", "--log-file"):
            assert flag in out
