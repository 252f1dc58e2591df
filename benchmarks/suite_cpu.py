"""Where a command's CPU goes, by kind of process: run the test suite (or anything) and read every process's CPU time
from /proc while it runs (a benchmark tool, not a test).

    .venv/bin/python benchmarks/suite_cpu.py [--every 0.3] [--raw FILE] -- python -m pytest

Every ``--every`` seconds each process's user and system time is read from ``/proc/PID/stat``; a process is counted
from its last reading (one that lives less than ``--every`` may be missed, and its last ``--every`` seconds are), and
one that was running before the command from what it spent since.  A process is named by its command line the first
time it is seen: a rank forked from the rank template can be seen as the template just before it takes its own title
(counted under "template (seen before its fork took a title)" where its parent is a template).  Prints a Markdown
table: CPU-seconds, processes, kind; and the machine's busy CPU-seconds over the same time (``/proc/stat``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, what its command line holds), the first that matches
    ("rank template", ("ddp_notebook.rank.template",)),
    ("rank", ("ddp_notebook.rank.worker", "ddp_notebook.worker")),
    ("kernel", ("ipykernel_launcher",)),
    ("pytest-xdist worker", ("exec(eval(sys.stdin.readline()))",)),
    ("pytest", ("-m pytest", "bin/pytest")),
    ("torchrun", ("torch.distributed.run", "bin/torchrun")),
    ("submitit task", ("submitit.core._submit",)),
    ("chromium", ("chromium", "chrome")),
    ("jupyter server", ("jupyter", "-m notebook", "jupyterlab")),
    ("slurm and munge", ("slurm", "munge")),
    ("busy loop (a test's load)", ("while True: pass",)),
    ("playwright", ("playwright",)),
)


def _busy_seconds() -> float:
    with open("/proc/stat") as handle:
        fields = [int(f) for f in handle.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


def _kind(command: str, name: str) -> str:
    for kind, marks in KINDS:
        if any(mark in command for mark in marks):
            return kind
    if name.startswith(("kworker", "kdamond", "ksoftirq", "rcu_", "migration", "kcompact", "khugepage")):
        return "the OS kernel's threads"
    return "other python" if "python" in command.split(" ", 1)[0] else f"other ({name})"


class Sampler:
    """Reads every process's CPU time every ``every`` seconds until :meth:`stop`."""

    def __init__(self, every: float):
        self.every = every
        self.seen: dict[tuple[int, int], dict] = {}
        self._stopping = threading.Event()
        self._first = True
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._read()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._read()
            self._first = False
            self._stopping.wait(self.every)

    def _read(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    stat = handle.read()
                fields = stat[stat.rindex(")") + 2:].split()
                ticks, key = int(fields[11]) + int(fields[12]), (int(pid), int(fields[19]))
                if key in self.seen:
                    self.seen[key]["ticks"] = ticks
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
                self.seen[key] = {"pid": int(pid), "ppid": int(fields[1]), "name": stat[stat.index("(") + 1:stat.rindex(")")],
                                  "command": command[:300], "before": ticks if self._first else 0, "ticks": ticks}
            except (OSError, ValueError, IndexError):
                pass  # (it ended meanwhile)

    def by_kind(self) -> list[tuple[float, int, str]]:
        kinds = {key: _kind(p["command"], p["name"]) for key, p in self.seen.items()}
        by_pid = {key[0]: kind for key, kind in kinds.items()}
        seconds: dict[str, float] = collections.Counter()
        count: dict[str, int] = collections.Counter()
        for key, process in self.seen.items():
            kind = kinds[key]
            if kind == "rank template" and by_pid.get(process["ppid"]) == "rank template":
                kind = "rank template (seen before its fork took a title)"
            seconds[kind] += (process["ticks"] - process["before"]) / TICKS
            count[kind] += 1
        return sorted(((s, count[k], k) for k, s in seconds.items()), reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=0.3, help="seconds between readings")
    parser.add_argument("--raw", help="write every process seen, one JSON line each, to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = Sampler(args.every)
    busy, started = _busy_seconds(), time.monotonic()
    sampler.start()
    code = subprocess.call(command)
    sampler.stop()
    busy, wall = _busy_seconds() - busy, time.monotonic() - started
    rows = sampler.by_kind()
    print(f"\n`{' '.join(command)}`: exit status {code}, {wall:.0f} s; the machine busy {busy:,.0f} CPU-s "
          f"({busy / wall / os.cpu_count():.0%} of {os.cpu_count()} CPUs); the processes read: "
          f"{sum(s for s, _, _ in rows):,.0f} CPU-s\n")
    print("| CPU-s | processes | kind |\n|---|---|---|")
    for seconds, count, kind in rows:
        if seconds >= 0.5:
            print(f"| {seconds:,.1f} | {count} | {kind} |")
    if args.raw:
        with open(args.raw, "w") as handle:
            for process in sampler.seen.values():
                handle.write(json.dumps(process) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
