# The README's two commands: `make demo` (set up, then PPO on the built-in task) and
# `make test` (set up, then the test suite). Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.oppo-installed

.PHONY: demo test bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on the project's CPU machines this takes the local CPU build;
	# elsewhere pip picks the platform's (CUDA) build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/oppo train

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/oppo bench --quick --out benchmarks/latest

clean:
	rm -rf $(VENV) build src/*.egg-info
