"""Config: every shipped experiment validates; typos and wrong types name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dmltrain.service.config import ConfigError, flatten, load_config, to_yaml

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
PAPER_SETUPS = {
    "sop_fastap",
    "inshop_fastap",
    "vehicleid_fastap",
    "sop_smoothap",
    "inat_smoothap",
    "vehicleid_smoothap",
    "sop_rll",
    "inshop_rll",
    "cub_rll",
    "cars_rll",
    "sop_triplet",
    "quickstart",
}


def test_every_paper_setup_ships_and_validates() -> None:
    assert {p.stem for p in CONFIGS} >= PAPER_SETUPS
    for path in CONFIGS:
        config = load_config(path)
        assert config.train.global_batch_size % config.scaling.num_workers == 0, path


def test_paper_hyperparameters() -> None:
    smoothap = load_config(CONFIGS[0].parent / "inat_smoothap.yaml")
    assert (smoothap.loss.name, smoothap.loss.temperature, smoothap.sampler.samples_per_class) == (
        "smoothap",
        0.01,
        4,
    )
    assert (smoothap.optim.name, smoothap.optim.lr, smoothap.optim.weight_decay) == ("adam", 1e-5, 4e-5)
    rll = load_config(CONFIGS[0].parent / "sop_rll.yaml")
    assert (rll.optim.name, rll.optim.lr, rll.loss.margin, rll.loss.tn) == ("sgd", 1e-2, 0.4, 10.0)
    assert rll.train.global_batch_size == 180 and rll.data.crop_scale == (0.5, 1.0)
    fastap = load_config(CONFIGS[0].parent / "sop_fastap.yaml")
    assert (fastap.loss.num_bins, fastap.sampler.name, fastap.optim.embedding_lr_mult) == (10, "hard", 10.0)


def _write(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load((CONFIGS[0].parent / "quickstart.yaml").read_text())
    mutate(raw)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_typo_names_key_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda raw: raw["optim"].update(lr_rate=0.1))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "optim.lr_rate" in str(error.value) and str(path) in str(error.value)
    assert "unknown key" in str(error.value)


def test_wrong_type_and_unknown_loss(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda raw: raw["train"].update(steps="many"))
    with pytest.raises(ConfigError, match=r"train\.steps"):
        load_config(path)
    path = _write(tmp_path, lambda raw: raw["loss"].update(name="arcface"))
    with pytest.raises(ConfigError, match=r"loss"):
        load_config(path)
    path = _write(tmp_path, lambda raw: raw["loss"].update(num_bins=10))  # a FastAP key on Smooth-AP
    with pytest.raises(ConfigError, match=r"loss\.num_bins"):
        load_config(path)


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    path = CONFIGS[0].parent / "quickstart.yaml"
    config = load_config(path, ["optim.lr=3e-4", "train.steps=7", "run.name=other", "loss.temperature=0.05"])
    assert config.optim.lr == pytest.approx(3e-4) and config.train.steps == 7 and config.run.name == "other"
    assert config.loss.temperature == pytest.approx(0.05)
    with pytest.raises(ConfigError, match=r"train\.stepz"):
        load_config(path, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(path, ["train.steps"])
    with pytest.raises(ConfigError, match="divisible"):
        load_config(path, ["train.global_batch_size=129"])


def test_worker_environment_keys(tmp_path: Path) -> None:
    from dmltrain.service.run import worker_env_vars

    path = CONFIGS[0].parent / "quickstart.yaml"
    assert worker_env_vars(load_config(path)) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_env_vars(load_config(path, ["scaling.omp_wait_policy=null"])) == {}
    with pytest.raises(ConfigError, match=r"scaling\.omp_wait_policy"):
        load_config(path, ["scaling.omp_wait_policy=spin"])


def test_missing_file_and_required_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = _write(tmp_path, lambda raw: raw.pop("run"))
    with pytest.raises(ConfigError, match=r"run: required key is missing"):
        load_config(path)


def test_yaml_round_trip_and_flatten(tmp_path: Path) -> None:
    config = load_config(CONFIGS[0].parent / "quickstart.yaml")
    copy = tmp_path / "resolved.yaml"
    copy.write_text(to_yaml(config))
    assert load_config(copy) == config
    flat = flatten(config)
    assert flat["loss.name"] == "smoothap" and flat["train.steps"] == str(config.train.steps)


@pytest.mark.parametrize(
    ("root", "storage", "expected_root", "expected_storage"),
    [
        ("data/glyphs", "runs", "{base}/data/glyphs", "{base}/runs"),
        ("/abs/data", "/abs/runs", "/abs/data", "/abs/runs"),
        ("s3://bucket/sop", "s3://bucket/runs", "s3://bucket/sop", "s3://bucket/runs"),
        ("https://host/sop", "gs://bucket/runs", "https://host/sop", "gs://bucket/runs"),
        ("file:///abs/data", "runs", "file:///abs/data", "{base}/runs"),
        ("pipe:aws s3 cp s3://b/x -", "runs", "pipe:aws s3 cp s3://b/x -", "{base}/runs"),
    ],
)
def test_launch_resolves_only_relative_local_paths(
    tmp_path: Path, root: str, storage: str, expected_root: str, expected_storage: str
) -> None:
    """Ray workers run in another directory: relative paths become absolute, URLs stay as written."""
    from dmltrain.service.run import resolve_paths

    config = load_config(
        CONFIGS[0].parent / "quickstart.yaml", [f"data.root={root}", f"run.storage_path={storage}"]
    )
    resolved = resolve_paths(config, base=tmp_path)
    base = str(tmp_path.resolve())
    assert resolved.data.root == expected_root.format(base=base)
    assert resolved.run.storage_path == expected_storage.format(base=base)
