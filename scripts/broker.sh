#!/usr/bin/env bash
# Makes sure a RabbitMQ broker answers AMQP on 127.0.0.1:${AMQP_PORT:-5672}.
#   1. a broker already answering is used as it is;
#   2. else an installed rabbitmq-server is started (rabbitmq-server -detached);
#   3. else Debian's rabbitmq-server package is installed (needs root) and started.
# Then, for the broker on 5672, makes sure its management API answers on 127.0.0.1:15672
# (the plugin is enabled when it does not; the bridge's stuck-level watch reads it), and its
# stream protocol on 127.0.0.1:5552 (rabbitmq_stream: the adversary suite attacks the cancel
# stream through it, as a canceller can wherever an operator enables it).
# Waits for the broker with a deadline (BROKER_WAIT_SECONDS, default 120). Idempotent.
set -euo pipefail

host=127.0.0.1
port=${AMQP_PORT:-5672}
deadline_s=${BROKER_WAIT_SECONDS:-120}

say() { echo "broker.sh: $*"; }

# True when something on host:port answers the AMQP 0-9-1 protocol header with a frame.
amqp_answers() {
  python3 - "$host" "$port" <<'PY' 2>/dev/null
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    s.settimeout(3)
    first = s.recv(1)
    sys.exit(0 if first == b"\x01" else 1)
except Exception:
    sys.exit(1)
PY
}

# `broker.sh --probe`: only say (by exit status) whether a broker answers on the port.
if [ "${1:-}" = "--probe" ]; then
  amqp_answers
  exit $?
fi

wait_for_broker() {
  local waited=0
  until amqp_answers; do
    if (( waited >= deadline_s )); then
      say "RabbitMQ did not answer on $host:$port within ${deadline_s}s"
      for log in /var/log/rabbitmq/*.log; do [ -f "$log" ] && tail -n 20 "$log"; done
      exit 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
}

# The management API on 127.0.0.1:15672, for the default broker only (another port is a
# broker someone else configures).
management() {
  [ "$port" = 5672 ] || return 0
  api() { curl -sf -o /dev/null -u guest:guest "http://$host:15672/api/overview"; }
  api && return 0
  PATH=$PATH:/usr/sbin:/usr/lib/rabbitmq/bin
  if [ "$(id -u)" -ne 0 ] && [ "$(id -un)" != rabbitmq ]; then
    say "the management API does not answer on $host:15672 and enabling it needs root:"
    say "  sudo rabbitmq-plugins enable rabbitmq_management"
    return 0
  fi
  say "enabling the management plugin"
  rabbitmq-plugins enable rabbitmq_management >/dev/null
  local waited=0
  until api; do
    (( waited++ < deadline_s )) || { say "the management API did not answer within ${deadline_s}s"; exit 1; }
    sleep 1
  done
  say "the management API answers on $host:15672"
}

# The stream protocol on 127.0.0.1:5552, for the default broker only.
stream_protocol() {
  [ "$port" = 5672 ] || return 0
  listens() { python3 -c "import socket; socket.create_connection(('$host', 5552), timeout=2)" 2>/dev/null; }
  listens && return 0
  PATH=$PATH:/usr/sbin:/usr/lib/rabbitmq/bin
  if [ "$(id -u)" -ne 0 ] && [ "$(id -un)" != rabbitmq ]; then
    say "the stream protocol does not answer on $host:5552 and enabling it needs root:"
    say "  sudo rabbitmq-plugins enable rabbitmq_stream"
    return 0
  fi
  say "enabling the stream plugin"
  rabbitmq-plugins enable rabbitmq_stream >/dev/null
  local waited=0
  until listens; do
    (( waited++ < deadline_s )) || { say "the stream protocol did not answer within ${deadline_s}s"; exit 1; }
    sleep 1
  done
  say "the stream protocol answers on $host:5552"
}

if amqp_answers; then
  say "RabbitMQ already answers on $host:$port; using it"
  management
  stream_protocol
  exit 0
fi

if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
  if [ "$(id -u)" -ne 0 ]; then
    say "RabbitMQ is not installed and installing it needs root:"
    say "  sudo apt-get install -y rabbitmq-server   (then run this script again)"
    exit 1
  fi
  say "RabbitMQ is not installed; installing Debian's rabbitmq-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The package's own start attempt may fail without an init system; we start it below.
  apt-get install -y -qq rabbitmq-server >/dev/null || apt-get install -y rabbitmq-server
fi
PATH=$PATH:/usr/sbin:/usr/lib/rabbitmq/bin

if amqp_answers; then
  say "RabbitMQ was started by its package; using it"
  management
  stream_protocol
  exit 0
fi

if [ "$(id -u)" -ne 0 ] && [ "$(id -un)" != rabbitmq ]; then
  say "RabbitMQ is installed but not running, and starting it needs root:"
  say "  sudo rabbitmq-server -detached"
  exit 1
fi
say "starting the installed RabbitMQ (rabbitmq-server -detached)"
rabbitmq-server -detached || true
timeout "$deadline_s" rabbitmqctl await_startup >/dev/null 2>&1 || true
wait_for_broker
say "RabbitMQ is up on $host:$port ($(rabbitmqctl version 2>/dev/null || echo 'version unknown'))"
management
stream_protocol
