"""How the ``raymq`` command joins Ray: quickly, quietly, with one-line errors.

Left alone, ``ray.init(address=...)`` on an address nobody answers retries for minutes
(Ray 2.60's ``Node._init_gcs_client`` makes 20 attempts, each waiting up to 5 s for a
connection and 30 s for the cluster id) and prints a C++ log line per attempt to the
process's stderr; on success it logs a token-authentication banner and "Connecting to
existing Ray cluster" through the ``ray`` logger. A command that prints one table or
one line must print only that, so ``join_ray``:

- checks that the GCS address takes a TCP connection (``TCP_TIMEOUT_SECONDS``) before
  ``ray.init``, so an unreachable host or a port nobody listens on fails at once;
- bounds Ray's own retries for a port that answers but is not a GCS, or refuses the
  token (``CLI_RAY_ENV``; each can still be overridden in the environment);
- silences the ``ray`` logger, and keeps the C++ lines written to file descriptor 2
  during ``ray.init`` out of the output (read back only to explain a failure).

This applies to the ``raymq`` process alone: a command never starts Ray processes, so
nothing set here reaches a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator

from raymq.errors import BrokerUnavailable

#: Seconds a TCP connection to the cluster's GCS port may take before the address counts
#: as unreachable (a refused connection fails at once).
TCP_TIMEOUT_SECONDS = 3.0

#: Ray settings for this process's connection attempt, set unless already in the
#: environment. ``RAY_gcs_server_port_wait_time_s``: attempts of ``Node._init_gcs_client``
#: (1 s apart; default 20). ``RAY_gcs_rpc_server_connect_timeout_s``: seconds to open the
#: gRPC channel to the GCS (default 5). ``RAY_py_gcs_connect_timeout_s``: seconds to wait
#: for the cluster id (default 30). A healthy GCS answers within milliseconds; with these a
#: port that answers without being a GCS fails in about 10 s instead of 14 minutes.
CLI_RAY_ENV = {
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_gcs_rpc_server_connect_timeout_s": "2",
    "RAY_py_gcs_connect_timeout_s": "5",
}

#: What to do when no cluster is found or reached.
START_HINT = "start one with `ray start --head`, or pass --address host:port (or set RAY_ADDRESS)"

#: Signs, in the C++ lines captured during ``ray.init``, that the GCS refused the token.
_AUTH_SIGNS = ("InvalidAuthToken", "Unauthenticated", "AuthenticationError")


def quiet_ray_loggers(verbose: bool = False) -> None:
    """Keep the ``ray`` logger (INFO and up to stderr since ``import ray``) silent,
    unless ``verbose``: its banners and warnings are not the command's output."""
    logging.getLogger("ray").setLevel(logging.DEBUG if verbose else logging.CRITICAL + 1)


def split_host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``scheme://host:port``; None if
    the address has no port."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def tcp_error(host: str, port: int, timeout: float = TCP_TIMEOUT_SECONDS) -> str | None:
    """None if ``host:port`` accepts a TCP connection within ``timeout`` seconds, else
    why not (one phrase)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def no_cluster_message(address: str) -> str:
    """The error when ``address`` (``auto``) finds no cluster on this machine."""
    return f"cannot reach Ray at {address!r}: no Ray cluster is running on this machine; " + (
        START_HINT
    )


def unreachable_message(address: str, target: str, why: str) -> str:
    """The error when the GCS at ``target`` (what ``address`` resolved to) takes no
    TCP connection."""
    via = "" if target == address else f" (GCS {target})"
    return (
        f"cannot reach Ray at {address!r}{via}: {why}; is a Ray head running there?"
        f" {START_HINT[0].upper()}{START_HINT[1:]}"
    )


def init_failure_message(address: str, exc: BaseException, ray_log: str) -> str:
    """The error when ``ray.init`` failed although the port answered; ``ray_log`` is
    what Ray wrote to stderr meanwhile (to tell a refused token from the rest)."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    if any(sign in ray_log or sign in detail for sign in _AUTH_SIGNS):
        where = (
            "the token that `ray get-auth-token` prints on the head, in ~/.ray/auth_token,"
            " $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN"
        )
        mode = os.environ.get("RAY_AUTH_MODE")
        if mode == "token":
            return (
                f"Ray at {address!r} refused this process's authentication token: provide {where}"
            )
        return (
            f"Ray at {address!r} wants an authentication token and this process sends none"
            f" (RAY_AUTH_MODE is {mode or 'unset'}): set RAY_AUTH_MODE=token and provide {where}"
        )
    return f"cannot reach Ray at {address!r}: {detail}"


@contextlib.contextmanager
def captured_stderr_fd(enabled: bool = True) -> Iterator[list[str]]:
    """Send what is written to file descriptor 2 (Ray's C++ logging writes there, below
    Python's ``sys.stderr``) to a temporary file while the block runs; the yielded list
    receives that text afterwards. Python's own ``sys.stderr`` keeps the real stream."""
    captured: list[str] = []
    if not enabled:
        yield captured
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        # sys.stderr writes to fd 2 too: give it the real stream for the block's duration.
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1, errors="backslashreplace")
        try:
            yield captured
        finally:
            sys.stderr.flush()
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode("utf-8", "replace"))


def _reload_ray_config() -> None:
    """Make Ray's C++ config read ``CLI_RAY_ENV`` (it read the environment at ``import
    ray``); ``ray.init`` itself does this when it turns token authentication on."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception:  # a Ray without it: only the number of attempts is bounded
        pass


def resolve(address: str) -> str:
    """The GCS ``host:port`` that ``ray.init(address=address)`` will connect to (Ray's own
    resolution: ``auto`` reads ``ray_current_cluster`` or looks for GCS processes here,
    ``localhost`` becomes this node's IP); ``BrokerUnavailable`` if ``auto`` finds none."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # another Ray: check what the user gave
        return address
    try:
        return canonicalize_bootstrap_address(address) or address
    except ConnectionError:
        raise BrokerUnavailable(no_cluster_message(address)) from None
    except ValueError as exc:
        raise BrokerUnavailable(f"--address {address!r} is not host:port ({exc})") from None


def join_ray(address: str, namespace: str, *, verbose: bool = False) -> None:
    """Connect this process to the Ray cluster at ``address`` (``auto``: the one running
    on this machine) in ``namespace``; nothing to do if already connected.

    Raises ``BrokerUnavailable`` with one line naming the address (and what to do)
    within about ``TCP_TIMEOUT_SECONDS`` when the address is unreachable.
    """
    import ray

    if ray.is_initialized():  # embedded in a process that set Ray up itself: leave it be
        return
    quiet_ray_loggers(verbose)
    if address == "local":
        raise BrokerUnavailable(
            "--address local would start a Ray that ends with this command; raymq commands"
            " join a running cluster: " + START_HINT
        )
    for key, value in CLI_RAY_ENV.items():
        os.environ.setdefault(key, value)
    _reload_ray_config()
    target = resolve(address)
    host_port = split_host_port(target)
    if host_port is not None:
        why = tcp_error(*host_port)
        if why is not None:
            raise BrokerUnavailable(unreachable_message(address, target, why))
    with captured_stderr_fd(enabled=not verbose) as ray_log:
        try:
            ray.init(
                address=address, namespace=namespace, log_to_driver=False, configure_logging=False
            )
            failure = None
        except Exception as exc:  # ConnectionError, AuthenticationError, RuntimeError...
            failure = exc
    if failure is not None:
        raise BrokerUnavailable(init_failure_message(address, failure, "".join(ray_log)))
