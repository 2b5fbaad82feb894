.PHONY: run test bootstrap lint

# The main job: the engine on the embedded SmolLM2-135M model.
run: bootstrap
	.venv/bin/kvfleet generate "Write a haiku about Kubernetes."

# The whole test suite (what CI runs).
test:
	scripts/test.sh

bootstrap:
	scripts/bootstrap.sh

lint: bootstrap
	.venv/bin/ruff check kvfleet tests e2e bench && .venv/bin/mypy && .venv/bin/lint-imports
