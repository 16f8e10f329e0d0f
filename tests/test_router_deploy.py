"""deploy/ against the code it deploys: every flag the manifests pass is one `pagoda serve`/`route` accepts (with
values their configs accept), ports and probe paths match what the apps serve, the router lists exactly the
replicas KEDA may create, core kinds validate offline against the Kubernetes schemas, the KEDA ScaledObject
has the fields KEDA's documentation requires, and the Grafana dashboard asks only for metrics pagoda exports."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from pagoda.cli import build_parser
from pagoda.router.app import build_router_app
from pagoda.router.cli import event_endpoints, router_config_from
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.tokens import LoadOnlyReader
from pagoda.server.api import build_app
from pagoda.server.state import ServerState
from pagoda.wire.kv_events import KVEventsConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES_VERSION = "1.30.0"
CORE_KINDS = {"Service", "Deployment", "StatefulSet"}


def manifests() -> list[dict]:
    documents = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def workloads() -> list[dict]:
    return [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def containers_running(command: str) -> list[tuple[dict, dict]]:
    """(workload, container) for each container whose args start with `command`."""
    found = [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]
             if c["args"][0] == command]
    assert found, f"no container runs pagoda {command}"
    return found


def parse(args: list[str]):
    try:
        return build_parser().parse_args(args)
    except SystemExit as error:
        raise AssertionError(f"pagoda refuses {args}") from error


def app_paths(command: str) -> set[str]:
    if command == "serve":
        app = build_app(ServerState(model_name="m"))
    else:
        app = build_router_app(Router(["http://r"], RouterConfig()), LoadOnlyReader(), httpx.AsyncClient())
    return {route.path for route in app.routes}


def named_ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def the(kind: str, name: str | None = None) -> dict:
    found = [d for d in manifests() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "route"])
def test_every_flag_is_accepted_and_ports_and_probes_match_the_app(command):
    paths = app_paths(command)
    for _workload, container in containers_running(command):
        args = parse(container["args"])
        ports = named_ports(container)
        assert args.port == ports["http"] and args.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                check = container[probe]["httpGet"]
                assert check["path"] in paths, f"{probe} asks {check['path']}, which pagoda {command} does not serve"
                assert check["port"] in ports, f"{probe} names port {check['port']}"
        if command == "route":
            router_config_from(args)  # the values, too, are ones RouterConfig takes
            endpoints = event_endpoints(args.replica_kv_events)
            assert set(endpoints) <= set(args.replica)


def test_replicas_drain_within_their_grace_period_and_publish_events_on_their_port():
    for workload, container in containers_running("serve"):
        args = parse(container["args"])
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > args.shutdown_timeout, "Kubernetes must not kill a replica while it drains"
        events = KVEventsConfig.from_dict(args.kv_events_config)
        assert events.publishes
        assert int(events.endpoint.rsplit(":", 1)[1]) == named_ports(container)["kv-events"]


def test_the_router_lists_exactly_the_replicas_keda_may_create():
    statefulset = the("StatefulSet", "pagoda-replica")
    service = the("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "stable per-pod DNS names need a headless service"
    http_port = named_ports(statefulset["spec"]["template"]["spec"]["containers"][0])["http"]
    events_port = named_ports(statefulset["spec"]["template"]["spec"]["containers"][0])["kv-events"]
    maximum = the("ScaledObject")["spec"]["maxReplicaCount"]
    hosts = [f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(maximum)]
    (_, router), = containers_running("route")
    args = parse(router["args"])
    assert args.replica == [f"http://{host}:{http_port}" for host in hosts]
    assert event_endpoints(args.replica_kv_events) == {
        f"http://{host}:{http_port}": f"tcp://{host}:{events_port}" for host in hosts}


def test_services_select_the_pods_and_target_named_ports():
    for service in (d for d in manifests() if d["kind"] == "Service"):
        selected = [w for w in workloads()
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = named_ports(selected[0]["spec"]["template"]["spec"]["containers"][0])
        assert all(port["targetPort"] in ports for port in service["spec"]["ports"])


def test_core_kinds_validate_against_the_kubernetes_schemas():
    documents = [d for d in manifests() if d["kind"] in CORE_KINDS]
    assert {d["kind"] for d in documents} == CORE_KINDS
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(documents[0]))
    broken["spec"]["bogus_field"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_scaled_object_has_what_keda_requires_and_scales_on_the_waiting_queue():
    """KEDA's ScaledObject (keda.sh/v1alpha1): spec.scaleTargetRef.name and spec.triggers are required; a
    prometheus trigger needs metadata serverAddress, query and threshold."""
    scaled = the("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["metadata"]["name"]
    target = scaled["spec"]["scaleTargetRef"]
    workload = the(target["kind"], target["name"])
    assert target["apiVersion"] == workload["apiVersion"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert {"serverAddress", "query", "threshold"} <= set(metadata)
    assert all(isinstance(value, str) for value in metadata.values()), "KEDA's trigger metadata is strings"
    assert "vllm:num_requests_waiting" in metadata["query"] and float(metadata["threshold"]) > 0


def exported_metric_names() -> set[str]:
    """What a replica and the router export, as Prometheus families (with their sample suffixes)."""
    from pagoda.engine.api import EngineStats
    from pagoda.server.metrics import ServerMetrics

    texts = [ServerMetrics("m", EngineStats).render().decode(),
             Router(["http://r"], RouterConfig()).metrics.render().decode()]
    names = set()
    for text in texts:
        names |= set(re.findall(r"^# TYPE (\S+)", text, flags=re.MULTILINE))
        names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    return names


def test_the_dashboard_asks_only_for_metrics_pagoda_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda-dashboard.json").read_text())
    exported = exported_metric_names()
    exported.add("vllm:cache_config_info")  # exported by replicas once their engine is loaded
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"(vllm:[a-z_:]+|pagoda_router_[a-z_]+)", target["expr"])}
    assert asked and asked <= exported, sorted(asked - exported)


def test_the_image_exposes_the_ports_and_runs_pagoda():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    exposed = {int(p) for line in dockerfile.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    containers = [c for _, c in containers_running("serve") + containers_running("route")]
    ports = {port for container in containers for port in named_ports(container).values()}
    assert ports <= exposed
    assert re.search(r'^ENTRYPOINT \["pagoda"\]$', dockerfile, flags=re.MULTILINE)
    (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile, flags=re.MULTILINE)
    parse(json.loads(cmd))
    assert "/models/pagoda-demo" in dockerfile and all("/models/pagoda-demo" in shlex.join(c["args"])
                                                      for _, c in containers_running("serve"))


def test_the_replicas_share_the_kv_store_the_manifests_run():
    from pagoda.kv_transfer_config import KVTransferConfig

    store = the("Deployment", "pagoda-kv-store")
    service = the("Service", "pagoda-kv-store")
    (container,) = store["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--maxmemory-policy"] == "allkeys-lru", "a cache: full means evict, never refuse writes"
    assert flags["--save"] == "" and flags["--appendonly"] == "no"
    port = named_ports(container)["redis"]
    assert int(flags["--port"]) == port and service["spec"]["ports"][0]["port"] == port
    for _workload, replica in containers_running("serve"):
        options = KVTransferConfig.from_dict(parse(replica["args"]).kv_transfer_config).offload_options
        assert options is not None
        assert options.shared_store == f"redis://{service['metadata']['name']}:{port}/0"
        memory = replica["resources"]["limits"]["memory"]
        assert options.cpu_bytes_to_use < int(memory.removesuffix("Gi")) << 30
