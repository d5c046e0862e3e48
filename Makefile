# pdserve: the two commands a newcomer needs are `make demo` and `make test`.
# On these CPU machines torch is pinned to the local CPU wheel (2.13.0). For CUDA / ROCm see README.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0 triton==3.9.0
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
# Everything pip resolves for pdserve[test,mooncake] is pinned in $(LOCK), torch and triton aside: TORCH_SPEC pins
# them (the CPU wheel and the triton the tests run under TRITON_INTERPRET), and a CUDA / ROCm torch brings the triton
# it was built with. `make lock` re-resolves the lock in a scratch venv and regenerates the gRPC code with the
# grpcio-tools it locked, so the committed code and the lock always agree (tests/protos and tests/test_lock check).
LOCK_VENV := .lock-venv
LOCK_EXCLUDE := ^(torch|triton|setuptools|wheel)==

.PHONY: install test demo protos lock clean

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip
	$(PY) -m pip install -q -c $(LOCK) $(TORCH_SPEC)
	$(PY) -m pip install -q -c $(LOCK) -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(LOCK_VENV)/bin/python -m pip install -q ".[test,mooncake]"
	{ echo "# pdserve's locked install: \`make lock\` writes it (pip freeze of pdserve[test,mooncake] resolved"; \
	  echo "# on $$(date -u +%Y-%m-%d), Python $$($(LOCK_VENV)/bin/python -c 'import platform; print(platform.python_version())'),"; \
	  echo "# torch from TORCH_SPEC=$(TORCH_SPEC), not pinned here); \`make install\` installs with it as constraints."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude pdserve | grep -Ev '$(LOCK_EXCLUDE)'; } > $(LOCK)
	$(LOCK_VENV)/bin/python -m protos.build
	rm -rf $(LOCK_VENV)

protos: install
	$(PY) -m protos.build

# TEST_WORKERS: pytest-xdist workers (--dist loadgroup: a module's tests on one worker, tests/conftest.py names the
# groups). 0, the default, runs the suite in this process: on the 2-core AVX2 EPYC two workers took 45.0 min from
# cold caches (2026-12-07), one test saw the other worker's processes, and there is no serial run there to compare
# yet, so CI stays serial. --durations=30: where the time went.
TEST_WORKERS ?= 0

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30 tests

demo: install
	$(VENV)/bin/pdserve demo

clean:
	rm -rf $(VENV) $(LOCK_VENV) build *.egg-info
