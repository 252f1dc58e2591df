"""Node 0's torchrun agent, whose rendezvous store listens on a socket the notebook bound.

torchrun's static rendezvous binds ``--master-port`` itself, so the notebook would have to let go of the port first,
and another user of the host could take it in between (the other hosts' agents would then meet at theirs). This is
torchrun (``torch.distributed.run``) with a rendezvous handler of its own, registered where torch lets rendezvous
backends be added: the static rendezvous, except that its ``TCPStore`` takes over the listening socket the notebook
bound and this process inherited (``master_listen_fd``). The other hosts' agents, plain torchrun with the static
rendezvous, join it as they would join torchrun's.

``python -m ddp_notebook.engine.torchrun_agent <torchrun arguments> --rdzv-backend ddp_notebook-static
--rdzv-endpoint HOST:PORT --rdzv-conf rank=0,listen_fd=FD ...``; :func:`agent_arguments` builds them. Notebook side
(the agent's process).
"""
from __future__ import annotations

import sys
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo, rendezvous_handler_registry)

BACKEND = "ddp_notebook-static"
_DEFAULT_TIMEOUT_S = 600  # torch's static rendezvous's


def agent_arguments(master_addr: str, port: int, listen_fd: int) -> list[str]:
    """The torchrun arguments of a rendezvous on ``master_addr:port`` whose store listens on ``listen_fd``."""
    return ["--rdzv-backend", BACKEND, "--rdzv-endpoint", f"{master_addr}:{port}",
            "--rdzv-conf", f"rank=0,listen_fd={listen_fd}"]


class BoundStaticRendezvous(RendezvousHandler):
    """torch's static rendezvous on node 0, its store on a socket bound already."""

    def __init__(self, params: RendezvousParameters):
        self._params = params
        host, _, port = params.endpoint.rpartition(":")
        self.master_addr, self.master_port = host, int(port)
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        params = self._params
        if self._store is None:
            self._store = TCPStore(self.master_addr, self.master_port, params.max_nodes, True,
                                   timedelta(seconds=params.get_as_int("timeout", _DEFAULT_TIMEOUT_S)),
                                   multi_tenant=True, master_listen_fd=params.get_as_int("listen_fd"))
        return RendezvousInfo(PrefixStore(params.run_id, self._store), 0, params.max_nodes,
                              RendezvousStoreInfo(self.master_addr, self.master_port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._params.run_id

    def shutdown(self) -> bool:
        return True


def main(argv: list[str]) -> None:
    rendezvous_handler_registry.register(BACKEND, BoundStaticRendezvous)
    torchrun.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
