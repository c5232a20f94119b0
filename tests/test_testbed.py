"""Fast checks of the test bed's pieces and of checkpoint naming, without building a cluster."""

from __future__ import annotations

import os

import pytest

from dmltrain.service.checkpoints import checkpoint_dir_name, checkpoint_dir_step, checkpoint_uri
from dmltrain.service.testbed import bed_requirements
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
