"""``raymq.auth``: which token file Ray reads, making it private, the warning when Ray's
token authentication is off. Files only (a temporary home), except the last test, which
asks the session's Ray (started by ``ray.init``: token authentication on, no dashboard,
so a worker answers)."""

from __future__ import annotations

import os
import stat

import pytest

from raymq import auth


def token(path, mode: int = 0o644) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("t" * 32)
    os.chmod(path, mode)
    return str(path)


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_token_readable_by_others_is_made_private(tmp_path):
    path = token(tmp_path / ".ray" / "auth_token", 0o644)
    got = auth.check_token_auth(mode="token", environ={}, home=str(tmp_path))
    assert got == auth.TokenAuthStatus("token", path, permissions_fixed=True, warning=None)
    assert mode_of(path) == 0o600
    assert got.lines() == [f"made {path} readable by its owner only (mode 0600)"]
    again = auth.check_token_auth(mode="token", environ={}, home=str(tmp_path))
    assert not again.permissions_fixed and again.lines() == []


@pytest.mark.parametrize("before", [0o640, 0o604, 0o666, 0o755])
def test_only_the_owner_keeps_access(tmp_path, before):
    path = token(tmp_path / "t", before)
    assert auth.make_private(tmp_path / "t")
    assert mode_of(path) & 0o077 == 0 and mode_of(path) & 0o600 == 0o600


def test_a_private_token_is_left_alone(tmp_path):
    path = token(tmp_path / ".ray" / "auth_token", 0o600)
    got = auth.check_token_auth(mode="token", environ={}, home=str(tmp_path))
    assert got.token_path == path and not got.permissions_fixed and got.warning is None


def test_authentication_off_gives_one_line_saying_what_to_set(tmp_path):
    got = auth.check_token_auth(mode="disabled", environ={}, home=str(tmp_path))
    assert got.mode == "disabled" and got.token_path is None and not got.permissions_fixed
    assert "\n" not in got.warning
    assert "RAY_AUTH_MODE=token" in got.warning and "ray get-auth-token --generate" in got.warning
    assert got.lines() == [f"warning: {got.warning}"]


def test_ray_token_sources_in_rays_order(tmp_path):
    home = str(tmp_path)
    default = token(tmp_path / ".ray" / "auth_token")
    elsewhere = token(tmp_path / "elsewhere" / "token")
    assert str(auth.token_path_in_use({}, home)) == default
    assert str(auth.token_path_in_use({auth.TOKEN_PATH_ENV: elsewhere}, home)) == elsewhere
    # $RAY_AUTH_TOKEN wins over every file; a $RAY_AUTH_TOKEN_PATH that is missing is not
    # replaced by ~/.ray/auth_token (Ray fails then)
    assert auth.token_path_in_use({auth.TOKEN_ENV: "x" * 32}, home) is None
    assert auth.token_path_in_use({auth.TOKEN_PATH_ENV: str(tmp_path / "nope")}, home) is None


def test_every_token_file_here_is_made_private(tmp_path):
    default = token(tmp_path / ".ray" / "auth_token")
    elsewhere = token(tmp_path / "elsewhere" / "token")
    got = auth.check_token_auth(
        mode="token", environ={auth.TOKEN_PATH_ENV: elsewhere}, home=str(tmp_path)
    )
    assert got.token_path == elsewhere and got.permissions_fixed
    assert mode_of(default) == mode_of(elsewhere) == 0o600


def test_a_token_that_cannot_be_made_private_is_reported(tmp_path, monkeypatch):
    path = token(tmp_path / ".ray" / "auth_token")

    def refuse(p, mode):
        raise PermissionError(1, "Operation not permitted", str(p))

    monkeypatch.setattr(auth.os, "chmod", refuse)
    got = auth.check_token_auth(mode="token", environ={}, home=str(tmp_path))
    assert not got.permissions_fixed
    assert f"chmod 600 {path}" in got.warning and "\n" not in got.warning


def test_a_driver_without_the_token_proves_authentication_off(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(auth, "local_auth_mode", lambda: "disabled")
    assert auth.cluster_auth_mode() == "disabled"


def test_an_unknown_mode_is_said(tmp_path):
    got = auth.check_token_auth(mode="unknown", environ={}, home=str(tmp_path))
    assert "could not tell" in got.warning


def test_the_session_ray_is_asked(ray_session, tmp_path):
    # ray.init turns token authentication on unless RAY_AUTH_MODE says otherwise
    off = os.environ.get(auth.MODE_ENV, "").lower() == "disabled"
    expected = "disabled" if off else "token"
    assert auth.cluster_auth_mode() == expected
    got = auth.check_token_auth(environ={}, home=str(tmp_path))
    assert got.mode == expected and (got.warning is None) == (not off)
