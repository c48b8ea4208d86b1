#!/usr/bin/env bash
# The test command: brings up RabbitMQ 3.x (127.0.0.1:5672) and RabbitMQ 4.x (127.0.0.1:5673,
# scripts/broker4.sh), checks formatting and lints, runs the unit tests and doctests once
# and the integration suite against each broker, reporting each separately. The benchmarks'
# smoke tests need the `bench` feature, so every test run here turns it on.
# DELAY_BRIDGE_SKIP_RMQ4=1 skips the 4.x run (it is then reported as skipped, not passed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

bash scripts/broker.sh
if [ "${DELAY_BRIDGE_SKIP_RMQ4:-}" != 1 ]; then
  bash scripts/broker4.sh start
fi
DELAY_BRIDGE_PYTHON=$(bash scripts/python-env.sh)
export DELAY_BRIDGE_PYTHON

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy --all-targets [--all-features], --lib --no-default-features -- -D warnings"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --all-features -- -D warnings
# What a library user compiles: no CLI, no sandbox, no benchmarks.
cargo clippy --lib --no-default-features -- -D warnings

mkdir -p target
# passed failed, summed over the `test result:` lines of a log
count() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
       END { printf "%d %d\n", p, f }' "$1"
}
summary=()
status=0

version3=$(rabbitmqctl -q version 2>/dev/null || echo "3.x")
echo "== cargo test: unit tests, doctests, and the integration suite against RabbitMQ $version3 (127.0.0.1:5672)"
log3=target/test-output-rabbitmq3.log
start=$SECONDS
set +e
cargo test --features bench 2>&1 | tee "$log3"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || status=1
read -r p3 f3 < <(count "$log3")
summary+=("RabbitMQ $version3 on 5672 (unit, doc and integration tests): $p3 passed, $f3 failed in $((SECONDS - start)) s")

p4=0 f4=0
if [ "${DELAY_BRIDGE_SKIP_RMQ4:-}" != 1 ]; then
  version4=$(bash scripts/broker4.sh ctl version 2>/dev/null || echo "4.x")
  echo "== cargo test --lib --test integration --test alarm --test size_limit --test tls against RabbitMQ $version4 (127.0.0.1:5673; TLS node 5696)"
  log4=target/test-output-rabbitmq4.log
  start=$SECONDS
  set +e
  DELAY_BRIDGE_TEST_URL="amqp://guest:guest@127.0.0.1:5673/%2f" \
    DELAY_BRIDGE_TEST_CTL="bash scripts/broker4.sh ctl" \
    DELAY_BRIDGE_TEST_MANAGEMENT_URL="http://127.0.0.1:15673" \
    DELAY_BRIDGE_TEST_TLS_BROKER="scripts/broker4.sh" DELAY_BRIDGE_TEST_TLS_PORT=5696 \
    cargo test --features bench --lib --test integration --test alarm --test size_limit --test tls 2>&1 | tee "$log4"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || status=1
  read -r p4 f4 < <(count "$log4")
  summary+=("RabbitMQ $version4 on 5673 (unit and integration tests): $p4 passed, $f4 failed in $((SECONDS - start)) s")
else
  summary+=("RabbitMQ 4.x: SKIPPED (DELAY_BRIDGE_SKIP_RMQ4=1)")
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
# One closing line for the whole run.
echo "tests: $((p3 + p4)) passed, $((f3 + f4)) failed"
exit $status
