"""Publishes entries to a RabbitMQ stream over the stream protocol (port 5552), as a user who
may write to it: what a canceller can do once the broker's stream plugin is enabled.

Usage: stream_publisher.py HOST PORT USER PASSWORD VHOST STREAM < entries.json

entries.json is a list of objects: {"message_id": str, "user_id": str | null,
"headers": {name: str | int}, "body": str | null (latin-1 text; null: no body section)}.
Exits 0 once the broker confirmed every entry, 3 when the stream protocol refused to
publish (printed on stderr), 2 on any other failure.
"""

import asyncio
import json
import sys

from rstream import AMQPMessage, Producer, Properties


async def main() -> int:
    host, port, user, password, vhost, stream = sys.argv[1:7]
    entries = json.load(sys.stdin)
    try:
        async with Producer(
            host, port=int(port), username=user, password=password, vhost=vhost
        ) as producer:
            for entry in entries:
                user_id = entry.get("user_id")
                body = entry.get("body")
                message = AMQPMessage(
                    body=None if body is None else body.encode("latin-1"),
                    properties=Properties(
                        message_id=entry["message_id"],
                        user_id=None if user_id is None else user_id.encode(),
                    ),
                    application_properties=entry.get("headers", {}),
                )
                await producer.send_wait(stream, message)
    except Exception as e:  # the stream protocol's refusals are several exception types
        text = f"{type(e).__name__}: {e}"
        print(text, file=sys.stderr)
        return 3 if "ACCESS" in text.upper() or "REFUSED" in text.upper() else 2
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
