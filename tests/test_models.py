"""Embedding network: any torchvision backbone, L2-normalised output, local weight files, 10x head lr."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dmltrain.models import build_model, normalize_images
from dmltrain.service.builders import (
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    lr_factor,
    restore_schedule,
)
from dmltrain.service.config import OptimConfig


@pytest.mark.parametrize("backbone", ["resnet18", "mobilenet_v2", "googlenet"])
def test_backbones_give_unit_embeddings(backbone: str) -> None:
    torch.manual_seed(0)
    model = build_model(backbone, embedding_dim=16).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32) if backbone != "googlenet" else torch.randn(3, 3, 64, 64))
    assert out.shape == (3, 16)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


def test_unknown_backbone_and_weights_name() -> None:
    with pytest.raises(ValueError, match="model.backbone"):
        build_model("resnet19", 8)
    with pytest.raises(ValueError, match="model.weights"):
        build_model("resnet18", 8, weights="IMAGENET9K_V9")


def test_local_weights_file(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = build_model("resnet18", 8)
    full = tmp_path / "full.pt"
    torch.save({"model": source.state_dict()}, full)
    loaded = build_model("resnet18", 8, weights=str(full))
    for key, value in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)
    # A plain torchvision backbone file: the classifier is dropped, the backbone loads.
    import torchvision

    plain = torchvision.models.resnet18()
    backbone_file = tmp_path / "resnet18.pth"
    torch.save(plain.state_dict(), backbone_file)
    model = build_model("resnet18", 8, weights=str(backbone_file))
    torch.testing.assert_close(model.backbone.conv1.weight, plain.conv1.weight)
    with pytest.raises(FileNotFoundError, match="model.weights"):
        build_model("resnet18", 8, weights=str(tmp_path / "missing.pt"))


def test_head_learns_ten_times_faster() -> None:
    model = build_model("resnet18", 8)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.01, embedding_lr_mult=10))
    rates = {group["name"]: group["lr"] for group in optimizer.param_groups}
    assert rates == {"backbone": 0.01, "embedding": pytest.approx(0.1)}
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    assert n_params == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_optimizer_is_fused_on_cpu_and_matches_the_default(name: str) -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", 8)
    reference = build_model("resnet18", 8)
    reference.load_state_dict(model.state_dict())
    cfg = OptimConfig(name=name, lr=0.01, weight_decay=1e-4)
    fused = build_optimizer(model, cfg)
    assert all(group["fused"] for group in fused.param_groups)
    plain_groups = [
        {**{k: v for k, v in g.items() if k not in ("params", "fused")}, "params": list(r)}
        for g, r in zip(
            fused.param_groups,
            [reference.backbone.parameters(), reference.embedding.parameters()],
            strict=True,
        )
    ]
    plain = type(fused)(plain_groups)
    initial = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 3, 32, 32)
    for net, opt in ((model, fused), (reference, plain)):  # one update: later ones amplify rounding
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    for (key, value), other in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(value, other, rtol=1e-5, atol=1e-7, msg=key)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), initial, strict=True))


def test_resuming_an_unfused_optimizer_state_stays_fused() -> None:
    model = build_model("resnet18", 8)
    cfg = OptimConfig(name="adam", lr=0.01)
    old = build_optimizer(model, cfg)
    for group in old.param_groups:  # as checkpoints written before fusing have them
        group["fused"] = None
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    old.step()
    resumed = build_optimizer(model, cfg)
    load_optimizer_state(resumed, old.state_dict())
    assert all(group["fused"] for group in resumed.param_groups)
    assert resumed.state_dict()["state"][0]["step"].item() == 1.0


def test_schedule_shapes() -> None:
    cosine = OptimConfig(schedule="cosine", warmup_steps=10)
    assert lr_factor(cosine, 110, 0) == pytest.approx(0.1)
    assert lr_factor(cosine, 110, 10) == pytest.approx(1.0)
    assert lr_factor(cosine, 110, 110) == pytest.approx(0.0, abs=1e-9)
    step = OptimConfig(schedule="step", step_every=5, step_gamma=0.5)
    assert [lr_factor(step, 100, s) for s in (0, 4, 5, 10)] == [1.0, 1.0, 0.5, 0.25]


def test_normalize_images_grey_and_rgb() -> None:
    grey = torch.full((2, 1, 4, 4), 255, dtype=torch.uint8)
    out = normalize_images(grey)
    assert out.shape == (2, 3, 4, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out[0, 0, 0, 0], torch.tensor((1 - 0.485) / 0.229))


def test_a_resumed_optimizer_and_schedule_keep_this_launchs_settings() -> None:
    """run.resume=must with another optim.lr: torch restored the checkpoint's rates (param groups and the
    scheduler's base_lrs), so training went on at the old rate though the segment record said otherwise.
    train.steps under auto: a cosine decay spans the new length from the step it resumes at."""
    model = build_model("resnet18", 8)
    old_cfg = OptimConfig(name="adam", lr=0.01, weight_decay=1e-4, schedule="cosine")
    old = build_optimizer(model, old_cfg)
    old_schedule = build_scheduler(old, old_cfg, 100)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    for _ in range(50):
        old.step()
        old_schedule.step()
    new_cfg = OptimConfig(name="adam", lr=0.001, weight_decay=0.0, schedule="cosine")
    resumed = build_optimizer(model, new_cfg)
    schedule = build_scheduler(resumed, new_cfg, 200)
    load_optimizer_state(resumed, old.state_dict())
    restore_schedule(schedule, old_schedule.state_dict())
    assert schedule.last_epoch == 50 and resumed.state_dict()["state"][0]["step"].item() == 50.0
    bases = [0.001, 0.01]  # the backbone, the embedding layer at 10x
    assert [g["initial_lr"] for g in resumed.param_groups] == pytest.approx(bases)
    want = [base * lr_factor(new_cfg, 200, 50) for base in bases]
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx(want)
    assert schedule.get_last_lr() == pytest.approx(want)
    assert all(g["weight_decay"] == 0.0 for g in resumed.param_groups)
    schedule.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(0.001 * lr_factor(new_cfg, 200, 51))
