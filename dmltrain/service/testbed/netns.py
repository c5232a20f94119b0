"""Network plumbing of the test bed: one bridge, one /24, one namespace + veth pair per node.

Several beds may run on one machine at once (other developers' test sessions): every bed gets a random id
that prefixes all its names, and a /24 of its own, claimed by holding an flock on a file under
``/run/dmltrain-testbed`` for the bed's lifetime. The registry file beside it names the owner's pid, so a
bed whose owner died without tearing down (SIGKILL, power cut of the test runner) is reaped by the next bed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dmltrain.service.processes import pid_alive

REGISTRY = Path("/run/dmltrain-testbed")
SUBNET_PREFIX = "10.213"  # 10.213.K.0/24, K claimed per bed; rarely used by anything else
NS_PREFIX = "dmlbed-"


class BedError(RuntimeError):
    """The bed could not be built or a step of it failed; the message says which and why."""


class NetError(BedError):
    """An `ip` command failed: the bed cannot build its network."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def namespaces() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    out = ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def namespace_pids(name: str) -> list[int]:
    out = ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(name: str, timeout: float = 30.0) -> None:
    """SIGKILL every process in the namespace until none is left (raylets may respawn workers meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = namespace_pids(name)
        if not pids:
            return
        if time.monotonic() > deadline:
            raise NetError(f"processes {pids} in namespace {name} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@dataclass
class Network:
    """A bridge with the root namespace at .1 and one namespace per node at .2, .3, ..."""

    bed_id: str
    subnet: int  # K of 10.213.K.0/24
    lock_fd: int
    next_host: int = 2

    @property
    def bridge(self) -> str:
        return f"dmlb{self.bed_id}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge: where `ray job submit` and tests come from."""
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    def namespace(self, node: str) -> str:
        return f"{NS_PREFIX}{self.bed_id}-{node}"

    def veth(self, node: str) -> str:
        return f"dml{self.bed_id}{node}"[:15]

    @classmethod
    def create(cls, base_dir: Path) -> Network:
        """Reap dead beds, claim a free /24, and bring the bridge up."""
        REGISTRY.mkdir(parents=True, exist_ok=True)
        reap_stale()
        bed_id = secrets.token_hex(3)
        used = ip("-4", "route", "show", check=False).stdout
        for subnet in range(1, 255):
            if f"{SUBNET_PREFIX}.{subnet}." in used:
                continue
            fd = os.open(REGISTRY / f"net-{subnet}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            network = cls(bed_id, subnet, fd)
            break
        else:
            raise NetError(f"no free {SUBNET_PREFIX}.K.0/24 left for a test bed")
        record = {"owner_pid": os.getpid(), "bed_id": bed_id, "subnet": subnet, "base_dir": str(base_dir)}
        # No bed holds the network until this returns, so nobody's stop() removes it and reap_stale() skips
        # it while this process lives: a failure part way undoes here what was made, then re-raises.
        bridge_added = False
        try:
            (REGISTRY / f"bed-{bed_id}.json").write_text(json.dumps(record))
            ip("link", "add", network.bridge, "type", "bridge")
            bridge_added = True
            ip("addr", "add", f"{network.gateway}/24", "dev", network.bridge)
            ip("link", "set", network.bridge, "up")
        except BaseException:
            if bridge_added:  # only ours: a failed `link add` may mean another bed's bridge has the name
                with contextlib.suppress(Exception):
                    ip("link", "del", network.bridge, check=False)
            with contextlib.suppress(OSError):
                os.close(network.lock_fd)
            with contextlib.suppress(OSError):
                (REGISTRY / f"bed-{bed_id}.json").unlink(missing_ok=True)
            raise
        return network

    def add_namespace(self, node: str) -> tuple[str, str]:
        """A namespace for ``node`` wired to the bridge; returns (namespace, address)."""
        ns, veth = self.namespace(node), self.veth(node)
        address = f"{SUBNET_PREFIX}.{self.subnet}.{self.next_host}"
        self.next_host += 1
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        return ns, address

    def cut(self, node: str) -> None:
        """Pull the node's cable: peers see silence, not a closed connection (a crashed machine)."""
        ip("link", "set", self.veth(node), "down", check=False)

    def remove_namespace(self, node: str) -> None:
        ns = self.namespace(node)
        if ns in namespaces():
            kill_namespace_processes(ns)
        _remove(ns, self.veth(node))

    def destroy(self) -> None:
        """Remove every namespace, link and the bridge of this bed, and release the subnet."""
        _destroy_bed(self.bed_id)
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)
        with contextlib.suppress(FileNotFoundError):
            (REGISTRY / f"bed-{self.bed_id}.json").unlink()


def _remove(ns: str | None, veth: str | None) -> None:
    if veth and veth in links():
        ip("link", "del", veth, check=False)  # deletes both ends of the pair now, not when the ns dies
    if ns and ns in namespaces():
        ip("netns", "del", ns, check=False)


def _destroy_bed(bed_id: str) -> None:
    prefix = f"{NS_PREFIX}{bed_id}-"
    for ns in namespaces():
        if ns.startswith(prefix):
            kill_namespace_processes(ns)
    for link in links():
        if link.startswith(f"dml{bed_id}"):
            ip("link", "del", link, check=False)
    for ns in namespaces():
        if ns.startswith(prefix):
            ip("netns", "del", ns, check=False)
    if f"dmlb{bed_id}" in links():
        ip("link", "del", f"dmlb{bed_id}", check=False)


def leftovers(bed_id: str, base_dir: Path | None = None) -> list[str]:
    """What a torn-down bed left behind (empty when teardown was complete)."""
    found = [f"namespace {ns}" for ns in namespaces() if ns.startswith(f"{NS_PREFIX}{bed_id}-")]
    found += [f"link {link}" for link in links() if link.startswith((f"dml{bed_id}", f"dmlb{bed_id}"))]
    if base_dir is not None:
        if base_dir.exists():
            found.append(f"directory {base_dir}")
        with open("/proc/self/mountinfo") as mounts:
            found += [f"mount {line.split()[4]}" for line in mounts if str(base_dir) in line]
    if (REGISTRY / f"bed-{bed_id}.json").exists():
        found.append(f"registry entry bed-{bed_id}.json")
    return found


def reap_stale() -> list[str]:
    """Tear down beds whose owning process is gone; returns their ids."""
    reaped = []
    for entry in sorted(REGISTRY.glob("bed-*.json")):
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(record.get("owner_pid", 0))):
            continue
        _destroy_bed(record["bed_id"])
        base = record.get("base_dir")
        if base:
            shutil.rmtree(base, ignore_errors=True)
        entry.unlink(missing_ok=True)
        reaped.append(record["bed_id"])
    return reaped
