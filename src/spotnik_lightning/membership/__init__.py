"""Membership: the value type, the store protocol, its two implementations and a URL opener.

Store URLs accepted by :func:`open_store`:

* ``etcd://host:port[,host:port...]`` — :class:`EtcdStore` (endpoints tried in order);
* ``embedded://host:port`` or bare ``host:port`` — client of an :class:`EmbeddedStoreServer`.

IPv6 hosts are written in brackets: ``[::1]:2379``. Importing this package does not import grpc:
the etcd client library is loaded when the first EtcdStore is built.
"""

from __future__ import annotations

from datetime import timedelta

from spotnik_lightning.api import ConfigError
from spotnik_lightning.membership.embedded import EmbeddedStore, EmbeddedStoreServer
from spotnik_lightning.membership.etcd import EtcdStore
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import Member, Membership

__all__ = [
    "EmbeddedStore",
    "EmbeddedStoreServer",
    "EtcdStore",
    "Member",
    "Membership",
    "MembershipStore",
    "open_store",
    "parse_endpoints",
]

_FORMS = "etcd://host:port[,host:port...], embedded://host:port or host:port"


def _parse_one(item: str, text: str) -> tuple[str, int]:
    host, sep, port = item.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"IPv6 host must be in brackets, e.g. [::1]:2379: {item!r} in {text!r}")
    if not sep or not host.strip():
        raise ConfigError(f"endpoint {item!r} in {text!r} must be host:port with a non-empty host")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {item!r} in {text!r}: port must be a number in 1..65535")
    return host.strip(), int(port)


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """Parse ``host:port[,host:port...]`` into ``[(host, port), ...]`` (order kept).

    Raises ConfigError naming the bad entry: empty list or entry, missing or empty host, port not
    numeric or outside 1..65535, unbracketed IPv6 host.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"expected host:port[,host:port...], got {text!r}")
    return [_parse_one(item, text) for item in text.split(",")]


def open_store(url: str, run_id: str, timeout: timedelta = timedelta(seconds=5)) -> MembershipStore:
    """Build the store client ``url`` names, for run ``run_id``. Does not contact the store.

    Raises ConfigError on a malformed url (naming it and the accepted forms), a bad run id or
    timeout, or a missing etcd client library.
    """
    if not isinstance(url, str):
        raise ConfigError(f"bad membership store url {url!r}: expected {_FORMS}")
    scheme, sep, rest = url.strip().partition("://")
    kind = "etcd" if sep and scheme == "etcd" else "embedded" if (not sep or scheme == "embedded") else None
    if kind is None:
        raise ConfigError(f"bad membership store url {url!r}: unknown scheme {scheme!r}; expected {_FORMS}")
    try:
        endpoints = parse_endpoints(rest if sep else url)
    except ConfigError as exc:
        raise ConfigError(f"bad membership store url {url!r}: {exc}; expected {_FORMS}") from exc
    if kind == "etcd":
        return EtcdStore(endpoints, run_id, timeout)
    if len(endpoints) != 1:
        raise ConfigError(f"bad membership store url {url!r}: an embedded store has exactly one endpoint")
    return EmbeddedStore(*endpoints[0], run_id, timeout)
