"""An HTTP session with one Airflow's REST API, logged in as one user, that rides out an api-server
which does not answer for a while: the transport under ``airflow_api.AirflowApi`` (its calls).

A JWT is fetched on first use and again when it expires. ``answered`` tries a call again while the
API does not answer (refused, reset or timed out: the api-server restarts or hangs; a 5xx: its
database restarts, fails over or is locked) for up to two minutes.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

_HTTP_TIMEOUT_S = 30.0
# An api-server may not answer for a while (a supervisor restarting it); waits tolerate this long.
_API_UNAVAILABLE_GRACE_S = 120.0
_API_RETRY_SECONDS = 2.0
_T = TypeVar("_T")


class AirflowError(RuntimeError):
    """Airflow could not start, answer or stop as expected."""


class AirflowUnavailable(AirflowError):
    """The api-server answered 5xx (it is up but cannot serve now: its database restarts), or did not
    answer at all for longer than a call waits."""


class AirflowSession:
    """The REST API at ``url`` as ``username``.

    ``check_alive`` is called before every try of a call: it raises when the Airflow behind the API
    is gone for good (not merely restarting its api-server), so a call ends instead of waiting out
    its grace.
    """

    def __init__(
        self,
        url: str | Callable[[], str],
        username: str,
        password: str,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        # A callable is asked on every request: an Airflow restarted under a long wait may come back
        # on another port, and the client must follow it.
        self._url = url if callable(url) else (lambda: url)
        self._username, self._password = username, password
        self._check_alive = check_alive or (lambda: None)
        self._token: str | None = None
        self._log = logging.getLogger(type(self).__module__)  # the calls' module: airflow_api

    @property
    def url(self) -> str:
        return self._url()

    def log_out(self) -> None:
        """Forget the token: the next request logs in again (the Airflow behind the URL changed)."""
        self._token = None

    def token(self) -> str:
        """A JWT for this client's user (``POST /auth/token``), fetched once and kept until it expires."""
        if self._token is None:
            status, body = self.request(
                "POST", "/auth/token", {"username": self._username, "password": self._password}, auth=False
            )
            if status not in (200, 201):
                raise_for(status, f"POST /auth/token answered {status}: {error_text(body)}")
            self._token = body["access_token"]
        return self._token

    def answered(
        self, call: Callable[[], _T], poll_seconds: float = _API_RETRY_SECONDS, resend_unanswered: bool = True
    ) -> _T:
        """``call()``, tried again while the API does not answer (refused, reset or timed out: the
        api-server restarts or hangs; a 5xx: its database restarts, fails over or is locked) for up to
        _API_UNAVAILABLE_GRACE_S; AirflowUnavailable after that, AirflowGone (from ``check_alive``)
        when the instance itself is gone. ``call`` must be safe to repeat; one that is not after a
        request that may have been served (``resend_unanswered=False``) is repeated only after a 5xx or
        a refused connection (nothing was sent)."""
        unanswered_since: float | None = None
        while True:
            self._check_alive()
            try:
                result = call()
            except (OSError, AirflowUnavailable) as exc:
                if isinstance(exc, OSError) and not resend_unanswered and not _refused(exc):
                    raise
                now = time.monotonic()
                if unanswered_since is None:
                    unanswered_since = now
                    self._log.info("the Airflow API does not answer (%s); waiting for it", exc)
                elif now - unanswered_since > _API_UNAVAILABLE_GRACE_S:
                    waited = now - unanswered_since
                    raise AirflowUnavailable(f"the Airflow API did not answer for {waited:.0f} s") from exc
                time.sleep(poll_seconds)
                continue
            if unanswered_since is not None:
                self._log.info("the Airflow API answers again")
            return result

    def get_json(self, path: str, auth: bool = True) -> dict[str, Any]:
        """``GET path``'s JSON body, waiting for an api-server that does not answer (``answered``);
        AirflowError for any other answer but 200 (a 404: no such run)."""
        return self.answered(lambda: self.get_once(path, auth))

    def get_once(self, path: str, auth: bool = True) -> dict[str, Any]:
        """``GET path``'s JSON body, one try (for probes whose callers poll, and inside a retried call)."""
        status, body = self.request("GET", path, auth=auth)
        if status != 200:
            raise_for(status, f"GET {path} answered {status}: {error_text(body)}")
        return body

    def request(
        self, method: str, path: str, payload: dict[str, Any] | None = None, auth: bool = True
    ) -> tuple[int, Any]:
        status, body = self._send(method, path, payload, auth)
        if status == 401 and auth:
            self._token = None  # expired: log in again once
            status, body = self._send(method, path, payload, auth)
        return status, body

    def _send(self, method: str, path: str, payload: dict[str, Any] | None, auth: bool) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                return response.status, _decode(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())


def _refused(exc: OSError) -> bool:
    """Whether the request never reached a server (urllib wraps the refusal in a URLError)."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, ConnectionRefusedError)


def raise_for(status: int, message: str) -> NoReturn:
    """AirflowUnavailable for a 5xx (worth another try), AirflowError for any other refusal."""
    raise (AirflowUnavailable if status >= 500 else AirflowError)(message)


def quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw.decode(errors="replace")


def error_text(body: Any) -> str:
    """The human part of a FastAPI error body: ``detail`` as a string or a list of pydantic errors."""
    if not isinstance(body, dict):
        return str(body)
    detail = body.get("detail", body)
    if isinstance(detail, list):
        return "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', []))}: {item.get('msg')}"
            if isinstance(item, dict)
            else str(item)
            for item in detail
        )
    return detail if isinstance(detail, str) else json.dumps(detail)
