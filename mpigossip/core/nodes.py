"""Which ranks share a node: the one place the package asks MPI (``MPI_Comm_split_type``
with ``COMM_TYPE_SHARED``: the ranks that can share memory)."""

from __future__ import annotations

from typing import cast

from mpi4py import MPI


def node_comm(comm: MPI.Intracomm, *, key: int = 0) -> MPI.Intracomm:
    """Collective: the ranks of ``comm`` on this rank's node, ordered by ``key`` then by their
    rank in ``comm``. The caller frees it."""
    return cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=key))


def local_rank(comm: MPI.Intracomm) -> tuple[int, int]:
    """Collective: this rank's index among the ranks of ``comm`` on its node, and their count."""
    node = node_comm(comm)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def spans_nodes(comm: MPI.Intracomm) -> bool:
    """Collective: whether ``comm``'s ranks are on more than one node (the same answer on every
    rank: one rank's node holds fewer than all of them exactly when every rank's does)."""
    return local_rank(comm)[1] < comm.Get_size()
