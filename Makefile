# Two entry points (README): `make quickstart` and `make test`. Both create the environment.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first, pinned: an open torch range asked for before it is installed pulls a CUDA build.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup helm promtool lint test test-fast quickstart crd clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	# DS_BUILD_OPS=0: DeepSpeed (trainer extra) installs without compiling its C++/CUDA ops.
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[trainer,local,dev]'
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
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile trainer_image/Dockerfile

test: setup helm promtool lint
	$(BIN)/python -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

quickstart: setup
	$(BIN)/ftjob run --local examples/quickstart.yaml

crd: setup
	$(BIN)/ftjob crd > crds/finetunejobs.finetune.dev.yaml

clean:
	rm -rf $(VENV) .tools .ftjob .mypy_cache .ruff_cache .pytest_cache
