# Two commands on a fresh machine: `make demo` and `make test`. Each installs into ./.venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Everything runs offline: no model, dataset or metric hub.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: install install-dev demo test clean

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

test: install-dev
	$(OFFLINE) $(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) demo_data outputs
