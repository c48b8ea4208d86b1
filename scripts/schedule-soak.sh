#!/usr/bin/env bash
# One bridge (the release build, the default configuration on a prefix of its own) running one
# recurring schedule every second for N minutes (default 10) on the broker at 127.0.0.1:5672:
# prints, per minute, the occurrences delivered, the bridge's RSS and the cancel stream's
# entries. An occurrence delivered in the ordinary way writes nothing to the stream, so its
# entries stay flat after the first minute (the schedule's one replacement entry).
# With CANCELS_PER_S set, that many cancels a second go to the stream as well (each naming a
# due time 5 minutes on), and each minute also shows what a starting bridge would read: the
# newest checkpoint's live records and the entries after it (from `delay-bridge status`).
#   scripts/schedule-soak.sh [minutes]   (DELAY_BRIDGE_EXE: another build to run)
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
python=$(scripts/python-env.sh)
exe=${DELAY_BRIDGE_EXE:-target/release/delay-bridge}
[ -x "$exe" ] || cargo build --release -q -p delay-bridge
prefix="soak-schedule-$$"
url=${DELAY_BRIDGE_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
config=$(mktemp --suffix .toml)
log=$(mktemp --suffix .log)
sed -e "s/^prefix = .*/prefix = \"$prefix\"/" \
    -e "s/^ingress = .*/ingress = \"$prefix.in\"/" \
    -e "s/^target = .*/target = \"amq.topic\"/" config/delay-bridge.toml >"$config"
DELAY_BRIDGE_URL=$url "$exe" -c "$config" run >"$log" 2>&1 &
bridge=$!
cleanup() {
  kill "$bridge" 2>/dev/null || true
  wait "$bridge" 2>/dev/null || true
  for q in $(rabbitmqctl list_queues -q name 2>/dev/null | grep "^$prefix"); do
    rabbitmqctl delete_queue "$q" >/dev/null 2>&1 || true
  done
  rm -f "$config" "$log"
}
trap cleanup EXIT
"$python" - "$url" "$prefix" "$minutes" "$bridge" "${CANCELS_PER_S:-0}" "$exe" "$config" <<'PY'
import json, subprocess, sys, time
import pika

url, prefix, minutes, bridge = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cancels_per_s, exe, config = float(sys.argv[5]), sys.argv[6], sys.argv[7]
connection = pika.BlockingConnection(pika.URLParameters(url))
channel = connection.channel()
queue = prefix + ".ticks"
channel.queue_declare(queue, durable=False, auto_delete=True)
channel.queue_bind(queue, "amq.topic", "soak.tick")
deadline = time.time() + 30
while True:  # the bridge declares its ingress when it starts
    try:
        probe = connection.channel()
        probe.exchange_declare(prefix + ".in", passive=True)
        probe.close()
        break
    except pika.exceptions.ChannelClosedByBroker:
        if time.time() > deadline:
            sys.exit("the bridge did not start within 30 s")
        time.sleep(0.2)
channel.basic_publish(prefix + ".in", "soak.tick", b"tick", pika.BasicProperties(
    message_id="soak-tick", headers={"x-repeat-every": "1s"}))

def rss_mib():
    with open(f"/proc/{bridge}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")

def stream_entries():
    out = subprocess.run(["rabbitmqctl", "list_queues", "-q", "name", "messages"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, _, count = line.partition("\t")
        if name == prefix + ".cancel":
            return int(count)
    return -1

def start_reads():
    """What a starting bridge reads: the newest checkpoint's records, the entries after."""
    out = subprocess.run([exe, "-c", config, "status", "--json"],
                         capture_output=True, text=True, env={"DELAY_BRIDGE_URL": url}).stdout
    entries = json.loads(out)["cancel_entries"]
    checkpoint = entries.get("checkpoint") or {}
    records = sum(checkpoint.get(k, 0) for k in ("cancels", "replacements", "successors", "held"))
    after = sum(entries[k] for k in ("tombstones", "successors", "markers", "clamps",
                                     "checkpoint_entries", "invalid", "unreadable"))
    return records, after

header = "minute  occurrences  bridge RSS MiB  cancel-stream entries"
if cancels_per_s:
    header += "  cancels  checkpoint records  entries after it"
print(header)
delivered = cancelled = 0
next_cancel = time.time()
for minute in range(1, minutes + 1):
    end = time.time() + 60
    while time.time() < end:
        while cancels_per_s and time.time() >= next_cancel:
            now_ms = int(time.time() * 1000)
            channel.basic_publish(prefix + ".cancel", "", b"", pika.BasicProperties(
                message_id=f"soak-cancel-{cancelled}", delivery_mode=2,
                headers={"delay-bridge-kind": "cancel", "delay-bridge-cancelled-at": now_ms,
                         "delay-bridge-due-at": now_ms + 300_000}))
            cancelled += 1
            next_cancel += 1 / cancels_per_s
        _, _, body = channel.basic_get(queue, auto_ack=True)
        if body is None:
            connection.sleep(0.05)
        else:
            delivered += 1
    line = f"{minute:>6}  {delivered:>11}  {rss_mib():>14.1f}  {stream_entries():>21}"
    if cancels_per_s:
        records, after = start_reads()
        line += f"  {cancelled:>7}  {records:>18}  {after:>16}"
    print(line, flush=True)
connection.close()
PY
