# Set-up and checks. Every target creates .venv and installs requirements.txt when they are missing or stale.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# Runs the whole suite on the CPU (gloo). pytest's exit code 5 (nothing collected) is a failure too:
# a suite that runs no test proves nothing.
test: $(VENV)/.installed
	@$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc
