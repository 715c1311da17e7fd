"""L0_response_cache against Trireme (triton_qa.py --only response_cache).

Replays qa/L0_response_cache/test.sh's server sections, one `trireme serve` each, with
test.sh's flags (`--cache-config ...`, `--response-cache-byte-size ...`,
`--model-control-mode=explicit --load-model=...`):

  decoupled model           models/decoupled_cache (backend "identity", decoupled, cache
                            enabled): the server must fail to start, its log holding a line
                            with "response cache does not currently support" and "decoupled"
                            (grep -i | grep -i)
  cache flags               models/identity_cache: --response-cache-byte-size=8192 and
                            --cache-config=local,size=8192 start; local + redis, and
                            --response-cache-byte-size with --cache-config, fail with
                            "multiple cache configurations" / "incompatible flags" (grep -i)
  redis flags               a redis-server of our own (Debian's, on 6379 as test.sh's, or a
                            free port when 6379 is taken), stopped at the end: host+port
                            starts; port=nonexistent, host=nonexistent and no host fail with
                            test.sh's texts
  redis auth                `config set requirepass` as set_redis_auth: the password on the
                            command line, wrong, none; TRITONCACHE_REDIS_USERNAME /
                            _PASSWORD in the server's environment, right and wrong
  decoupled ensemble        ensemble_cache_decoupled (the ensemble decoupled, its cache on),
                            ensemble_cache_composing_decoupled (the ensemble's cache on, its
                            composing onnx model decoupled): the server must fail, as above
  ensemble cache            ensemble_cache_test.py EnsembleCacheTest.<case>, four servers
                            (--cache-config local,size=10840, explicit; the last 200 and
                            test.sh's grep -i "Failed to insert key" afterwards)

Repositories as test.sh builds them: models/ (the folder's decoupled_cache and identity_cache
with a version folder 1) holding ensemble_models, ensemble_cache_decoupled and
ensemble_cache_composing_decoupled, each a copy of qa_ensemble_model_repository/
qa_model_repository/simple_onnx_float32_float32_float32 and qa_model_repository/
onnx_float32_float32_float32 (qa_gen's ONNX and ensemble generators), the two
`echo ... >> config.pbtxt` lines appended where test.sh appends them.

Not run: the C++ unit test (response_cache_test, gtest against Triton's core and the
local/redis cache libraries) and the memory growth test (valgrind massif around
tritonserver, perf_analyzer).
"""
from __future__ import annotations

import atexit
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import qa_gen
import qa_tree

SUITE = "response_cache"
SUITES = (SUITE,)
TEST_DIR = "L0_response_cache"
TEST = "ensemble_cache_test.py"
EXPORT_PATHS = ("qa/L0_response_cache",)
ENSEMBLE_MODEL = "simple_onnx_float32_float32_float32"
COMPOSING_MODEL = "onnx_float32_float32_float32"
REDIS_HOST = "localhost"   # test.sh: TRITON_REDIS_HOST
REDIS_PW = "redis123!"     # test.sh: REDIS_PW
ENSEMBLE_CASES = (   # test.sh's test_response_cache_ensemble_model calls, in order
    ("test_ensemble_top_level_response_cache", 10840),
    ("test_ensemble_all_models_cache_enabled", 10840),
    ("test_ensemble_composing_model_cache_enabled", 10840),
    ("test_ensemble_cache_insertion_failure", 200),
)


def grep_i(*texts: str) -> re.Pattern:
    """`grep -i A | grep -i B ...`: a line holding every text, any case."""
    return re.compile("^" + "".join(f"(?=.*{re.escape(t)})" for t in texts), re.I | re.M)


def grep_i_any(*texts: str) -> re.Pattern:
    """`grep -i "A\\|B"`: a line holding one of the texts, any case."""
    return re.compile("|".join(re.escape(t) for t in texts), re.I)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """test.sh's start_redis / set_redis_auth / unset_redis_auth / stop_redis, on a
    redis-server this runner starts (in the foreground, as its child) and stops."""

    def __init__(self, work: Path, log) -> None:
        self.work = work
        self.log = log
        self.port = 6379 if _port_free(6379) else _free_port()
        self.password = ""
        self.proc: subprocess.Popen | None = None
        atexit.register(self.stop)

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin"}
        if self.password:
            env["REDISCLI_AUTH"] = self.password
        return subprocess.run(["redis-cli", "-h", REDIS_HOST, "-p", str(self.port), *args],
                              capture_output=True, text=True, env=env, timeout=10)

    def start(self) -> None:
        if self.proc is not None:
            return
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (test.sh's install_redis: "
                               "apt install redis)")
        data = self.work / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "-::1",
             "--save", "", "--appendonly", "no", "--dir", str(data),
             "--logfile", str(self.work / "logs" / "redis-server.cli_tests.log"),
             "--loglevel", "debug"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        for _ in range(100):
            if self.proc.poll() is not None:
                break
            try:
                if self._cli("ping").stdout.strip() == "PONG":
                    self.log(f"redis-server on {REDIS_HOST}:{self.port} (pid {self.proc.pid})")
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def set_auth(self) -> None:
        self._cli("config", "set", "requirepass", REDIS_PW)
        self.password = REDIS_PW

    def unset_auth(self) -> None:
        self._cli("config", "set", "requirepass", "")
        self.password = ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


def _repositories(work: Path, log) -> Path:
    """test.sh's MODEL_DIR, with its three ensemble repositories inside."""
    models = work / "qa" / TEST_DIR / "models"
    qa_model = qa_gen.datadir(work, "qa_model_repository", log)
    ensembles = qa_gen.datadir(work, "qa_ensemble_model_repository/qa_model_repository", log)
    for name in ("ensemble_models", "ensemble_cache_decoupled",
                 "ensemble_cache_composing_decoupled"):
        d = models / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        qa_gen.copytree(ensembles / ENSEMBLE_MODEL, d / ENSEMBLE_MODEL)
        qa_gen.copytree(qa_model / COMPOSING_MODEL, d / COMPOSING_MODEL)
    (models / "decoupled_cache" / "1").mkdir(parents=True, exist_ok=True)
    (models / "identity_cache" / "1").mkdir(parents=True, exist_ok=True)
    # echo -e "..." >> config.pbtxt (echo's newline after each)
    dec = models / "ensemble_cache_decoupled" / ENSEMBLE_MODEL / "config.pbtxt"
    qa_gen.append(dec, "response_cache { enable: True }\n")
    qa_gen.append(dec, "model_transaction_policy { decoupled: True }\n")
    comp = models / "ensemble_cache_composing_decoupled"
    qa_gen.append(comp / ENSEMBLE_MODEL / "config.pbtxt", "response_cache { enable: True }\n")
    qa_gen.append(comp / COMPOSING_MODEL / "config.pbtxt",
                  "model_transaction_policy { decoupled: True }\n")
    return models


def phases(suites: list[str], source: qa_tree.TritonSource, work: Path, phase_cls, log
           ) -> list:
    if SUITE not in suites:
        return []
    log(f"response_cache: exported {', '.join(qa_gen.export(source, work, EXPORT_PATHS))}")
    models = _repositories(work, log)
    redis = Redis(work, log)
    phase = qa_gen.make_phase(phase_cls, SUITE, TEST_DIR)
    decoupled_text = grep_i("response cache does not currently support", "decoupled")

    def must_fail(key: str, run: str, repo: Path, args: tuple[str, ...], what: str,
                  needle, **kw):
        return phase(key, run, None, repository=repo, args=args, server_must_fail=True,
                     log_checks=((what, needle),), **kw)

    def must_start(key: str, run: str, args: tuple[str, ...], **kw):
        return phase(key, run, None, repository=models, args=(*args, *extra),
                     server_must_start=True, **kw)

    def decoupled(key: str, run: str, repo: Path, model: str):
        # check_server_failure_decoupled_model
        return must_fail(key, run, repo, ("--cache-config", "local,size=10480",
                                          "--model-control-mode=explicit",
                                          f"--load-model={model}"),
                         "response cache / decoupled error", decoupled_text)

    extra = ("--model-control-mode=explicit", "--load-model=identity_cache")
    endpoint = ("--cache-config", f"redis,host={REDIS_HOST}",
                "--cache-config", f"redis,port={redis.port}")
    env_user = "TRITONCACHE_REDIS_USERNAME"
    env_pw = "TRITONCACHE_REDIS_PASSWORD"
    out = [
        decoupled("decoupled_cache", "decoupled model + cache", models, "decoupled_cache"),
        must_start("byte_size", "--response-cache-byte-size=8192",
                   ("--response-cache-byte-size=8192",)),
        must_start("cache_config", "--cache-config=local,size=8192",
                   ("--cache-config=local,size=8192",)),
        must_fail("multiple", "local and redis --cache-config", models,
                  ("--cache-config=local,size=8192", "--cache-config=redis,key=value", *extra),
                  "multiple cache configurations", grep_i("multiple cache configurations")),
        must_fail("incompatible", "--response-cache-byte-size with --cache-config", models,
                  ("--response-cache-byte-size=12345", "--cache-config=local,size=67890",
                   *extra), "incompatible flags", grep_i("incompatible flags")),
        must_start("redis", "redis host and port", endpoint, before=redis.start),
        must_fail("redis_bad_port", "redis port=nonexistent", models,
                  ("--cache-config=redis,host=localhost", "--cache-config=redis,port=nonexistent",
                   *extra), "failed to connect",
                  grep_i("failed to connect to Redis (localhost:0): Connection refused")),
        must_fail("redis_bad_host", "redis host=nonexistent", models,
                  ("--cache-config=redis,host=nonexistent",
                   "--cache-config=redis,port=nonexistent", *extra), "name resolution",
                  grep_i_any("Temporary failure in name resolution", "Name or service not known")),
        must_fail("redis_no_host", "redis port only", models,
                  (f"--cache-config=redis,port={REDIS_HOST}", *extra), "Must at a minimum specify",
                  grep_i("Must at a minimum specify")),
        must_start("redis_auth", "redis auth: password flag", (*endpoint, "--cache-config",
                   f"redis,password={REDIS_PW}"), before=redis.set_auth),
        must_fail("redis_auth_wrong", "redis auth: wrong password flag", models,
                  (*endpoint, "--cache-config", "redis,password=wrong", *extra), "WRONGPASS",
                  grep_i("WRONGPASS")),
        must_fail("redis_auth_none", "redis auth: no password", models, (*endpoint, *extra),
                  "NOAUTH Authentication required", grep_i("NOAUTH Authentication required")),
        must_start("redis_env_pw", f"redis auth: {env_pw}", endpoint,
                   server_env={env_pw: REDIS_PW}),
        must_start("redis_env_user_pw", f"redis auth: {env_user}=default, {env_pw}", endpoint,
                   server_env={env_user: "default", env_pw: REDIS_PW}),
        must_fail("redis_env_wrong", f"redis auth: {env_user}=default, wrong {env_pw}", models,
                  (*endpoint, *extra), "WRONGPASS", grep_i("WRONGPASS"),
                  server_env={env_user: "default", env_pw: "wrong"}),
        decoupled("ensemble_decoupled", "ensemble decoupled + cache",
                  models / "ensemble_cache_decoupled", ENSEMBLE_MODEL),
        decoupled("ensemble_composing_decoupled", "ensemble cache, composing model decoupled",
                  models / "ensemble_cache_composing_decoupled", ENSEMBLE_MODEL),
    ]

    def after_redis() -> None:   # unset_redis_auth; stop_redis
        redis.unset_auth()
        redis.stop()
    out[-2].before = after_redis
    for case, size in ENSEMBLE_CASES:
        checks = ((("Failed to insert key", grep_i("Failed to insert key")),)
                  if case == "test_ensemble_cache_insertion_failure" else ())
        out.append(phase(case, f"ensemble cache, local,size={size}", TEST,
                         (f"EnsembleCacheTest.{case}",), models / "ensemble_models",
                         ("--cache-config", f"local,size={size}",
                          "--model-control-mode=explicit"),
                         expected=1, server_must_start=True, log_after=checks))
    out.append(phase("unit_test", "C++ unit test", "response_cache_test", not_run=(
        "gtest binary against Triton's core and its local/redis cache libraries (C++)")))
    out.append(phase("memory_growth", "memory growth (identity_cache)", None, not_run=(
        "valgrind massif around the tritonserver process and perf_analyzer (C++ tools)")))
    return out
