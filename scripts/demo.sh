#!/usr/bin/env bash
# The demo: brings up RabbitMQ, builds delay-bridge, and runs `delay-bridge demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
bash scripts/broker.sh
cargo build --release --quiet -p delay-bridge   # the daemon only, not the bench
exec ./target/release/delay-bridge demo "$@"
