#!/usr/bin/env bash
# The test command: brings up three brokers, RabbitMQ 3.x (the host's package, 127.0.0.1:5672),
# 4.0 (Debian trixie's, 127.0.0.1:5673) and 4.3 (Debian sid's, 127.0.0.1:5674), the last two
# with scripts/debian-broker.sh; checks formatting and lints, runs the unit tests and
# doctests once and the integration suite against each broker, reporting each separately;
# checks and unit-tests the alerting rules with promtool (scripts/promtool.sh).
# The benchmarks' smoke tests need the `bench` feature, so every test run here turns it on.
# DELAY_BRIDGE_SKIP_RMQ4=1 skips the 4.0 run, DELAY_BRIDGE_SKIP_RMQ43=1 the 4.3 run (each is
# then reported as skipped, not passed).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

bash scripts/broker.sh
# The two Debian brokers start (installing on first use) in the background, one after the
# other, while the lints and the 3.x run compile; each of their runs waits for them first.
mkdir -p target
debian_log=target/debian-brokers.log
(
  set -e
  if [ "${DELAY_BRIDGE_SKIP_RMQ4:-}" != 1 ]; then
    bash scripts/debian-broker.sh trixie start
  fi
  if [ "${DELAY_BRIDGE_SKIP_RMQ43:-}" != 1 ]; then
    bash scripts/debian-broker.sh sid start
  fi
) >"$debian_log" 2>&1 &
debian_brokers=$!
DELAY_BRIDGE_PYTHON=$(bash scripts/python-env.sh)
# libfaketime, for the adversary suite's bridge whose clock is behind (skipped without it).
if ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq faketime >/dev/null ||
    echo "test.sh: could not install faketime; the clock test will say it is skipped"
fi
export DELAY_BRIDGE_PYTHON
# Four tests of a binary at a time (cargo's default is one per core, two here): an
# integration test mostly waits on the broker and on delays, so two at a time left the
# machine a third idle (2026-11-29, the 4.3.6 leg on 2 cores: 486 s at two, 251 s at four,
# the machine 66 % busy). A test whose verdict is a time or an order under load runs with
# no other test's world beside it (`Setup::alone` in tests/support). RUST_TEST_THREADS
# overrides.
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-4}

echo "== cargo fmt --all --check"
cargo fmt --all --check
echo "== cargo clippy --workspace --all-targets [--all-features], -p delay-bridge --lib --no-default-features -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --all-features -- -D warnings
# What a library user compiles: no CLI, no sandbox, no benchmarks.
cargo clippy -p delay-bridge --lib --no-default-features -- -D warnings

# The alerting rules (ops/prometheus): valid, and their unit tests pass.
echo "== promtool check rules, promtool test rules (ops/prometheus)"
rules_status=passed
set +e
promtool=$(bash scripts/promtool.sh) &&
  "$promtool" check rules ops/prometheus/delay-bridge-alerts.yml &&
  (cd ops/prometheus && "$promtool" test rules delay-bridge-alerts.test.yml)
rc=$?
set -e
[ "$rc" -eq 0 ] || rules_status=FAILED

# passed failed, summed over the `test result:` lines of a log
count() {
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed;?$/) p += $(i-1); if ($i ~ /^failed;?$/) f += $(i-1) } }
       END { printf "%d %d\n", p, f }' "$1"
}
summary=("Alerting rules (promtool check rules, test rules): $rules_status")
status=0
[ "$rules_status" = passed ] || status=1

version3=$(rabbitmqctl -q version 2>/dev/null || echo "3.x")
echo "== cargo test --no-fail-fast: unit tests, doctests, and the integration suite against RabbitMQ $version3 (127.0.0.1:5672)"
log3=target/test-output-rabbitmq3.log
start=$SECONDS
set +e
# The adversary suite's stream-protocol attacks run against this broker's stream listener
# (scripts/broker.sh enables it); the Debian brokers have none, and those tests say so.
DELAY_BRIDGE_STREAM_PORT=5552 cargo test --workspace --no-fail-fast 2>&1 | tee "$log3"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || status=1
read -r p3 f3 < <(count "$log3")
summary+=("RabbitMQ $version3 on 5672 (unit, doc and integration tests): $p3 passed, $f3 failed in $((SECONDS - start)) s")

# The publisher examples (examples/: Python, Node, Java, Go), each run against a bridge on
# 5672 by scripts/examples.sh: one summary line per language, passed, FAILED or skipped with
# its reason. Passed and FAILED ones count in the closing line (with the 3.10.8 run's
# tests); a skipped one counts in neither.
echo "== scripts/examples.sh: the publisher examples against a bridge on RabbitMQ $version3 (127.0.0.1:5672)"
logx=target/test-output-examples.log
# The cargo test run built target/debug/delay-bridge (the integration tests run it): the
# examples use it when that run passed, rather than build the binary alone (cargo resolves
# other features for it and compiles anew).
examples_bin=
[ "$rc" -ne 0 ] || examples_bin=target/debug/delay-bridge
set +e
DELAY_BRIDGE_BIN=$examples_bin bash scripts/examples.sh 2>&1 | tee "$logx"
rc=${PIPESTATUS[0]}
set -e
mapfile -t example_lines < <(grep -E '^examples: .*: (passed|FAILED|skipped)' "$logx")
if [ "$rc" -ne 0 ] && ! grep -q '^examples: .*: FAILED' "$logx"; then
  example_lines+=("examples: FAILED (scripts/examples.sh exited $rc)")
fi
[ "$rc" -eq 0 ] || status=1
summary+=("${example_lines[@]}")
p3=$((p3 + $(printf '%s\n' "${example_lines[@]}" | grep -c ': passed' || true)))
f3=$((f3 + $(printf '%s\n' "${example_lines[@]}" | grep -c ': FAILED' || true)))

# The integration suite against a broker from a Debian suite (scripts/debian-broker.sh):
# SUITE AMQP_PORT MANAGEMENT_PORT TLS_PORT. Adds its line to the summary and its counts to
# p4 f4.
p4=0 f4=0
# Waits once for the background start of the Debian brokers and shows its output; a failed
# start fails the test command (each run then fails on its own for want of its broker).
debian_started=
await_debian_brokers() {
  [ -z "$debian_started" ] || return 0
  debian_started=1
  echo "== scripts/debian-broker.sh trixie start, sid start (started in the background)"
  if ! wait "$debian_brokers"; then
    status=1
    summary+=("Debian brokers: FAILED to start (target/debian-brokers.log)")
  fi
  cat "$debian_log"
}
run_debian_broker() {
  local suite=$1 port=$2 management=$3 tls=$4 version log rc p f
  await_debian_brokers
  version=$(bash scripts/debian-broker.sh "$suite" ctl version 2>/dev/null || echo "($suite)")
  # The smoke binary's fault suite runs against every broker; its benchmark smoke runs
  # (bench::) test the bench's own commands, which the 3.10.8 run covers.
  # The unit tests and doctests use no broker: the 3.x run covers them.
  echo "== cargo test --workspace --no-fail-fast --test integration --test alarm --test size_limit --test tls, and --test smoke fault_suite:: against RabbitMQ $version (127.0.0.1:$port; TLS node $tls)"
  log=target/test-output-rabbitmq-$suite.log
  start=$SECONDS
  set +e
  (
    export DELAY_BRIDGE_TEST_URL="amqp://guest:guest@127.0.0.1:$port/%2f" \
      DELAY_BRIDGE_TEST_CTL="bash $PWD/scripts/debian-broker.sh $suite ctl" \
      DELAY_BRIDGE_TEST_MANAGEMENT_URL="http://127.0.0.1:$management" \
      DELAY_BRIDGE_TEST_TLS_BROKER="$PWD/scripts/debian-broker.sh $suite" DELAY_BRIDGE_TEST_TLS_PORT=$tls
    cargo test --workspace --no-fail-fast --test integration --test alarm --test size_limit --test tls
    first=$?
    cargo test --no-fail-fast -p delay-bridge-bench --test smoke -- fault_suite::
    second=$?
    [ "$first" -eq 0 ] && [ "$second" -eq 0 ]
  ) 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || status=1
  read -r p f < <(count "$log")
  p4=$((p4 + p)) f4=$((f4 + f))
  summary+=("RabbitMQ $version on $port (integration tests): $p passed, $f failed in $((SECONDS - start)) s")
}
if [ "${DELAY_BRIDGE_SKIP_RMQ4:-}" != 1 ]; then
  run_debian_broker trixie 5673 15673 5696
else
  summary+=("RabbitMQ 4.0 (trixie): SKIPPED (DELAY_BRIDGE_SKIP_RMQ4=1)")
fi
if [ "${DELAY_BRIDGE_SKIP_RMQ43:-}" != 1 ]; then
  run_debian_broker sid 5674 15674 5697
else
  summary+=("RabbitMQ 4.3 (sid): SKIPPED (DELAY_BRIDGE_SKIP_RMQ43=1)")
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
# One closing line for the whole run.
echo "tests: $((p3 + p4)) passed, $((f3 + f4)) failed"
exit $status
