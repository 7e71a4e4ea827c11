# `make demo` and `make test` work on a fresh clone: both depend on `install`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without a CUDA driver, take the CPU build of torch (an unpinned torch pulls GBs of CUDA wheels).
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: install
	$(PY) examples/prefix_caching.py

# Lint and type-check first (config in pyproject.toml); any failure, pytest's exit code 5 included, fails the target.
# Two workers, one test file each at a time (module-scoped servers and engines start once), long files
# first: tests/conftest.py orders them and gives each worker one torch thread.
test: install
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: install
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
