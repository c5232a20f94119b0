"""The test bed: Ray nodes in network + mount namespaces, MLflow on PostgreSQL, S3 (moto), job submission.

Layout on disk (``base`` is a fresh directory outside /tmp, because every node mounts its own /tmp)::

    base/nodes/<node>/   a node's disk; inside the node it is mounted at base/local (the same path on every
                         node, as /home/ray is in every pod) and base/nodes is hidden by an empty tmpfs
    base/shared/         visible to every node at the same path: the ReadWriteMany volume
    base/local/          mount point only (empty in the root namespace)

The head hosts the services a real deployment keeps beside Ray: PostgreSQL (127.0.0.1 inside the head's
namespace, run as ``nobody``), the MLflow server with proxied artifacts on the head's disk, and moto as the
S3 endpoint. Nothing binds a port in the root namespace, so concurrent beds cannot collide.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.service.testbed.netns import BedError, Network, kill_namespace_processes, leftovers

NOBODY = 65534
RAY_PORT, DASHBOARD_PORT, MLFLOW_PORT, S3_PORT, PG_PORT = 6379, 8265, 5000, 9000, 5432
S3_REGION = "us-east-1"
# Variables that must not leak from the developer's or CI's shell into the nodes: the first one makes Ray
# refuse a second node; the others would point nodes at the wrong cluster, interface or services.
_STRIPPED = (
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_ADDRESS",
    "RAY_AUTH_TOKEN_PATH",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "MLFLOW_TRACKING_URI",
    "TMPDIR",
)


def _postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def bed_requirements() -> str | None:
    """Why the bed cannot run on this machine, or None when it can."""
    if platform.system() != "Linux":
        return "the cluster test bed needs Linux network and mount namespaces"
    if os.geteuid() != 0:
        return "the cluster test bed needs root (ip netns, veth, bridge, mount namespaces)"
    for tool in ("ip", "unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"the cluster test bed needs `{tool}` (iproute2 / util-linux)"
    if _postgres_bin() is None:
        return (
            "the cluster test bed needs PostgreSQL's server binaries (initdb, postgres), e.g. apt postgresql"
        )
    for module in ("psycopg2", "moto", "s3fs"):
        if importlib.util.find_spec(module) is None:
            return f"the cluster test bed needs {module}: pip install -e '.[cpu,dev]'"
    # Every node mounts a /tmp of its own, so an interpreter or a checkout under /tmp is invisible there.
    package = Path(__file__).resolve().parents[3]
    for what, path in (("the Python environment", Path(sys.prefix).resolve()), ("the checkout", package)):
        if path == Path("/tmp") or Path("/tmp") in path.parents:
            return (
                f"the cluster test bed gives each node its own /tmp, which hides {what} at {path}: "
                "use one outside /tmp"
            )
    return None


@dataclass
class Node:
    """One Ray node: its namespace, address, disk (as seen from the root namespace) and `ray start`."""

    name: str
    namespace: str
    address: str
    disk: Path
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class TestBed:
    """Build with :meth:`start` (or ``with TestBed() as bed``); everything goes away in :meth:`stop`."""

    __test__ = False  # not a pytest test class despite the name

    worker_nodes: int = 2
    cpus_per_node: int = 1
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dmlbed-", dir="/var/tmp")))
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    # Faster node-death detection than Ray's default (~15 s of silence), still tolerant of a loaded box.
    head_env: dict[str, str] = field(
        default_factory=lambda: {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000"}
    )
    # Where stop() copies every node's logs (ray start, services, Ray session logs, job drivers) first.
    archive: Path | None = None
    network: Network | None = None
    nodes: dict[str, Node] = field(default_factory=dict)
    _services: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    _worker_count: int = 0

    # ------------------------------------------------------------------ layout
    @property
    def shared(self) -> Path:
        return self.base / "shared"

    @property
    def local(self) -> Path:
        """A node's own disk, at the same path on every node (empty in the root namespace)."""
        return self.base / "local"

    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.head.address}:{MLFLOW_PORT}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.head.address}:{S3_PORT}"

    @property
    def s3_env(self) -> dict[str, str]:
        """What a client (test, driver, worker) needs to reach the bed's S3 endpoint with s3fs/pyarrow."""
        return {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": S3_REGION,
        }

    @property
    def bin_dir(self) -> Path:
        return Path(sys.executable).parent

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> TestBed:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> TestBed:
        why = bed_requirements()
        if why:
            raise BedError(why)
        self.base.chmod(0o755)  # nobody (PostgreSQL) must traverse it
        for path in (self.base / "nodes", self.shared, self.local):
            path.mkdir(parents=True, exist_ok=True)
        self.shared.chmod(0o1777)
        self.network = Network.create(self.base)
        head = self._add_namespace("head")
        self._start_postgres(head)
        self._start_service(
            "mlflow",
            head,
            [
                str(sys.executable),
                "-m",
                "mlflow",
                "server",
                "--host",
                head.address,
                "--port",
                str(MLFLOW_PORT),
                "--workers",
                "1",
                "--backend-store-uri",
                f"postgresql+psycopg2://mlflow@127.0.0.1:{PG_PORT}/mlflow",
                "--serve-artifacts",
                "--artifacts-destination",
                str(self.local / "mlartifacts"),
            ],
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        self._start_service(
            "s3",
            head,
            [str(sys.executable), "-m", "moto.server", "-H", head.address, "-p", str(S3_PORT)],
            {},
        )
        self._start_ray(
            head,
            [
                "--head",
                f"--port={RAY_PORT}",
                f"--dashboard-host={head.address}",
                f"--dashboard-port={DASHBOARD_PORT}",
                "--num-cpus=0",
            ],
            self.head_env,
        )
        for _ in range(self.worker_nodes):
            self.add_worker(wait=False)
        self.wait_for_nodes(1 + self.worker_nodes)
        self._wait_service("mlflow", f"{self.mlflow_url}/health", 180)
        self._wait_service("s3", f"{self.s3_endpoint}/moto-api/", 60)
        return self

    def stop(self) -> None:
        """Stop every process by namespace, remove namespaces, links, bridge and the base directory."""
        errors: list[str] = []
        if self.archive is not None:
            self._archive_logs(self.archive)
        # Everything (PostgreSQL too: its data is thrown away) is SIGKILLed by namespace; the private IPC
        # namespace and tmpfs mounts die with the processes, so nothing of theirs outlives them.
        if self.network is not None:
            try:
                self.network.destroy()
            except Exception as error:  # keep tearing down; report at the end
                errors.append(str(error))
        for _, proc in self._services:
            _reap(proc)
        for node in self.nodes.values():
            _reap(node.process)
        shutil.rmtree(self.base, ignore_errors=True)
        if errors:
            raise BedError("; ".join(errors))

    def _archive_logs(self, target: Path) -> None:
        for disk in sorted((self.base / "nodes").glob("*")):
            with contextlib.suppress(OSError):
                shutil.copytree(disk / "logs", target / disk.name, dirs_exist_ok=True)
            for log in (disk / "ray").glob("session_*/logs/*"):
                if log.is_file() and log.name.startswith(
                    ("job-driver-", "raylet.", "gcs_server.", "worker-")
                ):
                    with contextlib.suppress(OSError):
                        shutil.copy2(log, target / disk.name / log.name)

    def leftovers(self) -> list[str]:
        """Anything of this bed still on the machine (processes, namespaces, links, mounts, files)."""
        found = [f"process {pid}" for pid in self.processes()]
        if self.network is None:
            return found + ([f"directory {self.base}"] if self.base.exists() else [])
        return found + leftovers(self.network.bed_id, self.base)

    def processes(self, node: Node | None = None, command: str | None = None) -> list[int]:
        """Pids (root namespace) of every process the bed started, or one node's, or those whose command
        line contains ``command``: all of them, and only them, carry this bed's token in their
        environment."""
        marker = f"RAY_AUTH_TOKEN={self.token}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                if node is not None and os.readlink(entry / "ns" / "net") != _netns_id(node.namespace):
                    continue
                if command is not None and command.encode() not in (entry / "cmdline").read_bytes():
                    continue
            except OSError:
                continue
            found.append(int(entry.name))
        return found

    # ------------------------------------------------------------------ nodes
    def _add_namespace(self, name: str) -> Node:
        assert self.network is not None
        ns, address = self.network.add_namespace(name)
        disk = self.base / "nodes" / name
        for sub in ("home", "logs"):
            (disk / sub).mkdir(parents=True, exist_ok=True)
        disk.chmod(0o755)
        node = Node(name, ns, address, disk, process=None, log=disk / "logs" / "ray.log")  # type: ignore[arg-type]
        self.nodes[name] = node
        return node

    def add_worker(self, name: str | None = None, wait: bool = True) -> Node:
        """A worker node joining the head (a new pod or VM); its disk is fresh and its own."""
        self._worker_count += 1
        node = self._add_namespace(name or f"w{self._worker_count}")
        self._start_ray(
            node, [f"--address={self.head.address}:{RAY_PORT}", f"--num-cpus={self.cpus_per_node}"], {}
        )
        if wait:
            self.wait_for_nodes(len(self.alive_nodes_expected()))
        return node

    def alive_nodes_expected(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.process is not None and n.process.poll() is None]

    def kill_node(self, name: str) -> None:
        """Crash a node: cut its network first (peers get silence, not a FIN), then SIGKILL everything."""
        assert self.network is not None
        node = self.nodes.pop(name)
        self.network.cut(name)
        kill_namespace_processes(node.namespace)
        self.network.remove_namespace(name)
        _reap(node.process)

    def node_env(self, node: Node, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _STRIPPED and not k.startswith("AWS_")}
        env.update(
            {
                "PATH": f"{self.bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
                "HOME": str(self.local / "home"),
                "GLOO_SOCKET_IFNAME": "eth0",  # the namespace's own interface
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.token,
                "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "1",
            }
        )
        env.update(extra or {})
        return env

    def in_node(self, node: Node, argv: list[str], as_user: int | None = None) -> list[str]:
        """``argv`` run inside the node, as on a machine of its own: its network namespace; its own process
        table (Ray finds "its" cluster by scanning processes), SysV IPC, /tmp and /dev/shm; its disk at
        base/local; the other nodes' disks hidden."""
        script = (
            'set -e; mount --bind "$1" "$2"; mount -t tmpfs -o size=1m,mode=0755 dmlbed-hidden "$3"; '
            "mount -t tmpfs -o size=2g,mode=1777 dmlbed-tmp /tmp; "
            "mount -t tmpfs -o size=1g,mode=1777 dmlbed-shm /dev/shm; "
            'cd "$2"; shift 3; exec "$@"'
        )
        drop = ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups"] if as_user else []
        return [
            "ip",
            "netns",
            "exec",
            node.namespace,
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--mount-proc",
            "--ipc",
            "--",
            "sh",
            "-c",
            script,
            "sh",
            str(node.disk),
            str(self.local),
            str(self.base / "nodes"),
            *drop,
            *argv,
        ]

    def _start_ray(self, node: Node, args: list[str], extra_env: dict[str, str]) -> None:
        argv = [
            str(self.bin_dir / "ray"),
            "start",
            "--block",
            f"--node-ip-address={node.address}",
            f"--temp-dir={self.local / 'ray'}",
            "--object-store-memory=200000000",
            "--disable-usage-stats",
            *args,
        ]
        with open(node.log, "ab") as log:
            node.process = subprocess.Popen(
                self.in_node(node, argv),
                env=self.node_env(node, extra_env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    # ------------------------------------------------------------------ services on the head
    def _service_log(self, name: str) -> Path:
        return self.base / "nodes" / "head" / "logs" / f"{name}.log"

    def _start_service(
        self, name: str, node: Node, argv: list[str], env: dict[str, str], user: int | None = None
    ):
        with open(self._service_log(name), "ab") as log:
            proc = subprocess.Popen(
                self.in_node(node, argv, as_user=user),
                env=self.node_env(node, env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._services.append((name, proc))
        return proc

    def _wait_service(self, name: str, url: str, timeout: float) -> None:
        proc = dict(self._services)[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BedError(f"{name} exited {proc.returncode}: {_tail(self._service_log(name))}")
            try:
                with urllib.request.urlopen(url, timeout=5):
                    return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                time.sleep(0.5)
        raise BedError(
            f"{name} did not answer {url} within {timeout:.0f} s: {_tail(self._service_log(name))}"
        )

    def _start_postgres(self, head: Node) -> None:
        bindir = _postgres_bin()
        assert bindir is not None
        data, sockets = head.disk / "pg", head.disk / "pgsock"
        for path in (data, sockets):
            path.mkdir()
            os.chown(path, NOBODY, NOBODY)
        as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        initdb = subprocess.run(
            [
                *as_nobody,
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                "mlflow",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "HOME": str(data)},
            cwd=data,
        )
        if initdb.returncode != 0:
            raise BedError(f"initdb failed: {initdb.stderr.strip()[-2000:]}")
        # Paths inside the node: its disk is mounted at base/local.
        self._start_service(
            "postgres",
            head,
            [
                str(bindir / "postgres"),
                "-D",
                str(self.local / "pg"),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                f"port={PG_PORT}",
                "-c",
                f"unix_socket_directories={self.local / 'pgsock'}",
                "-c",
                "shared_buffers=16MB",
                "-c",
                "fsync=off",
            ],
            {"HOME": str(self.local / "pg")},
            user=NOBODY,
        )
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run(
                [str(bindir / "pg_isready"), "-q", "-h", str(sockets), "-p", str(PG_PORT), "-U", "mlflow"],
                timeout=30,
            )
            if ready.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise BedError(f"PostgreSQL did not start: {_tail(self._service_log('postgres'))}")
            time.sleep(0.3)
        created = subprocess.run(
            [str(bindir / "createdb"), "-h", str(sockets), "-p", str(PG_PORT), "-U", "mlflow", "mlflow"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if created.returncode != 0:
            raise BedError(f"createdb failed: {created.stderr.strip()}")

    # ------------------------------------------------------------------ Ray dashboard (REST, token)
    def _get(self, path: str, timeout: float = 10) -> Any:
        request = urllib.request.Request(
            f"{self.dashboard_url}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def ray_nodes(self) -> list[dict[str, Any]]:
        """Nodes as the GCS sees them (``state`` ALIVE/DEAD, ``node_ip``)."""
        reply = self._get("/api/v0/nodes?limit=100&detail=1")
        return list(reply["data"]["result"]["result"])

    def wait_for_nodes(self, count: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        alive: list[str] = []
        while time.monotonic() < deadline:
            for node in self.nodes.values():
                if node.process is not None and node.process.poll() is not None:
                    raise BedError(
                        f"`ray start` on {node.name} exited {node.process.returncode}: {_tail(node.log)}"
                    )
            with contextlib.suppress(OSError, ValueError, KeyError):
                alive = [n["node_ip"] for n in self.ray_nodes() if n["state"] == "ALIVE"]
                if len(alive) >= count:
                    return
            time.sleep(1)
        raise BedError(f"{len(alive)} of {count} Ray nodes alive after {timeout:.0f} s: {alive}")

    def actors(self, class_name: str) -> list[dict[str, Any]]:
        """Actors of one class the GCS knows of, dead or alive (``job_id``, ``state``, ``node_id``)."""
        query = f"filter_keys=class_name&filter_predicates=%3D&filter_values={class_name}"
        reply = self._get(f"/api/v0/actors?limit=1000&detail=1&{query}")
        return list(reply["data"]["result"]["result"])

    # ------------------------------------------------------------------ jobs, as a user submits them
    def submit_env(self) -> dict[str, str]:
        """The submitting shell (root namespace): token auth as README documents."""
        env = {k: v for k, v in os.environ.items() if k not in _STRIPPED}
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0"})
        return env

    def submit(
        self,
        entrypoint: list[str],
        working_dir: Path,
        submission_id: str,
        env_vars: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """``ray job submit --no-wait`` from the root namespace; retried while the job agent starts."""
        cli = [
            str(self.bin_dir / "ray"),
            "job",
            "submit",
            "--address",
            self.dashboard_url,
            "--no-wait",
            f"--submission-id={submission_id}",
            "--working-dir",
            str(working_dir),
        ]
        if env_vars:
            cli += ["--runtime-env-json", json.dumps({"env_vars": env_vars})]
        cli += ["--", *entrypoint]
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(cli, env=self.submit_env(), capture_output=True, text=True, timeout=timeout)
            if done.returncode == 0 or time.monotonic() > deadline:
                return done
            time.sleep(2)

    def ray_cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cli = [str(self.bin_dir / "ray"), *args]
        return subprocess.run(cli, env=self.submit_env(), capture_output=True, text=True, timeout=timeout)

    def stop_job(self, submission_id: str) -> None:
        """What ``ray job stop`` does (the driver gets SIGTERM, then SIGKILL), without the CLI's start-up."""
        request = urllib.request.Request(
            f"{self.dashboard_url}/api/jobs/{submission_id}/stop",
            method="POST",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            if not json.loads(response.read()).get("stopped"):
                raise BedError(f"job {submission_id} was not running")

    def job(self, submission_id: str) -> dict[str, Any]:
        return dict(self._get(f"/api/jobs/{submission_id}"))

    def job_logs(self, submission_id: str) -> str:
        with contextlib.suppress(OSError, ValueError):
            return str(self._get(f"/api/jobs/{submission_id}/logs", timeout=30)["logs"])
        return ""

    def wait_job(self, submission_id: str, timeout: float, until: tuple[str, ...] = ()) -> str:
        """Poll until the job reaches a terminal state (or one of ``until``); returns the status."""
        terminal = {"SUCCEEDED", "FAILED", "STOPPED", *until}
        deadline = time.monotonic() + timeout
        status = "UNKNOWN"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                status = str(self.job(submission_id)["status"])
                if status in terminal:
                    return status
            time.sleep(2)
        return status

    def describe(self) -> str:
        """How to use this bed from a shell in the root namespace."""
        lines = [
            f"head {self.head.address} (0 CPUs), workers: "
            + ", ".join(f"{n.name} {n.address}" for n in self.nodes.values() if n.name != "head"),
            f"shared directory (every node): {self.shared}",
            f"node disks (root namespace view): {self.base / 'nodes'}/<node>; logs in <node>/logs",
            f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN={self.token}",
            f"ray job submit --address {self.dashboard_url} --working-dir . --runtime-env-json "
            f"'{json.dumps({'env_vars': {'MLFLOW_TRACKING_URI': self.mlflow_url}})}' -- "
            f"python -m dmltrain.run configs/quickstart.yaml data.root={self.shared}/glyphs "
            f"run.storage_path={self.shared}/ray_results scaling.num_workers={len(self.nodes) - 1} "
            f"scaling.cpus_per_worker={self.cpus_per_node}",
            f"MLflow UI: {self.mlflow_url}   S3 endpoint: {self.s3_endpoint} (keys testing/testing)",
            f"a shell on a node (its network, its disk): {shlex.join(self.in_node(self.head, ['bash']))}",
        ]
        return "\n".join(lines)


def _netns_id(namespace: str) -> str:
    """The ``net:[inode]`` link target of a named network namespace, to match /proc/<pid>/ns/net."""
    return f"net:[{os.stat(f'/run/netns/{namespace}').st_ino}]"


def _reap(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {path})"
