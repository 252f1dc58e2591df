"""Authenticated message channel between the notebook and its ranks.

The notebook side listens on a TCP port with a random per-job key; each rank
connects with that key (HMAC challenge of ``multiprocessing.connection``), so a
process without the key is refused before it can send anything.  Messages are
``(kind, body)`` tuples.  The channel knows nothing of what the messages mean.
"""
from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

__all__ = ["ChannelServer", "connect", "Sender"]


class ChannelServer:
    """Listens for ranks; accepted, authenticated connections are queued."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: bytes | None = None):
        self.key = key or secrets.token_bytes(32)
        # The HMAC handshake runs per connection in its own thread: a peer that
        # connects and stays silent must not hold up the ranks behind it.
        self._listener = Listener((host, port), family="AF_INET", backlog=256)
        self.address = self._listener.address
        self.refused = 0
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self._handshaking: set[Connection] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="ddp-channel-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # listener closed
            self._handshaking.add(conn)
            threading.Thread(target=self._handshake, args=(conn,), name="ddp-channel-auth", daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except Exception:  # wrong key, garbage, or a peer that hung up
            self.refused += 1
            conn.close()
            return
        finally:
            self._handshaking.discard(conn)
        if self._closed:
            conn.close()
        else:
            self._accepted.put(conn)

    def new_connections(self) -> list[Connection]:
        """Connections accepted since the last call."""
        conns = []
        while True:
            try:
                conns.append(self._accepted.get_nowait())
            except queue.Empty:
                return conns

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in self.new_connections():
            conn.close()
        for conn in list(self._handshaking):
            try:  # wakes a handshake blocked on a silent peer
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def connect(address: tuple[str, int], key: bytes) -> Connection:
    """Rank side: connect to the notebook's channel."""
    return Client(tuple(address), family="AF_INET", authkey=key)


class Sender:
    """Sends messages from any thread without blocking the caller.

    A single thread owns the connection's send side, so the training loop only
    pays for a queue put; ``flush`` waits until everything queued has gone.
    """

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue()
        self._broken = False
        self._thread = threading.Thread(target=self._loop, name="ddp-channel-send", daemon=True)
        self._thread.start()

    def send(self, kind: str, body: dict | None = None) -> None:
        if not self._broken:
            self._queue.put((kind, body or {}))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if not self._broken:
                    self._conn.send(item)
            except (OSError, EOFError, ValueError):
                self._broken = True
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()
