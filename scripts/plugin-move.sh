#!/usr/bin/env bash
# Runs docs/moving-off-the-plugin.md end to end on the local RabbitMQ 3.10 broker
# (127.0.0.1:5672, guest/guest, rabbitmqctl on this machine) with the archived
# rabbitmq_delayed_message_exchange plugin, and counts what arrives.
#
#   bash scripts/plugin-move.sh PLUGIN_DIR      (or DELAY_BRIDGE_PLUGIN_DIR=PLUGIN_DIR)
#
# PLUGIN_DIR holds the plugin's build for RabbitMQ 3.10
# (rabbitmq_delayed_message_exchange-3.10.2/ebin/). It is not part of this repository and
# CI never runs this script: it is run by hand, as root (it copies the plugin into the
# broker's plugins directory and enables it).
#
# The commands of the move are the page's own: every ```sh block, read from the page when
# the script runs, executed in order in one directory, with `delay-bridge` standing for the
# release binary and `rabbitmqadmin` for the management CLI on 127.0.0.1. Around them the
# script plays the users: it sets up `orders.delayed` as under the plugin, publishes BEFORE
# messages into it (x-delay uniform over [DELAY_MIN_MS, DELAY_MAX_MS]) while steps 1 to 3
# run, pauses for step 4, publishes AFTER more into the same name after step 5, tries the
# declarations of step 6, and counts at the queue `orders.close`: delivered, doubled, lost.
#
# Settings: BEFORE [1000] AFTER [1000] RATE [200 msg/s] DELAY_MIN_MS [2000]
#           DELAY_MAX_MS [20000] DELAY_BRIDGE_BIN [target/release/delay-bridge, built first]
# The publishers and the consumer are Python with pika (.venv, made by scripts/python-env.sh).
#
# At the end (also after a failure) it stops what it started and deletes what it declared,
# disables the plugin, removes the copy it made, and disables the management plugin if it
# enabled it: the broker is left as it was found.
set -euo pipefail

say() { echo "plugin-move.sh: $*"; }
die() { say "$*" >&2; exit 1; }

root=$(cd "$(dirname "$0")/.." && pwd)
doc=$root/docs/moving-off-the-plugin.md
plugin_src=${1:-${DELAY_BRIDGE_PLUGIN_DIR:-}}
plugin_name=rabbitmq_delayed_message_exchange-3.10.2
BEFORE=${BEFORE:-1000}
AFTER=${AFTER:-1000}
RATE=${RATE:-200}
DELAY_MIN_MS=${DELAY_MIN_MS:-2000}
DELAY_MAX_MS=${DELAY_MAX_MS:-20000}

if [ -z "$plugin_src" ] || [ ! -d "$plugin_src/$plugin_name/ebin" ]; then
  die "needs the archived delayed-message plugin built for RabbitMQ 3.10: give its directory
(the one holding $plugin_name/ebin/) as the first argument or in DELAY_BRIDGE_PLUGIN_DIR.
It is not part of this repository, and CI does not run this script."
fi
[ "$(id -u)" -eq 0 ] || die "run as root: it installs and enables a broker plugin"
PATH=$PATH:/usr/sbin:/usr/lib/rabbitmq/bin
for tool in rabbitmqctl rabbitmq-plugins rabbitmqadmin curl awk; do
  command -v "$tool" >/dev/null || die "$tool not found"
done
version=$(rabbitmqctl -q version)
case $version in 3.10.*) ;; *) die "the plugin's build is for RabbitMQ 3.10; this broker is $version" ;; esac
plugins_dir=$(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-"$version"/plugins)
[ -f "$doc" ] || die "$doc not found"

# The names of the page's example must be free on this broker: the run declares and then
# deletes them.
for exchange in orders.delayed orders; do
  if rabbitmqctl -s list_exchanges name | grep -qx "$exchange"; then
    die "exchange $exchange exists on this broker; this run would change it"
  fi
done
if rabbitmqctl -s list_queues name | grep -qx orders.close; then
  die "queue orders.close exists on this broker; this run would change it"
fi
if rabbitmq-plugins -s list -e -m | grep -qx rabbitmq_delayed_message_exchange; then
  die "the delayed-message plugin is enabled already; step 8 disables it, which deletes what it holds"
fi

python=$(bash "$root/scripts/python-env.sh")
if [ -n "${DELAY_BRIDGE_BIN:-}" ]; then
  bin=$DELAY_BRIDGE_BIN
else
  say "building the release binary"
  (cd "$root" && cargo build --release -p delay-bridge --bin delay-bridge)
  bin=$root/target/release/delay-bridge
fi

work=$(mktemp -d /tmp/plugin-move.XXXXXX)
export DELAY_BRIDGE_PREFIX="plugin-move-$(od -An -N4 -tx4 /dev/urandom | tr -d ' ')"
management_enabled_here=false
plugin_copied_here=false
enabled_plugins_existed=false
[ -f /etc/rabbitmq/enabled_plugins ] && enabled_plugins_existed=true
bridge_pid=
consumer_pid=
publisher_pid=

# The page's commands: `delay-bridge` is the release binary (`run` starts it in the
# background and waits until it consumes); `rabbitmqadmin` talks to 127.0.0.1.
delay-bridge() {
  if [ "${*: -1}" = run ]; then
    "$bin" "$@" >"$work/bridge.log" 2>&1 &
    bridge_pid=$!
    local waited=0
    until grep -qs consuming "$work/bridge.log"; do
      kill -0 "$bridge_pid" 2>/dev/null || { cat "$work/bridge.log"; die "the bridge exited"; }
      (( waited++ < 600 )) || die "the bridge did not consume within 60 s"
      sleep 0.1
    done
    say "the bridge consumes (pid $bridge_pid, log $work/bridge.log)"
  else
    "$bin" "$@"
  fi
}
rabbitmqadmin() { command rabbitmqadmin -H 127.0.0.1 "$@"; }

cleanup() {
  local status=$?
  set +e
  for pid in $publisher_pid $consumer_pid $bridge_pid; do
    kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  done
  if rabbitmq-plugins -s list -E -m 2>/dev/null | grep -qx rabbitmq_delayed_message_exchange; then
    rabbitmqctl -q eval 'sys:resume(rabbit_delayed_message).' >/dev/null 2>&1
    rabbitmq-plugins disable rabbitmq_delayed_message_exchange >/dev/null
  fi
  for queue in orders.close $(rabbitmqctl -s list_queues name | grep "^$DELAY_BRIDGE_PREFIX\."); do
    rabbitmqadmin delete queue name="$queue" >/dev/null 2>&1
  done
  for exchange in orders.delayed orders "$DELAY_BRIDGE_PREFIX".{work,parked,cancel}; do
    rabbitmqadmin delete exchange name="$exchange" >/dev/null 2>&1
  done
  if $management_enabled_here; then
    rabbitmq-plugins disable rabbitmq_management >/dev/null
    rabbitmqctl -q eval 'application:unset_env(rabbitmq_management, tcp_config).' >/dev/null
  fi
  $plugin_copied_here && rm -rf "${plugins_dir:?}/$plugin_name"
  if ! $enabled_plugins_existed && [ "$(cat /etc/rabbitmq/enabled_plugins 2>/dev/null)" = "[]." ]; then
    rm -f /etc/rabbitmq/enabled_plugins
  fi
  if [ "$status" -eq 0 ]; then
    rm -rf "$work"
  else
    say "failed; the run's files are in $work"
  fi
  say "the broker is left as it was found: $(rabbitmqctl -q list_exchanges name | grep -c '^orders') orders exchanges, plugins enabled: [$(rabbitmq-plugins -s list -E -m | tr '\n' ' ')]"
}
trap cleanup EXIT

# The page's ```sh blocks, in order; each starts with `# step N: ...`.
awk -v dir="$work" '
  /^```sh$/ { n++; file = sprintf("%s/block-%d.sh", dir, n); inside = 1; next }
  /^```/ && inside { inside = 0; close(file); next }
  inside { print > file }
' "$doc"
declare -A step_file
for file in "$work"/block-*.sh; do
  step=$(sed -n '1s/^# step \([0-9]*\):.*/\1/p' "$file")
  [ -n "$step" ] || die "a sh block of $doc does not start with '# step N:': $(head -n 1 "$file")"
  step_file[$step]=$file
done
for step in 1 2 3 4 5 7 8; do
  [ -n "${step_file[$step]:-}" ] || die "$doc has no block for step $step"
done

# Runs step $1 of the page, in the work directory, timing it.
run_step() {
  say "---- step $1 ($(sed -n '1s/^# step [0-9]*: //p' "${step_file[$1]}"))"
  sed -n '2,$p' "${step_file[$1]}" | sed 's/^/  | /'
  local started=$(($(date +%s%N) / 1000000))
  # In this shell (step 5 starts the bridge), in the work directory; `set -e` ends the
  # run at the first command that fails.
  cd "$work"
  # shellcheck disable=SC1090
  source "${step_file[$1]}"
  cd "$root"
  step_ms=$(($(date +%s%N) / 1000000 - started))
  say "step $1 took $step_ms ms"
}

# The users' side: publishers and the consumer of orders.close, with pika.
cat >"$work/users.py" <<'PY'
import random, signal, sys, time
import pika

def connect():
    return pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2f"))

def now_ms():
    return int(time.time() * 1000)

def setup():
    """orders.delayed as under the plugin, bound to orders.close by routing key."""
    ch = connect().channel()
    ch.exchange_declare("orders.delayed", "x-delayed-message", durable=True,
                        arguments={"x-delayed-type": "direct"})
    ch.queue_declare("orders.close", durable=True)
    ch.queue_bind("orders.close", "orders.delayed", "orders.close")

def consume(out):
    conn = connect()
    ch = conn.channel()
    ch.basic_qos(prefetch_count=1000)
    with open(out, "a", buffering=1) as f:
        def on(ch, method, props, body):
            f.write(f"{body.decode()} {now_ms()}\n")
            ch.basic_ack(method.delivery_tag)
        ch.basic_consume("orders.close", on)
        signal.signal(signal.SIGTERM, lambda *_: ch.stop_consuming())
        ch.start_consuming()

def publish(first, count, rate, min_ms, max_ms, out):
    ch = connect().channel()
    ch.confirm_delivery()
    start = time.monotonic()
    with open(out, "a", buffering=1) as f:
        for i in range(count):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            seq = first + i
            delay = random.randint(min_ms, max_ms)
            published = now_ms()
            ch.basic_publish("orders.delayed", "orders.close", str(seq).encode(),
                             pika.BasicProperties(message_id=str(seq), delivery_mode=2,
                                                  headers={"x-delay": delay}),
                             mandatory=False)
            f.write(f"{seq} {published + delay}\n")

def declarations():
    """Step 6: the plugin's declaration, then the changed one."""
    conn = connect()
    ch = conn.channel()
    try:
        ch.exchange_declare("orders.delayed", "x-delayed-message", durable=True,
                            arguments={"x-delayed-type": "direct"})
        print("  declaring orders.delayed as x-delayed-message: accepted (unexpected)")
    except pika.exceptions.ChannelClosedByBroker as e:
        print(f"  declaring orders.delayed as x-delayed-message: {e.reply_code} {e.reply_text}")
    ch = conn.channel()
    ch.exchange_declare("orders", "direct", durable=True)
    ch.queue_declare("orders.close", durable=True)
    ch.queue_bind("orders.close", "orders", "orders.close")
    print("  the changed client (declares orders, direct, and binds orders.close to it): accepted")
    ch.exchange_declare("orders.delayed", "headers", durable=True,
                        arguments={"x-delayed-type": "direct"})
    print("  declaring orders.delayed as headers (x-delayed-type left on): accepted")
    conn.close()

def count(dues_before, dues_after, arrivals, move_started):
    def read(path):
        with open(path) as f:
            return [tuple(map(int, line.split())) for line in f if line.strip()]
    before, after = dict(read(dues_before)), dict(read(dues_after))
    got = read(arrivals)
    seen = {}
    for seq, at in got:
        seen.setdefault(seq, []).append(at)
    def pct(values, p):
        values = sorted(values)
        return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else 0
    waiting = sum(1 for due in before.values() if due > move_started)
    print(f"waiting in the plugin at the move: {waiting} of {len(before)}")
    for name, dues in (("before the move (plugin)", before), ("after the move (bridge)", after)):
        delivered = sum(1 for s in dues if s in seen)
        doubled = sum(len(seen[s]) - 1 for s in dues if s in seen)
        late = [seen[s][0] - dues[s] for s in dues if s in seen]
        print(f"{name}: published {len(dues)}, delivered {delivered}, doubled {doubled}, "
              f"lost {len(dues) - delivered}; lateness ms p50 {pct(late, 50)}, "
              f"p99 {pct(late, 99)}, max {max(late, default=0)}")
    total = len(before) + len(after)
    delivered = sum(1 for s in seen if s in before or s in after)
    doubled = sum(len(v) - 1 for v in seen.values())
    unknown = sum(1 for s in seen if s not in before and s not in after)
    print(f"total: published {total}, delivered {delivered}, doubled {doubled}, "
          f"lost {total - delivered}, unknown {unknown}")
    return 0 if delivered == total and doubled == 0 and unknown == 0 else 1

if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "setup": setup()
    elif cmd == "consume": consume(args[0])
    elif cmd == "publish": publish(int(args[0]), int(args[1]), float(args[2]), int(args[3]), int(args[4]), args[5])
    elif cmd == "declarations": declarations()
    elif cmd == "count": sys.exit(count(args[0], args[1], args[2], int(args[3])))
PY
users() { "$python" "$work/users.py" "$@"; }

say "broker RabbitMQ $version; bridge prefix $DELAY_BRIDGE_PREFIX; work directory $work"
# The management API (for rabbitmqadmin), on 127.0.0.1 only.
if ! curl -sf -o /dev/null -u guest:guest http://127.0.0.1:15672/api/overview; then
  say "enabling the management plugin on 127.0.0.1:15672 (disabled again at the end)"
  rabbitmqctl -q eval 'application:set_env(rabbitmq_management, tcp_config, [{ip, "127.0.0.1"}, {port, 15672}]).' >/dev/null
  management_enabled_here=true
  rabbitmq-plugins enable rabbitmq_management >/dev/null
  for _ in $(seq 60); do
    curl -sf -o /dev/null -u guest:guest http://127.0.0.1:15672/api/overview && break
    sleep 1
  done
fi
if [ ! -d "$plugins_dir/$plugin_name" ]; then
  cp -r "$plugin_src/$plugin_name" "$plugins_dir/"
  plugin_copied_here=true
fi
say "enabling rabbitmq_delayed_message_exchange"
rabbitmq-plugins enable rabbitmq_delayed_message_exchange >/dev/null

say "---- as under the plugin: orders.delayed (x-delayed-message, direct) -> orders.close"
users setup
: >"$work/arrivals" >"$work/dues-before" >"$work/dues-after"
users consume "$work/arrivals" &
consumer_pid=$!
say "publishing $BEFORE into the plugin at $RATE msg/s, x-delay over [$DELAY_MIN_MS, $DELAY_MAX_MS] ms, while steps 1-3 run"
users publish 0 "$BEFORE" "$RATE" "$DELAY_MIN_MS" "$DELAY_MAX_MS" "$work/dues-before" &
publisher_pid=$!

run_step 1
run_step 2
run_step 3
say "---- pausing the publishers"
wait "$publisher_pid"
publisher_pid=
move_started=$(($(date +%s%N) / 1000000))
run_step 4
move_ms=$step_ms
run_step 5
say "---- resuming the publishers: $AFTER into orders.delayed, now through the bridge"
users publish "$BEFORE" "$AFTER" "$RATE" "$DELAY_MIN_MS" "$DELAY_MAX_MS" "$work/dues-after"
say "---- step 6: what a client that declares the exchange meets"
users declarations
run_step 7
total=$((BEFORE + AFTER))
deadline=$(($(date +%s) + DELAY_MAX_MS / 1000 + 30))
while [ "$(wc -l <"$work/arrivals")" -lt "$total" ] && [ "$(date +%s)" -lt "$deadline" ]; do
  sleep 1
done
sleep 3 # anything doubled would come now
run_step 8
say "---- the ingress's bindings now"
rabbitmqctl -s list_bindings source_name destination_name destination_kind routing_key arguments \
  | awk -F'\t' '$1 == "orders.delayed"' | sed 's/^/  /'
say "---- delay-bridge status"
delay-bridge -c "$work/delay-bridge.toml" status | sed 's/^/  /'
kill -TERM "$bridge_pid" && wait "$bridge_pid" || true
bridge_pid=
kill -TERM "$consumer_pid" && wait "$consumer_pid" || true
consumer_pid=

say "---- counts at orders.close (the move, step 4, took $move_ms ms with the plugin suspended)"
users count "$work/dues-before" "$work/dues-after" "$work/arrivals" "$move_started"
