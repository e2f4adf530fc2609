# The two quick-start commands (`make demo`, `make test`) each set up a local virtual
# environment from nothing. torch is installed first, pinned, only when the environment
# has none: on the project's build machines `torch==2.13.0` is a local CPU wheel, while
# an unpinned spelling would pull a multi-GB CUDA build. Override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,demo]'
	touch $@

# Main job: four nodes on the emulated 11-city WAN train a model, beside a dense
# synchronous baseline; a summary table and a plot (ciuic-node demo --help).
demo: $(STAMP)
	$(VENV)/bin/ciuic-node demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ciuic_p2p tests bench
	$(VENV)/bin/ruff format --check ciuic_p2p tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q

# The whole test suite: lint, types, then the tests.
test: lint typecheck unit

bench: $(STAMP)
	$(PY) bench/codec.py --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
