"""What a queue holds, read by a plain pika connection of the test's own: the
independent count, not the client under test."""

from __future__ import annotations

import pika


def drained(url: str, queue: str) -> list[tuple[pika.BasicProperties, bytes]]:
    """Every message waiting in ``queue`` (taken, acked on receipt), in order."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        taken: list[tuple[pika.BasicProperties, bytes]] = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return taken
            taken.append((properties, body))
    finally:
        connection.close()
