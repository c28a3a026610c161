# Two commands on a fresh Linux machine with Python 3.11:
#   make serve   virtualenv + install + start the service (GPU when present, else CPU)
#   make test    virtualenv + install + the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Tests, CI and CPU serving: torch 2.13.0, the CPU build where pip finds one (a machine's local
# wheel folder, 2.13.0+cpu). Named in the same pip command as the project so that resolving
# the project's torch range can never move it.
TORCH_CPU ?= torch==$(TORCH_VERSION)
# GPU serving: exactly "2.13.0" (===, so never a local 2.13.0+cpu build), which on Linux x86_64
# is PyPI's CUDA build (CUDA 13 runtime as nvidia-* wheels; needs NVIDIA driver >= 580).
TORCH_GPU ?= torch===$(TORCH_VERSION)
# A GPU is "present" when nvidia-smi exists and lists at least one GPU.
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
# Extra flags for `make serve`, e.g. make serve SERVE_ARGS="--port 9000 --queue-size 16"
SERVE_ARGS ?=

.PHONY: venv install install-test reinstall test-tools serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

venv: $(BIN)/python

# Installing is done once, and again only when what it builds from changed: a stamp file in the
# venv per kind of install (serving on the CPU, on a GPU, the tests), newer than pyproject.toml,
# the C sources (the cpu-fast kernel, the SHA-256 lanes) and this Makefile (its torch versions). The code itself is
# installed editable, so a changed .py needs nothing. `make reinstall` installs again regardless.
BUILT_FROM := pyproject.toml Makefile $(wildcard learner/*.c learner/backends/*.c learner/backends/*.h)
STAMP_CPU := $(VENV)/.rev88-installed-cpu
STAMP_GPU := $(VENV)/.rev88-installed-gpu
STAMP_TEST := $(VENV)/.rev88-installed-test

# (the GPU build and the CPU one replace each other's torch: each removes the other's stamps;
# the tests' install is a CPU install too, so it stamps both)
$(STAMP_GPU): $(BUILT_FROM) | $(BIN)/python
	$(BIN)/pip install -q '$(TORCH_GPU)' -e '.[gpu]'
	@$(BIN)/python -c "import torch; ok = torch.cuda.is_available(); print('torch', torch.__version__, \
	  'CUDA', torch.version.cuda, '- GPU usable' if ok else '- GPU NOT usable (driver too old?): serving on the CPU')"
	rm -f $(STAMP_CPU) $(STAMP_TEST)
	touch $@

$(STAMP_CPU): $(BUILT_FROM) | $(BIN)/python
	$(BIN)/pip install -q '$(TORCH_CPU)' -e .
	rm -f $(STAMP_GPU)
	touch $@

$(STAMP_TEST): $(BUILT_FROM) | $(BIN)/python
	$(BIN)/pip install -q '$(TORCH_CPU)' -e '.[test]'
	rm -f $(STAMP_GPU)
	touch $(STAMP_CPU) $@

ifeq ($(HAS_GPU),yes)
install: $(STAMP_GPU)
else
install: $(STAMP_CPU)
endif

install-test: $(STAMP_TEST)

reinstall:
	rm -f $(STAMP_CPU) $(STAMP_GPU) $(STAMP_TEST)
	$(MAKE) install

serve: install
	$(BIN)/rev88 serve $(SERVE_ARGS)

# The PostgreSQL and browser tests fail, not skip, when their parts are missing (Debian's
# postgresql server binaries, chromium; `make test` installs them first where it may):
# `make test TEST_REQUIRE=` lets them skip instead.
TEST_REQUIRE ?= postgres,browser

# Debian's chromium and postgresql when the tests require them and they are missing: installed
# when this may (root, or sudo -n), else it stops before the suite with the command to run
test-tools:
	REV88_TEST_REQUIRE=$(TEST_REQUIRE) bash scripts/test_tools.sh

test: install-test test-tools
	REV88_TEST_REQUIRE=$(TEST_REQUIRE) $(BIN)/python -m pytest -q

# ruff, and the dependency rules of pyproject.toml's [tool.importlinter] (rev88 -> app -> learner;
# app's rooms top to bottom; no import cycle)
lint: install-test
	$(BIN)/ruff check learner app rev88 tests bench scripts deploy
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# Not part of `make test` (the image build downloads several GB and takes minutes):
#   make image-check        build the Dockerfile (podman or docker) and run the image for real:
#                           read-only, ready time, draw-0 hash vs the host, non-root, SIGTERM drain
#                           (deploy/image_check.py; IMAGE_CHECK_ARGS="--no-cache" for a cold build)
#   make compose-check      PostgreSQL + two rev88 replicas (compose.yaml + compose.cpu.yaml +
#                           compose.replicas.yaml) from a clean state, with a replica killed and
#                           PostgreSQL restarted under load, then down -v (deploy/compose_check.py;
#                           needs podman-compose, installed into the venv when missing, or docker compose)
#   make compose-cpu-check  the same (the CPU variant is the one compose-check runs)
#   make kube-check         the Kubernetes manifests under podman kube play: the PostgreSQL StatefulSet's
#                           pod and two rev88 pods ready through their own probes, tasks through both
#                           (deploy/kube_check.py; what podman cannot play is said there)
#   make postgres-image     rev88-postgres:15 from deploy/postgres/Containerfile (Debian's package),
#                           for hosts that cannot pull postgres:15-bookworm
IMAGE_CHECK_ARGS ?=
COMPOSE_CHECK_ARGS ?=
KUBE_CHECK_ARGS ?=
ENGINE ?= podman
.PHONY: image-check compose-check compose-cpu-check kube-check postgres-image
image-check:
	@test -x $(BIN)/rev88 || $(MAKE) install
	$(BIN)/python deploy/image_check.py $(IMAGE_CHECK_ARGS)

compose-check compose-cpu-check:
	@test -x $(BIN)/rev88 || $(MAKE) install
	@command -v podman-compose >/dev/null || test -x $(BIN)/podman-compose || docker compose version >/dev/null 2>&1 \
	  || $(BIN)/pip install -q podman-compose
	$(BIN)/python deploy/compose_check.py $(COMPOSE_CHECK_ARGS)

kube-check:
	@test -x $(BIN)/rev88 || $(MAKE) install
	$(BIN)/python deploy/kube_check.py $(KUBE_CHECK_ARGS)

postgres-image:
	ENGINE=$(ENGINE) deploy/bootstrap_base_image.sh
	CONTAINERS_CONF=$${CONTAINERS_CONF:-deploy/podman/containers.conf} $(ENGINE) build --pull=never \
	  $$([ "$(ENGINE)" = podman ] && echo --format docker) -f deploy/postgres/Containerfile -t rev88-postgres:15 .
