"""The Ray-free cores that the actors in ``raymq.actors`` wrap, one concept per module.

- ``queue``: a queue, owner of its QueueArea (admission, group commit, dispatch);
  wrapped by ``actors/queue_actor.py``, with ``target_area`` (TargetArea: who may get
  and who holds which message), ``head_cache`` (HeadQueueCache) and ``dead_letter``
  (Artemis's dead letter address). Its parts: ``admission`` (batch checks and the
  address-full policy), ``group_commit`` (the send/commit pipeline) with
  ``replicated_commit`` (a leader's commits to its followers), ``address`` (an
  address's subscription definitions), ``scrub_pacer`` (the background scrub's pace)
  and ``queue_stats`` (the QueueStats record).
- ``target_list``: a consumer's TargetList (watermark, direct references, PendingCache);
  wrapped by ``actors/target_list_actor.py``.
- ``budget``: the linked caches and Qpid's proportional flow-to-disk threshold; wrapped
  by ``actors/governor_actor.py``.
- ``registry``: the broker's queues, its ``queue.json`` files; wrapped by
  ``actors/broker_actor.py``.
- ``offset_set`` (CacheReferences as compressed offset sets) and ``supervisor``
  (long-lived tasks that never die silently) serve the others.

Nothing here imports ``ray`` (``tests/test_layout.py`` checks it).
"""
