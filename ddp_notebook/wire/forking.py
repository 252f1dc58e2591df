"""What the notebook and its rank template say to each other over their socket pair.

A message is a length-prefixed JSON object; file descriptors (a rank's pipes,
its lifeline, the TCPStore's socket) travel with it as ``SCM_RIGHTS``, named
in the message's ``"fds"`` list in the order they were sent.
"""
from __future__ import annotations

import json
import socket
import struct

_HEADER = struct.Struct("!I")
MAX_FDS = 8
READY = "ready"  # the template has imported what every rank needs: {"pid", "environment_read": [the variables
#                  Python code looked up in os.environ as it imported], "environment_set_where_unset": {variable:
#                  the value Python code set it to where it was unset}}
FORK = "fork"  # start one rank: {"boot", "env", "cwd", "fds"}
FORKED = "forked"  # {"pid"} or {"error"}
HOLD = "hold"  # a job's ranks are coming: import nothing more until GO_ON
GO_ON = "go_on"
PRELOAD = "preload"  # import these libraries, one at a time between requests: {"modules": [[library, [its
#                      modules], the file the notebook imported it from (or None below a module imported)], ...],
#                      "sys_path"}
PRELOADED = "preloaded"  # one library done: {"module", "file", "skipped": [modules]}, or {"module", "error"} (not
#                          imported, or imported and the template tainted: {"tainted": True}; it forks no more);
#                          with "environment_read" and "environment_set_where_unset" as READY's either way
STOP = "stop"
# A rank sets these up itself, from its own environment (matplotlib reads MPLBACKEND at import): the template never
# preloads them, and a library that imports them is left to the ranks.
RANK_OWN_MODULES = ("IPython", "ipykernel", "ipywidgets", "matplotlib")


def send(sock: socket.socket, message: dict, fds: dict[str, int] | None = None) -> None:
    """Send ``message`` with ``fds`` (name -> descriptor) attached."""
    fds = fds or {}
    body = json.dumps({**message, "fds": list(fds)}).encode()
    socket.send_fds(sock, [_HEADER.pack(len(body))], list(fds.values()))
    sock.sendall(body)


def receive(sock: socket.socket) -> tuple[dict, dict[str, int]] | None:
    """The next message and its descriptors (name -> descriptor, now owned by the caller); None at end of stream."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not header:
        return None
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            return None
        header += more
    (size,) = _HEADER.unpack(header)
    body = bytearray()
    while len(body) < size:
        chunk = sock.recv(min(size - len(body), 1 << 20))
        if not chunk:
            return None
        body += chunk
    message = json.loads(body)
    return message, dict(zip(message.pop("fds"), fds))
