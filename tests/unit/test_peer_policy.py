"""The pure rules of the data plane's allow-lists (``core.peer_policy``) and
their configuration (``DaemonConfig`` validation, ``kvmapd serve`` flags)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.core.config import DaemonConfig
from kvmap.core.peer_policy import (
    LOOPBACK,
    PeerPolicy,
    grpc_peer_address,
    in_networks,
    parse_identity,
    parse_network,
)
from kvmap.daemon.adapters.config_files import load_config

ipv4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
ipv6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


def _is_network(value: str) -> bool:
    try:
        parse_network(value)
    except ValueError:
        return False
    return True


# A dotted quad of digit labels ("0.0.0.0") is an address, not a host name.
host_names = (
    st.lists(labels, min_size=1, max_size=4).map(".".join).filter(lambda n: not _is_network(n))
)


def policy(
    accept: tuple[str, ...] = LOOPBACK, allow: tuple[str, ...] = LOOPBACK, ids: tuple[str, ...] = ()
) -> PeerPolicy:
    return PeerPolicy.parse(accept, allow, ids)


@given(address=ipv4, prefix=st.integers(0, 32))
def test_an_ipv4_address_is_in_a_network_exactly_when_its_prefix_bits_match(
    address: ipaddress.IPv4Address, prefix: int
) -> None:
    """Membership equals the bitwise definition, and an IPv4-mapped IPv6 form of the
    same client (a dual-stack listener's view) is judged like the plain address."""
    net = ipaddress.IPv4Network(f"{address}/{prefix}", strict=False)
    probe = ipaddress.IPv4Address(int(address) ^ 1)
    mask = (2**32 - 1) ^ (2 ** (32 - prefix) - 1)
    expected = int(probe) & mask == int(net.network_address)
    assert in_networks(probe, [net]) is expected
    mapped = ipaddress.IPv6Address(f"::ffff:{probe}")
    assert in_networks(mapped, [net]) is expected


@given(address=ipv6)
def test_the_default_accepts_loopback_and_nothing_else(address: ipaddress.IPv6Address) -> None:
    """Loopback (127/8, ::1) is the whole default, for both lists."""
    default = policy()
    assert default.accepts_address(ipaddress.ip_address("127.0.0.1"))
    assert default.accepts_address(ipaddress.ip_address("127.255.0.9"))
    assert default.accepts_address(ipaddress.ip_address("::1"))
    assert not default.accepts_address(ipaddress.ip_address("10.0.0.1"))
    assert not default.accepts_address(None)
    assert default.accepts_address(address) is (address == ipaddress.IPv6Address("::1"))
    assert default.allows_addresses([address]) is (address == ipaddress.IPv6Address("::1"))


@given(inside=st.lists(st.integers(0, 255), min_size=1, max_size=5), outside=st.integers(0, 255))
def test_every_resolved_address_must_be_allowed(inside: list[int], outside: int) -> None:
    """A name resolving to several addresses is allowed only if all are: one outside
    address (a rebinding answer) denies, whatever its position."""
    allowed = policy(allow=("10.1.0.0/16",))
    addresses = [ipaddress.ip_address(f"10.1.0.{i}") for i in inside]
    assert allowed.allows_addresses(addresses)
    stranger = ipaddress.ip_address(f"10.2.0.{outside}")
    for at in range(len(addresses) + 1):
        assert not allowed.allows_addresses([*addresses[:at], stranger, *addresses[at:]])
    assert not allowed.allows_addresses([])


@given(name=host_names, other=host_names)
def test_names_match_exactly_and_case_insensitively(name: str, other: str) -> None:
    """A listed host name allows itself (any case, trailing dot) and no other name."""
    allowed = policy(allow=(name,))
    assert allowed.allows_name(name.upper())
    assert allowed.allows_name(name + ".")
    assert allowed.allows_name(other) is (other == name)
    assert allowed.allow_names == frozenset({name})


@given(domain=host_names, path=st.from_regex(r"(/[A-Za-z0-9._-]{1,12}){1,4}", fullmatch=True))
def test_an_identity_matches_only_an_equal_san(domain: str, path: str) -> None:
    """SPIFFE IDs match exactly (trust domain case-insensitive, path case-sensitive);
    a certificate of the same trust domain with another path, or no SAN, is refused."""
    spiffe = f"spiffe://{domain}{path}"
    allowed = policy(ids=(spiffe,))
    assert allowed.accepts_identities([f"spiffe://{domain.upper()}{path}"])
    assert allowed.accepts_identities(["other.example", spiffe])
    assert not allowed.accepts_identities([f"spiffe://{domain}{path}x"])
    assert not allowed.accepts_identities([f"spiffe://{domain}"])
    assert not allowed.accepts_identities([])
    assert not policy().accepts_identities([spiffe])


def test_dns_identities_compare_like_host_names() -> None:
    """A DNS identity matches its SAN in any case; a sibling name does not."""
    allowed = policy(ids=("Decode-0.Kvmap.svc",))
    assert allowed.accepts_identities(["decode-0.kvmap.svc"])
    assert not allowed.accepts_identities(["decode-1.kvmap.svc", "kvmap.svc"])


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1"),
        ("ipv6:%5B::1%5D:37638", "::1"),
        ("ipv6:[fe80::1]:1", "fe80::1"),
        ("unix:/run/kvmap/kvmapd.sock", None),
        ("ipv4:not-an-address:1", None),
        ("", None),
    ],
)
def test_grpc_peer_strings(peer: str, expected: str | None) -> None:
    """gRPC's peer strings (as grpcio 1.85 writes them, IPv6 percent-encoded) give the
    client's address; Unix sockets and garbage give none (and so are never accepted)."""
    got = grpc_peer_address(peer)
    assert (str(got) if got else None) == expected


@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        ("accept", ("10.0.0.0/8", "decode.example"), "peer_accept: 'decode.example'"),
        ("allow", ("10.0.0.0/33",), "peer_allow: '10.0.0.0/33'"),
        ("allow", ("bad_name!",), "peer_allow: 'bad_name!'"),
        ("ids", ("spiffe://td:8080/x",), "peer_identities"),
        ("ids", ("*.example",), "peer_identities"),
    ],
)
def test_bad_entries_are_refused_by_name(field: str, values: tuple[str, ...], message: str) -> None:
    """Each list names the entry it cannot parse."""
    kwargs = {"accept": LOOPBACK, "allow": LOOPBACK, "ids": ()} | {field: values}
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        policy(**kwargs)


def test_parse_identity_normalises() -> None:
    """Trust domains and DNS names are lower-cased; SPIFFE paths keep their case."""
    assert parse_identity("spiffe://Example.ORG/ns/A") == "spiffe://example.org/ns/A"
    assert parse_identity("Pod.Example.") == "pod.example"


def test_mutual_tls_without_identities_refuses_to_start() -> None:
    """Any certificate from the CA is no authorization: tls_client_ca needs peer_identities,
    and identities need a certificate of this daemon's own."""
    tls = DaemonConfig(socket="/s", tls_cert="c", tls_key="k", tls_client_ca="ca")
    with pytest.raises(ValueError, match="tls_client_ca needs peer_identities"):
        tls.validated()
    ok = DaemonConfig(
        socket="/s", tls_cert="c", tls_key="k", tls_client_ca="ca", peer_identities=("a.b",)
    ).validated()
    assert ok.peer_policy.identities == frozenset({"a.b"})
    with pytest.raises(ValueError, match="peer_identities need tls_cert"):
        DaemonConfig(socket="/s", peer_identities=("a.b",)).validated()


def test_lists_come_from_toml_arrays_and_repeated_flags(tmp_path: Path) -> None:
    """TOML arrays load as tuples; repeated flags replace the file's list; a string
    where an array belongs is refused rather than read as its characters."""
    path = tmp_path / "kvmapd.toml"
    path.write_text('socket = "/s"\npeer_allow = ["10.0.0.0/8", "prefill.example"]\n')
    config = load_config(str(path), {"peer_accept": ["192.168.0.0/16", "::1"]})
    assert config.peer_allow == ("10.0.0.0/8", "prefill.example")
    assert config.peer_accept == ("192.168.0.0/16", "::1")
    assert config.peer_policy.allow_names == frozenset({"prefill.example"})
    path.write_text('socket = "/s"\npeer_accept = "10.0.0.0/8"\n')
    with pytest.raises(ValueError, match=r'peer_accept = "10\.0\.0\.0/8" in .*: expected a list'):
        load_config(str(path), {})


def test_serve_flags_are_repeatable() -> None:
    """--peer-allow, --peer-accept and --peer-identity each collect every occurrence."""
    import argparse

    from kvmap.daemon.cli import kvmapd

    parser = argparse.ArgumentParser()
    kvmapd._add_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--peer-allow", "10.0.0.0/8", "--peer-allow", "p.example",
         "--peer-accept", "10.1.0.0/16", "--peer-identity", "spiffe://td/a",
         "--peer-identity", "spiffe://td/b"]
    )  # fmt: skip
    assert args.peer_allow == ["10.0.0.0/8", "p.example"]
    assert args.peer_accept == ["10.1.0.0/16"]
    assert args.peer_identities == ["spiffe://td/a", "spiffe://td/b"]
