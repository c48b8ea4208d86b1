#!/usr/bin/env bash
# A local three-node RabbitMQ cluster (no Docker), on loopback only, beside the broker on 5672.
# For fault tests: node loss, restarts, quorum queues.
#
#   bash scripts/cluster.sh start         # start and cluster the three nodes (idempotent)
#   bash scripts/cluster.sh status        # which nodes run, and the cluster as node 1 sees it
#   bash scripts/cluster.sh kill N        # kill -9 node N (1..3): a node lost, no goodbye
#   bash scripts/cluster.sh restart N     # start node N again; it rejoins the cluster
#   bash scripts/cluster.sh pause N       # SIGSTOP node N's VM (it says nothing at all)
#   bash scripts/cluster.sh resume N      # SIGCONT it
#   bash scripts/cluster.sh stop          # stop every node (data is kept for the next start)
#   bash scripts/cluster.sh ctl N ARGS..  # rabbitmqctl against node N
#   bash scripts/cluster.sh urls          # the AMQP URL of every node, one a line
#   bash scripts/cluster.sh url N         # the AMQP URL of node N (4: the single broker)
#   bash scripts/cluster.sh management-urls  # the management API of every node, one a line
#   bash scripts/cluster.sh start-solo    # node 4: a single broker of its own, never clustered
#                                         # (for broker-crash faults; kill 4 / restart 4 / stop)
#   bash scripts/cluster.sh start-tls DIR # node 5 (3.x only): a single broker with an AMQPS
#                                         # listener on 127.0.0.1:5695 that requires a client
#                                         # certificate, from DIR/ca.pem, DIR/server.pem,
#                                         # DIR/server.key (restarted when it runs)
#   bash scripts/cluster.sh stop-tls      # stop node 5
#
# CLUSTER_BROKER picks the RabbitMQ: 3 (default) runs the installed package (3.10.8 from
# scripts/broker.sh); 4 runs 4.0.x inside scripts/debian-broker.sh trixie's chroot, 43 runs
# 4.3.x inside scripts/debian-broker.sh sid's (each installed and started on first use),
# with the same commands. Every command of a 4.x cluster needs CLUSTER_BROKER (export it).
#
#   broker  node N               AMQP              management         distribution
#   3       rabbit-cN@localhost  127.0.0.1:568N    127.0.0.1:1568N    2568N
#   4       rabbit4-cN@localhost 127.0.0.1:569N    127.0.0.1:1569N    2569N
#   43      rabbit43-cN@localhost 127.0.0.1:570N   127.0.0.1:1570N    2570N
#
# Data, logs, config and one shared Erlang cookie live under $CLUSTER_DIR/nodeN (3.x default
# /var/lib/delay-bridge/cluster; 4.x: /var/lib/delay-bridge-cluster inside the chroot). Every
# node's advanced.config lowers dead_letter_worker_publisher_confirm_timeout to 2000 ms:
# without it a quorum level whose dead-letter target moved (a failover) retries only after
# 180 s. Waits have deadlines (CLUSTER_WAIT_SECONDS, default 90 per node).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
wait_s=${CLUSTER_WAIT_SECONDS:-90}
tls_dir=
nodes=(1 2 3)
bin=/usr/lib/rabbitmq/bin

say() { echo "cluster.sh: $*"; }
die() { say "$*" >&2; exit 1; }

case ${CLUSTER_BROKER:-3} in
  3)
    root=                 # the host itself
    dir=${CLUSTER_DIR:-/var/lib/delay-bridge/cluster}
    name_prefix=rabbit-c
    port_base=5680
    epmd_port=4369
    [ -x "$bin/rabbitmq-server" ] || die "no RabbitMQ installed ($bin/rabbitmq-server); run scripts/broker.sh first"
    ;;
  4)
    root=${RMQ4_ROOT:-/var/lib/delay-bridge/rabbitmq-4-trixie}
    dir=${CLUSTER_DIR:-/var/lib/delay-bridge-cluster}   # inside the chroot
    name_prefix=rabbit4-c
    port_base=5690
    epmd_port=${RMQ4_EPMD_PORT:-4370}
    suite=trixie
    ;;
  43)
    root=${RMQ43_ROOT:-/var/lib/delay-bridge/rabbitmq-sid}
    dir=${CLUSTER_DIR:-/var/lib/delay-bridge-cluster}   # inside the chroot
    name_prefix=rabbit43-c
    port_base=5700
    epmd_port=${RMQ43_EPMD_PORT:-4371}
    suite=sid
    ;;
  *) die "CLUSTER_BROKER must be 3, 4 or 43, not ${CLUSTER_BROKER}" ;;
esac
# $dir as the host sees it.
host_dir=$root$dir

# For 4.x: the chroot installed, started (its own node too) and mounted, once.
ensure_root() {
  [ -z "$root" ] && return
  if [ ! -x "$root$bin/rabbitmq-server" ] || ! mountpoint -q "$root/proc"; then
    bash "$here/debian-broker.sh" "$suite" start
  fi
}

node_name() { echo "$name_prefix$1@localhost"; }
amqp_port() { echo $((port_base + $1)); }
dist_port() { echo $((20000 + port_base + $1)); }
management_port() { echo $((10000 + port_base + $1)); }

# The environment of node N, for the server and for the CLI tools alike.
node_env() {
  local n=$1 base="$dir/node$1"
  echo "HOME=$dir" \
    "RABBITMQ_NODENAME=$(node_name "$n")" \
    "RABBITMQ_NODE_IP_ADDRESS=127.0.0.1" \
    "RABBITMQ_NODE_PORT=$(amqp_port "$n")" \
    "RABBITMQ_DIST_PORT=$(dist_port "$n")" \
    "RABBITMQ_MNESIA_BASE=$base/mnesia" \
    "RABBITMQ_LOG_BASE=$base/log" \
    "RABBITMQ_PID_FILE=$base/pid" \
    "RABBITMQ_CONF_ENV_FILE=$base/rabbitmq-env.conf" \
    "RABBITMQ_CONFIG_FILE=$base/rabbitmq.conf" \
    "RABBITMQ_ADVANCED_CONFIG_FILE=$base/advanced.config" \
    "RABBITMQ_ENABLED_PLUGINS_FILE=$base/enabled_plugins" \
    "ERL_EPMD_ADDRESS=127.0.0.1" \
    "ERL_CRASH_DUMP=$base/erl_crash.dump"
}

# Runs a command in node N's environment: on the host, or in the 4.x chroot.
in_node() {
  local n=$1
  shift
  if [ -z "$root" ]; then
    # shellcheck disable=SC2046
    env $(node_env "$n") "$@"
  else
    # shellcheck disable=SC2046
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
      ERL_EPMD_PORT="$epmd_port" $(node_env "$n") "$@"
  fi
}

ctl() {
  local n=$1
  shift
  in_node "$n" "$bin/rabbitmqctl" -n "$(node_name "$n")" "$@"
}

running() { ctl "$1" -q status >/dev/null 2>&1; }

prepare() {
  local n=$1 base="$host_dir/node$1"
  mkdir -p "$base/mnesia" "$base/log"
  if [ ! -f "$host_dir/.erlang.cookie" ]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$host_dir/.erlang.cookie"
    chmod 400 "$host_dir/.erlang.cookie"
  fi
  : > "$base/rabbitmq-env.conf"
  printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\nmanagement.tcp.ip = 127.0.0.1\nmanagement.tcp.port = %s\n' \
    "$(amqp_port "$n")" "$(management_port "$n")" > "$base/rabbitmq.conf"
  if [ "$n" = 5 ]; then
    printf 'listeners.ssl.default = 127.0.0.1:5695\nssl_options.cacertfile = %s/ca.pem\nssl_options.certfile = %s/server.pem\nssl_options.keyfile = %s/server.key\nssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n' \
      "$tls_dir" "$tls_dir" "$tls_dir" >> "$base/rabbitmq.conf"
  fi
  echo '[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 2000}]}].' > "$base/advanced.config"
  echo '[rabbitmq_management].' > "$base/enabled_plugins"
}

# Starts node N's server in the background (nothing when it runs); see await_node.
launch_node() {
  local n=$1
  if running "$n"; then
    say "node $n ($(node_name "$n"), AMQP $(amqp_port "$n")) already runs"
    return
  fi
  prepare "$n"
  in_node "$n" "$bin/rabbitmq-server" -detached
}

# Waits until node N has booted. Nodes of a stopped cluster wait for each other at boot
# (each for the last one to stop), so all are launched before any is awaited.
await_node() {
  local n=$1 from=$SECONDS
  # Until the node has registered, the CLI cannot even reach it: retry within the deadline.
  until ctl "$n" -q await_startup --timeout 5 >/dev/null 2>&1; do
    if (( SECONDS - from >= wait_s )); then
      tail -n 30 "$host_dir/node$n/log/"*.log 2>/dev/null || true
      die "node $n did not start within ${wait_s}s (logs: $host_dir/node$n/log)"
    fi
    sleep 1
  done
  say "node $n ($(node_name "$n")) up on 127.0.0.1:$(amqp_port "$n")"
}

# Joins node N to node 1's cluster unless it is in it already.
join() {
  local n=$1 first
  first=$(node_name 1)
  if ctl "$n" -q cluster_status 2>/dev/null | grep -q "$first"; then
    return
  fi
  ctl "$n" -q stop_app >/dev/null
  ctl "$n" -q join_cluster "$first" >/dev/null
  ctl "$n" -q start_app >/dev/null
  ctl "$n" -q await_startup --timeout "$wait_s" >/dev/null
  say "node $n joined $first"
}

case "${1:-}" in
  start)
    started=$SECONDS
    ensure_root
    mkdir -p "$host_dir"
    for n in "${nodes[@]}"; do launch_node "$n"; done
    for n in "${nodes[@]}"; do await_node "$n"; done
    for n in 2 3; do join "$n"; done
    say "cluster of 3 up in $((SECONDS - started)) s: $(for n in "${nodes[@]}"; do printf 'amqp://guest:guest@127.0.0.1:%s/%%2f ' "$(amqp_port "$n")"; done)"
    ;;
  start-solo)
    started=$SECONDS
    ensure_root
    mkdir -p "$host_dir"
    launch_node 4
    await_node 4
    say "single node 4 up in $((SECONDS - started)) s: amqp://guest:guest@127.0.0.1:$(amqp_port 4)/%2f"
    ;;
  start-tls)
    [ -z "$root" ] || die "4.x has its own TLS node: bash scripts/debian-broker.sh $suite start-tls DIR"
    tls_dir=$(cd "${2:?usage: cluster.sh start-tls DIR}" && pwd)
    for f in ca.pem server.pem server.key; do
      [ -r "$tls_dir/$f" ] || die "no $tls_dir/$f"
    done
    started=$SECONDS
    mkdir -p "$host_dir"
    if running 5; then
      ctl 5 -q stop >/dev/null 2>&1 || true
    fi
    launch_node 5
    await_node 5
    say "TLS node 5 up in $((SECONDS - started)) s: amqps://guest:guest@127.0.0.1:5695/%2f (client certificate required)"
    ;;
  stop-tls)
    ctl 5 -q stop >/dev/null 2>&1 || true
    say "TLS node 5 stopped"
    ;;
  stop)
    for n in "${nodes[@]}" 4 5; do
      [ "$n" -ge 4 ] && [ ! -d "$host_dir/node$n" ] && continue
      [ -n "$root" ] && ! mountpoint -q "$root/proc" && { say "node $n not running"; continue; }
      if running "$n"; then
        ctl "$n" -q stop >/dev/null 2>&1 || true
        say "node $n stopped"
      else
        say "node $n not running"
      fi
    done
    ;;
  status)
    for n in "${nodes[@]}"; do
      if running "$n"; then state=running; else state=down; fi
      say "node $n $(node_name "$n") AMQP 127.0.0.1:$(amqp_port "$n"): $state"
    done
    for n in "${nodes[@]}"; do
      if running "$n"; then
        say "running in the cluster, as node $n sees it: $(ctl "$n" -q eval 'rabbit_nodes:all_running().' 2>/dev/null | tr -d '\n ')"
        break
      fi
    done
    ;;
  kill)
    n=${2:?usage: cluster.sh kill N}
    pidfile="$host_dir/node$n/pid"
    [ -s "$pidfile" ] || die "node $n has no pid file ($pidfile): not started by this script?"
    pid=$(cat "$pidfile")
    if kill -0 "$pid" 2>/dev/null; then
      kill -9 "$pid"
      say "node $n (pid $pid) killed with SIGKILL"
    else
      say "node $n (pid $pid) was not running"
    fi
    ;;
  pause|resume)
    # SIGSTOP / SIGCONT of node N's VM: a broker that says nothing at all for a while.
    n=${2:?usage: cluster.sh pause|resume N}
    pidfile="$host_dir/node$n/pid"
    [ -s "$pidfile" ] || die "node $n has no pid file ($pidfile): not started by this script?"
    pid=$(cat "$pidfile")
    signal=STOP
    [ "$1" = resume ] && signal=CONT
    kill -"$signal" "$pid"
    say "node $n (pid $pid) sent SIG$signal"
    ;;
  restart)
    n=${2:?usage: cluster.sh restart N}
    started=$SECONDS
    ensure_root
    launch_node "$n"
    await_node "$n"
    say "node $n back in $((SECONDS - started)) s"
    ;;
  ctl)
    n=${2:?usage: cluster.sh ctl N ARGS..}
    shift 2
    ctl "$n" "$@"
    ;;
  urls)
    for n in "${nodes[@]}"; do echo "amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/%2f"; done
    ;;
  url)
    n=${2:?usage: cluster.sh url N}
    echo "amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/%2f"
    ;;
  management-urls)
    for n in "${nodes[@]}"; do echo "http://127.0.0.1:$(management_port "$n")"; done
    ;;
  *)
    sed -n '2,35p' "$0"
    exit 2
    ;;
esac
