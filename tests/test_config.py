"""Config: every shipped experiment validates; typos and wrong types name the key and the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
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
    with pytest.raises(ConfigError, match=r"loss\.num_bins: a key of loss.name=fastap, not of smoothap"):
        load_config(path)
    # Switching the loss by its name keeps the other loss's keys: said so, not "unknown key (typo?)"
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS[0].parent / "quickstart.yaml", ["loss.name=fastap"])
    assert str(caught.value).splitlines()[1] == (
        "  loss.temperature: a key of loss.name=smoothap, not of fastap (replace the whole section: "
        "loss={name: fastap})"
    )
    with pytest.raises(ConfigError, match=r"loss\.tempratur: unknown key \(typo\?\)"):
        load_config(CONFIGS[0].parent / "quickstart.yaml", ["loss.tempratur=0.1"])


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
        load_config(path, ["train.global_batch_size=129", "scaling.num_workers=2"])
    with pytest.raises(ConfigError) as tiny:  # it named neither key nor number
        load_config(path, ["train.global_batch_size=2"])
    assert (
        "train.global_batch_size=2 over scaling.num_workers=1 is 2 images per worker, fewer than "
        "sampler.samples_per_class=4" in str(tiny.value)
    )
    profiled = load_config(path, ["train.profile_start=599", "train.profile_steps=2"])  # steps 599-600
    assert (profiled.train.profile_start, profiled.train.profile_steps) == (599, 2)
    with pytest.raises(
        ConfigError, match=r"train\.profile_start=600 with train\.profile_steps=2 .* train\.steps=600"
    ):
        load_config(path, ["train.profile_start=600", "train.profile_steps=2"])
    with pytest.raises(ConfigError, match=r"train\.profile_start"):
        load_config(path, ["train.profile_start=0"])
    # A warm-up longer than the run never reached optim.lr (warmup_steps=100000 over 600 steps ended at
    # 0.6% of it), silently; one as long as the run reaches it at the last step.
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps=601 is longer than train\.steps=600"):
        load_config(path, ["optim.warmup_steps=601"])
    assert load_config(path, ["optim.warmup_steps=600"]).optim.warmup_steps == 600


def test_booleans_infinities_and_paths_in_a_name_are_refused() -> None:
    """YAML's true was read as 1 (train.steps=true trained one step), .inf passed as a learning rate, and
    run.name=../x put the checkpoints outside run.storage_path."""
    path = CONFIGS[0].parent / "quickstart.yaml"
    for override, line in (
        ("train.steps=true", "train.steps: expected an integer, got the boolean true"),
        ("optim.lr=false", "optim.lr: expected a number, got the boolean false"),
        ("loss.temperature=true", "loss.temperature: expected a number, got the boolean true"),
        ("eval.ks=[1,true]", "eval.ks: expected numbers, got the boolean true"),
        ("data.crop_scale=[false,1.0]", "data.crop_scale: expected numbers, got the boolean false"),
        ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
        ("optim.grad_clip=.nan", "optim.grad_clip: Input should be a finite number"),
        (
            "run.name=../escape",
            "run.name: must be a plain name (a folder under run.storage_path), got '../escape'",
        ),
        ("run.name=a/b", "run.name: must be a plain name"),
    ):
        with pytest.raises(ConfigError) as caught:
            load_config(path, [override])
        assert line in str(caught.value), (override, str(caught.value))
    # Settings whose type includes a boolean still take one.
    config = load_config(path, ["train.compile=false", "model.freeze_bn=false", "run.name=quick.start-2"])
    assert config.train.compile is False and config.model.freeze_bn is False


def test_building_the_glyphs_into_a_url_is_refused() -> None:
    """data.prepare=glyphs with data.root=s3://bucket/x wrote 92 MB into ./s3:/bucket/x, then failed reading
    the real URL."""
    path = CONFIGS[0].parent / "quickstart.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["data.root=s3://bucket/x"])
    message = str(caught.value)
    assert (
        "data: prepare=glyphs builds the data set on this machine, so root must be a local directory"
        in message
    )
    assert load_config(path, ["data.root=s3://bucket/x", "data.prepare=null"]).data.root == "s3://bucket/x"


def test_worker_environment_keys(tmp_path: Path) -> None:
    from dmltrain.service.run import worker_env_vars

    path = CONFIGS[0].parent / "quickstart.yaml"
    assert worker_env_vars(load_config(path)) == {
        "GOMP_SPINCOUNT": "10000",  # brief: spin about 0.1 ms, then sleep
        "RAY_worker_niceness": "0",
        "DMLTRAIN_LOADER_PRIORITY": "idle",
        # keep_freed_memory auto on CPU workers: one arena, 1 GiB thresholds
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_THRESHOLD_": "1073741824",
        "MALLOC_TRIM_THRESHOLD_": "1073741824",
    }
    inherited = [
        "scaling.omp_wait_policy=null",
        "scaling.worker_niceness=null",
        "data.loader_priority=normal",
        "scaling.keep_freed_memory=false",
    ]
    assert worker_env_vars(load_config(path, inherited)) == {"DMLTRAIN_LOADER_PRIORITY": "normal"}
    # torch.compile's compiler processes: as many as the worker's CPUs, where it compiles (auto: GPUs)
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in worker_env_vars(load_config(path))
    eight = load_config(path, ["scaling.cpus_per_worker=12"])
    assert worker_env_vars(eight, use_gpu=True)["TORCHINDUCTOR_COMPILE_THREADS"] == "12"
    assert worker_env_vars(load_config(path, ["train.compile=true"]))["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
    # auto keeps glibc's defaults on GPU workers; true sets them there too
    assert "MALLOC_ARENA_MAX" not in worker_env_vars(load_config(path), use_gpu=True)
    assert "MALLOC_ARENA_MAX" in worker_env_vars(load_config(path), multi_node=True)
    forced = load_config(path, ["scaling.keep_freed_memory=true"])
    assert worker_env_vars(forced, use_gpu=True)["MALLOC_TRIM_THRESHOLD_"] == "1073741824"
    with pytest.raises(ConfigError, match=r"scaling\.keep_freed_memory"):
        load_config(path, ["scaling.keep_freed_memory=sometimes"])
    # auto loaders: idle only for CPU training on one node, with the workers at niceness 0
    assert worker_env_vars(load_config(path), multi_node=True)["DMLTRAIN_LOADER_PRIORITY"] == "normal"
    assert worker_env_vars(load_config(path), use_gpu=True)["DMLTRAIN_LOADER_PRIORITY"] == "normal"
    assert worker_env_vars(load_config(path, ["scaling.worker_niceness=5"]))["RAY_worker_niceness"] == "5"
    # auto: 0 only for CPU training on one node; Ray's default (unset) on GPU workers and across nodes
    assert "RAY_worker_niceness" not in worker_env_vars(load_config(path), multi_node=True)
    assert "RAY_worker_niceness" not in worker_env_vars(load_config(path), use_gpu=True)
    explicit = load_config(path, ["scaling.worker_niceness=0"])
    assert worker_env_vars(explicit, multi_node=True, use_gpu=True)["RAY_worker_niceness"] == "0"
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["scaling.worker_niceness=-5"])
    assert str(caught.value).splitlines()[1:] == [  # one line: the union's constrained member is no key
        "  scaling.worker_niceness: Input should be 'auto' or Input should be greater than or equal to 0 "
        "(got -5)"
    ]
    with pytest.raises(ConfigError, match=r"data\.loader_priority"):
        load_config(path, ["data.loader_priority=low"])
    assert load_config(path).data.cache_mb == 1024
    with pytest.raises(ConfigError, match=r"data\.cache_mb"):
        load_config(path, ["data.cache_mb=-1"])
    for policy, expected in [
        ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
        ("active", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "30000000000"}),
    ]:
        env = worker_env_vars(load_config(path, [f"scaling.omp_wait_policy={policy}"]))
        assert {k: v for k, v in env.items() if "OMP" in k} == expected
    with pytest.raises(ConfigError, match=r"scaling\.omp_wait_policy"):
        load_config(path, ["scaling.omp_wait_policy=spin"])


def test_numbers_and_text_read_as_written(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 rules read train.steps=010 as 8 (octal) and 1:00 as 60 (base 60), without a
    word; a name given as digits was refused (got 2024) or changed (0123 became 83)."""
    path = CONFIGS[0].parent / "quickstart.yaml"
    config = load_config(
        path, ["train.steps=010", "optim.lr=1e-4", "run.name=0123", "mlflow.experiment=2024"]
    )
    assert (config.train.steps, config.optim.lr) == (10, 1e-4)
    assert (config.run.name, config.mlflow.experiment) == ("0123", "2024")
    assert load_config(path, ["eval.ks=[1, 010]"]).eval.ks == (1, 10)
    for bad in ("train.steps=1:00", "optim.lr=1:30"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(path, [bad])
    in_file = tmp_path / "octal.yaml"
    in_file.write_text(path.read_text().replace("steps: 600", "steps: 0600"))
    assert load_config(in_file).train.steps == 600
    # Keys with empty parts and values that are not YAML are one line naming the override.
    for bad, message in (
        ("train..steps=5", "has an empty part"),
        ("optim.lr=[1,", "its value is not valid YAML"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"override {bad!r}") + ".*" + message) as caught:
            load_config(path, [bad])
        assert "\n" not in str(caught.value)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes(path.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {latin} is not UTF-8 text"):
        load_config(latin)
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} cannot be read|not found"):
        load_config(tmp_path)
    # Empty names reached MLflow after Ray had started (experiment) or were skipped silently (register_as).
    for key in ("mlflow.experiment", "mlflow.register_as"):
        with pytest.raises(ConfigError, match=rf"{key}: String should have at least 1 character"):
            load_config(path, [f'{key}=""'])


def test_missing_file_and_required_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = _write(tmp_path, lambda raw: raw.pop("run"))
    with pytest.raises(ConfigError, match=r"run: required key is missing"):
        load_config(path)


def test_a_key_given_twice_and_broken_yaml_name_the_file_and_lines(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys without a word (a file saying steps: 20, then steps: 30
    trained 30 steps); its syntax errors named "<unicode string>" instead of the file."""
    twice = tmp_path / "twice.yaml"
    quickstart = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    twice.write_text(quickstart.read_text() + "\ntrain:\n  steps: 5\n")
    with pytest.raises(
        ConfigError, match=rf"config file {twice} is not valid YAML: key 'train' appears twice"
    ):
        load_config(twice)
    inner = tmp_path / "inner.yaml"
    inner.write_text("train:\n  steps: 20\n  log_every: 5\n  steps: 30\n")
    with pytest.raises(ConfigError, match=r"key 'steps' appears twice \(lines 2 and 4\)"):
        load_config(inner)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [\n")
    with pytest.raises(ConfigError) as error:
        load_config(broken)
    assert f'in "{broken}", line 2' in str(error.value) and "<unicode string>" not in str(error.value)


def test_yaml_round_trip_and_flatten(tmp_path: Path) -> None:
    config = load_config(CONFIGS[0].parent / "quickstart.yaml")
    copy = tmp_path / "resolved.yaml"
    copy.write_text(to_yaml(config))
    assert load_config(copy) == config
    flat = flatten(config)
    assert flat["loss.name"] == "smoothap" and flat["train.steps"] == str(config.train.steps)
    # MLflow params read as config.yaml writes the values (a search for params.data.flip = 'false' found
    # nothing when they were Python's False/None), and an empty mapping is kept
    assert (flat["data.flip"], flat["data.mean"], flat["model.backbone_kwargs"]) == ("false", "null", "{}")
    assert flat["eval.ks"] == "[1, 2, 4, 8]" and flat["optim.lr"] == str(config.optim.lr)


@pytest.mark.parametrize(
    ("root", "storage", "expected_root", "expected_storage"),
    [
        ("data/glyphs", "runs", "{base}/data/glyphs", "{base}/runs"),
        ("/abs/data", "/abs/runs", "/abs/data", "/abs/runs"),
        ("s3://bucket/sop", "s3://bucket/runs", "s3://bucket/sop", "s3://bucket/runs"),
        ("https://host/sop", "gs://bucket/runs", "https://host/sop", "gs://bucket/runs"),
        ("file:///abs/data", "runs", "file:///abs/data", "{base}/runs"),
        ("pipe:aws s3 cp s3://b/x -", "runs", "pipe:aws s3 cp s3://b/x -", "{base}/runs"),
        # ~ as a shell expands it (Ray wrote to ./~/ray_results while the checks probed the home folder)
        ("~/data", "~/runs", f"{Path.home()}/data", f"{Path.home()}/runs"),
    ],
)
def test_launch_resolves_only_relative_local_paths(
    tmp_path: Path, root: str, storage: str, expected_root: str, expected_storage: str
) -> None:
    """Ray workers run in another directory: relative paths become absolute, URLs stay as written."""
    from dmltrain.service.run import resolve_paths

    config = load_config(
        CONFIGS[0].parent / "quickstart.yaml",
        [f"data.root={root}", f"run.storage_path={storage}", "data.prepare=null"],
    )
    resolved = resolve_paths(config, base=tmp_path)
    base = str(tmp_path.resolve())
    assert resolved.data.root == expected_root.format(base=base)
    assert resolved.run.storage_path == expected_storage.format(base=base)


@pytest.mark.parametrize(
    ("name", "paper", "batch", "classes"),
    [("sop_smoothap_b16k", "sop_smoothap", 16384, 11318), ("inat_smoothap_b8k", "inat_smoothap", 8192, 5690)],
)
def test_large_batch_configs_keep_the_method_and_state_their_memory(
    name: str, paper: str, batch: int, classes: int
) -> None:
    """Only the batch (and what follows from it) differs from the paper config; the file says its memory."""
    path = CONFIGS[0].parent / f"{name}.yaml"
    big, base = load_config(path), load_config(path.parent / f"{paper}.yaml")
    assert big.train.global_batch_size == batch and big.train.chunk_size == 256
    assert big.local_batch_size == batch // 8 and big.local_batch_size % big.train.chunk_size == 0
    assert batch // big.sampler.samples_per_class <= classes  # classes per step the data set has
    # the same number of images seen as the paper config
    assert big.train.steps * batch == base.train.steps * base.train.global_batch_size
    for section in ("model", "loss", "optim"):
        assert getattr(big, section) == getattr(base, section), section
    assert big.data.resize_mode == base.data.resize_mode and big.data.crop_scale == base.data.crop_scale
    if base.sampler.name == "pk":
        assert big.sampler == base.sampler
    else:  # SOP's category pairs cannot hold half of 16,384 images: P x K at the paper's |P| = 4
        assert big.sampler.name == "pk" and big.sampler.samples_per_class == 4
    assert (big.train.precision, big.train.compile, big.train.channels_last) == ("auto", "auto", "auto")
    header = path.read_text().split("\ndata:")[0]
    assert "Memory per GPU" in header and "10.7 GB" in header and "total: about" in header


def test_precision_compile_and_memory_keys_validate(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda raw: None)
    config = load_config(
        path,
        [
            "train.precision=fp16",
            "train.compile=false",
            "train.channels_last=true",
            "loss.saved_budget_mb=512",
        ],
    )
    assert (config.train.precision, config.train.compile, config.train.channels_last) == ("fp16", False, True)
    assert config.loss.saved_budget_mb == 512 and config.loss.memory_budget_mb is None
    for bad, key in (
        ("train.precision=fp8", "train.precision"),
        ("train.compile=sometimes", "train.compile"),
        ("loss.memory_budget_mb=0", "loss.memory_budget_mb"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(path, [bad])


# ---------------------------------------------------------------------------------------------------------
# the paper set-ups, checked against the papers (sections cited in each file's comments)


def _paper(name: str):
    return load_config(CONFIGS[0].parent / f"{name}.yaml")


def test_paper_configs_warp_images_to_256_then_crop_224() -> None:
    """FastAP 5.1, Smooth-AP 5.3 and RLL 4.1.2 all warp every image to 256 x 256 (train and test)."""
    for name in PAPER_SETUPS - {"quickstart", "sop_triplet"}:
        data = _paper(name).data
        assert (data.resize_mode, data.resize, data.image_size) == ("warp", 256, 224), name


def test_smoothap_configs_follow_section_5_3_and_supplement_11() -> None:
    for name in ("sop_smoothap", "inat_smoothap", "vehicleid_smoothap"):
        c = _paper(name)
        assert (c.loss.temperature, c.optim.name, c.optim.lr, c.optim.weight_decay) == (
            0.01,
            "adam",
            1e-5,
            4e-5,
        )
        assert (c.model.backbone, c.model.embedding_dim) == ("resnet50", 512), name
    assert _paper("sop_smoothap").sampler.name == "hard"  # hard negative mining on SOP only (5.3)
    assert _paper("inat_smoothap").sampler.name == _paper("vehicleid_smoothap").sampler.name == "pk"
    assert _paper("inat_smoothap").optim.embedding_lr_mult == 2.0  # supplement 11
    assert _paper("sop_smoothap").optim.embedding_lr_mult == 1.0  # none given
    assert _paper("vehicleid_smoothap").optim.embedding_lr_mult == 1.0


def test_fastap_configs_follow_section_5_1_and_supplement_a() -> None:
    for name, sampler, per_pair in (
        ("sop_fastap", "hard", 5),
        ("inshop_fastap", "hard", 2),
        ("vehicleid_fastap", "vehicleid", None),
    ):
        c = _paper(name)
        assert (c.optim.name, c.optim.lr, c.optim.weight_decay, c.optim.embedding_lr_mult) == (
            "adam",
            1e-5,
            0.0,
            10.0,
        )
        assert (c.loss.num_bins, c.model.embedding_dim, c.sampler.name) == (10, 512, sampler), name
        assert c.sampler.batches_per_pair == per_pair, name


def test_rll_configs_follow_section_4_1() -> None:
    expected = {  # name: (embedding size, BatchNorm frozen, C x K batch)
        "sop_rll": (128, False, 180),  # Table V; 4.1.3; 4.1.6
        "inshop_rll": (128, False, 66),  # Table II
        "cub_rll": (64, True, 66),  # Table IV
        "cars_rll": (64, True, 66),  # Table III
    }
    for name, (dim, frozen, batch) in expected.items():
        c = _paper(name)
        assert (c.model.embedding_dim, c.model.freeze_bn, c.train.global_batch_size) == (
            dim,
            frozen,
            batch,
        ), name
        assert (c.sampler.name, c.sampler.samples_per_class, c.data.crop_scale) == ("pk", 3, (0.5, 1.0)), name
        assert (c.optim.name, c.optim.lr, c.optim.momentum, c.optim.weight_decay) == ("sgd", 1e-2, 0.9, 2e-5)
        assert (c.loss.margin, c.loss.alpha, c.loss.tn, c.loss.tp, c.loss.lam) == (0.4, None, 10.0, 0.0, 0.5)
        assert c.loss.gradient == "query", name  # Sec. 3.2: the other features are constants
        if not frozen:  # live BatchNorm: the whole batch in one chunk on one worker, as on the paper's GPU
            assert c.scaling.num_workers == 1 and c.train.chunk_size >= batch, name


def test_config_comments_agree_with_chunk_size() -> None:
    """A comment such as 'chunking 128' must not contradict the chunk_size the file sets."""
    import re

    for path in CONFIGS:
        config = load_config(path)
        for claim in re.findall(r"chunking (?:its )?(\d+)", path.read_text()):
            assert int(claim) in (config.train.chunk_size, config.local_batch_size), (path.name, claim)


def test_triplet_config_runs_whole_triplets_and_scores_the_sampled_ones(tmp_path: Path) -> None:
    c = _paper("sop_triplet")
    assert c.sampler.name == "triplet" and c.local_batch_size % 3 == 0
    assert c.loss.triplets == "sampled"
    path = _write(tmp_path, lambda raw: raw.update(loss={"name": "triplet"}))  # quickstart's pk sampler
    with pytest.raises(ConfigError, match="loss.triplets=sampled .* sampler.name is 'pk'"):
        load_config(path)
    assert load_config(path, ["loss.triplets=all"]).loss.triplets == "all"
    with pytest.raises(ConfigError, match=r"multiple of 3") as error:
        load_config(path, ["sampler.name=triplet"])  # 128 images on the one worker
    assert "got {" not in str(error.value)  # one readable line, not the whole config echoed back
    assert (
        load_config(
            path, ["sampler.name=triplet", "train.global_batch_size=126", "scaling.num_workers=2"]
        ).local_batch_size
        == 63
    )


def test_rll_gradient_and_resize_mode_keys_are_validated(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda raw: raw.update(loss={"name": "rll", "gradient": "query"}))
    assert load_config(path).loss.gradient == "query"
    with pytest.raises(ConfigError, match=r"loss\.rll\.gradient|loss\.gradient"):
        load_config(path, ["loss.gradient=gallery"])
    with pytest.raises(ConfigError, match=r"data\.resize_mode"):
        load_config(path, ["data.resize_mode=stretch"])


def test_live_batchnorm_is_announced_once_when_it_breaks_the_exact_gradient() -> None:
    from dmltrain.service.run import batchnorm_note

    quickstart = CONFIGS[0].parent / "quickstart.yaml"
    quick = load_config(quickstart, ["model.freeze_bn=false", "scaling.num_workers=2"])
    note = batchnorm_note(quick)
    assert note is not None and "model.freeze_bn=false" in note and "not the exact" in note
    assert batchnorm_note(load_config(quickstart)) is None  # frozen as shipped
    # one worker embedding its whole batch in one chunk: live BatchNorm sees the global batch
    assert batchnorm_note(load_config(quickstart, ["model.freeze_bn=false"])) is None
    assert batchnorm_note(_paper("sop_rll")) is None  # one worker, one chunk: BN sees the whole batch
    assert batchnorm_note(_paper("sop_rll").model_copy(update={"scaling": quick.scaling})) is not None


def test_loss_options_reach_the_loss_objects() -> None:
    from dmltrain.service.builders import build_loss

    rll = build_loss(_paper("sop_rll").loss)
    triplet = build_loss(_paper("sop_triplet").loss)
    assert rll.gradient == "query" and rll.gallery_is_constant
    assert triplet.triplets == "sampled" and triplet.margin == 0.2
    quick = load_config(CONFIGS[0].parent / "quickstart.yaml", ["loss={name: rll}"])
    assert build_loss(quick.loss).gradient == "both"


def test_resize_mode_reaches_the_preprocessing_and_both_transforms(tmp_path: Path) -> None:
    """data.resize_mode overrides the backbone's resize rule (warp = squash) for train and test alike; left
    unset, the backbone's own rule (torchvision: the shorter side) applies."""
    from dmltrain.service.builders import resolve_preprocessing

    paper = resolve_preprocessing(_paper("sop_smoothap"))
    assert (paper.crop_mode, paper.resize_mode) == ("squash", "warp")
    assert (paper.resolution, paper.resize) == (224, 256)
    assert paper.train_transform((0.16, 1.0)).warp == 256
    path = _write(tmp_path, lambda raw: None)
    plain = resolve_preprocessing(load_config(path))
    assert plain.resize_mode == "shorter_side" and plain.train_transform((0.5, 1.0)).warp is None
    image = torch.zeros(3, 40, 80, dtype=torch.uint8)
    image[:, :, :8] = 255  # a bright band at the left edge: only a warp keeps it inside the centre crop
    warped = resolve_preprocessing(load_config(path, ["data.resize_mode=warp"])).test_transform()(image)
    kept = plain.test_transform()(image)
    assert warped.shape == kept.shape and warped.max() > 0 and kept.max() == 0
