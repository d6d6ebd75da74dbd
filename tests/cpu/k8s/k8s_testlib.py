"""Reading the manifests in k8s/: documents, RayServices, their Serve configs and worker groups."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
# The KubeRay CRD lives beside the repository in the development workspace, not in it.
RAYSERVICE_CRD = REPO.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"
APP_IMPORT_PATH = "outrider.cluster.app:build_app"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def ray_services(path: Path) -> list[dict[str, Any]]:
    return [
        d for d in documents(path) if d.get("apiVersion") == "ray.io/v1" and d.get("kind") == "RayService"
    ]


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    """`serveConfigV2` is a YAML document inside a string field."""
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def outrider_apps(service: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in serve_config(service)["applications"] if a["import_path"] == APP_IMPORT_PATH]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of a head or worker group: KubeRay treats the first container as it."""
    return group["template"]["spec"]["containers"][0]


def start_resources(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources of `rayStartParams.resources`. KubeRay pastes the value into the
    shell command `ray start --resources=<value>`, so it is JSON quoted for bash: read it as bash
    would, then as JSON."""
    text = group.get("rayStartParams", {}).get("resources")
    if text is None:
        return {}
    (word,) = shlex.split(text)
    return {k: float(v) for k, v in json.loads(word).items()}


def node_resources(group: dict[str, Any]) -> dict[str, float]:
    """What one pod of `group` offers Ray: CPUs and GPUs as KubeRay passes them to `ray start`
    (rayStartParams first, else the container limits, CPUs rounded up), plus custom resources."""
    params = group.get("rayStartParams", {})
    limits = ray_container(group).get("resources", {}).get("limits", {})
    cpus = (
        float(params["num-cpus"]) if "num-cpus" in params else math.ceil(cpu_quantity(limits.get("cpu", 0)))
    )
    gpus = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    return {"CPU": cpus, "GPU": gpus, **start_resources(group)}


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
