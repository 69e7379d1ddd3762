# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# On these Linux machines torch==2.13.0 is a local CPU build; an unpinned torch would pull a multi-GB CUDA build.
# Elsewhere, install PyTorch first (https://pytorch.org, CPU build is enough) and run `make TORCH= demo`.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test unit notebooks book grade release bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[book]"
	touch $(STAMP)

demo: $(STAMP)
	A4_SOLUTIONS=1 $(PY) -m a4 demo

# Unit tests, notebooks against the reference solutions and against the skeleton, skeleton in sync, the book.
test: $(STAMP)
	$(PY) -m a4.course check
	$(PY) -m pytest -q -n 2 --dist loadfile tests
	$(MAKE) notebooks book

notebooks: $(STAMP)
	$(PY) -m a4.course verify-notebooks

book: $(STAMP)
	A4_SOLUTIONS=1 $(VENV)/bin/jupyter-book build book/ -W -n --keep-going

grade: $(STAMP)
	$(PY) -m a4.course grade .

bench: $(STAMP)
	A4_SOLUTIONS=1 $(PY) -m a4 bench

clean:
	rm -rf $(VENV) .cache book/_build
