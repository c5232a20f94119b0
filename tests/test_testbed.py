"""Fast checks of the test bed's pieces and of checkpoint naming, without building a cluster."""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import subprocess
from pathlib import Path

import pytest

import dmltrain.service.testbed.__main__ as testbed_main
import dmltrain.service.testbed.bed as bed_module
import dmltrain.service.testbed.netns as netns
from dmltrain.service.checkpoints import checkpoint_dir_name, checkpoint_dir_step, checkpoint_uri
from dmltrain.service.testbed import BedError, NetError, TestBed, bed_requirements
from dmltrain.service.testbed.netns import Network


def test_bed_says_why_it_cannot_run_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    why = bed_requirements()
    assert why is not None and "root" in why


def test_bed_names_fit_linux_interface_names() -> None:
    network = Network(bed_id="a1b2c3", subnet=7, lock_fd=-1)
    for node in ("head", "w1", "w2", "w10"):
        assert len(network.veth(node)) <= 15 and network.veth(node).startswith("dmla1b2c3")
    assert len(network.bridge) <= 15 and network.gateway == "10.213.7.1"
    assert network.namespace("w1") == "dmlbed-a1b2c3-w1"


def test_checkpoint_directories_are_named_by_step() -> None:
    assert checkpoint_dir_name(300) == "checkpoint_000000300"
    assert checkpoint_dir_step("/mnt/shared/ray-results/run/checkpoint_000000300") == 300
    assert checkpoint_dir_step("bucket/ray-results/run/checkpoint_000000005/") == 5
    assert checkpoint_dir_step("/x/checkpoint_2026-11-23_12-02-30.518496") is None  # Ray's own naming
    assert checkpoint_uri("/mnt/shared/rr", "run", 5) == "/mnt/shared/rr/run/checkpoint_000000005"
    assert checkpoint_uri("s3://bucket/rr/", "run", 5) == "s3://bucket/rr/run/checkpoint_000000005"


class FakeIp:
    """Stands in for `ip` (no real network state is touched): keeps the links and namespaces commands made,
    and fails the first command that starts with ``fail`` as `ip` would (NetError, or rc 2 unchecked)."""

    def __init__(self, fail: tuple[str, ...]) -> None:
        self.fail = fail
        self.failed = False
        self.links: set[str] = set()
        self.namespaces: set[str] = set()
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.calls.append(args)
        if not self.failed and args[: len(self.fail)] == self.fail:
            self.failed = True
            if check:
                raise NetError(f"ip {' '.join(args)}: RTNETLINK answers: Operation not permitted")
            return subprocess.CompletedProcess(
                ["ip", *args], 2, "", "RTNETLINK answers: Operation not permitted"
            )
        out = ""
        if args[:2] == ("link", "add"):
            self.links.add(args[2])
        elif args[:2] == ("link", "del"):
            self.links.discard(args[2])
        elif args[:2] == ("netns", "add"):
            self.namespaces.add(args[2])
        elif args[:2] == ("netns", "del"):
            self.namespaces.discard(args[2])
        elif args == ("-o", "link", "show"):
            out = "".join(f"{i}: {name}: <BROADCAST,UP> mtu 1500\n" for i, name in enumerate(self.links, 1))
        elif args[:2] == ("netns", "list"):
            out = "".join(f"{name}\n" for name in self.namespaces)
        return subprocess.CompletedProcess(["ip", *args], 0, out, "")


@pytest.fixture
def fake_ip(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeIp:
    fake = FakeIp(request.param)
    monkeypatch.setattr(netns, "REGISTRY", tmp_path / "registry")
    monkeypatch.setattr(netns, "ip", fake)
    monkeypatch.setattr(bed_module, "bed_requirements", lambda: None)
    return fake


def _assert_nothing_left(fake: FakeIp, bed: TestBed) -> None:
    assert fake.failed
    assert fake.links == set() and fake.namespaces == set()
    assert sorted(p.name for p in netns.REGISTRY.glob("bed-*.json")) == []
    for lock in netns.REGISTRY.glob("net-*.lock"):  # the subnet is free again: its flock was released
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not bed.base.exists()
    assert bed.leftovers() == []


FAILING_STEPS = [
    ("link", "add"),  # the bridge: nothing of ours exists yet, and nobody's bridge may be deleted
    ("addr", "add"),  # the bridge exists, without its address
    ("link", "set"),  # the bridge has its address, is not up
    ("netns", "add"),  # the network is built, the head's namespace is not
    ("-n",),  # the head's namespace and veth pair exist, its address is not set
]


@pytest.mark.parametrize("fake_ip", FAILING_STEPS, indirect=True)
def test_bed_whose_network_fails_part_way_leaves_nothing_behind(fake_ip: FakeIp, tmp_path: Path) -> None:
    bed = TestBed(base=tmp_path / "base")
    bed.base.mkdir()
    with pytest.raises(BedError, match="RTNETLINK"), bed:
        pass
    _assert_nothing_left(fake_ip, bed)
    if fake_ip.fail == ("link", "add"):
        assert not [call for call in fake_ip.calls if call[:2] == ("link", "del")]


@pytest.mark.parametrize("fake_ip", [("addr", "add")], indirect=True)
def test_bed_command_reports_a_network_failure_without_a_traceback(
    fake_ip: FakeIp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setattr(testbed_main, "bed_requirements", lambda: None)
    monkeypatch.setattr(testbed_main, "TestBed", functools.partial(TestBed, base=base))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # main() installs a SIGTERM handler
    assert testbed_main.main(["--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ip addr add ") and "Traceback" not in err and "left behind" not in err
    assert fake_ip.links == set() and not list(netns.REGISTRY.glob("bed-*.json")) and not base.exists()
