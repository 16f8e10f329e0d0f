# The two commands of the README: `make serve` and `make test`. Both set up .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned CPU build first, so nothing later pulls a CUDA torch.
	$(PY) -m pip install -q torch==2.13.0
	# One environment for every target: dev is the test tools plus the bench extra.
	$(PY) -m pip install -q -e '.[dev]'
	# Native CPU kernels are compiled once here (about a minute), not inside the first test or request.
	$(PY) -m pagoda.kernels
	touch $(STAMP)

.PHONY: install serve generate test lint bench-models
install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagoda serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/pagoda generate $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy
	OMP_NUM_THREADS=2 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy

bench-models: $(STAMP)
	$(PY) scripts/make_bench_models.py
