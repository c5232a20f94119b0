"""Deployment hardening, checked statically like test_deployment.py (no cluster, no Docker engine here).

- Pod Security "restricted" for every pod the manifests run, with one declared exception (the one-time
  chown Job, "baseline"), an init step that prepares the shared volume for uid 1000, and a namespace that
  enforces "restricted".
- NetworkPolicy: only Ray pods reach MLflow, only MLflow reaches PostgreSQL.
- MLflow's basic-auth app on, its secrets and the clients' credentials in Secrets.
- `ray up`: workers run with their own instance profile, limited to the data/artifact bucket.
- A reproducible image: pip installs from a committed constraints file that pins every package, the MLflow
  client at the server's version, Ray and torch at the Dockerfile's versions; pyproject's ray floor is the
  version whose API the service uses.

Each checker returns a list of problems and each test also runs it on a broken copy, so every check is shown
to be able to fail.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_deployment import (
    DOCKERFILE,
    K8S_DIR,
    RAY_UP,
    REPO,
    _arg_defaults,
    _arg_value,
    _find,
    _groups,
    _name,
    _pod,
    copied_sources,
    load_manifests,
    parse_dockerfile,
    ray_cluster_specs,
)

Doc = dict[str, Any]
CONSTRAINTS = REPO / "cluster" / "image-constraints.txt"
WORKER_POLICY = REPO / "cluster" / "aws" / "worker-policy.json"
EXCEPTION_ANNOTATION = "dmltrain/pod-security"  # value "baseline": a declared, one-time exception

# ----------------------------------------------------------------------------------------------------------
# Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/)
# ----------------------------------------------------------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}


def pod_templates(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """(where, pod metadata, pod spec) of every pod the manifests create."""
    for where, spec in ray_cluster_specs(docs):
        for label, group in _groups(spec):
            template = group.get("template") or {}
            yield f"{where} {label}", template.get("metadata") or {}, _pod(group)
    for doc in docs:
        kind = doc.get("kind")
        spec = doc.get("spec") or {}
        if kind == "RayJob" and spec.get("submitterPodTemplate"):
            template = spec["submitterPodTemplate"]
            yield f"{_name(doc)} submitter", template.get("metadata") or {}, template.get("spec") or {}
        elif kind in {"Deployment", "Job", "StatefulSet", "DaemonSet"}:
            template = spec.get("template") or {}
            yield _name(doc), template.get("metadata") or {}, template.get("spec") or {}


def _containers(pod: Doc) -> list[Doc]:
    return [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]


def baseline_problems(where: str, pod: Doc) -> list[str]:
    """Pod Security "baseline": no privileged or host access, only the default capabilities."""
    problems = [f"{where}: {key} is set" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    problems += [
        f"{where}: hostPath volume {v.get('name')}" for v in pod.get("volumes") or [] if "hostPath" in v
    ]
    pod_seccomp = ((pod.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        problems.append(f"{where}: seccompProfile Unconfined")
    for container in _containers(pod):
        at = f"{where} container {container.get('name')}"
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            problems.append(f"{at}: privileged")
        added = set((context.get("capabilities") or {}).get("add") or [])
        if added - BASELINE_CAPABILITIES:
            problems.append(f"{at}: adds capabilities {sorted(added - BASELINE_CAPABILITIES)}")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            problems.append(f"{at}: hostPort")
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append(f"{at}: seccompProfile Unconfined")
    return problems


def restricted_problems(where: str, pod: Doc) -> list[str]:
    """Pod Security "restricted" on top of baseline: non-root, no escalation, no capabilities but
    NET_BIND_SERVICE, RuntimeDefault/Localhost seccomp, only the volume types it allows."""
    problems = baseline_problems(where, pod)
    pod_context = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"{where}: volume {volume.get('name')} of type {sorted(kinds)}")
    for container in _containers(pod):
        at = f"{where} container {container.get('name')}"
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{at}: allowPrivilegeEscalation is not false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{at}: capabilities.drop does not include ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{at}: adds capabilities {capabilities.get('add')}")
        non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{at}: runAsNonRoot is not true")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            problems.append(f"{at}: runAsUser 0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in {"RuntimeDefault", "Localhost"}:
            problems.append(f"{at}: seccompProfile is {seccomp!r}, not RuntimeDefault")
    return problems


def check_pod_security(docs: list[Doc]) -> list[str]:
    """Every pod restricted except declared baseline exceptions, which must be run-once Jobs; the namespace
    enforces restricted; pods on the shared volume prepare it as uid 1000; a Job makes it writable."""
    problems: list[str] = []
    exceptions = []
    for where, metadata, pod in pod_templates(docs):
        declared = (metadata.get("annotations") or {}).get(EXCEPTION_ANNOTATION)
        if declared == "baseline":
            exceptions.append(where)
            if not where.startswith("Job/"):
                problems.append(f"{where}: only a run-once Job may be a Pod Security exception")
            problems.extend(baseline_problems(where, pod))
        else:
            problems.extend(restricted_problems(where, pod))
    if len(exceptions) > 1:
        problems.append(f"more than one Pod Security exception: {exceptions}")
    namespace = _find(docs, "Namespace") or {}
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    if labels.get("pod-security.kubernetes.io/enforce") != "restricted":
        problems.append(f"Namespace does not enforce Pod Security restricted (labels {labels})")

    for where, spec in ray_cluster_specs(docs):
        for label, group in _groups(spec):
            pod = _pod(group)
            claims = {v["name"] for v in pod.get("volumes") or [] if "persistentVolumeClaim" in v}
            inits = [
                c
                for c in pod.get("initContainers") or []
                if {m.get("name") for m in c.get("volumeMounts") or []} & claims
            ]
            if claims and not inits:
                problems.append(f"{where} {label}: no init container prepares the shared volume")
    chowns = [
        d
        for d in docs
        if d.get("kind") == "Job"
        and any(
            "chown 1000:1000" in " ".join(map(str, c.get("command", []) + c.get("args", [])))
            for c in _containers(((d.get("spec") or {}).get("template") or {}).get("spec") or {})
        )
    ]
    if not chowns:
        problems.append("no Job makes the shared volume writable for uid 1000 (chown 1000:1000)")
    return problems


# ----------------------------------------------------------------------------------------------------------
# NetworkPolicy
# ----------------------------------------------------------------------------------------------------------


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against pod labels; {} selects every pod."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if (
            (operator == "In" and labels.get(key) not in values)
            or (operator == "NotIn" and labels.get(key) in values)
            or (operator == "Exists" and key not in labels)
            or (operator == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def _admitted(policies: list[Doc], target: dict[str, str]) -> list[Doc] | None:
    """The ingress peers admitted to pods with ``target`` labels, or None if no policy isolates them."""
    selecting = [
        p
        for p in policies
        if _selects(p["spec"].get("podSelector") or {}, target)
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
    ]
    if not selecting:
        return None
    peers: list[Doc] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers.extend(rule.get("from") or [{}])  # a rule without `from` admits everyone
    return peers


def check_network_policies(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    pods = {where: metadata.get("labels") or {} for where, metadata, _ in pod_templates(docs)}
    mlflow = _find(docs, "Deployment", "mlflow")
    mlflow_labels = ((mlflow or {}).get("spec", {}).get("template", {}).get("metadata") or {}).get(
        "labels"
    ) or {}
    # Ray pods log runs; the search service (search.yaml) downloads an index and its model.
    clients = {
        w: labels
        for w, labels in pods.items()
        if (w.startswith(("RayCluster/", "RayJob/")) and "submitter" not in w)
        or w == "Deployment/dmltrain-search"
    }

    for target, labels, allowed in (
        ("MLflow", mlflow_labels, "Ray pods and the search service"),
        ("PostgreSQL", {"app.kubernetes.io/name": "postgresql"}, "the MLflow server"),
    ):
        peers = _admitted(policies, labels)
        if peers is None:
            problems.append(f"no NetworkPolicy isolates the {target} pods: every pod can connect")
            continue
        for peer in peers:
            if set(peer) != {"podSelector"}:
                problems.append(f"{target} admits {peer} (only pod selectors in this namespace are expected)")
                continue
            reached = sorted(w for w, pod_labels in pods.items() if _selects(peer["podSelector"], pod_labels))
            expected = sorted(clients) if target == "MLflow" else [_name(mlflow or {})]
            if reached != expected:
                problems.append(f"{target} admits pods {reached}, expected only {allowed} {expected}")
    return problems


# ----------------------------------------------------------------------------------------------------------
# MLflow basic auth
# ----------------------------------------------------------------------------------------------------------


def _from_secret(env: dict[str, Doc], name: str) -> bool:
    return "secretKeyRef" in ((env.get(name) or {}).get("valueFrom") or {})


def check_mlflow_auth(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    deployment = _find(docs, "Deployment", "mlflow")
    if deployment is None:
        return ["no MLflow Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = [str(a) for a in container.get("command", []) + container.get("args", [])]
    if _arg_value(args, "--app-name") != "basic-auth":
        problems.append("MLflow server runs without --app-name basic-auth: anyone who reaches it can write")
    env = {e["name"]: e for e in container.get("env") or []}
    for name in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        if not _from_secret(env, name):
            problems.append(f"MLflow {name} does not come from a Secret")
    config_path = (env.get("MLFLOW_AUTH_CONFIG_PATH") or {}).get("value", "")
    secret_volumes = {v["name"] for v in pod.get("volumes") or [] if "secret" in v}
    mounts = [m["mountPath"] for m in container.get("volumeMounts") or [] if m.get("name") in secret_volumes]
    if not any(config_path.startswith(m.rstrip("/") + "/") for m in mounts):
        problems.append(
            f"MLFLOW_AUTH_CONFIG_PATH {config_path!r} is not in a Secret volume (it holds the DB URI)"
        )
    for where, spec in ray_cluster_specs(docs):
        for label, group in _groups(spec):
            for ray_container in _pod(group).get("containers") or []:
                ray_env = {e["name"]: e for e in ray_container.get("env") or []}
                for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                    if not _from_secret(ray_env, name):
                        problems.append(f"{where} {label}: {name} does not come from a Secret")
    return problems


# ----------------------------------------------------------------------------------------------------------
# `ray up` worker instance profile
# ----------------------------------------------------------------------------------------------------------


def check_worker_profile(config: Doc, policy: Doc) -> list[str]:
    problems: list[str] = []
    types = config.get("available_node_types") or {}
    head = types.get(config.get("head_node_type"), {})
    head_profile = (head.get("node_config") or {}).get("IamInstanceProfile") or {"Name": "ray-autoscaler-v1"}
    for name, node_type in types.items():
        if name == config.get("head_node_type"):
            continue
        profile = (node_type.get("node_config") or {}).get("IamInstanceProfile")
        if not profile:
            problems.append(f"worker type {name}: no IamInstanceProfile (workers cannot reach the bucket)")
        elif profile == head_profile or "ray-autoscaler" in json.dumps(profile):
            problems.append(f"worker type {name}: uses the head's autoscaler profile {profile}")
    buckets = set()
    for statement in policy.get("Statement") or []:
        actions = statement.get("Action")
        actions = [actions] if isinstance(actions, str) else actions or []
        resources = statement.get("Resource")
        resources = [resources] if isinstance(resources, str) else resources or []
        if statement.get("Effect") != "Allow":
            continue
        for action in actions:
            if not action.startswith("s3:") or "*" in action:
                problems.append(f"worker policy allows {action!r}: only named s3 actions")
        for resource in resources:
            match = re.fullmatch(r"arn:aws:s3:::([a-zA-Z0-9.\-_A-Z]+)(/\*)?", resource)
            if not match:
                problems.append(f"worker policy resource {resource!r} is not one bucket or its objects")
            else:
                buckets.add(match.group(1))
    if len(buckets) != 1:
        problems.append(f"worker policy covers buckets {sorted(buckets)}, expected exactly one")
    return problems


# ----------------------------------------------------------------------------------------------------------
# Reproducible image
# ----------------------------------------------------------------------------------------------------------


def parse_constraints(text: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip() if sep else ""
    return pins


def check_image_pins(dockerfile: str, constraints: str, pyproject: Doc, mlflow_image: str) -> list[str]:
    """pip installs with --constraint from a committed file that pins every requirement exactly and agrees
    with the Dockerfile's versions and the MLflow server image."""
    problems: list[str] = []
    instructions = parse_dockerfile(dockerfile)
    args = _arg_defaults(instructions)
    copied = {dest: src for src, dest in copied_sources(instructions)}
    runs = " ; ".join(i.args for i in instructions if i.keyword == "RUN")
    installs = re.findall(r"pip\s+install\b([^;&|]*)", runs)
    for install in installs:
        path = re.search(r"(?:--constraint|-c)[ =](\S+)", install)
        if path is None:
            problems.append(f"pip install without --constraint: {install.strip()}")
        elif copied.get(path.group(1)) != "cluster/image-constraints.txt":
            problems.append(
                f"pip install uses constraints {path.group(1)}, not COPY'd cluster/image-constraints.txt"
            )
    pins = parse_constraints(constraints)
    loose = sorted(
        name for name, version in pins.items() if not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version)
    )
    if loose:
        problems.append(f"constraints without an exact version: {loose}")
    project = pyproject["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["gpu"]]
    requirements += [*project["optional-dependencies"]["s3"], "boto3"]
    requirements += [*project["optional-dependencies"]["timm"], *project["optional-dependencies"]["openclip"]]
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name not in pins:
            problems.append(f"{requirement.name} is not pinned in cluster/image-constraints.txt")
        elif pins[name] and not requirement.specifier.contains(pins[name], prereleases=True):
            problems.append(f"pinned {name}=={pins[name]} does not satisfy pyproject's {requirement}")
    for package, arg in (
        ("ray", "RAY_VERSION"),
        ("torch", "TORCH_VERSION"),
        ("torchvision", "TORCHVISION_VERSION"),
    ):
        if pins.get(package) != args.get(arg):
            problems.append(
                f"{package}=={pins.get(package)} in the constraints != Dockerfile {arg}={args.get(arg)}"
            )
    server = re.search(r":v?(\d+\.\d+\.\d+)", mlflow_image)
    if server is None or pins.get("mlflow") != server.group(1):
        problems.append(f"mlflow client {pins.get('mlflow')} != the server image {mlflow_image}")
    ray_requirement = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "ray")
    floors = [Version(s.version) for s in ray_requirement.specifier if s.operator == ">="]
    if not floors or floors[0] < Version("2.60"):
        problems.append(f"pyproject {ray_requirement}: the service uses Ray Train v2 APIs of Ray 2.60")
    return problems


# ----------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture()
def docs() -> list[Doc]:
    return load_manifests(K8S_DIR)


def _mlflow_pod(docs: list[Doc]) -> Doc:
    return _find(docs, "Deployment", "mlflow")["spec"]["template"]


def _ray_pods(docs: list[Doc]) -> list[Doc]:
    return [group["template"] for _, spec in ray_cluster_specs(docs) for _, group in _groups(spec)]


def test_every_pod_is_restricted_and_the_shared_volume_is_prepared(docs: list[Doc]) -> None:
    assert check_pod_security(docs) == []
    assert len(list(pod_templates(docs))) >= 7  # 2 RayCluster + 2 RayJob pods, submitter, MLflow, init Job


def _head_container(docs: list[Doc]) -> Doc:
    return _ray_pods(docs)[0]["spec"]["containers"][0]


POD_MUTATIONS: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    (
        "escalation",
        lambda d: _head_container(d)["securityContext"].pop("allowPrivilegeEscalation"),
        "allowPrivilegeEscalation",
    ),
    (
        "capabilities",
        lambda d: _head_container(d)["securityContext"]["capabilities"].update(drop=[]),
        "drop does not include ALL",
    ),
    ("root", lambda d: _ray_pods(d)[1]["spec"]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    ("seccomp", lambda d: _mlflow_pod(d)["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile"),
    (
        "init seccomp",
        lambda d: _ray_pods(d)[2]["spec"]["initContainers"][0].update(securityContext={}),
        "allowPrivilegeEscalation",
    ),
    (
        "hostPath",
        lambda d: _ray_pods(d)[3]["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        "hostPath",
    ),
    ("no init", lambda d: _ray_pods(d)[0]["spec"].pop("initContainers"), "no init container prepares"),
    (
        "no chown Job",
        lambda d: d.remove(_find(d, "Job", "shared-volume-init")),
        "no Job makes the shared volume",
    ),
    (
        "privileged Job",
        lambda d: _find(d, "Job")["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
            privileged=True
        ),
        "privileged",
    ),
    (
        "Job SYS_ADMIN",
        lambda d: _find(d, "Job")["spec"]["template"]["spec"]["containers"][0]["securityContext"][
            "capabilities"
        ]["add"].append("SYS_ADMIN"),
        "SYS_ADMIN",
    ),
    (
        "undeclared Job",
        lambda d: _find(d, "Job")["spec"]["template"]["metadata"]["annotations"].clear(),
        "runAsUser 0",
    ),
    (
        "exception not a Job",
        lambda d: _mlflow_pod(d)["metadata"].update(annotations={EXCEPTION_ANNOTATION: "baseline"}),
        "only a run-once Job",
    ),
    (
        "namespace",
        lambda d: _find(d, "Namespace")["metadata"]["labels"].update(
            {"pod-security.kubernetes.io/enforce": "baseline"}
        ),
        "does not enforce",
    ),
]


@pytest.mark.parametrize(("label", "mutate", "expected"), POD_MUTATIONS, ids=[m[0] for m in POD_MUTATIONS])
def test_pod_security_checker_catches(docs: list[Doc], label: str, mutate: Callable, expected: str) -> None:
    broken = copy.deepcopy(docs)
    mutate(broken)
    problems = check_pod_security(broken)
    assert any(expected in p for p in problems), (label, problems)


def test_only_ray_pods_reach_mlflow_and_only_mlflow_reaches_postgresql(docs: list[Doc]) -> None:
    assert check_network_policies(docs) == []


NETWORK_MUTATIONS: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    (
        "no policy",
        lambda d: d.remove(_find(d, "NetworkPolicy", "mlflow-clients")),
        "no NetworkPolicy isolates the MLflow",
    ),
    ("label missing", lambda d: _ray_pods(d)[1]["metadata"]["labels"].clear(), "expected only Ray pods"),
    (
        "open rule",
        lambda d: _find(d, "NetworkPolicy", "mlflow-clients")["spec"]["ingress"][0].pop("from"),
        "admits {}",
    ),
    (
        "namespaces",
        lambda d: _find(d, "NetworkPolicy", "mlflow-clients")["spec"]["ingress"][0]["from"].append(
            {"namespaceSelector": {}}
        ),
        "only pod selectors",
    ),
    (
        "submitter",
        lambda d: _find(d, "RayJob")["spec"]["submitterPodTemplate"].update(
            metadata={"labels": {"dmltrain/mlflow-client": "true"}}
        ),
        "expected only Ray pods",
    ),
    (
        "db open",
        lambda d: _find(d, "NetworkPolicy", "postgresql-clients")["spec"]["ingress"][0]["from"][0].update(
            podSelector={}
        ),
        "PostgreSQL admits pods",
    ),
]


@pytest.mark.parametrize(
    ("label", "mutate", "expected"), NETWORK_MUTATIONS, ids=[m[0] for m in NETWORK_MUTATIONS]
)
def test_network_policy_checker_catches(docs: list[Doc], label: str, mutate: Callable, expected: str) -> None:
    broken = copy.deepcopy(docs)
    mutate(broken)
    problems = check_network_policies(broken)
    assert any(expected in p for p in problems), (label, problems)


def _mlflow_container(docs: list[Doc]) -> Doc:
    return _mlflow_pod(docs)["spec"]["containers"][0]


def test_mlflow_requires_a_login_with_credentials_from_secrets(docs: list[Doc]) -> None:
    assert check_mlflow_auth(docs) == []


def _drop_env(container: Doc, name: str) -> None:
    container["env"] = [e for e in container["env"] if e["name"] != name]


AUTH_MUTATIONS: list[tuple[str, Callable[[list[Doc]], None], str]] = [
    ("no auth app", lambda d: _mlflow_container(d)["args"].remove("--app-name=basic-auth"), "basic-auth"),
    (
        "inline admin password",
        lambda d: _drop_env(_mlflow_container(d), "MLFLOW_AUTH_ADMIN_PASSWORD"),
        "MLFLOW_AUTH_ADMIN_PASSWORD",
    ),
    ("ini not secret", lambda d: _mlflow_pod(d)["spec"]["volumes"].pop(), "not in a Secret volume"),
    (
        "client password",
        lambda d: _drop_env(_head_container(d), "MLFLOW_TRACKING_PASSWORD"),
        "MLFLOW_TRACKING_PASSWORD",
    ),
]


@pytest.mark.parametrize(("label", "mutate", "expected"), AUTH_MUTATIONS, ids=[m[0] for m in AUTH_MUTATIONS])
def test_mlflow_auth_checker_catches(docs: list[Doc], label: str, mutate: Callable, expected: str) -> None:
    broken = copy.deepcopy(docs)
    mutate(broken)
    assert any(expected in p for p in check_mlflow_auth(broken)), label


def test_ray_up_workers_get_a_bucket_only_profile() -> None:
    config = yaml.safe_load(RAY_UP.read_text())
    policy = json.loads(WORKER_POLICY.read_text())
    assert check_worker_profile(config, policy) == []
    autoscaler = copy.deepcopy(config)
    autoscaler["available_node_types"]["gpu_worker"]["node_config"]["IamInstanceProfile"] = {
        "Name": "ray-autoscaler-v1"
    }
    assert any("autoscaler profile" in p for p in check_worker_profile(autoscaler, policy))
    missing = copy.deepcopy(config)
    missing["available_node_types"]["gpu_worker"]["node_config"].pop("IamInstanceProfile")
    assert any("no IamInstanceProfile" in p for p in check_worker_profile(missing, policy))
    broad = copy.deepcopy(policy)
    broad["Statement"][1]["Resource"] = "*"
    broad["Statement"].append({"Effect": "Allow", "Action": "ec2:RunInstances", "Resource": "*"})
    problems = check_worker_profile(config, broad)
    assert any("'*' is not one bucket" in p for p in problems) and any(
        "ec2:RunInstances" in p for p in problems
    )


def _image_inputs(docs: list[Doc]) -> tuple[str, str, Doc, str]:
    return (
        DOCKERFILE.read_text(),
        CONSTRAINTS.read_text(),
        tomllib.loads((REPO / "pyproject.toml").read_text()),
        _mlflow_container(docs)["image"],
    )


def test_image_installs_exact_pins_that_agree_with_the_cluster(docs: list[Doc]) -> None:
    assert check_image_pins(*_image_inputs(docs)) == []


IMAGE_MUTATIONS: list[tuple[str, Callable[[list], None], str]] = [
    (
        "no constraint",
        lambda i: i.__setitem__(0, i[0].replace("--constraint /tmp/image-constraints.txt ", "")),
        "without --constraint",
    ),
    ("loose pin", lambda i: i.__setitem__(1, i[1].replace("numpy==", "numpy>=")), "without an exact version"),
    (
        "missing pin",
        lambda i: i.__setitem__(1, re.sub(r"(?m)^webdataset==.*\n", "", i[1])),
        "webdataset is not pinned",
    ),
    ("server skew", lambda i: i.__setitem__(3, "ghcr.io/mlflow/mlflow:v3.16.0-full"), "!= the server image"),
    (
        "ray skew",
        lambda i: i.__setitem__(0, i[0].replace("ARG RAY_VERSION=2.60.0", "ARG RAY_VERSION=2.59.0")),
        "ray==2.60.0 in the constraints",
    ),
    (
        "old ray floor",
        lambda i: i[2]["project"]["dependencies"].__setitem__(
            next(n for n, r in enumerate(i[2]["project"]["dependencies"]) if r.startswith("ray")),
            "ray[train,default]>=2.40",
        ),
        "Ray 2.60",
    ),
    (
        "pin outside range",
        lambda i: i.__setitem__(1, re.sub(r"(?m)^pyyaml==.*$", "pyyaml==5.4", i[1])),
        "does not satisfy",
    ),
]


@pytest.mark.parametrize(
    ("label", "mutate", "expected"), IMAGE_MUTATIONS, ids=[m[0] for m in IMAGE_MUTATIONS]
)
def test_image_pin_checker_catches(docs: list[Doc], label: str, mutate: Callable, expected: str) -> None:
    inputs = list(copy.deepcopy(_image_inputs(docs)))
    mutate(inputs)
    assert any(expected in p for p in check_image_pins(*inputs)), (label, check_image_pins(*inputs))


def _generated_pins() -> dict[str, str]:
    """What cluster/update_image_constraints.py would write from the packages installed here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "update_image_constraints", CONSTRAINTS.parent / "update_image_constraints.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return parse_constraints(module.render())


def test_constraints_pin_every_package_the_image_installs() -> None:
    """The generator, walking the installed dependency tree of dmltrain[gpu,s3,timm,openclip] + boto3, finds
    exactly the packages the committed file pins: a new dependency (or a dropped one) shows up here in any
    environment."""
    generated, committed = _generated_pins(), parse_constraints(CONSTRAINTS.read_text())
    assert sorted(set(generated) - set(committed)) == [], (
        "not pinned: run cluster/update_image_constraints.py"
    )
    assert sorted(set(committed) - set(generated)) == [], "pinned but no longer needed"


def test_constraints_versions_are_this_development_environment() -> None:
    """In the development venv the pins are exactly what is installed (the versions the suite passed with);
    a fresh install elsewhere (CI) may resolve newer releases: what the pins keep out of the image."""
    generated, committed = _generated_pins(), parse_constraints(CONSTRAINTS.read_text())
    drift = {
        name: (committed[name], version)
        for name, version in generated.items()
        if committed.get(name) != version
    }
    if drift:
        pytest.skip(f"not the environment the pins were generated in (pinned, installed): {drift}")
    assert generated == committed
