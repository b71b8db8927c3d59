# Everything a fresh machine needs: `make demo` and `make test` create and fill .venv (idempotent, pinned).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
REQS   := requirements/base.txt requirements/test.txt requirements/lint.txt requirements/lock.txt pyproject.toml

.PHONY: all install demo lint test test-fast bench parity info serve clean

all: test

$(STAMP): $(REQS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c requirements/lock.txt -r requirements/base.txt -r requirements/test.txt \
	  -r requirements/lint.txt
	# speculators pulls torchvision/torchaudio; their wheels are CUDA-linked and break transformers' imports on CPU
	$(PIP) uninstall -q -y torchvision torchaudio 2>/dev/null || true
	$(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>/dev/null || \
	  $(PIP) install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/generate.py --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

serve: $(STAMP)
	$(PY) -m jdspark.serve --checkpoint checkpoints/default --slots 16 --port 8000

bench: $(STAMP)
	$(PY) scripts/bench.py --json

parity: $(STAMP)
	$(PY) scripts/parity.py --self-test --json

info: $(STAMP)
	$(PY) -m kimi.info --preset k3 --json

clean:
	rm -rf $(VENV) .pytest_cache .jax_cache
