#!/usr/bin/env bash
# The fault suite: load through delay-bridge while something breaks, everything on loopback,
# each scenario bounded in count and time. Each prints messages sent, delivered, missing,
# duplicates, parked and lateness, its targets as PASS or MISS, and a JSON line; each report
# also goes to target/faults/<scenario>.txt.
#
#   bash scripts/faults.sh                       # every scenario, one after the other
#   bash scripts/faults.sh connection-cuts fuzz  # some
#
# Scenarios (run alone with the command each prints):
#   connection-cuts       the broker on 5672 closes the bridge's connection every 3 s for 60 s
#   bridge-chaos          two bridges, one SIGKILLed and restarted every 2-5 s; 100 000 over 60 s
#   fuzz                  2 000 messages with random header tables and properties
#   node-loss             quorum mode on the three-node cluster (scripts/cluster.sh), two
#                         bridges; kill -9 of the node that leads every queue at 10 s, back at 25 s
#   broker-crash-quorum   one broker (cluster.sh node 4), quorum mode: kill -9 at 10 s, back at 15 s
#   broker-crash-classic  the same in classic mode
#   broker-stall          one broker (cluster.sh node 4), classic mode: its VM stopped
#                         (SIGSTOP) at 10 s for 40 s, then resumed (SIGCONT)
#
# The cluster scenarios run on the installed RabbitMQ (3.x); with CLUSTER_BROKER=4 they run
# on 4.0.x in scripts/debian-broker.sh trixie's chroot, with CLUSTER_BROKER=43 on 4.3.x in
# sid's, and the reports go to target/faults/4/ or target/faults/43/.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
bash scripts/broker.sh
cargo build --release --quiet --workspace
reports=target/faults
if [ "${CLUSTER_BROKER:-3}" != 3 ]; then
  export CLUSTER_BROKER
  reports=target/faults/$CLUSTER_BROKER
fi
mkdir -p "$reports"
# FAULTS_BENCH runs another build of the bench (and the bridge beside it), for a before/after.
bench=${FAULTS_BENCH:-./target/release/delay-bridge-bench}
export RUST_LOG=${RUST_LOG:-error}

# A configuration for the bench: its prefix and route are replaced by each scenario's own.
# With management API URLs after the queue type, its bridges watch for stuck levels.
config() {
  local file=$reports/$1.toml
  printf '[topology]\nqueue_type = "%s"\n\n' "$1" > "$file"
  if [ $# -gt 1 ]; then
    printf '[management]\nurls = [%s]\ninterval = "1s"\nstuck_after = "15s"\n\n' "$2" >> "$file"
  fi
  printf '[[route]]\ningress = "unused.in"\ntarget = "unused.out"\n' >> "$file"
  echo "$file"
}

cluster_urls() { bash scripts/cluster.sh urls | tr '\n' ' '; }

run() {
  local name=$1
  shift
  echo "== $*"
  "$@" | tee "$reports/$name.txt"
}

scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(connection-cuts bridge-chaos fuzz node-loss broker-crash-quorum broker-crash-classic)
for scenario in "${scenarios[@]}"; do
  case $scenario in
    connection-cuts)
      run "$scenario" $bench --config "$(config classic)" connection-cuts --count 60000 --rate 1000 --every 3s --cut-for 60s
      ;;
    bridge-chaos)
      run "$scenario" $bench --config "$(config classic)" bridge-chaos --count 100000 --rate 1666
      ;;
    fuzz)
      run "$scenario" $bench --config "$(config classic)" fuzz --count 2000
      ;;
    node-loss)
      bash scripts/cluster.sh start
      # Its bridges (which log warnings) watch the levels through the management API.
      management=$(bash scripts/cluster.sh management-urls | sed 's/.*/"&"/' | paste -sd, -)
      DELAY_BRIDGE_URL=$(cluster_urls) \
        run "$scenario" $bench --config "$(config quorum "$management")" node-loss \
        --count 50000 --rate 1000 --min-delay 1s --max-delay 30s \
        --kill "bash scripts/cluster.sh kill 1" --restart "bash scripts/cluster.sh restart 1" \
        --kill-after 10s --restart-after 25s --bridges 2
      ;;
    broker-crash-quorum|broker-crash-classic)
      bash scripts/cluster.sh start-solo
      DELAY_BRIDGE_URL=$(bash scripts/cluster.sh url 4) run "$scenario" $bench --config "$(config "${scenario#broker-crash-}")" broker-crash \
        --count 50000 --rate 1000 --min-delay 1s --max-delay 30s \
        --kill "bash scripts/cluster.sh kill 4" --restart "bash scripts/cluster.sh restart 4" \
        --kill-after 10s --restart-after 15s --bridges 1
      ;;
    broker-stall)
      bash scripts/cluster.sh start-solo
      DELAY_BRIDGE_URL=$(bash scripts/cluster.sh url 4) run "$scenario" $bench --config "$(config classic)" broker-crash \
        --count 60000 --rate 1000 --min-delay 1s --max-delay 30s \
        --kill "bash scripts/cluster.sh pause 4" --restart "bash scripts/cluster.sh resume 4" \
        --kill-after 10s --restart-after 50s --bridges 1
      ;;
    *)
      echo "faults.sh: unknown scenario $scenario" >&2
      sed -n '2,20p' "$0" >&2
      exit 2
      ;;
  esac
done
