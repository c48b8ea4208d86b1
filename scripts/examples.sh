#!/usr/bin/env bash
# Runs the publisher examples (examples/python, node, java, go) against a bridge: builds
# delay-bridge (debug), starts it on RabbitMQ at 127.0.0.1:5672 with a throw-away prefix
# and route (ingress <prefix>.delayed, target amq.direct), runs each example, stops the
# bridge and deletes every queue and exchange of the prefix. Each example publishes with
# x-delay, with x-deliver-at, a recurring schedule and a cancel (a plain publish of the
# tombstone), prints each arrival and fails if one is missing or late by more than 1 s or
# the cancelled one arrives.
#
# A missing toolchain is installed as root from Debian (nodejs/npm, default-jdk-headless
# and librabbitmq-client-java, golang-go and golang-github-rabbitmq-amqp091-go-dev),
# amqplib with `npm ci`, pika with scripts/python-env.sh; a language whose toolchain
# cannot be had is skipped with its reason. Prints one line per language, `examples: NAME:
# passed`, `FAILED (...)` or `skipped (...)`, then `examples: N passed, N failed, N
# skipped`; exits 1 when one failed.
#
# Variables: EXAMPLES (the languages to run, default "python node java go"),
# DELAY_BRIDGE_BIN (a built delay-bridge to use instead of building one),
# DELAY_BRIDGE_PYTHON (a python with pika, as scripts/test.sh exports),
# EXAMPLES_MANAGEMENT_URL (default http://127.0.0.1:15672, for the clean-up; guest/guest).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

url="amqp://guest:guest@127.0.0.1:5672/%2f"
management=${EXAMPLES_MANAGEMENT_URL:-http://127.0.0.1:15672}
languages=${EXAMPLES:-python node java go}
prefix="examples-$(date +%s)-$$"
ingress="$prefix.delayed"
cancel_exchange="$prefix.cancel" # <prefix>.cancel: where tombstones are published
target=amq.direct
work=$(mktemp -d)
started=$SECONDS

say() { echo "examples.sh: $*"; }
summary=()
passed=0 failed=0 skipped=0

# --- the bridge: configuration, start, stop, clean-up -----------------------------------
# A free port for the bridge's /readyz.
port=19470
while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done

# A short ladder: fewer queues to declare and delete; every delay here is under 10 s.
cat >"$work/bridge.toml" <<EOF
[broker]
url = "$url"
[topology]
prefix = "$prefix"
[delays]
ladder = "1s 2s 4s 8s"
[metrics]
listen = "127.0.0.1:$port"
[[route]]
ingress = "$ingress"
target = "$target"
EOF

bridge_pid=
stop_bridge() {
  [ -n "$bridge_pid" ] || return 0
  kill -TERM "$bridge_pid" 2>/dev/null || true
  for _ in $(seq 1 150); do
    kill -0 "$bridge_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$bridge_pid" 2>/dev/null || true
  wait "$bridge_pid" 2>/dev/null || true
  bridge_pid=
}
# Deletes every queue and exchange named <prefix>.*: through the management API, or, when
# it does not answer, with rabbitmqctl (the broker on this machine).
delete_topology() {
  local kind name deleted=0
  if curl -fsS -o /dev/null -u guest:guest "$management/api/overview" 2>/dev/null; then
    for kind in queues exchanges; do
      for name in $(curl -fsS -u guest:guest "$management/api/$kind/%2f?columns=name" |
        grep -o "\"name\":\"$prefix\.[^\"]*\"" | cut -d'"' -f4); do
        curl -fsS -u guest:guest -X DELETE "$management/api/$kind/%2f/$name" >/dev/null &&
          deleted=$((deleted + 1))
      done
    done
  else
    for name in $(rabbitmqctl -q list_queues name | grep "^$prefix\."); do
      rabbitmqctl -q delete_queue "$name" >/dev/null && deleted=$((deleted + 1))
    done
    for name in $(rabbitmqctl -q list_exchanges name | grep "^$prefix\."); do
      rabbitmqctl -q eval "rabbit_exchange:delete(rabbit_misc:r(<<\"/\">>, exchange, <<\"$name\">>), false, <<\"examples.sh\">>)." >/dev/null &&
        deleted=$((deleted + 1))
    done
  fi
  say "deleted $deleted queues and exchanges of $prefix"
}
cleanup() {
  stop_bridge
  delete_topology || say "could not delete every queue and exchange of $prefix"
  rm -rf "$work"
}
trap cleanup EXIT

bash scripts/broker.sh >/dev/null
bin=${DELAY_BRIDGE_BIN:-}
if [ -z "$bin" ]; then
  say "cargo build -p delay-bridge --bin delay-bridge"
  if ! cargo build --quiet -p delay-bridge --bin delay-bridge; then
    echo "examples: bridge: FAILED (cargo build failed)"
    exit 1
  fi
  bin=target/debug/delay-bridge
fi

say "starting the bridge: prefix $prefix, ingress $ingress, target $target"
RUST_LOG=${RUST_LOG:-warn} "$bin" -c "$work/bridge.toml" run >"$work/bridge.log" 2>&1 &
bridge_pid=$!
ready=
for _ in $(seq 1 300); do
  if "$bin" -c "$work/bridge.toml" health --ready >/dev/null 2>&1; then
    ready=1
    break
  fi
  kill -0 "$bridge_pid" 2>/dev/null || break
  sleep 0.2
done
if [ -z "$ready" ]; then
  echo "examples: bridge: FAILED (not ready within 60 s); its log:"
  cat "$work/bridge.log"
  exit 1
fi

# --- toolchains -------------------------------------------------------------------------
# apt-get install PACKAGES, as root only (updating the package lists when it fails once).
apt_install() {
  [ "$(id -u)" -eq 0 ] || return 1
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "$@" >>"$work/install.log" 2>&1 ||
    { apt-get update -qq >>"$work/install.log" 2>&1 && apt-get install -y -qq "$@" >>"$work/install.log" 2>&1; }
}

# Each setup_LANG sets `command` (an array, run with the example's arguments) and `name`
# (with the client's version), or `skip` (why it cannot run), or `fail` (why it broke).
setup_python() {
  local python
  if ! python=${DELAY_BRIDGE_PYTHON:-$(bash scripts/python-env.sh 2>>"$work/install.log")}; then
    skip="pika could not be installed (scripts/python-env.sh failed)"
    return
  fi
  name="python (pika $("$python" -c 'import pika; print(pika.__version__)'))"
  command=("$python" examples/python/publish.py)
}
setup_node() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    apt_install nodejs npm || { skip="no node/npm, and apt-get install nodejs npm failed or needs root"; return; }
  fi
  if [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 18 ]; then
    skip="node $(node --version) is older than amqplib's minimum, 18"
    return
  fi
  if ! (cd examples/node && npm ci --no-audit --no-fund --silent >>"$work/install.log" 2>&1); then
    skip="npm ci could not install amqplib (no registry?)"
    return
  fi
  name="node ($(node --version), amqplib $(node -p 'require("./examples/node/node_modules/amqplib/package.json").version'))"
  command=(node examples/node/publish.js)
}
setup_java() {
  local jars=/usr/share/java
  if ! command -v javac >/dev/null || [ ! -f $jars/amqp-client.jar ] || [ ! -f $jars/slf4j-nop.jar ]; then
    apt_install default-jdk-headless librabbitmq-client-java libslf4j-java ||
      { skip="no JDK or Debian's librabbitmq-client-java, and apt-get install failed or needs root"; return; }
  fi
  name="java ($(java -version 2>&1 | head -1 | cut -d'"' -f2), amqp-client $(dpkg-query -W -f '${Version}' librabbitmq-client-java 2>/dev/null || echo '?'))"
  # The source launcher runs Publish.java as it is; slf4j-nop keeps the client's logger quiet.
  command=(java -cp "$jars/amqp-client.jar:$jars/slf4j-api.jar:$jars/slf4j-nop.jar" examples/java/Publish.java)
}
setup_go() {
  local gopath=/usr/share/gocode
  if ! command -v go >/dev/null || [ ! -d $gopath/src/github.com/rabbitmq/amqp091-go ]; then
    apt_install golang-go golang-github-rabbitmq-amqp091-go-dev ||
      { skip="no Go or Debian's golang-github-rabbitmq-amqp091-go-dev, and apt-get install failed or needs root"; return; }
  fi
  name="go ($(go version | cut -d' ' -f3), amqp091-go $(dpkg-query -W -f '${Version}' golang-github-rabbitmq-amqp091-go-dev 2>/dev/null || echo '?'))"
  # Debian's module in GOPATH mode, offline; go.mod is for builds with the module proxy.
  if ! (cd examples/go && GO111MODULE=off GOPATH=$gopath GOFLAGS='' go build -o "$work/go-publish" .) 2>&1; then
    fail="go build failed"
    return
  fi
  command=("$work/go-publish")
}

# --- the examples -----------------------------------------------------------------------
for language in $languages; do
  command=() name=$language skip='' fail=''
  if ! declare -F "setup_$language" >/dev/null; then
    fail="no such example"
  else
    "setup_$language"
  fi
  if [ -n "$skip" ]; then
    echo "== examples: $name: skipped: $skip"
    summary+=("examples: $name: skipped ($skip)")
    skipped=$((skipped + 1))
    continue
  fi
  if [ -z "$fail" ]; then
    echo "== examples: $name"
    start=$SECONDS
    set +e
    PYTHONUNBUFFERED=1 timeout 60 "${command[@]}" "$url" "$ingress" "$cancel_exchange" "$target" 2>&1 |
      sed -u 's/^/  /'
    rc=${PIPESTATUS[0]}
    set -e
    [ "$rc" -eq 0 ] || fail="exit $rc"
    [ "$rc" -ne 124 ] || fail="timed out after 60 s"
  fi
  if [ -z "$fail" ]; then
    summary+=("examples: $name: passed in $((SECONDS - start)) s")
    passed=$((passed + 1))
  else
    summary+=("examples: $name: FAILED ($fail)")
    failed=$((failed + 1))
  fi
done

stop_bridge
if [ "$failed" -gt 0 ]; then
  echo "== the bridge's log (warnings and errors)"
  cat "$work/bridge.log"
fi
echo "== examples: summary ($((SECONDS - started)) s)"
printf '%s\n' "${summary[@]}"
echo "examples: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
