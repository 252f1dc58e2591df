"""An interrupt in the middle of a message: held until the message is whole, then raised as usual.

Jupyter's stop button raises KeyboardInterrupt in the kernel's main thread wherever it is; one that cut a
message read between its length and its bytes would leave the channel out of step, and the next read would
wait forever for a length's worth of bytes.
"""
import os
import pickle
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest

from ddp_notebook.wire.channel import whole_message


def _half_then_rest(sock, message, interrupt):
    data = pickle.dumps(message)
    frame = struct.pack("!i", len(data)) + data
    sock.sendall(frame[:len(frame) // 2])
    time.sleep(0.3)  # the reader waits inside the message now
    if interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
    sock.sendall(frame[len(frame) // 2:])


@pytest.mark.parametrize("held", [True, False])
def test_an_interrupt_mid_message_is_held_until_it_is_whole(held):
    reader_sock, writer_sock = socket.socketpair()
    conn = Connection(reader_sock.detach())
    first = {"kind": "metric", "values": list(range(20_000))}  # its second half fits in the socket's buffer
    second = ("after", {"n": 1})
    writer = threading.Thread(target=lambda: (_half_then_rest(writer_sock, first, True),
                                              writer_sock.sendall(_frame(second))))
    writer.start()
    try:
        if held:
            with pytest.raises(KeyboardInterrupt):
                with whole_message():
                    got = conn.recv()
            assert got == first
            with whole_message():
                assert conn.recv() == second  # the stream is still in step
        else:  # what the guard prevents: the read is cut, and what follows is misread
            with pytest.raises(KeyboardInterrupt):
                conn.recv()
            writer.join()
            writer_sock.close()  # so that a misread length ends in EOF rather than a wait
            try:
                after = conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError, ValueError, MemoryError):
                after = None
            assert after != second
    finally:
        writer.join()
        writer_sock.close()
        conn.close()


def _frame(message):
    data = pickle.dumps(message)
    return struct.pack("!i", len(data)) + data


def test_outside_the_main_thread_nothing_changes():
    seen = []

    def other():
        with whole_message():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGINT)]
