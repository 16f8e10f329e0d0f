# The two commands of the README: `make serve` and `make test`. Both set up .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
# One environment, two stamps: serving's dependencies, then (for `make test` and `make lint` only) the test
# tools and the bench extra on top.
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# The kernels have a stamp of their own: a pull that changes them rebuilds them at the next make, not at the
# next start, and without redoing the pip installs.
KERNELS_STAMP := $(VENV)/.kernels-built
KERNEL_SOURCES := $(wildcard src/pagoda/kernels/*.cpp src/pagoda/kernels/*.h src/pagoda/kernels/*.py)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned CPU build first, so nothing later pulls a CUDA torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# dev is the test tools plus the bench extra.
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

# Native CPU kernels are compiled here (a minute or two), not inside the first test or request.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_SOURCES)
	$(PY) -m pagoda.kernels
	touch $(KERNELS_STAMP)

.PHONY: install serve generate test lint bench-models
install: $(KERNELS_STAMP)

serve: $(KERNELS_STAMP)
	$(VENV)/bin/pagoda serve $(ARGS)

generate: $(KERNELS_STAMP)
	$(VENV)/bin/pagoda generate $(ARGS)

test: $(KERNELS_STAMP) $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	OMP_NUM_THREADS=2 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench-models: $(STAMP)
	$(PY) scripts/make_bench_models.py
