# The two README commands: `make train` (set up, then run the main job) and `make test`
# (set up, then check the code and run the whole suite on both ends of the supported torch range).
# Extra arguments go through ARGS, e.g. `make train ARGS="experiment=debug"` or
# `make test ARGS="-m 'not slow'"` (given to both pytest runs).
PYTHON ?= python3
# The newest supported torch (CPU build), with the test and lint tools.
VENV := .venv
# The oldest supported torch, 2.9.0: what torch_xla 2.9 pins, so the XLA backend's environment
# (the xla extra brings the torchao release built for it).
OLDEST_VENV := .venv-xla

# What `make test` leaves for .ci/suite_report.py: the phases' times, the suites' timings.
REPORT := .ci-report
export REPORT
# COVERAGE=1: every Python process the newest suite starts measures its coverage of axtorch/
# (.ci/coverage_hook.sh), the XLA workers (torch 2.9.0) among them, and the report holds each
# package to its floor. Off by default: coverage's tracer slows the suite by about half, and on a
# slow hour that takes CI past its 90 minutes (a fresh clone's run was at 13% after an hour).
COVERAGE ?=
MEASURE := $(if $(filter 1,$(COVERAGE)),COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage)
# The floors are held only when the whole suite ran: ARGS that select fewer tests cover less.
FLOOR_CHECK := $(if $(strip $(ARGS)),,$(if $(filter 1,$(COVERAGE)),--check-floors))

.PHONY: train test test-quick check test-newest test-oldest newcomer environments suites

train: $(VENV)/.axtorch-base
	$(VENV)/bin/axtorch-train $(ARGS)

# The whole suite, as CI runs it, in phases: both environments at once; then lint and types, the
# suite on the newest torch and on torch 2.9.0, with the newcomer's journey (~8 min, mostly pip
# unpacking on one core) beside them (.ci/beside.sh); then the report: each phase's wall time,
# the costliest test files (wall and CPU seconds) and fixtures, and (COVERAGE=1) coverage per
# package against its floor. The two suites take turns: run beside each other on 2 cores they
# took longer (47:46 from a fresh clone against 40:59), the cores being busy already.
# MAKE_COMMAND, not MAKE: a line that expands MAKE runs even under `make -n`.
test:
	@rm -rf $(REPORT) .coverage-data && mkdir -p $(REPORT) .coverage-data && date +%s >$(REPORT)/started
	@.ci/phase.sh environments $(MAKE_COMMAND) --no-print-directory -j2 environments
	@PYTHON=$(PYTHON) .ci/beside.sh "newcomer's journey (beside)" .ci/newcomer.sh -- $(MAKE_COMMAND) --no-print-directory suites; status=$$?; \
	  .ci/phase.sh "coverage report" $(VENV)/bin/python .ci/suite_report.py $(REPORT) $(FLOOR_CHECK) || { [ $$status -ne 0 ] || status=1; }; \
	  exit $$status

suites:
	@.ci/phase.sh "lint and types" $(MAKE_COMMAND) --no-print-directory check
	@.ci/phase.sh "suite on torch 2.13.0" $(MAKE_COMMAND) --no-print-directory test-newest
	@.ci/phase.sh "suite on torch 2.9.0" $(MAKE_COMMAND) --no-print-directory test-oldest

# The inner loop: every test that starts no subprocess journey (the
# `journey` marker: torchrun groups, XLA workers, the CLI and the documented commands, Slurm), on
# the newest torch, without coverage. Before a commit that touches launchers, backends, the CLI or
# the docs, run `make test`.
test-quick: $(VENV)/.axtorch-test
	$(VENV)/bin/python -m pytest $(PARALLEL) -m "not journey" --durations=10 $(ARGS)

environments: $(VENV)/.axtorch-test $(OLDEST_VENV)/.axtorch-xla

# Lint, formatting and types (and the container images' Dockerfiles): fast, so they run first.
check: $(VENV)/.axtorch-test
	$(VENV)/bin/ruff check axtorch tests benchmarks .ci
	$(VENV)/bin/ruff format --check axtorch tests benchmarks .ci
	$(VENV)/bin/mypy axtorch
	$(VENV)/bin/hadolint launch/docker/*.Dockerfile

# One pytest worker per core, each taking whole scheduling groups (tests/xdist_scheduling.py): a file (so
# its module fixtures run once) or a finer group named there. The groups start in collection
# order, which puts the groups with the most slow tests first (xdist would otherwise start the
# groups with the most tests first). Most tests wait on subprocesses (torchrun, XLA workers, the
# documented commands) part of the time.
PARALLEL := -n auto --dist loadgroup --no-loadscope-reorder

test-newest: $(VENV)/.axtorch-test $(OLDEST_VENV)/.axtorch-xla
	$(MEASURE) $(VENV)/bin/python -m pytest $(PARALLEL) --durations=15 --timings-json $(REPORT)/newest.json $(ARGS)

# The same suite on torch 2.9.0, less what does not depend on the torch version: the XLA tests
# and the XLA cases of the parity files (their workers already run on 2.9, the simulated hosts
# too; the one-device references they compare with are checked on 2.9 by the native cases), the multi-node launcher (torchrun's
# rendezvous; the native backend's own tests stay), the Kubernetes manifests and Dockerfiles (YAML and
# hadolint), Slurm's two-node jobs but their preemption and the failing job (a stand-in torchrun,
# no torch at all) (the preemption tests stay: torch 2.9's
# torchrun passes SIGTERM on to workers Slurm already signalled, and they must still save and requeue),
# the documented commands (they exercise the docs), the
# single-process kill, goodput and signal journeys (process handling; the torchrun preemption
# test stays), config composition, mesh rules and the planner (Hydra and arithmetic), the data
# pipeline (numpy and tokenizers, with its streamed training runs), import layering and feature
# locality (source text), the suite's own tooling (tiers, timings, coverage floors, scheduling groups), the launcher script, the command-line journeys whose pieces the unit tests cover on 2.9 (generate,
# export, the SmolLM2 fine-tune), the GGUF file formats and the real GGUFs' tokenizers and special
# tokens (numpy, gguf and tokenizers; the models they load are the HF-parity-tested ones) and the
# GPU script's CPU smoke run, and the planner's large-mesh rows (the planner is arithmetic; the dry
# run they price it against is held to a real step on 2.9.0 by the gloo check).
ALSO_NOT_ON_OLDEST := \
	--deselect tests/parallel/test_native_backend.py::test_launcher_runs_native_training_and_rejects_a_mesh_that_does_not_fit \
	--deselect tests/train/test_preemption.py::test_a_sigterm_and_its_repeat_save_at_a_step_boundary_and_exit_resume_me \
	--deselect tests/train/test_preemption.py::test_a_sigint_saves_at_a_step_boundary_and_exits_resume_me \
	--deselect tests/infer/test_generate.py::test_generate_command_continues_prompts_from_a_trained_run \
	--deselect tests/launch/test_slurm.py::test_a_two_node_job_submitted_as_documented_matches_one_device \
	--deselect tests/launch/test_slurm.py::test_a_node_whose_job_step_is_killed_requeues_counted_and_resumes_exactly \
	--deselect tests/launch/test_slurm.py::test_a_node_that_never_comes_back_leaves_the_job_waiting_says_what_to_do_and_loses_no_checkpoint \
	--deselect tests/launch/test_slurm.py::test_a_failing_job_requeues_itself_max_requeues_times \
	--deselect tests/parallel/test_native_lora.py::test_lora_under_xla_sharding_trains_as_one_device_does \
	--deselect tests/parallel/test_document_masking_backends.py::test_xla_matches_one_device \
	--deselect tests/parallel/test_layer_stacks_parallel.py::test_xla_scan_over_pattern_groups_equals_running_the_layers_unrolled \
	--deselect tests/cli/test_plan_check.py::test_the_planner_prices_large_meshes_within_a_tenth_of_the_dry_run
test-oldest: $(OLDEST_VENV)/.axtorch-xla
	$(OLDEST_VENV)/bin/python -m pytest $(PARALLEL) --durations=15 --timings-json $(REPORT)/oldest.json --ignore=tests/parallel/test_xla_backend.py --ignore=tests/parallel/test_xla_multihost.py \
		--ignore=tests/parallel/test_xla_dry_run.py --ignore=tests/parallel/test_tpu_compile.py \
		--ignore=tests/parallel/test_multi_node.py --ignore=tests/launch/test_kubernetes_manifests.py --ignore=tests/launch/test_container_images.py --ignore=tests/docs \
		--ignore=tests/infer/test_xla_decode.py --ignore=tests/train/test_kill_and_resume.py \
		--ignore=tests/train/test_goodput.py --ignore=tests/config --ignore=tests/parallel/test_mesh_rules.py \
		--ignore=tests/train/test_gpu_train_benchmark.py --ignore=tests/cli/test_plan.py \
		--ignore=tests/cli/test_plan_search.py --ignore=tests/data --ignore=tests/health \
		--ignore=tests/train/test_streaming_training.py \
		--ignore=tests/test_feature_locality.py --ignore=tests/test_suite_tooling.py --ignore=tests/test_scheduling_groups.py --ignore=tests/interop/test_gguf_export.py \
		--ignore=tests/interop/test_gguf_llama.py --ignore=tests/interop/test_gguf_quantisations.py \
		--ignore=tests/interop/test_gguf_sentencepiece.py --ignore=tests/interop/test_gguf_smollm2.py \
		--ignore=tests/interop/test_gguf_experts.py --ignore=tests/interop/test_gguf_pre_tokenizers.py \
		--ignore=tests/interop/test_gguf_gemma3.py --ignore=tests/interop/test_imported_special_tokens.py \
		$(ALSO_NOT_ON_OLDEST) $(ARGS)

# A wheel, installed into an empty environment, run from outside the repository.
newcomer:
	PYTHON=$(PYTHON) .ci/newcomer.sh

# A tier that does not exist says which do.
test-%:
	@echo "make: there is no test tier '$*'; the tiers are: test (the whole suite, as CI runs it)," \
	  "test-quick (no subprocess journeys, newest torch), test-newest, test-oldest" >&2; exit 2

# uv installs (.ci/install.sh); it comes into the newest environment with pip.
$(VENV)/.axtorch-uv:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "uv>=0.9"
	touch $@

$(VENV)/.axtorch-base: pyproject.toml $(VENV)/.axtorch-uv
	.ci/install.sh $(VENV)/bin/uv $(VENV) "" "torch==2.13.0"
	touch $@

$(VENV)/.axtorch-test: $(VENV)/.axtorch-base
	.ci/install.sh $(VENV)/bin/uv $(VENV) test,lint "torch==2.13.0"
	.ci/coverage_hook.sh $(VENV)
	touch $@

$(OLDEST_VENV)/.axtorch-xla: pyproject.toml $(VENV)/.axtorch-uv
	$(PYTHON) -m venv $(OLDEST_VENV)
	.ci/install.sh $(VENV)/bin/uv $(OLDEST_VENV) xla,tpu,test
	.ci/coverage_hook.sh $(OLDEST_VENV)
	touch $@
