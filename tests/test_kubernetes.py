"""deploy/kubernetes, checked without a cluster, kubectl or kustomize (docs/kubernetes.md).

Each deployable directory (base, overlays/cpu, overlays/gpu) is built here the way kustomize
builds it, for the few kustomization features these files use: `resources` (files and other
kustomization directories) and `patches` with a strategic-merge patch file (`strategic_merge`,
the list merge keys of the Kubernetes API for the lists a patch may touch). Any other
kustomization field fails the test, so a feature this builder does not model cannot slip in
unchecked. Where kustomize or kubectl is installed, `test_kustomize_cli_agrees` checks that
they build exactly the same objects.

Every object of every build must validate against the Kubernetes OpenAPI schemas
(`kubernetes_validate`, strict: no unknown fields) of the oldest version the docs support and of
the newest the package ships. Then what the schemas cannot know: every container runs an entry
point of this repo whose flags parse with the service's own parser (tests/entrypoints.py) and
whose SPECMESH_* variables name real flags; probes and Services reach ports the service listens
on; the drain budget covers --grace-seconds; the gateway's dns:/// targets name the headless
Services of the drafters and verifiers on their listening ports; the HPA scales the drafters;
security settings, resources and the model cache; TLS on every server from the Secret
specmesh-tls (mutual to the replicas, the gateway's client certificate, probes that speak TLS); the
GPU overlay's verifier.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from tests.entrypoints import allowed_env, parse_command

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
STACKS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
OLDEST_VERSION = "1.30.0"  # docs/kubernetes.md: "Kubernetes 1.30 or later"
VERSIONS = (OLDEST_VERSION, kubernetes_validate.latest_version())
WORKLOADS = {"Deployment", "StatefulSet", "Job"}
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches"}
# x-kubernetes-patch-merge-key of the lists a strategic-merge patch merges item by item; every other
# list (args, command, tolerations, …) is replaced whole, as the API server and kustomize do
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
MODEL_CACHE = "/models"
TLS_SECRET = "specmesh-tls"  # docs/kubernetes.md: made with `specmesh certs`
MIN_STARTUP_SECONDS = 300  # loading a model (and measuring its forward cost) on a slow node


def _uid_of_image_user() -> int:
    match = re.search(r"useradd .*--uid (\d+)", (ROOT / "docker" / "Dockerfile").read_text())
    assert match, "docker/Dockerfile: no `useradd --uid`"
    return int(match.group(1))


# ---- building the directories ------------------------------------------------------------------


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def strategic_merge(base: Any, patch: Any) -> Any:
    """`patch` applied to `base` as a strategic-merge patch: maps merged key by key (null deletes),
    the MERGE_KEYS lists item by item, anything else replaced."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        assert not key.startswith("$"), f"patch directive {key} is not modelled here"
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(out.get(key), list):
            # the patch's items first, in its order (merged into the base's item of the same key),
            # then the base's other items (the order the API server and kustomize give)
            merge_key = MERGE_KEYS[key]
            old = {item[merge_key]: item for item in out[key]}
            patched = [strategic_merge(old.get(item[merge_key], {}), item) for item in value]
            keys = {item[merge_key] for item in value}
            out[key] = patched + [item for item in out[key] if item[merge_key] not in keys]
        elif key in out:
            out[key] = strategic_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def test_strategic_merge_follows_kubernetes():
    """The builder's merge on a case whose result `kubectl kustomize` (kustomize v5.5) gave."""

    def env(*pairs: tuple[str, str]) -> list[dict]:
        return [{"name": name, "value": value} for name, value in pairs]

    base = {
        "containers": [
            {"name": "one", "image": "i", "env": env(("A", "1"), ("B", "2"), ("C", "3"))},
            {"name": "two", "image": "i", "args": ["--a", "1"]},
        ],
        "tolerations": [{"key": "a", "operator": "Exists"}],
    }
    patch = {
        "containers": [
            {"name": "two", "image": "j", "args": ["--b"]},
            {"name": "three", "image": "k"},
            {"name": "one", "env": env(("Z", "9"), ("B", "x"))},
        ],
        "tolerations": [{"key": "b", "operator": "Exists"}],
    }
    assert strategic_merge(base, patch) == {
        "containers": [
            {"name": "two", "image": "j", "args": ["--b"]},
            {"name": "three", "image": "k"},
            {"name": "one", "image": "i", "env": env(("Z", "9"), ("B", "x"), ("A", "1"), ("C", "3"))},
        ],
        "tolerations": [{"key": "b", "operator": "Exists"}],
    }


def build(directory: Path) -> list[dict]:
    """The objects `kustomize build directory` gives, for the fields KUSTOMIZATION_FIELDS."""
    (kustomization,) = _load(directory / "kustomization.yaml")
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields not modelled by this test: {unknown}"
    assert kustomization["kind"] == "Kustomization"
    objects: list[dict] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml: no {entry}"
        objects += build(path) if path.is_dir() else _load(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only `patches: - path: FILE` is modelled"
        for doc in _load(directory / patch["path"]):
            matches = [i for i, o in enumerate(objects) if _key(o) == _key(doc)]
            assert len(matches) == 1, f"{directory}/{patch['path']}: targets {_key(doc)}, not one object"
            objects[matches[0]] = strategic_merge(objects[matches[0]], doc)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request) -> tuple[str, list[dict]]:
    return request.param, build(STACKS[request.param])


def _kustomizations() -> Iterator[tuple[Path, dict]]:
    for path in sorted(K8S.rglob("kustomization.yaml")):
        (doc,) = _load(path)
        yield path, doc


# ---- pods, containers and what they run --------------------------------------------------------


def _pod_template(obj: dict) -> dict:
    return obj["spec"]["template"]


def _containers(pod_spec: dict) -> list[dict]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def _ours(container: dict) -> bool:
    return container["image"].split(":")[0] == "specmesh"


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _parsed(where: str, container: dict) -> Any:
    """The config the container's command parses to (tests/entrypoints.py)."""
    assert "command" in container, f"{where}: no command (the image's CMD is `specmesh --help`)"
    return parse_command(where, [*container["command"], *container.get("args", [])], _env(container))


def _our_containers(objects: list[dict]) -> Iterator[tuple[str, dict, dict, Any]]:
    """(where, workload, container, parsed config) for every specmesh container."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            for container in _containers(_pod_template(obj)["spec"]):
                if _ours(container):
                    where = f"{obj['kind']}/{obj['metadata']['name']} container {container['name']}"
                    yield where, obj, container, _parsed(where, container)


def _runs(container: dict, module: str) -> bool:
    return container.get("command", [])[:3] == ["python", "-m", module]


def _workload_running(objects: list[dict], module: str) -> dict:
    found = [o for o in objects if o["kind"] in WORKLOADS and any(_runs(c, module) for c in _main(o))]
    assert len(found) == 1, f"{len(found)} workloads run {module}"
    return found[0]


def _main(obj: dict) -> list[dict]:
    return _pod_template(obj)["spec"]["containers"]


def _container_running(obj: dict, module: str) -> dict:
    (container,) = [c for c in _main(obj) if _runs(c, module)]
    return container


def _container_port(container: dict, port: int | str) -> int | None:
    """The containerPort a probe or Service port (number or name) refers to, if declared."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def _probe_port(probe: dict) -> int | str | None:
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return probe[kind]["port"]
    return None


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _selected(objects: list[dict], selector: dict) -> dict:
    """The one workload whose pods carry every label of `selector`."""
    found = [
        o
        for o in objects
        if o["kind"] in WORKLOADS
        and selector.items() <= _pod_template(o)["metadata"].get("labels", {}).items()
    ]
    assert len(found) == 1, f"selector {selector} selects {[_key(o) for o in found]}, not one workload"
    return found[0]


# ---- the files -----------------------------------------------------------------------------------


def test_every_file_is_deployed():
    """No YAML file under deploy/kubernetes escapes the checks: each is a kustomization or listed
    by one (as a resource or a patch)."""
    used = set()
    for path, doc in _kustomizations():
        used.add(path)
        for entry in [*doc.get("resources", []), *(p["path"] for p in doc.get("patches", []))]:
            used.add((path.parent / entry).resolve())
    files = {p.resolve() for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml")}
    assert files, "no manifests"
    assert files <= used, f"not in any kustomization: {sorted(str(p) for p in files - used)}"


def test_everything_goes_into_the_namespace_it_creates():
    (kustomization,) = _load(STACKS["base"] / "kustomization.yaml")
    (namespace,) = _by_kind(build(STACKS["base"]), "Namespace")
    assert namespace["metadata"]["name"] == kustomization["namespace"]
    for path, doc in _kustomizations():  # an overlay setting another one would split the stack
        assert path.parent == STACKS["base"] or "namespace" not in doc, path


@pytest.mark.parametrize("version", VERSIONS)
def test_objects_validate_against_the_kubernetes_schemas(stack, version):
    name, objects = stack
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {_key(obj)} is not valid Kubernetes {version}:\n{str(exc)[:3000]}")


def test_objects_are_unique(stack):
    name, objects = stack
    keys = [_key(o) for o in objects]
    assert len(keys) == len(set(keys)), f"{name}: duplicates in {keys}"


# ---- what runs ---------------------------------------------------------------------------------


def test_containers_run_entry_points_with_real_flags_and_env(stack):
    name, objects = stack
    seen = set()
    for where, _, container, parsed in _our_containers(objects):
        names = {e["name"] for e in container.get("env", []) if e["name"].startswith("SPECMESH_")}
        assert names <= allowed_env(parsed), f"{name}: {where}: unknown {names - allowed_env(parsed)}"
        seen.add(tuple(container["command"]))
    for module in ("drafter_service", "verifier_service", "gateway"):
        assert ("python", "-m", module) in seen, f"{name}: nothing runs {module}"
    for obj in objects:  # the only other image: Redis
        if obj["kind"] in WORKLOADS:
            for container in _containers(_pod_template(obj)["spec"]):
                if not _ours(container):
                    assert container["image"].startswith("redis:")
                    assert container["command"][0] == "redis-server"


def test_services_listen_on_all_interfaces_on_their_declared_ports(stack):
    name, objects = stack
    for where, _, container, config in _our_containers(objects):
        if not hasattr(config, "port"):
            continue  # `specmesh models pull`
        assert config.host == "0.0.0.0", f"{name}: {where}: --host {config.host} is unreachable"
        assert _container_port(container, "grpc") == config.port, f"{name}: {where}: gRPC port"


def test_probes_reach_declared_ports(stack):
    """Every probe's port is a declared containerPort; the services' gRPC probes ask the port the
    service listens on (grpc.health.v1); the model services may take minutes to start."""
    name, objects = stack
    for obj in objects:
        if obj["kind"] not in WORKLOADS:
            continue
        for container in _main(obj):
            where = f"{name}: {_key(obj)} {container['name']}"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = _probe_port(container.get(kind, {}))
                if port is not None:  # not an exec probe
                    assert _container_port(container, port) is not None, f"{where}: {kind} port {port}"
    for where, obj, container, config in _our_containers(objects):
        if obj["kind"] == "Job" or container not in _main(obj):
            continue
        where = f"{name}: {where}"
        assert _health_probe_port(where, container["readinessProbe"], config) == config.port, where
        assert "livenessProbe" in container, where
        if not _runs(container, "gateway"):  # the gateway listens at once (NOT_SERVING till ready)
            startup = container["startupProbe"]
            assert _health_probe_port(where, startup, config) == config.port, where
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= MIN_STARTUP_SECONDS, f"{where}: {budget} s to load the model"
            assert _health_probe_port(where, container["livenessProbe"], config) == config.port, where


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else ""


def _health_probe_port(where: str, probe: dict, config: Any) -> int:
    """The port a probe asks grpc.health.v1 on: kubelet's own gRPC probe on a plaintext server,
    else (kubelet's cannot speak TLS) `python -m specmesh.rpc.health 127.0.0.1:PORT` in the pod,
    with the CA, and for mutual TLS a client certificate."""
    tls = config.server_tls()
    if "grpc" in probe:
        assert tls is None, f"{where}: kubelet's gRPC probe cannot reach a TLS server"
        return probe["grpc"]["port"]
    argv = probe["exec"]["command"]
    assert argv[:3] == ["python", "-m", "specmesh.rpc.health"], f"{where}: {argv}"
    parse_command(where, argv)  # its flags exist
    host, _, port = argv[3].rpartition(":")
    assert host == "127.0.0.1", f"{where}: {argv[3]}"
    if tls is not None:
        assert _flag(argv, "--ca"), f"{where}: a TLS server, probed without --ca"
        if tls.client_ca:
            assert _flag(argv, "--cert") and _flag(argv, "--key"), f"{where}: mutual TLS needs --cert/--key"
    return int(port)


def _secret_files(obj: dict, container: dict, secret: str) -> dict[str, str]:
    """Path in the container -> key of `secret`, for every item of it the container mounts."""
    volumes = {v["name"]: v for v in _pod_template(obj)["spec"]["volumes"]}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]].get("secret", {})
        if volume.get("secretName") == secret:
            assert mount.get("readOnly") is True, mount
            files.update({f"{mount['mountPath']}/{i['path']}": i["key"] for i in volume["items"]})
    return files


def test_every_server_speaks_tls_with_files_of_the_tls_secret(stack):
    """Every server listens with TLS only; the replicas require client certificates (mutual TLS)
    and the gateway shows one to them; every file these flags and the probes name is an item of the
    Secret specmesh-tls mounted read-only in the pod, named as `specmesh certs` names its files."""
    from specmesh.stack.certs import cert_files

    name, objects = stack
    written = {p.name for p in cert_files(".").all()}
    servers = 0
    for where, obj, container, config in _our_containers(objects):
        if not hasattr(config, "port"):
            continue  # `specmesh models pull`
        servers += 1
        where = f"{name}: {where}"
        files = _secret_files(obj, container, TLS_SECRET)
        assert set(files.values()) <= written, f"{where}: {set(files.values()) - written}"
        tls = config.server_tls()
        assert tls is not None, f"{where}: plaintext"
        used = [tls.cert, tls.key]
        if _runs(container, "gateway"):
            replicas = config.replica_tls()
            assert replicas is not None and replicas.ca and replicas.cert, f"{where}: no client certificate"
            used += [replicas.ca, replicas.cert, replicas.key]
        else:
            assert tls.client_ca, f"{where}: accepts clients without a certificate"
            used.append(tls.client_ca)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            argv = container.get(kind, {}).get("exec", {}).get("command", [])
            used += [_flag(argv, f) for f in ("--ca", "--cert", "--key") if _flag(argv, f)]
        missing = [path for path in used if path not in files]
        assert not missing, f"{where}: not files of Secret {TLS_SECRET}: {missing}"
    assert servers == 3, f"{name}: {servers} servers"


def test_the_documented_certificates_name_the_replicas_services(stack):
    """docs/kubernetes.md's `specmesh certs` command: the server certificate names every dns:///
    host the gateway dials (it checks each replica's certificate for that name, not the pod IP)."""
    from gateway.pools import parse_targets

    name, objects = stack
    config = _parsed(f"{name}: gateway", _container_running(_workload_running(objects, "gateway"), "gateway"))
    lines = (ROOT / "docs" / "kubernetes.md").read_text().splitlines()
    (command,) = [line.strip() for line in lines if line.strip().startswith("specmesh certs ")]
    certs = parse_command("docs/kubernetes.md", shlex.split(command))
    for target in parse_targets(f"{config.drafters},{config.verifiers}"):
        assert target.host in certs.host, f"{name}: the certificate would not name {target.host}"


def test_metrics_are_scraped_where_they_are_served(stack):
    name, objects = stack
    for where, obj, container, config in _our_containers(objects):
        if obj["kind"] == "Job" or container not in _main(obj):
            continue
        annotations = _pod_template(obj)["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", f"{name}: {where}"
        scheme = "https" if config.server_tls() else "http"  # /metrics is HTTPS on a TLS server
        assert annotations.get("prometheus.io/scheme", "http") == scheme, f"{name}: {where}"
        port = int(annotations["prometheus.io/port"])
        # the replicas' --metrics-port, the gateway's --http-port (which serves /metrics)
        served = config.http_port if _runs(container, "gateway") else config.metrics_port
        assert port == served, f"{name}: {where}: scrapes {port}, metrics on {served}"
        assert _container_port(container, port) == port, f"{name}: {where}: {port} not declared"


def test_termination_grace_covers_the_drain(stack):
    """SIGTERM: health NOT_SERVING, in-flight RPCs get --grace-seconds; Kubernetes kills the pod
    terminationGracePeriodSeconds after it began terminating (preStop included)."""
    name, objects = stack
    for where, obj, container, config in _our_containers(objects):
        if obj["kind"] == "Job" or container not in _main(obj):
            continue
        spec = _pod_template(obj)["spec"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        budget = spec.get("terminationGracePeriodSeconds", 30)
        needed = pre_stop + config.grace_seconds
        assert budget > needed, f"{name}: {where}: {budget} s to stop, needs {needed} s + exit"


# ---- how the pieces find each other ------------------------------------------------------------


def test_services_select_pods_and_their_ports(stack):
    name, objects = stack
    for service in _by_kind(objects, "Service"):
        where = f"{name}: Service/{service['metadata']['name']}"
        workload = _selected(objects, service["spec"]["selector"])
        containers = _main(workload)
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found = {_container_port(c, target) for c in containers} - {None}
            assert len(found) == 1, f"{where}: port {port['name']} -> {target}, not a containerPort"
            if service["spec"].get("clusterIP") == "None":  # DNS gives pod IPs: no port mapping
                assert port["port"] == found.pop(), f"{where}: headless, port != targetPort"
    for obj in _by_kind(objects, "StatefulSet"):
        (governing,) = [
            s for s in _by_kind(objects, "Service") if s["metadata"]["name"] == obj["spec"]["serviceName"]
        ]
        assert governing["spec"].get("clusterIP") == "None"


def _dns_service(objects: list[dict], host: str, namespace: str | None) -> dict:
    """The Service a DNS name inside the cluster resolves through (short or fully qualified)."""
    short, _, rest = host.partition(".")
    assert rest in ("", f"{namespace}.svc.cluster.local", f"{namespace}.svc"), f"{host}: other namespace"
    services = [s for s in _by_kind(objects, "Service") if s["metadata"]["name"] == short]
    assert len(services) == 1, f"{host}: no Service {short}"
    return services[0]


def test_gateway_finds_drafters_verifiers_and_redis(stack):
    """--drafters / --verifiers are dns:/// names of headless Services (every ready pod, re-resolved)
    on the port the selected pods listen on; --redis-url names the Redis Service."""
    from gateway.pools import parse_targets

    name, objects = stack
    gateway_obj = _workload_running(objects, "gateway")
    gateway = _container_running(gateway_obj, "gateway")
    config = _parsed(f"{name}: gateway", gateway)
    namespace = gateway_obj["metadata"].get("namespace")
    for flag, module in ((config.drafters, "drafter_service"), (config.verifiers, "verifier_service")):
        (target,) = parse_targets(flag)
        assert target.dns, f"{name}: {flag}: not dns:///, a scaled Deployment would not be found"
        service = _dns_service(objects, target.host, namespace)
        assert service["spec"].get("clusterIP") == "None", f"{name}: {flag}: not a headless Service"
        selected = _selected(objects, service["spec"]["selector"])
        assert selected is _workload_running(objects, module), f"{name}: {flag} selects {_key(selected)}"
        replica = _container_running(selected, module)
        listening = _parsed(f"{name}: {module}", replica).port
        assert target.port == listening, f"{name}: {flag}: the pods listen on {listening}"
    redis = urlparse(config.redis_url)
    service = _dns_service(objects, redis.hostname, namespace)
    selected = _selected(objects, service["spec"]["selector"])
    assert any(_container_port(c, redis.port) == redis.port for c in _main(selected)), config.redis_url


def test_the_hpa_scales_the_drafters_on_cpu(stack):
    name, objects = stack
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    drafter = _workload_running(objects, "drafter_service")
    target = (ref["apiVersion"], ref["kind"], ref["name"])
    assert target == ("apps/v1", *_key(drafter)), f"{name}: the HPA scales {target}"
    assert "replicas" not in drafter["spec"], f"{name}: the HPA owns the drafters' replica count"
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    for container in _containers(_pod_template(drafter)["spec"]):  # utilization is of the requests
        assert "cpu" in container["resources"]["requests"], f"{name}: {container['name']}"


# ---- pods: security, resources, the model cache ------------------------------------------------


def test_pods_run_as_non_root_with_read_only_root_filesystems(stack):
    name, objects = stack
    uid = _uid_of_image_user()
    for obj in objects:
        if obj["kind"] not in WORKLOADS:
            continue
        spec = _pod_template(obj)["spec"]
        where = f"{name}: {_key(obj)}"
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert context["seccompProfile"]["type"] == "RuntimeDefault", where
        if any(_ours(c) for c in _containers(spec)):
            assert context["runAsUser"] == uid and context["fsGroup"] == uid, f"{where}: uid {uid}"
        for container in _containers(spec):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{where} {container['name']}"
            assert sc["allowPrivilegeEscalation"] is False, f"{where} {container['name']}"
            assert sc["capabilities"]["drop"] == ["ALL"], f"{where} {container['name']}"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where} {bound}"


def test_model_cache_is_mounted_everywhere(stack):
    """One volume at /models (SPECMESH_CACHE) in every specmesh container, the Job provisions it,
    the model pods' init containers wait for it; HOME and /tmp are writable (an emptyDir)."""
    name, objects = stack
    (claim,) = _by_kind(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], f"{name}: pods on several nodes read it"
    (job,) = _by_kind(objects, "Job")
    (pull,) = _main(job)
    assert pull["command"][:3] == ["specmesh", "models", "pull"]
    for module in ("drafter_service", "verifier_service"):
        init = _pod_template(_workload_running(objects, module))["spec"]["initContainers"]
        assert any(c["command"][:3] == ["specmesh", "models", "pull"] for c in init), f"{name}: {module}"
    for where, obj, container, _ in _our_containers(objects):
        volumes = {v["name"]: v for v in _pod_template(obj)["spec"]["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        cache = mounts[MODEL_CACHE]["persistentVolumeClaim"]["claimName"]
        assert cache == claim["metadata"]["name"], f"{name}: {where}"
        assert _env(container)["SPECMESH_CACHE"] == MODEL_CACHE, f"{name}: {where}"
        assert _env(container)["HOME"] == "/tmp" and "emptyDir" in mounts["/tmp"], f"{name}: {where}"


# ---- CPU and GPU verifier ----------------------------------------------------------------------


def test_gpu_overlay_puts_only_the_verifier_on_a_gpu():
    base, gpu = build(STACKS["base"]), build(STACKS["gpu"])
    assert build(STACKS["cpu"]) == base
    verifiers = {}
    for stack_name, objects in (("base", base), ("gpu", gpu)):
        workload = _workload_running(objects, "verifier_service")
        container = _container_running(workload, "verifier_service")
        verifiers[stack_name] = workload, container, _parsed(f"{stack_name}: verifier", container)
    _, cpu_container, cpu_config = verifiers["base"]
    assert cpu_config.device == "cpu" and cpu_container["image"] == "specmesh:verifier-cpu"
    assert "nvidia.com/gpu" not in cpu_container["resources"]["limits"]
    workload, container, config = verifiers["gpu"]
    assert config.device == "cuda" and container["image"] == "specmesh:verifier-cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a surge would need a spare GPU"
    same = [o for o in gpu if o is not workload]
    assert same == [o for o in base if _key(o) != _key(workload)], "the overlay changes only the verifier"


def _secret_env(container: dict, name: str) -> tuple[str, str]:
    """(Secret, key) the container's variable `name` comes from (required, not optional)."""
    (entry,) = [e for e in container.get("env", []) if e["name"] == name]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional", False), f"{name}: an optional Secret would run Redis without a password"
    return ref["name"], ref["key"]


def test_redis_persists_requires_the_secrets_password_and_disables_config_debug_keys(stack):
    """AOF (everysec) on the volume; --requirepass from the Secret (through $(REDISCLI_AUTH),
    which the probes' redis-cli also reads); CONFIG / DEBUG / KEYS gone; the gateway's URL carries
    the same Secret's password (in its environment, not its arguments)."""
    name, objects = stack
    (redis,) = [
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "specmesh-redis"
    ]
    (container,) = _main(redis)
    command = [*container["command"], *container.get("args", [])]
    flags = {command[i]: command[i + 1] for i in range(1, len(command) - 1) if command[i].startswith("--")}
    assert (flags["--appendonly"], flags["--appendfsync"], flags["--dir"]) == ("yes", "everysec", "/data")
    assert any(m["mountPath"] == "/data" for m in container["volumeMounts"])
    assert flags["--requirepass"] == "$(REDISCLI_AUTH)"
    secret = _secret_env(container, "REDISCLI_AUTH")
    renamed = {command[i + 1]: command[i + 2] for i, arg in enumerate(command) if arg == "--rename-command"}
    assert renamed == {"CONFIG": "", "DEBUG": "", "KEYS": ""}, f"{name}: {renamed}"
    gateway = _container_running(_workload_running(objects, "gateway"), "gateway")
    assert "--redis-url" not in gateway.get("args", []) + gateway["command"]
    assert _secret_env(gateway, "REDIS_PASSWORD") == secret
    url = _env(gateway)["SPECMESH_REDIS_URL"]
    assert url == "redis://:$(REDIS_PASSWORD)@specmesh-redis:6379/0", url
    names = [e["name"] for e in gateway["env"]]  # Kubernetes expands $(VAR) only from earlier entries
    assert names.index("REDIS_PASSWORD") < names.index("SPECMESH_REDIS_URL")


# ---- a real kustomize, where one is installed --------------------------------------------------


def _kustomize_cli() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("stack_name", list(STACKS))
def test_kustomize_cli_agrees(stack_name):
    cli = _kustomize_cli()
    if cli is None:
        pytest.skip("neither kustomize nor kubectl here; built by this test's own builder above")
    result = subprocess.run(
        [*cli, str(STACKS[stack_name])], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(result.stdout) if o}
    ours = {_key(o): o for o in build(STACKS[stack_name])}
    assert set(theirs) == set(ours)
    for key, obj in ours.items():  # the objects checked above are exactly what kustomize builds
        assert theirs[key] == obj, f"{stack_name}: {key} differs from `{' '.join(cli)}`"


# The Dockerfile target (and image) of each role, as docker-compose.yml builds them; a pod's init
# containers run its main container's image. The model Job converts weights: the drafter's torch.
ROLE_IMAGES = {
    "gateway": "specmesh:gateway", "drafter_service": "specmesh:drafter",
    "verifier_service": "specmesh:verifier-cpu", "specmesh": "specmesh:drafter",
}  # fmt: skip


@pytest.mark.parametrize("stack_name", ["base", "gpu"])
def test_every_pod_runs_the_image_of_its_role(stack_name):
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "docker" / "Dockerfile").read_text(), re.M))
    seen = set()
    for obj in build(STACKS[stack_name]):
        if obj["kind"] not in WORKLOADS or not any(_ours(c) for c in _main(obj)):
            continue
        command = _main(obj)[0]["command"]
        role = command[2] if command[:2] == ["python", "-m"] else command[0]
        image = ROLE_IMAGES[role]
        if stack_name == "gpu" and role == "verifier_service":
            image = "specmesh:verifier-cuda"
        for container in _containers(_pod_template(obj)["spec"]):
            assert container["image"] == image, f"{obj['metadata']['name']}: {container['name']}"
        assert image.split(":")[1] in targets
        seen.add(role)
    assert seen == set(ROLE_IMAGES)
