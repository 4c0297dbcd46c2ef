# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, run the quick demo
#   make test   - create .venv, install, run the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test setup
demo: $(STAMP)
	$(VENV)/bin/python scripts/demo.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	# torch pinned for development: the CPU wheel of 2.13.0 lies on local disk
	$(VENV)/bin/pip install --quiet "torch==2.13.0"
	$(VENV)/bin/pip install --quiet -e ".[test]"
	# third-party model code for tests/conformance: the torchvision wheels here are CUDA builds, so no
	# dependencies (they would pull a second torch); timm's own dependencies come with transformers
	$(VENV)/bin/pip install --quiet --no-deps "torchvision==0.28.0" "timm==1.0.31"
	touch $(STAMP)
