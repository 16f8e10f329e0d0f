"""deploy/k8s-pd/, the prefill/decode layout, against the code it deploys: every flag is one `pagoda serve`/`route`
accepts (after Kubernetes puts the pod's address into the args), each pool's connector has the role its pool
needs, the producer's block server listens on the port its container and Service name, the router in
--pd-disaggregation lists exactly the pods of each StatefulSet (and their KV events), probes ask paths the apps
serve, and the core kinds validate offline against the Kubernetes schemas."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from test_router_deploy import KUBERNETES_VERSION, app_paths, named_ports, parse

from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.router.cli import event_endpoints, replica_pools, router_config_from

LAYOUT = Path(__file__).resolve().parent.parent / "deploy" / "k8s-pd"
POD_IP = "10.1.2.3"


def manifests() -> list[dict]:
    documents = []
    for path in sorted(LAYOUT.glob("*.yaml")):
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def the(kind: str, name: str) -> dict:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def container_of(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def expanded_args(container: dict) -> list[str]:
    """The args as the kubelet passes them: $(NAME) replaced by the container's env (the pod's address for
    status.podIP); a reference to an undeclared variable is left as it is, which pagoda would then refuse."""
    env = {}
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[variable["name"]] = POD_IP if source == "status.podIP" else variable.get("value", "")
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in container["args"]]


def pool(role: str) -> tuple[dict, dict, KVTransferConfig]:
    statefulset = the("StatefulSet", f"pagoda-{role}")
    container = container_of(statefulset)
    args = parse(expanded_args(container))
    assert args.port == named_ports(container)["http"] and args.host == "0.0.0.0"
    return statefulset, container, KVTransferConfig.from_dict(args.kv_transfer_config)


def test_each_pool_runs_the_connector_role_it_needs():
    _, prefill, producer = pool("prefill")
    assert (producer.kv_connector, producer.kv_role) == ("TcpConnector", "kv_producer")
    assert producer.kv_ip == POD_IP, "decode replicas must be told the pod's own address"
    assert producer.kv_port == named_ports(prefill)["kv-transfer"]
    _, _, consumer = pool("decode")
    assert (consumer.kv_connector, consumer.kv_role) == ("TcpConnector", "kv_consumer")
    assert consumer.kv_buffer_size > 0


def test_the_router_lists_exactly_each_statefulsets_pods_in_pd_mode():
    router = container_of(the("Deployment", "pagoda-router"))
    args = parse(router["args"])
    assert args.pd_disaggregation and not args.replica
    router_config_from(args)
    decode, prefill = replica_pools(args)
    urls = {}
    for role in ("prefill", "decode"):
        statefulset, container, _ = pool(role)
        service = the("Service", statefulset["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None", "stable per-pod DNS names need a headless service"
        assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
        ports = named_ports(container)
        assert all(port["targetPort"] in ports for port in service["spec"]["ports"])
        hosts = [f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}"
                 for i in range(statefulset["spec"]["replicas"])]
        urls[role] = {f"http://{host}:{ports['http']}": f"tcp://{host}:{ports['kv-events']}" for host in hosts}
    assert prefill == list(urls["prefill"]) and decode == list(urls["decode"])
    assert event_endpoints(args.replica_kv_events) == urls["prefill"] | urls["decode"]


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_probes_ask_what_the_app_serves(role):
    workload = the("Deployment", "pagoda-router") if role == "router" else the("StatefulSet", f"pagoda-{role}")
    container = container_of(workload)
    paths = app_paths(container["args"][0])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            check = container[probe]["httpGet"]
            assert check["path"] in paths and check["port"] in named_ports(container)


def test_core_kinds_validate_against_the_kubernetes_schemas_and_the_image_exposes_their_ports():
    documents = manifests()
    assert {d["kind"] for d in documents} == {"Service", "Deployment", "StatefulSet"}
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(the("StatefulSet", "pagoda-prefill")))
    broken["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["path"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    dockerfile = (LAYOUT.parent / "Dockerfile").read_text()
    exposed = {int(p) for line in dockerfile.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    workloads = [d for d in documents if d["kind"] in ("Deployment", "StatefulSet")]
    assert {port for w in workloads for port in named_ports(container_of(w)).values()} <= exposed
