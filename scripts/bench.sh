#!/usr/bin/env bash
# The benchmarks: brings up RabbitMQ 3.x (127.0.0.1:5672) and 4.x (127.0.0.1:5673,
# scripts/debian-broker.sh trixie), builds delay-bridge and delay-bridge-bench in release mode, and runs
# each scenario three times on each broker, one run after the other (never in parallel:
# they would measure each other). Each run's report goes to
# target/bench/<broker version>/<scenario>.<run>.txt; after the runs of a scenario, its
# spread (min / median / max of every figure, and the runs that met each target) is
# printed and saved as target/bench/<broker version>/<scenario>.spread.txt.
#   bash scripts/bench.sh                      # every scenario, both brokers, 3 runs each
#   bash scripts/bench.sh steady capacity      # some scenarios
#   BENCH_RUNS=1 bash scripts/bench.sh burst   # another number of runs
#   BENCH_BROKERS=3 bash scripts/bench.sh      # one broker: 3 (5672), 4 (4.0, 5673) or 43
#                                      # (4.3, 5674); the default is 3 and 4
#   BENCH_BUNDLE_WINDOW=200ms bash scripts/bench.sh steady   # another hop window (the
#                                      # default config bundles in 100-ms windows); reports go
#                                      # to target/bench/<version>/bundles-200ms/
#   BENCH_BUNDLE_WINDOW=0s bash scripts/bench.sh steady      # no windows, no bundles (as before
#                                      # they were the default); reports go to .../no-bundles/
#   BENCH_BROKERS=3 bash scripts/bench.sh plugin   # the archived delayed-message plugin beside
#                                      # the bridge (installed for the broker and enabled first)
#   BENCH_BROKERS=3 bash scripts/bench.sh plugin-move   # moving an exchange off the plugin onto
#                                      # the bridge (docs/operations.md, Moving off the plugin): counts
#   BENCH_RUNS=3 bash scripts/bench.sh mixed       # the 30-minute soak, 3 runs (not in the
#                                      # default list: 90 minutes per broker), each also drawn
#                                      # as target/bench/<version>/mixed.<run>.svg
#   target/release/delay-bridge-bench mixed --plugin  # the soak's flow through the archived
#                                      # plugin instead (enabled first; no cancels or parking)
#   target/release/delay-bridge-bench capacity --plugin  # capacity's search through the archived
#                                      # plugin (a fresh x-delayed-message exchange per run; no targets)
#   DELAY_BRIDGE_BENCH_CAPACITY_BEFORE=3363 BENCH_BROKERS=3 bash scripts/bench.sh capacity
#                                      # capacity's target is twice this figure: the capacity
#                                      # measured on this machine before the first change for
#                                      # it (docs/performance.md: the commit and how). Without
#                                      # it, the first reference machine's figure is the base.
# The benchmarks are their own package (`bench/`, a workspace member with its own
# dependencies; the daemon's build has none of it). Extra arguments for one scenario: run the binary directly, e.g.
#   target/release/delay-bridge-bench steady --rate 1000 --seconds 30
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
runs=${BENCH_RUNS:-3}
brokers=${BENCH_BROKERS:-3 4}
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(baseline hop burst steady intake capacity pending cancel-horizon tombstones)

cargo build --release --quiet --workspace
bench=./target/release/delay-bridge-bench
label=
if [ -n "${BENCH_BUNDLE_WINDOW:-}" ]; then
  # The default configuration with another hop window: nothing else differs.
  if [ "$BENCH_BUNDLE_WINDOW" = 0s ]; then label=no-bundles; bundles=false; else
    label=bundles-$BENCH_BUNDLE_WINDOW; bundles=true; fi
  mkdir -p target/bench
  sed -e "s/^hop_window = .*/hop_window = \"$BENCH_BUNDLE_WINDOW\"/" \
      -e "s/^bundle_hops = .*/bundle_hops = $bundles/" config/delay-bridge.toml >"target/bench/$label.toml"
  bench="$bench --config target/bench/$label.toml"
fi

for broker in $brokers; do
  case $broker in
    3) bash scripts/broker.sh; url="amqp://guest:guest@127.0.0.1:5672/%2f"
       version=$(rabbitmqctl version 2>/dev/null || echo 3.x) ;;
    4) bash scripts/debian-broker.sh trixie start; url="amqp://guest:guest@127.0.0.1:5673/%2f"
       version=$(bash scripts/debian-broker.sh trixie ctl version 2>/dev/null || echo 4.0) ;;
    43) bash scripts/debian-broker.sh sid start; url="amqp://guest:guest@127.0.0.1:5674/%2f"
       version=$(bash scripts/debian-broker.sh sid ctl version 2>/dev/null || echo 4.3) ;;
    *) echo "bench.sh: BENCH_BROKERS takes 3, 4 and/or 43, not $broker" >&2; exit 2 ;;
  esac
  out=target/bench/$version${label:+/$label}
  mkdir -p "$out"
  for scenario in "${scenarios[@]}"; do
    reports=()
    for run in $(seq 1 "$runs"); do
      echo "== RabbitMQ $version: delay-bridge-bench $scenario (run $run of $runs)"
      # The soak also draws its per-minute figures beside its report.
      extra=()
      [ "$scenario" = mixed ] && extra=(--svg "$out/$scenario.$run.svg")
      DELAY_BRIDGE_URL=$url $bench "$scenario" "${extra[@]}" | tee "$out/$scenario.$run.txt"
      reports+=("$out/$scenario.$run.txt")
    done
    echo "== RabbitMQ $version: $scenario over $runs runs"
    $bench spread "${reports[@]}" | tee "$out/$scenario.spread.txt"
  done
done
