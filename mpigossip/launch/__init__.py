"""Starting jobs: :mod:`.launcher` (``mpigossip-mpiexec`` and its defaults), :mod:`.slurm`
(``python -m mpigossip launch`` under Slurm) and :mod:`.info` (what a job sees). How the
one-sided methods' targets make progress is chosen in :mod:`mpigossip.onesided.progress`.
"""
