"""The prefill side's pushes as ``TransferSpec``s, without I/O: which
decode ranks a prefill rank writes (the same tensor-parallel mapping a pull
uses, seen from each decode rank), which of its blocks go into which of the
decode rank's offered blocks (by whole blocks, or by tokens when block or TP
sizes differ), and the layer groups a request is cut into.

A push is a pull turned around: the spec a decode rank would build to pull
from this rank (``PullSpecs``, with this rank's blocks as the remote ones)
has its two sides swapped. So every rule of a pull (windows, trailing
blocks, token mapping, heads) is written once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmap.client.connector.blocks import BlockIds
from kvmap.client.connector.metadata import PushSendTask, RecvTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.connector.params import RemoteSource
from kvmap.client.connector.pulls import PullSpecs
from kvmap.client.connector.tp_mapping import TpSplit
from kvmap.core.push_offers import Offer
from kvmap.v1 import transfers_pb2, types_pb2

# Layer names of one layer group, per transfer group.
LayerGroup = dict[int, tuple[str, ...]]


def layer_groups(layers: Sequence[tuple[str, int]], count: int) -> list[LayerGroup]:
    """Cut the worker's layers ((name, transfer group), in the order the
    model computes them) into ``count`` contiguous groups of nearly equal
    size (fewer when there are fewer layers). Contiguous, so in a
    block-outermost cache a group's layers of one block are one descriptor."""
    names = list(dict.fromkeys(layers))
    count = max(1, min(count, len(names)))
    out: list[LayerGroup] = []
    for k in range(count):
        chunk = names[k * len(names) // count : (k + 1) * len(names) // count]
        group: dict[int, list[str]] = {}
        for name, transfer_group in chunk:
            group.setdefault(transfer_group, []).append(name)
        out.append({g: tuple(n) for g, n in group.items()})
    return out


@dataclass(frozen=True)
class PrefillRank:
    """What a prefill worker knows of itself for its pushes."""

    worker: types_pb2.WorkerId
    tp_size: int
    block_size: int
    split: TpSplit
    features: Callable[[], frozenset[int]]


def decode_ranks_written(rank: PrefillRank, decode_tp: int) -> set[int]:
    """The decode ranks (of a decode engine of ``decode_tp`` ranks) that
    read this prefill rank in a pull, so the ones it writes in a push."""
    return rank.split.destinations(rank.tp_size, decode_tp, rank.worker.tp_rank)


def writers_of(rank: PrefillRank, offer: Offer) -> int:
    """How many prefill ranks write the offer's decode rank."""
    decode = offer.decode_worker.tp_rank
    return len(rank.split.sources(rank.tp_size, offer.decode_tp_size, decode))


def uses_per_writer(groups: Sequence[LayerGroup], transfer_groups: set[int]) -> int:
    """The pushes one prefill rank makes into a decode rank: one per layer
    group holding layers of the offered transfer groups."""
    return sum(1 for group in groups if transfer_groups & group.keys())


def push_spec(
    rank: PrefillRank, task: PushSendTask, offer: Offer, options: ConnectorOptions
) -> tuple[transfers_pb2.TransferSpec | None, int]:
    """The push of ``task``'s KV from this rank into ``offer``'s decode rank
    (every layer; ``for_layers`` cuts it), or None when that decode rank
    reads none of this rank's heads; and how many prefill ranks write that
    decode rank. Raises ``ValueError`` for an offer this rank cannot serve."""
    if offer.first_token + offer.num_tokens != task.num_tokens:
        raise ValueError(
            f"the decode side wants tokens [{offer.first_token}, "
            f"{offer.first_token + offer.num_tokens}) of a {task.num_tokens}-token prompt"
        )
    as_decode = PullSpecs(
        offer.decode_worker,
        options,
        tp_size=offer.decode_tp_size,
        block_size=offer.decode_block_size,
        split=rank.split,
        features=rank.features,
    )
    decode_blocks: BlockIds = tuple(g.block_ids for g in offer.groups)
    pull = RecvTask(
        request_id=offer.request_id,
        source=_as_source(rank, task, offer),
        local_block_ids=task.windows.fit(decode_blocks, task.block_ids),
    )
    pulls = as_decode.specs_for(pull)
    mine = [s for s in pulls if s.remote_worker.tp_rank == rank.worker.tp_rank]
    if not mine:
        return None, len(pulls)
    return _turned(mine[0], rank.worker, offer), len(pulls)


def _as_source(rank: PrefillRank, task: PushSendTask, offer: Offer) -> RemoteSource:
    """This rank's request as the decode rank would see it in a pull's params."""
    w = rank.worker
    return RemoteSource(
        target=offer.decode_target,  # not used: the spec is turned around
        engine_id=w.engine_id,
        request_id=offer.request_id,
        block_ids=task.block_ids,
        dp_rank=w.dp_rank,
        pp_rank=w.pp_rank,
        tp_size=rank.tp_size,
        num_tokens=task.num_tokens,
        # Stand-ins: the push presents the decode side's capability.
        capability=".".join(["x"] * rank.tp_size),
        block_size=rank.block_size,
        open_grants=True,
    )


def _turned(
    pull: transfers_pb2.TransferSpec, me: types_pb2.WorkerId, offer: Offer
) -> transfers_pb2.TransferSpec:
    """A decode rank's pull from this rank as this rank's push into it."""
    spec = transfers_pb2.TransferSpec(
        request_id=offer.request_id,
        local_worker=me,
        remote_target=offer.decode_target,
        remote_worker=offer.decode_worker,
        timeout_ms=pull.timeout_ms,
        capability=offer.capability,
    )
    for g in pull.groups:
        if g.remote_first_token:
            # The decode prefix ends inside one of this rank's larger blocks:
            # the first token to write is not at a block start on this side.
            raise ValueError(
                f"group {g.transfer_group}: the decode side's prefix ends inside a "
                "prefill block; a push cannot start there"
            )
        spec.groups.add(
            transfer_group=g.transfer_group,
            local_block_ids=g.remote_block_ids,
            remote_block_ids=g.local_block_ids,
            num_tokens=g.num_tokens,
        )
    return spec


def layer_pushes(
    spec: transfers_pb2.TransferSpec, groups: Sequence[LayerGroup], readers: int
) -> list[tuple[int, transfers_pb2.TransferSpec]]:
    """``spec`` cut into one push per layer group (its index with it) that
    holds some of its transfer groups' layers, each declaring ``readers``:
    the uses the decode side's grant admits, every writing prefill rank's
    pushes (each rank cuts alike: ``uses_per_writer``)."""
    out = []
    for k, group in enumerate(groups):
        cut = _restricted(spec, group)
        if cut is not None:
            cut.readers = readers
            out.append((k, cut))
    return out


def _restricted(
    spec: transfers_pb2.TransferSpec, group: LayerGroup
) -> transfers_pb2.TransferSpec | None:
    out = transfers_pb2.TransferSpec()
    out.CopyFrom(spec)
    del out.groups[:]
    for g in spec.groups:
        names = group.get(g.transfer_group)
        if names:
            added = out.groups.add()
            added.CopyFrom(g)
            added.layer_names.extend(names)
    return out if out.groups else None
