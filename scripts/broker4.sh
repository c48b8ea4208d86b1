#!/usr/bin/env bash
# A RabbitMQ 4.x broker beside the default one, for testing delay-bridge on both.
#
#   scripts/broker4.sh start    start it (installing on first use), wait until it answers
#   scripts/broker4.sh stop     stop it and unmount what start mounted
#   scripts/broker4.sh status   say whether it answers
#   scripts/broker4.sh ctl ...  run rabbitmqctl against it (for example: ctl list_queues)
#   scripts/broker4.sh start-tls DIR   a second node, rabbit4tls@localhost, alone, with an
#                               AMQPS listener on 127.0.0.1:5696 that requires a client
#                               certificate, from DIR/ca.pem, DIR/server.pem, DIR/server.key
#                               (copied into the chroot; restarted when it runs)
#   scripts/broker4.sh stop-tls stop that node
#
# It is Debian trixie's rabbitmq-server (4.0.x, Erlang 27) in a debootstrap chroot, so the
# host's packages are untouched. Node rabbit4@localhost, AMQP 127.0.0.1:${RMQ4_PORT:-5673},
# distribution port 25673, epmd port 4370, management API 127.0.0.1:15673; guest/guest
# works from loopback. Installing
# needs root, the Debian mirror apt already uses, ~40 s and ~330 MB. Idempotent.
set -euo pipefail

root=${RMQ4_ROOT:-/var/lib/delay-bridge/rabbitmq-4-trixie}
port=${RMQ4_PORT:-5673}
dist_port=${RMQ4_DIST_PORT:-25673}
epmd_port=${RMQ4_EPMD_PORT:-4370}
management_port=${RMQ4_MANAGEMENT_PORT:-15673}
node=rabbit4@localhost
suite=trixie
deadline_s=${BROKER_WAIT_SECONDS:-120}

say() { echo "broker4.sh: $*"; }
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
    say "installing RabbitMQ 4 needs root (debootstrap, chroot, mount)"; exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap"
    apt-get install -y -qq debootstrap >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq debootstrap; }
  fi
  local started=$SECONDS m
  m=$(mirror)
  say "installing Debian $suite's rabbitmq-server into $root (mirror $m); about 40 s"
  mkdir -p "$root"
  if [ ! -x "$root/usr/bin/apt-get" ]; then
    debootstrap --variant=minbase "$suite" "$root" "$m" >"$root.debootstrap.log" 2>&1 \
      || { tail -n 20 "$root.debootstrap.log"; say "debootstrap failed (log: $root.debootstrap.log)"; exit 1; }
  fi
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
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
  # The management API on 127.0.0.1:15673 (3.x has 15672).
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
  if answers; then say "RabbitMQ 4 already answers on 127.0.0.1:$port"; return 0; fi
  [ -x "$root/usr/sbin/rabbitmq-server" ] || install
  if [ "$(id -u)" -ne 0 ]; then say "starting RabbitMQ 4 needs root (chroot)"; exit 1; fi
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
  say "RabbitMQ $(ctl version 2>/dev/null || echo 4) is up on 127.0.0.1:$port (node $node) in $((SECONDS - started)) s"
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
  say "RabbitMQ 4 stopped"
}

# The TLS node: its own name, ports, data, config and plugins inside the chroot.
tls_node=rabbit4tls@localhost
in_tls_root() {
  in_root RABBITMQ_NODENAME="$tls_node" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT=5676 RABBITMQ_DIST_PORT=25676 \
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
  printf 'listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:5696\nssl_options.cacertfile = /etc/rabbitmq/tls-node/ca.pem\nssl_options.certfile = /etc/rabbitmq/tls-node/server.pem\nssl_options.keyfile = /etc/rabbitmq/tls-node/server.key\nssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n' >"$conf/rabbitmq.conf"
  chown -R rabbitmq:rabbitmq "$root/var/lib/rabbitmq/tls-node" "$root/var/log/rabbitmq/tls-node" 2>/dev/null || true
  in_tls_root rabbitmq-server -detached >/dev/null 2>&1 || true
  await_node "$tls_node" "$started" /var/log/rabbitmq/tls-node
  say "TLS node $tls_node up in $((SECONDS - started)) s: amqps://guest:guest@127.0.0.1:5696/%2f (client certificate required)"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) if answers; then say "answers on 127.0.0.1:$port"; else say "not running"; exit 1; fi ;;
  ctl) shift; ctl "$@" ;;
  start-tls) start_tls "$(cd "${2:?usage: broker4.sh start-tls DIR}" && pwd)" ;;
  stop-tls) in_root rabbitmqctl -q -n "$tls_node" stop >/dev/null 2>&1 || true; say "TLS node stopped" ;;
  *) echo "usage: $0 start|stop|status|ctl ARGS...|start-tls DIR|stop-tls" >&2; exit 2 ;;
esac
