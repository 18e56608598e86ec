# Two commands for a fresh machine: `make run` (set up + the default pipeline run) and
# `make test` (set up + the whole test suite). Both create the virtual environment themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run smoke test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: install
	$(PY) -m flows.mnist $(ARGS)

smoke: install
	$(PY) -m flows.mnist --preset smoke $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(ARGS)

bench: install
	$(PY) -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) storage .pytest_cache
