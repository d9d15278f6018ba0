"""Who may talk to this daemon over TCP, and whom it may dial: the pure
matching rules of the data plane's allow-lists.

NIXL READs need no lease: whoever holds a daemon's agent metadata can read all
the memory it registered. So the metadata (``Peer``) and the memory addresses
(``RegionMaps`` on TCP) go only to authorized peers, and a daemon dials only
authorized peers (a ``remote_target`` comes from an HTTP body, so an open dialer
would be a port scanner).

- Inbound with mutual TLS: the client certificate's SANs (DNS names,
  ``spiffe://`` URIs) must match an entry of ``identities``.
- Inbound without client certificates: the TCP source address must lie in
  ``accept``.
- Outbound: the target's host must be a listed name, or every address it
  resolves to must lie in a listed network (with TLS, the server certificate's
  identity is matched as well).

The default of both lists is loopback only. An address alone is not enough
inbound: a neighbour on the same host or in the same pod shares loopback, so
without mutual TLS a caller must also present the pod-scoped peer secret
(``peer_secret_file``; ``secret_matches``), and a daemon with neither refuses
every TCP caller.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK = ("127.0.0.0/8", "::1/128")

# The one answer to a caller that may not do what it asked. Deliberately the
# same whatever failed (unlisted address, DNS error, wrong certificate), so it
# reveals nothing about what lies behind an address or which check failed.
# The hint names the settings, never what this caller lacked: a stranger
# learns nothing it could not read in the docs.
INBOUND_DENIED = (
    "this peer is not authorized (its daemon's operator admits callers with "
    "peer_accept and peer_secret_file, or peer_identity under mutual TLS: docs/security.md)"
)
OUTBOUND_DENIED = "remote_target is not an allowed peer of this daemon"


# gRPC metadata key under which a peer daemon presents the shared peer secret.
PEER_SECRET_METADATA = "kvmap-peer-secret"
# Fewest bytes a peer secret file must hold (``secrets.token_urlsafe(32)``
# writes 43): a short one could be guessed.
MIN_PEER_SECRET_BYTES = 16


def secret_matches(presented: str | bytes | None, secret: bytes) -> bool:
    """Whether a caller presented the peer secret. Both sides are hashed
    first and compared in constant time, so neither the secret's bytes nor
    its length shows in the time a refusal takes."""
    if presented is None:
        return False
    raw = presented.encode("utf-8", "surrogatepass") if isinstance(presented, str) else presented
    return hmac.compare_digest(hashlib.sha256(raw).digest(), hashlib.sha256(secret).digest())


_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def is_host_name(value: str) -> bool:
    """An RFC 1123 host name (letters, digits, hyphens; dot-separated labels)."""
    name = value.lower().rstrip(".")
    if not name or len(name) > 253:
        return False
    return all(_LABEL.match(label) for label in name.split("."))


def parse_network(value: str) -> IPNetwork:
    """A CIDR (``10.0.0.0/8``) or a single address (taken as /32 or /128)."""
    return ipaddress.ip_network(value.strip(), strict=False)


def parse_identity(value: str) -> str:
    """A certificate identity: a ``spiffe://`` URI or a DNS name, normalised."""
    if value.startswith("spiffe://"):
        parsed = urllib.parse.urlsplit(value)
        if not is_host_name(parsed.netloc) or parsed.query or parsed.fragment:
            raise ValueError(
                f"{value!r}: a SPIFFE ID is spiffe://TRUST-DOMAIN/PATH (no port, query, fragment)"
            )
        return f"spiffe://{parsed.netloc.lower()}{parsed.path}"
    if is_host_name(value):
        return value.lower().rstrip(".")
    raise ValueError(f"{value!r}: expected a DNS name or a spiffe:// URI")


def _plain(address: IPAddress) -> IPAddress:
    # An IPv4 client of a dual-stack socket may appear as ::ffff:a.b.c.d.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def in_networks(address: IPAddress, networks: Iterable[IPNetwork]) -> bool:
    plain = _plain(address)
    return any(plain.version == net.version and plain in net for net in networks)


def grpc_peer_address(peer: str) -> IPAddress | None:
    """The IP address of a gRPC peer string (``ipv4:1.2.3.4:5``,
    ``ipv6:%5B::1%5D:5``); None for anything else (Unix sockets, garbage)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = urllib.parse.unquote(rest).rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class PeerPolicy:
    """The three allow-lists, parsed. Build with ``PeerPolicy.parse``."""

    # Networks whose TCP clients may call Peer/RegionMaps (no client certificates).
    accept: tuple[IPNetwork, ...]
    # What this daemon may dial: networks and exact host names.
    allow_networks: tuple[IPNetwork, ...]
    allow_names: frozenset[str]
    # Certificate identities (DNS names, spiffe:// URIs) of peers, both ways.
    identities: frozenset[str]

    @classmethod
    def parse(
        cls, accept: Sequence[str], allow: Sequence[str], identities: Sequence[str]
    ) -> PeerPolicy:
        """Raises ValueError naming the first entry that is neither a CIDR nor
        (for ``allow``) a host name, or (for ``identities``) not an identity."""
        accepted = tuple(_network_entry(v, "peer_accept") for v in accept)
        networks, names = [], set()
        for value in allow:
            try:
                networks.append(parse_network(value))
            except ValueError:
                if not is_host_name(value):
                    raise ValueError(
                        f"peer_allow: {value!r} is neither a CIDR nor a host name"
                    ) from None
                names.add(value.lower().rstrip("."))
        try:
            ids = frozenset(parse_identity(v) for v in identities)
        except ValueError as err:
            raise ValueError(f"peer_identities: {err}") from None
        return cls(accepted, tuple(networks), frozenset(names), ids)

    def accepts_address(self, address: IPAddress | None) -> bool:
        """Inbound without client certificates: is this source address listed?"""
        return address is not None and in_networks(address, self.accept)

    def accepts_identities(self, sans: Iterable[str]) -> bool:
        """Inbound or outbound with mutual TLS: does any SAN of the peer's
        certificate match a listed identity? (Exact match; DNS names compare
        case-insensitively. Nothing matches an empty list.)"""
        return any(_normalised_san(san) in self.identities for san in sans)

    def allows_name(self, host: str) -> bool:
        """Outbound: is this host name listed by name (no resolution needed)?"""
        return host.lower().rstrip(".") in self.allow_names

    def allows_addresses(self, addresses: Sequence[IPAddress]) -> bool:
        """Outbound: does every address a target resolved to lie in a listed
        network? (All of them: the resolver's order must not matter.)"""
        return bool(addresses) and all(in_networks(a, self.allow_networks) for a in addresses)


def _network_entry(value: str, field: str) -> IPNetwork:
    try:
        return parse_network(value)
    except ValueError:
        raise ValueError(f"{field}: {value!r} is not a CIDR") from None


def _normalised_san(san: str) -> str:
    if san.startswith("spiffe://"):
        try:
            return parse_identity(san)
        except ValueError:
            return ""
    return san.lower().rstrip(".")
