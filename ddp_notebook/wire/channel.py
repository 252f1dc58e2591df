"""Authenticated message channel between the notebook and its ranks.

The notebook side listens on a TCP port with a random per-job key; each rank
connects with that key (the two-way HMAC challenge of ``multiprocessing.connection``),
so a process without the key is refused before it can send anything.  The
handshake ends with a nonce from each side, and each direction of the connection
gets its own key from the job key and both nonces; from then on every frame
carries an HMAC-SHA256 of its sequence number and its bytes, checked before
anything is unpickled (:class:`FrameRefused` otherwise); a frame's buffer grows with the
bytes that arrive, never to a length only announced.  Someone on the path
who relays the handshake can still cut the connection, but cannot alter, replay,
reorder or inject a message.  Messages are ``(kind, body)`` tuples.  The channel
knows nothing of what the messages mean.

A peer that connects and says nothing is let go after :data:`HANDSHAKE_TIMEOUT_S`;
at most :data:`MAX_HANDSHAKES` handshakes run at once (more are closed at once,
and a rank retries); the accept loop waits out a lack of descriptors.
"""
from __future__ import annotations

import _signal
import contextlib
import ctypes
import errno
import hmac
import os
import queue
import resource
import secrets
import select
import signal
import socket
import struct
import sys
import termios
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["ChannelServer", "connect", "Connection", "FrameRefused", "Sender", "whole_message"]

HANDSHAKE_TIMEOUT_S = 10.0  # a peer that has not proven the key by then is let go (a rank answers in milliseconds)
# Handshakes in progress at once in this process, every server together: a sixteenth of its descriptors at most, so
# that silent peers can never take what a new job needs; a connection beyond them is closed (the rank tries again).
MAX_HANDSHAKES = min(64, max(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 16))
_handshake_slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
CONNECT_TIMEOUT_S = 120.0  # a rank's connect and handshake, retries included, when no timeout is given
_RETRY_FIRST_S, _RETRY_MAX_S = 0.02, 1.0  # a rank's wait before it connects again to a notebook busy handshaking
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_HEADER = struct.Struct("!Q")  # a frame: its length, then its bytes (and, after the handshake, their MAC)
_SEQUENCE = struct.Struct("!Q")
_MAC_SIZE = 32  # HMAC-SHA256
_SEND_WITHOUT_SWITCH_MAX = 16384  # a frame whose bytes are at most this goes out in one write (a copy costs less)
_NONCE_SIZE = 32
# A frame's buffer grows with what has arrived, at most this beyond it: a length no one has sent the bytes of (a
# relay's forgery) makes no one allocate it. A frame longer than this machine's memory is refused at once.
_READ_STEP = 16 << 20
_MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class FrameRefused(ConnectionError):
    """A frame after the handshake failed its check (altered, replayed, reordered or injected on the way): the
    connection can no longer be trusted and is to be closed.  An ``OSError``, so that every reader takes it as the
    connection's end."""


class Connection:
    """One end of a channel connection: ``send``/``recv`` of picklable objects, ``send_bytes``/``recv_bytes``,
    ``poll``, ``fileno`` and ``close``, as ``multiprocessing.connection.Connection`` has them.

    Until :meth:`_secure` (the end of the handshake) frames are plain; from then on each carries the MAC of its
    sequence number and bytes under the key of its direction, and a frame is handed on (or unpickled) only once
    its MAC is right.  One thread sends at a time (a lock); one thread reads at a time (the callers' part).
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._fd = sock.fileno()
        self._send_lock = threading.Lock()
        self._deadline: float | None = None  # during the handshake
        self._send_key = self._recv_key = b""  # set by _secure
        self._sent = self._received = 0
        self._refused: FrameRefused | None = None

    # -- the handshake ---------------------------------------------------------------------------
    def _shake_hands(self, key: bytes, server: bool, deadline: float) -> None:
        """Both sides prove the key (the server asks first), then :meth:`_secure`; all of it by ``deadline``."""
        self._deadline = deadline
        try:
            if server:
                deliver_challenge(self, key)
                answer_challenge(self, key)
            else:
                answer_challenge(self, key)
                deliver_challenge(self, key)
            self._secure(key, server)
        except AssertionError:  # (answer_challenge's check that a challenge came)
            raise AuthenticationError("the peer does not speak this channel's handshake") from None
        self._deadline = None
        self._sock.settimeout(None)

    def _secure(self, key: bytes, server: bool) -> None:
        """Both sides have proven the key: exchange nonces and derive this connection's keys from them."""
        mine = secrets.token_bytes(_NONCE_SIZE)
        self.send_bytes(mine)
        theirs = self.recv_bytes(_NONCE_SIZE)
        if len(theirs) != _NONCE_SIZE:
            raise AuthenticationError("the peer's nonce has the wrong length")
        nonces = mine + theirs if server else theirs + mine  # the server's first
        to_client = hmac.digest(key, b"ddp_notebook channel, server to client:" + nonces, "sha256")
        to_server = hmac.digest(key, b"ddp_notebook channel, client to server:" + nonces, "sha256")
        self._send_key, self._recv_key = (to_client, to_server) if server else (to_server, to_client)

    def _frame(self, data) -> list:
        """``data`` as it goes on the wire (its length, its bytes, after the handshake their MAC), its sequence
        number used (under the send lock): one piece when it is small, else three (no copy of the bytes)."""
        if not self._send_key:
            return [_HEADER.pack(len(data)) + data]
        mac = _mac(self._send_key, self._sent, data)
        self._sent += 1
        header = _HEADER.pack(len(data) + _MAC_SIZE)
        return [header + data + mac] if len(data) <= _SEND_WITHOUT_SWITCH_MAX else [header, data, mac]

    def _open(self, frame: memoryview) -> memoryview:
        """A frame's bytes once its MAC is right (its length read already); raises :class:`FrameRefused`."""
        if not self._recv_key:
            return frame
        if self._refused is None and len(frame) >= _MAC_SIZE:
            data, mac = frame[:-_MAC_SIZE], frame[-_MAC_SIZE:]
            if hmac.compare_digest(_mac(self._recv_key, self._received, data), mac):
                self._received += 1
                return data
        if self._refused is None:  # the stream is out of step for good: every later read fails too
            self._refused = FrameRefused(f"message {self._received} from the other end failed its authentication "
                                         f"check (altered or injected on the way); nothing of it was read")
        raise self._refused

    # -- sending ---------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        self.send_bytes(ForkingPickler.dumps(obj))

    def send_bytes(self, data) -> None:
        with self._send_lock:
            for piece in self._frame(data):
                self._before_io()
                self._sock.sendall(piece)

    # -- receiving -------------------------------------------------------------------------------
    def recv(self) -> Any:
        return ForkingPickler.loads(self._receive())

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """The next frame's bytes, checked; ``maxlength`` refuses a longer one before reading it (the handshake:
        nobody proven yet may make this process allocate what it says)."""
        return bytes(self._receive(maxlength))

    def _receive(self, maxlength: int | None = None) -> memoryview:
        if self._refused is not None:
            raise self._refused
        header = self._read(_HEADER.size)
        size = _HEADER.unpack(header)[0]
        if maxlength is not None and size > maxlength:
            raise OSError(f"a message of {size} bytes where at most {maxlength} were expected")
        if size > _MEMORY:  # no sender of ours wrote it (it could not be held): the check would fail too
            self._refused = FrameRefused(f"a message of {size} bytes, more than this machine's memory "
                                         f"({_MEMORY} bytes), was announced; nothing of it was read")
            raise self._refused
        try:
            frame = self._read(size)
        except MemoryError:
            raise FrameRefused(f"a message of {size} bytes cannot be held; the connection is cut") from None
        return self._open(frame)

    def _read(self, size: int) -> memoryview:
        """``size`` bytes, in a buffer that grows by :data:`_READ_STEP` at most beyond what has arrived."""
        buffer = bytearray(min(size, _READ_STEP))
        got = 0
        while got < size:
            if got == len(buffer):
                buffer.extend(bytes(min(size - got, _READ_STEP)))  # (no view of it is held here)
            self._before_io()
            with memoryview(buffer) as view:
                n = self._sock.recv_into(view[got:])
            if n == 0:
                raise EOFError
            got += n
        return memoryview(buffer)

    def _before_io(self) -> None:
        if self._deadline is not None:  # the handshake's time left; past it the read or write times out
            self._sock.settimeout(max(1e-3, self._deadline - time.monotonic()))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether something can be read (or the peer has gone) within ``timeout`` seconds (None: wait)."""
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))

    # -- the descriptor --------------------------------------------------------------------------
    def fileno(self) -> int:
        if self._fd < 0:
            raise OSError("the connection is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd >= 0:
            self._fd = -1
            self._sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        self._closing = threading.Event()  # wakes the accept loop's wait for descriptors
        # A byte per connection queued: whoever waits for messages can wait on this too (``fileno()``).
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._thread = threading.Thread(target=self._accept_loop, name="ddp-channel-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        pause = _RETRY_FIRST_S
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _OUT_OF_DESCRIPTORS:  # the connection waits in the backlog: take it later
                    self._closing.wait(pause)
                    pause = min(2 * pause, _RETRY_MAX_S)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR):
                    continue  # that peer gave up already
                return  # listener shut down
            pause = _RETRY_FIRST_S
            self._start_handshake(sock)

    def _start_handshake(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # a peer gone already: its handshake fails below
            _send_at_once(sock)
        conn = Connection(sock)
        thread = threading.Thread(target=self._handshake, args=(conn,), name="ddp-channel-auth", daemon=True)
        if _handshake_slots.acquire(blocking=False):
            with self._lock:
                if not self._closed:
                    self._handshaking[conn] = thread
                    try:
                        thread.start()
                        return
                    except RuntimeError:  # no thread to be had (out of memory or descriptors)
                        del self._handshaking[conn]
            _handshake_slots.release()
        self.refused += 1
        conn.close()

    def _handshake(self, conn: Connection) -> None:
        try:
            conn._shake_hands(self.key, server=True, deadline=time.monotonic() + HANDSHAKE_TIMEOUT_S)
            ok = True
        except Exception:  # wrong key, garbage, silence past the deadline, a peer that hung up, or close()
            ok = False
        _handshake_slots.release()
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
        self._closing.set()
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


def _mac(key: bytes, sequence: int, data) -> bytes:
    """HMAC-SHA256 of a frame's sequence number and bytes (a big frame's bytes hashed where they are)."""
    if len(data) <= _SEND_WITHOUT_SWITCH_MAX:
        return hmac.digest(key, _SEQUENCE.pack(sequence) + data, "sha256")
    mac = hmac.new(key, _SEQUENCE.pack(sequence), "sha256")
    mac.update(data)
    return mac.digest()


def _send_at_once(sock: socket.socket) -> None:
    """No Nagle delay: a :class:`Connection` writes a message over 16 KiB as three writes (its length, its bytes,
    their MAC), and with Nagle's algorithm the second waits for the peer's ACK of the first, which the peer delays by up to
    40 ms."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# Calls that keep the GIL (ctypes.PyDLL): in a Jupyter kernel every system call made through Python lets the
# kernel's own threads run, which are busy at the start of each cell, and a warm cell's steps then waited for them.
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
    take at once is written the usual way.  Each connection's frame has its own MAC.
    """
    failed = []
    for conn in conns:
        try:
            with conn._send_lock:
                pieces = conn._frame(data)
                sent = 0
                if _libc is not None and len(pieces) == 1:
                    sent = _libc.send(conn.fileno(), pieces[0], len(pieces[0]), socket.MSG_DONTWAIT | _NOSIGNAL)
                    if sent < 0:
                        code = ctypes.get_errno()
                        if code not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                            raise OSError(code, os.strerror(code))
                        sent = 0
                for piece in pieces:  # what the socket did not take at once: the usual way
                    rest = memoryview(piece)[sent:]
                    sent = max(0, sent - len(piece))
                    if rest:
                        conn._sock.sendall(rest)
        except OSError:
            failed.append(conn)
    return failed


def receive_now(conn: Connection) -> tuple[bool, Any]:
    """``(True, conn.recv())`` when a whole message has arrived, read without letting another thread run; else
    ``(False, None)`` and nothing is read (receive it the usual way).  Raises :class:`FrameRefused` for a frame
    that fails its check (nothing of it unpickled)."""
    if _libc is None:
        return False, None
    fd = conn.fileno()
    waiting = ctypes.c_int()
    if _libc.ioctl(fd, termios.FIONREAD, ctypes.byref(waiting)) != 0 or waiting.value < _HEADER.size:
        return False, None
    header = ctypes.create_string_buffer(_HEADER.size)
    if _libc.recv(fd, header, _HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT) != _HEADER.size:
        return False, None
    size = _HEADER.unpack(header.raw)[0]
    if waiting.value < _HEADER.size + size:
        return False, None
    frame = ctypes.create_string_buffer(_HEADER.size + size)
    if _libc.recv(fd, frame, _HEADER.size + size, socket.MSG_DONTWAIT) != _HEADER.size + size:
        raise OSError(f"a message of {size} bytes was there, but could not be read whole")
    return True, ForkingPickler.loads(conn._open(memoryview(frame)[_HEADER.size:]))


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
    """Rank side: connect to the notebook's channel and prove the key, within ``timeout`` seconds in all
    (:data:`CONNECT_TIMEOUT_S` when None: a firewall may drop the attempt without an answer, a peer may never
    speak).  A notebook that closes the connection before the handshake ends (busy with
    :data:`MAX_HANDSHAKES` others) is tried again until then; a wrong key raises ``AuthenticationError`` at once."""
    deadline = time.monotonic() + (CONNECT_TIMEOUT_S if timeout is None else timeout)
    pause = _RETRY_FIRST_S
    while True:
        try:
            return _connect_once(address, key, deadline)
        except (EOFError, ConnectionResetError, BrokenPipeError):
            if time.monotonic() + pause >= deadline:
                raise TimeoutError(f"the notebook's channel at {address[0]}:{address[1]} kept closing the "
                                   f"connection before its handshake ended") from None
            time.sleep(pause * (0.5 + secrets.randbelow(1000) / 1000))  # (spread: many ranks may be waiting)
            pause = min(2 * pause, _RETRY_MAX_S)


def _connect_once(address: tuple[str, int], key: bytes, deadline: float) -> Connection:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # IPv4, as the notebook listens (a hostname too)
    try:
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        sock.connect(tuple(address))
        _send_at_once(sock)
    except BaseException:
        sock.close()
        raise
    conn = Connection(sock)
    try:
        conn._shake_hands(key, server=False, deadline=deadline)
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
        self.broken = False  # the connection failed: what is sent from now on is dropped
        self._lock = threading.Lock()  # one message on the wire at a time (the thread's, or send_now's)
        self._thread = threading.Thread(target=self._loop, name="ddp-channel-send", daemon=True)
        self._thread.start()

    def send(self, kind: str, body: dict | None = None) -> None:
        if not self.broken:
            self._queue.put((kind, body or {}))

    def send_now(self, kind: str, body: dict | None = None) -> None:
        """Send from the calling thread, after everything queued before: a cell's result, which its thread waits
        for anyway (no hand-over to the sending thread and back)."""
        self.flush()
        self._send((kind, body or {}))

    def _send(self, item: tuple) -> None:
        data = ForkingPickler.dumps(item)  # (before the lock: a batch of reports waits for its window as it pickles)
        with self._lock:
            if self.broken:
                return
            try:
                self._conn.send_bytes(data)
            except (OSError, EOFError, ValueError):
                self.broken = True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                try:
                    self._send(item)
                except Exception as exc:  # noqa: BLE001 - one message that cannot be pickled: the channel goes on
                    print(f"ddp_notebook: a {item[0]!r} message could not be sent to the notebook: {exc!r}",
                          file=sys.stderr)
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

