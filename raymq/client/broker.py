"""``connect()`` and the ``Broker`` handle: create, find, delete and inspect queues."""

from __future__ import annotations

from typing import Any

import ray

from raymq.batch import (
    warm_arrow_conversions,
)
from raymq.client.calls import _call
from raymq.client.handles import Address, Queue
from raymq.config import (
    STOP_SECONDS,
    BrokerConfig,
    QueueConfig,
    apply_ray_env_defaults,
    validate_queue_name,
)
from raymq.errors import (
    BrokerUnavailable,
    InvalidSetting,
    QueueNotFound,
)


def connect(
    address: str | None = None,
    namespace: str = "raymq",
    *,
    create: bool = True,
    warm: bool = True,
    **broker_config: Any,
) -> Broker:
    """Join (or start) Ray and the broker of ``namespace``; returns a ``Broker``.

    ``address`` None joins a running cluster if one is found, else starts an embedded
    local Ray; ``"auto"`` requires a running cluster. ``broker_config`` are the settings
    of ``raymq.config.BrokerConfig`` (``paging_directory``, ``max_message_size``, ...);
    they apply when this call creates the broker, and must match a running one.
    ``create=False`` only joins a running broker (``BrokerUnavailable`` if none).
    ``warm`` starts ahead what a first consumer would wait for (a spare TargetList
    process on this node, pyarrow's lazy imports: about 0.7 s of CPU); a short-lived
    process that makes one consumer at most (the ``raymq`` command) passes False.
    """
    from raymq.actors.broker_actor import BrokerActor
    from raymq.actors.governor_actor import MemoryGovernorActor
    from raymq.actors.names import BROKER_ACTOR_NAME, GOVERNOR_ACTOR_NAME
    from raymq.placement import spares
    from raymq.placement.nodes import current_node_id, pinned_to

    config = BrokerConfig.from_kwargs(**broker_config)
    _join_ray(address, namespace)
    if not create:
        try:
            ray.get_actor(BROKER_ACTOR_NAME, namespace=namespace)
        except ValueError:
            raise BrokerUnavailable(
                f"no RayMQ broker in namespace {namespace!r} on this Ray cluster;"
                " start one with `raymq start`"
            ) from None

    def here(actor_class, name: str):
        """``actor_class``'s detached actor ``name`` on this node, made if missing."""
        return actor_class.options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(current_node_id()),
        )

    actor = here(BrokerActor, BROKER_ACTOR_NAME).remote(config, namespace)

    def again():  # a broker just stopped (killed) keeps its name a moment: ask anew
        nonlocal actor
        actor = here(BrokerActor, BROKER_ACTOR_NAME).remote(config, namespace)
        return actor.config

    running: BrokerConfig = _call(actor.config, refresh=again, about="the broker")
    if broker_config and running != config:
        raise InvalidSetting(f"broker in namespace {namespace!r} runs with {running}, not {config}")
    if warm:
        spares.warm(current_node_id())  # the first consumer need not wait for a process
        warm_arrow_conversions()  # nor its first receive for pyarrow's lazy imports
    governor = here(MemoryGovernorActor, GOVERNOR_ACTOR_NAME).remote(running, namespace)
    return Broker(actor, running, namespace, governor)


def _join_ray(address: str | None, namespace: str) -> None:
    """``ray.init`` unless this process joined a Ray already (``connect``'s
    ``address``); ``BrokerUnavailable`` if it cannot be reached."""
    if ray.is_initialized():
        return
    apply_ray_env_defaults()
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        raise BrokerUnavailable(f"cannot reach Ray at {address!r}: {exc}") from exc


class Broker:
    """Handle of a running broker: create, find, delete and inspect queues."""

    def __init__(self, actor, config: BrokerConfig, namespace: str, governor=None):
        self._actor = actor
        self._governor = governor
        self.config = config
        self.namespace = namespace
        self._shut_down = False

    def create_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        max_size_bytes: int = -1,
        page_size_bytes: int = 10 * 2**20,
        address_full_policy: str = "PAGE",
        page_max_cache_size: int = 5,
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
        node_id: str | None = None,
        replicas: int = 1,
        min_insync_replicas: int | None = None,
        dedup_window_s: float = 120.0,
        id_cache_size: int = 100_000,
        redelivery_delay_s: float = 0.0,
        default_ttl_s: float | None = None,
        expiry_queue: str | None = None,
        message_expiry_scan_period_s: float = 30.0,
        max_priority: int | None = None,
    ) -> Queue:
        """Create a queue, or return it if it exists with equal settings.

        A message delivered ``max_delivery_attempts`` times (None: no limit) and given
        back again goes to ``dead_letter_queue`` (default ``f"{name}.DLQ"``, created
        when first needed with this queue's durability) instead of a further delivery.
        ``replicas`` (2 or 3) keeps that many copies of the queue's files, each on its
        own node: a send is answered once ``min_insync_replicas`` of them (default all
        of 2, 2 of 3) have it durably, and the queue survives the loss of its leader's
        node (README, "Failure model"). A message sent with a ``message_id`` the queue
        stored within ``dedup_window_s`` seconds is not stored again (at most
        ``id_cache_size`` ids remembered); a nacked message waits
        ``redelivery_delay_s`` seconds before it is delivered again. ``default_ttl_s``,
        ``expiry_queue``, ``message_expiry_scan_period_s`` and ``max_priority``: README,
        "Message expiry" and "Priorities". Raises
        ``QueueExists`` for different settings,
        ``InvalidQueueName``, ``InvalidSetting`` or ``TypeError`` for bad arguments,
        ``BrokerUnavailable`` if there are fewer alive nodes than replicas (nothing is
        created then).
        """
        # Every keyword but node_id is a QueueConfig field of the same name.
        settings = {k: v for k, v in locals().items() if k not in ("self", "name", "node_id")}
        handle = _call(self._actor.create_queue, QueueConfig(name, **settings), node_id)
        return Queue(self, name, handle)

    def get_queue(self, name: str) -> Queue:
        """The handle of an existing queue; ``QueueNotFound`` if there is none."""
        validate_queue_name(name)
        return Queue(self, name, _call(self._actor.get_queue, name))

    def create_address(
        self,
        name: str,
        *,
        durable: bool = True,
        max_size_bytes: int = -1,
        page_size_bytes: int = 10 * 2**20,
        address_full_policy: str = "PAGE",
        page_max_cache_size: int = 5,
        node_id: str | None = None,
        default_ttl_s: float | None = None,
        expiry_queue: str | None = None,
        max_priority: int | None = None,
        retention_s: float | None = None,
        retention_bytes: int | None = None,
    ) -> Address:
        """Create an address (Artemis's multicast address), or return it if it exists
        with equal settings: a message sent to it is stored once and delivered to each
        of its subscriptions (``Address.create_subscription``).

        ``max_size_bytes`` and ``address_full_policy`` apply to what any subscription
        still needs; ``default_ttl_s``, ``expiry_queue`` and ``max_priority`` as
        ``create_queue``'s (a message expires for every subscription alike, and each
        subscription delivers by priority). ``retention_s`` and ``retention_bytes``
        keep what every subscription acknowledged, for new subscriptions and
        ``Subscription.seek``, until its segment file is older than ``retention_s``
        seconds and ``retention_bytes`` of newer files remain (README, "Retention and
        replay"; durable, PAGE only). Raises as ``create_queue`` does
        (``QueueExists`` when a queue or an address of that name exists with other
        settings).
        """
        cfg = QueueConfig(
            name,
            durable,
            max_size_bytes,
            page_size_bytes,
            address_full_policy,
            page_max_cache_size,
            address=True,
            default_ttl_s=default_ttl_s,
            expiry_queue=expiry_queue,
            max_priority=max_priority,
            retention_s=retention_s,
            retention_bytes=retention_bytes,
        )
        return Address(self, name, _call(self._actor.create_queue, cfg, node_id))

    def get_address(self, name: str) -> Address:
        """The handle of an existing address; ``QueueNotFound`` if there is none."""
        validate_queue_name(name)
        if name not in self.list_addresses():
            raise QueueNotFound(f"address {name!r} does not exist")
        return Address(self, name, _call(self._actor.get_queue, name))

    def delete_address(self, name: str) -> None:
        """Delete an address with its subscriptions, messages and files."""
        validate_queue_name(name)
        if name not in self.list_addresses():
            raise QueueNotFound(f"address {name!r} does not exist")
        _call(self._actor.delete_queue, name)

    def list_addresses(self) -> list[str]:
        """Names of the broker's addresses."""
        return _call(self._actor.list_addresses)

    def delete_queue(self, name: str) -> None:
        """Delete a queue with its messages and files."""
        validate_queue_name(name)
        _call(self._actor.delete_queue, name)

    def list_queues(self) -> list[str]:
        """Names of the broker's queues (not its addresses)."""
        return _call(self._actor.list_queues)

    def queue_nodes(self) -> dict[str, str]:
        """The node id each queue (its actor and files) lives on, by queue name."""
        return _call(self._actor.queue_nodes)

    def stats(self) -> dict[str, dict]:
        """Each queue's (and address's) statistics as a dict, by name, with its
        ``"state"``: "active", "replicated", or "hibernated" (its actor is not running,
        and is not started for this: its entry then holds only ``name`` and
        ``state``)."""
        states: dict[str, str] = _call(self._actor.queue_states)
        running = [n for n, state in states.items() if state != "hibernated"]
        handles = [_call(self._actor.get_queue, n) for n in running]
        out = {n: {"name": n, "state": state} for n, state in states.items()}
        for n, s in zip(running, ray.get([h.stats.remote() for h in handles]), strict=True):
            out[n] = {**s.to_dict(), "state": states[n]}
        return out

    def hibernation_stats(self) -> dict[str, Any]:
        """Hibernation of idle queues: the settings, running queue actors per node,
        the hibernated queues, and counts of hibernations and revivals
        (``raymq.core.hibernation.HibernationStats`` as a dict)."""
        return _call(self._actor.hibernation_stats).to_dict()

    def set_hibernation(
        self,
        max_active_queues: int | None = 32,
        hibernate_after_seconds: float | None = 300.0,
    ) -> None:
        """Set how many queue actors may run per node (None: no cap) and after how many
        idle seconds a queue hibernates (None: only to make room), until the broker
        actor restarts. A hibernated queue's files stay; the next call to it starts its
        actor again (a delay of about a process start), through any handle."""
        from raymq.core.hibernation import HibernationSettings

        HibernationSettings(max_active_queues, hibernate_after_seconds)  # checked here
        _call(self._actor.set_hibernation, max_active_queues, hibernate_after_seconds)

    def hibernate(self, name: str) -> bool:
        """Hibernate queue ``name`` now if it is idle; True if it did (False: busy,
        replicated, or not running). ``QueueNotFound`` if there is no such queue."""
        validate_queue_name(name)
        return _call(self._actor.hibernate, name)

    def task_results(self) -> Any:
        """The actor handle of the broker's store of task statuses and results
        (``raymq.serve``), started on the broker's node when first asked."""
        return _call(self._actor.task_results)

    def leftovers(self) -> list[dict[str, Any]]:
        """Replicas' copies of replicated queues left on their nodes (a replaced leader
        that did not rejoin, a lost follower replaced): ``queue``, ``replica_id``,
        ``node_id``, ``why``, ``since`` (seconds since the epoch) and ``verdict``,
        what ``remove_leftovers`` would do."""
        return _call(self._actor.leftovers)

    def remove_leftovers(self, dry_run: bool = False) -> list[dict[str, Any]]:
        """Remove the copies ``leftovers`` lists that no replica uses, each on its
        node (one its node is not alive for is kept); returns each with its
        ``outcome``. ``dry_run``: say what would be done, change nothing."""
        return _call(self._actor.remove_leftovers, dry_run)

    def governor_stats(self) -> dict[str, Any]:
        """The MemoryGovernor: threshold, per-node thresholds, each queue's budget split
        into its linked caches, the usage it was computed from, rounds so far."""
        return _call(self._governor.stats)

    def rebalance(self) -> dict[str, Any]:
        """Run a MemoryGovernor round now (it also runs every ``housekeeping_period``);
        returns the plan."""
        return _call(self._governor.rebalance)

    def shutdown(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the broker's actors, keeping every queue's files. Each queue has
        ``timeout`` seconds to flush and close; one that takes longer (a paused process,
        a leader waiting for replicas) is ended all the same, and the acks it had not
        written are lost: those messages are delivered again."""
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"shutdown: timeout must be seconds > 0, not {timeout!r}")
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self._governor is not None:
                ray.kill(self._governor, no_restart=True)
            _call(self._actor.stop_queues, timeout, retry=False)
        finally:
            ray.kill(self._actor, no_restart=True)
