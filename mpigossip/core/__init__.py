"""What every communicator uses, and nothing above it: buffers (numpy, cupy and torch
memory handed to MPI, CUDA-aware or staged), kernels (all arithmetic, on the CPU or as fused
CUDA kernels), wire formats (compressed messages), deadlines (nothing waits forever), the
``Steps`` interface every communicator meets (:mod:`.base`) and :class:`~mpigossip.Every`
(any of them every k-th step: :mod:`.periodic`), argument checks, the algorithms' registry
and provenance of results.

Nothing here imports a communicator, torch or the training job; importing this package
starts no MPI.
"""
