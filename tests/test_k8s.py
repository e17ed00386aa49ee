"""The Kubernetes manifests (deploy/k8s: a kustomize base, the cpu, gpu and cpu-tls overlays),
checked without a cluster: each overlay renders offline (`kubectl kustomize`), every rendered
object validates against the Kubernetes 1.32 schemas (kubernetes-validate, strict: no unknown
fields), and what the objects say agrees with the code - the probes ask grpc.health.v1 for each
service's own name on its --port (liveness the whole server, so a draining service is not
killed), the grace period covers --drain-grace, the headless Services and the gateway's
--target/--draft name the same ports, the internal token and API keys come from the Secret, and
the dashboard ConfigMap is the compose dashboard."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.grpc_api import SERVICE_NAME as GATEWAY
from services.draft.servicer import SERVICE_NAME as DRAFT
from services.target.servicer import SERVICE_NAME as TARGET

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy/k8s"
OVERLAYS = ("cpu", "gpu", "cpu-tls")
KUBERNETES = "1.32"
SERVICES = {"dflash-target": TARGET, "dflash-draft": DRAFT, "dflash-gateway": GATEWAY}
DRAIN_GRACE_S = 30
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (client)")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render(overlay)
    assert {o["kind"] for o in objects} == {"ConfigMap", "Service", "Deployment"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_grace_agree_with_the_services(overlay):
    objects = render(overlay)
    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    assert set(deployments) == set(SERVICES)
    for name, health_name in SERVICES.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        port = int(flag(c["command"], "--port"))
        assert float(flag(c["command"], "--drain-grace")) == DRAIN_GRACE_S
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= sleep + DRAIN_GRACE_S + 1
        for probe, asked in (("startupProbe", health_name), ("readinessProbe", health_name),
                             ("livenessProbe", "")):
            spec = c[probe]
            if overlay.endswith("tls"):             # exec: health_probe over mutual TLS
                cmd = spec["exec"]["command"]
                assert cmd[:3] == ["python", "-m", "services.common.health_probe"]
                assert cmd[3:5] == [f"127.0.0.1:{port}", asked] and "--ca" in cmd
            else:
                assert spec["grpc"] == {"port": port, "service": asked}, (name, probe)
        env = {e["name"]: e for e in c["env"]}
        assert env["DFLASH_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "dflash-secrets"
        ports = {p["containerPort"] for p in c["ports"]}
        assert port in ports
        if name != "dflash-gateway":
            assert services[name]["spec"]["clusterIP"] == "None"         # headless
            assert {p["port"] for p in services[name]["spec"]["ports"]} == ports
        metrics = deployments[name]["spec"]["template"]["metadata"]["annotations"]
        assert metrics["prometheus.io/scrape"] == "true"
        assert int(metrics["prometheus.io/port"]) in ports
    gateway = deployments["dflash-gateway"]["spec"]["template"]["spec"]["containers"][0]
    # the gateway finds every replica behind the headless Services (gateway/replicas.py)
    assert flag(gateway["command"], "--target") == "dns:dflash-target:50051"
    assert flag(gateway["command"], "--draft") == "dns:dflash-draft:50052"
    assert {e["name"] for e in gateway["env"]} >= {"DFLASH_API_KEYS", "DFLASH_INTERNAL_TOKEN"}


def test_the_overlays_set_the_launchers_defaults():
    cpu, gpu = (by_kind(render(o), "Deployment") for o in ("cpu", "gpu"))

    def env(deps: dict, name: str) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in deps[name]["spec"]["template"]["spec"]
                ["containers"][0]["env"]}
    assert env(cpu, "dflash-gateway")["DFLASH_BLOCK_SIZE"] == "4"
    assert env(cpu, "dflash-draft")["DFLASH_DTYPE"] == "auto"
    assert env(gpu, "dflash-gateway")["DFLASH_SPEC_TREE_NODES"] == "15"
    for name in ("dflash-target", "dflash-draft"):
        c = gpu[name]["spec"]["template"]["spec"]["containers"][0]
        assert env(gpu, name)["DFLASH_DEVICE"] == "cuda" and c["image"].endswith(":cuda")
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
        names = [e["name"] for e in c["env"]]
        assert len(names) == len(set(names)), names                      # no variable twice


def test_the_dashboard_config_map_is_the_compose_dashboard():
    (cm,) = by_kind(render("cpu"), "ConfigMap").values()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    compose = json.loads((REPO / "deploy/grafana/dashboards/dflash.json").read_text())
    assert json.loads(cm["data"]["dflash.json"]) == compose
