"""Values a rank can have no copy of (an open file, a socket, a process, a database connection) and values that cannot
be pickled (a lock) are refused before any rank starts, named where they sit: ``holder['lock']``, ``ds.f``,
``args[0].f``.  The kernel test runs in a real Jupyter kernel."""
import keyword
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

import ddp_notebook
from ddp_notebook import LaunchError
from ddp_notebook.engine import pool
from ddp_notebook.engine.local import LocalRanks
from ddp_notebook.notebook import cell_reading
from ddp_notebook.wire import payload
from nbrun import error, run_cells, text

pytestmark = pytest.mark.timeout(240)


class Holder:
    """An object holding what it is given as attributes."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


class FileDataset:
    """A Dataset that opens its file when made: the file object would travel with it."""

    def __init__(self, path):
        self.path = path
        self.f = open(path, "rb")


def refusal(names: dict) -> str:
    with pytest.raises(LaunchError) as refused:
        payload.dumps(payload.CellTask("pass", "<cell>", 1, names, [], payload.Sources()))
    return str(refused.value)


@pytest.fixture
def no_rank_starts(monkeypatch, no_leftovers):
    monkeypatch.setattr(LocalRanks, "start", lambda self, *args, **kwargs: pytest.fail("a rank was started"))


def test_an_open_file_is_refused_by_name_and_left_unread(tmp_path):
    path = tmp_path / "run.log"
    path.write_text("earlier runs\n")
    with open(path, "a+") as log:
        message = refusal({"log": log})
        assert message == (
            f"cannot send 'log' (open file '{path}') to the ranks: a file the notebook opened is its own: a rank "
            f"would get a copy of its contents, and its writes would reach no file.\n"
            f"Open it inside the cell (or the function) instead, so each rank opens its own. No rank was started.")
        # The warm pool's fingerprint fails too (the name is shipped, and refused there), without reading the file.
        assert pool.fingerprint(log) is None and pool.fingerprint({"log": log}) is None
        assert log.tell() == len("earlier runs\n")
    assert path.read_text() == "earlier runs\n"


def test_a_closed_file_is_refused_too(tmp_path):
    with open(tmp_path / "run.log", "w") as log:
        pass
    assert refusal({"log": log}).startswith(f"cannot send 'log' (closed file '{log.name}') to the ranks: a closed "
                                            f"file is of no use to a rank.\nOpen it inside the cell")


def test_standard_streams_become_the_ranks_own():
    data = payload.dumps(payload.CellTask("pass", "<cell>", 1, {"out": sys.__stdout__, "err": sys.__stderr__}, [],
                                          payload.Sources()))
    names = payload.loads(data).names
    assert names["out"] is sys.stdout and names["err"] is sys.stderr


def test_a_lock_in_a_dict_is_named_by_its_key():
    message = refusal({"steps": 3, "holder": {"count": 1, "lock": threading.Lock()}})
    assert message.startswith("cannot send holder['lock'] (lock) to the ranks: TypeError: cannot pickle "
                              "'_thread.lock' object\nCreate it inside the cell")


def test_a_culprit_is_named_through_lists_objects_modules_and_functions(tmp_path):
    torch = pytest.importorskip("torch")
    log = open(tmp_path / "run.log", "a+")
    model = torch.nn.Sequential(OrderedDict(body=torch.nn.Linear(2, 2), head=torch.nn.Linear(2, 2)))
    model.head.log = log  # (kept in model._modules['head'].__dict__)

    def train():
        log.write("epoch\n")

    try:
        assert refusal({"items": [1, "two", threading.Lock()]}).startswith("cannot send items[2] (lock)")
        assert refusal({"model": model}).startswith("cannot send model.head.log (open file")
        assert refusal({"train": train}).startswith("cannot send train.__closure__[0].cell_contents (open file")
        assert refusal({"ds": FileDataset(tmp_path / "run.log")}).startswith("cannot send ds.f (open file")
    finally:
        log.close()


def test_sockets_processes_and_database_connections_are_refused_by_what_they_are():
    sock = socket.socket()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    connection = sqlite3.connect(":memory:")
    try:
        assert refusal({"sock": sock}) == (
            "cannot send 'sock' (socket) to the ranks: a socket is the notebook process's own: a rank cannot use it.\n"
            "Open it inside the cell (or the function) instead, so each rank opens its own. No rank was started.")
        # (a Popen fails to pickle on its lock: the process is named, not the lock)
        assert refusal({"jobs": {"server": proc}}) == (
            f"cannot send jobs['server'] (process {proc.pid}) to the ranks: a process the notebook started is the "
            f"notebook's child: a rank can neither wait for it nor stop it.\n"
            f"Start it inside the cell (or the function) instead, so each rank starts its own. No rank was started.")
        assert refusal({"db": Holder(connection=connection)}).startswith(
            "cannot send db.connection (sqlite3 connection) to the ranks: a sqlite3 connection is the notebook "
            "process's own")
        assert refusal({"cursor": connection.cursor()}).startswith("cannot send 'cursor' (sqlite3 cursor)")
    finally:
        sock.close()
        connection.close()


def test_launch_names_the_argument_and_starts_no_rank(tmp_path, no_rank_starts):
    (tmp_path / "data.bin").write_bytes(bytes(1 << 20))
    ds = FileDataset(tmp_path / "data.bin")
    connection = sqlite3.connect(":memory:")
    lock = threading.Lock()
    try:
        with pytest.raises(LaunchError, match=r"^cannot send args\[0\]\.f \(open file '.*data\.bin'\) to the ranks"):
            ddp_notebook.launch(len, (ds,), cpus=2)
        with pytest.raises(LaunchError, match=r"^cannot send kwargs\['db'\] \(sqlite3 connection\) to the ranks"):
            ddp_notebook.launch(print, kwargs={"db": connection}, cpus=2)

        def train():
            with lock:
                pass

        with pytest.raises(LaunchError, match=r"^cannot send train\.__closure__\[0\]\.cell_contents \(lock\)"):
            ddp_notebook.launch(train, cpus=2)
        assert ds.f.tell() == 0  # never read
    finally:
        ds.f.close()
        connection.close()


@pytest.mark.parametrize("cell, shipped", [
    ("with open(f'rank{rank}.log', 'a') as log:\n    log.write('x')", set()),  # the cell's own file, as advised
    ("log = open('run.log')\nprint(log.read())", set()),
    ("import os as log\nlog.getpid()", set()),
    ("log.write('x')\nlog = None", {"log"}),  # read first
    ("log = log\n", {"log"}),
    ("if rank == 0:\n    log = open('run.log')\nlog.write('x')", {"log"}),  # not surely bound
    ("with contextlib.suppress(OSError):\n    log = open('run.log')\nlog.write('x')", {"log", "contextlib"}),
    ("def write():\n    log.write('x')\nlog = open('run.log')\nwrite()", {"log"}),  # the function may run first
    ("log.mode = 'a'\nlog = open('run.log')", {"log"}),
])
def test_a_name_the_cell_binds_before_reading_it_is_not_sent(cell, shipped):
    import contextlib

    with open(os.devnull, "a+") as log:
        assert set(cell_reading.select_names(cell, {"log": log, "contextlib": contextlib})[0]) == shipped


IDENTIFIERS = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(lambda name: not keyword.iskeyword(name))
# One step from a container to what it holds: (kind, key or index or attribute, how many other items it holds)
STEPS = st.one_of(
    st.tuples(st.just("dict"), st.one_of(st.text(max_size=4), st.integers(-3, 3)), st.integers(0, 3)),
    st.tuples(st.just("list"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("tuple"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("attribute"), IDENTIFIERS, st.integers(0, 3)),
)


def wrapped(value, step):
    """``value`` inside a container with other (picklable) items, and the step that reaches it there."""
    kind, where, others = step
    if kind == "dict":
        container = {f"other{i}": [i] for i in range(others)}
        container[where] = value
        return container, f"[{where!r}]"
    if kind == "attribute":
        holder = Holder(**{f"other{i}": [i] for i in range(others)})
        setattr(holder, where, value)
        return holder, f".{where}"
    items = [f"before{i}" for i in range(where)] + [value] + [{"after": i} for i in range(others)]
    return (items if kind == "list" else tuple(items)), f"[{where}]"


@settings(max_examples=60, deadline=None)
@given(st.lists(STEPS, max_size=6))
def test_the_named_path_is_exactly_where_the_file_sits(steps):
    with open(os.devnull, "a+") as log:
        value, path = log, ""
        for step in steps:
            value, step_path = wrapped(value, step)
            path = step_path + path
        message = refusal({"root": value})
        subject = f"root{path}" if path else "'root'"
        assert message.startswith(f"cannot send {subject} (open file '{os.devnull}') to the ranks"), message
        assert eval(f"root{path}", {"root": value}) is log


@pytest.mark.slow
@pytest.mark.kernel
def test_a_cell_reading_an_open_file_is_refused_fresh_and_on_a_warm_pool(tmp_path, no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "import threading\nlog = open('run.log', 'a+')\nholder = {'lock': threading.Lock()}\n"
        "class Dataset:\n    def __init__(self, path):\n        self.f = open(path)\nds = Dataset('run.log')",
        "%%ddp --cpus 2\nlog.write('from a rank\\n')",
        "%%ddp --cpus 2\nprint(ds.f.read())",
        "%%ddp --cpus 2\nwith holder['lock']:\n    pass",
        "import ddp_notebook\nprint('jobs started:', ddp_notebook.last_job())",
        "%%ddp --cpus 2\nwith open(f'rank{rank}.log', 'a') as log:  # the cell's own\n    print(log.write('x'))",
        "%ddp_start --cpus 2",
        "%%ddp\nlog.write('from a rank\\n')",
        "%%ddp\nprint('on the pool', rank)",
        "%ddp_stop",
        "log.close()\nprint(repr(open('run.log').read()))",
    ], cwd=str(tmp_path), timeout=180)
    c = nb.cells
    for refused, subject in (c[2], "'log'"), (c[3], "ds.f"), (c[8], "'log'"):
        shown = text(refused)
        assert f"UsageError: cannot send {subject} (open file 'run.log') to the ranks" in shown, shown
        assert "Open it inside the cell (or the function) instead" in shown and "[rank" not in shown, shown
    assert "UsageError: cannot send holder['lock'] (lock) to the ranks" in text(c[4])
    assert text(c[5]) == "jobs started: None\n"  # nothing was started for any refused cell
    assert error(c[6]) is None and "[rank 0] 1" in text(c[6]) and "[rank 1] 1" in text(c[6])
    assert (tmp_path / "rank0.log").read_text() == (tmp_path / "rank1.log").read_text() == "x"
    assert error(c[9]) is None and "[rank 0] on the pool 0" in text(c[9])  # the pool goes on
    assert text(c[11]) == "''\n"  # no rank wrote to the notebook's file
