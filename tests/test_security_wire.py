"""The channel against others: silent peers, a flood under a low descriptor limit, and a relay on the path.

A flood comes from a real second Unix user (made with ``useradd``; the tests that need one are skipped when not
root, and fail under CI=true). The relay is a loopback TCP proxy between a rank and the notebook that passes the
handshake and then alters, injects or replays frames: each is refused before anything is unpickled, which a pickle
that would create a marker file when unpickled proves.
"""
from __future__ import annotations

import json
import os
import pickle
import pwd
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest

from ddp_notebook.wire import channel
from sockets import accepted
from ddp_notebook.wire.channel import ChannelServer, FrameRefused, connect, receive_now

OTHER_USER = "ddpnb-other"
ATTACKER_PYTHON = "/usr/bin/python3"  # the other user cannot read this user's interpreter (under /root)
HANDSHAKE_FRAMES = 4  # each way: challenge, answer, welcome, nonce


@pytest.fixture(scope="module")
def other_user() -> str:
    """A second Unix user of this machine, made when missing."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the tests with a second Unix user need root (useradd, runuser); CI runs as root")
        pytest.skip("needs root: makes a second Unix user (useradd) and runs as it (runuser)")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                       check=True)
    return OTHER_USER


def _as_other(user: str, code: str) -> subprocess.Popen:
    return subprocess.Popen(["runuser", "-u", user, "--", ATTACKER_PYTHON, "-c", textwrap.dedent(code)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")




def _auth_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ddp-channel-auth"]


def _until(condition, limit=60.0):
    """Wait for ``condition()`` (a bound on a wait, not a timing requirement)."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not so after {limit:.0f} s")
        time.sleep(0.05)


# -- silent peers ---------------------------------------------------------------------------------

def test_a_silent_peer_is_let_go_at_the_handshake_deadline(monkeypatch):
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 0.5)
    server = ChannelServer()
    try:
        with socket.create_connection(server.address) as silent:
            silent.settimeout(60)
            received = b""
            while chunk := silent.recv(4096):  # the challenge, then the end: the server hangs up on it
                received += chunk
            assert b"#CHALLENGE#" in received
        _until(lambda: not _auth_threads())
        assert server.refused == 1
    finally:
        server.close()


def test_a_rank_gives_up_on_a_notebook_that_never_speaks():
    # It connects (the listener's backlog takes it), then waits for a challenge that never comes.
    with socket.create_server(("127.0.0.1", 0)) as mute:
        with pytest.raises(TimeoutError):
            connect(mute.getsockname()[:2], os.urandom(32), timeout=0.5)


def test_handshakes_in_progress_are_capped_and_a_rank_still_gets_in(monkeypatch):
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(channel, "_handshake_slots", threading.BoundedSemaphore(4))
    server = ChannelServer()
    silent = []
    try:
        for _ in range(20):
            silent.append(socket.create_connection(server.address))
        _until(lambda: server.refused >= 16)  # the ones over the cap: closed at once
        assert len(_auth_threads()) <= 4
        rank = connect(server.address, server.key, timeout=60)  # refused while the slots are held, then let in
        notebook = accepted(server)
        rank.send(("hello", {"rank": 0}))
        assert notebook.recv() == ("hello", {"rank": 0})
        rank.close()
        notebook.close()
    finally:
        for sock in silent:
            sock.close()
        server.close()
    assert not _auth_threads()


def test_the_accept_loop_waits_out_a_lack_of_descriptors(tmp_path):
    # Every descriptor of the notebook's process is taken when a rank connects: accept() fails with EMFILE. The
    # loop must wait and accept the rank once descriptors are free again (it used to end for good).
    script = textwrap.dedent("""
        import json, os, resource, subprocess, sys, time
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from ddp_notebook.wire.channel import ChannelServer
        server = ChannelServer()
        rank = subprocess.Popen([sys.executable, "-c", '''
        import sys
        from ddp_notebook.wire.channel import connect
        address, key = sys.stdin.readline().split()
        host, port = address.split(":")
        conn = connect((host, int(port)), bytes.fromhex(key), timeout=60)
        conn.send(("hello", {"rank": 0}))
        conn.recv()
        '''], stdin=subprocess.PIPE, text=True)
        fillers = []
        try:
            while True:
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        rank.stdin.write(f"{server.address[0]}:{server.address[1]} {server.key.hex()}\\n")
        rank.stdin.flush()
        time.sleep(1.0)  # the rank waits in the backlog; accept() fails meanwhile
        for fd in fillers:
            os.close(fd)
        deadline = time.monotonic() + 60
        conns = []
        while not conns and time.monotonic() < deadline:
            conns = server.new_connections()
            time.sleep(0.01)
        message = conns[0].recv() if conns else None
        if conns:
            conns[0].send(("exit", {}))
        print(json.dumps({"message": message, "filled": len(fillers), "rank": rank.wait(60)}))
        server.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": _package_root()})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["filled"] > 0
    assert result["message"] == ["hello", {"rank": 0}] and result["rank"] == 0


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(channel.__file__)))


# -- a flood from another user, under a low descriptor limit ---------------------------------------

_NOTEBOOK = """
import json, os, resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import psutil
import ddp_notebook
from ddp_notebook.wire import channel
channel.HANDSHAKE_TIMEOUT_S = 2.0
folder = sys.argv[1]

def wait_for_go(folder):
    import os, time, torch.distributed as dist
    open(os.path.join(folder, f"started{dist.get_rank()}"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    return "ran through"

def say(**what):
    print(json.dumps(what), flush=True)

ddp_notebook.launch(lambda: 0, cpus=2)  # warm-up: what the first job starts once (the rank template)
me = psutil.Process()
fds, threads = me.num_fds(), threading.active_count()
running = ddp_notebook.launch(wait_for_go, args=(folder,), cpus=2, background=True)
while not all(os.path.exists(os.path.join(folder, f"started{r}")) for r in range(2)):
    time.sleep(0.05)
say(port=running.group.channel.address[1], cap=channel.MAX_HANDSHAKES)
sys.stdin.readline()  # the flood holds its connections from here on
new = ddp_notebook.launch(lambda: 2, cpus=2)
deadline = time.monotonic() + 60
while any(t.name == "ddp-channel-auth" for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.05)
drained = not any(t.name == "ddp-channel-auth" for t in threading.enumerate())
open(os.path.join(folder, "go"), "w").close()
result = running.wait()
deadline = time.monotonic() + 60
while (me.num_fds() > fds or threading.active_count() > threads) and time.monotonic() < deadline:
    time.sleep(0.05)
say(new=new, running=result, drained=drained, fds=[fds, me.num_fds()], threads=[threads, threading.active_count()])
"""

_FLOOD = """
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (2048, max(2048, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
port = int(sys.stdin.readline())
held = []
for _ in range(600):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.readline()
"""


def test_a_flood_of_silent_connections_from_another_user_stops_no_job(other_user, tmp_path):
    folder = tmp_path / "flood"
    folder.mkdir()
    notebook = subprocess.Popen([sys.executable, "-c", _NOTEBOOK, str(folder)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": _package_root()})
    flood = None
    try:
        started = json.loads(notebook.stdout.readline())
        assert started["cap"] == 256 // 16
        flood = _as_other(other_user, _FLOOD)
        flood.stdin.write(f"{started['port']}\n")
        flood.stdin.flush()
        assert int(flood.stdout.readline()) > 500  # connected: the kernel's backlog takes them before accept()
        notebook.stdin.write("flooding\n")
        notebook.stdin.flush()
        ended = json.loads(notebook.stdout.readline())
        assert ended["new"] == [2, 2] and ended["running"] == ["ran through", "ran through"]
        assert ended["drained"]  # the silent peers were let go at the deadline, the flood still holding them
        assert ended["fds"][1] <= ended["fds"][0] and ended["threads"][1] <= ended["threads"][0]
        assert notebook.wait(60) == 0
    finally:
        if flood is not None:
            flood.stdin.close()
            flood.wait(60)
        if notebook.poll() is None:
            notebook.kill()
            notebook.wait()


# -- a relay on the path --------------------------------------------------------------------------

class _Touch:
    """Unpickling this creates ``path``: the proof that something was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class Relay:
    """A TCP proxy on loopback that passes the handshake untouched and then does ``attack`` to the frames one way.

    ``attack(index, frame)`` gets each frame after the handshake (its length header included) and returns the
    bytes to pass on instead.
    """

    def __init__(self, target, direction: str, attack):
        self.target, self.direction, self.attack = target, direction, attack
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self):
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        for source, sink, way in ((client, upstream, "to notebook"), (upstream, client, "to rank")):
            thread = threading.Thread(target=self._pipe, args=(source, sink, way == self.direction), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _pipe(self, source, sink, attacked):
        index = -HANDSHAKE_FRAMES
        try:
            while True:
                header = _read_exact(source, 8)
                frame = header + _read_exact(source, struct.unpack("!Q", header)[0])
                sink.sendall(self.attack(index, frame) if attacked and index >= 0 else frame)
                index += 1
        except (OSError, EOFError):
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def _read_exact(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _frame(payload: bytes, mac: bytes = b"") -> bytes:
    return struct.pack("!Q", len(payload) + len(mac)) + payload + mac


def _attacks(marker):
    evil = pickle.dumps(_Touch(marker))
    replayed = {}

    def flip(index, frame):
        if index != 1:
            return frame
        altered = bytearray(frame)
        altered[12] ^= 0x01
        return bytes(altered)

    def substitute(index, frame):  # the body swapped for the marker's pickle, the MAC kept
        return _frame(evil, frame[-32:]) if index == 1 else frame

    def inject(index, frame):  # a whole frame of the attacker's before the real one
        return _frame(evil, os.urandom(32)) + frame if index == 1 else frame

    def inject_unsigned(index, frame):  # as frames were before they were signed
        return _frame(evil) + frame if index == 1 else frame

    def replay(index, frame):
        replayed.setdefault("first", frame)
        return replayed["first"] if index == 1 else frame

    return {"flip": flip, "substitute": substitute, "inject": inject, "inject_unsigned": inject_unsigned,
            "replay": replay}


@pytest.mark.parametrize("direction", ["to notebook", "to rank"])
@pytest.mark.parametrize("attack", ["flip", "substitute", "inject", "inject_unsigned", "replay"])
def test_a_relay_that_alters_or_injects_after_the_handshake_is_refused_before_unpickling(tmp_path, direction,
                                                                                         attack):
    marker = tmp_path / "unpickled"
    server = ChannelServer()
    relay = Relay(server.address, direction, _attacks(marker)[attack])
    try:
        rank = connect(relay.address, server.key, timeout=30)
        notebook = accepted(server)
        sender, receiver = (rank, notebook) if direction == "to notebook" else (notebook, rank)
        sender.send(("metric", {"loss": 0.5}))
        assert receiver.recv() == ("metric", {"loss": 0.5})  # untouched: passes
        sender.send(("result", {"task": 1, "value": b"x" * 100}))
        if direction == "to notebook":  # read as the job's pump reads: the fast way when the frame is whole
            _until(lambda: channel.readable(receiver))
            with pytest.raises(FrameRefused):
                whole, _ = receive_now(receiver)
                if not whole:
                    receiver.recv()
        else:
            with pytest.raises(FrameRefused):
                receiver.recv()
        with pytest.raises(FrameRefused):  # and for good: the stream is out of step
            receiver.recv()
        assert not marker.exists()
        rank.close()
        notebook.close()
    finally:
        relay.close()
        server.close()
    assert not marker.exists()


def _announcing(length):
    """An attack that gives the second frame after the handshake a forged length (its bytes follow as they were)."""
    def announce(index, frame):
        return struct.pack("!Q", length) + frame[8:] if index == 1 else frame
    return announce


@pytest.mark.parametrize("direction", ["to notebook", "to rank"])
def test_a_forged_length_allocates_only_what_has_arrived(direction):
    # A relay announces a 1 GiB frame and sends a few hundred bytes of it: the reader's buffer grows with what
    # arrives (channel._READ_STEP beyond it at most), never to what was announced.
    server = ChannelServer()
    relay = Relay(server.address, direction, _announcing(1 << 30))
    tracemalloc.start()
    try:
        rank = connect(relay.address, server.key, timeout=30)
        notebook = accepted(server)
        sender, receiver = (rank, notebook) if direction == "to notebook" else (notebook, rank)
        sender.send(("metric", {"loss": 0.5}))
        assert receiver.recv() == ("metric", {"loss": 0.5})
        sender.send(("result", {"task": 1, "value": b"x" * 100}))
        _until(lambda: channel.readable(receiver))
        sender.close()  # the frame never comes whole
        tracemalloc.reset_peak()
        with pytest.raises(EOFError):
            receiver.recv()
        assert tracemalloc.get_traced_memory()[1] < 2 * channel._READ_STEP
        receiver.close()
    finally:
        tracemalloc.stop()
        relay.close()
        server.close()


@pytest.mark.parametrize("direction", ["to notebook", "to rank"])
def test_a_length_beyond_the_machines_memory_is_refused_unread(tmp_path, direction):
    marker = tmp_path / "unpickled"
    server = ChannelServer()
    relay = Relay(server.address, direction, _announcing(1 << 62))
    tracemalloc.start()
    try:
        rank = connect(relay.address, server.key, timeout=30)
        notebook = accepted(server)
        sender, receiver = (rank, notebook) if direction == "to notebook" else (notebook, rank)
        sender.send(("metric", {"loss": 0.5}))
        assert receiver.recv() == ("metric", {"loss": 0.5})
        sender.send(_Touch(marker))
        _until(lambda: channel.readable(receiver))
        tracemalloc.reset_peak()
        with pytest.raises(FrameRefused, match=f"a message of {1 << 62} bytes, more than this machine's memory"):
            receiver.recv()
        assert tracemalloc.get_traced_memory()[1] < channel._READ_STEP
        with pytest.raises(FrameRefused):  # for good
            receiver.recv()
        rank.close()
        notebook.close()
    finally:
        tracemalloc.stop()
        relay.close()
        server.close()
    assert not marker.exists()


# -- the store ------------------------------------------------------------------------------------

def _hold_until(folder):
    import os
    import time

    import torch.distributed as dist

    open(os.path.join(folder, f"started{dist.get_rank()}"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    dist.barrier()  # the group still works through its store
    return int(os.environ["MASTER_PORT"])


_PROBE = """
import json, socket, sys
store, port = sys.argv[1], int(sys.argv[2])
found = {}
try:
    open(store, "rb").close()
    found["store"] = "read"
except OSError as exc:
    found["store"] = type(exc).__name__
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    found["port"] = "connected"
except OSError as exc:
    found["port"] = type(exc).__name__
print(json.dumps(found))
"""


def test_a_single_host_jobs_store_is_out_of_other_users_reach(other_user, tmp_path):
    import ddp_notebook

    job = ddp_notebook.launch(_hold_until, args=(str(tmp_path),), cpus=2, background=True)
    try:
        _until(lambda: all((tmp_path / f"started{r}").exists() for r in range(2)))
        store = os.path.join(job.group.workdir, "store")
        assert os.path.exists(store) and os.stat(job.group.workdir).st_mode & 0o777 == 0o700
        probe = subprocess.run(["runuser", "-u", other_user, "--", ATTACKER_PYTHON, "-c", _PROBE, store,
                                str(job.group.port)], capture_output=True, text=True, timeout=60, cwd="/")
        assert json.loads(probe.stdout) == {"store": "PermissionError", "port": "ConnectionRefusedError"}
    finally:
        (tmp_path / "go").touch()
        ports = job.wait()
    assert ports[0] == ports[1] == job.port


_SQUAT = """
import errno, socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    sock.bind(("127.0.0.1", int(sys.argv[1])))
    sock.listen(16)
    print("took it", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
sys.stdin.readline()  # held until the test ends
"""


def _sum_over_hosts():
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return dist.get_world_size(), total.item()


def test_a_multi_host_jobs_port_is_never_free_for_another_user(other_user, tmp_path, monkeypatch, no_leftovers):
    # node 0's port is checked when the job is planned and bound by torchrun's agent seconds later: another user
    # tries to take it in between (as the job starts), and must find it bound the whole time.
    import ddp_notebook
    from ddp_notebook.engine import job as jobs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script, elsewhere = tmp_path / "export" / "job.py", tmp_path / "elsewhere"
    elsewhere.mkdir()
    squatters = []

    def squat(job):
        squatter = _as_other(other_user, _SQUAT.replace("sys.argv[1]", str(port)))
        squatters.append((squatter, squatter.stdout.readline().strip()))

    monkeypatch.setattr(jobs, "_job_observers", [])
    jobs.observe_jobs(squat)
    with open(tmp_path / "node1.log", "w+") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                                  "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  str(script)], cwd=elsewhere, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            results = ddp_notebook.launch(_sum_over_hosts, cpus=1, nnodes=2, master_addr="127.0.0.1", port=port,
                                          export=str(script))
            assert node1.wait(60) == 0
        finally:
            if node1.poll() is None:
                os.killpg(node1.pid, 9)
                node1.wait()
            for squatter, _ in squatters:
                squatter.stdin.close()
                squatter.wait(60)
            log.seek(0)
            node1_output = log.read()
    assert [said for _, said in squatters] == ["EADDRINUSE"], node1_output
    assert results == [(2, 2.0), (2, 2.0)]
    with socket.socket() as after:  # and nothing of the job listens there any more
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))
        after.listen()
