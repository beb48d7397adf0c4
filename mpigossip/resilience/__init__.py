"""Peers that fail, leave or join, one layer under the communicators.

* :mod:`.failures`: ULFM's revoke, shrink and agree; messages whose outcome is kept; the
  alarm every survivor hears;
* :mod:`.membership`: ranks leaving on purpose (out of data) and :class:`~mpigossip.Join`;
* the strategies a communicator's one schedule is given under ``on_failure="continue"``
  (:mod:`.persistent`: persistent requests, with an alarm for overlap mode; :mod:`.agp_tolerant`
  for AGP) and what a recovery salvages (:mod:`.tolerant` around a synchronous step,
  :mod:`.overlap` from PushSum's overlap mode).
"""
