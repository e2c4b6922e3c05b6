"""The Ray actors of RayMQ: thin shells around the plain classes in ``raymq``.

- ``queue_actor.QueueActor``: one per queue; owns its QueueArea segment files.
- ``broker_actor.BrokerActor``: the named registry of queues and broker settings.
"""
