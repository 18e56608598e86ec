# Two commands for a fresh machine: `make run` (set up + the default pipeline run) and
# `make test` (set up + the tests CI runs: every fast test and the spine of end-to-end runs, each
# user path once). `make test-all` runs everything. All create the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Every package, with the test tools, at the versions in requirements.lock (Python 3.11, Linux),
# so `make run`, `make test` and CI get the same environment on any machine. pip itself is pinned
# here; the project is installed last, editable and without touching the locked set. A changed
# lock rebuilds .venv from empty (--clear), so nothing an older lock installed stays behind.
LOCK := requirements.lock
PIP_VERSION := 26.3
PIP_TOOLS_VERSION := 7.6.2

.PHONY: install lock run smoke tune system-parts test test-all test-fast test-cluster bench image clean

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet pip==$(PIP_VERSION)
	$(PY) -m pip install --quiet --no-cache-dir -r $(LOCK)
	# PYTHONWARNINGS: setuptools' generic warning about editable installs is not for our users.
	PYTHONWARNINGS=ignore $(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Re-resolve requirements.lock from pyproject.toml's ranges (and the test extra) with pip-tools,
# which resolves through pip and so sees this machine's pip configuration (local wheels, the
# torch cap). Then `make install` (a changed lock reinstalls) and `make test`.
lock:
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet pip==$(PIP_VERSION) pip-tools==$(PIP_TOOLS_VERSION)
	.lock-venv/bin/pip-compile --quiet --upgrade --extra test --strip-extras --allow-unsafe \
		--no-emit-index-url --no-emit-find-links --output-file $(LOCK) pyproject.toml

run: install
	$(PY) -m flows.mnist $(ARGS)

smoke: install
	$(PY) -m flows.mnist --preset smoke $(ARGS)

# The hyperparameter search (Ray Tune) on the same stages: `make tune ARGS="--preset smoke"`.
tune: install
	$(PY) -m flows.tune $(ARGS)

# The system programs some tests drive (Debian's Chromium for the UI tests): installed first where this user
# can (root with apt-get), else one line each with the command to run, and their tests are skipped saying so.
# SYSTEM_PARTS=required (CI) makes a part still missing a failure (tests/support/system_parts.py).
SYSTEM_PARTS ?=
system-parts: install
	SYSTEM_PARTS=$(SYSTEM_PARTS) $(PY) -m tests.support.system_parts

# The tiers (docs/testing.md, Tiers): `slow` marks an end-to-end test, `spine` the slow ones CI runs.
# TEST_WORKERS pytest processes (pytest-xdist), each taking whole modules (a module's fixtures start once) and
# starting its own session server and Ray cluster: an end-to-end test mostly waits on processes that start, so
# two keep a 2-core machine busy. Not `-n auto`: every worker runs whole pipeline runs (GBs each), not one per
# core of a big machine. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: system-parts
	SYSTEM_PARTS=$(SYSTEM_PARTS) $(PY) -m pytest $(XDIST) -m "not slow or spine" $(ARGS)

test-all: system-parts
	SYSTEM_PARTS=$(SYSTEM_PARTS) $(PY) -m pytest $(XDIST) $(ARGS)

test-fast: install
	$(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

# The pipeline's rows (benchmarks/results/latest.json), then the recipe's cells on data the
# benchmark makes itself (benchmarks/results/recipe.json; RECIPE_ARGS="--seeds 0,1,2"), then image
# folders at three sizes through flows.train (benchmarks/results/scale.json; SCALE_ARGS="--quick"), then
# start-up: first step on the CLI and served paths, a small run's peak PSS (benchmarks/results/startup.json;
# STARTUP_ARGS="--quick", or "--only cli|memory|served").
bench: install
	$(PY) -m benchmarks.run $(ARGS)
	$(PY) -m benchmarks.speed.recipe $(RECIPE_ARGS)
	$(PY) -m benchmarks.data.scale $(SCALE_ARGS)
	$(PY) -m benchmarks.start.startup $(STARTUP_ARGS)

# The container image <project name>:<lock hash>, built offline with no registry base image
# (debootstrap + a venv from the lock's wheels, `docker import`ed; docs/operations.md). The tag
# rule (first 12 hex of sha256(requirements.lock)) is deployments/images.py, shared with the
# Kubernetes manifests and their test. Rebuilt only when the lock or the code changed; build output in
# IMAGE_BUILD_DIR (default /var/tmp/<name>-image), never in the repository.
IMAGE = $(shell $(PYTHON) -m deployments.images)

image:
	PYTHON=$(PYTHON) PIP_VERSION=$(PIP_VERSION) deployments/image/build.sh

# The opt-in cluster test (tests/test_cluster.py): moto S3, a Prefect server, a Ray head and two
# 1-CPU Ray workers as containers of $(IMAGE) on one Docker network. Skipped unless RUN_CLUSTER_TESTS=1.
test-cluster: install image
	RUN_CLUSTER_TESTS=1 CLUSTER_IMAGE=$(IMAGE) $(PY) -m pytest -m cluster -p no:cacheprovider $(ARGS)

clean:
	rm -rf $(VENV) .lock-venv storage .pytest_cache
