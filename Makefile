# The two quick-start commands (`make demo`, `make test`) each set up a local virtual
# environment from nothing. torch is installed first, pinned, only when the environment
# has none: on the project's build machines `torch==2.13.0` is a local CPU wheel, while
# an unpinned spelling would pull a multi-GB CUDA build. Override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check lint typecheck unit bench clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[train,dev,demo]'
	touch $@

# Main job: four nodes on the emulated 11-city WAN train a model, beside a dense
# synchronous baseline; a summary table and a plot (ciuic-node demo --help).
demo: $(STAMP)
	$(VENV)/bin/ciuic-node demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ciuic_p2p tests bench docs/generate_reference.py
	$(VENV)/bin/ruff format --check ciuic_p2p tests bench docs/generate_reference.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The status page is tested in a real headless browser: Debian's chromium, installed
# here when missing and we may (root with apt); otherwise that one test says why it
# cannot run.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
	  >/dev/null; } || echo "make: no chromium; the status page test will be skipped"

unit: $(STAMP) browser
	$(VENV)/bin/pytest -q

# The whole test suite: lint, types, then the tests.
test: lint typecheck unit

# The fast tier: every test that starts no process, opens no real socket and drives no
# browser (pure machines, in-memory daemons on virtual time). How long it takes, as
# measured: docs/index.md.
check: $(STAMP)
	$(VENV)/bin/pytest -q -m "not processes and not network and not browser"

bench: $(STAMP)
	$(PY) bench/codec.py --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# bench/compare.py's separate environment: hivemind 1.1.12 (numpy<2.4: newer numpy makes
# its 8-bit codecs fail silently) beside the pinned torch and this project.
#     .venv-bench/bin/python bench/compare.py --json
BENCH_VENV ?= .venv-bench

# The README's comparison with hivemind and torch.distributed, all three workloads, its
# plots into bench/results/compare/ (about 30 minutes on 2 cores).
compare: bench-deps
	$(BENCH_VENV)/bin/python bench/compare.py --json --workloads round,train,wan \
	  --plots bench/results/compare $(COMPARE_ARGS)

bench-deps: $(BENCH_VENV)/.installed

$(BENCH_VENV)/.installed: pyproject.toml
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import torch" 2>/dev/null || $(BENCH_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(BENCH_VENV)/bin/python -m pip install -q hivemind==1.1.12 "numpy<2.4"
	$(BENCH_VENV)/bin/python -m pip install -q -e ".[demo]"
	touch $@

.PHONY: bench-deps compare
