"""docker-compose.yml, the Dockerfile and deploy/ against the code.

- The compose file (and its GPU override) validates with Debian's docker-compose 1.29
  (`docker-compose config`, installed by deploy/install-test-tools.sh when missing); its
  normalized output is what the rest of the checks read.
- Each service's command is parsed by that service's own argument parser (with the compose
  environment as DFLASH_* variables), so ports, hosts and paths are the ones the code will
  listen on and open; the health checks run the project's probe against exactly those ports and
  health service names; the gateway dials the target and draft where they listen.
- Only the gateway's ports and Grafana are published; models are prepared once into the named
  volume the others mount; the draft is the trained drafter shipped in models/.
- deploy/prometheus.yml scrapes each service where it exposes /metrics (promtool validates it);
  Grafana's provisioning points at that Prometheus and loads the dashboard."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from support.procs import REPO

from bench import grafana_dashboard
from bench.local_prometheus import ensure_installed
from runtime.home import model_dir

COMPOSE = REPO / "docker-compose.yml"
GPU_OVERRIDE = REPO / "deploy" / "docker-compose.gpu.yml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus.yml"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
SERVICES = {"prepare", "target", "draft", "gateway", "prometheus", "grafana"}
WORKDIR = "/app"                     # the Dockerfile's WORKDIR


def compose_config(*files: Path, env: dict[str, str] | None = None) -> dict:
    ensure_installed(("docker-compose",))
    cmd = ["docker-compose"] + [a for f in files for a in ("-f", str(f))] + ["config"]
    done = subprocess.run(cmd, cwd=REPO, check=False, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config(COMPOSE)


@pytest.fixture
def parsed(compose, monkeypatch):
    """service -> its command parsed by the service's own parser, with the compose environment."""
    from gateway.__main__ import parse_args as gateway_args
    from services.draft.__main__ import parse_args as draft_args
    from services.target.__main__ import parse_args as target_args
    parsers = {"target": ("services.target", target_args), "draft": ("services.draft", draft_args),
               "gateway": ("gateway", gateway_args)}
    out = {}
    for name, (module, parse) in parsers.items():
        service = compose["services"][name]
        for key in [k for k in os.environ if k.startswith("DFLASH_")]:
            monkeypatch.delenv(key)
        for key, value in (service.get("environment") or {}).items():
            monkeypatch.setenv(key, str(value))
        cmd = service["command"]
        assert cmd[:3] == ["python", "-m", module], cmd
        out[name] = parse(cmd[3:])
    return out


def test_compose_file_validates(compose):
    assert set(compose["services"]) == SERVICES
    assert {"dflash-home", "prometheus-data", "grafana-data"} <= set(compose["volumes"])


def test_gpu_override_validates_and_selects_cuda(monkeypatch):
    merged = compose_config(COMPOSE, GPU_OVERRIDE)
    from services.target.__main__ import parse_args
    target = merged["services"]["target"]
    for key, value in target["environment"].items():
        monkeypatch.setenv(key, str(value))
    args = parse_args(target["command"][3:])
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    devices = target["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_gpu_override_gives_the_gateway_dflash_ups_gpu_defaults(monkeypatch):
    """The drafter's block, drafting at every load and trees of GPU_DFLASH_TREE_NODES, as
    `dflash up --device cuda` (the CPU file's block 4 and no drafting above 1 request do not
    leak into the GPU stack)."""
    from dflash.stack import GPU_DFLASH_TREE_NODES
    from gateway.__main__ import parse_args
    gateway = compose_config(COMPOSE, GPU_OVERRIDE)["services"]["gateway"]
    for key in [k for k in os.environ if k.startswith("DFLASH_")]:
        monkeypatch.delenv(key)
    for key, value in gateway["environment"].items():
        monkeypatch.setenv(key, str(value))
    config = parse_args(gateway["command"][3:])
    assert (config.block_size, config.spec_disable_batch_size, config.spec_tree_nodes) == \
        (0, 0, GPU_DFLASH_TREE_NODES)


def test_the_draft_shares_the_targets_ipc_namespace(compose):
    """The draft reads the target's /dev/shm feature plane (else features go through the
    gateway)."""
    assert compose["services"]["target"]["ipc"] == "shareable"
    assert compose["services"]["draft"]["ipc"] == "service:target"


def test_cpu_stack_runs_dflash_up_dtypes(parsed):
    """As `dflash up` on the CPU: an fp32 target and a draft of dtype auto (CPU_DFLASH_DRAFT_DTYPE:
    bf16 where the host's CPU computes it natively)."""
    from dflash.stack import CPU_DFLASH_DRAFT_DTYPE
    assert (parsed["target"].dtype, parsed["target"].device) == ("float32", "cpu")
    assert (parsed["draft"].dtype, parsed["draft"].device) == (CPU_DFLASH_DRAFT_DTYPE, "cpu")


def healthcheck_probe(service: dict) -> tuple[str, str]:
    """(address, health service name) the healthcheck asks, after checking it is the probe."""
    test = service["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "services.common.health_probe"], test
    from services.common.health_probe import parse_args
    probe = parse_args(test[4:])
    return probe.address, probe.service


def test_health_checks_ask_what_each_service_listens_on(compose, parsed):
    from gateway.state import SERVICE_NAME as GATEWAY
    from services.draft.servicer import SERVICE_NAME as DRAFT
    from services.target.servicer import SERVICE_NAME as TARGET
    gateway = parsed["gateway"]
    expected = {"target": (parsed["target"].port, TARGET), "draft": (parsed["draft"].port, DRAFT),
                "gateway": (gateway.port, GATEWAY)}
    for name, (port, health_name) in expected.items():
        assert healthcheck_probe(compose["services"][name]) == (f"127.0.0.1:{port}", health_name)
    for name in ("target", "draft"):
        assert parsed[name].host == "0.0.0.0"          # reachable from the gateway's container
    assert gateway.host == "0.0.0.0"


def test_gateway_dials_target_and_draft_where_they_listen(compose, parsed):
    gateway = parsed["gateway"]
    assert gateway.target == f"target:{parsed['target'].port}"
    assert gateway.draft == f"draft:{parsed['draft'].port}"
    assert gateway.tokenizer_dir == parsed["target"].model == parsed["draft"].target_model
    depends = compose["services"]["gateway"]["depends_on"]
    assert depends == {"target": {"condition": "service_healthy"},
                       "draft": {"condition": "service_healthy"}}


def test_the_internal_token_reaches_all_three():
    """Issue 39: DFLASH_INTERNAL_TOKEN in the environment of `docker compose up` is the internal
    ports' secret of the target and draft and what the gateway sends them."""
    compose = compose_config(COMPOSE, env={"DFLASH_INTERNAL_TOKEN": "t0ken-for-compose"})
    for name in ("target", "draft", "gateway"):
        env = compose["services"][name]["environment"]
        assert env["DFLASH_INTERNAL_TOKEN"] == "t0ken-for-compose", name


def test_only_gateway_and_grafana_are_published(compose, parsed):
    published = {name: {(p["published"], p["target"]) for p in svc.get("ports", [])}
                 for name, svc in compose["services"].items() if svc.get("ports")}
    gateway = parsed["gateway"]
    assert published == {"gateway": {(gateway.http_port, gateway.http_port),
                                      (gateway.port, gateway.port)},
                         "grafana": {(3000, 3000)}}


def test_models_prepared_once_into_the_named_volume(compose, parsed):
    services = compose["services"]
    prepare = services["prepare"]
    home = prepare["environment"]["DFLASH_HOME"]
    assert prepare["command"][:4] == ["python", "-m", "dflash.cli", "prepare-model"]
    import argparse

    from dflash.prepare import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(prepare["command"][4:])
    assert args.name in cli.MODELS
    prepared = {str(model_dir(args.name, dtype, Path(home))) for dtype in args.dtypes}
    assert parsed["target"].model in prepared
    assert f"dflash-home:{home}:rw" in prepare["volumes"]
    for name in ("target", "draft", "gateway"):
        assert f"dflash-home:{home}:ro" in services[name]["volumes"], name
    for name in ("target", "draft"):        # the gateway comes after them
        assert services[name]["depends_on"]["prepare"] == \
            {"condition": "service_completed_successfully"}


def test_draft_is_the_shipped_trained_drafter(parsed):
    """The same drafter `dflash up` picks by default (dflash/stack.py)."""
    from dflash.stack import DEFAULT_DRAFTER, SHIPPED_DRAFTER
    args = parsed["draft"]
    assert args.drafter == DEFAULT_DRAFTER == "dflash"
    assert args.model.startswith(f"{WORKDIR}/")
    shipped = REPO / args.model.removeprefix(f"{WORKDIR}/")
    assert shipped == SHIPPED_DRAFTER
    assert (shipped / "config.json").is_file() and (shipped / "model.safetensors").is_file()
    dockerfile = (REPO / "Dockerfile").read_text().splitlines()
    assert f"WORKDIR {WORKDIR}" in dockerfile and "COPY models models" in dockerfile


def scrape_targets() -> dict[str, tuple[str, str]]:
    """job -> (host:port, metrics path) of deploy/prometheus.yml."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    out = {}
    for job in cfg["scrape_configs"]:
        [static] = job["static_configs"]
        [target] = static["targets"]
        out[job["job_name"]] = (target, job.get("metrics_path", "/metrics"))
    return out


def test_prometheus_scrapes_each_service_where_it_exposes_metrics(compose, parsed):
    ensure_installed(("promtool",))
    check = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)],
                           check=False, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert scrape_targets() == {
        "gateway": (f"gateway:{parsed['gateway'].http_port}", "/metrics"),
        "target": (f"target:{parsed['target'].metrics_port}", "/metrics"),
        "draft": (f"draft:{parsed['draft'].metrics_port}", "/metrics")}
    prom = compose["services"]["prometheus"]
    assert f"{PROMETHEUS_YML}:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert "ports" not in prom


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    provisioning = mounts[str(PROVISIONING)]
    dashboards_dir = mounts[str(grafana_dashboard.DASHBOARD.parent)]
    assert provisioning == "/etc/grafana/provisioning"
    [source] = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090" in [str(p) for p in compose["services"]["prometheus"]["expose"]]
    [provider] = yaml.safe_load((PROVISIONING / "dashboards" / "dflash.yml").read_text())[
        "providers"]
    assert provider["options"]["path"] == dashboards_dir
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_dir}/{grafana_dashboard.DASHBOARD.name}"
    uids = {p["datasource"]["uid"] for p in grafana_dashboard.load()["panels"]} | {
        t["datasource"]["uid"] for p in grafana_dashboard.load()["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
