# Two entry points (README): `make quickstart` and `make test`. Both create the environment.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first, pinned (constraints.txt): an open torch range asked for before it is installed
# pulls a CUDA build.
TORCH  := $(shell sed -n 's/^\(torch==[^ ]*\).*/\1/p' constraints.txt)
# uv (from PyPI) resolves and installs the rest in parallel: minutes of pip's resolving and
# serial downloads become seconds.
UV     := uv==0.13.8
PYTEST_ARGS ?=

.PHONY: setup helm promtool lint test test-fast quickstart crd clean

setup: $(VENV)/.installed

# torch by pip, which takes the CPU build where pip's configuration finds one on local disk (uv
# reads no pip configuration). The rest by uv, torch held at the installed build by
# constraints.txt. Both write bytecode at install (uv's --compile-bytecode, on every core, only
# for what uv installs): where PYTHONDONTWRITEBYTECODE is set, every test process would compile
# torch and transformers again at import. DS_BUILD_OPS=0: DeepSpeed (trainer extra, an sdist)
# builds without compiling its C++/CUDA ops. --system-certs: uv trusts the machine's certificate
# store, as pip does by its configuration (uv's own roots are refused where TLS is intercepted).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH) $(UV)
	DS_BUILD_OPS=0 $(BIN)/uv pip install -q --system-certs --compile-bytecode \
		--python $(BIN)/python -c constraints.txt -e '.[trainer,local,dev]'
	touch $@

helm:
	bash scripts/fetch-helm.sh

# promtool (Debian's prometheus package) unit-tests the chart's alerts (tests/chart/test_alert_rules.py).
promtool:
	@command -v promtool >/dev/null || { command -v apt-get >/dev/null && \
		{ apt-get install -y -q prometheus >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; }; }; } || \
		echo "WARNING: promtool could not be installed (apt-get missing or failed): alert unit tests skip"

lint: setup
	$(BIN)/ruff check operator trainer_image local_cluster tests bench
	$(BIN)/ruff format --check operator trainer_image local_cluster tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile trainer_image/Dockerfile

# Two sides at once. The slow tests that run processes (multi-process torchrun and end to end:
# much of their time is spent waiting on step delays, restarts, rendezvous) start as soon as the
# environment is ready, and take their end-to-end tests last (tests/conftest.py). Beside them,
# one after the other: helm and promtool (only the quick chart tests need them), lint (mypy
# alone is minutes of CPU on a fresh machine, with no cache), then one pytest of the quick tests
# and the `inprocess` slow ones (the planner's traced steps: pure CPU on one core, no waits),
# which use the core the other side leaves idle while it waits. That side's output is printed
# after; it fails the target as lint would. Exit 5 (nothing selected by PYTEST_ARGS in one
# run) is not a failure.
test: setup
	@log=$$(mktemp); \
	{ $(MAKE) -k --no-print-directory helm promtool lint; lint=$$?; \
	  $(BIN)/python -m pytest -q -ra --durations=10 -m "not slow or inprocess" $(PYTEST_ARGS); \
	  fast=$$?; { [ $$fast -eq 0 ] || [ $$fast -eq 5 ]; } && [ $$lint -eq 0 ]; } >$$log 2>&1 & \
	side=$$!; \
	$(BIN)/python -m pytest -q -ra --durations=25 -m "slow and not inprocess" $(PYTEST_ARGS); \
	slow=$$?; wait $$side; side=$$?; \
	echo "== helm, promtool, lint, the quick and the inprocess tests, run beside the others:"; \
	cat $$log; rm -f $$log; \
	{ [ $$slow -eq 0 ] || [ $$slow -eq 5 ]; } && [ $$side -eq 0 ]

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

quickstart: setup
	$(BIN)/ftjob run --local examples/quickstart.yaml

crd: setup
	$(BIN)/ftjob crd > crds/finetunejobs.finetune.dev.yaml

clean:
	rm -rf $(VENV) .tools .ftjob .mypy_cache .ruff_cache .pytest_cache
