#!/usr/bin/env bash
# The benchmarks: brings up RabbitMQ, builds delay-bridge and delay-bridge-bench in release
# mode, and runs every scenario of `delay-bridge-bench` with its defaults, one after the other (never in
# parallel: they would measure each other). Each report goes to target/bench/<scenario>.txt.
#   bash scripts/bench.sh                 # all scenarios
#   bash scripts/bench.sh steady burst    # some
# The benchmarks are their own binary, built with `--features bench` (the daemon's default
# build has none of it). Extra arguments for one scenario: run the binary directly, e.g.
#   target/release/delay-bridge-bench pending --count 10000000
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
bash scripts/broker.sh
cargo build --release --quiet --features bench
mkdir -p target/bench
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(ladder baseline hop burst steady pending cancel-horizon tombstones)
for scenario in "${scenarios[@]}"; do
  echo "== delay-bridge-bench $scenario"
  ./target/release/delay-bridge-bench "$scenario" | tee "target/bench/$scenario.txt"
done
