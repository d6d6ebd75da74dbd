"""The manifests in k8s/ against every schema that will judge them, and against the app's code.

- standard kinds (and each Ray pod template) against the Kubernetes OpenAPI schemas
  (`kubernetes_validate`, strict: an unknown field is an error, as `kubectl apply` makes it);
- each RayService against the KubeRay CRD's own schema (../shared/schemas/; skipped where absent),
  made strict the same way;
- each `serveConfigV2` against Ray Serve's `ServeDeploySchema`, and its `args` against
  `cluster.config.OutriderArgs`;
- worker groups against what the app asks of them: the GPU pool resources their GPUs belong to
  (`cluster.gpu_pools.classify`), room for every replica the Serve autoscalers may start
  (`cluster.placement`), the ports, files and volumes the app uses.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_testlib import (
    K8S,
    MANIFESTS,
    RAYSERVICE_CRD,
    documents,
    node_resources,
    outrider_apps,
    ray_container,
    ray_services,
    serve_config,
    start_resources,
)

from outrider.cluster.app import RAY_ENV
from outrider.cluster.config import OutriderArgs
from outrider.cluster.gpu_pools import DRAFT_RESOURCE, TARGET_RESOURCE, GpuInfo, PoolAssignment, classify
from outrider.cluster.placement import draft_options, target_options

K8S_VERSION = "1.34"  # a recent release kubernetes-validate ships schemas for

EXPECTED = {"demo-cpu.yaml", "llama-eagle3.yaml", "deepseek-multinode.yaml", "api-key-secret.yaml"}

# Memory NVML reports for the GPUs the manifests select (`nvidia.com/gpu.product`, the label
# NVIDIA's GPU feature discovery sets), in GiB: 23034, 81559, 143771 MiB.
GPU_MEMORY_GIB = {"NVIDIA-L4": 22.49, "NVIDIA-H100-80GB-HBM3": 79.65, "NVIDIA-H200": 140.4}

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

manifests = pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
services = pytest.mark.parametrize("path", [p for p in MANIFESTS if ray_services(p)], ids=lambda p: p.name)


# ---------------------------------------------------------------------------- helpers


def groups(service: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, group) for the head and every worker group."""
    cluster = service["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"])] + [
        (g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])
    ]


def gpus(group: dict[str, Any]) -> list[GpuInfo]:
    """The GPUs one pod of `group` gets, identified by the product its node selector asks for."""
    count = int(ray_container(group).get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    if not count:
        return []
    product = group["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product")
    assert product in GPU_MEMORY_GIB, f"GPU group without a known nvidia.com/gpu.product selector: {product}"
    return [GpuInfo(i, product, GPU_MEMORY_GIB[product]) for i in range(count)]


def cluster_pools(service: dict[str, Any], args: OutriderArgs) -> PoolAssignment:
    """The pools the app sees on this cluster: every worker group's GPUs, classified as the app does."""
    return classify([g for _, group in groups(service) for g in gpus(group)], args.gpu_pools)


def demand(actor_options: dict[str, Any]) -> dict[str, float]:
    wanted = {
        "CPU": actor_options.get("num_cpus", 1),
        "GPU": actor_options.get("num_gpus", 0),
        **actor_options.get("resources", {}),
    }
    return {k: float(v) for k, v in wanted.items() if v}


def most_replicas(options: dict[str, Any]) -> int:
    auto = options.get("autoscaling_config")
    return auto["max_replicas"] if auto else options["num_replicas"]


def deployments(args: OutriderArgs, pools: PoolAssignment, drafting: bool) -> dict[str, dict[str, Any]]:
    """Per deployment: bundles of one replica, their placement strategy, most replicas Serve may run."""
    found = {}
    target = target_options(args, pools)
    found["TargetWorker"] = {
        "bundles": target.get("placement_group_bundles") or [demand(target["ray_actor_options"])],
        "strategy": target.get("placement_group_strategy"),
        "max": most_replicas(target),
    }
    if drafting and args.draft_pool.mode == "deployment":
        draft = draft_options(args, pools)
        found["DraftWorker"] = {
            "bundles": [demand(draft["ray_actor_options"])],
            "strategy": None,
            "max": most_replicas(draft),
        }
    found["OpenAIIngress"] = {
        "bundles": [demand({"num_cpus": args.ingress_num_cpus})],
        "strategy": None,
        "max": 1,
    }
    return found


def fits(free: dict[str, float], ask: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in ask.items())


def take(free: dict[str, float], ask: dict[str, float]) -> None:
    for k, v in ask.items():
        free[k] = free.get(k, 0.0) - v


def unplaced(nodes: list[dict[str, float]], replicas: list[tuple[str, list[dict], str | None]]) -> list[str]:
    """First-fit of replicas (biggest first) onto nodes; the replicas that found no room."""
    left = []
    for name, bundles, strategy in sorted(replicas, key=lambda r: -sum(b.get("GPU", 0) for b in r[1])):
        if strategy == "STRICT_PACK":  # every bundle on one node
            whole: dict[str, float] = {}
            for b in bundles:
                for k, v in b.items():
                    whole[k] = whole.get(k, 0.0) + v
            node = next((n for n in nodes if fits(n, whole)), None)
            if node is None:
                left.append(name)
            else:
                take(node, whole)
            continue
        trial, used = copy.deepcopy(nodes), set()
        for b in bundles:
            candidates = [i for i, n in enumerate(trial) if fits(n, b)]
            if strategy == "STRICT_SPREAD":
                candidates = [i for i in candidates if i not in used]
            if not candidates:
                left.append(name)
                break
            take(trial[candidates[0]], b)
            used.add(candidates[0])
        else:
            nodes[:] = trial
    return left


def mount_for(group: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mounted over `path` in the group's Ray container, or None."""
    volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    covering = [
        m
        for m in ray_container(group).get("volumeMounts", [])
        if (path.rstrip("/") + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    if not covering:
        return None
    deepest = max(covering, key=lambda m: len(m["mountPath"].rstrip("/")))
    return volumes.get(deepest["name"])


def app_paths(args: OutriderArgs, raw: dict[str, Any]) -> list[str]:
    """Files the app reads on whichever pod a step lands: build_app (model config, tokenizer),
    the ingress (tokenizer, API key), targets and drafts (weights)."""
    spec = raw.get("speculative_config") or {}
    paths = [args.model, args.tokenizer, spec.get("model"), spec.get("target_model"), args.api_key_file]
    return [p for p in paths if p]


# ---------------------------------------------------------------------------- parsing and schemas


def test_the_manifests_are_all_there():
    assert {p.name for p in MANIFESTS} == EXPECTED
    readme = (K8S / "README.md").read_text()
    for name in EXPECTED:
        assert name in readme, f"k8s/README.md does not describe {name}"


@manifests
def test_manifest_parses_into_named_objects(path: Path):
    docs = documents(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys()
        assert DNS_LABEL.match(doc["metadata"]["name"]), doc["metadata"]["name"]


@manifests
def test_standard_kinds_validate_against_kubernetes(path: Path):
    for doc in documents(path):
        if doc["apiVersion"].split("/")[0] == "ray.io":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@services
def test_ray_pod_templates_validate_against_kubernetes(path: Path):
    """A group's `template` is a PodTemplateSpec: checked as one, strictly, field by field."""
    for service in ray_services(path):
        for name, group in groups(service):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
            wrapped["template"] = group["template"]
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever it lists the known ones (the API
    server would silently prune them; `kubectl apply`'s field validation refuses them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_ended:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    if not RAYSERVICE_CRD.is_file():
        pytest.skip(f"the KubeRay RayService CRD is not at {RAYSERVICE_CRD}")
    crd = yaml.load(RAYSERVICE_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


@services
def test_rayservice_validates_against_the_kuberay_crd(path: Path, rayservice_schema):
    validator = jsonschema.Draft7Validator(rayservice_schema)
    for service in ray_services(path):
        errors = [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(service)
        ]
        assert not errors, "\n".join(errors)


def test_the_strict_crd_check_catches_a_misspelt_field(rayservice_schema):
    (service,) = ray_services(K8S / "demo-cpu.yaml")
    validator = jsonschema.Draft7Validator(rayservice_schema)
    assert not list(validator.iter_errors(service))
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e.message for e in validator.iter_errors(service))


@services
def test_serve_config_validates_with_ray_serve_and_outrider_args(path: Path):
    from ray.serve.schema import ServeDeploySchema

    for service in ray_services(path):
        ServeDeploySchema.model_validate(serve_config(service))
        apps = outrider_apps(service)
        assert apps, "a RayService here serves cluster.app:build_app"
        for app in apps:
            OutriderArgs.model_validate(app["args"])


def test_outrider_args_check_catches_drift():
    """The args check is the model's own: a misspelt or out-of-range key fails it."""
    (service,) = ray_services(K8S / "demo-cpu.yaml")
    (app,) = outrider_apps(service)
    OutriderArgs.model_validate(app["args"])
    for bad in ({"engine": {"max_num_seq": 8}}, {"target": {"num_cpus": -1}}):
        with pytest.raises(ValueError):
            OutriderArgs.model_validate({**app["args"], **bad})


# ---------------------------------------------------------------------------- against the app


@services
def test_worker_groups_declare_the_gpu_pools_of_their_gpus(path: Path):
    """`rayStartParams.resources` = what cluster.gpu_pools would declare for the group's GPUs."""
    for service in ray_services(path):
        (app,) = outrider_apps(service)
        args = OutriderArgs.model_validate(app["args"])
        for name, group in groups(service):
            declared = {k: v for k, v in start_resources(group).items() if k.startswith("outrider_")}
            expected = classify(gpus(group), args.gpu_pools).ray_resources()
            assert declared == expected, f"group {name}: declares {declared}, its GPUs make {expected}"
            if name != "head":
                assert group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"], name


@services
def test_every_replica_the_autoscalers_may_start_fits_the_worker_groups(path: Path):
    for service in ray_services(path):
        (app,) = outrider_apps(service)
        args = OutriderArgs.model_validate(app["args"])
        drafting = not args.no_speculation
        pools = cluster_pools(service, args)
        cluster = service["spec"]["rayClusterConfig"]
        nodes = [node_resources(cluster["headGroupSpec"])]
        for group in cluster.get("workerGroupSpecs", []):
            nodes += [node_resources(group) for _ in range(group["maxReplicas"] * group.get("numOfHosts", 1))]
        apps = deployments(args, pools, drafting)
        # GPU pools exist: replicas must ask for theirs, or Ray may place them on any pod.
        if pools.target:
            assert all(b.get(TARGET_RESOURCE) for b in apps["TargetWorker"]["bundles"])
        if pools.draft and "DraftWorker" in apps:
            assert all(b.get(DRAFT_RESOURCE) for b in apps["DraftWorker"]["bundles"])
        replicas = [(name, d["bundles"], d["strategy"]) for name, d in apps.items() for _ in range(d["max"])]
        left = unplaced(nodes, replicas)
        assert not left, f"no room at max replicas for {left} on nodes {nodes}"


def test_the_fit_check_refuses_a_group_too_small():
    """The packing check is real: a 2-rank STRICT_PACK replica does not fit 1-GPU nodes."""
    bundle = {"CPU": 1.0, "GPU": 1.0, TARGET_RESOURCE: 1.0}
    one_gpu = {"CPU": 8.0, "GPU": 1.0, TARGET_RESOURCE: 1.0}
    assert unplaced([dict(one_gpu), dict(one_gpu)], [("t", [bundle, bundle], "STRICT_PACK")]) == ["t"]
    assert unplaced([dict(one_gpu), dict(one_gpu)], [("t", [bundle, bundle], "PACK")]) == []
    two_gpu = {"CPU": 8.0, "GPU": 2.0, TARGET_RESOURCE: 2.0}
    assert unplaced([dict(two_gpu)], [("t", [bundle, bundle], "STRICT_PACK")] * 2) == ["t"]


@services
def test_pods_mount_every_file_the_app_reads(path: Path):
    """Any pod may run build_app's resolution, the ingress or a replica: each mounts every path."""
    for service in ray_services(path):
        (app,) = outrider_apps(service)
        args = OutriderArgs.model_validate(app["args"])
        for name, group in groups(service):
            container = ray_container(group)
            volumes = {v["name"] for v in group["template"]["spec"].get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: mount of undefined volume {mount['name']}"
            for file in app_paths(args, app["args"]):
                assert mount_for(group, file), f"{name}: nothing mounted over {file}"
            if args.api_key_file:
                assert "secret" in mount_for(group, args.api_key_file), f"{name}: the API key is not a Secret"
            if args.model is None:  # the demo family: its folders are resolved once, read everywhere
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                assert env.get("OUTRIDER_HOME"), f"{name}: OUTRIDER_HOME unset"
                assert mount_for(group, env["OUTRIDER_HOME"]), f"{name}: OUTRIDER_HOME is not a shared volume"


@services
def test_every_ray_container_sets_the_ray_env(path: Path):
    """Serve's proxy runs on every node (`proxy_location: EveryNode`): each pod's Ray reads
    `RAY_ENV` at start, as `outrider serve` sets it before starting a local Ray."""
    for service in ray_services(path):
        for name, group in groups(service):
            env = {e["name"]: e.get("value") for e in ray_container(group).get("env", [])}
            for key, value in RAY_ENV.items():
                assert env.get(key) == value, f"{name}: {key} is not {value!r}"


@services
def test_ports_volumes_and_secrets_agree(path: Path):
    known_claims = {d["metadata"]["name"] for d in documents(path) if d["kind"] == "PersistentVolumeClaim"}
    known_secrets = {d["metadata"]["name"] for p in MANIFESTS for d in documents(p) if d["kind"] == "Secret"}
    for service in ray_services(path):
        config = serve_config(service)
        (app,) = outrider_apps(service)
        args = OutriderArgs.model_validate(app["args"])
        for name, group in groups(service):
            spec = group["template"]["spec"]
            for volume in spec.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in known_claims, name
                if "secret" in volume:
                    assert volume["secret"]["secretName"] in known_secrets, name
            ports = {p.get("name"): p["containerPort"] for p in ray_container(group).get("ports", [])}
            assert ports.get("serve") == config["http_options"]["port"], f"{name}: serve port"
            # Draft replicas run where the draft pool is (anywhere but the head without pools).
            hosts_drafts = DRAFT_RESOURCE in start_resources(group) or (
                name != "head" and not cluster_pools(service, args).draft
            )
            if args.draft_pool.mode == "deployment" and args.draft_pool.grpc_port and hosts_drafts:
                assert args.draft_pool.grpc_port in ports.values(), f"{name}: draft gRPC port not declared"
