"""Who may do what: basic auth, the ``access`` resolver, and CSRF tokens.

CSRF: a double submit bound to a per-process secret. The page sets a random nonce
in a cookie and puts HMAC(secret, nonce) in each form; a POST must bring both, and
they must match. Another site can make the browser send the cookie, but cannot
read it, so it cannot compute the form's token.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import inspect
import os
import secrets
from collections.abc import Callable, Collection, Mapping
from typing import Any

ACTIONS = ("pause", "resume", "trigger", "resign")
CSRF_COOKIE = "pgcoord_csrf"
CSRF_FIELD = "csrf"
USER_ENV, PASSWORD_ENV = "PGCOORD_WEB_USER", "PGCOORD_WEB_PASSWORD"
#: The CSRF key shared by the worker processes of one deployment (else per process).
SECRET_ENV = "PGCOORD_WEB_SECRET"


def basic_auth_from_env() -> tuple[str, str] | None:
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if not user and not password:
        return None
    if not (user and password):
        raise ValueError(f"set both {USER_ENV} and {PASSWORD_ENV} for basic auth, or neither")
    if ":" in user:
        raise ValueError(f"{USER_ENV} cannot contain ':' (basic auth splits on it)")
    return user, password


def check_basic(header: str | None, expected: tuple[str, str]) -> str | None:
    """The user name when ``header`` carries the expected credentials, else None.
    Both parts are compared in constant time, whatever matched first."""
    if not header or header[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):  # ValueError: non-ASCII in the header
        return None
    user, sep, password = decoded.partition(":")
    ok_user = hmac.compare_digest(user.encode(), expected[0].encode())
    ok_password = hmac.compare_digest(password.encode(), expected[1].encode())
    return user if (sep and ok_user and ok_password) else None


Access = Callable[[Any], Any]


def check_access(access: Access | None) -> Access | None:
    if access is not None and not callable(access):
        raise TypeError("access must be a callable access(request) returning 'all', 'read_only' "
                        f"or a set of action names, not {access!r}")
    return access


async def allowed_actions(access: Access | None, request: Any) -> frozenset[str]:
    """The actions ``access(request)`` grants: None (the default) grants none."""
    if access is None:
        return frozenset()
    granted = access(request)
    if inspect.isawaitable(granted):
        granted = await granted
    if granted == "all":
        return frozenset(ACTIONS)
    if granted == "read_only" or granted is None:
        return frozenset()
    # A mapping reads as {action: allowed?}: its keys would grant what it denies.
    if isinstance(granted, (str, Mapping)) or not isinstance(granted, Collection):
        raise TypeError(f"access(request) returned {granted!r}: return 'all', 'read_only' "
                        "or a set of action names")
    unknown = set(granted) - set(ACTIONS)
    if unknown:
        raise TypeError(f"access(request) granted unknown action(s) {sorted(unknown)}; "
                        f"the actions are {', '.join(ACTIONS)}")
    return frozenset(granted)


class Csrf:
    def __init__(self) -> None:
        # Behind `uvicorn --workers N` a page drawn by one process posts to another:
        # they must share the key, which only the deployment can give them all.
        shared = os.environ.get(SECRET_ENV, "")
        self._secret = (hashlib.sha256(b"pgcoord.web csrf\0" + shared.encode()).digest() if shared
                        else secrets.token_bytes(32))

    def new_nonce(self) -> str:
        return secrets.token_urlsafe(18)

    def token(self, nonce: str) -> str:
        return hmac.new(self._secret, nonce.encode(), hashlib.sha256).hexdigest()

    def valid(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or not token:
            return False
        return hmac.compare_digest(self.token(nonce), token)
