#!/usr/bin/env bash
# Prints the path of a promtool: the one on PATH, or else the one in Debian's `prometheus`
# package, unpacked (not installed: no service is started) into target/promtool/ on first use.
#   "$(bash scripts/promtool.sh)" check rules ops/prometheus/delay-bridge-alerts.yml
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v promtool >/dev/null 2>&1; then
  command -v promtool
  exit 0
fi
dir=target/promtool
tool=$dir/root/usr/bin/promtool
if [ ! -x "$tool" ]; then
  mkdir -p "$dir"
  echo "promtool.sh: unpacking Debian's prometheus package into $dir (promtool only is used)" >&2
  (
    cd "$dir"
    rm -f prometheus_*.deb
    apt-get download prometheus >&2 2>/dev/null || { apt-get update >&2 && apt-get download prometheus >&2; }
    dpkg-deb -x prometheus_*.deb root
  )
fi
echo "$PWD/$tool"
