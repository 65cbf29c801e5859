"""Who may call what: the client key opens the OpenAI endpoints, the admin key ``/debug/*``.

===================  ================  ===============
keys configured      OpenAI endpoints  ``/debug/*``
===================  ================  ===============
none                 open              open
``api_key``          ``api_key``       closed (403)
``admin_api_key``    open              ``admin_api_key``
both                 ``api_key``       ``admin_api_key``
===================  ================  ===============

With only a client key, ``/debug/*`` stays closed rather than falling back to that key:
``/debug/route`` answers, for any prompt, how many of its blocks each backend holds, so a
client could learn what other tenants' prompts begin with. ``/metrics`` takes the same
column: diffing its hit counters around one request tells whether a guessed prompt is
cached (Prometheus scrapes it with the admin key as its bearer token). ``/health``,
``/livez`` and ``/readyz`` stay open (load balancers and probes call them without keys).

Keys are compared with :func:`hmac.compare_digest` over bytes, so the time taken does not
depend on how many leading characters of a guess were right.

With ``router.tenants``, a tenant's key opens the OpenAI endpoints too, and the request is
that tenant's (:mod:`router.http.tenants`); without ``api_key`` nothing else does. Tenants
count as a client key for ``/debug/*`` and ``/metrics``: closed without an admin key.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pydantic import SecretStr

from kvconfig import bearer_matches
from kvconfig import RouterSettings
from router.http.errors import BadRequest, Forbidden, Unauthorized
from router.http.tenants import Tenant, Tenants


def _secret(key: SecretStr | None) -> bytes | None:
    return None if key is None else key.get_secret_value().encode()


def _matches(headers: Mapping[str, str], key: bytes) -> bool:
    return bearer_matches(headers.get("authorization"), key)


def _one_authorization(headers: Mapping[str, str]) -> None:
    """Refuse a request with two ``Authorization`` headers: the router would judge the first
    while a server behind it may read the last."""
    getlist = getattr(headers, "getlist", None)
    if getlist is not None and len(getlist("authorization")) > 1:
        raise BadRequest("the request has more than one Authorization header", code="duplicate_header")


class Access:
    """The router's two keys and its tenants' (see the module docstring for what each one opens)."""

    def __init__(self, settings: RouterSettings, tenants: Tenants | None = None) -> None:
        self._client = _secret(settings.api_key)
        self._admin = _secret(settings.admin_api_key)
        self.tenants = tenants if tenants is not None and tenants.keys else None

    @property
    def admin_same_as_client(self) -> bool:
        return self._admin is not None and self._client is not None and hmac.compare_digest(self._admin, self._client)

    def client(self, headers: Mapping[str, str]) -> Tenant | None:
        """Raise :class:`Unauthorized` unless the OpenAI endpoints are open to this request;
        the tenant it is (``anonymous`` for ``api_key``), or None without tenants."""
        _one_authorization(headers)
        if self.tenants is not None:
            tenant = self.tenants.identify(headers.get("authorization"))
            if tenant is None and self._client is not None and _matches(headers, self._client):
                tenant = self.tenants.anonymous
            if tenant is None:
                raise Unauthorized("Incorrect API key provided.")
            return tenant
        if self._client is not None and not _matches(headers, self._client):
            raise Unauthorized("Incorrect API key provided.")
        return None

    def admin(self, headers: Mapping[str, str], what: str = "Admin endpoints are") -> None:
        """Raise unless ``/debug/*`` (and ``/metrics``) is open to this request."""
        _one_authorization(headers)
        if self._admin is not None:
            if not _matches(headers, self._admin):
                raise Unauthorized("Incorrect admin API key provided.")
        elif self._client is not None or self.tenants is not None:
            raise Forbidden(f"{what} disabled: the router has no admin_api_key.")
