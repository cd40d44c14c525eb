# Thin wrappers over cargo; `cargo xtask --help` lists everything.
.PHONY: test figures figures-test sweep ci

test:
	cargo test --workspace

figures:
	cargo xtask figures

figures-test:
	cargo test -p figures

sweep:
	cargo xtask sweep pressure-grid --quick

ci:
	bash .ci/run
