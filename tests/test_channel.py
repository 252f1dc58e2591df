"""The notebook-rank channel: authenticated, and every message goes out whole at once."""
import os
import select
import socket
import time

import pytest

from ddp_notebook.wire.channel import ChannelServer, connect


def _accepted(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conns = server.new_connections()
        if conns:
            return conns[0]
        time.sleep(0.01)
    raise AssertionError("the server accepted no connection")


def _no_delay(conn) -> int:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_both_ends_send_without_nagle_and_messages_around_the_split_arrive_whole(timeout):
    # multiprocessing's Connection writes a message over 16 KiB as two writes; with Nagle's algorithm the
    # second waited for the peer's delayed ACK: 40 ms for every such task or result.
    server = ChannelServer()
    try:
        rank_side = connect(server.address, server.key, timeout=timeout)
        notebook_side = _accepted(server)
        assert _no_delay(rank_side) and _no_delay(notebook_side)
        for size in (0, 1, 16_384 - 40, 16_384, 16_384 + 1, 100_000):
            body = {"data": os.urandom(size)}
            notebook_side.send(("run", body))
            assert rank_side.recv() == ("run", body)
            rank_side.send(("result", body))
            assert notebook_side.recv() == ("result", body)
        rank_side.close()
        notebook_side.close()
    finally:
        server.close()


def test_the_server_is_readable_while_connections_wait_to_be_taken():
    # A job waits on the server with its connections, so a rank's hello is read as it connects, not at the next
    # timeout of the wait.
    server = ChannelServer()
    try:
        assert select.select([server], [], [], 0)[0] == []
        first = connect(server.address, server.key)
        assert select.select([server], [], [], 10)[0] == [server]
        taken = _accepted(server)
        assert select.select([server], [], [], 0)[0] == []  # taken: nothing waits
        second = connect(server.address, server.key)
        assert select.select([server], [], [], 10)[0] == [server]
        assert server.new_connections() != [] or _accepted(server)
        for conn in (first, second, taken):
            conn.close()
    finally:
        server.close()
