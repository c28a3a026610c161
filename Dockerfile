# syntax=docker/dockerfile:1
# The rev88 service on one NVIDIA GPU (falls back to the CPU backend when none is visible).
#
#   docker build -t rev88:0.1.0 .
#   docker run --rm --gpus all -p 8000:8000 rev88:0.1.0
#
# PyPI's torch 2.13.0 wheel for Linux x86_64 is the CUDA build (CUDA 13 runtime libraries
# come with it as nvidia-* wheels), so a slim Python base is enough: the host needs only the
# NVIDIA driver (>= 580 for CUDA 13) and the NVIDIA Container Toolkit. `===` asks for exactly
# "2.13.0", never a local CPU build such as "2.13.0+cpu" that a build machine's pip may hold.
# Checked statically by tests/test_deploy_static.py (routes, port, settings) and built and run
# for real by `make image-check` (deploy/image_check.sh; deploy/README.md has its figures).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUBLAS_WORKSPACE_CONFIG=:16:8 \
    HOME=/home/rev88 \
    XDG_CACHE_HOME=/tmp/rev88-cache \
    TRITON_CACHE_DIR=/tmp/rev88-cache/triton \
    REV88_DATA_DIR=/var/lib/rev88

# A C compiler: Triton (the fused backend) builds its small launcher stubs with the host
# compiler at first use, into TRITON_CACHE_DIR; versions come with the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# A fixed numeric, non-root user (Kubernetes' runAsNonRoot can verify a number).
RUN groupadd --system --gid 10001 rev88 \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/rev88 --create-home --shell /usr/sbin/nologin rev88

WORKDIR /opt/rev88

# The large, rarely changing layer first: torch alone.
RUN pip install "torch===2.13.0"

COPY pyproject.toml README.md ./
COPY learner ./learner
COPY app ./app
COPY rev88 ./rev88
# Same torch pin again so resolving the package cannot move it; then a smoke test of the
# *installed* package, run from / so that the source copy here cannot stand in for it: the
# compiled cpu-fast kernel, SHA-256 lanes and permutations must have been built (gcc above) or the
# build fails.
# The project itself (".") carries its dependency ranges in pyproject.toml; the postgres extra
# (psycopg) lets the same image keep its ledger in PostgreSQL (REV88_DATABASE_URL).
# hadolint ignore=DL3003,DL3013
RUN pip install "torch===2.13.0" ".[gpu,postgres]" \
 && rm -rf build ./*.egg-info \
 && cd / \
 && python -c "import learner, app.main, rev88.cli, app.ledger.postgres; from learner.backends import cpu_fast; \
assert not learner.__file__.startswith('/opt/rev88/'), learner.__file__; \
assert cpu_fast.kernel_available(), cpu_fast.KERNEL_ERROR; from learner import _sha256_lanes, permutations; \
assert permutations.fast(), 'learner/permutations.c not built, or not numpy here'; \
from app.http import versions; assert not versions.untested(), versions.untested(); \
print('rev88', learner.__version__, 'installed at', learner.__file__, '- cpu-fast kernel, SHA-256 lanes and permutations built')"

# The official MNIST training split (9.9 MB): the draws of POST /evaluations are built from it on
# the server (docs/evaluations.md); the files are checked against their known SHA-256 when read.
COPY data/mnist/train-images.idx3-ubyte.gz data/mnist/train-labels.idx1-ubyte.gz /opt/rev88/data/mnist/
ENV REV88_MNIST_DIR=/opt/rev88/data/mnist

# The task ledger (SQLite + uploads of asynchronous tasks; unused with REV88_DATABASE_URL): a volume, writable by the service's
# user while the root filesystem stays read-only (compose and Kubernetes mount one here).
RUN mkdir -p /var/lib/rev88 && chown 10001:10001 /var/lib/rev88
VOLUME ["/var/lib/rev88"]

USER 10001:10001

EXPOSE 8000

# Liveness only (the process answers); readiness (/v2/health/ready) is for load balancers.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/v2/health/live', timeout=4).status == 200 else 1)"]

# Docker sends SIGTERM on stop; `rev88 serve` drains for REV88_DRAIN_TIMEOUT_S (30 s):
# give `docker stop` a longer --time (compose: stop_grace_period).
STOPSIGNAL SIGTERM
CMD ["rev88", "serve", "--host", "0.0.0.0", "--port", "8000"]
