"""The launchable cluster files under ``cluster/``, each checked against the schema that reads it.

* ``ray up`` configs (a top-level ``provider``): Ray's own preparation and validation
  (``prepare_config``: the provider's defaults, the on-premise provider's checks; then
  ``validate_config``: ``ray/autoscaler/ray-schema.json`` and its cross-field rules), and each
  node type's ``node_config`` against the cloud request Ray sends it in: EC2 ``RunInstances``
  (botocore's service model) or Compute Engine ``instances.insert`` (the Google API client's
  discovery document).
* Kubernetes manifests: a ``RayJob`` against the KubeRay CRD's ``openAPIV3Schema``
  (``cluster/schemas/``, recorded in ``cluster/schemas/SOURCE``), strict as the API server's
  field validation is; its pod templates and every other object against Kubernetes' own schemas
  (``kubernetes-validate``, offline).
* ``cluster/Dockerfile``: its instructions (``dockerfile-parse``), its install line against the
  README's, its base image against the README's torch pin; its ``.dockerignore`` against what
  ``.gitignore`` and ``.rayignore`` leave out.

Every file in ``cluster/`` has a kind here (:func:`kind_of`), and a file of no kind fails
:func:`test_every_cluster_file_is_checked`. Nothing starts Ray or touches the network.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import io
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
README = ROOT / "README.md"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1.4 MB: libyaml reads it in 0.4 s
GPU = "nvidia.com/gpu"
DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                       "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


# --------------------------------------------------------------------------- which file is what


def kind_of(rel: str) -> str | None:
    """The kind of ``cluster/<rel>`` (which tests check it), or None for a file no test checks."""
    fixed = {"README.md": "readme", "Dockerfile": "dockerfile", "Dockerfile.dockerignore": "dockerignore",
             "schemas/SOURCE": "source"}
    if rel in fixed:
        return fixed[rel]
    if not rel.endswith((".yaml", ".yml")):
        return None
    if rel.startswith("schemas/"):
        return "crd"  # test_crd_* check that it is one
    docs = _docs(rel)
    if len(docs) == 1 and {"cluster_name", "provider"} <= set(docs[0]):
        return "ray-cluster"
    if docs and all({"apiVersion", "kind"} <= set(d) for d in docs):
        return "kubernetes"
    return None


@functools.lru_cache(maxsize=None)
def _docs(rel: str) -> tuple:
    return tuple(d for d in yaml.load_all((CLUSTER / rel).read_text(), Loader=LOADER) if d is not None)


def _load(rel: str) -> dict:
    """A fresh copy of the single document of ``cluster/<rel>`` (tests mutate what they get)."""
    (doc,) = _docs(rel)
    return copy.deepcopy(doc)


FILES = sorted(p.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*") if p.is_file())
RAY_CONFIGS = [f for f in FILES if kind_of(f) == "ray-cluster"]
K8S_FILES = [f for f in FILES if kind_of(f) == "kubernetes"]
CRDS = [f for f in FILES if kind_of(f) == "crd"]


def test_every_cluster_file_is_checked():
    """Every file in cluster/ has a kind that a test below checks; the three launcher configs and
    the RayJob exist."""
    assert {f: kind_of(f) for f in FILES if kind_of(f) is None} == {}
    assert sorted(_load(f)["provider"]["type"] for f in RAY_CONFIGS) == ["aws", "gcp", "local"]
    assert [d["kind"] for f in K8S_FILES for d in _docs(f) if d["kind"] == "RayJob"] == ["RayJob"]
    assert CRDS == ["schemas/ray.io_rayjobs.yaml"]


# --------------------------------------------------------------------------- install lines


def pip_installs(command: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in a shell command line, one list per install (the
    line split at ``&&``, ``||`` and ``;``)."""
    found = []
    for part in re.split(r"&&|\|\||;", command):
        words = shlex.split(part)
        found += [words[i + 2:] for i in range(len(words) - 1) if words[i] in ("pip", "pip3") and words[i + 1] == "install"]
    return found


@functools.lru_cache(maxsize=None)
def readme_install() -> tuple[str, ...]:
    """The package part of the README's install command (its first line): ``torch==X -e .``."""
    line = next(x for x in README.read_text().splitlines() if x.startswith("python3 -m venv .venv &&"))
    (args,) = pip_installs(line)
    assert "-e" in args, line
    return tuple(args)


def install_problems(commands: list[str]) -> list[str]:
    """What is wrong with the installs of ``commands`` (shell lines): exactly one installs the
    project (``-e``), with the README's package part; another installs ``ray[train,default]``
    pinned, and ``wandb``."""
    installs = [a for c in commands for a in pip_installs(c)]
    project = [a for a in installs if "-e" in a]
    problems = []
    if [tuple(a) for a in project] != [readme_install()]:
        problems.append(f"project install {project} is not the README's [{' '.join(readme_install())}]")
    extras = [a for a in installs if any(x.startswith("ray[train,default]==") for x in a)]
    if len(extras) != 1 or "wandb" not in extras[0]:
        problems.append(f"no single install of pinned ray[train,default] with wandb: {installs}")
    return problems


def ray_pins(text: str) -> set[str]:
    return set(re.findall(r"ray\[train,default\]==([0-9][\w.]*)", text))


# --------------------------------------------------------------------------- ray up: node configs


@functools.lru_cache(maxsize=None)
def _run_instances():
    import botocore.session

    return botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape


def ec2_problems(node_config: dict) -> list[str]:
    """What EC2 ``RunInstances`` refuses in ``node_config`` as Ray's AWS provider sends it (Ray
    resolves its own ``SubnetIds`` and adds ``MinCount``/``MaxCount``), by botocore's model,
    and an instance type that is not in the model's list."""
    from botocore.validate import ParamValidator

    request = {k: v for k, v in node_config.items() if k != "SubnetIds"}
    request.update(MinCount=1, MaxCount=1)
    report = ParamValidator().validate(request, _run_instances())
    problems = [report.generate_report()] if report.has_errors() else []
    types = _run_instances().members["InstanceType"].enum
    if node_config.get("InstanceType") not in types:
        problems.append(f"InstanceType {node_config.get('InstanceType')!r} is no EC2 instance type")
    return problems


def _discovery_to_json_schema(node: dict) -> dict:
    """A Google API discovery schema as JSON Schema: ``$ref`` to ``#/schemas/NAME``, int64 fields
    as the integer or string JSON allows, and objects refusing properties they do not list."""
    out = {}
    for key, value in node.items():
        if key == "$ref":
            out["$ref"] = "#/schemas/" + value
        elif key == "properties":
            out[key] = {name: _discovery_to_json_schema(p) for name, p in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _discovery_to_json_schema(value)
        elif key in ("type", "enum"):
            out[key] = value
    if node.get("type") == "string" and node.get("format") in ("int64", "uint64"):
        out["type"] = ["string", "integer"]
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _gce_instance_validator():
    from googleapiclient.discovery_cache import get_static_doc

    doc = json.loads(get_static_doc("compute", "v1"))
    schemas = {name: _discovery_to_json_schema(s) for name, s in doc["schemas"].items()}
    return jsonschema.Draft7Validator({"$ref": "#/schemas/Instance", "schemas": schemas})


def gce_problems(node_config: dict) -> list[str]:
    """What Compute Engine ``instances.insert`` refuses in ``node_config`` as Ray's GCP provider
    sends it (less its own keys ``sourceInstanceTemplate`` and ``networkConfig``), by the v1
    discovery document, and a node Ray would not take for a VM."""
    from ray.autoscaler._private.gcp.config import GCPNodeType, get_node_type

    if get_node_type(node_config) is not GCPNodeType.COMPUTE:
        return ["not a Compute Engine VM (a TPU node config)"]
    body = {k: v for k, v in node_config.items() if k not in ("sourceInstanceTemplate", "networkConfig")}
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _gce_instance_validator().iter_errors(body)]


NODE_CONFIG_CHECKS = {"aws": ec2_problems, "gcp": gce_problems}
"""Provider type -> what its cloud refuses in a node_config."""


def prepared(config: dict) -> dict:
    """``config`` as ``ray up`` has it before it reaches the cloud: prepared, then validated."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    out = prepare_config(copy.deepcopy(config))
    validate_config(out)
    return out


@pytest.mark.parametrize("rel", RAY_CONFIGS)
def test_ray_config_passes_ray_up_checks(rel):
    """Ray's preparation and schema accept the config; every node type's node_config is a valid
    request of its cloud; GPU workers have 8 GPUs, a fixed count."""
    config = _load(rel)
    ready = prepared(config)
    provider = config["provider"]["type"]
    head = ready["head_node_type"]
    for name, node_type in ready["available_node_types"].items():
        node_config = node_type["node_config"]
        if provider == "local":  # Ray's on-premise provider: one node type of the listed machines
            assert node_config == {} and node_type["min_workers"] == len(config["provider"]["worker_ips"])
        elif provider in NODE_CONFIG_CHECKS:
            assert NODE_CONFIG_CHECKS[provider](node_config) == [], name
        else:
            pytest.fail(f"{rel}: no check of provider {provider!r}'s node_config here; add one to NODE_CONFIG_CHECKS")
        if provider != "local" and name != head:
            assert node_type["resources"]["GPU"] == 8 and node_type["min_workers"] == node_type["max_workers"], name


def test_ray_up_checks_refuse_broken_configs():
    """One broken copy per check: Ray's schema (a count as a string, an unknown key), the
    on-premise provider (no head_ip), EC2 (a misspelt key, an unknown instance type), Compute
    Engine (a value outside its enum, a misspelt key, no machine type)."""
    import click

    aws = _load("aws.yaml")
    bad = copy.deepcopy(aws)
    bad["available_node_types"][bad["head_node_type"]]["resources"]["CPU"] = "32"
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        prepared(bad)
    bad = copy.deepcopy(aws)
    bad["max_worker"] = 2
    with pytest.raises(jsonschema.ValidationError, match="'max_worker' was unexpected"):
        prepared(bad)
    local = _load("local.yaml")
    del local["provider"]["head_ip"]
    with pytest.raises(click.ClickException, match="head_ip"):
        prepared(local)

    (worker,) = [t for n, t in aws["available_node_types"].items() if n != aws["head_node_type"]]
    node = copy.deepcopy(worker["node_config"])
    node["InstanceTyp"] = node.pop("InstanceType")
    assert any('Unknown parameter in input: "InstanceTyp"' in p for p in ec2_problems(node))
    assert ec2_problems(dict(worker["node_config"], InstanceType="p5.48xlarg")) == [
        "InstanceType 'p5.48xlarg' is no EC2 instance type"]

    gcp = _load("gcp.yaml")
    (worker,) = [t for n, t in gcp["available_node_types"].items() if n != gcp["head_node_type"]]
    node = copy.deepcopy(worker["node_config"])
    node["scheduling"]["onHostMaintenance"] = "TERMINATED"
    node["disks"][0]["initializeParams"]["diskSizeGB"] = 500
    assert gce_problems(node) == [
        "disks.0.initializeParams: Additional properties are not allowed ('diskSizeGB' was unexpected)",
        "scheduling.onHostMaintenance: 'TERMINATED' is not one of ['MIGRATE', 'TERMINATE']"]
    del node["machineType"]
    with pytest.raises(ValueError, match="'machineType' is required"):
        gce_problems(node)


@pytest.mark.parametrize("rel", RAY_CONFIGS)
def test_ray_config_installs_the_project_as_the_readme(rel):
    """Every node gets this checkout (file_mounts from the repository root, .gitignore'd files
    left out) and installs it with the README's package part, plus pinned Ray Train and W&B, in
    the venv its Ray commands run in; Ray starts with token authentication and the shared file
    system is mounted where the RayJob mounts its volume."""
    config = _load(rel)
    assert config["file_mounts"]["~/tessera"] == "." and ".gitignore" in config["rsync_filter"]
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    setup = config["setup_commands"]
    assert install_problems(setup) == []
    (project,) = [c for c in setup if "-e" in sum(pip_installs(c), [])]
    assert "cd ~/tessera &&" in project and project.startswith(". ~/tessera-venv/bin/activate &&")
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert ". ~/tessera-venv/bin/activate &&" in cmd
        assert "ray stop" in cmd or "RAY_AUTH_MODE=token ray start" in cmd
    shared = shared_mount()
    assert any(re.search(rf"\bmount\b.*\s{re.escape(shared)}\)", c) for c in setup), setup


def test_install_check_refuses_a_diverging_line():
    """The install check fails when a config's or the Dockerfile's line leaves the README's."""
    (torch,) = [a for a in readme_install() if a.startswith("torch==")]
    line = f'pip install {" ".join(readme_install())} && pip install "ray[train,default]==2.60.0" wandb'
    assert install_problems([line]) == []
    assert install_problems([line.replace(torch, "torch==2.0.0")])[0].startswith(
        f"project install [{['torch==2.0.0'] + list(readme_install()[1:])}] is not the README's")
    assert install_problems([line.replace(" -e .", " .")])[0].startswith("project install []")
    assert install_problems([line.replace(" wandb", "")]) == [
        f"no single install of pinned ray[train,default] with wandb: {pip_installs(line.replace(' wandb', ''))}"]


# --------------------------------------------------------------------------- Kubernetes


def _strict(schema):
    """A CRD schema as the API server applies it under strict field validation (kubectl's
    default): an object that lists its properties refuses others, unless it keeps unknown ones."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: _strict(p) for n, p in v.items()} if k == "properties" else _strict(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def _crd(rel: str = "schemas/ray.io_rayjobs.yaml") -> dict:
    (crd,) = _docs(rel)
    return crd


def _served_schema(crd: dict, api_version: str) -> dict:
    """The ``openAPIV3Schema`` of the CRD version ``api_version`` (``group/version``) names."""
    group, version = api_version.split("/")
    assert group == crd["spec"]["group"], api_version
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return v["schema"]["openAPIV3Schema"]


@functools.lru_cache(maxsize=None)
def _rayjob_validator(api_version: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(_served_schema(_crd(), api_version)))


def cel_rules_reached(schema: dict, value, path: str = "") -> list[str]:
    """Paths in ``value`` whose schema carries CEL rules (``x-kubernetes-validations``), which
    jsonschema does not evaluate."""
    found = [path or "."] if "x-kubernetes-validations" in schema else []
    if isinstance(value, dict):
        for key, sub in value.items():
            sub_schema = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(sub_schema, dict):
                found += cel_rules_reached(sub_schema, sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            found += cel_rules_reached(schema["items"], sub, f"{path}[{i}]")
    return found


def k8s_validate(obj: dict) -> str:
    """``obj`` against Kubernetes' schemas of the newest version kubernetes-validate ships,
    strict (unknown fields refused); returns that version."""
    import kubernetes_validate

    return kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def pod_template(name: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def _rayjob() -> tuple[dict, list[dict]]:
    """The RayJob of the Kubernetes files and the other objects of its file."""
    for rel in K8S_FILES:
        docs = [copy.deepcopy(d) for d in _docs(rel)]
        jobs = [d for d in docs if d["kind"] == "RayJob"]
        if jobs:
            return jobs[0], [d for d in docs if d["kind"] != "RayJob"]
    raise AssertionError("no RayJob in cluster/")


def _templates(rayjob: dict) -> dict[str, dict]:
    spec = rayjob["spec"]["rayClusterSpec"]
    out = {"head": spec["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return out


@pytest.mark.parametrize("rel", K8S_FILES)
def test_kubernetes_objects_validate(rel):
    """RayJobs against the KubeRay CRD (strict, no field under a CEL rule), their head and worker
    pod templates and every other object against Kubernetes' schemas (strict)."""
    for doc in _docs(rel):
        if doc["kind"] == "RayJob":
            errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                      for e in _rayjob_validator(doc["apiVersion"]).iter_errors(doc)]
            assert errors == []
            assert cel_rules_reached(_served_schema(_crd(), doc["apiVersion"]), doc) == []
            for name, template in _templates(doc).items():
                k8s_validate(pod_template(name, template))
        else:
            k8s_validate(doc)


def test_kubernetes_checks_refuse_broken_objects():
    """One broken copy per schema: the CRD refuses a misspelt field and a word for a count,
    Kubernetes' schema a misspelt resources key and a PVC access mode it does not know; the CEL
    walk finds a field under a rule."""
    import kubernetes_validate

    rayjob, others = _rayjob()
    validator = _rayjob_validator(rayjob["apiVersion"])
    bad = copy.deepcopy(rayjob)
    group = bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")
    assert [e.message for e in validator.iter_errors(bad)] == ["Additional properties are not allowed ('replica' was unexpected)"]
    group["replica"] = "two"
    group["replicas"] = group.pop("replica")
    assert [e.message for e in validator.iter_errors(bad)] == ["'two' is not of type 'integer'"]

    template = copy.deepcopy(_templates(rayjob)["head"])
    resources = template["spec"]["containers"][0]["resources"]
    resources["limit"] = resources.pop("limits")
    with pytest.raises(kubernetes_validate.ValidationError, match="'limit' was unexpected"):
        k8s_validate(pod_template("head", template))
    (pvc,) = [d for d in others if d["kind"] == "PersistentVolumeClaim"]
    pvc["spec"]["accessModes"] = "ReadWriteMany"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'array'"):
        k8s_validate(pvc)
    assert cel_rules_reached(_served_schema(_crd(), rayjob["apiVersion"]),
                             {"spec": {"managedBy": "someone"}}) == [".spec.managedBy"]


def shared_mount() -> str:
    """Where the RayJob mounts its ReadWriteMany volume (the same path in every pod)."""
    rayjob, others = _rayjob()
    claims = {d["metadata"]["name"] for d in others if d["kind"] == "PersistentVolumeClaim"
              and "ReadWriteMany" in d["spec"]["accessModes"]}
    paths = set()
    for template in _templates(rayjob).values():
        volumes = {v["name"] for v in template["spec"]["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") in claims}
        paths |= {m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] in volumes}
    (path,) = paths
    return path


def _launch_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` (after ``python -m tessera.launch``) parsed as the launcher parses it."""
    from tessera.cli.train import add_arguments

    parser = argparse.ArgumentParser(prog="python -m tessera.launch")
    add_arguments(parser)
    return parser.parse_args(argv)


def _resolved(recipe_path: Path, overrides: list[str]):
    from tessera.config.load import load_recipe
    from tessera.flow import resolve

    return resolve(load_recipe(str(recipe_path), overrides))


def test_rayjob_runs_the_recipe_on_its_pods():
    """The entrypoint is ``python -m tessera.launch`` with arguments the launcher accepts, a
    recipe the image holds (under the Dockerfile's WORKDIR) whose values pass the recipe rules, an
    out_dir on the shared volume, and pp * dp = the GPUs of the worker pods, gpus_per_node each;
    every GPU container has /dev/shm in memory; the Ray version is the image's."""
    rayjob, _ = _rayjob()
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "tessera.launch"]
    args = _launch_args(argv[3:])
    workdir = dockerfile().workdir
    assert args.recipe.startswith(workdir + "/")
    resolved = _resolved(ROOT / args.recipe[len(workdir) + 1:], args.overrides)
    assert resolved.recipe.logging.out_dir.startswith(shared_mount() + "/")
    spec = rayjob["spec"]["rayClusterSpec"]
    gpus = 0
    for group in spec["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        per_pod = int(container["resources"]["limits"][GPU])
        assert per_pod == resolved.hardware.gpus_per_node and group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        shm = [v["name"] for v in group["template"]["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] in shm] == ["/dev/shm"]
        gpus += per_pod * group["replicas"]
    assert gpus == resolved.recipe.parallel.pp * resolved.recipe.parallel.dp
    assert spec["rayVersion"] == dockerfile().args["RAY_VERSION"]


@pytest.mark.parametrize("rel", CRDS)
def test_crd_is_the_recorded_upstream_file(rel):
    """The vendored CRD is a valid CustomResourceDefinition of RayJob, unchanged from the file
    ``SOURCE`` names (its git blob hash)."""
    crd = _crd(rel)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayJob"
    k8s_validate(crd)
    source = dict(line.split(": ", 1) for line in (CLUSTER / "schemas" / "SOURCE").read_text().splitlines())
    assert source["file"] == Path(rel).name and source["path"].endswith("/" + source["file"])
    assert source["repository"] == "https://github.com/ray-project/kuberay"
    data = (CLUSTER / rel).read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert source["blob"].split()[0] == blob
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"].split()[0])


# --------------------------------------------------------------------------- the image


class Dockerfile:
    """A Dockerfile read by dockerfile-parse: its instructions, its base image (ARG defaults
    applied), the ARGs declared after FROM and its WORKDIR."""

    def __init__(self, text: str):
        from dockerfile_parse import DockerfileParser

        parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
        self.instructions = [(s["instruction"], s["value"]) for s in parser.structure if s["instruction"] != "COMMENT"]
        self.baseimage = parser.baseimage
        self.args = parser.args
        self.workdir = ([v for i, v in self.instructions if i == "WORKDIR"] or [None])[-1]

    def problems(self) -> list[str]:
        """Unknown instructions, anything but ARG before FROM, COPY/ADD without a source in the
        checkout, a variable used after FROM that no ARG or ENV after FROM declares (shell
        variables of a RUN count too: this file uses none), an install line other than the
        README's, a base image whose tag is not the README's torch."""
        out = [f"unknown instruction {i}" for i, _ in self.instructions if i not in DOCKER_INSTRUCTIONS]
        names = [i for i, _ in self.instructions]
        if "FROM" not in names or set(names[:names.index("FROM")]) - {"ARG"}:
            out.append("the first instruction other than ARG is not FROM")
            return out
        declared: set[str] = set()
        for instruction, value in self.instructions[names.index("FROM") + 1:]:
            if instruction in ("ARG", "ENV"):
                declared |= set(re.findall(r"(?:^|\s)([A-Za-z_]\w*)=", value))
            used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", value)) - declared
            if used:
                out.append(f"{instruction} {value}: {sorted(used)} not declared after FROM")
            if instruction in ("COPY", "ADD"):
                words = [w for w in shlex.split(value) if not w.startswith("--")]
                if len(words) < 2 or not all((ROOT / w).exists() for w in words[:-1]):
                    out.append(f"{instruction} {value}: needs sources in the checkout and a destination")
        out += install_problems([v for i, v in self.instructions if i == "RUN"])
        (torch,) = [a for a in readme_install() if a.startswith("torch==")]
        if not self.baseimage.split(":")[-1].startswith(torch.split("==")[1] + "-"):
            out.append(f"base image {self.baseimage} is not a build of the README's {torch}")
        return out


@functools.lru_cache(maxsize=None)
def dockerfile() -> Dockerfile:
    return Dockerfile((CLUSTER / "Dockerfile").read_text())


def test_dockerfile():
    """The Dockerfile parses to known instructions in a valid order, installs the project with
    the README's line on a base image of the README's torch, and copies the project to the
    WORKDIR the RayJob's entrypoint names."""
    assert dockerfile().problems() == []
    assert ("COPY", f". {dockerfile().workdir}") in dockerfile().instructions


def test_dockerfile_check_refuses_broken_files():
    """A misspelt instruction, a Ray version declared only before FROM (out of scope after it), an
    install line or a base image off the README's pin: each is named."""
    text = (CLUSTER / "Dockerfile").read_text()
    (torch,) = [a for a in readme_install() if a.startswith("torch==")]
    assert Dockerfile(text.replace("\nENV ", "\nENVV ")).problems() == ["unknown instruction ENVV"]
    moved = text.replace("ARG RAY_VERSION=", "#").replace("FROM ${BASE_IMAGE}", "ARG RAY_VERSION=2.60.0\nFROM ${BASE_IMAGE}")
    assert any("['RAY_VERSION'] not declared after FROM" in p for p in Dockerfile(moved).problems())
    assert Dockerfile(text.replace(f"RUN pip install {torch}", "RUN pip install torch==2.0.0")).problems()[0].startswith(
        "project install [['torch==2.0.0'")
    base = dockerfile().baseimage
    assert Dockerfile(text.replace(base, base.replace(torch.split("==")[1], "2.0.0"))).problems() == [
        f"base image {base.replace(torch.split('==')[1], '2.0.0')} is not a build of the README's {torch}"]


def _ignore_patterns(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _docker_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match with ``**``, relative to the context root) as a
    regular expression over ``/``-separated paths."""
    p, out, i = pattern.strip("/"), "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(p[i], re.escape(p[i])), i + 1
    return re.compile(out + r"\Z")


def docker_excluded(path: str, patterns: list[str]) -> bool:
    """Whether ``docker build`` leaves ``path`` out of the context: a pattern matching the path or
    a directory above it excludes it, ``!`` takes it back, the last matching pattern wins."""
    parts, excluded = path.split("/"), False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = _docker_pattern(pattern[1:] if negate else pattern)
        if any(rx.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def ignore_examples(pattern: str) -> list[str]:
    """Paths a .gitignore-style pattern leaves out: what it names at the root and, when the
    pattern is not anchored (no ``/`` but a trailing one), the same one directory down."""
    is_dir = pattern.endswith("/")
    body = pattern.rstrip("/")
    anchored = "/" in body
    leaf = re.sub(r"\*+|\?", "x", body.lstrip("/")) + ("/f" if is_dir else "")
    return [leaf] if anchored else [leaf, "sub/" + leaf]


def uncovered(docker_patterns: list[str]) -> list[str]:
    """The .gitignore and .rayignore patterns (and .git) whose paths the dockerignore lets in."""
    wanted = dict.fromkeys(["/.git/"] + _ignore_patterns(ROOT / ".gitignore") + _ignore_patterns(ROOT / ".rayignore"))
    return [p for p in wanted if not all(docker_excluded(e, docker_patterns) for e in ignore_examples(p))]


def test_dockerignore_leaves_out_what_git_and_ray_jobs_leave_out():
    """The image's build context is the checkout less what .gitignore and .rayignore name (venvs,
    run outputs, caches, weights) and the history; a pattern dropped is named."""
    patterns = _ignore_patterns(CLUSTER / "Dockerfile.dockerignore")
    assert uncovered(patterns) == []
    assert not docker_excluded("tessera/launch.py", patterns) and not docker_excluded("recipes", patterns)
    assert uncovered([p for p in patterns if p != "out"]) == ["/out/"]


# --------------------------------------------------------------------------- across the files


def test_every_file_names_one_ray_version():
    """The launcher configs' pins, the Dockerfile's RAY_VERSION (used by its install) and the
    RayJob's rayVersion are one version."""
    versions = {rel: ray_pins((CLUSTER / rel).read_text()) for rel in RAY_CONFIGS}
    assert all(len(v) == 1 for v in versions.values()), versions
    assert any("ray[train,default]==${RAY_VERSION}" in v for i, v in dockerfile().instructions if i == "RUN")
    rayjob, _ = _rayjob()
    found = set().union(*versions.values()) | {dockerfile().args["RAY_VERSION"], rayjob["spec"]["rayClusterSpec"]["rayVersion"]}
    assert len(found) == 1, found


def test_readme_commands_match_the_files():
    """cluster/README.md names every config, image and manifest here; its `ray job submit` lines run
    `python -m tessera.launch` with arguments the launcher accepts, a recipe of this checkout, an
    out_dir on the shared mount and no more GPUs than each launcher config's workers have; its
    KubeRay entrypoint is the RayJob's."""
    text = (CLUSTER / "README.md").read_text()
    named = set(re.findall(r"cluster/([\w./-]+\w)", text))
    assert {f for f in FILES if kind_of(f) in ("ray-cluster", "kubernetes", "dockerfile")} <= named
    assert all((CLUSTER / n).exists() for n in named), named - set(FILES)
    submits = [x for x in text.splitlines() if "ray job submit" in x and " -- " in x]
    assert submits
    for line in submits:
        argv = shlex.split(line.split(" -- ", 1)[1])
        assert argv[:3] == ["python", "-m", "tessera.launch"]
        args = _launch_args(argv[3:])
        resolved = _resolved(ROOT / args.recipe, args.overrides)
        assert resolved.recipe.logging.out_dir.startswith(shared_mount() + "/")
        need = resolved.recipe.parallel.pp * resolved.recipe.parallel.dp
        for rel in RAY_CONFIGS:  # the on-premise provider detects its nodes' GPUs: nothing to compare
            config = _load(rel)
            workers = [t for n, t in config.get("available_node_types", {}).items() if n != config["head_node_type"]]
            for node_type in workers:
                assert node_type["resources"]["GPU"] == resolved.hardware.gpus_per_node
                assert node_type["resources"]["GPU"] * node_type["max_workers"] >= need, rel
    rayjob, _ = _rayjob()
    assert rayjob["spec"]["entrypoint"] in text
