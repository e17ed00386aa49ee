"""TLS on every gRPC link, mutual TLS between the gateway and the model services, and API keys
on the gateway, with certificates from scripts/dev_ca.sh.

The stack: target and draft serve TLS and require client certificates signed by the dev CA
(target: --tls-cert/--tls-key/--tls-client-ca; draft: the same as DFLASH_TLS_* variables); the
gateway reaches them with --upstream-ca/--upstream-cert/--upstream-key,
serves TLS itself (gRPC and HTTPS) and takes API keys from DFLASH_API_KEYS and --api-key-file."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from support.draft_service import start_draft
from support.gateway_stack import GatewayProcess
from support.procs import free_port, start_target
from support.reliability import (
    BLOCK,
    TARGET_FLAGS,
    make_certs,
    report,
    request,
    tiny_hybrid,
    tls_health_status,
    wait_serving_tls,
)

from dflash.v1 import (
    common_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from services.common import callers

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
ENV_KEY = "env-key-0123456789abcdef"
FILE_KEY = "file-key-0123456789abcdef"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("security_tls")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Another dev CA: its client certificate is well-formed but not ours."""
    return make_certs(tmp_path_factory.mktemp("foreign_certs"))


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_dir):
    return tiny_hybrid(tmp_path_factory, smollm2_dir)


def server_flags(certs) -> tuple[str, ...]:
    return ("--tls-cert", certs.path("server.crt"), "--tls-key", certs.path("server.key"),
            "--tls-client-ca", certs.path("ca.crt"))


@pytest.fixture(scope="module")
def upstreams(model, logs, certs):
    target = start_target(model, logs, *TARGET_FLAGS, *server_flags(certs), wait=False)
    # the draft takes its TLS settings from DFLASH_* variables (services/common/flags.py)
    env = {"DFLASH_TLS_CERT": certs.path("server.crt"), "DFLASH_TLS_KEY": certs.path("server.key"),
           "DFLASH_TLS_CLIENT_CA": certs.path("ca.crt")}
    draft = start_draft(model, logs, "--drafter", "prompt-lookup", "--block-size", str(BLOCK),
                        wait=False, env=env)
    creds = certs.client_credentials()
    wait_serving_tls(target, creds)
    wait_serving_tls(draft, creds)
    yield target, draft
    target.stop()
    draft.stop()


def start_tls_gateway(upstreams, model, logs, certs, *extra: str, env: dict | None = None,
                      client_cert: bool = True) -> GatewayProcess:
    target, draft = upstreams
    port, http_port = free_port(), free_port()
    up = ["--upstream-ca", certs.path("ca.crt")]
    if client_cert:
        up += ["--upstream-cert", certs.path("client.crt"), "--upstream-key",
               certs.path("client.key")]
    args = ["--target", target.address, "--draft", draft.address, "--tokenizer", str(model),
            "--port", str(port), "--http-port", str(http_port), "--host", "127.0.0.1",
            "--backoff-max", "1", "--tls-cert", certs.path("server.crt"),
            "--tls-key", certs.path("server.key"), *up, *extra]
    gw = GatewayProcess(args, port, http_port, logs)
    gw.env.update(env or {})
    gw.http_url = f"https://127.0.0.1:{http_port}"
    return gw.start()


@pytest.fixture(scope="module")
def gateway(upstreams, model, logs, certs, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text(f"# one key per line\n{FILE_KEY}\n")
    gw = start_tls_gateway(upstreams, model, logs, certs, "--api-key-file", str(key_file),
                           env={"DFLASH_API_KEYS": ENV_KEY})
    wait_serving_tls(gw, grpc.ssl_channel_credentials(certs.read("ca.crt")))
    yield gw
    gw.stop()


def capabilities(address: str, stub_cls, creds: grpc.ChannelCredentials | None):
    """GetCapabilities over TLS (creds) or plaintext (None): the answer, or the RpcError."""
    ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with ch:
        try:
            return stub_cls(ch).GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=5)
        except grpc.RpcError as e:
            return e


@pytest.mark.parametrize("which", ["target", "draft"])
def test_model_services_refuse_clients_without_the_right_certificate(which, upstreams, certs,
                                                                     foreign):
    service = upstreams[0] if which == "target" else upstreams[1]
    stub = target_pb2_grpc.TargetStub if which == "target" else draft_pb2_grpc.DraftStub
    refused = {
        "plaintext": None,
        "no client certificate": certs.client_credentials(cert=False),
        "server not trusted (other CA)": grpc.ssl_channel_credentials(
            foreign.read("ca.crt"), certs.read("client.key"), certs.read("client.crt")),
        "client certificate of another CA": grpc.ssl_channel_credentials(
            certs.read("ca.crt"), foreign.read("client.key"), foreign.read("client.crt")),
    }
    for what, creds in refused.items():
        answer = capabilities(service.address, stub, creds)
        assert isinstance(answer, grpc.RpcError), f"{which} accepted a client with {what}"
        assert answer.code() == grpc.StatusCode.UNAVAILABLE, (what, answer)
    ok = capabilities(service.address, stub, certs.client_credentials())
    assert not isinstance(ok, grpc.RpcError) and ok.protocol_version == 1
    report(f"mtls_{which}", clients_refused=len(refused), refused_kinds=len(refused),
           accepted_with_ca_and_cert=1)


def test_gateway_without_a_client_certificate_cannot_reach_the_services(upstreams, model, logs,
                                                                         certs):
    gw = start_tls_gateway(upstreams, model, logs, certs, client_cert=False)
    try:
        time.sleep(6)                     # the TLS handshakes fail: never SERVING
        r = httpx.get(f"{gw.http_url}/readiness", verify=certs.ssl_context(), timeout=5)
        assert r.status_code == 503 and "target" in r.json()["reason"], r.json()
        report("mtls_gateway_without_client_cert", ready_after_6s=False,
               reason=repr(r.json()["reason"][:80]))
    finally:
        gw.stop()


def test_gateway_serves_tls_only(gateway, certs):
    assert tls_health_status(gateway.address, "dflash.v1.Gateway", None) is None   # plaintext
    creds = grpc.ssl_channel_credentials(certs.read("ca.crt"))
    assert tls_health_status(gateway.address, "dflash.v1.Gateway", creds) == SERVING
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{gateway.http_port}/health", timeout=5)


def test_api_keys_are_enforced_on_grpc(gateway, certs):
    creds = grpc.ssl_channel_credentials(certs.read("ca.crt"))
    with grpc.secure_channel(gateway.address, creds) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        refused = 0
        for metadata in ((), (("authorization", "Bearer wrong-key-0123456789abcdef"),),
                         (("authorization", f"Basic {ENV_KEY}"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request("hi", 4), timeout=10, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            refused += 2
        for key in (ENV_KEY, FILE_KEY):
            out = list(stub.Generate(request("The cat sat", 6), timeout=30,
                                     metadata=(("authorization", f"Bearer {key}"),)))
            assert sum(len(m.token_ids) for m in out) == 6 and out[-1].finish_reason == "length"
    report("api_keys_grpc", refused=refused, accepted=2)


def test_api_keys_are_enforced_on_https(gateway, certs):
    with httpx.Client(base_url=gateway.http_url, verify=certs.ssl_context(), timeout=30) as c:
        assert c.get("/health").status_code == 200              # open
        assert c.get("/readiness").status_code == 200           # open
        assert c.get("/metrics").status_code == 200             # open without --metrics-auth
        refused = 0
        for headers in ({}, {"Authorization": "Bearer not-a-key-0123456789"},
                        {"Authorization": ENV_KEY}):
            for r in (c.get("/v1/models", headers=headers),
                      c.post("/v1/completions", headers=headers,
                             json={"model": "m", "prompt": "x"})):
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
                refused += 1
        good = {"Authorization": f"Bearer {FILE_KEY}"}
        model_id = c.get("/v1/models", headers=good).json()["data"][0]["id"]
        r = c.post("/v1/chat/completions", headers=good, json={
            "model": model_id, "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    report("api_keys_https", refused=refused, accepted=2)


def _another_client_certificate(certs, out) -> tuple[bytes, bytes]:
    """(key, certificate) of a second client, signed by the same dev CA as the gateway's."""
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True, cwd=out)
    run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "c2.key")
    run("openssl", "req", "-new", "-key", "c2.key", "-subj", "/CN=another-client", "-out", "c2.csr")
    (out / "c2.ext").write_text("basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    run("openssl", "x509", "-req", "-in", "c2.csr", "-CA", certs.path("ca.crt"), "-CAkey",
        certs.path("ca.key"), "-CAcreateserial", "-CAserial", str(out / "ca.srl"), "-days", "2",
        "-extfile", "c2.ext", "-out", "c2.crt")
    return (out / "c2.key").read_bytes(), (out / "c2.crt").read_bytes()


def test_a_sequence_belongs_to_the_client_certificate_that_created_it(upstreams, certs,
                                                                     tmp_path):
    """Issue 39, hole 4, with mutual TLS: the owner of a sequence is its client certificate and
    its caller key together (services/common/callers.py). Another client the CA also trusts,
    sending the very same caller key, gets NOT_FOUND for it and frees nothing."""
    target, _ = upstreams
    key = ((callers.HEADER, callers.new_key()),)
    c2_key, c2_cert = _another_client_certificate(certs, tmp_path)
    other = grpc.ssl_channel_credentials(certs.read("ca.crt"), c2_key, c2_cert)
    with grpc.secure_channel(target.address, certs.client_credentials()) as mine, \
            grpc.secure_channel(target.address, other) as theirs:
        owner, intruder = target_pb2_grpc.TargetStub(mine), target_pb2_grpc.TargetStub(theirs)
        first = owner.Prefill(target_pb2.PrefillRequest(sequence_id="mtls", token_ids=[5, 6, 7, 8]),
                              metadata=key, timeout=60).next_token
        with pytest.raises(grpc.RpcError) as e:
            intruder.Verify(target_pb2.VerifyRequest(sequence_id="mtls", token_ids=[first]),
                            metadata=key, timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
        release = common_pb2.ReleaseRequest(sequence_id="mtls")
        assert not intruder.Release(release, metadata=key, timeout=30).released
        assert owner.Verify(target_pb2.VerifyRequest(sequence_id="mtls", token_ids=[first]),
                            metadata=key, timeout=30).seq_len == 5
        assert owner.Release(release, metadata=key, timeout=30).released


def test_the_health_probe_speaks_mutual_tls(upstreams, certs):
    """services.common.health_probe with --ca/--cert/--key: the probe Kubernetes runs (an exec
    probe: its own gRPC probes speak plaintext only) against a target that requires client
    certificates - SERVING with ours, refused without a client certificate or without TLS."""
    target, _ = upstreams

    def probe(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.common.health_probe",
                               target.address, "dflash.v1.Target", "--timeout", "5", *extra],
                              capture_output=True, text=True, timeout=60, check=False)
    ca, cert, key = certs.path("ca.crt"), certs.path("client.crt"), certs.path("client.key")
    ok = probe("--ca", ca, "--cert", cert, "--key", key)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok
    for refused in (probe("--ca", ca), probe()):
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused
    assert probe("--cert", cert, "--key", key).returncode == 2          # no --ca
