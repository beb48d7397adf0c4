"""The algorithms by name and the options of their torch wrappers.

Plain data, no imports: the command line checks its flags against it before torch or
MPI are loaded.
"""

#: Every algorithm, in the order tables list them.
ALGORITHMS = ("allreduce", "allreduce-params", "easgd", "asgd", "gossip-pull", "gossip-push", "sgp", "osgp", "dpsgd",
              "adpsgd")

#: The options each algorithm's wrapper takes (besides ``comm`` and ``timeout``).
_HIERARCHICAL = ("hierarchical", "node_size")
OPTIONS = {"allreduce": ("bucket_mb",), "allreduce-params": _HIERARCHICAL, "easgd": ("beta", "tau", "servers"),
           "asgd": ("servers",), "gossip-pull": ("tau", "seed"), "gossip-push": ("tau", "seed") + _HIERARCHICAL,
           "sgp": ("topology", "peers") + _HIERARCHICAL, "osgp": ("topology", "peers", "max_delay"),
           "dpsgd": ("topology",) + _HIERARCHICAL, "adpsgd": ("seed",)}

#: The algorithms that take ``hierarchical=True`` (``--hierarchical``).
HIERARCHICAL = tuple(a for a in ALGORITHMS if "hierarchical" in OPTIONS[a])

#: The default ``--topology`` of the algorithms that take one.
DEFAULT_TOPOLOGY = {"sgp": "exponential", "osgp": "exponential", "dpsgd": "undirected-ring"}
