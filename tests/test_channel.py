"""The notebook-rank channel: authenticated, and every message goes out whole at once."""
import os
import select
import socket
import time

import pytest

from sockets import accepted
from ddp_notebook.wire.channel import ChannelServer, connect




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
        notebook_side = accepted(server)
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
        taken = accepted(server)
        assert select.select([server], [], [], 0)[0] == []  # taken: nothing waits
        second = connect(server.address, server.key)
        assert select.select([server], [], [], 10)[0] == [server]
        taken_second = accepted(server)
        for conn in (first, second, taken, taken_second):
            conn.close()
    finally:
        server.close()
    server.close()  # again: nothing left to close, and no descriptor of someone else's touched
    assert server.fileno() == -1 and server.new_connections() == []


def test_a_handshake_that_ends_as_the_server_closes_keeps_its_byte_out_of_reused_descriptors(monkeypatch):
    # The handshake thread queues a connection and writes a wake-up byte; close() must not close the wake-up pipe
    # between the two, or the byte lands in whatever descriptor took its number.
    import queue
    import threading

    server = ChannelServer()
    slow_put = threading.Event()

    class SlowQueue(queue.Queue):
        def put(self, item, *args, **kwargs):
            slow_put.set()
            time.sleep(0.5)
            super().put(item, *args, **kwargs)

    server._accepted = SlowQueue()
    rank_side = connect(server.address, server.key)
    assert slow_put.wait(10)
    server.close()
    others = [os.pipe() for _ in range(4)]  # they may take the wake-up pipe's numbers
    try:
        time.sleep(0.7)
        for read_end, _ in others:
            assert select.select([read_end], [], [], 0)[0] == []  # no stray byte
        assert server.new_connections() == []  # the connection was closed, not left queued
    finally:
        rank_side.close()
        for pair in others:
            for fd in pair:
                os.close(fd)


def test_wait_closed_returns_when_the_peer_closes_and_leaves_its_messages_to_be_read():
    import threading

    from ddp_notebook.wire.channel import readable, wait_closed

    server = ChannelServer()
    try:
        rank_side = connect(server.address, server.key)
        notebook_side = accepted(server)
        closed = threading.Event()
        watcher = threading.Thread(target=lambda: (wait_closed(rank_side), closed.set()), daemon=True)
        watcher.start()
        notebook_side.send(("run", {"task": 1}))
        time.sleep(0.3)
        assert not closed.is_set()  # a message does not wake it ...
        assert readable(rank_side) and rank_side.recv() == ("run", {"task": 1})  # ... nor take it
        assert not readable(rank_side)
        notebook_side.send(("stop", {"task": 1}))
        notebook_side.close()
        assert closed.wait(10)
        assert rank_side.recv() == ("stop", {"task": 1})  # what came before the close is still there
        with pytest.raises(EOFError):
            rank_side.recv()
        rank_side.close()
    finally:
        server.close()


def test_send_together_delivers_each_message_whole_as_send_bytes_does():
    # Small messages go out with the GIL kept; one a socket does not take at once is finished the usual way.
    import threading

    from ddp_notebook.wire.channel import send_together

    server = ChannelServer()
    try:
        ranks, notebook = [], []
        for _ in range(2):  # one at a time: each rank's end with its notebook end
            ranks.append(connect(server.address, server.key))
            notebook.append(accepted(server))
        messages = [b"", b"x", os.urandom(1000), os.urandom(16384), os.urandom(16385), os.urandom(300_000)]
        for data in messages:
            assert send_together(notebook, data) == []
            assert [r.recv_bytes() for r in ranks] == [data, data]
        # A socket with a full buffer: the first message is partly taken, the next not at all; both arrive whole.
        with socket.socket(fileno=os.dup(notebook[0].fileno())) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        got = []
        reader = threading.Timer(0.3, lambda: got.extend(ranks[0].recv_bytes() for _ in range(40)))
        reader.start()
        sent = [os.urandom(16000) for _ in range(40)]
        for data in sent:
            assert send_together(notebook[:1], data) == []
        reader.join(30)
        assert got == sent
        ranks[1].close()  # a rank gone: its send fails, the others' do not
        time.sleep(0.1)
        failed = []
        for _ in range(3):  # (the first write to a closed peer may still succeed)
            failed = send_together(notebook, b"after")
            if failed:
                break
            time.sleep(0.1)
        assert failed == [notebook[1]]
        assert ranks[0].recv_bytes() == b"after"
    finally:
        server.close()


def test_receive_now_reads_only_a_message_that_has_arrived_whole():
    import threading

    from multiprocessing.reduction import ForkingPickler

    from ddp_notebook.wire.channel import receive_now

    server = ChannelServer()
    try:
        rank = connect(server.address, server.key)
        notebook = accepted(server)
        assert receive_now(notebook) == (False, None)  # nothing yet
        rank.send(("result", {"task": 3, "value": b"\0" * 1000}))
        rank.send(("bye", {}))
        assert receive_now(notebook) == (True, ("result", {"task": 3, "value": b"\0" * 1000}))
        assert receive_now(notebook) == (True, ("bye", {}))
        # Half a message: nothing is taken; the usual read then waits for the rest and gets it whole.
        [frame] = rank._frame(bytes(ForkingPickler.dumps(("metric", {"loss": 0.5}))))
        os.write(rank.fileno(), frame[:len(frame) // 2])
        assert receive_now(notebook) == (False, None)
        os.write(rank.fileno(), frame[len(frame) // 2:])
        assert notebook.recv() == ("metric", {"loss": 0.5})
        big = os.urandom(1 << 20)  # more than the socket holds at once: read the usual way
        sender = threading.Thread(target=rank.send_bytes, args=(big,))
        sender.start()
        time.sleep(0.2)
        assert receive_now(notebook) == (False, None)
        assert notebook.recv_bytes() == big
        sender.join()
        rank.close()
        assert receive_now(notebook) == (False, None)  # the end: the usual read raises EOFError
        with pytest.raises(EOFError):
            notebook.recv()
        notebook.close()
    finally:
        server.close()
