"""The algorithms by name and the options of their torch wrappers.

Plain data, no imports: the command line checks its flags against it before torch or
MPI are loaded.
"""

#: Every algorithm, in the order tables list them.
ALGORITHMS = ("allreduce", "allreduce-params", "easgd", "asgd", "gossip-pull", "gossip-push", "sgp", "osgp")

#: The options each algorithm's wrapper takes (besides ``comm`` and ``timeout``).
OPTIONS = {"allreduce": ("bucket_mb",), "allreduce-params": (), "easgd": ("beta", "tau", "servers"), "asgd": ("servers",),
           "gossip-pull": ("tau", "seed"), "gossip-push": ("tau", "seed"), "sgp": ("topology", "peers"),
           "osgp": ("topology", "peers", "max_delay")}
