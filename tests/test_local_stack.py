"""`dflash up` and `dflash demo`: the local stack as child processes, endpoints printed, a chat
through the openai client, and nothing left running after SIGTERM - or after the launcher is
killed outright."""
from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from openai import OpenAI
from support.gateway_stack import wait_until
from support.procs import REPO, free_port, stop_launcher

from dflash.stack import Child
from dflash.supervisor import RestartPolicy, Supervisor
from dflash.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow


def _processes(marker: str) -> dict[int, str]:
    """pid -> command line, of the processes whose command line contains marker (a port only
    this test uses)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd:
                found[int(entry.name)] = cmd
    return found


def processes_with(marker: str) -> list[int]:
    return list(_processes(marker))


def processes_cmdlines(marker: str) -> list[str]:
    return list(_processes(marker).values())


def listen_addresses(port: int) -> set[str]:
    """The addresses a TCP port listens on (/proc/net/tcp and tcp6, state 0A = LISTEN; an
    IPv4-mapped IPv6 address - how gRPC binds 127.0.0.1 - as its IPv4 address)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
            ip = ipaddress.ip_address(raw)
            found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def launch(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, int], Path]:
    ports = {k: free_port() for k in ("http", "port", "target", "draft")}
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "up", "--http-port", str(ports["http"]),
         "--port", str(ports["port"]), "--target-port", str(ports["target"]),
         "--draft-port", str(ports["draft"]), "--log-dir", str(tmp_path / "logs"), *extra],
        cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, ports, log


def wait_up(proc: subprocess.Popen, log: Path) -> str:
    def up():
        assert proc.poll() is None, log.read_text()
        return "dflash stack is up" in log.read_text()
    wait_until(up, timeout=240, interval=0.5, what="dflash up")
    return log.read_text()


def test_up_serves_and_stops_cleanly_on_sigterm(tmp_path):
    metrics_ports = [free_port(), free_port()]
    proc, ports, log = launch(tmp_path, "--target-metrics-port", str(metrics_ports[0]),
                              "--draft-metrics-port", str(metrics_ports[1]))
    marker = f"--port {ports['target']}"
    try:
        out = wait_up(proc, log)
        assert f"http://127.0.0.1:{ports['http']}/v1" in out and f"127.0.0.1:{ports['port']}" in out
        assert len(processes_with(marker)) == 1            # the target child
        client = OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key="x",
                        max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                           messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8)
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        # issue 39: the services' metrics listen on this host only; the logs are the user's
        for port in [ports["target"], ports["draft"], *metrics_ports]:
            assert listen_addresses(port) == {"127.0.0.1"}, port
        # the services' ports need the stack's internal token: a direct Prefill is refused
        with grpc.insecure_channel(f"127.0.0.1:{ports['target']}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                target_pb2_grpc.TargetStub(channel).Prefill(target_pb2.PrefillRequest(
                    sequence_id="probe", token_ids=[1, 2, 3]), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "internal" not in " ".join(processes_cmdlines(marker))   # not on a command line
        logs = tmp_path / "logs"
        assert logs.stat().st_mode & 0o777 == 0o700
        assert {f.stat().st_mode & 0o777 for f in logs.glob("*.log")} == {0o600}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for port in ports.values():
            assert processes_with(f"--port {port}") == [] and processes_with(f"-port {port} ") == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_killed_launcher_leaves_no_orphans(tmp_path):
    proc, ports, log = launch(tmp_path, "--drafter", "none")
    try:
        wait_up(proc, log)
        assert processes_with(f"--port {ports['target']}")
        proc.kill()                                          # no chance to clean up itself
        proc.wait(10)
        wait_until(lambda: not processes_with(f"--port {ports['target']}")
                   and not processes_with(f"--http-port {ports['http']}"),
                   timeout=30, what="children gone after the launcher died")
    finally:
        for pid in processes_with(f"--port {ports['target']}"):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_service_is_started_again_and_the_stream_finishes_identical(tmp_path):
    """Issue 39, hole 7: under dflash up (prompt lookup), the target is killed -9 in the middle
    of a greedy stream; the launcher starts it again on its port, the gateway prefills the
    committed tokens again, and the stream ends with the tokens of an undisturbed run. The
    admission flags reach the gateway."""
    proc, ports, log = launch(tmp_path, "--drafter", "prompt-lookup", "--max-running", "3",
                              "--max-waiting", "5")
    marker = f"--port {ports['target']}"
    try:
        wait_up(proc, log)
        gateway_cmd = " ".join(processes_cmdlines(f"--http-port {ports['http']}"))
        assert "--max-running 3" in gateway_cmd and "--max-waiting 5" in gateway_cmd
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['port']}")
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(text="Count from one to fifty in words:", max_tokens=96,
                                          ignore_eos=True,
                                          sampling=common_pb2.SamplingParams(temperature=0))
        undisturbed = [t for m in stub.Generate(req, timeout=300) for t in m.token_ids]
        tokens: list[int] = []
        for i, msg in enumerate(stub.Generate(req, timeout=300)):
            tokens += msg.token_ids
            if i == 3:
                (pid,) = processes_with(marker)
                os.killpg(pid, signal.SIGKILL)
        assert tokens == undisturbed
        out = log.read_text()
        assert "target exited with -9; starting it again in 1.0 s" in out
        assert "target started again (restart 1)" in out
        assert proc.poll() is None                           # the launcher serves on
        channel.close()
    finally:
        stop_launcher(proc)


def test_the_supervisor_backs_off_and_gives_up(tmp_path):
    """Real children that exit at once: restarted after 0.1, 0.2, 0.4 s (doubling), each run's
    log appended; after the limit the supervisor says why it stops; exit 2 (refused) stops at
    once."""
    said: list[str] = []
    policy = RestartPolicy(initial_s=0.1, max_s=1.0, limit=3, window_s=60)
    crash = Child("crash", [sys.executable, "-c", "print('run'); raise SystemExit(1)"],
                  tmp_path / "crash.log")
    crash.start()
    sup = Supervisor([crash], policy, said.append)
    t0, fatal = time.monotonic(), None
    while fatal is None and time.monotonic() - t0 < 30:
        fatal = sup.check()
        time.sleep(0.01)
    assert fatal is not None and "3 restarts within 60 s" in fatal
    starts = [line for line in said if "starting it again" in line]
    assert [re.search(r"in ([\d.]+) s", line).group(1) for line in starts] == ["0.1", "0.2", "0.4"]
    assert crash.log_path.read_text().count("run") == 4       # the first run and 3 restarts
    refused = Child("refused", [sys.executable, "-c", "raise SystemExit(2)"],
                    tmp_path / "refused.log")
    refused.start()
    refused.proc.wait(30)
    assert "refused to start (exit 2)" in Supervisor([refused], policy, said.append).check()


def test_demo_prints_answer_speed_and_acceptance(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "demo", "--max-tokens", "48",
                           "--log-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "assistant>" in done.stdout and "tokens/s" in done.stdout
    assert "mean acceptance length" in done.stdout
    http_port = re.search(r"OpenAI API +http://127.0.0.1:(\d+)/v1", done.stdout).group(1)
    time.sleep(0.5)
    assert not processes_with(f"--http-port {http_port}")   # its children are gone too


def test_target_graphs_capture_the_drafter_layers(tmp_path):
    """With a DFlash drafter the target's CUDA graphs are captured with the drafter's target
    layers (a verify that asks for features would otherwise run eagerly); device, backend and
    extra flags reach the children."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import SHIPPED_DRAFTER, Stack, StackOptions
    from runtime.models.dflash import DFlashConfig
    model = prepare_smollm2(["float32"], progress=False)["float32"]
    taps = DFlashConfig.from_dir(SHIPPED_DRAFTER).target_layer_ids
    stack = Stack(StackOptions(model_dir=str(model), log_dir=str(tmp_path), device="cuda",
                               attention_backend="triton", draft_args=("--kv-budget", "1GiB")))
    argv = {c.name: c.argv for c in stack.plan()}
    target = argv["target"]
    assert target[target.index("--graph-capture-layers") + 1] == ",".join(map(str, taps))
    for name in ("target", "draft"):
        assert argv[name][argv[name].index("--device") + 1] == "cuda"
        assert argv[name][argv[name].index("--attention-backend") + 1] == "triton"
    assert argv["draft"][-2:] == ["--kv-budget", "1GiB"]
    assert "--deterministic" not in argv["target"]
    none = Stack(StackOptions(model_dir=str(model), log_dir=str(tmp_path), drafter="none"))
    assert "--graph-capture-layers" not in {a for c in none.plan() for a in c.argv}
    det = Stack(StackOptions(model_dir=str(model), log_dir=str(tmp_path), device="cuda",
                             deterministic=True))          # dflash up --deterministic
    argv = {c.name: c.argv for c in det.plan()}
    assert "--deterministic" in argv["target"] and "--deterministic" in argv["draft"]
    assert "--deterministic" not in argv["gateway"]


def gateway_flag(tmp_path, flag: str, **options) -> str:
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])
    stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), **options))
    argv = {c.name: c.argv for c in stack.plan()}["gateway"]
    return str(argv[argv.index(flag) + 1])


def test_speculation_is_auto_by_default_with_no_fixed_sizes(tmp_path):
    """`dflash up` leaves the sizes to the gateway's --speculation auto (block 0, no tree, no
    batch limit); fixed (or a number) brings back the device defaults below."""
    assert gateway_flag(tmp_path, "--speculation") == "auto"
    for flag in ("--block-size", "--spec-disable-batch-size", "--spec-tree-nodes"):
        assert gateway_flag(tmp_path, flag) == "0"
        assert gateway_flag(tmp_path, flag, device="cuda", attention_backend="triton") == "0"
    assert gateway_flag(tmp_path, "--speculation", speculation="fixed") == "fixed"
    assert gateway_flag(tmp_path, "--block-size", speculation="fixed") == "4"


def test_verify_block_defaults_to_the_cpu_block_for_dflash_on_the_cpu(tmp_path):
    """--speculation fixed, --block-size 0: a DFlash stack on the CPU verifies CPU_DFLASH_BLOCK
    tokens, on a GPU the drafter's trained block (gateway 0); an explicit --block-size always
    wins."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import CPU_DFLASH_BLOCK, Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])

    def gateway_block(**options) -> int:
        stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), speculation="fixed",
                                   **options))
        argv = {c.name: c.argv for c in stack.plan()}["gateway"]
        return int(argv[argv.index("--block-size") + 1])

    assert gateway_block() == CPU_DFLASH_BLOCK == 4
    assert gateway_block(block_size=16) == 16
    assert gateway_block(device="cuda", attention_backend="triton") == 0
    assert gateway_block(drafter="prompt-lookup") == 0
    assert gateway_block(drafter="none") == 0


def test_drafting_stops_above_a_batch_size_by_default_on_the_cpu(tmp_path):
    """--speculation fixed, --spec-disable-batch-size -1: CPU_SPEC_DISABLE_BATCH for dflash on
    the CPU, else 0 (always draft); an explicit value always wins."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import CPU_SPEC_DISABLE_BATCH, Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])

    def limit(**options) -> int:
        stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), speculation="fixed",
                                   **options))
        argv = {c.name: c.argv for c in stack.plan()}["gateway"]
        return int(argv[argv.index("--spec-disable-batch-size") + 1])

    assert limit() == CPU_SPEC_DISABLE_BATCH > 0
    assert limit(spec_disable_batch_size=0) == 0
    assert limit(spec_disable_batch_size=8) == 8
    assert limit(device="cuda", attention_backend="triton") == 0
    assert limit(drafter="none") == 0


def test_trees_by_default_for_dflash_on_a_gpu(tmp_path):
    """--speculation fixed, --spec-tree-nodes -1: GPU_DFLASH_TREE_NODES for dflash on CUDA
    (measured to pay at 1, 8 and 32 requests in flight), else 0 (chains); an explicit value
    always wins."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import GPU_DFLASH_TREE_NODES, Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])

    def nodes(**options) -> int:
        stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), speculation="fixed",
                                   **options))
        argv = {c.name: c.argv for c in stack.plan()}["gateway"]
        return int(argv[argv.index("--spec-tree-nodes") + 1])

    gpu = {"device": "cuda", "attention_backend": "triton"}
    assert nodes() == 0
    assert nodes(**gpu) == GPU_DFLASH_TREE_NODES == 15
    assert nodes(spec_tree_nodes=0, **gpu) == 0
    assert nodes(spec_tree_nodes=63) == 63
    assert nodes(drafter="prompt-lookup", **gpu) == 0


def test_draft_dtype_defaults_to_auto_for_dflash_on_the_cpu(tmp_path):
    """--draft-dtype "": CPU_DFLASH_DRAFT_DTYPE for dflash on the CPU, else the target's --dtype;
    an explicit value always wins. The target keeps --dtype."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import CPU_DFLASH_DRAFT_DTYPE, Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])

    def dtypes(**options) -> tuple[str, str]:
        stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), **options))
        argv = {c.name: c.argv for c in stack.plan()}
        return tuple(argv[n][argv[n].index("--dtype") + 1] for n in ("target", "draft"))

    assert dtypes() == ("float32", CPU_DFLASH_DRAFT_DTYPE) == ("float32", "auto")
    assert dtypes(draft_dtype="float32") == ("float32", "float32")
    assert dtypes(dtype="bfloat16", device="cuda", attention_backend="triton") == \
        ("bfloat16", "bfloat16")
    assert dtypes(drafter="prompt-lookup") == ("float32", "float32")


def test_the_services_get_call_sockets_with_the_socket_wire(tmp_path):
    """dflash up --wire socket gives the target and the draft a call socket each (short paths
    under /tmp, removed at stop); none with the default wire, unary or stream, and none to a
    service given TLS flags (they do not combine)."""
    from dflash.prepare.smollm2 import prepare_smollm2
    from dflash.stack import Stack, StackOptions
    model = str(prepare_smollm2(["float32"], progress=False)["float32"])

    def sockets(**options) -> dict[str, str]:
        stack = Stack(StackOptions(model_dir=model, log_dir=str(tmp_path), **options))
        argv = {c.name: c.argv for c in stack.plan()}
        stack.stop()
        return {name: a[a.index("--call-socket") + 1] for name, a in argv.items()
                if "--call-socket" in a}

    paths = sockets(wire="socket")
    assert sorted(paths) == ["draft", "target"]
    assert all(len(p) < 108 and p.startswith("/tmp/") for p in paths.values())
    assert sockets() == sockets(wire="stream") == sockets(wire="unary") == {}
    assert sorted(sockets(wire="socket", target_args=("--tls-cert", "c.pem", "--tls-key",
                                                      "k.pem"))) == ["draft"]
