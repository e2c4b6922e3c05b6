"""The wire: RayMQ's one transport for data between processes (docs/WIRE.md).

Ray calls carry control (creating queues, registering consumers, failover); the wire
carries data: ``frames`` (the codec), ``server`` and ``client`` (one connection, pipelined
requests, hello, limits, pings), ``blocking`` (that client for threads), ``sync_client``
(a client its one waiting thread reads: a consumer's delivery connection), and the op tables
over them: ``send`` (producers to a queue), ``fetch`` (a TargetList from its queue),
``delivery`` (a consumer from its TargetList) and ``replica`` (a leader to a follower).
"""
