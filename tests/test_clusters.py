"""Offline validation of clusters/: each file against the schema of the tool that consumes it.

`ray up` YAML: Ray's own autoscaler schema after filling defaults; KubeRay manifests: the CRDs'
openAPIV3Schema made strict (unknown fields rejected, as `kubectl --validate=strict`); Serve configs
(clusters/serve.yaml and the RayService's embedded serveConfigV2): ray.serve.schema.ServeDeploySchema.
Each check is also run on a deliberately broken copy, so a validator that accepts anything fails.
"""
from __future__ import annotations

import copy
import functools
import importlib
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "clusters"
CRDS = Path("/work/shared/data/kuberay-crds")
if not CRDS.exists():
    CRDS = ROOT.parent / "shared" / "data" / "kuberay-crds"


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTERS / name).read_text())


# ---------------------------------------------------------------- ray up
def _ray_up_check(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_ray_up_yaml_passes_ray_schema():
    prepared = _ray_up_check(_load("ray-cluster-aws.yaml"))
    types = prepared["available_node_types"]
    gpu_types = [t for t, spec in types.items() if spec.get("resources", {}).get("GPU", 0) > 0]
    assert gpu_types, "no GPU worker type"
    assert prepared["head_node_type"] not in gpu_types
    docker = prepared["docker"]
    assert docker["disable_shm_size_detection"] is True
    shm = [o for o in docker["worker_run_options"] if o.startswith("--shm-size=")]
    assert len(shm) == 1 and shm[0].endswith("g") and int(shm[0][len("--shm-size="):-1]) >= 64
    starts = " ".join(prepared["worker_start_ray_commands"] + prepared["head_start_ray_commands"])
    assert starts.count("--metrics-export-port=") == 2
    # the GPU nodes' object store is held below /dev/shm, which the page store also fills
    assert all("--object-store-memory=" in c for c in prepared["worker_start_ray_commands"] if "ray start" in c)
    # an ImageId of every node type (without one Ray boots its 2023 Ubuntu 18.04 fallback AMI)
    config = _load("ray-cluster-aws.yaml")
    for name, spec in config["available_node_types"].items():
        assert spec["node_config"].get("ImageId", "").startswith(("ami-", "resolve:ssm:")), name
    # file mounts: sources that a fresh checkout has, small (`ray up` reads every file of a mount to hash it)
    for target, source in config["file_mounts"].items():
        path = ROOT / source
        assert path.exists() and path.resolve() != ROOT, (target, source)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        assert size < 1 << 20, (target, source, size)


@pytest.mark.parametrize("breakage", ["typo_top", "typo_docker", "bad_type"])
def test_ray_up_schema_rejects_broken_copy(breakage):
    config = _load("ray-cluster-aws.yaml")
    if breakage == "typo_top":
        config["max_worker"] = 3
    elif breakage == "typo_docker":
        config["docker"]["shm_size"] = "192g"
    else:
        config["upscaling_speed"] = "fast"
    with pytest.raises(jsonschema.ValidationError):
        _ray_up_check(config)


# ---------------------------------------------------------------- KubeRay
def _strict(schema):
    """Copy of an openAPIV3Schema where objects with declared properties reject unknown keys."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _crd(crd_file: str) -> dict:
    """The CRD (about 1 MB of YAML: parsed once, with libyaml when present)."""
    return yaml.load((CRDS / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _crd_validator(crd_file: str, manifest: dict) -> jsonschema.Draft7Validator:
    crd = _crd(crd_file)
    group, version = manifest["apiVersion"].split("/")
    assert group == crd["spec"]["group"] and manifest["kind"] == crd["spec"]["names"]["kind"]
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert ver["served"], f"{version} is not served"
    return jsonschema.Draft7Validator(_strict(ver["schema"]["openAPIV3Schema"]))


KUBERAY = [("kuberay-raycluster.yaml", "ray.io_rayclusters.yaml"),
           ("kuberay-rayservice.yaml", "ray.io_rayservices.yaml")]


def _cluster_spec(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterConfig"] if manifest["kind"] == "RayService" else manifest["spec"]


@pytest.mark.parametrize("manifest_file,crd_file", KUBERAY)
def test_kuberay_manifest_matches_crd_strictly(manifest_file, crd_file):
    manifest = _load(manifest_file)
    errors = sorted(_crd_validator(crd_file, manifest).iter_errors(manifest), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])
    spec = _cluster_spec(manifest)
    assert spec["rayVersion"] == "2.60.0"
    gpu_groups = [g for g in spec["workerGroupSpecs"]
                  if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")]
    assert gpu_groups
    for group in gpu_groups:
        pod = group["template"]["spec"]
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1 and re.fullmatch(r"\d+Gi", shm[0]["emptyDir"]["sizeLimit"])
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[shm[0]["name"]] == "/dev/shm"


@pytest.mark.parametrize("manifest_file,crd_file", KUBERAY)
def test_kuberay_strict_schema_rejects_typos(manifest_file, crd_file):
    manifest = _load(manifest_file)
    validator = _crd_validator(crd_file, manifest)
    broken = copy.deepcopy(manifest)
    _cluster_spec(broken)["workerGroupSpecs"][0]["maxReplica"] = 2
    assert not validator.is_valid(broken)
    broken = copy.deepcopy(manifest)
    _cluster_spec(broken)["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}
    assert not validator.is_valid(broken)


# ---------------------------------------------------------------- Serve
def _serve_configs() -> dict[str, dict]:
    service = _load("kuberay-rayservice.yaml")
    return {"serve.yaml": _load("serve.yaml"),
            "rayservice.serveConfigV2": yaml.safe_load(service["spec"]["serveConfigV2"])}


def _unknown_keys(model_cls, data: dict, where: str) -> list[str]:
    """ServeDeploySchema tolerates extra keys (forward compatibility); a typo should not pass here."""
    return [f"{where}.{k}" for k in data if k not in model_cls.model_fields]


@pytest.mark.parametrize("name", ["serve.yaml", "rayservice.serveConfigV2"])
def test_serve_config_matches_serve_schema(name):
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    config = _serve_configs()[name]
    parsed = ServeDeploySchema.model_validate(config)
    unknown = _unknown_keys(ServeDeploySchema, config, "config")
    for i, app in enumerate(config["applications"]):
        unknown += _unknown_keys(ServeApplicationSchema, app, f"applications[{i}]")
    assert not unknown, unknown
    (app,) = parsed.applications
    assert app.route_prefix == "/"
    module, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    from pagedweight.actors.openai_app import AppArgs

    AppArgs.model_validate(app.args)  # the builder's own argument model (extra="forbid": a typo raises)
    if name == "serve.yaml":
        assert parsed.http_options.host == "127.0.0.1"


def test_serve_schema_rejects_broken_copy():
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    config = _serve_configs()["serve.yaml"]
    config["applications"][0]["import_path"] = "build_app"  # no module
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(config)
    config = _serve_configs()["serve.yaml"]
    config["applications"].append(copy.deepcopy(config["applications"][0]))
    with pytest.raises(ValidationError):  # duplicate application name and route prefix
        ServeDeploySchema.model_validate(config)
