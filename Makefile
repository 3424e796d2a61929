# Transom developer entry points. Everything a fresh machine needs is installed from here.
#
#   make demo      a local fault-tolerant run: 3 replicas, one SIGKILLed at step 20, checkpoints
#   make test      unit, integration and e2e tests (installs and builds the test control plane first)
#   make generate  regenerate derived files (CRDs) from their sources
#
# The virtual environment lives outside the checkout (torch is several GB), keyed by the
# hash of pyproject.toml so a dependency change builds a fresh one; `.venv` links to it.

PYTHON ?= python3
DEPS_HASH := $(shell sha256sum pyproject.toml | cut -c1-12)
VENV ?= $(HOME)/.cache/transom/venv-$(DEPS_HASH)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install testenv demo test test-unit test-integration test-e2e generate clean-venv

$(VENV)/.deps-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.deps-installed
	@# Re-point the editable install at this checkout (a cached venv may have served another).
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	ln -sfn $(VENV) .venv

# The local Kubernetes control plane's binaries (built from source once, then cached).
testenv: install
	hack/testenv.sh build

# The demo checkpoints every 25 steps into a fresh directory (a second run would resume).
DEMO_CHECKPOINTS ?= /tmp/transom-demo-checkpoints

demo: install
	rm -rf $(DEMO_CHECKPOINTS)
	$(VENV)/bin/transom run --replicas 3 --nproc-per-replica 1 \
		--inject kill:replica=1,step=20 --summary-json demo.summary.json \
		--checkpoint-uri $(DEMO_CHECKPOINTS) --checkpoint-interval 25 \
		-- $(PY) examples/train_tiny_gpt.py --steps 60

test: install testenv
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: install
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: install testenv
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

generate: install
	$(PY) -m transom_operator.crdgen

clean-venv:
	rm -rf $(VENV) .venv
