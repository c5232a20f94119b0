"""Typed experiment configuration: one YAML file per experiment plus dotted command-line overrides.

Every section forbids unknown keys, so a typo (``optim.lr_rate``) is an error that names the key and the
file instead of a silently ignored setting. The config is plain data: it can be validated, flattened for
MLflow and shipped to Ray workers without importing torch.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dmltrain.data.urls import is_local


def plain_folder_name(value: str) -> str:
    """``value`` if it names one folder under run.storage_path (a run's, a sweep's): ../x or a/b would put
    checkpoints elsewhere. A ValueError for a pydantic validator otherwise."""
    if not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError(f"must be a plain name (a folder under run.storage_path), got {value!r}")
    return value


class ConfigError(ValueError):
    """A configuration problem, with the file and key at fault in the message."""


def _type_name(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, "a number" if float in get_args(annotation) else "a value of its type")


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type lists ``bool`` (directly, in a union or in Literal values)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(value, bool) for value in get_args(annotation))
    return any(_admits_bool(arg) for arg in get_args(annotation))


class _Section(BaseModel):
    # No inf/nan in float settings (optim.lr=.inf trained on infinities); unknown keys are errors.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        """YAML's true/false are not numbers: pydantic read train.steps=true as 1 step."""
        if isinstance(data, Mapping):
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                items = value if isinstance(value, list | tuple) else [value]  # eval.ks=[true] too
                flag = next((v for v in items if isinstance(v, bool)), None)
                if flag is not None and field is not None and not _admits_bool(field.annotation):
                    expected = _type_name(field.annotation) if items is not value else "numbers"
                    raise PydanticCustomError(
                        "bool_not_number",
                        "{key}: expected {expected}, got the boolean {value}",  # see _describe_errors
                        {"key": key, "expected": expected, "value": str(flag).lower()},
                    )
        return data


class DataConfig(_Section):
    """Where the shards live and how images are turned into tensors."""

    root: str = Field(description="Directory or URL (s3://, gs://, https://) with dataset.json and shards.")
    prepare: Literal["glyphs"] | None = Field(
        default=None, description="Build this embedded data set into `root` on first use (no download)."
    )
    train_split: str = "train"
    image_size: int | None = Field(
        default=None, ge=8, description="Side of the square crop the network sees; None = the backbone's."
    )
    resize: int | None = Field(
        default=None,
        ge=8,
        description="Resize before cropping: the test-time shorter side (shorter_side) or the square every "
        "image is warped to for train and test (warp); None = the backbone's share.",
    )
    resize_mode: Literal["shorter_side", "warp"] | None = Field(
        default=None,
        description="shorter_side: train crops the original, test keeps the aspect ratio; warp: every image "
        "is first warped to resize x resize (FastAP 5.1, Smooth-AP 5.3, RLL 4.1.2); None = the backbone's "
        "(shorter_side, or warp for timm/open_clip models evaluated squashed).",
    )
    mean: tuple[float, float, float] | None = Field(default=None, description="None = the backbone's.")
    std: tuple[float, float, float] | None = Field(default=None, description="None = the backbone's.")
    interpolation: Literal["bilinear", "bicubic", "nearest"] | None = Field(
        default=None, description="Resize filter; None = the backbone's."
    )
    crop_scale: tuple[float, float] = Field(default=(0.16, 1.0), description="RandomResizedCrop scale range.")
    flip: bool = Field(
        default=True,
        description="Random horizontal flips in training (the papers). Off for data whose mirror image is "
        "another class: glyphs (b/d, acute/grave accents).",
    )
    loader_workers: int = Field(default=2, ge=0, description="DataLoader processes per Ray worker.")
    loader_priority: Literal["auto", "idle", "normal"] = Field(
        default="auto",
        description="CPU priority of the training loader processes: idle = Linux SCHED_IDLE, they use only "
        "cycles the training step leaves idle (on shared cores a loader that takes a core stalls the step's "
        "other threads: bench/service.py); normal = like any process; auto = idle for CPU training on a "
        "single node (with scaling.worker_niceness auto, the case measured), else normal.",
    )
    cache_mb: int = Field(
        default=1024,
        ge=0,
        description="Host memory (MB) each training worker's loader processes may keep their shards in after "
        "the first pass, read and (decode cpu) decoded, split evenly between them: from the second pass on "
        "no tar file is read and no image decoded again, only the crops and flips are new (the same "
        "batches). Used by a loader process only when all of its shards fit its share; 0 = off.",
    )
    decode: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Where training images are decoded and augmented: cpu = PIL in the loader workers; gpu = "
        "JPEGs in batches on the worker's GPU (nvJPEG), the loader workers only sample, read and draw the "
        "crops; auto = gpu on CUDA workers where torchvision decodes JPEGs, else cpu.",
    )
    host_decode_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Where data.decode resolves to gpu: the fraction of each batch's JPEGs that the loader "
        "workers still decode and augment with PIL (spread evenly over the batch). One host thread drives "
        "the GPU's decodes and on a fast GPU it can set the step's pace while the loader workers, which then "
        "only read and draw, have cores to spare. 0 = every JPEG on the GPU, 1 = all in the loader workers; "
        "the same crops either way. Ignored where decode resolves to cpu.",
    )

    @model_validator(mode="after")
    def _check_scale(self) -> DataConfig:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}")
        if self.image_size is not None and self.resize is not None and self.resize < self.image_size:
            raise ValueError(f"resize={self.resize} must be at least image_size={self.image_size}")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")
        if self.prepare is not None and not is_local(self.root):  # it built into ./s3:/bucket/...
            raise ValueError(  # the URL is not repeated: it may hold a password
                f"prepare={self.prepare} builds the data set on this machine, so root must be a local "
                "directory, not a URL: build it locally, copy it there, and set prepare to null"
            )
        return self


class SamplerConfig(_Section):
    """Class-level batch construction (papers: FastAP Sec. 4.2, Smooth-AP Sec. 5.3, RLL Sec. 4.1)."""

    name: Literal["pk", "hard", "vehicleid", "random", "triplet"] = "pk"
    samples_per_class: int = Field(default=4, ge=1, description="K images per class (Smooth-AP |P|).")
    pool_images: int | None = Field(
        default=None,
        ge=1,
        description="Images buffered per loader worker; None = max(8 x its part of the batch, 1024).",
    )
    batches_per_pair: int | None = Field(
        default=None, ge=1, description="hard: batches per category pair; None = dataset hint (SOP 5)."
    )
    in_category_negatives: float = Field(
        default=0.5, ge=0, le=1, description="triplet: share of negatives from the query's own category."
    )
    seed: int = 0


class ModelConfig(_Section):
    """Backbone with its classifier replaced by a linear embedding and L2 normalisation."""

    backbone: str = Field(
        default="resnet50",
        description="torchvision name (resnet50), timm:<name> (timm:vit_small_patch14_dinov2) or "
        "open_clip:<name> (open_clip:ViT-B-32).",
    )
    embedding_dim: int = Field(default=512, ge=1, description="Output size (all levels together).")
    weights: str | None = Field(
        default=None,
        description="None (random init); named weights: torchvision (IMAGENET1K_V2, DEFAULT), timm (DEFAULT "
        "or a pretrained tag), open_clip (a pretrained tag such as openai); or a local file path.",
    )
    pooling: Literal["avg", "gem"] = Field(
        default="avg", description="gem: learnable generalized-mean pooling for CNNs (Radenovic et al.)."
    )
    gem_p: float = Field(default=3.0, gt=0, description="Initial GeM exponent.")
    multilevel: bool | list[str] = Field(
        default=False,
        description="RLL multi-level embedding: true (three default depths) or the feature names to tap.",
    )
    backbone_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the library's model constructor."
    )
    freeze_bn: bool = Field(
        default=True,
        description="BatchNorm in eval mode while training (papers). false: each chunk on each worker is "
        "normalised with its own batch statistics, so the step is no longer the exact global-batch gradient "
        "(it changes with train.chunk_size and scaling.num_workers).",
    )

    @model_validator(mode="after")
    def _check_levels(self) -> ModelConfig:
        if isinstance(self.multilevel, list) and len(self.multilevel) < 2:
            raise ValueError("multilevel lists at least two feature names (or is true)")
        return self


class _LossSection(_Section):
    """Memory of the loss call; None = from the device (see dmltrain.losses.RankingLoss)."""

    memory_budget_mb: float | None = Field(
        default=None, gt=0, description="Working memory of one block of queries; None: 64 MB CPU, CUDA auto."
    )
    saved_budget_mb: float | None = Field(
        default=None, gt=0, description="Most kept for backward; above it the loss streams column tiles."
    )


class FastAPConfig(_LossSection):
    name: Literal["fastap"]
    num_bins: int = Field(default=10, ge=1)


class SmoothAPConfig(_LossSection):
    name: Literal["smoothap"]
    temperature: float = Field(default=0.01, gt=0)


class TnScheduleConfig(_Section):
    """Dynamic negative temperature of RLL Eq. 15; None in the loss config keeps Tn fixed."""

    start: float
    end: float
    steps: int = Field(ge=1)


class RankedListConfig(_LossSection):
    name: Literal["rll"]
    margin: float = Field(default=0.4, gt=0)
    alpha: float | None = None
    tn: float = 10.0
    tp: float = 0.0
    lam: float = Field(default=0.5, ge=0, le=1)
    tn_schedule: TnScheduleConfig | None = None
    gradient: Literal["both", "query"] = Field(
        default="both",
        description="both: both embeddings of every pair get gradient; query: only the query, the other "
        "features are constants in its ranked list (RLL Sec. 3.2; skips the engine's gradient all-reduce).",
    )


class TripletConfig(_LossSection):
    name: Literal["triplet"]
    margin: float = Field(default=0.2, ge=0)
    triplets: Literal["sampled", "all"] = Field(
        default="sampled",
        description="sampled: the triplet sampler's [q, p, n] triplets (Deep Ranking Eq. 8; needs "
        "sampler.name=triplet); all: every valid in-batch triplet, averaged over the active ones.",
    )


LossConfig = Annotated[
    FastAPConfig | SmoothAPConfig | RankedListConfig | TripletConfig, Field(discriminator="name")
]


class OptimConfig(_Section):
    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD only.")
    embedding_lr_mult: float = Field(default=10.0, gt=0, description="Papers train the new head 10x faster.")
    schedule: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    step_every: int = Field(default=1000, ge=1, description="`step` schedule: decay interval in steps.")
    step_gamma: float = Field(default=0.5, gt=0, le=1)
    grad_clip: float | None = Field(default=None, gt=0, description="Max global gradient norm.")


class TrainConfig(_Section):
    steps: int = Field(ge=1, description="Optimizer steps in the whole run.")
    global_batch_size: int = Field(ge=2, description="Images per step over all workers: the loss's batch.")
    chunk_size: int = Field(default=64, ge=1, description="Images per forward/backward chunk in a worker.")
    log_every: int = Field(default=10, ge=1)
    checkpoint_every: int = Field(default=100, ge=1)
    eval_every: int = Field(default=500, ge=1)
    eval_at_start: bool = True
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description="auto = bf16 autocast on CUDA GPUs with bf16, fp16 with loss scaling on older ones, "
        "fp32 on CPU.",
    )
    compile: bool | Literal["auto"] = Field(
        default="auto", description="torch.compile the network; auto = on CUDA (eager fallback on failure)."
    )
    channels_last: bool | Literal["auto"] = Field(
        default="auto", description="channels_last memory format; auto = convolutional networks on CUDA."
    )
    small_conv_matmul: bool | Literal["auto"] = Field(
        default="auto",
        description="Train convolutions with 1x1 or 2x2 outputs as matrix products over the batch, where "
        "oneDNN is slow (resnet18's 32 px step 2x faster on an AVX2 CPU, 1.18x with AVX-512, where only "
        "1x1 maps are rewritten; dmltrain.small_convs); auto = CPU.",
    )
    max_skipped_steps: int = Field(
        default=20, ge=0, description="Consecutive non-finite losses tolerated before the run fails."
    )
    best_metric: str | None = Field(
        default="auto",
        description="Evaluation metric that ranks checkpoints, e.g. eval/test/map@r; auto = the first "
        "evaluation's recall@1; null = keep the latest checkpoints only.",
    )
    best_mode: Literal["max", "min"] = Field(
        default="max", description="Whether a higher best_metric is better."
    )
    early_stopping_patience: int | None = Field(
        default=None, ge=1, description="Stop after this many evaluations without a new best; null = never."
    )
    early_stopping_min_delta: float = Field(
        default=0.0, ge=0, description="Improvement of best_metric that counts as a new best."
    )
    seed: int = 0
    profile_start: int | None = Field(
        default=None,
        ge=1,
        description="Record steps from this one (1-based, after one unrecorded warm-up step) with "
        "torch.profiler on rank 0: a Perfetto/Chrome trace and an operator table as MLflow artifacts "
        "under profile/; null = off.",
    )
    profile_steps: int = Field(default=3, ge=1, description="How many steps profile_start records.")

    @model_validator(mode="after")
    def _check_best(self) -> TrainConfig:
        if self.early_stopping_patience is not None and self.best_metric is None:
            raise ValueError("early_stopping_patience needs train.best_metric (the metric it watches)")
        return self

    @model_validator(mode="after")
    def _check_profile(self) -> TrainConfig:
        if self.profile_start is not None and self.profile_start + self.profile_steps - 1 > self.steps:
            raise ValueError(
                f"train.profile_start={self.profile_start} with train.profile_steps={self.profile_steps} "
                f"records past train.steps={self.steps}"
            )
        return self


class EvalConfig(_Section):
    ks: tuple[int, ...] | None = Field(
        default=None,
        description="Recall@K cut-offs; None = the data set's own (dataset.json recall_ks: SOP 1, 10, 100, "
        "1000; In-Shop 1, 10, ..., 50; VehicleID 1, 5; iNaturalist 1, 4, 16, 32; else 1, 2, 4, 8), resolved "
        "before the run starts.",
    )
    batch_size: int = Field(default=128, ge=1)
    max_images: int | None = Field(
        default=None,
        ge=2,
        description="Quick checks: only the first N // scaling.num_workers images of each rank's shards of a "
        "split, the same images with any data.loader_workers (another scaling.num_workers reads others); "
        "None = all.",
    )
    grid_queries: int = Field(default=8, ge=0, description="Queries in the retrieval-grid plot.")
    cache_mb: int = Field(
        default=1024,
        ge=0,
        description="Host memory (MB) each training worker may keep its test images in, decoded, after their "
        "first evaluation: later evaluations skip reading and decoding. Splits that do not fit are read "
        "every time; 0 = off.",
    )
    index: Literal["exact", "auto", "flat", "ivfpq", "hnsw"] = Field(
        default="exact",
        description="exact: blocked matmul ranking (every metric incl. full mAP); a faiss kind: k-NN metrics "
        "from that index plus its neighbour recall against exact search; auto: exact up to "
        "exact_max_gallery rows, else ivfpq.",
    )
    exact_max_gallery: int = Field(default=1_000_000, ge=1, description="eval.index=auto: exact up to here.")
    index_recall_queries: int = Field(
        default=1000,
        ge=1,
        description="Queries sampled to measure an approximate index against exact search.",
    )

    @field_validator("ks")
    @classmethod
    def _positive_ks(cls, ks: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ks is not None and (not ks or min(ks) < 1):
            raise ValueError("Recall@K cut-offs must be one or more positive integers")
        return ks


class ScalingConfigSection(_Section):
    num_workers: int = Field(default=2, ge=1)
    use_gpu: bool | Literal["auto"] = Field(
        default="auto",
        description="auto: GPUs if the cluster has some when the run is submitted (GPU configs say true).",
    )
    cpus_per_worker: float = Field(default=1.0, gt=0)
    torch_threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads per worker; None = cpus_per_worker."
    )
    omp_wait_policy: Literal["passive", "brief", "active"] | None = Field(
        default="brief",
        description="How the workers' idle OpenMP threads wait for the next parallel region: brief = spin "
        "about 0.1 ms, then sleep (GNU OpenMP's GOMP_SPINCOUNT=10000; torch's Linux wheels use GNU "
        "OpenMP), passive = sleep at once (OMP_WAIT_POLICY=PASSIVE, count 0), active = spin "
        "(OMP_WAIT_POLICY=ACTIVE); each sets GOMP_SPINCOUNT, which in GNU OpenMP beats an inherited policy "
        "or count; None = inherit the environment (GNU's default spins about 3 ms, which starves SCHED_IDLE "
        "loaders). "
        "brief: 150-step quickstarts on the AVX2 machine stepped 1.48x as fast as passive (README).",
    )
    keep_freed_memory: bool | Literal["auto"] = Field(
        default="auto",
        description="glibc malloc in the workers keeps the memory a step frees for the next step instead "
        "of handing it back to the OS (MALLOC_ARENA_MAX=1, MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ "
        "of 1 GiB): with glibc's defaults the quickstart's CPU step faulted about 14,000 fresh pages "
        "(55 MB) back in every step, 31-38 ms of kernel time, and larger tensors in Ray Train's training "
        "thread are always fresh mmaps (bench/malloc.py). auto = on for CPU workers, glibc's defaults on "
        "GPU workers (their step's memory is the GPU's); other C libraries ignore the variables.",
    )
    worker_niceness: Literal["auto"] | Annotated[int, Field(ge=0, le=19)] | None = Field(
        default="auto",
        description="Niceness of the training workers (RAY_worker_niceness in their runtime env). Ray starts "
        "workers at 15 so its daemons win the CPU; at 15 the step's threads no longer preempt the SCHED_IDLE "
        "loader processes (data.loader_priority) and the loader's gain is lost (bench/service.py, part 1). "
        "auto = 0 for CPU training on a single node (the measured case; Ray's job supervisor uses 0 too), "
        "Ray's default on GPU workers and across nodes (unmeasured there; one CI run of the 2-core "
        "multi-node test bed with workers at 0 failed to start a worker group); None = Ray's default.",
    )
    ray_priority: Literal["auto", "idle", "normal"] = Field(
        default="auto",
        description="CPU priority of Ray's bookkeeping processes on the node (GCS, dashboard, log monitor, "
        "agents, Ray Train's controller and helper actors, the driver's threads that wait on Ray; not "
        "raylet, the training workers, Ray's idle workers or the driver's main thread): idle = "
        "Linux SCHED_IDLE, they use only cycles the training leaves idle and never preempt its threads "
        "(each wakes about 100 times a second: bench/ray_priority.py); normal = as Ray starts them; "
        "auto = idle for CPU training on a single node, else normal.",
    )
    topology: Literal["auto", "single-node", "multi-node"] = Field(
        default="auto",
        description="auto: multi-node when Ray reports several nodes or the driver joined an existing "
        "cluster; multi-node requires shared storage and a tracking server (dmltrain.service.cluster).",
    )


class RunSection(_Section):
    name: str = Field(description="Ray Train run name: relaunching with the same name resumes.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return plain_folder_name(value)

    storage_path: str = Field(default="./ray_results", description="Shared storage for Ray checkpoints.")
    max_failures: int = Field(default=3, ge=-1, description="Worker-group restarts from the last checkpoint.")
    keep_checkpoints: int = Field(
        default=2, ge=1, description="Checkpoints Ray keeps: the best by train.best_metric, plus the latest."
    )
    checkpoint_upload: Literal["async", "sync"] = Field(
        default="async", description="async: training continues while Ray copies a checkpoint to storage."
    )
    resume: Literal["auto", "never", "must"] = Field(
        default="auto",
        description="Relaunch with an existing run.name: auto resumes only if nothing but length/cadence "
        "settings changed; must resumes whatever changed; never refuses an existing run.",
    )


class MlflowSection(_Section):
    tracking_uri: str | None = Field(
        default=None, description="None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd."
    )
    experiment: str = Field(default="dmltrain", min_length=1)
    log_checkpoints: bool = Field(
        default=False,
        description="Also copy every checkpoint (optimizer state included) to MLflow; the final and best "
        "models are logged either way.",
    )
    register_as: str | None = Field(
        default=None,
        min_length=1,
        description="Register the finished run's model under this name in the model registry.",
    )


class ExperimentConfig(_Section):
    data: DataConfig
    sampler: SamplerConfig = SamplerConfig()
    model: ModelConfig = ModelConfig()
    loss: LossConfig
    optim: OptimConfig = OptimConfig()
    train: TrainConfig
    eval: EvalConfig = EvalConfig()
    scaling: ScalingConfigSection = ScalingConfigSection()
    run: RunSection
    mlflow: MlflowSection = MlflowSection()

    @model_validator(mode="after")
    def _check_batch(self) -> ExperimentConfig:
        workers = self.scaling.num_workers
        if self.train.global_batch_size % workers:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} must be divisible by "
                f"scaling.num_workers={workers}"
            )
        if self.train.global_batch_size // workers < self.sampler.samples_per_class:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} over scaling.num_workers={workers} "
                f"is {self.train.global_batch_size // workers} images per worker, fewer than "
                f"sampler.samples_per_class={self.sampler.samples_per_class}"
            )
        if self.data.decode == "gpu" and self.scaling.use_gpu is False:
            raise ValueError(
                "data.decode=gpu decodes on the training workers' GPUs, but scaling.use_gpu=false: "
                "set data.decode=auto or cpu"
            )
        if self.data.decode == "cpu" and self.data.host_decode_share > 0:
            raise ValueError(
                f"data.host_decode_share={self.data.host_decode_share} splits the decoding between the GPU "
                "and the loader workers, but data.decode=cpu decodes everything in the workers: set "
                "data.decode=gpu or auto, or leave data.host_decode_share at 0"
            )
        if self.sampler.name == "hard" and self.train.global_batch_size % 2:
            raise ValueError("sampler.name=hard splits the global batch in two halves: make it even")
        local = self.train.global_batch_size // workers
        if self.sampler.name == "triplet" and local % 3:
            raise ValueError(
                f"sampler.name=triplet fills each worker's batch with whole triplets: "
                f"train.global_batch_size={self.train.global_batch_size} / scaling.num_workers={workers} = "
                f"{local} is not a multiple of 3"
            )
        if self.sampler.name == "pk" and self.sampler.samples_per_class < 2:
            raise ValueError(
                "sampler.samples_per_class must be >= 2 for sampler.name=pk (a class needs a pair)"
            )
        sampled = isinstance(self.loss, TripletConfig) and self.loss.triplets == "sampled"
        if sampled and self.sampler.name != "triplet":
            raise ValueError(
                f"loss.triplets=sampled scores the triplet sampler's triplets but sampler.name is "
                f"{self.sampler.name!r}: set sampler.name=triplet, or loss.triplets=all"
            )
        if self.optim.warmup_steps > self.train.steps:
            raise ValueError(
                f"optim.warmup_steps={self.optim.warmup_steps} is longer than train.steps="
                f"{self.train.steps}: the learning rate would never reach optim.lr"
            )
        if self.model.multilevel and self.loss.name == "triplet":
            raise ValueError(
                "model.multilevel trains one loss per level, which the triplet loss cannot (its normaliser "
                "differs per level): use fastap, smoothap or rll"
            )
        return self

    @property
    def local_batch_size(self) -> int:
        return self.train.global_batch_size // self.scaling.num_workers


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and a YAML-typed value (so ``1e-4`` is a float); a field
    that holds text takes the text as written (``run.name=2024``, ``run.name=0123``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: the key {key.strip()!r} has an empty part")
    if not raw.strip():
        return parts, None
    try:
        value = yaml.load(raw, Loader=_CoreSchemaLoader)
    except yaml.YAMLError as error:
        raise ConfigError(
            f"override {text!r}: its value is not valid YAML ({' '.join(str(error).split())})"
        ) from None
    if value is not None and not isinstance(value, str) and _holds_text(parts):
        value = raw.strip()
    return parts, value


def _holds_text(path: Sequence[str]) -> bool:
    """Whether the config field at ``path`` holds text (``str`` or ``str | None``)."""
    model: type[BaseModel] = ExperimentConfig
    for part in path[:-1]:
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    field = model.model_fields.get(path[-1])
    return field is not None and field.annotation in (str, str | None)


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every dotted override applied (creating sections as needed)."""
    merged = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return merged


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _describe_errors(error: ValidationError, source: str) -> str:
    """One line per key; a union such as ``bool | "auto"`` lists its alternatives on that line."""
    found: dict[str, list[tuple[str, Any]]] = {}
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"] if not _is_union_member(p))
        tags = [str(p) for p in item["loc"] if _is_union_member(p)]
        other = _LOSS_KEYS.get(str(item["loc"][-1]), set()) - set(tags) if item["loc"] else set()
        if item["type"] == "extra_forbidden" and tags and other:
            # `loss.name=fastap` over a smoothap section keeps smoothap's keys: not a typo
            message = (
                f"a key of loss.name={'/'.join(sorted(other))}, not of {tags[0]} (replace the whole section: "
                f"loss={{name: {tags[0]}}})"
            )
            found.setdefault(key, []).append((message, _NO_INPUT))
        elif item["type"] == "extra_forbidden":
            found.setdefault(key, []).append(("unknown key (typo?)", _NO_INPUT))
        elif item["type"] == "missing":
            found.setdefault(key, []).append(("required key is missing", _NO_INPUT))
        elif item["type"] == "bool_not_number":  # found on the section: name the field
            ctx = item.get("ctx", {})
            found.setdefault(f"{key}.{ctx.get('key')}", []).append(
                (f"expected {ctx.get('expected')}, got the boolean {ctx.get('value')}", _NO_INPUT)
            )
        elif item["type"] == "value_error":  # a cross-field check: its message names the keys itself
            found.setdefault(key, []).append((str(item["msg"]).removeprefix("Value error, "), _NO_INPUT))
        else:
            found.setdefault(key, []).append((item["msg"], item.get("input")))
    lines = [f"invalid config {source}:"]
    for key, problems in found.items():
        text = " or ".join(message for message, _ in problems)
        value = problems[0][1]
        lines.append(f"  {key}: {text}" if key else f"  {text}")
        if value is not _NO_INPUT:
            lines[-1] += f" (got {value!r})"
    return "\n".join(lines)


# How the driver passes its resolution of data.loader_priority=auto to the workers (it knows the topology).
LOADER_PRIORITY_ENV = "DMLTRAIN_LOADER_PRIORITY"

# What scaling.keep_freed_memory puts in the workers' environment (the worker tags what it got): glibc malloc
# keeps what a step frees. One arena, because Ray Train runs the training function in a thread, and a
# thread's own arena cannot hold a block beyond its 64 MB heaps (those are fresh mmaps, faulted in page by
# page every step); thresholds of 1 GiB, because glibc's dynamic mmap threshold stops at 32 MB and its trim
# threshold hands the top of the heap back after each step.
KEEP_FREED_MEMORY_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}

_NO_INPUT = object()
_UNION_TAGS = {"fastap", "smoothap", "rll", "triplet"}


def _loss_keys() -> dict[str, set[str]]:
    """A loss option -> the ``loss.name`` values that take it."""
    out: dict[str, set[str]] = {}
    for model in get_args(get_args(LossConfig)[0]):
        for key in model.model_fields:
            out.setdefault(key, set()).update(get_args(model.model_fields["name"].annotation))
    return out


_LOSS_KEYS = _loss_keys()


def _is_union_member(part: object) -> bool:
    """A location step naming a union's member (loss kind, ``bool``, ``literal['auto']``), not a key."""
    return isinstance(part, str) and (
        part in _UNION_TAGS
        or part in {"bool", "int", "float", "str"}
        or part.startswith(("literal[", "constrained-"))
    )


def config_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> ExperimentConfig:
    """Validate a raw mapping; errors name every offending key and the source."""
    try:
        return ExperimentConfig.model_validate(dict(raw))
    except ValidationError as error:
        raise ConfigError(_describe_errors(error, source)) from None


class _CoreSchemaLoader(yaml.SafeLoader):
    """YAML's safe loader with YAML 1.2's core schema for booleans and numbers: PyYAML's 1.1 rules read
    `steps: 010` as 8 (octal), `1:00` as 60 (base 60) and `yes`/`off` as booleans, and `1e-4` as text."""

    def construct_core_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node))
        return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


_CoreSchemaLoader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp) for tag, regexp in resolvers if tag.rsplit(":", 1)[1] not in ("bool", "int", "float")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    _CoreSchemaLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_CoreSchemaLoader.add_constructor("tag:yaml.org,2002:int", _CoreSchemaLoader.construct_core_int)


class _UniqueKeyLoader(_CoreSchemaLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the last
    silently, so `steps: 20` ... `steps: 30` in one section trained 30 steps without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (lines {seen[key]} and {line})",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file holding a mapping (config or sweep file); every problem is a ConfigError naming it."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        with open(path) as handle:  # a stream, so YAML's messages name the file, not "<unicode string>"
            raw = yaml.load(handle, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{what} {path} is not valid YAML: {' '.join(str(error).split())}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:  # a folder, an unreadable file
        raise ConfigError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must hold a mapping at the top level")
    return raw


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read a YAML experiment file, apply ``key.sub=value`` overrides and validate the result."""
    file = Path(path)
    raw = read_yaml_mapping(file, "config file")
    source = f"{file}" + (f" with overrides {list(overrides)}" if overrides else "")
    return config_from_dict(apply_overrides(raw, overrides), source)


def flatten(config: ExperimentConfig) -> dict[str, str]:
    """Dotted ``section.key -> str`` pairs, the form MLflow params take (`flatten_mapping`)."""
    return flatten_mapping(config.model_dump(mode="json"))


def flatten_mapping(raw: Mapping[str, Any]) -> dict[str, str]:
    """Dotted ``section.key -> str`` pairs of a config's raw mapping: values as JSON (``false``, ``null``,
    as config.yaml writes them: Python's ``False``/``None`` matched no search for them), text as is, an
    empty mapping as ``{}`` (it was left out)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", raw)
    return out


def to_yaml(config: ExperimentConfig) -> str:
    """The resolved config as YAML, re-loadable with :func:`load_config`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def recall_ks(config: ExperimentConfig, dataset_ks: Sequence[int]) -> tuple[int, ...]:
    """The run's Recall@K cut-offs: ``eval.ks``, or when unset the data set's (``dataset.json`` recall_ks)."""
    return config.eval.ks if config.eval.ks is not None else tuple(dataset_ks)


def with_recall_ks(config: ExperimentConfig, dataset_ks: Sequence[int]) -> ExperimentConfig:
    """``config`` with ``eval.ks`` resolved (`recall_ks`): what MLflow records and every worker reads."""
    if config.eval.ks is not None:
        return config
    return config.model_copy(
        update={"eval": config.eval.model_copy(update={"ks": recall_ks(config, dataset_ks)})}
    )
