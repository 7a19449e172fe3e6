# Two commands for a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
# Each creates .venv itself; re-running is quick once .venv is complete (stamp files).
PYTHON ?= python3
VENV := .venv
LATEST := .venv-latest
# --no-cache-dir: PyPI's torch wheels are CUDA builds (about 3.5 GB of wheels per environment); a
# cache would keep a second copy of them on a CI disk that must also hold both environments.
PIP_FLAGS := -q --disable-pip-version-check --no-cache-dir
# The newest torch, installed without torch_xla, proves the core does not need it.
LATEST_TORCH := torch==2.14.1

# pytest exits 5 when it collected no test: a run that tests nothing must not pass.
PYTEST_STATUS = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

.PHONY: demo test test-xla-stack test-latest lint docs clean

$(VENV)/.stamp: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[xla,test]"
	touch $@

$(LATEST)/.stamp: pyproject.toml Makefile
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install $(PIP_FLAGS) $(LATEST_TORCH)
	$(LATEST)/bin/pip install $(PIP_FLAGS) -e ".[test]" $(LATEST_TORCH)
	touch $@

demo: $(VENV)/.stamp
	PJRT_DEVICE=CPU $(VENV)/bin/tiekit demo

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check tiekit tests examples benchmarks
	$(VENV)/bin/ruff format --check tiekit tests examples benchmarks
	$(VENV)/bin/mypy

# --durations: the slowest tests in every log, to see where the 20-minute budget goes.
# Everything on the pinned XLA stack (torch 2.9.1 + torch_xla 2.9.0, XLA:CPU devices).
test-xla-stack: $(VENV)/.stamp
	PJRT_DEVICE=CPU TIEKIT_REQUIRE_XLA=1 $(VENV)/bin/pytest -q -p no:cacheprovider --durations=25; $(PYTEST_STATUS)

# The non-XLA tests on the newest torch, torch_xla absent.
test-latest: $(LATEST)/.stamp
	$(LATEST)/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_xla') is not None)"
	$(LATEST)/bin/pytest -q -p no:cacheprovider --durations=25 -m "not xla"; $(PYTEST_STATUS)

# The documentation site (mkdocs.yml), warnings as errors: a broken link, a missing page or a
# docstring mkdocstrings cannot render fails. Its code blocks run in tests/test_docs.py.
docs: $(VENV)/.stamp
	$(VENV)/bin/mkdocs build --strict --quiet

# The two environments install side by side (pip spends most of it unpacking wheels on one core),
# the checks run beside the second install; then the two suites at once: one alone kept 1.3-1.4
# of the 2 cores busy (process start-ups, launchers' and rendezvous' waits), the two together
# both (a fresh-clone run of 1d80c38: 18 min 50 s, against 23 min 3 s one after the other in the
# same hour). -O keeps each job's output in one piece in the log.
test:
	$(MAKE) -j2 -O lint docs $(LATEST)/.stamp
	$(MAKE) -j2 -O test-xla-stack test-latest

clean:
	rm -rf $(VENV) $(LATEST)
