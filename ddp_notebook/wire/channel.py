"""Authenticated message channel between the notebook and its ranks.

The notebook side listens on a TCP port with a random per-job key; each rank
connects with that key (HMAC challenge of ``multiprocessing.connection``), so a
process without the key is refused before it can send anything.  Messages are
``(kind, body)`` tuples.  The channel knows nothing of what the messages mean.
"""
from __future__ import annotations

import _signal
import contextlib
import ctypes
import errno
import os
import queue
import secrets
import select
import signal
import socket
import struct
import termios
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["ChannelServer", "connect", "Sender", "whole_message"]


class ChannelServer:
    """Listens for ranks; accepted, authenticated connections are queued.

    ``close()`` ends the listening port and every thread the server started.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, key: bytes | None = None):
        self.key = key or secrets.token_bytes(32)
        self._sock = socket.create_server((host, port), backlog=256)
        self.address = self._sock.getsockname()[:2]
        self.refused = 0
        self._accepted: queue.Queue[Connection] = queue.Queue()
        # The HMAC handshake runs per connection in its own thread: a peer that
        # connects and stays silent must not hold up the ranks behind it.
        self._handshaking: dict[Connection, threading.Thread] = {}
        self._lock = threading.Lock()  # a connection leaves _handshaking before its thread closes it
        self._closed = False
        # A byte per connection queued: whoever waits for messages can wait on this too (``fileno()``).
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._thread = threading.Thread(target=self._accept_loop, name="ddp-channel-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # listener shut down
            sock.setblocking(True)
            with contextlib.suppress(OSError):  # a peer gone already: its handshake fails below
                _send_at_once(sock)
            conn = Connection(sock.detach())
            thread = threading.Thread(target=self._handshake, args=(conn,), name="ddp-channel-auth", daemon=True)
            with self._lock:
                self._handshaking[conn] = thread
                thread.start()

    def _handshake(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            ok = True
        except Exception:  # wrong key, garbage, a peer that hung up, or close()
            ok = False
        with self._lock:  # close() closes the wake-up pipe under the lock: no byte can go to a reused descriptor
            self._handshaking.pop(conn, None)
            kept = ok and not self._closed
            if kept:
                self._accepted.put(conn)
                with contextlib.suppress(OSError):  # full (many waiting already): no byte is needed
                    os.write(self._wakeup_write, b"\0")
        if not ok:
            self.refused += 1
        if not kept:
            conn.close()

    def fileno(self) -> int:
        """Readable while authenticated connections wait to be taken (:meth:`new_connections`); -1 once closed."""
        return self._wakeup_read

    def new_connections(self) -> list[Connection]:
        """Connections accepted since the last call."""
        with self._lock:
            if self._accepted.empty():
                return []  # (a connection and its wake-up byte come together, under this lock: no byte either)
            if self._wakeup_read >= 0:
                with contextlib.suppress(OSError):  # emptied first: a connection queued after this leaves a byte
                    while os.read(self._wakeup_read, 4096):
                        pass
            conns = []
            while True:
                try:
                    conns.append(self._accepted.get_nowait())
                except queue.Empty:
                    return conns

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening, end the server's threads and close the connections nobody took (again: nothing)."""
        with self._lock:
            self._closed = True
        # Closing alone would not wake a thread blocked in accept(): the port
        # would go on listening, with no fd left, for as long as the process.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout)
        self._sock.close()
        with self._lock:
            for conn in self._handshaking:
                try:  # wakes a handshake blocked on a silent peer
                    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threads = list(self._handshaking.values())
        for thread in threads:
            thread.join(timeout)
        for conn in self.new_connections():
            conn.close()
        with self._lock:
            wakeup = (self._wakeup_read, self._wakeup_write)
            self._wakeup_read = self._wakeup_write = -1
        for fd in wakeup:
            if fd >= 0:
                os.close(fd)


def _send_at_once(sock: socket.socket) -> None:
    """No Nagle delay: a ``Connection`` writes a message over 16 KiB as two writes (its length, then its bytes),
    and with Nagle's algorithm the second waits for the peer's ACK of the first, which the peer delays by up to
    40 ms."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# Calls that keep the GIL (ctypes.PyDLL): in a Jupyter kernel every system call made through Python lets the
# kernel's own threads run, which are busy at the start of each cell, and a warm cell's steps then waited for them.
_SEND_WITHOUT_SWITCH_MAX = 16384  # what a Connection writes in one write (its length, then its bytes)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", None)
CAN_WAIT_CLOSED = hasattr(select, "POLLRDHUP")  # Linux
_libc = None
if _NOSIGNAL is not None and CAN_WAIT_CLOSED:
    _libc = ctypes.PyDLL(None, use_errno=True)
    _libc.send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
    _libc.send.restype = ctypes.c_ssize_t
    _libc.poll.argtypes = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int)
    _libc.poll.restype = ctypes.c_int
    _libc.recv.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.recv.restype = ctypes.c_ssize_t
    _libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
    _libc.ioctl.restype = ctypes.c_int


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def ready_now(fds: list[int]) -> list[int]:
    """The descriptors among ``fds`` with something to read, or closed, now (``select`` with a zero timeout,
    without letting another thread run)."""
    if _libc is None:
        return select.select(fds, [], [], 0)[0]
    polled = (_PollFd * len(fds))(*[(fd, select.POLLIN, 0) for fd in fds])
    while _libc.poll(polled, len(fds), 0) < 0:
        if ctypes.get_errno() != errno.EINTR:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return [entry.fd for entry in polled if entry.revents]


def send_together(conns: list[Connection], data: bytes) -> list[Connection]:
    """Send one message on several connections, as ``conn.send_bytes(data)`` does, but a small one goes out on
    all of them before any other thread of this process runs; returns the connections the send failed on.

    Python lets other threads run during each write.  In a Jupyter kernel, whose own threads are busy at the
    start of every cell, the second rank got a warm cell's task about 0.3 ms after the first.  Here a small
    message is written with the GIL kept (``send`` with MSG_DONTWAIT, which never waits); what a socket does not
    take at once is written the usual way.
    """
    failed = []
    frame = struct.pack("!i", len(data)) + data if _libc is not None and len(data) <= _SEND_WITHOUT_SWITCH_MAX \
        else None
    for conn in conns:
        try:
            sent = 0
            if frame is not None:
                sent = _libc.send(conn.fileno(), frame, len(frame), socket.MSG_DONTWAIT | _NOSIGNAL)
                if sent < 0:
                    code = ctypes.get_errno()
                    if code not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                        raise OSError(code, os.strerror(code))
                    sent = 0
            if frame is None or sent == 0:
                conn.send_bytes(data)
            else:
                rest = memoryview(frame)[sent:]
                while rest:  # the socket took part of it: the rest the usual way
                    rest = rest[os.write(conn.fileno(), rest):]
        except OSError:
            failed.append(conn)
    return failed


def receive_now(conn: Connection) -> tuple[bool, Any]:
    """``(True, conn.recv())`` when a whole message has arrived, read without letting another thread run; else
    ``(False, None)`` and nothing is read (receive it the usual way)."""
    if _libc is None:
        return False, None
    fd = conn.fileno()
    waiting = ctypes.c_int()
    if _libc.ioctl(fd, termios.FIONREAD, ctypes.byref(waiting)) != 0 or waiting.value < 4:
        return False, None
    header = ctypes.create_string_buffer(4)
    if _libc.recv(fd, header, 4, socket.MSG_PEEK | socket.MSG_DONTWAIT) != 4:
        return False, None
    size = struct.unpack("!i", header.raw)[0]
    if size < 0 or waiting.value < 4 + size:  # (a message of 2 GiB or more has a longer header)
        return False, None
    message = ctypes.create_string_buffer(4 + size)
    if _libc.recv(fd, message, 4 + size, socket.MSG_DONTWAIT) != 4 + size:
        raise OSError(f"a message of {size} bytes was there, but could not be read whole")
    return True, ForkingPickler.loads(memoryview(message)[4:])


def readable(conn: Connection) -> bool:
    """``conn.poll()`` (something to read, or the peer gone) without the selector it builds for each call."""
    return bool(ready_now([conn.fileno()]))


def wait_closed(conn: Connection) -> None:
    """Block until the peer has closed the connection (Linux: :data:`CAN_WAIT_CLOSED`).  Unlike a read, this
    never takes the peer's messages and never wakes for them (POLLRDHUP only), so another thread may read them
    meanwhile."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)
    poller.poll()  # (no timeout: it returns with the close; Python retries it after a signal)


def connect(address: tuple[str, int], key: bytes, timeout: float | None = None) -> Connection:
    """Rank side: connect to the notebook's channel (giving up after ``timeout`` seconds when it is given: a
    firewall may drop the attempt without an answer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # IPv4, as the notebook listens (a hostname too)
    try:
        sock.settimeout(timeout)
        sock.connect(tuple(address))
        sock.setblocking(True)  # Connection reads and writes the bare descriptor
        _send_at_once(sock)
    except BaseException:
        sock.close()
        raise
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, key)  # as multiprocessing.connection.Client does
        deliver_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


class Sender:
    """Sends messages from any thread without blocking the caller.

    A single thread owns the connection's send side, so the training loop only
    pays for a queue put; ``flush`` waits until everything queued has gone.
    """

    def __init__(self, conn: Connection):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue()
        self._broken = False
        self._lock = threading.Lock()  # one message on the wire at a time (the thread's, or send_now's)
        self._thread = threading.Thread(target=self._loop, name="ddp-channel-send", daemon=True)
        self._thread.start()

    def send(self, kind: str, body: dict | None = None) -> None:
        if not self._broken:
            self._queue.put((kind, body or {}))

    def send_now(self, kind: str, body: dict | None = None) -> None:
        """Send from the calling thread, after everything queued before: a cell's result, which its thread waits
        for anyway (no hand-over to the sending thread and back)."""
        self.flush()
        self._send((kind, body or {}))

    def _send(self, item: tuple) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                self._conn.send(item)
            except (OSError, EOFError, ValueError):
                self._broken = True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._send(item)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, end the sending thread and close the connection."""
        self._queue.put(None)
        self._thread.join()
        self._conn.close()


@contextlib.contextmanager
def whole_message():
    """Hold an interrupt (SIGINT on the main thread) until the message being read or written is whole.

    An interrupt between a message's length and its bytes would leave the
    stream out of step: the next read would take data for a length and wait
    forever.  The interrupt is raised as usual once the message is through.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    # _signal: the same calls as signal.signal without its enum conversions, which cost more than the message
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, held[0])
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)  # as it would have been

