"""The seeded fault simulator: a queue core under random load on a disk that crashes,
rots, fills up and fails (``raymq.sim.disk``), with invariants checked at every step
(``raymq.sim.run``; what it knows of messages, consumers and settings in
``raymq.sim.model``, an address's subscriptions in ``raymq.sim.address_ops``).
``python -m raymq.sim --seeds N`` runs seeds 0..N-1; a failing seed prints the one
command that replays it. Never imports Ray."""
