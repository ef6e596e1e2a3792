# `make up` starts everything; `make test` runs the tests. Both create .venv and install what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: up test install bench-engine clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/switchyard up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
