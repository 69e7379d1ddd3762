# The two commands of the README: `make demo` and `make test`. Both create .venv on first use (venv.mk).
include venv.mk

.PHONY: demo test unit unit-portable browser-test client-test notebooks book grade release bench train-tiny clean

demo: $(STAMP)
	A4_SOLUTIONS=1 $(PY) -m a4 demo

# The student skeleton in sync with solutions/, the unit tests (against the reference solutions), the notebooks
# against the reference solutions and against the skeleton, the book.
test: $(STAMP)
	$(PY) -m a4.course check
	$(MAKE) unit
	$(MAKE) notebooks book

# Two pytest workers on two cores: one torch thread each (THREADS), or every small op pays for thread
# oversubscription. Another thread count splits the sums differently: `make unit THREADS=2`.
# tests/test_browser.py runs in browser-test only, tests/clients in client-test only.
THREADS ?= 1
unit: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) A4_SOLUTIONS=1 $(PY) -m pytest -q -n 2 --dist loadfile --ignore=tests/test_browser.py \
		--ignore=tests/clients $(UNIT_ARGS) tests

# The numerics of the unit tests on PyTorch's plain C++ kernels instead of this CPU's vectorised ones: sums in another
# order, as on another CPU (CI runs this after `make test`; `ATEN_CPU_CAPABILITY=avx2 make unit-portable` tries
# AVX2's). The files that compare a4's floating-point results with transformers' (layers, models, the engines' greedy
# tokens, logprobs), where another order of the sums could flip a token or pass a tolerance; the rest (the server,
# the course tooling, pools and trees of integers) runs the same arithmetic or none, and CI's time is better spent
# elsewhere. `make unit ATEN_CPU_CAPABILITY=default` runs everything that way. The training script's reproduction of
# the shipped run (a minute and a half on one worker) is left to `make unit`: its tolerance, 1e-3 relative, is set to
# tell a changed recipe, far above the ~1e-7 that another order of the sums moves a loss.
PORTABLE_TESTS = test_deltanet test_gated_attention test_gdn_decode test_layers test_merged_linear test_moe test_mtp \
	test_qwen3_5_model test_qwen3_model test_engine_qwen3 test_engine_qwen3_5 test_step_loop test_speculative \
	test_speculative_verify test_logprobs test_sampling_params test_tensor_parallel_layers test_trained_checkpoint
unit-portable: $(STAMP)
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=$(THREADS) A4_SOLUTIONS=1 $(PY) -m pytest -q -n 2 --dist loadfile \
		--deselect tests/test_trained_checkpoint.py::test_the_training_script_reproduces_the_shipped_run \
		$(PORTABLE_TESTS:%=tests/%.py)

# Notebooks in JupyterLab in a real browser (tests/test_browser.py, about 3 minutes on 2 cores): Playwright from the
# `browser` extra, which only this target installs, and Debian's Chromium at /usr/bin/chromium (apt-get install
# chromium; CI's .ci/run installs it). A4_REQUIRE_BROWSER=1: a missing browser fails the run instead of skipping it.
BROWSER_STAMP := $(VENV)/.installed-browser
$(BROWSER_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[book,browser]"
	touch $(BROWSER_STAMP)

browser-test: $(BROWSER_STAMP)
	OMP_NUM_THREADS=1 A4_REQUIRE_BROWSER=1 $(PY) -m pytest -q tests/test_browser.py

# lm-eval and guidellm against `python -m a4 serve` (tests/clients, a few minutes on 2 cores), installed in their own
# environment .venv-clients (a CPU torch, transformers, the clients of tests/clients/requirements.txt), never in .venv.
# A4_REQUIRE_CLIENTS=1: a missing client fails the run instead of skipping it.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
$(CLIENTS_STAMP): tests/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(if $(TORCH),$(CLIENTS_VENV)/bin/python -m pip install -q "$(TORCH)")
	$(CLIENTS_VENV)/bin/python -m pip install -q -r tests/clients/requirements.txt
	touch $(CLIENTS_STAMP)

client-test: $(STAMP) $(CLIENTS_STAMP)
	OMP_NUM_THREADS=1 A4_SOLUTIONS=1 A4_REQUIRE_CLIENTS=1 $(PY) -m pytest -q tests/clients

# Every cell passes with A4_SOLUTIONS=1; on the skeleton every check cell fails and no other cell does.
notebooks: $(STAMP)
	$(PY) -m a4.course verify-notebooks

# The book's source root is the repository root (see book/_config.yml); notebooks run against the reference
# solutions, widgets fall back to static figures, and a failing cell or any warning fails the build. The notebooks
# run first, two at a time with one torch thread each (jupyter-cache's parallel executor; Jupyter Book would run them
# one after another), into a cache emptied first, since it would notice a change in a notebook but not in a4's code;
# the build reads their outputs from it (execute_notebooks: cache). Then the tests of the built pages (tables,
# offline math, page 08's figures), which need this fresh build.
BOOK_CACHE := book/_build/.jupyter_cache
book: $(STAMP)
	rm -rf $(BOOK_CACHE)
	yes | $(VENV)/bin/jcache notebook -p $(BOOK_CACHE) add notebooks/[0-9][0-9]_*.ipynb > /dev/null
	A4_SOLUTIONS=1 A4_STATIC=1 OMP_NUM_THREADS=1 $(VENV)/bin/jcache project -p $(BOOK_CACHE) execute \
		--executor local-parallel --timeout 300
	A4_SOLUTIONS=1 A4_STATIC=1 $(VENV)/bin/jupyter-book build . --config book/_config.yml --toc book/_toc.yml \
		--path-output book --all -W -n --keep-going
	A4_SOLUTIONS=1 A4_BOOK_HTML=book/_build/html $(PY) -m pytest -q tests/test_book.py

# Grade a student's handout with this repository's notebooks and check code, against the student's exercise files
# only: make grade STUDENT=../their-handout (default: this checkout's skeleton); GRADE_ARGS="--notebook 01" for one.
STUDENT ?= .
grade: $(STAMP)
	$(PY) -m a4.course grade $(STUDENT) $(GRADE_ARGS)

# The student handout (without solutions/, with the student's own Makefile, README, CI and book intro from
# handout/): make release OUT=../a4-handout
OUT ?= ../a4-handout
release: $(STAMP)
	$(PY) -m a4.course release $(OUT)

bench: $(STAMP)
	A4_SOLUTIONS=1 $(PY) -m a4 bench

# Retrain the tiny Qwen3.5 that ships in a4/trained/qwen3_5-tiny (minutes on a GPU, hours on 2 cores; the shipped
# run's log is there).
train-tiny: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m a4.train_tiny

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .cache book/_build
