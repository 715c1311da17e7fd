"""--metrics-config and its companions, parsed as tritonserver parses them
(server/src/command_line_parser.cc, core/src/metric_model_reporter.cc), on the `trireme`
command line and in services.scheduler.metrics_config."""
from __future__ import annotations

import pytest

from services.cli import build_parser
from services.scheduler.metrics_config import DEFAULT_QUANTILES, MetricsOptions, parse_quantiles


def parse(*argv: str):
    return build_parser().parse_args(["serve", "--model-repository", "/tmp", *argv])


def test_defaults_are_tritons():
    o = MetricsOptions.from_settings(object())
    assert (o.counter_latencies, o.histogram_latencies, o.summary_latencies) == (True, False, False)
    assert o.quantiles == ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
    assert (o.interval_ms, o.cpu, o.gpu) == (2000, True, True)
    args = parse()
    assert (args.metrics_config, args.metrics_interval_ms, args.allow_cpu_metrics,
            args.allow_gpu_metrics) == ([], 2000, True, True)


@pytest.mark.parametrize("bad", ["foo", "a,b=c", "x=", "=y"])
def test_bad_metrics_config_is_refused_in_tritons_words(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--metrics-config", bad)
    assert f"--metrics-config option format is <setting>=<value>. Got {bad}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"option format is <setting>=<value>\. Got "):
        MetricsOptions.parse([bad])


def test_metrics_interval_is_a_positive_integer(capsys):
    assert parse("--metrics-interval-ms", "250").metrics_interval_ms == 250
    with pytest.raises(SystemExit):
        parse("--metrics-interval-ms", "abc")
    assert "Invalid option value. Got abc" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--metrics-interval-ms", "0")


def test_flags_reach_the_scheduler_settings():
    from services.cli import _scheduler_settings
    args = parse("--metrics-config", "summary_latencies=true", "--metrics-config",
                 "summary_quantiles=0.5:0.01", "--metrics-interval-ms", "100",
                 "--allow-cpu-metrics", "false", "--allow-gpu-metrics", "0")
    s = _scheduler_settings(args, "unix:///x/f.sock", "unix:///x/w.sock", "127.0.0.1")
    o = MetricsOptions.from_settings(s)
    assert o.summary_latencies and o.quantiles == ((0.5, 0.01),)
    assert (o.interval_ms, o.cpu, o.gpu) == (100, False, False)


def test_values_turn_on_only_as_tritons_do(caplog):
    # Triton: counter_latencies is off only for "false"; the others on only for "true"
    o = MetricsOptions.parse(["counter_latencies=False", "histogram_latencies=yes",
                              "summary_latencies=true"])
    assert (o.counter_latencies, o.histogram_latencies, o.summary_latencies) == (True, False, True)
    assert "read as true" in caplog.text and "read as false" in caplog.text
    o = MetricsOptions.parse(["counter_latencies=false"])
    assert not o.counter_latencies


def test_unknown_setting_is_ignored_with_a_warning(caplog):
    assert MetricsOptions.parse(["summary_max_age=10"]) == MetricsOptions()
    assert "unknown setting 'summary_max_age'" in caplog.text


def test_allow_metrics_false_turns_the_rest_off():
    o = MetricsOptions.parse(["histogram_latencies=true", "summary_latencies=true"], enabled=False)
    assert not (o.histogram_latencies or o.summary_latencies or o.cpu or o.gpu)


def test_quantiles_parse_as_std_stod_and_skip_bad_pairs_in_tritons_words():
    errors: list[str] = []
    got = parse_quantiles("0.1:0.0.1,bad,0.7:x,0.75:0.01,1.5:0.1", errors.append)
    assert got == ((0.1, 0.0), (0.75, 0.01))
    assert errors[0] == ("Invalid option: [bad]. No ':' delimiter found. Expected format is "
                         "<quantile>:<error>")
    assert errors[1].startswith("Invalid option: [0.7:x]. Error: ")
    assert errors[2].startswith("Invalid option: [1.5:0.1]. Error: ")
    assert parse_quantiles("nothing", errors.append) == DEFAULT_QUANTILES
