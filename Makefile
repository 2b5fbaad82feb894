.PHONY: run generate test bootstrap lint demo

# The main job: the engine serving the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000.
# The compiled kernels first, saying what is built and how long it took (once per source and
# ISA level; later runs find them built).
run: bootstrap
	.venv/bin/kvfleet kernels build
	.venv/bin/kvfleet serve

# One offline generation with the same engine, no server.
generate: bootstrap
	.venv/bin/kvfleet generate --chat "Write a haiku about Kubernetes."

# A rollout to watch: the dev cluster, operator, router and Prometheus, a good revision
# promoted and a slow one rolled back (`kubectl get servingpools,rollouts -n demo -w` in
# another shell). Ctrl-C stops everything.
demo: bootstrap
	.venv/bin/kvfleet dev-cluster build
	.venv/bin/kvfleet dev-cluster demo

# The whole test suite (what CI runs).
test:
	scripts/test.sh

bootstrap:
	scripts/bootstrap.sh

lint: bootstrap
	.venv/bin/ruff check kvfleet tests e2e bench && .venv/bin/mypy && .venv/bin/lint-imports
