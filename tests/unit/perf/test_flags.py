"""perf_analyzer's command line as `trireme perf` reads it: defaults, ranges, the checks
with perf_analyzer's texts, the refused flags (each named), and exit codes."""
from __future__ import annotations

import pytest

from services.perf.flags import REFUSED, UsageError, build_parser, settings_from


def parse(*argv: str):
    return settings_from(build_parser().parse_args(list(argv)))


def test_defaults_are_perf_analyzers():
    s = parse("-m", "simple")
    assert (s.url, s.protocol, s.batch_size) == ("localhost:8000", "http", 1)
    assert s.concurrency_range == (1, 1, 1) and s.load_mode == "concurrency"
    assert (s.measurement_mode, s.measurement_interval_ms, s.measurement_request_count) == \
        ("time_windows", 5000, 50)
    assert (s.stability, s.max_trials, s.percentile) == (0.10, 10, -1)
    assert parse("-m", "simple", "-i", "grpc").url == "localhost:8001"


def test_ranges_shapes_headers_and_parameters():
    s = parse("-m", "m", "--concurrency-range", "2:16:2", "--shape", "IMAGE:3,224,224",
              "--shape", "a:b:4", "-H", "Authorization: Bearer x", "--request-parameter",
              "max_tokens:256:int", "--request-parameter", "flag:true:bool", "-s", "5")
    assert s.concurrency_range == (2, 16, 2)
    assert s.shapes == {"IMAGE": [3, 224, 224], "a:b": [4]}
    assert s.headers == {"Authorization": "Bearer x"}
    assert s.request_parameters == {"max_tokens": 256, "flag": True}
    assert s.stability == pytest.approx(0.05)
    r = parse("-m", "m", "--request-rate-range", "10.5:100:20", "--latency-threshold", "50")
    assert r.load_mode == "request_rate" and r.rate_range == (10.5, 100.0, 20.0)
    assert parse("-m", "m", "-t", "4").concurrency_range == (4, 1, 1)
    assert parse("-m", "m", "-z").input_data == ["zero"]
    assert parse("-m", "m", "-u", "https://host:8000").ssl.https


@pytest.mark.parametrize("argv,text", [
    ([], "-m flag must be specified"),
    (["-m", "m", "--concurrency-range", "1:0"], "can not be both 0"),
    (["-m", "m", "--concurrency-range", "1:2", "--request-rate-range", "5"], "Cannot use both"),
    (["-m", "m", "--shape", "x"], "There must be a colon after input name"),
    (["-m", "m", "--shape", "x:0"], "must be > 0"),
    (["-m", "m", "-p", "0"], "--measurement-interval (-p)"),
    (["-m", "m", "--max-trials", "0"], "--max-trials (-r)"),
    (["-m", "m", "--streaming"], "Streaming is only allowed with gRPC protocol."),
    (["-m", "m", "--binary-search", "--concurrency-range", "1:8"], "--binary-search"),
    (["-m", "m", "-H", "novalue"], "-H 'novalue'"),
    (["-m", "m", "--ssl-https-client-certificate-type", "DER"], "PEM files only"),
])
def test_bad_values_name_the_flag(argv, text):
    with pytest.raises(UsageError) as e:
        parse(*argv)
    assert text in str(e.value)


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_every_refused_flag_is_refused_by_name(flag):
    argv = ["-m", "m", flag] if flag in ("--fixed-schedule", "--enable-mpi") else \
        ["-m", "m", flag, "x"]
    with pytest.raises(UsageError) as e:
        parse(*argv)
    assert str(e.value).startswith(f"{flag} is not supported by trireme perf: ")


def test_an_unknown_flag_exits_99_not_argparses_2(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["-m", "m", "--no-such-flag"])
    assert e.value.code == 99   # (2 is perf_analyzer's "unstable")
    assert "Error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err
