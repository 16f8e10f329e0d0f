"""deploy/k8s-tp/, one model split across the pods of a LeaderWorkerSet, against the code it deploys: the pod
templates validate offline as core pods, every rank runs the same command, the group's size is the command's
world size, the Service selects the leaders alone, and the command itself, run here rank by rank with the
variables LWS would give each pod, serves the model and ends the worker with the leader. (The LeaderWorkerSet
kind is not in the Kubernetes schemas, so its own fields are checked by hand against the LWS API.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml
from server_fixtures import ServerProcess, free_port
from test_router_deploy import KUBERNETES_VERSION, parse

from pagoda.config import ParallelConfig
from pagoda.demo import DEMO_MODEL_DIR
from pagoda.sampling import SamplingParams

LAYOUT = Path(__file__).resolve().parent.parent / "deploy" / "k8s-tp"
LWS_VARIABLES = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


def documents() -> list[dict]:
    return [d for path in sorted(LAYOUT.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def the(kind: str) -> dict:
    (found,) = [d for d in documents() if d["kind"] == kind]
    return found


def templates() -> dict[str, dict]:
    spec = the("LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"leader": spec["leaderTemplate"], "worker": spec["workerTemplate"]}


def shell_line(template: dict) -> str:
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    (line,) = container["args"]
    return line


def serve_args(line: str) -> list[str]:
    words = shlex.split(line)
    start = words.index("exec")
    assert words[start + 1] == "pagoda"
    return words[start + 2:]


def test_the_set_runs_one_command_on_a_group_as_large_as_its_world():
    lws = the("LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"]
    group = lws["spec"]["leaderWorkerTemplate"]
    lines = {role: shell_line(template) for role, template in templates().items()}
    assert lines["leader"] == lines["worker"], "every rank runs the same command"
    args = parse(serve_args(lines["leader"]))
    assert args.distributed_executor_backend == "external_launcher"
    world = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size or 1,
                           pipeline_parallel_size=args.pipeline_parallel_size or 1)
    assert group["size"] == world.world_size
    assert set(re.findall(r"\$(\w+)", lines["leader"])) == LWS_VARIABLES
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"


def test_the_pods_validate_and_the_service_selects_the_leaders():
    for role, template in templates().items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pagoda-tp-{role}"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    service = the("Service")
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    leader_labels = {**templates()["leader"]["metadata"]["labels"],
                     "leaderworkerset.sigs.k8s.io/name": the("LeaderWorkerSet")["metadata"]["name"]}
    selector = service["spec"]["selector"]
    assert selector.items() <= leader_labels.items()
    assert not selector.items() <= {**templates()["worker"].get("metadata", {}).get("labels", {}),
                                    "leaderworkerset.sigs.k8s.io/name": "pagoda-tp"}.items()
    (leader,) = templates()["leader"]["spec"]["containers"]
    assert {port["name"] for port in leader["ports"]} >= {"http"}
    dockerfile = (LAYOUT.parent / "Dockerfile").read_text()
    exposed = {int(p) for line in dockerfile.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    assert {port["containerPort"] for port in leader["ports"]} <= exposed


def runnable_here(line: str, port: int, master_port: int) -> str:
    """The pod's line with this machine's model, ports and Python in place of the image's."""
    replaced = (line.replace("exec pagoda ", f"exec {shlex.quote(sys.executable)} -m pagoda ")
                .replace("--model=/models/pagoda-demo", f"--model={shlex.quote(str(DEMO_MODEL_DIR))}")
                .replace("--host=0.0.0.0", "--host=127.0.0.1").replace("--port=8000", f"--port={port}")
                .replace("--threads=4", "--threads=1").replace("MASTER_PORT=29500", f"MASTER_PORT={master_port}"))
    assert replaced.count(str(port)) == 1 and replaced.count(f"MASTER_PORT={master_port}") == 1
    return replaced


def test_the_pods_command_serves_the_model_split_across_two_processes(make_llm, tmp_path):
    port, master_port = free_port(), free_port()
    started = {}
    for role, index in (("worker", 1), ("leader", 0)):
        env = {**os.environ, "LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(tmp_path / f"{role}.log", "wb") as log:
            started[role] = subprocess.Popen(["sh", "-c", runnable_here(shell_line(templates()[role]), port,
                                                                         master_port)],
                                             stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(started["leader"], port, "pagoda-demo", tmp_path / "leader.log")
    try:
        server.wait_for_health(200)
        prompt = "What is 12 + 35?"
        answer = server.client().completions.create(model="pagoda-demo", prompt=prompt, max_tokens=12,
                                                     temperature=0, extra_body={"ignore_eos": True})
        with make_llm(DEMO_MODEL_DIR) as unsplit:  # the same dtype, the image's default
            [expected] = unsplit.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert answer.choices[0].text == expected.outputs[0].text
        server.stop()
        assert started["worker"].wait(timeout=30) == 0, "the worker pod ends with its leader"
    finally:
        for process in started.values():
            process.kill()
            process.wait()
