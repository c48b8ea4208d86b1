"""Publishes to delay-bridge with pika, then watches what arrives.

Usage: publish.py [AMQP_URL [INGRESS [CANCEL_EXCHANGE [TARGET]]]]
The defaults fit config/delay-bridge.toml: amqp://guest:guest@127.0.0.1:5672/%2f,
delayed, delay-bridge.cancel (<prefix>.cancel), amq.direct.

Four messages, nothing but AMQP: one with x-delay, one with x-deliver-at, one recurring
(every 2 s, 3 times) and one scheduled, then cancelled by publishing a tombstone. Exits 0
when each arrived on time (not early, at most 1 s late) and the cancelled one never did.
"""
import sys
import time
from datetime import datetime, timezone

import pika

args = sys.argv[1:] + [None] * 4
URL = args[0] or "amqp://guest:guest@127.0.0.1:5672/%2f"
INGRESS = args[1] or "delayed"
CANCEL_EXCHANGE = args[2] or "delay-bridge.cancel"
TARGET = args[3] or "amq.direct"
TOLERANCE_MS = 1000


def now_ms():
    return int(time.time() * 1000)


def clock(ms):
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


run = f"python-{now_ms()}"  # this run's routing key, and the start of its message ids
connection = pika.BlockingConnection(pika.URLParameters(URL))
channel = connection.channel()
channel.confirm_delivery()  # each basic_publish returns once the broker confirmed it

# A queue of our own on the target exchange: due messages are delivered there with the
# routing key they were published with.
queue = channel.queue_declare("", exclusive=True).method.queue
channel.queue_bind(queue, TARGET, routing_key=run)

labels, due_at = {}, {}  # message_id -> what it is, when it is due (epoch ms)


def publish(message_id, label, headers, due=None):
    channel.basic_publish(INGRESS, run, label.encode(), pika.BasicProperties(
        message_id=message_id, delivery_mode=2, headers=headers))
    labels[message_id], due_at[message_id] = label, due
    print(f"published  {label:<20} {message_id}")


start = now_ms()
# 1. A delay in milliseconds, counted from when the bridge reads the message.
publish(f"{run}-delay", "x-delay 3000 ms", {"x-delay": 3000}, start + 3000)
# 2. An absolute time in epoch milliseconds (an RFC 3339 string works too).
at = now_ms() + 4000
publish(f"{run}-at", "x-deliver-at +4 s", {"x-deliver-at": at}, at)
# 3. A recurring schedule: every 2 s, 3 occurrences; it needs a message_id. Each
#    occurrence arrives with x-occurrence (1, 2, 3) and x-occurrence-due (epoch ms).
publish(f"{run}-every", "every 2 s", {"x-repeat-every": "2s", "x-repeat-count": 3})
# 4. A message due in 5 s, cancelled at once. x-published-at (epoch ms) says when the
#    copy entered, so the cancel covers it even before a bridge has read it.
cancelled = f"{run}-cancelled"
published = now_ms()
publish(cancelled, "x-delay 5000 ms", {"x-delay": 5000, "x-published-at": published},
        published + 5000)

# The cancel: a tombstone published to the fanout exchange <prefix>.cancel, with an
# empty body and message_id = the id to cancel. It drops every copy of the id that
# entered at or before delay-bridge-cancelled-at; delay-bridge-due-at (optional) lets
# bridges forget it after that time. Both are epoch ms, sent by pika as 64-bit integers.
channel.basic_publish(CANCEL_EXCHANGE, "", b"", pika.BasicProperties(
    message_id=cancelled, delivery_mode=2, headers={
        "delay-bridge-kind": "cancel",
        "delay-bridge-cancelled-at": now_ms(),
        "delay-bridge-due-at": published + 5000,
    }), mandatory=True)  # mandatory: raises UnroutableError if no cancel stream is bound
print(f"cancelled  {'x-delay 5000 ms':<20} {cancelled} (tombstone confirmed)")

# Watch the queue until everything is due, and a little longer.
print(f"arrivals:\n  {'message':<20} {'due':<12}  {'arrived':<12}  late")
seen, failures = set(), []
deadline = start + 6000 + TOLERANCE_MS + 500
for method, properties, _body in channel.consume(queue, auto_ack=True, inactivity_timeout=0.1):
    if now_ms() > deadline:
        break
    if method is None:
        continue
    arrived, headers = now_ms(), properties.headers or {}
    label, due = labels[properties.message_id], due_at[properties.message_id]
    if "x-occurrence" in headers:
        label, due = f"{label} #{headers['x-occurrence']}", headers["x-occurrence-due"]
    late = arrived - due
    print(f"  {label:<20} {clock(due)}  {clock(arrived)}  {late:+d} ms")
    seen.add(label)
    if properties.message_id == cancelled:
        failures.append("the cancelled message arrived")
    elif not 0 <= late <= TOLERANCE_MS:
        failures.append(f"{label} arrived {late:+d} ms from its due time")
connection.close()

wanted = ["x-delay 3000 ms", "x-deliver-at +4 s", "every 2 s #1", "every 2 s #2", "every 2 s #3"]
failures += [f"{label} never arrived" for label in wanted if label not in seen]
if failures:
    print("FAILED: " + "; ".join(failures))
    sys.exit(1)
print(f"ok: {len(wanted)} arrived on time, the cancelled one never")
