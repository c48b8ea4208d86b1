#!/usr/bin/env bash
# A RabbitMQ broker from a Debian suite, beside the default one (the host's package), for
# testing delay-bridge on several broker versions. SUITE picks the version and the ports:
#
#   trixie   RabbitMQ 4.0.x (Erlang 27): node rabbit4@localhost, AMQP 127.0.0.1:5673,
#            distribution 25673, epmd 4370, management 15673, TLS node on 5696
#   sid      RabbitMQ 4.3.x (Erlang 29): node rabbit43@localhost, AMQP 127.0.0.1:5674,
#            distribution 25674, epmd 4371, management 15674, TLS node on 5697
#   other    any suite debootstrap knows, with RMQ_PORT, RMQ_DIST_PORT, RMQ_EPMD_PORT,
#            RMQ_MANAGEMENT_PORT, RMQ_TLS_PORT and RMQ_NODE set
#
#   scripts/debian-broker.sh SUITE start    start it (installing on first use), wait until it answers
#   scripts/debian-broker.sh SUITE stop     stop it and unmount what start mounted
#   scripts/debian-broker.sh SUITE status   say whether it answers
#   scripts/debian-broker.sh SUITE ctl ...  run rabbitmqctl against it (for example: ctl list_queues)
#   scripts/debian-broker.sh SUITE start-tls DIR   a second node, <node>tls@localhost, alone,
#                               with an AMQPS listener on the suite's TLS port that requires a
#                               client certificate, from DIR/ca.pem, DIR/server.pem,
#                               DIR/server.key (copied into the chroot; restarted when it runs)
#   scripts/debian-broker.sh SUITE stop-tls stop that node
#
# It is the suite's rabbitmq-server in a debootstrap chroot under /var/lib/delay-bridge, so
# the host's packages are untouched; guest/guest works from loopback. Installing needs
# root, the Debian mirror apt already uses, about a minute and ~330 MB. A suite whose
# Release file expires within days (sid) installs with apt's Check-Valid-Until off.
# Idempotent.
set -euo pipefail

suite=${1:?usage: $0 SUITE start|stop|status|ctl ARGS...|start-tls DIR|stop-tls}
shift
case "$suite" in
  trixie) defaults=(5673 25673 4370 15673 5696 rabbit4 rabbitmq-4-trixie) ;;
  sid) defaults=(5674 25674 4371 15674 5697 rabbit43 rabbitmq-sid) ;;
  *) defaults=("" "" "" "" "" "" "rabbitmq-$suite") ;;
esac
port=${RMQ_PORT:-${defaults[0]}}
dist_port=${RMQ_DIST_PORT:-${defaults[1]}}
epmd_port=${RMQ_EPMD_PORT:-${defaults[2]}}
management_port=${RMQ_MANAGEMENT_PORT:-${defaults[3]}}
tls_port=${RMQ_TLS_PORT:-${defaults[4]}}
node_name=${RMQ_NODE:-${defaults[5]}}
root=${RMQ_ROOT:-/var/lib/delay-bridge/${defaults[6]}}
for required in port dist_port epmd_port management_port tls_port node_name; do
  [ -n "${!required}" ] || { echo "debian-broker.sh: suite $suite has no default ports; set RMQ_PORT, RMQ_DIST_PORT, RMQ_EPMD_PORT, RMQ_MANAGEMENT_PORT, RMQ_TLS_PORT and RMQ_NODE" >&2; exit 2; }
done
node=$node_name@localhost
deadline_s=${BROKER_WAIT_SECONDS:-120}

say() { echo "debian-broker.sh $suite: $*"; }
here=$(cd "$(dirname "$0")" && pwd)

answers() { AMQP_PORT=$port "$here/broker.sh" --probe >/dev/null 2>&1; }

in_root() {
  chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 ERL_EPMD_PORT="$epmd_port" "$@"
}

ctl() { in_root rabbitmqctl -q -n "$node" "$@"; }

mounted() { mountpoint -q "$root/$1"; }

mount_all() {
  mounted proc || mount -t proc proc "$root/proc"
  mounted dev || mount --bind /dev "$root/dev"
}

umount_all() {
  mounted dev && umount "$root/dev"
  mounted proc && umount "$root/proc"
  return 0
}

mirror() {
  local m=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    m=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$m" ] && [ -f /etc/apt/sources.list ]; then
    m=$(awk '/^deb / && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

install() {
  if [ "$(id -u)" -ne 0 ]; then
    say "installing needs root (debootstrap, chroot, mount)"; exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap"
    # The lock timeout: scripts/test.sh starts the Debian brokers beside other installs.
    local apt=(apt-get -o DPkg::Lock::Timeout=300)
    "${apt[@]}" install -y -qq debootstrap >/dev/null 2>&1 || { "${apt[@]}" update -qq; "${apt[@]}" install -y -qq debootstrap; }
  fi
  local started=$SECONDS m
  m=$(mirror)
  say "installing Debian $suite's rabbitmq-server into $root (mirror $m); about a minute"
  mkdir -p "$root"
  if [ ! -x "$root/usr/bin/apt-get" ]; then
    debootstrap --variant=minbase "$suite" "$root" "$m" >"$root.debootstrap.log" 2>&1 \
      || { tail -n 20 "$root.debootstrap.log"; say "debootstrap failed (log: $root.debootstrap.log)"; exit 1; }
  fi
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  # sid's Release file expires within days of its date.
  echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99delay-bridge-valid-until"
  chmod +x "$root/usr/sbin/policy-rc.d"
  cp /etc/hosts "$root/etc/hosts"
  mount_all
  # The broker's files are owned by the host's rabbitmq uid/gid, not another host user's.
  local uid gid
  uid=$(id -u rabbitmq 2>/dev/null || echo 2000)
  gid=$(id -g rabbitmq 2>/dev/null || echo 2000)
  in_root getent group rabbitmq >/dev/null || in_root groupadd -r -g "$gid" rabbitmq
  in_root getent passwd rabbitmq >/dev/null \
    || in_root useradd -r -u "$uid" -g "$gid" -d /var/lib/rabbitmq -s /usr/sbin/nologin rabbitmq
  in_root apt-get update -qq >/dev/null
  in_root apt-get install -y -qq --no-install-recommends rabbitmq-server >"$root.apt.log" 2>&1 \
    || { tail -n 20 "$root.apt.log"; say "apt-get install failed (log: $root.apt.log)"; exit 1; }
  say "installed $(in_root dpkg-query -W -f='rabbitmq-server ${Version}' rabbitmq-server) in $((SECONDS - started)) s"
}

configure() {
  # The management API on its own port (the host's 3.x has 15672).
  echo '[rabbitmq_management].' >"$root/etc/rabbitmq/enabled_plugins"
  printf 'management.tcp.port = %s\nmanagement.tcp.ip = 127.0.0.1\n' "$management_port" \
    >"$root/etc/rabbitmq/rabbitmq.conf"
  cat >"$root/etc/rabbitmq/rabbitmq-env.conf" <<EOF
NODENAME=$node
NODE_PORT=$port
DIST_PORT=$dist_port
ERL_EPMD_PORT=$epmd_port
export ERL_EPMD_PORT
EOF
}

# Waits until NODE (launched at SECONDS = STARTED) has booted, or shows the end of its log
# (under LOG_DIR in the chroot) and exits. await_startup fails at once while the VM is not
# yet reachable: retry until the deadline.
await_node() {
  local node=$1 started=$2 log_dir=$3
  until timeout "$deadline_s" chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root ERL_EPMD_PORT="$epmd_port" rabbitmqctl -q -n "$node" await_startup >/dev/null 2>&1; do
    if (( SECONDS - started >= deadline_s )); then
      say "node $node did not start within ${deadline_s}s; its log:"
      tail -n 30 "$root$log_dir"/*.log 2>/dev/null || true
      exit 1
    fi
    sleep 1
  done
}

start() {
  if answers; then say "already answers on 127.0.0.1:$port"; return 0; fi
  [ -x "$root/usr/sbin/rabbitmq-server" ] || install
  if [ "$(id -u)" -ne 0 ]; then say "starting needs root (chroot)"; exit 1; fi
  configure
  mount_all
  local started=$SECONDS
  ulimit -n 65536 2>/dev/null || true
  in_root rabbitmq-server -detached >/dev/null 2>&1 || true
  await_node "$node" "$started" /var/log/rabbitmq
  local waited=0
  until answers; do
    (( waited++ < deadline_s )) || { say "no AMQP on 127.0.0.1:$port"; exit 1; }
    sleep 1
  done
  say "RabbitMQ $(ctl version 2>/dev/null || echo "($suite)") is up on 127.0.0.1:$port (node $node) in $((SECONDS - started)) s"
}

# PIDs of the processes running inside the chroot (the broker, its epmd).
chroot_pids() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && echo "${p#/proc/}"
  done
  return 0
}

stop() {
  if [ -x "$root/usr/sbin/rabbitmq-server" ] && mounted proc; then
    ctl stop >/dev/null 2>&1 || true
  fi
  local pids waited=0
  pids=$(chroot_pids)
  [ -n "$pids" ] && kill $pids 2>/dev/null
  while [ -n "$(chroot_pids)" ]; do
    (( waited++ < 30 )) || { kill -9 $(chroot_pids) 2>/dev/null || true; sleep 1; break; }
    sleep 1
  done
  umount_all
  say "stopped"
}

# The TLS node: its own name, ports, data, config and plugins inside the chroot.
tls_node=${node_name}tls@localhost
in_tls_root() {
  in_root RABBITMQ_NODENAME="$tls_node" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT=$((port + 3)) RABBITMQ_DIST_PORT=$((dist_port + 3)) \
    RABBITMQ_MNESIA_BASE=/var/lib/rabbitmq/tls-node RABBITMQ_LOG_BASE=/var/log/rabbitmq/tls-node \
    RABBITMQ_CONFIG_FILE=/etc/rabbitmq/tls-node/rabbitmq.conf \
    RABBITMQ_ENABLED_PLUGINS_FILE=/etc/rabbitmq/tls-node/enabled_plugins \
    RABBITMQ_CONF_ENV_FILE=/etc/rabbitmq/tls-node/rabbitmq-env.conf \
    RABBITMQ_PID_FILE=/var/lib/rabbitmq/tls-node/pid "$@"
}

start_tls() {
  local from=$1 conf=$root/etc/rabbitmq/tls-node started=$SECONDS
  [ -x "$root/usr/sbin/rabbitmq-server" ] || install
  mount_all
  in_root rabbitmqctl -q -n "$tls_node" stop >/dev/null 2>&1 || true
  mkdir -p "$conf" "$root/var/lib/rabbitmq/tls-node" "$root/var/log/rabbitmq/tls-node"
  for f in ca.pem server.pem server.key; do cp "$from/$f" "$conf/$f"; done
  chmod 644 "$conf"/*.pem "$conf/server.key"
  : >"$conf/rabbitmq-env.conf"
  echo '[].' >"$conf/enabled_plugins"
  printf 'listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:%s\nssl_options.cacertfile = /etc/rabbitmq/tls-node/ca.pem\nssl_options.certfile = /etc/rabbitmq/tls-node/server.pem\nssl_options.keyfile = /etc/rabbitmq/tls-node/server.key\nssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n' "$tls_port" >"$conf/rabbitmq.conf"
  chown -R rabbitmq:rabbitmq "$root/var/lib/rabbitmq/tls-node" "$root/var/log/rabbitmq/tls-node" 2>/dev/null || true
  in_tls_root rabbitmq-server -detached >/dev/null 2>&1 || true
  await_node "$tls_node" "$started" /var/log/rabbitmq/tls-node
  say "TLS node $tls_node up in $((SECONDS - started)) s: amqps://guest:guest@127.0.0.1:$tls_port/%2f (client certificate required)"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) if answers; then say "answers on 127.0.0.1:$port"; else say "not running"; exit 1; fi ;;
  ctl) shift; ctl "$@" ;;
  start-tls) start_tls "$(cd "${2:?usage: debian-broker.sh SUITE start-tls DIR}" && pwd)" ;;
  stop-tls) in_root rabbitmqctl -q -n "$tls_node" stop >/dev/null 2>&1 || true; say "TLS node stopped" ;;
  *) echo "usage: $0 SUITE start|stop|status|ctl ARGS...|start-tls DIR|stop-tls" >&2; exit 2 ;;
esac
