# The two commands a new user needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# the CPU onnxruntime only: onnx-cuda never goes with onnx (one onnxruntime folder)
EXTRAS ?= edge,fleet,cloud,models,models-edge,models-cloud,tools,dev,onnx,onnx-export
# The CPU build of torch (pip's find-links on these machines holds it; a CUDA machine may
# override TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

# OpenMP threads (llama.cpp, torch) spin-wait by default and collapse throughput on 2 cores.
export OMP_WAIT_POLICY := passive

.PHONY: demo test bench lint clean setup

demo: $(STAMP)
	$(VENV)/bin/cascade demo

test: $(STAMP)
	$(VENV)/bin/pytest -q --durations=30

bench: $(STAMP)
	$(PY) bench/edge_overhead.py

# ruff (style, line length 120), the layer contract in pyproject.toml (import-linter) and the size
# rules (no source file over 400 lines, no function over 60: scripts/check_structure.py), and the
# README's and docs' relative links (scripts/check_links.py)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_structure.py
	$(PY) scripts/check_links.py

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# llama-cpp-python compiles llama.cpp from source once (5-7 min) into a wheel directory outside
# the tree (~/.cache/cascade/wheels), which every later setup and CI run reuses.
$(STAMP): pyproject.toml scripts/build-llama-wheel.sh | $(PY)
	wheel_dir=$$(PYTHON=$(PY) bash scripts/build-llama-wheel.sh) && \
	  $(PY) -m pip install -q --find-links "$$wheel_dir" "$(TORCH_SPEC)" -e ".[$(EXTRAS)]"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
