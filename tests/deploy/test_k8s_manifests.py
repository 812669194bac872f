"""deploy/k8s, validated without a cluster.

Every resource is checked against the Kubernetes API schemas (kubernetes-validate, strict:
unknown fields fail), the LeaderWorkerSet's pod templates as PodTemplates, and, where no
schema can look, against tandem itself: each container's command line parses with tandem's
own argument parser (a misspelt flag fails here, not in a pod's crash loop), the router
discovers Services that exist, are headless and select the pods that serve on that port, and
every worker gets the time its preStop wait plus its drain need before it is killed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tandem.cli.main import build_parser
from tandem.router.cli import router_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = kubernetes_validate.latest_version()
# What the kubelet would put into $(VAR) references: the ConfigMap, the downward API, LWS.
ENV = {"MODEL": "/models/Llama-3.1-8B-Instruct", "KV_STORE": "redis://tandem-redis:6379", "POD_IP": "10.0.0.9",
       "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "tandem-tp-0.tandem-tp.default", "LWS_WORKER_INDEX": "1"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


DOCS = _documents()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(owner, PodTemplateSpec) of every Deployment and both templates of each LeaderWorkerSet."""
    out = [(d["metadata"]["name"], d["spec"]["template"]) for d in _of_kind("Deployment")]
    for lws in _of_kind("LeaderWorkerSet"):
        spec = lws["spec"]["leaderWorkerTemplate"]
        out += [(f"{lws['metadata']['name']}/leader", spec["leaderTemplate"]),
                (f"{lws['metadata']['name']}/worker", spec["workerTemplate"])]
    return out


def _argv(container: dict[str, Any]) -> list[str]:
    argv = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], str(a)) for a in argv]


@pytest.mark.parametrize(("name", "doc"), [d for d in DOCS if d[1]["kind"] != "LeaderWorkerSet"],
                         ids=lambda x: x if isinstance(x, str) else x["metadata"]["name"])
def test_resources_match_the_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_a_misspelt_field_fails_validation() -> None:
    deployment = next(d for d in _of_kind("Deployment") if d["metadata"]["name"] == "tandem-router")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_leaderworkerset_templates_are_valid_pods_and_the_group_is_one_engine() -> None:
    (lws,) = _of_kind("LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]["leaderWorkerTemplate"]
    assert spec["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    for role in ("leaderTemplate", "workerTemplate"):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                                      "template": spec[role]}, VERSION, strict=True)
    leader = build_parser().parse_args(_argv(spec["leaderTemplate"]["spec"]["containers"][0])[1:])
    worker = build_parser().parse_args(_argv(spec["workerTemplate"]["spec"]["containers"][0])[1:])
    assert not leader.headless and worker.headless and worker.node_rank == 1
    assert leader.nnodes == worker.nnodes == spec["size"] == int(ENV["LWS_GROUP_SIZE"])
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "master_port", "model"):
        assert getattr(leader, flag) == getattr(worker, flag), flag


def test_kustomization_lists_every_file_but_the_optional_group() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "leaderworkerset.yaml"}
    assert set(kustomization["resources"]) == files
    images = {image["name"] for image in kustomization["images"]}
    assert {c["image"] for d in _of_kind("Deployment") if d["metadata"]["name"] != "tandem-redis"
            for c in d["spec"]["template"]["spec"]["containers"]} <= images


@pytest.mark.parametrize(("owner", "template"), [t for t in _pod_templates() if "redis" not in t[0]],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_tandem_command_lines_parse_and_probes_fit_the_drain(owner: str, template: dict[str, Any]) -> None:
    (container,) = template["spec"]["containers"]
    argv = _argv(container)
    assert argv[0] == "tandem"
    args = build_parser().parse_args(argv[1:])
    if args.command == "route":
        config = router_config(args)
        assert config.discover, "the router finds its workers through --discover"
    if getattr(args, "headless", False):
        return  # ranks of node 0's engine: no API, no probes
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and args.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe"):
        if probe in container:
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in container["livenessProbe"], "/health fails on purpose while draining"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert template["spec"]["terminationGracePeriodSeconds"] >= pre_stop + args.shutdown_timeout
    if getattr(args, "role", None) in ("prefill", "decode"):
        assert args.kv_transfer_host == ENV["POD_IP"] and ports["kv-transfer"] == args.kv_transfer_port
        assert {"secretRef": {"name": "tandem-cluster-secret"}} in container["envFrom"]


def test_router_discovers_headless_services_of_the_right_pods() -> None:
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")}
    router = next(d for d in _of_kind("Deployment") if d["metadata"]["name"] == "tandem-router")
    config = router_config(build_parser().parse_args(_argv(router["spec"]["template"]["spec"]["containers"][0])[1:]))
    roles = {target.role for target in config.discover}
    assert roles == {"prefill", "decode"}
    for target in config.discover:
        service = services[target.host]
        assert service["spec"]["clusterIP"] == "None", f"{target.host} must be headless"
        assert any(p["port"] == target.port for p in service["spec"]["ports"])
        (pods,) = [d for d in _of_kind("Deployment") if d["metadata"]["name"] == target.host]
        labels = pods["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        (container,) = pods["spec"]["template"]["spec"]["containers"]
        assert build_parser().parse_args(_argv(container)[1:]).role == target.role
