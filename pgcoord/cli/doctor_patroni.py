"""``pgcoord doctor --patroni URL``: Patroni's settings against what pgcoord relies on.

Patroni's REST API (``/cluster``, ``/config``) is read with the standard library: no
dependency for one optional check. The verdicts are pure functions of what it
answered, tested against a real cluster configured to earn each
(tests/ha_patroni/test_patroni_doctor.py) and against REST APIs that answer badly
(tests/integration/test_doctor_patroni_rest.py):

* ``patroni``: ``synchronous_mode`` off → warn: a failover may promote a standby that
  lacks the last commits, the last fence among them, so a fence can go back;
* ``patroni_ttl``: a failover waits for the leader key to expire (Patroni's ``ttl``)
  plus a loop (``loop_wait``) before a standby is promoted. A pgcoord ttl shorter
  than that cannot ride a failover: every term and lease ends and is taken again with
  a greater fence. Safe, but leaders change on every failover: warn, so that it is
  chosen, not met. pgcoord's ttls come from ``--ttl``, else from the live leases'
  rows (``expires_at - renewed_at``: what the deployment really uses);
* ``patroni_members``: a standby not streaming, or lagging past
  ``maximum_lag_on_failover`` (Patroni will not promote it), or none → warn;
* ``patroni_failsafe``: ``failsafe_mode`` reported (pass either way): off, a primary
  that loses the DCS is demoted to read-only (pgcoord backs off until one is
  promoted); on, it stays writable while every member answers it.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .doctor import FAIL, PASS, WARN, Check

# Patroni's defaults for the dynamic settings read here (docs: "Dynamic configuration").
DEFAULTS = {"ttl": 30, "loop_wait": 10, "retry_timeout": 10, "maximum_lag_on_failover": 1048576,
            "synchronous_mode": False, "failsafe_mode": False, "primary_start_timeout": 300}


@dataclass(frozen=True)
class PatroniView:
    url: str
    config: dict[str, Any]  # GET /config, Patroni's defaults filled in
    cluster: dict[str, Any]  # GET /cluster

    @property
    def scope(self) -> str:
        return str(self.cluster.get("scope", "?"))


def shown(url: str) -> str:
    """``url`` without the password of its user (http://user:secret@host → http://user@host):
    what doctor prints."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}@{host}"))


def fetch(url: str, timeout: float = 3.0) -> PatroniView:
    """``/config`` and ``/cluster`` of the Patroni node at ``url`` (``http://host:8008``,
    ``https://user:password@host:8008`` for a REST API behind basic auth), each read
    within ``timeout`` seconds in all (a socket timeout bounds one read only: a node
    that answers a byte at a time would hold doctor for minutes). ``OSError`` or
    ``ValueError`` when it cannot be read."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{shown(url)!r} is not an http(s) URL (Patroni's REST API: http://host:8008)")
    parts = urlsplit(url.rstrip("/"))
    headers = {"Accept": "application/json"}
    if parts.username is not None:
        # urllib takes user:password@ for a part of the host name: sent as basic auth.
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
    base = urlunsplit(parts)

    def get(path: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(base + path, headers=headers)
        chunks = []
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            while chunk := resp.read1(65536):
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{base + path} did not answer within {timeout:g} s")
        try:
            body = json.loads(b"".join(chunks))
        except ValueError:
            raise ValueError(f"{base + path} did not answer JSON (is it Patroni's REST API?)") from None
        if not isinstance(body, dict):
            raise ValueError(f"{base + path} did not answer a JSON object")
        return body

    return PatroniView(shown(url.rstrip("/")), {**DEFAULTS, **get("/config")}, get("/cluster"))


def unreachable(url: str, exc: BaseException) -> Check:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return Check("patroni", FAIL, f"cannot read Patroni's REST API at {shown(url)}: {reason}",
                 "check --patroni (Patroni's REST API, e.g. http://host:8008) and that Patroni runs")


def _on(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "on", "quorum")


def check_synchronous(view: PatroniView) -> Check:
    mode = view.config.get("synchronous_mode")
    where = f"cluster {view.scope!r} ({view.url})"
    if not _on(mode):
        return Check("patroni", WARN, f"{where}: synchronous_mode is off",
                     "a failover may promote a standby without the last commits, the last fence "
                     "among them (a fence can go back): set synchronous_mode: true "
                     "(patronictl edit-config -s synchronous_mode=true)")
    strict = " (strict)" if _on(view.config.get("synchronous_mode_strict")) else ""
    return Check("patroni", PASS, f"{where}: synchronous_mode {mode}{strict}")


def check_ttl(view: PatroniView, ttls: tuple[float, float] | None) -> Check:
    ttl, loop_wait = float(view.config["ttl"]), float(view.config["loop_wait"])
    failover = ttl + loop_wait
    patroni = (f"Patroni ttl {ttl:g} s + loop_wait {loop_wait:g} s: a failover promotes after up "
               f"to {failover:g} s")
    if ttls is None:
        return Check("patroni_ttl", PASS, f"{patroni}; no pgcoord lease is held now to compare "
                                          "(pass --ttl to compare)")
    low, high = ttls
    ours = f"pgcoord ttl {low:g} s" if low == high else f"pgcoord ttls {low:g}-{high:g} s"
    start = float(view.config.get("primary_start_timeout", DEFAULTS["primary_start_timeout"]))
    restart = (f"; a crashed primary is restarted in place for up to {start:g} s first "
               "(primary_start_timeout)") if start > 0 else ""
    if low < failover:
        return Check("patroni_ttl", WARN, f"{patroni}{restart}; {ours}",
                     f"a failover outlasts a ttl of {low:g} s: every term and lease ends and is taken "
                     f"again with a greater fence (safe, but leaders change each time); a ttl above "
                     f"{failover:g} s rides a failover through, at the cost of a slower takeover "
                     "after a crash")
    return Check("patroni_ttl", PASS, f"{patroni}{restart}; {ours} rides it through")


def check_members(view: PatroniView) -> Check:
    members = [m for m in view.cluster.get("members", []) if isinstance(m, dict)]
    leader = [m for m in members if m.get("role") in ("leader", "standby_leader")]
    standbys = [m for m in members if m not in leader]
    max_lag = int(view.config["maximum_lag_on_failover"])
    problems = []
    if not leader:
        problems.append("no leader")
    for m in standbys:
        name, state, lag = m.get("name"), m.get("state"), m.get("lag")
        if state != "streaming":
            problems.append(f"{name} is {state}, not streaming")
        elif isinstance(lag, int) and lag > max_lag:
            problems.append(f"{name} lags {lag} bytes, past maximum_lag_on_failover {max_lag}")
    if not standbys:
        problems.append("no standby: a failover has nowhere to go")
    described = ", ".join(f"{m.get('name')} {m.get('role')} {m.get('state')}" for m in members)
    if problems:
        return Check("patroni_members", WARN, f"{'; '.join(problems)} ({described})",
                     "a standby that does not stream, or lags past maximum_lag_on_failover, will not "
                     "be promoted: a failover waits or loses writes; see patronictl list")
    return Check("patroni_members", PASS, described)


def check_failsafe(view: PatroniView) -> Check:
    if _on(view.config.get("failsafe_mode")):
        return Check("patroni_failsafe", PASS, "failsafe_mode on: a primary that loses the DCS stays "
                                               "writable while every member answers it")
    return Check("patroni_failsafe", PASS, "failsafe_mode off: a primary that loses the DCS is demoted "
                                           "to read-only until the DCS is back (pgcoord backs off)")


def patroni_checks(urls: list[str], ttls: tuple[float, float] | None) -> list[Check]:
    """The Patroni checks for every ``--patroni`` URL; one cluster's checks once,
    however many of its nodes are named."""
    checks: list[Check] = []
    seen: set[str] = set()
    for url in urls:
        try:
            view = fetch(url)
        except (OSError, ValueError) as exc:
            checks.append(unreachable(url, exc))
            continue
        if view.scope in seen:
            continue
        seen.add(view.scope)
        try:
            checks += [check_synchronous(view), check_ttl(view, ttls), check_members(view),
                       check_failsafe(view)]
        except (TypeError, ValueError) as exc:  # a setting of a type Patroni never gives
            checks.append(Check("patroni", FAIL, f"{view.url} answered a configuration doctor cannot "
                                                 f"read: {exc!r}",
                                "check that --patroni names Patroni's REST API (GET /config, /cluster)"))
    return checks
