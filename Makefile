# `make run`  : prepare everything on a fresh machine and run a short demo chat through the local stack.
# `make test` : prepare everything on a fresh machine and run the whole test suite.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROTOS  := $(wildcard proto/dflash/v1/*.proto)
GEN     := $(patsubst proto/%.proto,%_pb2.py,$(PROTOS))
PYTEST_ARGS ?=

.PHONY: all run test proto model bench clean lint

all: $(STAMP) proto model

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# CPU build of torch from local disk first: a looser pin would pull a multi-GB CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test,dev]'
	touch $@

proto: $(GEN)

dflash/v1/%_pb2.py: proto/dflash/v1/%.proto $(STAMP)
	$(VPY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $<

model: $(STAMP) proto
	$(VPY) -m dflash.cli prepare-model smollm2-135m-instruct --dtype float32 --dtype bfloat16

test: $(STAMP) proto model
	$(VPY) -m ruff check .              # lint first: seconds, and a finding fails the run
	bash deploy/install-test-tools.sh   # Debian's prometheus and docker-compose (tests use them)
	$(VPY) -m pytest -q -ra $(PYTEST_ARGS)

run: $(STAMP) proto model
	$(VPY) -m dflash.cli demo

bench: $(STAMP) proto model
	$(VPY) -m bench.run_cpu

lint: $(STAMP)
	$(VPY) -m ruff check .

clean:
	rm -rf $(VENV) dflash/v1/*_pb2*.py* .pytest_cache
