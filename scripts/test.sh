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
mkdir -p target
log=target/test-output.log
cargo test 2>&1 | tee "$log"
# One closing line for the whole run: the sum over every test binary and the doctests.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
