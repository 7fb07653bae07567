# Setup, demo and tests. Every target creates .venv (Python 3.11) on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned for development so pip takes the CPU build on disk instead of a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m autopar.demo

# Everything (what .ci/run calls; at most 25 minutes on 2 cores). No -x: one run reports every failure, and a
# worker pool that dies in one test does not hide what the remaining tests would have found. Two pytest
# workers (pytest-xdist), one per core, each test file on one worker so its cached plans are built once: the
# tests run single-threaded (tests/conftest.py), and most of them plan on one core.
TEST_WORKERS ?= -n 2 --dist loadfile
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_WORKERS) tests

# While working (at most 3 minutes on 2 cores): rules, planner, codegen, inspect, cli and a few gloo cases;
# tests marked slow run in `make test` only.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(TEST_WORKERS) -m "not slow" tests

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
