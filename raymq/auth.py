"""Ray token authentication as RayMQ relies on it: is it on, and is the token private?

What Ray 2.60 does (``ray/_private/authentication/authentication_token_setup.py``,
``ray/scripts/scripts.py``, ``ray/_private/worker.py``):

- ``ray start --head`` turns token authentication on only if ``RAY_AUTH_MODE=token`` is
  set, or if ``RAY_AUTH_MODE`` is unset and a token already exists; on a machine without
  one it starts with authentication *off* (and says so in a log line).
  ``RAY_AUTH_MODE=token`` with no token fails: ``ray get-auth-token --generate`` first.
- ``ray.init()`` starting a new local Ray (an embedded one) turns it on and writes a
  token if there is none.
- The token comes from ``$RAY_AUTH_TOKEN``, else the file ``$RAY_AUTH_TOKEN_PATH``,
  else ``~/.ray/auth_token``. Ray writes that file with the umask's mode: 0644 usually,
  readable by every local user.
- A client sends the token only when its own mode is token: ``ray job submit``,
  ``ray list ...`` and a driver given an explicit address (or ``$RAY_ADDRESS``) need
  ``RAY_AUTH_MODE=token``; a driver with ``address="auto"``/None turns it on by itself
  when it finds a token. Processes of the cluster (jobs' drivers, actors) inherit the
  mode from ``ray start``.

``check_token_auth()`` runs where ``raymq start`` runs: it tells whether the connected
cluster has token authentication on, makes the token file mode 0600, and words a
one-line warning when authentication is off.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
#: Seconds to wait for the dashboard's or a worker's answer about the cluster's mode.
PROBE_TIMEOUT_SECONDS = 10.0

AUTH_OFF_WARNING = (
    "Ray token authentication is off on this cluster: anyone who can reach its ports can"
    " run code on it and read every queue. Turn it on: `ray get-auth-token --generate`,"
    " restart the head with `RAY_AUTH_MODE=token ray start --head ...` and set"
    " RAY_AUTH_MODE=token wherever you run ray or raymq (README: Security)."
)


@dataclass(frozen=True)
class TokenAuthStatus:
    """What ``check_token_auth`` found."""

    #: The cluster's authentication mode: "token" or "disabled" ("unknown" when neither
    #: the dashboard nor a worker could be asked).
    mode: str
    #: The token file Ray reads here (None: the token is in ``$RAY_AUTH_TOKEN``, or none).
    token_path: str | None
    #: True if a token file was readable by others and is now mode 0600.
    permissions_fixed: bool
    #: One line to show the user, or None.
    warning: str | None

    def lines(self) -> list[str]:
        """What ``raymq start`` prints: the warning, and a note on a fixed file mode."""
        out = []
        if self.permissions_fixed:
            what = self.token_path or "Ray's token file"
            out.append(f"made {what} readable by its owner only (mode 0600)")
        if self.warning:
            out.append(f"warning: {self.warning}")
        return out


def token_files(environ: Mapping[str, str] | None = None, home: str | None = None) -> list[Path]:
    """Token files Ray may read here, in Ray's order: ``$RAY_AUTH_TOKEN_PATH`` (if set),
    then ``~/.ray/auth_token``; only those that exist."""
    env = os.environ if environ is None else environ
    candidates = []
    if env.get(TOKEN_PATH_ENV):
        candidates.append(Path(env[TOKEN_PATH_ENV]).expanduser())
    candidates.append(Path(home or Path.home()) / ".ray" / "auth_token")
    return [p for p in candidates if p.is_file()]


def token_path_in_use(
    environ: Mapping[str, str] | None = None, home: str | None = None
) -> Path | None:
    """The file Ray takes the token from (None: ``$RAY_AUTH_TOKEN`` wins, or no file)."""
    env = os.environ if environ is None else environ
    if env.get(TOKEN_ENV):
        return None
    if env.get(TOKEN_PATH_ENV):  # Ray does not fall back to ~/.ray when this is set
        path = Path(env[TOKEN_PATH_ENV]).expanduser()
        return path if path.is_file() else None
    files = token_files(env, home)
    return files[0] if files else None


def make_private(path: Path) -> bool:
    """Remove group and other permissions from ``path`` (0644 -> 0600); True if it
    changed. Raises ``OSError`` if it cannot (another user's file, read-only disk)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return False
    os.chmod(path, mode & 0o700 | stat.S_IRUSR | stat.S_IWUSR)
    return True


def _mode_name(mode: object) -> str:
    from ray._private.authentication.authentication_utils import get_authentication_mode_name

    return get_authentication_mode_name(mode)


def local_auth_mode() -> str:
    """This process's mode ("token" or "disabled"): what it sends, not what the cluster
    asks for."""
    from ray._raylet import get_authentication_mode

    return _mode_name(get_authentication_mode())


def _worker_auth_mode() -> str:
    from ray._raylet import get_authentication_mode

    return _mode_name(get_authentication_mode())


def _ask_dashboard() -> str | None:
    """The head's answer at ``/api/authentication_mode`` (served without a token), or
    None if there is no dashboard."""
    import ray

    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:
        return None
    if not url:
        return None
    if "://" not in url:
        url = "http://" + url
    try:
        with urllib.request.urlopen(
            url.rstrip("/") + "/api/authentication_mode", timeout=PROBE_TIMEOUT_SECONDS
        ) as reply:
            mode = json.load(reply).get("authentication_mode")
    except (OSError, ValueError):
        return None
    return mode if mode in ("token", "disabled") else None


def _ask_a_worker() -> str | None:
    """The mode of a worker process of the cluster (it inherits the raylet's), or None."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_worker_auth_mode).remote()
    try:
        return ray.get(task, timeout=PROBE_TIMEOUT_SECONDS)
    except Exception:
        ray.cancel(task, force=True)
        return None


def cluster_auth_mode() -> str:
    """The connected cluster's authentication mode: "token", "disabled" or "unknown".

    A driver whose own mode is disabled and that is connected proves the cluster's is
    too (the GCS refuses a driver without the token). A driver in token mode sends the
    token either way, so it asks: the dashboard, else a zero-CPU task on a worker.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("cluster_auth_mode needs a connected Ray (ray.init first)")
    if local_auth_mode() != "token":
        return "disabled"
    return _ask_dashboard() or _ask_a_worker() or "unknown"


def check_token_auth(
    *,
    mode: str | None = None,
    environ: Mapping[str, str] | None = None,
    home: str | None = None,
) -> TokenAuthStatus:
    """Check Ray's token authentication for ``raymq start``.

    ``mode`` is the cluster's mode if already known; else it is asked of the connected
    cluster (``cluster_auth_mode``). Every token file here that others can read is made
    mode 0600. The warning is one line: authentication off (and what to set), or a
    token file that could not be made private.
    """
    env = os.environ if environ is None else environ
    if mode is None:
        mode = cluster_auth_mode()
    fixed, problems = False, []
    for path in token_files(env, home):
        try:
            fixed = make_private(path) or fixed
        except OSError as exc:
            problems.append(
                f"{path} is readable by other users and could not be made private"
                f" ({exc.strerror or exc}): chmod 600 {path}"
            )
    if mode == "disabled":
        problems.insert(0, AUTH_OFF_WARNING)
    elif mode != "token":
        problems.insert(
            0,
            "could not tell whether Ray token authentication is on (no dashboard answered);"
            " see README: Security",
        )
    in_use = token_path_in_use(env, home)
    return TokenAuthStatus(
        mode=mode,
        token_path=str(in_use) if in_use else None,
        permissions_fixed=fixed,
        warning="; ".join(problems) or None,
    )
