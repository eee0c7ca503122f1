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


# ---------------------------------------------------------------- the commands the cluster files document
def _documented_commands(name: str) -> list[list[str]]:
    """The `ray ...` commands in a cluster file's header comments, continuation lines joined, as argv lists."""
    import shlex

    lines = [ln[1:].strip() for ln in (CLUSTERS / name).read_text().splitlines() if ln.startswith("#")]
    joined, cur = [], ""
    for ln in lines:
        cur = f"{cur} {ln}".strip() if cur else ln
        if cur.endswith("\\"):
            cur = cur[:-1].strip()
            continue
        joined.append(cur)
        cur = ""
    return [shlex.split(c) for c in joined if c.startswith(("ray submit", "ray job submit", "ray exec"))]


def test_aws_cluster_commands_run_what_the_code_takes():
    """Each command in ray-cluster-aws.yaml's header names a script or module that exists, with arguments its parser
    takes and a model at the path the setup commands sync it to; the Serve app it starts names a model the cluster
    has (it ran clusters/serve.yaml, whose model_dir is the bundled models/pw-tiny-moe: not on the cluster)."""
    from ray.scripts.scripts import exec as ray_exec, submit as ray_submit
    from ray.serve.scripts import run as serve_run

    from pagedweight.actors.jobs.evaluate import build_parser
    from pagedweight.actors.openai_app import AppArgs

    config = _load("ray-cluster-aws.yaml")
    synced = [c.split()[-1] for c in config["setup_commands"] if c.startswith("aws s3 sync")]
    assert synced == ["/home/ray/models"]
    commands = _documented_commands("ray-cluster-aws.yaml")
    assert [c[1] for c in commands] == ["submit", "job", "exec"]
    evaluations = []
    for argv in commands:
        if argv[1] == "submit":
            params = ray_submit.make_context("submit", argv[2:]).params
            assert (ROOT / params["script"]).is_file() and params["script"] == "actors/jobs/evaluate.py"
            evaluations.append(list(params["script_args"]))
        elif argv[1] == "job":
            cmd = argv[argv.index("--") + 1:]
            assert cmd[:3] == ["python", "-m", "pagedweight.actors.jobs.evaluate"]
            evaluations.append(cmd[3:])
        else:
            params = ray_exec.make_context("exec", argv[2:]).params
            assert (ROOT / params["cluster_config_file"]).resolve() == (CLUSTERS / "ray-cluster-aws.yaml").resolve()
            serve_argv = params["cmd"].split()
            assert serve_argv[:2] == ["serve", "run"]
            serve = serve_run.make_context("run", serve_argv[2:]).params
            target = serve["config_or_import_path"]
            if target.endswith(".yaml"):  # a Serve config that the file mounts bring
                mounted = {f"{dst}/": f"{src}/" for dst, src in config["file_mounts"].items()}
                local = next(src + target[len(dst):] for dst, src in mounted.items() if target.startswith(dst))
                (app,) = yaml.safe_load((ROOT / local).read_text())["applications"]
                target, args = app["import_path"], app["args"]
            else:  # an import path and the builder's arguments
                args = dict(a.split("=", 1) for a in serve["arguments"])
            module, attr = target.split(":")
            assert callable(getattr(importlib.import_module(module), attr))
            app = AppArgs.model_validate(args)
            assert app.model_dir.startswith("/home/ray/models/"), app.model_dir  # where the setup syncs models
            assert app.num_gpus_per_replica == 1
    for args in evaluations:
        job = build_parser().parse_args(args)
        assert job.model_dir.startswith("/home/ray/models/") and job.device == "cuda" and job.num_engines


def test_cluster_files_install_the_wheel_this_project_builds():
    """Every wheel the cluster files install (setup commands, runtime envs, comments) is the one `python -m build`
    makes of this version: a version bump in pyproject.toml must not leave them fetching a name that is not built."""
    version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    want = f"pagedweight-{version}-py3-none-any.whl"  # (tomllib is 3.11's: the project runs on 3.10 too)
    for path in CLUSTERS.glob("*.yaml"):
        wheels = set(re.findall(r"pagedweight-[^\s/'\"\]]+\.whl", path.read_text()))
        assert wheels <= {want}, (path.name, wheels)
    assert want in (CLUSTERS / "ray-cluster-aws.yaml").read_text()
