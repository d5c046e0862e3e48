# pdserve: the two commands a newcomer needs are `make demo` and `make test`.
# On these CPU machines torch is pinned to the local CPU wheel (2.13.0). For CUDA / ROCm see README.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test demo protos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

protos: install
	$(PY) -m protos.build

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

demo: install
	$(VENV)/bin/pdserve demo

clean:
	rm -rf $(VENV) build *.egg-info
