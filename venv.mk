# The virtual environment that the course's Makefile and the student handout's Makefile install into on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# On these Linux machines torch==2.13.0 is a local CPU build; an unpinned torch would pull a multi-GB CUDA build.
# Elsewhere, install PyTorch first (https://pytorch.org, CPU build is enough) and run `make TORCH= demo`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[book]"
	touch $(STAMP)
