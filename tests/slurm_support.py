"""A real single-node Slurm for the tests: slurmctld, slurmd and munge from the distribution's packages.

Started when this process is root and the packages are installed (``.ci/run``
installs them), stopped afterwards by the daemons' own PIDs.  Follows
``shared/notes/slurm-local.md``.  Outside CI the Slurm tests skip with the
reason when it cannot start; under ``CI=true`` they fail.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

CONF = "/etc/slurm/slurm.conf"
PIDS = {"slurmctld": "/run/slurmctld.pid", "slurmd": "/run/slurmd.pid"}
MUNGE_PID = "/run/munge/munged.pid"


def _pid(path: str) -> int | None:
    try:
        pid = int(open(path).read().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _ready(timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc"):
            return True
        time.sleep(0.5)
    return False


def start() -> tuple[list[int], str | None]:
    """Start the daemons (if they are not running already); (the PIDs this call started, why not if it could not)."""
    missing = [name for name in ("slurmctld", "slurmd", "munged", "sbatch", "squeue") if not
               (shutil.which(name) or os.path.exists(f"/usr/sbin/{name}"))]
    if missing:
        return [], f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd " \
                   f"slurm-client munge"
    if all(_pid(p) for p in PIDS.values()) and _ready(5):
        return [], None  # already running (a developer's own): left as it is
    if os.geteuid() != 0:
        return [], "starting Slurm's daemons needs root"
    for path in ("/etc/slurm", "/var/spool/slurmctld", "/var/spool/slurmd", "/var/log/slurm", "/run/munge"):
        os.makedirs(path, exist_ok=True)
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["mungekey", "-c"], check=True, capture_output=True)
    subprocess.run("chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge", shell=True,
                   check=True)
    host = socket.gethostname()
    memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
    with open(CONF, "w") as f:
        f.write(f"""ClusterName=local
SlurmctldHost={host}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPidFile={PIDS['slurmctld']}
SlurmdPidFile={PIDS['slurmd']}
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmUser=root
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=5
KillWait=5
NodeName={host} CPUs={os.cpu_count()} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    started = []
    if not _pid(MUNGE_PID):
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)
        time.sleep(0.5)
        pid = _pid(MUNGE_PID)
        if pid:
            started.append(pid)
    subprocess.run(["/usr/sbin/slurmctld", "-L", "/var/log/slurm/ctld.log"], check=True)
    subprocess.run(["/usr/sbin/slurmd", "-L", "/var/log/slurm/d.log"], check=True)
    for path in PIDS.values():
        deadline = time.monotonic() + 10
        while not _pid(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid(path):
            started.append(_pid(path))
    if not _ready():
        stop(started)
        return [], "Slurm's daemons started but the node never became idle (see /var/log/slurm/)"
    return started, None


def stop(pids: list[int]) -> None:
    """Stop the daemons this process started, by their PIDs."""
    for pid in reversed(pids):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def queue_state(job_id: str) -> str:
    """The job's state in Slurm's queue ("" once it has left it)."""
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def in_queue(job_id: str) -> bool:
    """Whether Slurm still has the job (pending, running or completing)."""
    return queue_state(job_id) in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
