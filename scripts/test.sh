#!/usr/bin/env bash
# The test command: brings up RabbitMQ, checks formatting and lints, runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

bash scripts/broker.sh
DELAY_BRIDGE_PYTHON=$(bash scripts/python-env.sh)
export DELAY_BRIDGE_PYTHON

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings
echo "== cargo test"
cargo test --all-targets
cargo test --doc
