"""Peers that fail, leave or join, one layer under the communicators.

* :mod:`.failures`: ULFM's revoke, shrink and agree; messages whose outcome is kept; the
  alarm every survivor hears;
* :mod:`.membership`: ranks leaving on purpose (out of data) and :class:`~mpigossip.Join`;
* the strategies a communicator is given under ``on_failure="continue"``: persistent
  requests and what is salvaged from a failed step (:mod:`.tolerant` for the synchronous
  mixing step, :mod:`.tolerant_overlap` for PushSum's overlap, :mod:`.agp_tolerant` for AGP,
  :mod:`.persistent` for the rings of the exact mean).
"""
