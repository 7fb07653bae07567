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

test: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
