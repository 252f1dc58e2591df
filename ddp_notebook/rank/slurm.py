"""One task of a Slurm job as one rank: ``python -m ddp_notebook.rank.slurm MANIFEST`` (``%%ddp --executor``).

Each task takes the torchrun environment contract from Slurm's, read through
submitit (``JobEnvironment``, ``TorchDistributedEnvironment``): RANK is the
task's global rank, LOCAL_RANK its rank on its node, WORLD_SIZE nodes × tasks
per node, MASTER_ADDR the job's first node, MASTER_PORT one the job's id picks
below the ephemeral ports (:func:`master_port`), GROUP_RANK the node.  Its GPU is
``cuda:LOCAL_RANK`` of those Slurm lets it see, or ``cuda:0`` where Slurm binds
one GPU to each task.  Then it runs the export the notebook wrote
(:mod:`ddp_notebook.rank.torchrun`), which reports to the notebook's channel,
or through files in the job's folder where not every rank can reach it.
Rank side: no IPython here.
"""
from __future__ import annotations

import os
import random
import sys

from ..wire import protocol
from . import torchrun


# The job's port, when the environment names none, below Linux's default range of ephemeral ports (32768-60999,
# /proc/sys/net/ipv4/ip_local_port_range), where the port of any TCP connection on the first node may be.  submitit
# draws from 20000-60000, mostly inside that range: a port some connection held made rank 0's TCPStore fail with
# EADDRINUSE.
PORTS = range(20000, 32768)


def master_port(job_id: str) -> int:
    """The job's TCPStore port: ``MASTER_PORT`` if the environment gives one (as submitit reads it), else one drawn
    from :data:`PORTS` by the job's id, the same on every node."""
    given = os.environ.get("MASTER_PORT")
    if given:
        return int(given)
    return random.Random(job_id).choice(PORTS)


def torchrun_environment() -> dict[str, str]:
    """The torchrun contract of this Slurm task."""
    import submitit

    job = submitit.JobEnvironment()
    dist = submitit.helpers.TorchDistributedEnvironment()
    env = {
        "MASTER_ADDR": dist.master_addr, "MASTER_PORT": str(master_port(str(job.job_id))), "RANK": str(dist.rank),
        "WORLD_SIZE": str(dist.world_size), "LOCAL_RANK": str(dist.local_rank),
        "LOCAL_WORLD_SIZE": str(dist.local_world_size), "GROUP_RANK": str(job.node),
        "GROUP_WORLD_SIZE": str(job.num_nodes), "ROLE_RANK": str(dist.rank), "ROLE_WORLD_SIZE": str(dist.world_size),
        "DDP_NOTEBOOK_RANK": str(dist.rank),
    }
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if len(visible) == 1 and dist.local_world_size > 1:  # one GPU bound to each task
        env[torchrun.DEVICE_INDEX_ENV] = "0"
    return env


def main(argv: list[str]) -> int:
    """Run the export ``argv[0]`` as this task's rank; its exit status."""
    import submitit

    os.environ.update(torchrun_environment())
    job = submitit.JobEnvironment()
    run_dir = protocol.slurm_run_dir(str(job.paths.folder), str(job.job_id))
    return torchrun.main(argv[0], ["--run-dir", run_dir])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
