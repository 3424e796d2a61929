# Transom developer entry points. Everything a fresh machine needs is installed from here.
#
#   make demo      a local fault-tolerant run: 3 replicas, one SIGKILLed at step 20, ended 10 steps
#                  after it caught up from a peer; checkpoints
#   make e2e-demo  the same on Kubernetes with real pods: two real nodes (kubelet + containerd),
#                  helm install, examples/trainingjob-cpu.yaml, a worker killed, a pod deleted
#   make chaos     the same job through every fault a cluster throws (node loss, partition, drain,
#                  coordinator and operator loss, S3 outage, OOM, image pull, containerd restart) on
#                  three real nodes: a table and one JSON line (CHAOS_SCENARIOS=a,b for some)
#   make lint      ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) and mypy over the code
#   make test      lint, then unit and fuzz, integration and e2e tests on kwok's nodes (installs and
#                  builds the test control plane first), then `make test-compat`: <= 15 min on 2 cores
#   make test-real the tests that need real nodes (kubelet + containerd): the chaos CI subset, a job
#                  on real pods with Prometheus, Kueue. CI (.ci/run) runs `make test` and this
#   make test-compat  the smoke subset (-m compat) on the oldest supported torch and Python 3.12
#   make wheelhouse   the small dependencies as wheels for the GPU machine (no registry there)
#   make test-gpu  on a machine with a CUDA GPU and its own torch: the CUDA tests and benchmarks
#   make bench-gpu on that machine: the recovery and overhead benchmarks on CUDA, beside torchft
#   make generate  regenerate derived files (CRDs, the Grafana dashboard) from their sources
#   make bench-deps   the benchmarks' optional dependencies (torchft 0.2.0, and torchft-nightly
#                     in .cache/torchft-nightly, for benchmarks/recovery.py and ftar_overhead.py)
#
# The virtual environment lives outside the checkout (torch is several GB), keyed by the
# hash of pyproject.toml so a dependency change builds a fresh one; `.venv` links to it.

PYTHON ?= python3
DEPS_HASH := $(shell sha256sum pyproject.toml | cut -c1-12)
VENV ?= $(HOME)/.cache/transom/venv-$(DEPS_HASH)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The venv is shared by every checkout on the machine, and its editable install points at
# the last one that ran `make install`: this checkout's code comes first on the path of
# everything run from here (tests, their subprocesses, the demo), whichever that was.
export PYTHONPATH := $(CURDIR)/launcher:$(CURDIR)/operator$(if $(PYTHONPATH),:$(PYTHONPATH))

# The oldest torch and the other Python that Transom supports (docs/compatibility.md).
COMPAT_TORCH ?= 2.6.0
COMPAT_PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
COMPAT_VENV ?= $(HOME)/.cache/transom/venv-compat-torch$(COMPAT_TORCH)-$(DEPS_HASH)
COMPAT_PY := $(COMPAT_VENV)/bin/python
WHEELHOUSE ?= .cache/wheelhouse

.PHONY: install lint testenv images demo e2e-demo chaos test test-real test-unit test-integration test-e2e test-compat test-gpu bench-gpu bench-gpu-deps bench-gpu-overhead bench-gpu-recovery wheelhouse generate constraints clean-venv bench-deps

# setuptools says "Editable installation. Please be careful with folders ..." (a warning, so
# --quiet keeps it) on every editable install of a project whose packages are in two roots.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(PY) -m pip install --quiet -e

$(VENV)/.deps-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools
	$(EDITABLE) ".[dev]"
	touch $@

install: $(VENV)/.deps-installed
	@# Re-point the editable install at this checkout (a cached venv may have served another).
	$(EDITABLE) . --no-deps --no-build-isolation
	ln -sfn $(VENV) .venv

# ruff, then mypy (configured in pyproject.toml; its cache in .cache/mypy), then the import
# contracts (.importlinter: the layers, and what must import without torch). Each test directory
# with a conftest.py of its own is a mypy run of its own: one run cannot hold two `conftest`s.
LINT_PATHS := launcher operator tests benchmarks hack examples
MYPY_OWN_RUNS := tests/integration tests/e2e tests/fuzz
# mypy's cache beside the venv, shared by the machine's checkouts: most of a cold run is the
# venv's packages (torch, kubernetes, pydantic), the same for every clone.
lint: export MYPY_CACHE_DIR := $(VENV)-mypy-cache
lint: install
	$(VENV)/bin/ruff check --quiet $(LINT_PATHS)
	$(PY) -m mypy
	@set -e; for d in $(MYPY_OWN_RUNS); do MYPYPATH=$$d $(PY) -m mypy $$d; done
	$(VENV)/bin/lint-imports --no-cache

# The local Kubernetes control plane's binaries (built from source once, then cached), and the
# operator image built from its Dockerfile (buildah, offline; rebuilt only when its inputs change).
testenv: install
	hack/testenv.sh build

# Both Dockerfiles built as written (buildah, offline, on a base made from Debian's packages),
# checked (non-root, --help as a uid without a passwd entry, no torch in the operator's, a
# two-replica run through a SIGKILL in the trainer's) and exported as OCI archives: their ids,
# sizes, users and build times, then a JSON line (docs/operations.md, "Images").
images: install
	hack/testenv.sh images

# The demo checkpoints every 25 steps into a fresh directory (emptied first: a location belongs
# to one job, and a later run resumes from it only with that job's --job-name, docs/checkpoint.md).
DEMO_CHECKPOINTS ?= /tmp/transom-demo-checkpoints

demo: install
	rm -rf $(DEMO_CHECKPOINTS) demo-logs
	$(VENV)/bin/transom run --replicas 3 --nproc-per-replica 1 \
		--inject kill:replica=1,step=20 --end-on caught_up:1 --end-margin 10 \
		--summary-json demo.summary.json --log-dir demo-logs \
		--checkpoint-uri $(DEMO_CHECKPOINTS) --checkpoint-interval 25 \
		-- $(PY) examples/train_tiny_gpt.py --steps 400

# Leaves the test environment running (`kubectl get tj -A`, then `hack/testenv.sh down`).
e2e-demo: install testenv
	$(PY) hack/e2e_demo.py --panels-out e2e-demo.panels.json

CHAOS_SCENARIOS ?=
chaos: install testenv
	$(PY) hack/chaos $(if $(CHAOS_SCENARIOS),--scenarios $(CHAOS_SCENARIOS))

# Side by side on the machine's cores (pytest-xdist): the unit and fuzz tests; then the integration
# tests beside the e2e tests that need only kwok's nodes, which mostly wait for the API server and
# the operator while the integration tests want the CPU. The e2e tests share one control plane,
# so they run on one worker (tests/e2e/conftest.py groups them); docs/testenv.md has the figures.
# The slowest tests are listed at the end: what to look at first when the suite grows slow.
TEST_WORKERS ?= 2
test: testenv
	$(MAKE) --no-print-directory -j2 --output-sync=target lint test-unit
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not real_nodes" --durations=25 tests/integration tests/e2e \
		$(PYTEST_ARGS)
	$(MAKE) test-compat

# The tests that need the test environment's real nodes (a control plane with three of them).
test-real: install testenv
	$(PY) -m pytest -m real_nodes tests/e2e $(PYTEST_ARGS)

$(COMPAT_VENV)/.deps-installed: pyproject.toml
	@test -n "$(COMPAT_PYTHON)" || { echo "make test-compat needs Python 3.12: pyenv install 3.12 (or apt-get install python3.12 where Debian has it), or set COMPAT_PYTHON=/path/to/python3.12" >&2; exit 1; }
	$(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip setuptools
	PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(COMPAT_PY) -m pip install --quiet "torch==$(COMPAT_TORCH)" \
		-e ".[train,operator,s3]" pytest pytest-timeout hypothesis requests
	touch $@

# A smoke subset (import, a two-replica run with a SIGKILL, checkpoint save and restore, peer
# state transfer, DCP interop) on the oldest supported torch, under Python 3.12.
test-compat: $(COMPAT_VENV)/.deps-installed
	PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(COMPAT_PY) -m pip install --quiet --no-deps \
		--no-build-isolation -e .
	$(COMPAT_PY) -c 'import sys, torch; print("test-compat: Python", sys.version.split()[0], "torch", torch.__version__)'
	$(COMPAT_PY) -m pytest -m compat tests/unit tests/integration -p no:cacheprovider $(PYTEST_ARGS)

# Wheels of the small dependencies (not torch) for the GPU machine's Python (3.12 by
# default), which reaches no package registry: carry $(WHEELHOUSE) there with the tree.
GPU_PYTHON_VERSION ?= 3.12
# The operator's packages too: the unit tests of the compat subset import it.
GPU_REQUIREMENTS := "aiohttp>=3.9" "pydantic>=2.6" "google-crc32c>=1.5" "prometheus-client>=0.19" "fsspec>=2024.2" "kopf>=1.37" \
	"kubernetes>=29" "pyyaml>=6" pytest pytest-timeout hypothesis requests
# The benchmarks' own: torchft 0.2.0 without its torch (the machine's own is used) and the
# OpenTelemetry packages that torchft imports.
GPU_BENCH_REQUIREMENTS := opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
GPU_DOWNLOAD = $(PY) -m pip download --quiet --dest $(WHEELHOUSE) --only-binary=:all: \
	--python-version $(GPU_PYTHON_VERSION) \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
wheelhouse: install
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(GPU_DOWNLOAD) $(GPU_REQUIREMENTS) $(GPU_BENCH_REQUIREMENTS)
	$(GPU_DOWNLOAD) --no-deps "torchft==0.2.0" "torchft-nightly==$(TORCHFT_NIGHTLY_VERSION)"
	@du -sh $(WHEELHOUSE)

# On the GPU machine: the wheelhouse installed into a directory of its own (--target) and put
# on PYTHONPATH beside the machine's own torch (a venv made from a Python that is itself a
# venv would not see that torch), then the CUDA tests (-m cuda), the compat subset and the
# GPU benchmarks. Fails without a CUDA device. GPU_PYTHON: the Python that has torch.
GPU_PYTHON ?= python3
GPU_SITE ?= .cache/gpu-site
GPU_ENV = PATH=$(CURDIR)/$(GPU_SITE)/bin:$$PATH PYTHONPATH=$(CURDIR)/launcher:$(CURDIR)/operator:$(CURDIR)/$(GPU_SITE)
test-gpu:
	@test -d $(WHEELHOUSE) || { echo "no $(WHEELHOUSE): run 'make wheelhouse' on a machine with PyPI first" >&2; exit 1; }
	$(GPU_PYTHON) -m pip install --quiet --no-index --find-links $(WHEELHOUSE) --target $(GPU_SITE) $(GPU_REQUIREMENTS)
	$(GPU_ENV) $(GPU_PYTHON) -c 'import torch, sys; assert torch.cuda.is_available(), "make test-gpu needs a CUDA GPU"; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
	$(GPU_ENV) $(GPU_PYTHON) -m pytest -m "cuda or compat" tests/unit tests/integration -p no:cacheprovider $(PYTEST_ARGS)
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/checkpoint_stall.py --device cuda --size-mb 1024
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/checkpoint_stall.py --device cuda --size-mb 8192 --repeats 1
	$(GPU_ENV) $(GPU_PYTHON) benchmarks/kill_recovery.py --kinds kill --model-args "--device ctx --dim 512 --layers 8"

# On the GPU machine: the recovery and overhead benchmarks on CUDA (the replicas share the
# GPU, Gloo across them), beside torchft; GPU_ROUNDS rounds each (the device time is short).
# `make -k bench-gpu` runs each benchmark even if another fails.
GPU_ROUNDS ?= 3
GPU_RECOVERY_STEPS ?= 200
bench-gpu: bench-gpu-overhead bench-gpu-recovery
bench-gpu-deps:
	@test -d $(WHEELHOUSE) || { echo "no $(WHEELHOUSE): run 'make wheelhouse' on a machine with PyPI first" >&2; exit 1; }
	$(GPU_PYTHON) -m pip install --quiet --no-index --find-links $(WHEELHOUSE) --target $(GPU_SITE) \
		$(GPU_REQUIREMENTS) $(GPU_BENCH_REQUIREMENTS)
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --find-links $(WHEELHOUSE) --target $(GPU_SITE) "torchft==0.2.0"
	rm -rf .cache/torchft-nightly
	$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --find-links $(WHEELHOUSE) --target .cache/torchft-nightly \
		"torchft-nightly==$(TORCHFT_NIGHTLY_VERSION)"
bench-gpu-overhead: bench-gpu-deps
	BENCH_DEVICE=cuda $(GPU_ENV) $(GPU_PYTHON) benchmarks/ftar_overhead.py --models mlp --shapes cpu_bound \
		--repeats $(GPU_ROUNDS)
bench-gpu-recovery: bench-gpu-deps
	BENCH_DEVICE=cuda $(GPU_ENV) $(GPU_PYTHON) benchmarks/recovery.py --shapes cpu_bound --repeats $(GPU_ROUNDS) \
		--steps $(GPU_RECOVERY_STEPS) --kill-step 30

# The unit and fuzz tests (`make test` runs them beside `make lint`).
test-unit: install
	$(PY) -m pytest -n $(TEST_WORKERS) tests/unit tests/fuzz $(PYTEST_ARGS)

test-integration: install
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: install testenv
	$(PY) -m pytest -m "not real_nodes" tests/e2e $(PYTEST_ARGS)

# Optional: what only benchmarks compare against (not needed by the product or the tests).
# torchft-nightly is the same `torchft` package: into a directory of its own, which its
# benchmark runs put first on PYTHONPATH (benchmarks/_replicas.py); it uses the venv's torch.
TORCHFT_NIGHTLY_VERSION ?= 2026.10.26
bench-deps: install
	$(PY) -m pip install --quiet "torchft==0.2.0"
	rm -rf .cache/torchft-nightly
	$(PY) -m pip install --quiet --no-deps --target .cache/torchft-nightly "torchft-nightly==$(TORCHFT_NIGHTLY_VERSION)"

# The versions the images install (images/constraints.txt), from the project venv: run it after
# changing a dependency in pyproject.toml (tests/unit/test_images.py checks the pins' bounds).
constraints: install
	$(PY) hack/image_constraints.py

generate: install
	$(PY) -m transom_operator.crdgen
	$(PY) -m transom_operator.dashboard
	$(PY) -m transom.defaults --write docs/defaults.md

clean-venv:
	rm -rf $(VENV) .venv
