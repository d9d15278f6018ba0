"""What a failed load's log line adds when the failure is a configuration
the operator must fix rather than a transient one: two daemons that do not
accept each other as peers. Without a shared peer secret (or mutual TLS)
every load fails and vLLM recomputes, and the daemons' own word on it is a
line at their start; so the engine's warning names the cause and the fix.

The daemons' messages are matched as kvmapd words them
(``kvmap.core.peer_policy``): the owner's refusal of an unauthorized peer
reaches this engine inside the decode daemon's error ("remote daemon
HOST:PORT: PERMISSION_DENIED: this peer is not authorized ..."), and the
decode daemon's own refusal to dial a target is its one message.
"""

from __future__ import annotations

from kvmap.core.peer_policy import INBOUND_DENIED, OUTBOUND_DENIED

REFUSED_PEER = (
    "the remote kvmapd does not accept this pod's kvmapd as a peer (no peer secret or "
    "another one, an address outside its --peer-accept, or no peer authentication "
    "configured there): start every kvmapd with the same --peer-secret-file, each "
    "peer's address in the other's --peer-accept, or with mutual TLS and --peer-identity "
    "(docs/vllm.md, docs/security.md); `kvmapctl status` on the remote daemon says why "
    "it refused"
)
UNDIALLED_PEER = (
    "this pod's kvmapd may not dial that remote_target: add the remote pods' network "
    "or host name to its --peer-allow (docs/security.md)"
)


def fix_for(error: str) -> str:
    """The cause and fix of a failed load's ``error`` when it is one of the
    peer configurations above, as a sentence to append; "" otherwise."""
    if INBOUND_DENIED in error:
        return f". Cause: {REFUSED_PEER}"
    if OUTBOUND_DENIED in error:
        return f". Cause: {UNDIALLED_PEER}"
    return ""
