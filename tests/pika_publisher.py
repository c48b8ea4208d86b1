"""Publishes to delay-bridge exactly as to the delayed-message plugin's exchange (pika).

Usage: pika_publisher.py AMQP_URL EXCHANGE
Prints the time it began publishing, epoch ms (the delays count from then, not from when
the interpreter started: importing pika on a loaded machine can take a second).
"""
import sys
import time

import pika

url, exchange = sys.argv[1], sys.argv[2]
connection = pika.BlockingConnection(pika.URLParameters(url))
channel = connection.channel()
channel.confirm_delivery()
print(int(time.time() * 1000), flush=True)
for n, (body, delay) in enumerate([(b"int 1500", 1500), (b"str 900", "900"), (b"int 400", 400)]):
    channel.basic_publish(
        exchange=exchange,
        routing_key="rk.pika",
        body=body,
        properties=pika.BasicProperties(
            content_type="text/plain",
            delivery_mode=2,
            message_id=f"py-{3 - n}",
            headers={"x-delay": delay, "tenant": "acme", "attempt": 3},
        ),
    )
connection.close()
