"""The types the public API's annotations name (for type checkers; nothing here runs MPI).

``Buffer``: a flat, contiguous array that a communicator averages in place: a
``numpy.ndarray``, a ``cupy.ndarray`` or a ``torch.Tensor`` (CPU or CUDA). It is ``Any`` to a
type checker, since neither CuPy nor torch is a dependency of the communicators; the buffer's
kind, dtype and layout are checked when a communicator is built (:mod:`mpigossip.core.buffers`).
"""

from typing import Any

Buffer = Any

__all__ = ["Buffer"]
