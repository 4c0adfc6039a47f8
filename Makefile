# amp-doctor developer commands. `make install` then `make test` on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch: on this project's machines it is a local wheel and
# installs in seconds; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-test test test-fast test-all acceptance lint typecheck demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(MAKE) install-test

# The test-only extras (transformers, accelerate, lightning), with torch held at TORCH_SPEC
# so that none of them pulls another torch build.
install-test: $(BIN)/python
	printf '%s\n' "$(TORCH_SPEC)" | $(BIN)/python -m pip install -q -c /dev/stdin -e ".[test]"

# Test processes (pytest-xdist). Most tests run a script in a subprocess and wait for it,
# so two workers on two cores take about 60% of the serial time. One torch thread each:
# the tests' models are tiny, and two workers with two threads each would fight for the
# cores. TEST_WORKERS=0 runs the tests in this process (for pdb).
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
	-n $(TEST_WORKERS) --dist worksteal

# Every test: the README's test command, and what CI runs. test-fast leaves out the slow
# subprocess runs (-m slow) and the acceptance suite, for the edit-test loop.
test:
	$(PYTEST) tests

test-fast:
	$(PYTEST) -m "not slow and not acceptance" tests

# The name earlier READMEs gave the whole suite.
test-all: test

# Real-style training scripts through the CLI (tests/acceptance; `make test` leaves them out).
acceptance:
	$(PYTEST) -m acceptance tests/acceptance

lint:
	$(BIN)/python -m ruff check .

typecheck:
	$(BIN)/python -m mypy amp_doctor

demo:
	$(BIN)/python sample_models/gallery.py

# One torch thread, as issue 15's targets are stated: the steps are timed by the process's
# CPU time, which other jobs on a shared machine do not inflate. e.g. BENCH_ARGS='--threads 1 --rounds 6'
BENCH_ARGS ?= --threads 1 --rounds 4 --steps 20

# run.py: the sample models and the wide-and-deep GPT (524 leaf modules) against plain
# AMP; bench_scale.py: cost against the number of layers; bench_gc.py: Python GC
# collections per step (the medians leave them out). Both appended to results.md.
bench:
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS) --markdown benchmarks/results.md --json benchmarks/results.json
	$(BIN)/python benchmarks/bench_scale.py --threads 1 --markdown benchmarks/results.md
	$(BIN)/python benchmarks/bench_gc.py --threads 1 --markdown benchmarks/results.md

clean:
	rm -rf $(VENV) build *.egg-info runs .pytest_cache
