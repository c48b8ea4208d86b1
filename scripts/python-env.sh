#!/usr/bin/env bash
# Creates .venv with pika and rstream (from PyPI) for the Python interop test and the
# stream-protocol attacks (tests/stream_publisher.py), and prints its python path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import pika, rstream" >/dev/null 2>&1; then
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
      # The lock timeout: scripts/test.sh may be starting a Debian broker beside this.
      apt-get -o DPkg::Lock::Timeout=300 update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq python3-venv >/dev/null
      python3 -m venv "$venv"
    else
      echo "python-env.sh: python3 -m venv failed; install python3-venv" >&2
      exit 1
    fi
  fi
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "pika>=1.3,<2" "rstream>=0.20,<1" >&2
fi
echo "$PWD/$venv/bin/python"
