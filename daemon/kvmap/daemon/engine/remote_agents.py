"""The remote NIXL agents this daemon has loaded, keyed the way NIXL keys
them: by agent name (global in the agent), with the peer targets that
presented each.

A target whose agent changed (a restarted daemon) is detached from the old
agent, which is removed once no target presents it. A target may not
present an agent another target presented with different metadata, and the
metadata must name the agent the peer claims: otherwise one peer (a fake,
or a compromised one) could replace a real peer's agent under its name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import structlog

from kvmap.core.errors import FailedPrecondition
from kvmap.daemon.adapters.nixl_port import NixlPort
from kvmap.daemon.adapters.nixl_thread import NixlRunner

log = structlog.get_logger("kvmapd.remote_agents")


@dataclass
class RemoteAgent:
    name: str
    daemon_instance: str
    # The metadata last loaded: it lists the remote's registered memory, so a
    # remote that registered new memory is loaded again (NIXL updates a known
    # agent in place; transfers over lists prepared before still work).
    metadata: bytes
    targets: set[str] = field(default_factory=set)


class RemoteAgents:
    def __init__(
        self,
        agent: NixlPort,
        nixl: NixlRunner,
        on_agent_changed: Callable[[str], Awaitable[None]],
    ) -> None:
        self._agent = agent
        self._nixl = nixl
        # Called with an agent name whose prepared lists must go (it was
        # reloaded or removed).
        self._on_agent_changed = on_agent_changed
        self._by_name: dict[str, RemoteAgent] = {}
        self._by_target: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def agent_of(self, target: str) -> str | None:
        return self._by_target.get(target)

    async def detach(self, target: str) -> None:
        name = self._by_target.pop(target, None)
        if name is None:
            return
        known = self._by_name[name]
        known.targets.discard(target)
        if not known.targets:
            await self._on_agent_changed(name)
            await self._nixl(partial(self._agent.remove_remote, name))
            del self._by_name[name]

    async def load(self, target: str, name: str, instance: str, metadata: bytes) -> None:
        """Make ``name`` (as ``target`` presents it) the loaded agent of ``target``."""
        current = self._by_target.get(target)
        if current is not None and current != name:
            log.info("remote_agent_changed", target=target, old=current, new=name)
            await self.detach(target)
        known = self._by_name.get(name)
        if known is not None and known.metadata == metadata:
            known.targets.add(target)
            self._by_target[target] = name
            return
        if known is not None and known.targets - {target}:
            raise FailedPrecondition(
                f"remote daemon {target} presents agent {name!r}, which "
                f"{sorted(known.targets - {target})[0]} presents with other metadata"
            )
        loaded = await self._nixl(partial(self._agent.add_remote, metadata))
        if loaded != name:
            # The metadata was another agent's: undo what loading it did.
            other = self._by_name.get(loaded)
            if other is not None:
                await self._nixl(partial(self._agent.add_remote, other.metadata))
                await self._on_agent_changed(loaded)
            else:
                await self._nixl(partial(self._agent.remove_remote, loaded))
            raise FailedPrecondition(
                f"remote daemon {target} claims agent {name!r} but sent the metadata of {loaded!r}"
            )
        # Reloading (the remote registered more memory) keeps lists prepared
        # before valid: NIXL updates the agent in place (measured).
        targets = (known.targets if known else set()) | {target}
        self._by_name[name] = RemoteAgent(name, instance, metadata, targets)
        self._by_target[target] = name

    async def close(self) -> None:
        for name in list(self._by_name):
            await self._nixl(partial(self._agent.remove_remote, name))
        self._by_name.clear()
        self._by_target.clear()
