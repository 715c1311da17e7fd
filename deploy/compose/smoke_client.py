"""The client side of deploy/compose/smoke.sh: each subcommand is one check, prints one short
detail line and exits 0, or prints why it failed and exits 1. Needs tritonclient[all] and
numpy (the repository's .venv has both).

    smoke_client.py ready       --http H:P --timeout S [--models a,b]
    smoke_client.py infer       --http H:P --grpc H:P
    smoke_client.py big         --http H:P --grpc H:P [--mib 4]
    smoke_client.py spread      --http H:P --metrics H:P --frontends N [--requests 90]
    smoke_client.py models-ready --http H:P --models a,b --timeout S
    smoke_client.py under-restart --http H:P --grpc H:P --clients N -- CMD...
    smoke_client.py image-clean --image IMG --bundle PEM
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np

SIMPLE_A = np.arange(16, dtype=np.float32).reshape(1, 16)
SIMPLE_B = np.ones((1, 16), dtype=np.float32)
REQUEST_TIMEOUT_S = 30.0


class Failed(Exception):
    pass


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_until(pred, timeout: float, step: float = 0.05) -> float:
    """Seconds until pred() held; Failed after timeout."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise Failed(f"not within {timeout:.0f}s")
        time.sleep(step)


def simple_http(url: str) -> None:
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(url, connection_timeout=REQUEST_TIMEOUT_S,
                                              network_timeout=REQUEST_TIMEOUT_S)
    try:
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"),
                  httpclient.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(SIMPLE_A)
        inputs[1].set_data_from_numpy(SIMPLE_B, binary_data=True)
        result = client.infer("simple", inputs)
        check_simple(result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))
    finally:
        client.close()


def simple_grpc(url: str) -> None:
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    try:
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
                  grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(SIMPLE_A)
        inputs[1].set_data_from_numpy(SIMPLE_B)
        result = client.infer("simple", inputs, client_timeout=REQUEST_TIMEOUT_S)
        check_simple(result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1"))
    finally:
        client.close()


def check_simple(out0, out1) -> None:
    if out0 is None or out1 is None:
        raise Failed("missing outputs")
    if not (np.array_equal(out0, SIMPLE_A + SIMPLE_B) and np.array_equal(out1, SIMPLE_A - SIMPLE_B)):
        raise Failed(f"wrong result: {out0.ravel()[:4]}..., {out1.ravel()[:4]}...")


def simple_json(url: str, timeout: float = REQUEST_TIMEOUT_S) -> None:
    """One request on a new TCP connection (urllib never reuses one): with SO_REUSEPORT the
    kernel picks a frontend per connection."""
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": SIMPLE_A.ravel().tolist()},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": SIMPLE_B.ravel().tolist()},
    ]}).encode()
    req = urllib.request.Request(f"http://{url}/v2/models/simple/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = {o["name"]: o["data"] for o in json.load(r)["outputs"]}
    except urllib.error.HTTPError as e:
        try:
            text = json.loads(e.read()).get("error", "")
        except ValueError:
            text = ""
        raise Failed(f"HTTP Error {e.code}: {text}") from None
    check_simple(np.array(out["OUTPUT0"], np.float32).reshape(1, 16),
                 np.array(out["OUTPUT1"], np.float32).reshape(1, 16))


def frontend_counts(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^trireme_frontend_requests\{frontend="([^"]+)"\} (\S+)$', text, re.M)}


# ---- subcommands ---------------------------------------------------------------------------

def cmd_ready(a) -> str:
    # time to the first successful inference, from the moment the caller started `up`
    dt = wait_until(lambda: http_status(f"http://{a.http}/v2/health/ready") == 200, a.timeout, 0.1)
    t_ready = time.monotonic()

    def infer_ok() -> bool:
        try:
            simple_json(a.http, timeout=5)
            return True
        except Exception:  # noqa: BLE001 - not ready yet: any error means try again
            return False
    wait_until(infer_ok, a.timeout, 0.1)
    return f"health/ready after {dt:.2f}s, first inference {time.monotonic() - t_ready:.2f}s later"


def cmd_infer(a) -> str:
    t0 = time.perf_counter()
    simple_http(a.http)
    t1 = time.perf_counter()
    simple_grpc(a.grpc)
    t2 = time.perf_counter()
    return f"simple over HTTP {1e3 * (t1 - t0):.0f} ms, gRPC {1e3 * (t2 - t1):.0f} ms (new clients)"


def cmd_big(a) -> str:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    n = a.mib * (1 << 20) // 4
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    x[:4] = [np.nan, np.inf, -0.0, 1e-45]  # bytes, not values: NaN and -0.0 must survive
    details = []
    for proto, mod, url in (("HTTP", httpclient, a.http), ("gRPC", grpcclient, a.grpc)):
        http = proto == "HTTP"
        client = (mod.InferenceServerClient(url, network_timeout=REQUEST_TIMEOUT_S) if http
                  else mod.InferenceServerClient(url))
        try:
            inp = mod.InferInput("INPUT0", [n], "FP32")
            inp.set_data_from_numpy(x)
            timeout = {} if http else {"client_timeout": REQUEST_TIMEOUT_S}
            t0 = time.perf_counter()
            result = client.infer("identity_fp32", [inp], **timeout)
            dt = time.perf_counter() - t0
        finally:
            client.close()
        y = result.as_numpy("OUTPUT0")
        if y is None or y.tobytes() != x.tobytes():
            raise Failed(f"{proto}: the {a.mib} MiB tensor came back different")
        details.append(f"{proto} {1e3 * dt:.0f} ms")
    return f"{a.mib} MiB FP32 round trip byte-exact: " + ", ".join(details)


def cmd_spread(a) -> str:
    before = frontend_counts(a.metrics)
    for _ in range(a.requests):
        simple_json(a.http)
    after = frontend_counts(a.metrics)
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0.0)}
    shares = ", ".join(str(int(v)) for v in sorted(grew.values(), reverse=True))
    if len(grew) < a.frontends:
        raise Failed(f"{a.requests} requests on new connections reached {len(grew)} frontend(s) "
                     f"({shares}), expected {a.frontends} (scheduler metric trireme_frontend_requests)")
    return f"{a.requests} requests over {len(grew)} frontends: {shares}"


def cmd_models_ready(a) -> str:
    models = a.models.split(",")

    def all_ready() -> bool:
        return all(http_status(f"http://{a.http}/v2/models/{m}/ready", 1.0) == 200 for m in models)
    dt = wait_until(all_ready, a.timeout, 0.05)
    return f"{','.join(models)} READY {dt:.2f}s after this check began"


def cmd_not_ready(a) -> str:
    """Waits until one of the models is not ready (the loss was noticed)."""
    models = a.models.split(",")
    dt = wait_until(lambda: any(http_status(f"http://{a.http}/v2/models/{m}/ready", 1.0) != 200
                                for m in models), a.timeout, 0.02)
    return f"not ready after {dt:.2f}s"


def cmd_under_restart(a) -> str:
    """Clients loop on `simple` (HTTP on new connections, gRPC on one channel each), every
    request with a 30 s timeout, while CMD runs (e.g. docker restart <scheduler>). Measures
    from the end of CMD to the first success of a request sent after it, then keeps the
    clients going a few more seconds: none may hang (reach its timeout)."""
    import tritonclient.grpc as grpcclient
    stop = threading.Event()
    records: list[tuple[str, float, float, bool, str]] = []  # client, start, end, ok, error
    lock = threading.Lock()

    def run_http(name: str) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                simple_json(a.http, timeout=REQUEST_TIMEOUT_S)
                ok, err = True, ""
            except Exception as e:  # noqa: BLE001 - every failure is recorded
                ok, err = False, f"{type(e).__name__}: {e}"
            with lock:
                records.append((name, t0, time.monotonic(), ok, err))
            if not ok:
                time.sleep(0.05)

    def run_grpc(name: str) -> None:
        client = grpcclient.InferenceServerClient(a.grpc)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
                  grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(SIMPLE_A)
        inputs[1].set_data_from_numpy(SIMPLE_B)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = client.infer("simple", inputs, client_timeout=REQUEST_TIMEOUT_S)
                check_simple(r.as_numpy("OUTPUT0"), r.as_numpy("OUTPUT1"))
                ok, err = True, ""
            except Exception as e:  # noqa: BLE001 - every failure is recorded
                ok, err = False, f"{type(e).__name__}: {str(e)[:120]}"
            with lock:
                records.append((name, t0, time.monotonic(), ok, err))
            if not ok:
                time.sleep(0.05)
        client.close()

    threads = [threading.Thread(target=run_http if i % 2 == 0 else run_grpc,
                                args=(f"{'http' if i % 2 == 0 else 'grpc'}{i}",), daemon=True)
               for i in range(a.clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    with lock:
        warm = [r for r in records if r[3]]
    if not warm:
        stop.set()
        raise Failed("no client succeeded before the restart")
    t_cmd = time.monotonic()
    proc = subprocess.run(a.cmd, capture_output=True, text=True, timeout=120)
    t_cmd_end = time.monotonic()
    if proc.returncode != 0:
        stop.set()
        raise Failed(f"{' '.join(a.cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
    deadline = t_cmd_end + a.timeout
    t_back = None
    while time.monotonic() < deadline and t_back is None:
        time.sleep(0.05)
        with lock:
            later = [r for r in records if r[3] and r[1] >= t_cmd_end]
        if later:
            t_back = min(r[2] for r in later)
    time.sleep(3.0)  # keep serving a little: every client must be answered again
    stop.set()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 5)
    hung = [t.name for t in threads if t.is_alive()]
    with lock:
        done = list(records)
    after = [r for r in done if r[1] >= t_cmd]
    failed = [r for r in after if not r[3]]
    slowest = max((r[2] - r[1] for r in after), default=0.0)
    timeouts = [r for r in failed if "timed out" in r[4].lower() or "deadline" in r[4].lower()]
    names = sorted({r[0] for r in done})
    back_per_client = {n: any(r[0] == n and r[3] and r[1] >= t_cmd_end for r in done) for n in names}
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[error_kind(r[4])] = kinds.get(error_kind(r[4]), 0) + 1
    errors = [f"{n}x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])]
    summary = (f"{a.clients} clients, {len(after)} requests from the restart on, {len(failed)} failed fast, "
               f"slowest {slowest:.2f}s, restart command {t_cmd_end - t_cmd:.2f}s")
    if hung or timeouts or slowest >= REQUEST_TIMEOUT_S:
        raise Failed(f"clients hung: {hung or [r[0] for r in timeouts]}; {summary}")
    if t_back is None:
        raise Failed(f"no success within {a.timeout:.0f}s after the restart; {summary}; errors: {errors}")
    if not all(back_per_client.values()):
        raise Failed(f"clients never served again: {[n for n, ok in back_per_client.items() if not ok]}")
    took = t_back - t_cmd
    if took > a.target:
        raise Failed(f"serving again {took:.2f}s after the restart began (target {a.target:.0f}s); {summary}")
    return f"serving again {took:.2f}s after `{' '.join(a.cmd[:2])}` began; {summary}" + (
        f" ({', '.join(errors)})" if errors else "")


def error_kind(err: str) -> str:
    """A failed request's error, short: the HTTP code or gRPC status and the message's start."""
    m = re.search(r"HTTP Error (\d+): (.{0,40})", err)
    if m:
        return f"HTTP {m.group(1)} '{m.group(2).strip()}'"
    m = re.search(r"\[StatusCode\.(\w+)\] (.{0,40})", err)
    if m:
        return f"gRPC {m.group(1)} '{m.group(2).strip()}'"
    return err[:50]


def cmd_image_clean(a) -> str:
    """The final image holds no copy of the build-time CA bundle: no file named like it, no
    layer created by a step that mentions it, and no file containing a certificate of the
    bundle that the image's own CA store does not have (those are the build machine's
    additions, e.g. a TLS-intercepting proxy's CA)."""
    history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", a.image],
                             check=True, capture_output=True, text=True).stdout
    if "build-ca" in history or "PIP_CERT" in history:
        raise Failed("docker history of the final image mentions the build CA")
    pem = open(a.bundle).read()
    certs = re.findall(r"-----BEGIN CERTIFICATE-----\s*(.*?)-----END CERTIFICATE-----", pem, re.S)
    cid = subprocess.run(["docker", "create", a.image], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        proc = subprocess.Popen(["docker", "export", cid], stdout=subprocess.PIPE)
        files = {}
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                if member.isfile():
                    if "build-ca" in member.name:
                        raise Failed(f"file {member.name} in the image")
                    f = tar.extractfile(member)
                    if f is not None and member.size < (64 << 20):
                        data = f.read()
                        if b"-----BEGIN CERTIFICATE-----" in data:
                            files[member.name] = re.sub(rb"\s+", b"", data)
        proc.wait()
    finally:
        subprocess.run(["docker", "rm", cid], capture_output=True)
    image_store = files.get("etc/ssl/certs/ca-certificates.crt", b"")
    extra = [re.sub(r"\s+", "", c).encode() for c in certs]
    extra = [c for c in extra if c not in image_store]
    found = [(name, i) for i, c in enumerate(extra) for name, data in files.items() if c[:200] in data]
    if found:
        raise Failed(f"build-only certificates found in the image: {found[:5]}")
    return (f"{len(files)} files with certificates scanned; none of the {len(extra)} build-only "
            f"certificates of {a.bundle}; history clean")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd_name", required=True)
    s = sub.add_parser("ready")
    s.add_argument("--http", required=True)
    s.add_argument("--timeout", type=float, default=120)
    s.set_defaults(fn=cmd_ready)
    s = sub.add_parser("infer")
    s.add_argument("--http", required=True)
    s.add_argument("--grpc", required=True)
    s.set_defaults(fn=cmd_infer)
    s = sub.add_parser("big")
    s.add_argument("--http", required=True)
    s.add_argument("--grpc", required=True)
    s.add_argument("--mib", type=int, default=4)
    s.set_defaults(fn=cmd_big)
    s = sub.add_parser("spread")
    s.add_argument("--http", required=True)
    s.add_argument("--metrics", required=True)
    s.add_argument("--frontends", type=int, required=True)
    s.add_argument("--requests", type=int, default=90)
    s.set_defaults(fn=cmd_spread)
    for name, fn in (("models-ready", cmd_models_ready), ("not-ready", cmd_not_ready)):
        s = sub.add_parser(name)
        s.add_argument("--http", required=True)
        s.add_argument("--models", required=True)
        s.add_argument("--timeout", type=float, default=30)
        s.set_defaults(fn=fn)
    s = sub.add_parser("under-restart")
    s.add_argument("--http", required=True)
    s.add_argument("--grpc", required=True)
    s.add_argument("--clients", type=int, default=4)
    s.add_argument("--timeout", type=float, default=60, help="give up waiting for service")
    s.add_argument("--target", type=float, default=10, help="fail when serving takes longer")
    s.add_argument("cmd", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_under_restart)
    s = sub.add_parser("image-clean")
    s.add_argument("--image", required=True)
    s.add_argument("--bundle", required=True)
    s.set_defaults(fn=cmd_image_clean)
    a = p.parse_args()
    if getattr(a, "cmd", None) and a.cmd[:1] == ["--"]:
        a.cmd = a.cmd[1:]
    try:
        print(a.fn(a))
    except Failed as e:
        print(e)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - one line for smoke.sh, whatever went wrong
        print(f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
