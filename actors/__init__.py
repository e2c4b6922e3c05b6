"""The Ray actors of RayMQ: thin shells around the plain classes in ``raymq``.

- ``queue_actor.QueueActor``: one per queue; owns its QueueArea segment files.
- ``target_list_actor.TargetListActor``: one per consumer, near it; direct references
  up to the watermark, eager loading, PendingCache.
- ``broker_actor.BrokerActor``: the named registry of queues and broker settings.
- ``governor_actor.MemoryGovernorActor``: one per broker; splits the memory budget
  between queues, nodes and linked caches every housekeeping period.
"""
