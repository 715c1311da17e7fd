"""deploy/k8s: the kustomize overlays, rendered by kustomize_lite and validated against
Kubernetes' schemas (kubernetes-validate), KServe's ServingRuntime against KServe's CRD
schema, and the behaviour a user relies on: probes, /dev/shm, graceful shutdown, the Service
and the autoscaler finding the pods, GPUs, and flags that `trireme serve` accepts."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.cli import FRONTEND_GRACE_S, build_parser

from . import kustomize_lite
from .kustomize_lite import KustomizeError

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "models-from-image")
# Schemas shipped by kubernetes-validate: the newest it has, and an older one still in wide
# use, so that nothing needs a field added after 1.30.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
ADAPTER_RULES = K8S / "base" / "prometheus-adapter-rules.yaml"
SERVING_RUNTIME = K8S / "kserve" / "servingruntime.yaml"
CRD_SCHEMA = Path(__file__).parent / "data" / "kserve-v0.20.0-servingruntime-schema.json"
METRIC = "nv_inference_pending_request_count"

_rendered: dict[str, list[dict]] = {}


def render(overlay: str) -> list[dict]:
    if overlay not in _rendered:
        _rendered[overlay] = kustomize_lite.build(K8S / "overlays" / overlay)
    return _rendered[overlay]


def one(objs: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def pod_spec(objs: list[dict]) -> dict:
    return one(objs, "Deployment")["spec"]["template"]["spec"]


def trireme_container(objs: list[dict]) -> dict:
    (c,) = [c for c in pod_spec(objs)["containers"] if c["name"] == "trireme"]
    return c


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- the flags: parsed by `trireme serve`'s own argument definitions ----------------------

class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # raise instead of printing usage and exiting
        raise _Refused(message)


def serve_parser() -> argparse.ArgumentParser:
    """`trireme serve`'s own parser (services.cli.build_parser), refusing by raising."""
    top = build_parser(_Parser)
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    assert argv[:2] == ["trireme", "serve"], argv
    flags = argv[2:]
    for arg in flags:   # no abbreviations: argparse accepts prefixes, Trireme's docs don't
        if arg.startswith("--"):
            assert arg.split("=")[0] in serve_parser()._option_string_actions, arg
    try:
        return serve_parser().parse_args(flags)
    except _Refused as e:
        raise AssertionError(f"`trireme serve` refuses {flags}: {e}") from None


def container_argv(c: dict) -> list[str]:
    """What the container runs: the containers set `args` only, after the image's
    ENTRYPOINT, which runs `trireme` (test_image_entrypoint_runs_trireme)."""
    assert "command" not in c, "`command` would replace the image's tini -- trireme"
    return ["trireme", *c["args"]]


def test_image_entrypoint_runs_trireme():
    dockerfile = ROOT / "deploy" / "docker" / "Dockerfile"
    if not dockerfile.is_file():
        pytest.skip("no deploy/docker/Dockerfile")
    lines = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    entrypoint = json.loads(lines[-1].removeprefix("ENTRYPOINT"))
    if entrypoint[0] == "tini":
        entrypoint = entrypoint[entrypoint.index("--") + 1:]
    assert entrypoint == ["trireme"]


# ---- the renderer ------------------------------------------------------------------------

def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamePrefix: x-\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        kustomize_lite.build(tmp_path)
    base = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "a", "image": "i", "ports": [{"containerPort": 1}]}]}}
    patch = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
             "spec": {"containers": [{"name": "a", "ports": [{"containerPort": 2}]}]}}
    with pytest.raises(KustomizeError, match="merge strategy"):
        kustomize_lite.apply_patch([base], patch)
    with pytest.raises(KustomizeError, match="matches 0"):
        kustomize_lite.apply_patch([base], {**patch, "metadata": {"name": "q"}})


def test_renderer_merges_like_a_strategic_merge_patch():
    base = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": {"template": {"spec": {
                "containers": [{"name": "a", "image": "x:1", "command": ["a", "b"],
                                "resources": {"limits": {"cpu": "1"}}}],
                "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]}}}}
    patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
             "spec": {"template": {"spec": {
                 "containers": [{"name": "a", "command": ["c"], "resources": {"limits": {"gpu": 1}}},
                                {"name": "b", "image": "y"}],
                 "volumes": [{"name": "v", "persistentVolumeClaim": None, "emptyDir": {}}]}}}}
    (out,) = kustomize_lite.apply_patch([base], patch)
    spec = out["spec"]["template"]["spec"]
    assert spec["containers"] == [
        {"name": "a", "image": "x:1", "command": ["c"], "resources": {"limits": {"cpu": "1", "gpu": 1}}},
        {"name": "b", "image": "y"}]
    assert spec["volumes"] == [{"name": "v", "emptyDir": {}}]
    assert kustomize_lite.apply_patch([base], {**patch, "$patch": "delete", "spec": None}) == []


def test_every_manifest_is_rendered_or_standalone():
    """No YAML file under deploy/k8s escapes these tests: each is a kustomization, listed in
    one (resource or patch), or one of the standalone manifests tested below."""
    used = {ADAPTER_RULES, SERVING_RUNTIME}
    for k in K8S.rglob("kustomization.yaml"):
        used.add(k)
        spec = yaml.safe_load(k.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            target = (k.parent / entry).resolve()
            if target.is_file():
                used.add(target)
    assert {p.resolve() for p in K8S.rglob("*.y*ml")} == used
    assert {p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")} == set(OVERLAYS)


# ---- schema validation ---------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_are_valid_kubernetes(overlay, version):
    objs = render(overlay)
    assert objs
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_adapter_rules_configmap_is_valid_kubernetes(version):
    (cm,) = kustomize_lite.load_documents(ADAPTER_RULES)
    kubernetes_validate.validate(cm, version, strict=True)


def test_kubernetes_validate_is_strict():
    """The validation above would catch a misplaced or misspelt field."""
    dep = json.loads(json.dumps(one(render("cpu"), "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBERNETES_VERSIONS[-1], strict=True)


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server prunes them silently."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_validator() -> jsonschema.protocols.Validator:
    schema = _strict(json.loads(CRD_SCHEMA.read_text()))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def serving_runtime() -> dict:
    (sr,) = kustomize_lite.load_documents(SERVING_RUNTIME)
    return sr


def test_serving_runtime_is_valid_for_kserve():
    sr = serving_runtime()
    assert (sr["apiVersion"], sr["kind"], sr["metadata"]["name"]) == (
        "serving.kserve.io/v1alpha1", "ServingRuntime", "trireme")
    crd_validator().validate(sr)
    # and the validator is strict
    bad = json.loads(json.dumps(sr))
    bad["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        crd_validator().validate(bad)


def test_serving_runtime_passes_kserve_webhook_priority_rule():
    """KServe's ServingRuntime webhook (validateModelFormatPrioritySame) refuses one runtime
    giving one auto-selected format two priorities."""
    priorities: dict[str, set] = {}
    for f in serving_runtime()["spec"]["supportedModelFormats"]:
        if f.get("autoSelect"):
            priorities.setdefault(f["name"], set()).add(f.get("priority"))
    assert priorities and all(len(p) == 1 for p in priorities.values())


def test_serving_runtime_serves_kserve_v2():
    spec = serving_runtime()["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    names = {f["name"] for f in spec["supportedModelFormats"]}
    assert {"onnx", "pytorch", "tensorflow", "triton"} <= names
    (c,) = [c for c in spec["containers"] if c["name"] == "kserve-container"]
    args = parse_serve(container_argv(c))
    assert args.model_repository == [Path("/mnt/models")]   # where KServe puts storageUri
    assert (args.http_port, args.grpc_port) == (8080, 9000)
    assert args.model_control_mode == "none"    # explicit would open the repository API
    assert args.metrics_port == int(spec["annotations"]["prometheus.kserve.io/port"])
    assert args.exit_timeout_secs + FRONTEND_GRACE_S < 30   # the pod's default grace period
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    _assert_memory_shm(c, spec["volumes"])


# Kubernetes' resource.Quantity syntax (the pattern its OpenAPI schemas give quantities;
# kubernetes-validate's JSON schemas only say "string").
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _quantities(node: Any, key: str = "", parent: str = ""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _quantities(v, k, key)
    elif isinstance(node, list):
        for v in node:
            yield from _quantities(v, key, parent)
    elif key in ("sizeLimit", "averageValue", "storage") or parent in ("requests", "limits"):
        yield f"{parent}.{key}", node


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_quantities_are_well_formed(overlay):
    found = list(_quantities(render(overlay))) + list(_quantities(serving_runtime()))
    assert any(k == "target.averageValue" for k, _ in found)
    for where, value in found:
        assert isinstance(value, int) or QUANTITY.match(value), (where, value)


# ---- behaviour ------------------------------------------------------------------------------

def _assert_memory_shm(container: dict, volumes: list[dict]) -> None:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in volumes if v["name"] == mount["name"]]
    assert set(vol) == {"name", "emptyDir"}
    assert vol["emptyDir"]["medium"] == "Memory"
    assert vol["emptyDir"]["sizeLimit"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_command_is_accepted_by_trireme_serve(overlay):
    c = trireme_container(render(overlay))
    args = parse_serve(container_argv(c))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)
    assert args.model_repository == [Path("/models")]
    assert args.exit_timeout_secs == 30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_triton_health_endpoints(overlay):
    c = trireme_container(render(overlay))
    http = parse_serve(container_argv(c)).http_port

    def target(probe: str) -> tuple[str, int]:
        get = c[probe]["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
        return get["path"], port

    assert target("livenessProbe") == ("/v2/health/live", http)
    assert target("readinessProbe") == ("/v2/health/ready", http)
    assert target("startupProbe") == ("/v2/health/ready", http)
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 300   # models load slowly


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dev_shm_is_memory_with_a_size_limit(overlay):
    objs = render(overlay)
    _assert_memory_shm(trireme_container(objs), pod_spec(objs)["volumes"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_exit_timeout(overlay):
    objs = render(overlay)
    c = trireme_container(objs)
    exit_timeout = parse_serve(container_argv(c)).exit_timeout_secs
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = pod_spec(objs)["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + exit_timeout + FRONTEND_GRACE_S + 5


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_reaches_the_pods(overlay):
    objs = render(overlay)
    dep, svc = one(objs, "Deployment"), one(objs, "Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], labels)
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert selects(svc["spec"]["selector"], labels)
    c = trireme_container(objs)
    by_name = {p["name"]: p["containerPort"] for p in c["ports"]}
    exposed = {}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        exposed[p["port"]] = by_name[target] if isinstance(target, str) else target
    assert exposed == {8000: 8000, 8001: 8001, 8002: 8002}
    (grpc,) = [p for p in svc["spec"]["ports"] if p["port"] == 8001]
    assert grpc["appProtocol"] in ("grpc", "kubernetes.io/h2c")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_scraped_on_the_metrics_port(overlay):
    objs = render(overlay)
    ann = one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    args = parse_serve(container_argv(trireme_container(objs)))
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == args.metrics_port
    assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_the_deployment_on_pending_requests(overlay):
    objs = render(overlay)
    dep, hpa = one(objs, "Deployment"), one(objs, "HorizontalPodAutoscaler")
    assert "replicas" not in dep["spec"]        # the HPA owns it
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"], "Deployment", dep["metadata"]["name"])
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"


def test_adapter_rule_serves_the_hpa_metric_summed_per_pod():
    (cm,) = kustomize_lite.load_documents(ADAPTER_RULES)
    (rule,) = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"] == METRIC + '{namespace!="",pod!=""}'
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    assert rule["metricsQuery"] == "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
    assert re.fullmatch(rule["name"]["matches"], METRIC)
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], METRIC) == METRIC
    # Trireme exports the metric under that name, as a gauge
    from services.scheduler.metrics import COUNTERS
    assert COUNTERS[METRIC][0] == "gauge"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pdb_covers_the_pods(overlay):
    objs = render(overlay)
    pdb = one(objs, "PodDisruptionBudget")
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_non_root_without_privileges(overlay):
    spec = pod_spec(render(overlay))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert not sc.get("privileged") and sc.get("runAsUser", 10001) != 0


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_image():
    objs = render("gpu")
    c = trireme_container(objs)
    assert c["image"] == "trireme:cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod_spec(objs)["tolerations"]


@pytest.mark.parametrize("overlay", ["cpu", "models-from-image"])
def test_cpu_overlays_use_the_cpu_image_and_no_gpu(overlay):
    objs = render(overlay)
    assert trireme_container(objs)["image"] == "trireme:cpu"
    assert "nvidia.com/gpu" not in json.dumps(objs)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_models_come_read_only_from_the_claim(overlay):
    objs = render(overlay)
    c = trireme_container(objs)
    repo = str(parse_serve(container_argv(c)).model_repository[0])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == repo]
    assert mount["readOnly"] is True
    (vol,) = [v for v in pod_spec(objs)["volumes"] if v["name"] == mount["name"]]
    claim = vol["persistentVolumeClaim"]["claimName"]
    assert claim == "trireme-models"
    assert one(objs, "PersistentVolumeClaim")["metadata"]["name"] == claim


def test_models_from_image_copies_into_an_empty_dir_first():
    objs = render("models-from-image")
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    spec = pod_spec(objs)
    c = trireme_container(objs)
    repo = str(parse_serve(container_argv(c)).model_repository[0])
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == repo]
    assert mount["readOnly"] is True
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert set(vol) == {"name", "emptyDir"}
    (init,) = spec["initContainers"]
    assert init["image"] == "trireme-models:latest"
    assert [m for m in init["volumeMounts"] if m["name"] == vol["name"] and not m.get("readOnly")]


def test_readme_names_existing_paths():
    text = (K8S / "README.md").read_text()
    paths = set(re.findall(r"deploy/k8s/[\w./-]*[\w]", text))
    assert paths
    for p in paths:
        assert (ROOT / p).exists(), p
    for overlay in OVERLAYS:
        assert f"deploy/k8s/overlays/{overlay}" in text
