"""Deployment files: Dockerfile, .dockerignore, KubeRay manifests, MLflow server, `ray up` config.

There is no Docker engine and no Kubernetes cluster here, so these tests check statically what would make
a build, an `kubectl apply` or a run go wrong: an unpinned base image, a root container, files missing from
the build context, KubeRay fields the operator rejects, mounts without volumes, images or Ray versions that
differ between nodes, a RayJob whose config does not exist or does not fit its GPUs, an MLflow server that
refuses its own clients' Host header. Each checker returns a list of problems; every test also runs the
checker on a broken copy, so each check is shown to be able to fail.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from dmltrain.service.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S_DIR = REPO / "cluster" / "kubernetes"
RAY_UP = REPO / "cluster" / "ray-up-aws.yaml"
IMAGE_HOME = "/home/ray"  # the image's WORKDIR: relative paths in entrypoints resolve against it

Doc = dict[str, Any]

# ----------------------------------------------------------------------------------------------------------
# Dockerfile
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comment lines dropped (as Docker's parser does)."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        joined = " ".join(p for p in parts if p)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    if parts:
        joined = " ".join(parts)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
    return instructions


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """``registry:port/name:tag@sha256:...`` -> (name, tag, digest)."""
    name, _, digest = ref.partition("@")
    tag = None
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest or None


def image_pin_problem(ref: str) -> str | None:
    """An image must name an exact release (x.y.z in the tag) or a digest; `latest` and `2.14` move."""
    _, tag, digest = split_image(ref)
    if digest:
        return None if re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else f"{ref}: malformed digest"
    if tag is None:
        return f"{ref}: no tag (means :latest)"
    if tag == "latest" or not re.search(r"\d+\.\d+\.\d+", tag):
        return f"{ref}: tag {tag!r} is not an exact version"
    return None


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            key, value = ins.args.split("=", 1)
            defaults[key.strip()] = value.strip().strip("\"'")
    return defaults


def _env(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in (i for i in instructions if i.keyword == "ENV"):
        tokens = shlex.split(ins.args)
        if tokens and "=" not in tokens[0]:
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for token in tokens:
            key, _, value = token.partition("=")
            env[key] = value
    return env


def _exec_form(args: str) -> list[str]:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return shlex.split(args)
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def copied_sources(instructions: list[Instruction]) -> list[tuple[str, str]]:
    """(source, destination) of every COPY/ADD from the build context."""
    pairs: list[tuple[str, str]] = []
    for ins in instructions:
        if ins.keyword not in {"COPY", "ADD"}:
            continue
        if any(t.startswith("--from") for t in shlex.split(ins.args)):
            continue  # copies from another build stage, not from the context
        tokens = [t for t in _exec_form(ins.args) if not t.startswith("--")]
        *sources, dest = tokens
        pairs.extend((src, dest) for src in sources)
    return pairs


def check_dockerfile(text: str) -> list[str]:
    """Problems with the image recipe: pinning, user, install, what Ray and KubeRay expect inside."""
    instructions = parse_dockerfile(text)
    problems: list[str] = []
    args = _arg_defaults(instructions)
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        return ["no FROM instruction"]
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), froms[-1].args.split()[0])
    if (pin := image_pin_problem(base)) is not None:
        problems.append(f"base image not pinned: {pin}")
    if "cuda" not in (split_image(base)[1] or ""):
        problems.append(f"base image {base} is not a CUDA build")

    users = [i for i in instructions if i.keyword == "USER"]
    final_user = users[-1].args if users else "root"
    if final_user.split(":")[0] not in {"1000", "ray"}:
        problems.append(f"final USER is {final_user!r}, not the non-root user ray (uid 1000)")
    runs = " ; ".join(i.args for i in instructions if i.keyword == "RUN")
    if not re.search(r"useradd\b[^;&|]*(?:--uid|-u)\s+1000\b[^;&|]*\sray\s*(?:;|&&|$)", runs):
        problems.append("no RUN creates the user `ray` with uid 1000")

    installs = re.findall(r"pip\s+install\b[^;&|]*?[\"']?\.\[([\w,\s-]*)\]", runs)
    extras = {e.strip() for group in installs for e in group.split(",")}
    if "gpu" not in extras:
        problems.append("dmltrain is not installed with the gpu extra (pip install '.[gpu]')")
    if "cpu" in extras:
        problems.append("the cpu extra (faiss-cpu) is installed next to faiss-gpu; they clash")
    apt = " ".join(re.findall(r"apt-get\s+install\b([^;&|]*)", runs)).split()
    for package, why in {
        "bash": "Ray runs its commands with bash",
        "wget": "KubeRay's default probes call wget",
        "rsync": "`ray up` syncs files with rsync",
        "openssh-client": "the `ray up` autoscaler reaches workers over SSH",
    }.items():
        if package not in apt:
            problems.append(f"apt package {package} missing ({why})")
    if "RAY_VERSION" not in args or not re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"]):
        problems.append("ARG RAY_VERSION=x.y.z missing: Ray must be pinned to the clusters' rayVersion")

    workdirs = [i.args for i in instructions if i.keyword == "WORKDIR"]
    if not workdirs or workdirs[-1].rstrip("/") != IMAGE_HOME:
        problems.append(f"final WORKDIR is {workdirs[-1:]} instead of {IMAGE_HOME}")
    if _env(instructions).get("HOME") != IMAGE_HOME:
        problems.append(f"ENV HOME={IMAGE_HOME} missing (the `ray up` launcher reads HOME from the image)")
    if any(i.keyword == "ENTRYPOINT" for i in instructions):
        problems.append("ENTRYPOINT set: KubeRay and `ray up` must be able to run their own commands")
    cmds = [i.args for i in instructions if i.keyword == "CMD"]
    if not cmds or _exec_form(cmds[-1]) not in (["bash"], ["/bin/bash"]):
        problems.append(f"default CMD is {cmds[-1:]}, not bash")
    if not any(
        src.rstrip("/") == "configs" and dest.rstrip("/") == f"{IMAGE_HOME}/configs"
        for src, dest in copied_sources(instructions)
    ):
        problems.append(f"configs/ is not copied to {IMAGE_HOME}/configs")
    return problems


# ----------------------------------------------------------------------------------------------------------
# .dockerignore (Docker's rules: Go path.Match globs plus **, a match also covers everything below it, the
# last matching line wins, `!` re-includes)
# ----------------------------------------------------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
            continue
        if pattern.startswith("**", i):
            out, i = out + ".*", i + 2
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[" and (end := pattern.find("]", i + 1)) > 0:
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body[:1] in "^!" and body else body) + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_matcher(text: str) -> Callable[[str], bool]:
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, _glob_regex(pattern)))

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for negate, regex in rules:
            if any(regex.match(p) for p in prefixes):
                result = not negate
        return result

    return ignored


MUST_STAY_OUT = (
    ".git/HEAD",
    ".venv/bin/python",
    "venv/bin/python",
    ".ci/venv/bin/python",
    "data/shards/train-000000.tar",
    "mlflow.db",
    "mlruns/0/meta.yaml",
    "mlartifacts/1/model.pt",
    "ray_results/run/checkpoint",
    "dmltrain/__pycache__/engine.cpython-311.pyc",
)


def check_dockerignore(ignore_text: str, dockerfile_text: str, repo: Path) -> list[str]:
    """Local state must stay out of the build context; everything the Dockerfile copies must get in."""
    ignored = dockerignore_matcher(ignore_text)
    problems = [f"{p} would be sent to the Docker build context" for p in MUST_STAY_OUT if not ignored(p)]
    for src, _ in copied_sources(parse_dockerfile(dockerfile_text)):
        path = repo / src
        if not path.exists():
            problems.append(f"COPY source {src} does not exist in the repository")
            continue
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        wanted = [f.relative_to(repo).as_posix() for f in files if "__pycache__" not in f.parts]
        problems.extend(
            f"{f} is copied by the Dockerfile but excluded by .dockerignore" for f in wanted if ignored(f)
        )
    return problems


# ----------------------------------------------------------------------------------------------------------
# Kubernetes manifests
# ----------------------------------------------------------------------------------------------------------

DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
API_VERSIONS = {
    "Namespace": "v1",
    "PersistentVolumeClaim": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "RayCluster": "ray.io/v1",
    "RayJob": "ray.io/v1",
    "Job": "batch/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
}


def load_manifests(directory: Path) -> list[Doc]:
    docs: list[Doc] = []
    for file in sorted(directory.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(file.read_text()) if d is not None)
    return docs


def _name(doc: Doc) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def _find(docs: list[Doc], kind: str, name: str | None = None) -> Doc | None:
    for doc in docs:
        if doc.get("kind") == kind and (name is None or doc["metadata"].get("name") == name):
            return doc
    return None


def parse_cpu(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ray_cluster_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for doc in docs:
        if doc.get("kind") == "RayCluster":
            yield _name(doc), doc.get("spec") or {}
        elif doc.get("kind") == "RayJob":
            yield _name(doc) + " rayClusterSpec", (doc.get("spec") or {}).get("rayClusterSpec") or {}


def _groups(spec: Doc) -> list[tuple[str, Doc]]:
    head = spec.get("headGroupSpec") or {}
    workers = spec.get("workerGroupSpecs") or []
    return [("head", head)] + [(f"worker group {g.get('groupName')!r}", g) for g in workers]


def _pod(group: Doc) -> Doc:
    return ((group.get("template") or {}).get("spec")) or {}


def _check_env(where: str, container: Doc, docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    env = {e.get("name"): e for e in container.get("env") or []}
    for item in env.values():
        if "value" in item and not isinstance(item["value"], str):
            problems.append(f"{where}: env {item['name']} value must be a string, got {item['value']!r}")
    if (env.get("RAY_USAGE_STATS_ENABLED") or {}).get("value") != "0":
        problems.append(f'{where}: RAY_USAGE_STATS_ENABLED is not set to "0"')
    source = (env.get("MLFLOW_TRACKING_URI") or {}).get("valueFrom") or {}
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        config_map = _find(docs, "ConfigMap", ref.get("name"))
        if config_map is None or ref.get("key") not in (config_map.get("data") or {}):
            problems.append(f"{where}: MLFLOW_TRACKING_URI refers to missing ConfigMap key {ref}")
    elif "secretKeyRef" not in source:
        problems.append(f"{where}: MLFLOW_TRACKING_URI must come from a Secret or ConfigMap (valueFrom)")
    return problems


def _check_volumes(where: str, pod: Doc, docs: list[Doc]) -> tuple[list[str], dict[str, str]]:
    """Problems, and the mount path of each ReadWriteMany claim mounted by the first container."""
    problems: list[str] = []
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    shared: dict[str, str] = {}
    for container in pod.get("containers") or []:
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount.get("name"))
            if volume is None:
                problems.append(f"{where}: volumeMount {mount.get('name')!r} has no volume of that name")
                continue
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is None:
                continue
            pvc = _find(docs, "PersistentVolumeClaim", claim)
            if pvc is None:
                problems.append(
                    f"{where}: volume {volume['name']!r} uses PVC {claim!r}, not in the manifests"
                )
            elif "ReadWriteMany" not in (pvc.get("spec") or {}).get("accessModes", []):
                problems.append(f"{where}: PVC {claim} is not ReadWriteMany; pods on several nodes share it")
            else:
                shared[claim] = mount.get("mountPath", "")
    return problems, shared


def check_ray_cluster_spec(where: str, spec: Doc, docs: list[Doc], ray_version: str) -> list[str]:
    """The RayCluster fields KubeRay requires or validates, plus what a dmltrain run needs on every pod."""
    problems: list[str] = []
    if str(spec.get("rayVersion")) != ray_version:
        problems.append(f"{where}: rayVersion {spec.get('rayVersion')!r} != image's Ray {ray_version}")
    if not spec.get("workerGroupSpecs"):
        problems.append(f"{where}: no workerGroupSpecs")
    names = [g.get("groupName") for g in spec.get("workerGroupSpecs") or []]
    if len(set(names)) != len(names):
        problems.append(f"{where}: duplicate worker groupName in {names}")
    gpus_total = 0
    mounts: dict[str, set[str]] = {}
    for label, group in _groups(spec):
        at = f"{where} {label}"
        if not isinstance(group, dict) or not group:
            problems.append(f"{at}: missing")
            continue
        params = group.get("rayStartParams")
        if not isinstance(params, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in params.items()
        ):
            problems.append(f"{at}: rayStartParams must be a map of strings, got {params!r}")
        containers = _pod(group).get("containers") or []
        if not containers or not containers[0].get("image"):
            problems.append(f"{at}: no container with an image")
            continue
        if label != "head":
            if not isinstance(group.get("groupName"), str) or not group["groupName"]:
                problems.append(f"{at}: groupName missing")
            counts = [group.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
            if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
                problems.append(f"{at}: minReplicas/replicas/maxReplicas must be integers, got {counts}")
            elif not 0 <= counts[0] <= counts[1] <= counts[2]:
                problems.append(f"{at}: replicas {counts[1]} not within [{counts[0]}, {counts[2]}]")
            resources = containers[0].get("resources") or {}
            limit = (resources.get("limits") or {}).get("nvidia.com/gpu")
            request = (resources.get("requests") or {}).get("nvidia.com/gpu")
            if request is not None and str(request) != str(limit):
                problems.append(f"{at}: nvidia.com/gpu request {request} != limit {limit}")
            if limit is not None and isinstance(group.get("replicas"), int):
                gpus_total += int(limit) * group["replicas"]
        problems.extend(_check_env(f"{at} container {containers[0].get('name')}", containers[0], docs))
        volume_problems, shared = _check_volumes(at, _pod(group), docs)
        problems.extend(volume_problems)
        for claim, path in shared.items():
            mounts.setdefault(claim, set()).add(path)
        if not shared:
            problems.append(f"{at}: mounts no ReadWriteMany volume for checkpoints and shards")
    if gpus_total <= 0:
        problems.append(f"{where}: no worker group has an nvidia.com/gpu limit")
    for claim, paths in mounts.items():
        if len(paths) > 1:
            problems.append(f"{where}: PVC {claim} is mounted at different paths {sorted(paths)}")
    return problems


def cluster_images(docs: list[Doc]) -> dict[str, str]:
    """Where -> image, for every container that runs dmltrain code (Ray pods and the job submitter)."""
    images: dict[str, str] = {}
    for where, spec in ray_cluster_specs(docs):
        for label, group in _groups(spec):
            for container in _pod(group).get("containers") or []:
                images[f"{where} {label} {container.get('name')}"] = container.get("image", "")
    for doc in docs:
        if doc.get("kind") == "RayJob":
            template = ((doc.get("spec") or {}).get("submitterPodTemplate") or {}).get("spec") or {}
            for container in template.get("containers") or []:
                images[f"{_name(doc)} submitter {container.get('name')}"] = container.get("image", "")
    search = _find(docs, "Deployment", SEARCH)
    if search is not None:
        for container in search["spec"]["template"]["spec"].get("containers") or []:
            images[f"{_name(search)} {container.get('name')}"] = container.get("image", "")
    return images


def check_images(images: dict[str, str], project_version: str) -> list[str]:
    """One pinned image, of this release, on every node: Ray refuses mixed versions, code must match."""
    problems = [f"{where}: {pin}" for where, ref in images.items() if (pin := image_pin_problem(ref))]
    distinct = sorted(set(images.values()))
    if len(distinct) != 1:
        problems.append(f"Ray nodes run different images {distinct}: every node needs the same code and Ray")
    for ref in distinct:
        if split_image(ref)[1] != project_version:
            problems.append(f"image {ref} is not tagged with the project version {project_version}")
    return problems


@dataclass(frozen=True)
class Entrypoint:
    config: str
    overrides: list[str]


def parse_entrypoint(command: str) -> Entrypoint:
    tokens = shlex.split(command)
    if len(tokens) < 4 or tokens[1:3] != ["-m", "dmltrain.run"] or not tokens[0].startswith("python"):
        raise ValueError(f"entrypoint {command!r} is not `python -m dmltrain.run CONFIG [key=value ...]`")
    return Entrypoint(tokens[3], tokens[4:])


def worker_slots(gpus: int, cpus: float, cpus_per_worker: float) -> int:
    """GPU training workers one node can host: each takes 1 GPU and cpus_per_worker CPUs."""
    return min(gpus, math.floor(cpus / cpus_per_worker + 1e-9))


def check_rayjob(job: Doc, docs: list[Doc], repo: Path) -> list[str]:
    """The job's config exists and validates, resumes on resubmission, and fits the cluster it creates."""
    where = _name(job)
    spec = job.get("spec") or {}
    problems: list[str] = []
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append(f"{where}: shutdownAfterJobFinishes is not true (the GPUs would stay allocated)")
    ttl = spec.get("ttlSecondsAfterFinished")
    if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 0:
        problems.append(f"{where}: ttlSecondsAfterFinished must be a non-negative integer, got {ttl!r}")
    try:
        entry = parse_entrypoint(str(spec.get("entrypoint", "")))
    except ValueError as error:
        return [*problems, f"{where}: {error}"]
    config_path = (repo / entry.config).resolve()
    if not entry.config.startswith("configs/") or not config_path.is_file():
        return [
            *problems,
            f"{where}: entrypoint config {entry.config} does not exist in {repo / 'configs'} "
            f"(the image copies configs/ to {IMAGE_HOME}/configs)",
        ]
    keys = {o.split("=", 1)[0] for o in entry.overrides}
    for pinned in ("run.name", "run.storage_path"):
        if pinned not in keys:
            problems.append(f"{where}: entrypoint does not pin {pinned}, so a resubmission would not resume")
    try:
        config = load_config(config_path, entry.overrides)
    except ConfigError as error:
        return [*problems, f"{where}: {error}"]

    cluster = spec.get("rayClusterSpec") or {}
    shared_paths = {
        mount.get("mountPath", "")
        for _, group in _groups(cluster)
        for container in _pod(group).get("containers") or []
        for mount in container.get("volumeMounts") or []
        if mount.get("name")
        in {v["name"] for v in _pod(group).get("volumes") or [] if "persistentVolumeClaim" in v}
    }
    for key, value in (("run.storage_path", config.run.storage_path), ("data.root", config.data.root)):
        if not any(value.startswith(p.rstrip("/") + "/") for p in shared_paths if p):
            problems.append(f"{where}: {key}={value} is not on the shared volume {sorted(shared_paths)}")
    if config.scaling.use_gpu is False:
        problems.append(f"{where}: the config trains on CPU (scaling.use_gpu=false) on a GPU cluster")
    slots = 0
    for label, group in _groups(cluster):
        if label == "head":
            continue
        limits = ((_pod(group).get("containers") or [{}])[0].get("resources") or {}).get("limits") or {}
        per_pod = worker_slots(
            int(limits.get("nvidia.com/gpu", 0)),
            parse_cpu(limits.get("cpu", 0)),
            config.scaling.cpus_per_worker,
        )
        slots += per_pod * int(group.get("replicas") or 0)
    if slots < config.scaling.num_workers:
        problems.append(
            f"{where}: scaling.num_workers={config.scaling.num_workers} with "
            f"{config.scaling.cpus_per_worker} CPUs + 1 GPU each, but the worker pods fit {slots}"
        )
    return problems


def _arg_value(args: list[str], flag: str) -> str | None:
    """The value a click CLI sees for ``flag``: the last occurrence wins."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


# MLflow's default when --allowed-hosts is not given: loopback names and private IP ranges, so a Service
# DNS name such as mlflow.<namespace>.svc.cluster.local is refused.
MLFLOW_DEFAULT_ALLOWED_HOSTS = [
    "localhost",
    "127.0.0.1",
    "localhost:*",
    "127.0.0.1:*",
    "10.*",
    "192.168.*",
    *(f"172.{n}.*" for n in range(16, 32)),
]


def host_allowed(allowed: list[str], host: str) -> bool:
    """MLflow's Host check (mlflow.server.security_utils.is_allowed_host_header): glob if it has `*`."""
    return "*" in allowed or any(
        fnmatch.fnmatch(host, pattern) if "*" in pattern else host == pattern for pattern in allowed
    )


def _selector_problems(deployment: Doc, service: Doc, pods: str) -> list[str]:
    """A Deployment whose selector picks its own pods, and a Service of the same name that reaches them."""
    name = deployment["metadata"]["name"]
    labels = (deployment["spec"]["template"].get("metadata") or {}).get("labels") or {}
    selector = deployment["spec"].get("selector", {}).get("matchLabels") or {}
    problems = []
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        problems.append(f"Deployment/{name} selector {selector} does not match its pod labels {labels}")
    if any(labels.get(k) != v for k, v in (service["spec"].get("selector") or {}).items()):
        problems.append(f"Service/{name} selector {service['spec'].get('selector')} matches no {pods}")
    return problems


def check_mlflow(docs: list[Doc]) -> list[str]:
    """The server keeps secrets in Secrets, artifacts in an object store, and accepts its own clients."""
    problems: list[str] = []
    deployment = _find(docs, "Deployment", "mlflow")
    service = _find(docs, "Service", "mlflow")
    if deployment is None or service is None:
        return ["MLflow Deployment and Service named mlflow are missing"]
    template = deployment["spec"]["template"]
    problems.extend(_selector_problems(deployment, service, "MLflow pod"))
    container = template["spec"]["containers"][0]
    args = [str(a) for a in container.get("command", []) + container.get("args", [])]
    destination = _arg_value(args, "--artifacts-destination") or ""
    if not re.match(r"(s3|gs|wasbs|abfss)://", destination):
        problems.append(f"MLflow --artifacts-destination {destination!r} is not an object store URI")
    if _arg_value(args, "--backend-store-uri") is not None:
        problems.append("MLflow --backend-store-uri is in the args: the database password would be visible")
    env = {e["name"]: e for e in container.get("env") or []}
    if "secretKeyRef" not in ((env.get("MLFLOW_BACKEND_STORE_URI") or {}).get("valueFrom") or {}):
        problems.append("MLFLOW_BACKEND_STORE_URI (database URI) does not come from a Secret")
    port_names = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    for port in service["spec"].get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        if target not in port_names and target not in port_names.values():
            problems.append(f"Service/mlflow targetPort {target!r} is not a port of the MLflow container")
    probe = ((container.get("readinessProbe") or {}).get("httpGet") or {}).get("path")
    if probe != "/health":
        problems.append(f"MLflow readinessProbe path is {probe!r}, not /health")

    config_map = _find(docs, "ConfigMap", "dmltrain-mlflow") or {}
    uri = (config_map.get("data") or {}).get("MLFLOW_TRACKING_URI", "")
    url = urlsplit(uri)
    host_parts = (url.hostname or "").split(".")
    namespace = service["metadata"].get("namespace", "default")
    if host_parts[:1] != ["mlflow"] or (len(host_parts) > 1 and host_parts[1] != namespace):
        problems.append(f"MLFLOW_TRACKING_URI {uri!r} does not name Service mlflow in namespace {namespace}")
    if url.port not in {p.get("port") for p in service["spec"].get("ports") or []}:
        problems.append(f"MLFLOW_TRACKING_URI {uri!r} uses a port the Service does not expose")
    allowed = [h.strip() for h in (_arg_value(args, "--allowed-hosts") or "").split(",") if h.strip()]
    allowed = allowed or MLFLOW_DEFAULT_ALLOWED_HOSTS
    for host in (url.netloc, "localhost:5000", "127.0.0.1:5000"):
        if not host_allowed(allowed, host):
            problems.append(f"MLflow --allowed-hosts rejects Host {host!r}; its clients would get 403")
    return problems


SEARCH = "dmltrain-search"


def check_search(docs: list[Doc]) -> list[str]:
    """The search service runs `dmltrain serve` as dmltrain's own parser reads it, on an index in MLflow,
    reachable through its Service, probed where MLflow's server answers, and admitted to MLflow."""
    from dmltrain.service.cli import parse_args

    deployment, service = _find(docs, "Deployment", SEARCH), _find(docs, "Service", SEARCH)
    if deployment is None or service is None:
        return [f"Deployment and Service named {SEARCH} are missing"]
    problems = _selector_problems(deployment, service, "search pod")
    template = deployment["spec"]["template"]
    labels = (template.get("metadata") or {}).get("labels") or {}
    policy = _find(docs, "NetworkPolicy", "mlflow-clients") or {}
    admitted = [
        (source.get("podSelector") or {}).get("matchLabels") or {}
        for rule in (policy.get("spec") or {}).get("ingress") or []
        for source in rule.get("from") or []
    ]
    if not any(all(labels.get(k) == v for k, v in wanted.items()) for wanted in admitted):
        problems.append(f"the search pod's labels {labels} are not admitted to MLflow by mlflow-clients")
    pod = template["spec"]
    container = (pod.get("containers") or [{}])[0]
    command = [str(a) for a in container.get("command", []) + container.get("args", [])]
    if command[:2] != ["dmltrain", "serve"]:
        return [*problems, f"{SEARCH} runs {command[:2]}, not `dmltrain serve`"]
    try:
        args = parse_args(command[1:])
    except SystemExit:
        return [*problems, f"{SEARCH}: `dmltrain serve` refuses the arguments {command[2:]}"]
    if not args.index.startswith(("runs:/", "models:/")):
        problems.append(f"{SEARCH} serves {args.index!r}: the pod has no local index; give runs:/...")
    if args.host != "0.0.0.0":
        problems.append(f"{SEARCH} listens on --host {args.host}: the Service cannot reach it")
    ports = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    if args.port not in ports.values():
        problems.append(f"{SEARCH} serves on --port {args.port}, not a containerPort {ports}")
    for port in service["spec"].get("ports") or []:
        target = port.get("targetPort", port.get("port"))
        if ports.get(target, target) != args.port:
            problems.append(f"Service/{SEARCH} targetPort {target!r} is not the port the server listens on")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = (container.get(probe) or {}).get("httpGet") or {}
        if (
            get.get("path") not in {"/ping", "/health"}
            or ports.get(get.get("port"), get.get("port")) != args.port
        ):
            problems.append(f"{SEARCH} {probe} {get} is not MLflow's /ping or /health on the server's port")
    env = {e.get("name"): e for e in container.get("env") or []}
    source = ((env.get("MLFLOW_TRACKING_URI") or {}).get("valueFrom") or {}).get("configMapKeyRef") or {}
    config_map = _find(docs, "ConfigMap", source.get("name"))
    if config_map is None or source.get("key") not in (config_map.get("data") or {}):
        problems.append(f"{SEARCH}: MLFLOW_TRACKING_URI does not come from the MLflow ConfigMap")
    scratch = (env.get("TMPDIR") or {}).get("value")
    mounts = {m.get("mountPath") for m in container.get("volumeMounts") or []}
    if scratch not in mounts:
        problems.append(f"{SEARCH}: TMPDIR {scratch!r} (the model and index copies) is not a mounted volume")
    return problems


def check_manifests(docs: list[Doc], repo: Path, ray_version: str, project_version: str) -> list[str]:
    """Every check of cluster/kubernetes/ at once."""
    problems: list[str] = []
    namespaces: set[str | None] = set()
    for doc in docs:
        kind, metadata = doc.get("kind"), doc.get("metadata") or {}
        if not kind or not doc.get("apiVersion") or not metadata.get("name"):
            problems.append(f"{_name(doc)}: apiVersion, kind and metadata.name are required")
            continue
        if kind in API_VERSIONS and doc["apiVersion"] != API_VERSIONS[kind]:
            problems.append(f"{_name(doc)}: apiVersion {doc['apiVersion']} (want {API_VERSIONS[kind]})")
        if kind == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"{_name(doc)}: secret values are committed to git")
        if kind in {"RayCluster", "RayJob"} and not DNS1035.fullmatch(metadata["name"]):
            problems.append(f"{_name(doc)}: name is not a DNS-1035 label (KubeRay rejects it)")
        if kind != "Namespace":
            namespaces.add(metadata.get("namespace"))
    if len(namespaces) != 1 or None in namespaces:
        problems.append(f"manifests spread over namespaces {namespaces}: Service DNS names would not resolve")
    kinds = {doc.get("kind") for doc in docs}
    for expected in ("RayCluster", "RayJob", "PersistentVolumeClaim", "Deployment", "Service"):
        if expected not in kinds:
            problems.append(f"no {expected} in the manifests")
    for where, spec in ray_cluster_specs(docs):
        problems.extend(check_ray_cluster_spec(where, spec, docs, ray_version))
    problems.extend(check_images(cluster_images(docs), project_version))
    for job in (d for d in docs if d.get("kind") == "RayJob"):
        problems.extend(check_rayjob(job, docs, repo))
    problems.extend(check_mlflow(docs))
    problems.extend(check_search(docs))
    return problems


# ----------------------------------------------------------------------------------------------------------
# `ray up` config
# ----------------------------------------------------------------------------------------------------------


def ray_schema() -> Doc:
    """The schema `ray up` validates against, from the installed ray package (no import of ray needed)."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.submodule_search_locations, "ray is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


def check_ray_up(config: Doc, image: str, num_workers: int, cpus_per_worker: float) -> list[str]:
    """Ray's own schema, then the image and the GPU capacity the run needs."""
    problems = [
        f"schema: {e.message} at {'/'.join(map(str, e.absolute_path)) or '<root>'}"
        for e in jsonschema.Draft7Validator(ray_schema()).iter_errors(config)
    ]
    if problems:
        return problems
    docker = config.get("docker") or {}
    if docker.get("image") != image:
        problems.append(f"ray up docker.image {docker.get('image')!r} != the cluster image {image!r}")
    types = config.get("available_node_types") or {}
    if config.get("head_node_type") not in types:
        problems.append(f"head_node_type {config.get('head_node_type')!r} is not an available node type")
    # The autoscaler launches at most max_workers VMs in all; count the roomiest node types first.
    capacity = sorted(
        (
            worker_slots(
                int(t["resources"].get("GPU", 0)), float(t["resources"].get("CPU", 0)), cpus_per_worker
            ),
            int(t.get("max_workers", 0)),
        )
        for name, t in types.items()
        if name != config.get("head_node_type")
    )
    slots, nodes_left = 0, int(config.get("max_workers", 0))
    for per_node, type_max in reversed(capacity):
        nodes = min(type_max, nodes_left)
        slots, nodes_left = slots + per_node * nodes, nodes_left - nodes
    if slots < num_workers:
        problems.append(
            f"ray up worker types fit {slots} GPU training workers, the config asks {num_workers}"
        )
    return problems


# ----------------------------------------------------------------------------------------------------------
# Fixtures and tests
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def ray_version(dockerfile_text: str) -> str:
    return _arg_defaults(parse_dockerfile(dockerfile_text)).get("RAY_VERSION", "")


@pytest.fixture(scope="module")
def project_version() -> str:
    return importlib.metadata.version("dmltrain")


@pytest.fixture()
def docs() -> list[Doc]:
    return load_manifests(K8S_DIR)


def _mutate(text: str, old: str, new: str) -> str:
    assert old in text, f"mutation anchor {old!r} not found; update the test with the file"
    return text.replace(old, new)


def test_dockerfile_is_pinned_non_root_and_installs_the_gpu_extra(dockerfile_text: str) -> None:
    assert check_dockerfile(dockerfile_text) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (":2.14.1-cuda12.6-cudnn9-runtime", ":latest", "base image not pinned"),
        (":2.14.1-cuda12.6-cudnn9-runtime", ":2.14-cuda12.6-cudnn9-runtime", "not an exact version"),
        (":2.14.1-cuda12.6-cudnn9-runtime", "", "no tag"),
        ("USER 1000:1000", "USER root", "final USER"),
        ('".[gpu,s3,timm,openclip]"', '".[cpu,s3,timm,openclip]"', "gpu extra"),
        ("--uid 1000", "--uid 1001", "uid 1000"),
        ("WORKDIR /home/ray", "WORKDIR /workspace", "WORKDIR"),
        ("HOME=/home/ray", "HOME=/root", "ENV HOME"),
        ('CMD ["bash"]', 'ENTRYPOINT ["python"]', "ENTRYPOINT"),
        (" wget", "", "wget"),
        ("/home/ray/configs", "/opt/configs", "configs/"),
        ("ARG RAY_VERSION=2.60.0", "ARG RAY_VERSION", "RAY_VERSION"),
    ],
)
def test_dockerfile_checker_catches(dockerfile_text: str, old: str, new: str, expected: str) -> None:
    problems = check_dockerfile(_mutate(dockerfile_text, old, new))
    assert any(expected in p for p in problems), problems


def test_dockerfile_parser_joins_continuations_and_skips_comments() -> None:
    text = "# syntax=docker/dockerfile:1\nFROM a:1.2.3\nRUN echo a \\\n    # inner comment\n    && echo b\n"
    assert parse_dockerfile(text) == [
        Instruction("FROM", "a:1.2.3", 2),
        Instruction("RUN", "echo a && echo b", 3),
    ]
    assert image_pin_problem("registry:5000/team/img:1.2.3") is None
    assert image_pin_problem("img@sha256:" + "0" * 64) is None
    assert "not an exact version" in (image_pin_problem("registry:5000/img:nightly") or "")


def test_dockerignore_keeps_local_state_out_and_lets_the_sources_in(dockerfile_text: str) -> None:
    assert check_dockerignore(DOCKERIGNORE.read_text(), dockerfile_text, REPO) == []


def test_dockerignore_checker_catches_leaks_and_missing_sources(dockerfile_text: str) -> None:
    ignore = DOCKERIGNORE.read_text()
    leaky = "\n".join(line for line in ignore.splitlines() if line.strip() != "*") + "\n"
    problems = check_dockerignore(leaky, dockerfile_text, REPO)
    assert any(".venv/bin/python" in p for p in problems) and any("mlflow.db" in p for p in problems)
    assert any(".git/HEAD" in p for p in problems), problems
    blocking = check_dockerignore(ignore + "configs\n", dockerfile_text, REPO)
    assert any("configs/inat_smoothap.yaml" in p and "excluded" in p for p in blocking), blocking
    missing = check_dockerignore(ignore, dockerfile_text + "COPY no_such_dir /x\n", REPO)
    assert any("no_such_dir does not exist" in p for p in missing), missing


def test_dockerignore_matcher_follows_docker_rules() -> None:
    ignored = dockerignore_matcher("*\n!src\n**/__pycache__\n*.md\n!README.md\n")
    assert ignored("data/x.tar") and ignored("src/pkg/__pycache__/m.pyc") and ignored("NOTES.md")
    assert not ignored("src/pkg/m.py") and not ignored("README.md")


def test_kubernetes_manifests(docs: list[Doc], ray_version: str, project_version: str) -> None:
    assert {d["kind"] for d in docs} >= {"RayCluster", "RayJob", "PersistentVolumeClaim", "Deployment"}
    assert check_manifests(docs, REPO, ray_version, project_version) == []


def _cluster(docs: list[Doc]) -> Doc:
    doc = _find(docs, "RayCluster")
    assert doc is not None
    return doc["spec"]


def _job(docs: list[Doc]) -> Doc:
    doc = _find(docs, "RayJob")
    assert doc is not None
    return doc["spec"]


def _worker(spec: Doc) -> Doc:
    return spec["workerGroupSpecs"][0]


def _worker_container(spec: Doc) -> Doc:
    return _worker(spec)["template"]["spec"]["containers"][0]


def _mlflow_container(docs: list[Doc]) -> Doc:
    doc = _find(docs, "Deployment", "mlflow")
    assert doc is not None
    return doc["spec"]["template"]["spec"]["containers"][0]


def _drop_allowed_hosts(docs: list[Doc]) -> None:
    container = _mlflow_container(docs)
    container["args"] = [a for a in container["args"] if not a.startswith("--allowed-hosts")]


def _set_entrypoint_config(docs: list[Doc], config: str) -> None:
    entry = parse_entrypoint(_job(docs)["entrypoint"])
    _job(docs)["entrypoint"] = " ".join(["python", "-m", "dmltrain.run", config, *entry.overrides])


def _search_container(docs: list[Doc]) -> Doc:
    doc = _find(docs, "Deployment", SEARCH)
    assert doc is not None
    return doc["spec"]["template"]["spec"]["containers"][0]


def _search_command(docs: list[Doc], old: str, new: str) -> None:
    container = _search_container(docs)
    assert old in container["command"], (old, container["command"])
    container["command"] = [new if a == old else a for a in container["command"]]


MANIFEST_MUTATIONS: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    ("wrong apiVersion", lambda d: _find(d, "RayCluster").update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
    (
        "head without image",
        lambda d: _cluster(d)["headGroupSpec"]["template"]["spec"]["containers"][0].pop("image"),
        "with an image",
    ),
    (
        "numeric rayStartParams",
        lambda d: _cluster(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),
        "map of strings",
    ),
    ("no groupName", lambda d: _worker(_cluster(d)).pop("groupName"), "groupName missing"),
    ("replicas above max", lambda d: _worker(_cluster(d)).update(replicas=5), "not within"),
    (
        "no GPU limit",
        lambda d: _worker_container(_cluster(d))["resources"]["limits"].pop("nvidia.com/gpu"),
        "nvidia.com/gpu",
    ),
    (
        "mount without volume",
        lambda d: _worker(_job(d)["rayClusterSpec"])["template"]["spec"]["volumes"].pop(0),
        "has no volume",
    ),
    (
        "PVC not RWX",
        lambda d: _find(d, "PersistentVolumeClaim")["spec"].update(accessModes=["ReadWriteOnce"]),
        "not ReadWriteMany",
    ),
    (
        "different image",
        lambda d: _worker_container(_cluster(d)).update(image="ghcr.io/x/dmltrain:0.1.0"),
        "different images",
    ),
    (
        "latest image",
        lambda d: _worker_container(_cluster(d)).update(image="ghcr.io/dmltrain/dmltrain:latest"),
        "not an exact version",
    ),
    (
        "tracking URI inline",
        lambda d: _worker_container(_cluster(d))["env"][1].update(value="http://mlflow:5000", valueFrom=None),
        "MLFLOW_TRACKING_URI must come from",
    ),
    (
        "usage stats on",
        lambda d: _worker_container(_cluster(d))["env"][0].update(value="1"),
        "RAY_USAGE_STATS",
    ),
    ("ray version skew", lambda d: _cluster(d).update(rayVersion="2.59.0"), "rayVersion"),
    ("missing config", lambda d: _set_entrypoint_config(d, "configs/no_such.yaml"), "does not exist"),
    (
        "unpinned run name",
        lambda d: _job(d).update(entrypoint=_job(d)["entrypoint"].replace("run.name=inat-smoothap", "")),
        "run.name",
    ),
    (
        "storage off the volume",
        lambda d: _job(d).update(
            entrypoint=_job(d)["entrypoint"].replace(
                "run.storage_path=/mnt/shared/ray-results", "run.storage_path=/tmp/ray-results"
            )
        ),
        "shared volume",
    ),
    ("too few GPUs", lambda d: _worker(_job(d)["rayClusterSpec"]).update(replicas=1, minReplicas=1), "fit 4"),
    ("no shutdown", lambda d: _job(d).update(shutdownAfterJobFinishes=False), "shutdownAfterJobFinishes"),
    (
        "committed secret",
        lambda d: d.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "s", "namespace": "dmltrain"},
                "stringData": {"a": "b"},
            }
        ),
        "committed",
    ),
    (
        "MLflow host check",
        lambda d: _find(d, "ConfigMap").update(
            data={"MLFLOW_TRACKING_URI": "http://mlflow.other.svc.cluster.local:5000"}
        ),
        "does not name Service",
    ),
    (
        "MLflow allowed hosts",
        lambda d: _mlflow_container(d)["args"].append("--allowed-hosts=localhost"),
        "rejects Host",
    ),
    (
        "MLflow default allowed hosts",
        _drop_allowed_hosts,
        "rejects Host 'mlflow.dmltrain.svc.cluster.local:5000'",
    ),
    (
        "MLflow local artifacts",
        lambda d: _mlflow_container(d)["args"].append("--artifacts-destination=/mlartifacts"),
        "object store",
    ),
    (
        "Service selector",
        lambda d: _find(d, "Service")["spec"].update(selector={"app": "other"}),
        "matches no MLflow pod",
    ),
    ("search on loopback", lambda d: _search_command(d, "0.0.0.0", "127.0.0.1"), "the Service cannot reach"),
    ("search port", lambda d: _search_command(d, "8080", "8081"), "not a containerPort"),
    ("search local index", lambda d: _search_command(d, "runs:/RUN_ID/indexes/sop_test", "/idx"), "no local"),
    ("search bad flag", lambda d: _search_command(d, "--workers", "--threads"), "refuses the arguments"),
    ("search not serve", lambda d: _search_command(d, "serve", "search"), "not `dmltrain serve`"),
    (
        "search probe",
        lambda d: _search_container(d)["readinessProbe"]["httpGet"].update(path="/"),
        "readinessProbe",
    ),
    (
        "search not an MLflow client",
        lambda d: _find(d, "Deployment", SEARCH)["spec"]["template"]["metadata"]["labels"].pop(
            "dmltrain/mlflow-client"
        ),
        "not admitted to MLflow",
    ),
    (
        "search image",
        lambda d: _search_container(d).update(image="ghcr.io/dmltrain/dmltrain:0.0.9"),
        "different images",
    ),
    ("search scratch", lambda d: _search_container(d).pop("volumeMounts"), "TMPDIR"),
]


@pytest.mark.parametrize(
    ("label", "mutate", "expected"), MANIFEST_MUTATIONS, ids=[m[0] for m in MANIFEST_MUTATIONS]
)
def test_manifest_checker_catches(
    docs: list[Doc],
    ray_version: str,
    project_version: str,
    label: str,
    mutate: Callable[[list[Doc]], None],
    expected: str,
) -> None:
    broken = copy.deepcopy(docs)
    mutate(broken)
    problems = check_manifests(broken, REPO, ray_version, project_version)
    assert any(expected in p for p in problems), (label, problems)


def _ray_up_inputs(docs: list[Doc]) -> tuple[str, int, float]:
    entry = parse_entrypoint(_job(docs)["entrypoint"])
    config = load_config(REPO / entry.config, entry.overrides)
    return (
        next(iter(cluster_images(docs).values())),
        config.scaling.num_workers,
        config.scaling.cpus_per_worker,
    )


def test_ray_up_config_validates_against_rays_schema(docs: list[Doc]) -> None:
    config = yaml.safe_load(RAY_UP.read_text())
    assert check_ray_up(config, *_ray_up_inputs(docs)) == []
    # What `ray up` itself does before it contacts the cloud: merge the provider defaults, then validate.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: c["docker"].update(imagee=c["docker"]["image"]), "schema: Additional properties"),
        (lambda c: c["available_node_types"]["gpu_worker"].update(resources={"GPU": "4"}), "schema:"),
        (lambda c: c.pop("provider"), "schema: 'provider' is a required property"),
        (lambda c: c["docker"].update(image="rayproject/ray:2.60.0-gpu"), "docker.image"),
        (lambda c: c.update(head_node_type="nope"), "head_node_type"),
        (lambda c: c["available_node_types"]["gpu_worker"].update(max_workers=1), "fit 4"),
        (lambda c: c.update(max_workers=1), "fit 4"),
    ],
)
def test_ray_up_checker_catches(docs: list[Doc], mutate: Callable[[Doc], None], expected: str) -> None:
    config = yaml.safe_load(RAY_UP.read_text())
    mutate(config)
    problems = check_ray_up(config, *_ray_up_inputs(docs))
    assert any(expected in p for p in problems), problems
