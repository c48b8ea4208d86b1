#!/usr/bin/env bash
# The command output shown in README.md, CONTRIBUTING.md and docs/*.md: every fenced block
# after a `<!-- sample: NAME -->` comment is produced by the commands it names (tests/samples.rs
# says which, and the masking rule for times, ids and lateness). Checks them against what
# the commands print today, or with --update rewrites them with it (then read `git diff`).
# Needs the broker the tests use (DELAY_BRIDGE_TEST_URL, default 127.0.0.1:5672): the demo,
# `status` and the metrics run against it, under a prefix of their own that they delete.
# `cargo test` runs the same check (the `samples` test).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
case "${1:-}" in
  --update) export DELAY_BRIDGE_SAMPLES=update ;;
  "") ;;
  *) echo "usage: scripts/samples.sh [--update]" >&2; exit 2 ;;
esac
bash scripts/broker.sh
exec cargo test -p delay-bridge --test samples -- --nocapture
