"""How the examples connect: to the running broker, or to a Ray and broker of their own.

- Submitted with ``ray job submit`` (Ray's job manager sets ``RAY_JOB_CONFIG_JSON_ENV_VAR``
  in a job's driver) or run with ``--join``: join the broker that ``raymq start`` started
  (``raymq.connect(address="auto", namespace="raymq", create=False)``; ``$RAYMQ_NAMESPACE``
  names another), use its settings, and never shut it down. The examples' queues are
  named ``example.*`` so that they do not meet the README's ``orders``.
- Otherwise (``python examples/NAME.py``, ``make demo``): start an embedded local Ray
  and a broker in a namespace and temporary paging directory of the example's own, and
  remove both at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import raymq

#: Set by Ray's job manager in the environment of a submitted job's driver (and of no
#: other process): ``ray/dashboard/modules/job/job_supervisor.py``.
JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
JOIN_FLAG = "--join"


def submitted_as_ray_job() -> bool:
    """True in the driver of a job submitted with ``ray job submit``."""
    return JOB_ENV in os.environ


def joins_running_broker(argv: list[str] | None = None) -> bool:
    """Whether this run joins the running broker: under ``ray job submit`` or ``--join``."""
    args = sys.argv[1:] if argv is None else argv
    return JOIN_FLAG in args or submitted_as_ray_job()


@dataclass
class Example:
    """The broker an example works with, and how it got it."""

    broker: raymq.Broker
    #: True: the running broker, shared with others (keep it running).
    joined: bool


@contextlib.contextmanager
def example_broker(name: str, **embedded_settings) -> Iterator[Example]:
    """The broker for example ``name``: the running one (see the module docstring), or
    an embedded one with ``embedded_settings`` that is shut down and removed at the end.
    """
    if joins_running_broker():
        namespace = os.environ.get("RAYMQ_NAMESPACE", "raymq")
        broker = raymq.connect(address="auto", namespace=namespace, create=False)
        print(
            f"joined the running RayMQ broker in namespace {namespace!r}"
            f" (paging directory {broker.config.paging_directory}; its settings apply)"
        )
        yield Example(broker, joined=True)
        return  # the broker stays: it is not ours
    paging = tempfile.mkdtemp(prefix=f"raymq-{name}-")
    broker = raymq.connect(
        address="local",  # an embedded Ray even where a cluster runs
        namespace=f"raymq-{name}",
        paging_directory=paging,
        **embedded_settings,
    )
    try:
        yield Example(broker, joined=False)
    finally:
        broker.shutdown()
        shutil.rmtree(paging, ignore_errors=True)
