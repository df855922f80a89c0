# protofl: two set-up commands, `make demo` and `make test`; both install what is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint typecheck pytest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, as the CPU build (a wheel on local disk); then the package with its extras.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/protofl run

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy src/protofl

pytest: $(STAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_skeleton.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
