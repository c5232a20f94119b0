# dmltrain GPU image for Ray clusters (KubeRay pods and `ray up` docker nodes).
#
# Base: the official PyTorch runtime image, pinned by its exact tag. It already holds torch 2.14.1 and
# torchvision 0.29.1 built for CUDA 12.6 with cuDNN 9 (the versions dmltrain is developed against), so pip
# does not download a second CUDA stack; faiss-gpu 1.15.1 links the same CUDA 12 runtime wheels. "runtime"
# rather than "devel": nothing here compiles CUDA code. CUDA 12.6 runs on any driver >= 525 (minor-version
# compatibility), i.e. on every current GPU node image.
# The rayproject/ray-ml images are no longer published; rayproject/ray would pull torch in a second time.
#
# Build from the repository root:   docker build -t <registry>/dmltrain:0.1.0 .
FROM pytorch/pytorch:2.14.1-cuda12.6-cudnn9-runtime

# Ray must be the same version on every node and should match the Ray that submits jobs; the cluster
# manifests (rayVersion) and tests/test_deployment.py check this pin. torch/torchvision are the base image's
# build. All three must agree with cluster/image-constraints.txt (the build checks it).
ARG RAY_VERSION=2.60.0
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1

ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    MPLBACKEND=Agg \
    RAY_USAGE_STATS_ENABLED=0

# bash: Ray and KubeRay run their commands with it. wget: KubeRay's default liveness/readiness probes.
# rsync + openssh-client: the `ray up` launcher syncs files into the container with rsync and the head's
# autoscaler reaches new worker VMs over SSH. ca-certificates: HTTPS/S3 for shards and MLflow.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bash ca-certificates openssh-client rsync wget \
    && rm -rf /var/lib/apt/lists/*

# Ray's images run as `ray` (uid 1000) with home /home/ray; do the same. The Ubuntu 24.04 base ships a
# user `ubuntu` with uid/gid 1000, so free those ids first.
RUN set -eux; \
    old_user="$(getent passwd 1000 | cut -d: -f1)"; \
    if [ -n "$old_user" ]; then userdel "$old_user"; rm -rf "/home/$old_user"; fi; \
    old_group="$(getent group 1000 | cut -d: -f1)"; \
    if [ -n "$old_group" ]; then groupdel "$old_group"; fi; \
    groupadd --gid 1000 ray; \
    useradd --uid 1000 --gid 1000 --create-home --home-dir /home/ray --shell /bin/bash ray; \
    command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

# Install dmltrain (not editable: the image is a release) with the gpu extra (faiss-gpu), the s3 extra
# (s3fs, so data.root can be s3://), the timm and openclip extras (model.backbone timm:<name> /
# open_clip:<name>), plus boto3, which the `ray up` head's autoscaler launches EC2 workers with. Every package
# pip resolves is pinned by cluster/image-constraints.txt (generated from the environment the tests passed
# in: cluster/update_image_constraints.py), so a rebuild installs the same versions, the MLflow client equals
# the server's version (kubernetes/mlflow.yaml) and boto3 stays on the botocore that s3fs's aiobotocore pins.
# Ray writes s3:// checkpoints itself. faiss-cpu (a base dependency) and faiss-gpu write the same files, so
# both are removed afterwards and faiss-gpu alone is put back (its CUDA libraries stay installed).
# Two layers: the dependencies, from pyproject.toml and the constraints alone (a stand-in package and README
# take the place of the code), then the code without dependencies. A commit that changes only code or the
# README then rebuilds seconds of the image, not the gigabytes of Ray, MLflow and faiss-gpu.
COPY pyproject.toml /tmp/dmltrain-deps/
COPY cluster/image-constraints.txt /tmp/image-constraints.txt
RUN set -eux; \
    grep -qx "ray==${RAY_VERSION}" /tmp/image-constraints.txt; \
    grep -qx "torch==${TORCH_VERSION}" /tmp/image-constraints.txt; \
    grep -qx "torchvision==${TORCHVISION_VERSION}" /tmp/image-constraints.txt; \
    cd /tmp/dmltrain-deps; \
    mkdir dmltrain; \
    touch dmltrain/__init__.py; \
    echo "# dmltrain" > README.md; \
    python -m pip install --constraint /tmp/image-constraints.txt ".[gpu,s3,timm,openclip]" boto3; \
    python -m pip uninstall -y dmltrain faiss-cpu faiss-gpu; \
    python -m pip install --no-deps --constraint /tmp/image-constraints.txt "faiss-gpu>=1.8"; \
    cd /; \
    rm -rf /tmp/dmltrain-deps

COPY pyproject.toml README.md /tmp/dmltrain-src/
COPY dmltrain /tmp/dmltrain-src/dmltrain
RUN set -eux; \
    python -m pip install --no-deps --constraint /tmp/image-constraints.txt /tmp/dmltrain-src; \
    rm -rf /tmp/dmltrain-src /tmp/image-constraints.txt; \
    ray --version; \
    python -c "import dmltrain, dmltrain.service.cli, timm, open_clip"

# Experiment configs, so `python -m dmltrain.run configs/<name>.yaml` works from the working directory.
COPY --chown=1000:1000 configs /home/ray/configs

# Non-root from here on. Numeric ids so Kubernetes' runAsNonRoot can verify them.
USER 1000:1000
ENV HOME=/home/ray \
    PATH=/home/ray/.local/bin:$PATH
WORKDIR /home/ray

# No ENTRYPOINT: KubeRay and the `ray up` launcher run their own commands (`ray start ...`) in the container.
CMD ["bash"]
