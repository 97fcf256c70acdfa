# The two commands a user needs (see README.md):
#   make serve   set up .venv and serve the embedded model on a local Ray cluster
#   make test    set up .venv (and the test tools) and run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup serve test bench test-tools

setup:
	@bash scripts/setup.sh

serve: setup
	$(VENV)/bin/ferrox serve --config deploy/serve.yaml $(ARGS)

test-tools:
	@bash scripts/test-tools.sh

test: setup test-tools
	RAY_AUTH_MODE=disabled $(PY) -X faulthandler -m pytest -q $(ARGS)

bench: setup
	$(VENV)/bin/ferrox bench offline $(ARGS)
