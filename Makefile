# Two commands on a fresh machine: `make demo` and `make test`. Each installs into ./.venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Everything runs offline: no model, dataset or metric hub.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Every pytest run here: a passing test's temporary directory is removed when it ends, and a green run leaves nothing
# under /tmp/pytest-of-<user> (a run writes several GB of checkpoints there; pytest would keep the last three runs).
# A failing test's directory stays, to look at.
PYTEST_TMP := -o tmp_path_retention_policy=failed

# `make test-lower-bounds`: the oldest versions requirements.txt admits, installed exactly, in their own venv.
LOWER  := .venv-lower
# `make gpu-check` runs with the project's .venv by default. On a GPU machine without network, run it with that
# machine's own Python instead, `make gpu-check GPU_PYTHON=python3`, and the few packages it lacks are carried as
# wheels that `make gpu-wheels` downloads beforehand where there is network (see docs/gpu.md).
GPU_PYTHON ?= $(PY)
WHEELS := wheels
GPU_SITE := .gpu-site
GPU_WHEELS := datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 torchcodec==0.16.0
ifeq ($(GPU_PYTHON),$(PY))
GPU_READY := $(VENV)/.installed-dev
GPU_ENV :=
else
GPU_READY := $(GPU_SITE)/.installed
GPU_ENV := PYTHONPATH=$(GPU_SITE)
endif

.PHONY: install install-dev demo test test-long test-slurm test-lower-bounds gpu-wheels gpu-check gpu-check-suite \
	gpu-bench clean

$(VENV)/.installed: requirements.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt -c constraints.txt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt -c constraints.txt
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(OFFLINE) $(PY) demo.py

# Two pytest workers (pytest-xdist), one test file each at a time (module fixtures train once), the longest files
# first (LONGEST_FIRST in tests/conftest.py), then name order:
# most of a test is one process starting or one thread training, so a 2-core machine's second core would idle.
# `make test` leaves out the tests marked `long` (learning checks that need many steps, the GPU tools' dry modes, the
# benchmarks' quick runs, the BERT runs under inductor); `make test-long` runs only those, and .ci/run both.
# The 15 slowest tests are listed at the end, so a slow one is seen the day it lands.
TEST_WORKERS ?= 2
PYTEST := $(OFFLINE) $(PY) -m pytest -q $(PYTEST_TMP) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
test: install-dev
	$(PYTEST) -m "not long" tests

# The 8-process launches (marker `alone`, about 10 GB each) run after the rest, on one worker: never two at once.
test-long: install-dev
	$(PYTEST) -m "long and not alone" tests
	$(OFFLINE) $(PY) -m pytest -q $(PYTEST_TMP) --durations=5 -m alone tests

# slurm/multinode.sbatch on a real Slurm: a throwaway cluster of slurmds on this machine (tests/slurm/). Needs root;
# installs Debian's Slurm 22.05 and munge with apt-get if they are missing. 5 to 8 minutes on 2 cores.
test-slurm: install-dev
	tests/slurm/install_slurm.sh
	$(OFFLINE) $(PY) -m pytest -q $(PYTEST_TMP) -p no:cacheprovider tests/slurm/check_multinode.py

$(LOWER)/.installed: requirements.txt requirements-dev.txt
	rm -rf $(LOWER)
	$(PYTHON) -m venv $(LOWER)
	sed -n 's/>=/==/p' requirements.txt requirements-dev.txt > $(LOWER)/lower-bounds.txt
	$(LOWER)/bin/python -m pip install --disable-pip-version-check -q -r $(LOWER)/lower-bounds.txt
	touch $@

# The learning tests of both scripts (1 and 2 processes, exports loaded back) on the lower bounds.
test-lower-bounds: $(LOWER)/.installed
	$(OFFLINE) $(LOWER)/bin/python -m pytest -q $(PYTEST_TMP) -p no:cacheprovider tests/test_bert_cls.py tests/test_resnet.py \
		-k "learns_and_counts_exactly or outputs_load_anywhere or exports_load_into_plain_torchvision"

# Pure-Python wheels (and TorchCodec's) for a Python 3.12 x86_64 GPU machine; a few MB, git-ignored.
gpu-wheels:
	$(PYTHON) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(WHEELS) $(GPU_WHEELS)

$(GPU_SITE)/.installed:
	@ls $(WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(WHEELS)/: run 'make gpu-wheels' first, on a machine with network"; exit 2; }
	$(GPU_PYTHON) -m pip install --disable-pip-version-check -q --no-index --no-deps --target $(GPU_SITE) $(WHEELS)/*.whl
	touch $@

# Every GPU check with tiny fixtures made on the spot, a report under benchmarks/results/ (about 8 min on one H100);
# on a machine without a GPU it says so and exits 0.
gpu-check: $(GPU_READY)
	$(GPU_ENV) $(OFFLINE) $(GPU_PYTHON) tools/gpu_check.py

# The GPU benchmark (benchmarks/gpu_bench.py): one table, appended to benchmarks/RESULTS.md with the machine; about 6
# minutes on one H200 (its --budget). It reads data/thucnews_titles/ and data/bert-base-chinese/ (docs/data.md);
# GPU_BENCH_ARGS passes flags on (--budget SECONDS, --only TEXT...). Without a visible GPU it says so and exits 0.
GPU_BENCH_ARGS ?=
gpu-bench: $(GPU_READY)
	$(GPU_ENV) $(OFFLINE) $(GPU_PYTHON) benchmarks/gpu_bench.py $(GPU_BENCH_ARGS)

# The whole test suite with the GPU machine's Python (it must pass where a GPU is visible, too).
gpu-check-suite: $(GPU_READY)
	$(GPU_ENV) $(OFFLINE) $(GPU_PYTHON) -m pytest -q $(PYTEST_TMP) -p no:cacheprovider -n 8 --dist loadfile tests

clean:
	rm -rf $(VENV) $(LOWER) $(GPU_SITE) demo_data outputs
