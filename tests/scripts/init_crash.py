"""Stands in for a rank that crashes inside MPI_Init the way Open MPI 5.0.x does under
``srun --mpi=pmix`` (open-mpi/ompi#12495): in the job's first step (``SLURM_STEP_ID`` 0),
task 0 prints Open MPI's backtrace through ``ompi_mpi_init`` and dies of SIGSEGV while the
other tasks wait in "MPI_Init" (until srun ends them); in later steps every task prints
``started`` and exits 0. No MPI is used.

    init_crash.py [init|late]     # late: the same crash, but its backtrace does not pass MPI_Init
"""

import os
import signal
import socket
import sys
import time

where = sys.argv[1] if len(sys.argv) > 1 else "init"
step = int(os.environ.get("SLURM_STEP_ID", "0"))
task = int(os.environ.get("SLURM_PROCID", "0"))
if step == 0 and task == 0:
    tag = f"[{socket.gethostname()}:{os.getpid()}]"
    frames = ["/lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7f00c0a5b050]",
              "/opt/ompi/lib/libmpi.so.40(mca_pml_ob1_recv_frag_callback_match+0x8f)[0x7f00bf6d2e1f]",
              "/opt/ompi/lib/libopen-pal.so.80(mca_btl_sm_poll_handle_frag+0x19d)[0x7f00bf3a1f0d]",
              "/opt/ompi/lib/libopen-pal.so.80(opal_progress+0x34)[0x7f00bf2e4d14]"]
    if where == "init":
        frames += ["/opt/ompi/lib/libmpi.so.40(ompi_mpi_init+0x7a1)[0x7f00bf4f0b31]",
                   "/opt/ompi/lib/libmpi.so.40(PMPI_Init_thread+0x7c)[0x7f00bf53c44c]"]
    else:
        frames += ["/opt/ompi/lib/libmpi.so.40(PMPI_Wait+0x4a)[0x7f00bf5511aa]"]
    lines = [f"{tag} *** Process received signal ***", f"{tag} Signal: Segmentation fault (11)"]
    lines += [f"{tag} [{i:2d}] {frame}" for i, frame in enumerate(frames)]
    lines += [f"{tag} *** End of error message ***"]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSEGV)
if step == 0:
    time.sleep(60)
print(f"started: step {step} task {task}", flush=True)
