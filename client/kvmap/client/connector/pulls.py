"""The decode side's pulls and releases as ``TransferSpec``s: from which
prefill ranks a decode rank reads (tensor-parallel mapping), by whole blocks
or by tokens (different block sizes), under which rank's capability, and
whether this rank's kvmapd understands every field a spec uses. Params that
must not become a pull raise ``ValueError``. See README.md here."""

from __future__ import annotations

from collections.abc import Callable

from kvmap.client.connector.blocks import map_token_ranges, pair_blocks
from kvmap.client.connector.metadata import RecvTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.connector.params import RemoteSource, rank_capability
from kvmap.client.connector.tp_mapping import TpSplit
from kvmap.core.grants import MAX_USES
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2


class PullSpecs:
    """Builds one decode worker's transfer specs. ``features`` says what its
    kvmapd listed when the worker last registered (it changes when the
    daemon is upgraded under the worker)."""

    def __init__(
        self,
        worker: types_pb2.WorkerId,
        options: ConnectorOptions,
        *,
        tp_size: int,
        block_size: int,
        split: TpSplit,
        features: Callable[[], frozenset[int]],
    ) -> None:
        self.worker = worker
        self.options = options
        self.tp_size = tp_size
        self.block_size = block_size
        self.split = split
        self.features = features

    def specs_for(self, task: RecvTask) -> list[transfers_pb2.TransferSpec]:
        """The pulls of one load: one from each prefill rank this rank reads
        (``TpSplit.sources``): the same rank between equal TP sizes, one
        rank of a replicated cache, each rank holding some of this rank's
        heads. Raises ``ValueError`` for params that must not become a pull."""
        src = task.source
        self._check_readers_tp(src)
        if src.tp_size == self.tp_size or self.split.replicated:
            # The same rank, or, every prefill rank holding the whole cache,
            # one of them: by blocks (by tokens where the block sizes differ).
            (rank,) = self._source_ranks(src)
            return [self._spec(task, rank, token_mode=False)]
        if not self.block_size:
            raise ValueError("tensor-parallel sizes differ: this engine's block size is needed")
        # Token mode: kvmapd moves the heads both ranks hold (their published
        # head layouts), each source rank's once.
        return [self._spec(task, rank, token_mode=True) for rank in self._source_ranks(src)]

    def _check_readers_tp(self, src: RemoteSource) -> None:
        """Refuse params whose grants were sized for another decode TP size
        (open grants fit any), and a TP size that is none."""
        if not 1 <= src.tp_size <= MAX_USES:
            # Hostile or broken params: never a division by zero further on.
            raise ValueError(f"kv_transfer_params.tp_size: {src.tp_size} is not a TP size")
        if not src.open_grants and (src.readers_tp_size or src.tp_size) != self.tp_size:
            # The prefill side waits for as many pulls as it was told decode
            # ranks: another count would hold its blocks until the lease.
            raise ValueError(
                f"the prefill engine expects decode engines of tensor-parallel size "
                f"{src.readers_tp_size or src.tp_size}, this one runs {self.tp_size}"
            )

    def readers_of(self, src: RemoteSource) -> tuple[int, ...]:
        """Per prefill rank, how many ranks of this (decode) engine read it
        (``TpSplit.readers``): what each pull declares, and 0 for a rank no
        one reads. Raises ``ValueError`` for sizes the heads do not split
        over."""
        self._check_readers_tp(src)
        return self.split.readers(src.tp_size, self.tp_size)

    def _spec(
        self, task: RecvTask, src_rank: int, *, token_mode: bool
    ) -> transfers_pb2.TransferSpec:
        """The pull from prefill rank ``src_rank``."""
        src = task.source
        remote_tokens = src.block_size or self.block_size
        if token_mode or (src.block_size and self.block_size and src.block_size != self.block_size):
            # Token mode: kvmapd maps each token's bytes between the block
            # grids with the head layouts both workers published.
            token_ranges = map_token_ranges(
                task.local_block_ids,
                src.block_ids,
                num_tokens=src.num_tokens,
                local_tokens=self.block_size,
                remote_tokens=remote_tokens,
            )
        else:
            local, remote = pair_blocks(task.local_block_ids, src.block_ids)
            token_ranges = [(lg, rg, 0, 0) for lg, rg in zip(local, remote, strict=True)]
        spec = self._spec_to(src, src_rank, self.readers_of(src)[src_rank])
        for g, (lg, rg, n, first) in enumerate(token_ranges):
            if lg:
                spec.groups.add(
                    transfer_group=g,
                    local_block_ids=lg,
                    remote_block_ids=rg,
                    num_tokens=n,
                    remote_first_token=first,
                )
        if not spec.groups:
            raise ValueError("no blocks to load")
        missing = missing_feature(spec, self.features())
        if missing:
            # An older kvmapd would drop the field and move the wrong bytes.
            raise ValueError(f"this pull needs {missing}, which the local kvmapd does not list")
        return spec

    def release_specs(self, task: RecvTask, *, pulling: bool) -> list[transfers_pb2.TransferSpec]:
        """The releases this rank sends for ``task``: its own uses of the
        prefill ranks it would read, unless it is ``pulling`` them; and, on
        rank 0 with open grants, the grants of the prefill ranks no decode
        rank reads (declaring 0 readers). Raises ``ValueError`` for params
        that must not become a pull."""
        src = task.source
        readers = self.readers_of(src)
        ranks: list[tuple[int, int]] = []
        if not pulling:
            ranks = [(rank, readers[rank]) for rank in self._source_ranks(src)]
        if src.open_grants and self.worker.tp_rank == 0:
            ranks += [(rank, 0) for rank, n in enumerate(readers) if n == 0]
        return [self._release_spec(src, rank, n) for rank, n in ranks]

    def _source_ranks(self, src: RemoteSource) -> list[int]:
        """The prefill ranks this rank pulls from."""
        return self.split.sources(src.tp_size, self.tp_size, self.worker.tp_rank)

    def _spec_to(
        self, src: RemoteSource, src_rank: int, readers: int
    ) -> transfers_pb2.TransferSpec:
        """A transfer (no groups yet) of ``src``'s request with prefill rank
        ``src_rank``, under that rank's capability, declaring ``readers``."""
        return transfers_pb2.TransferSpec(
            request_id=src.request_id,
            local_worker=self.worker,
            remote_target=src.target,
            remote_worker=types_pb2.WorkerId(
                engine_id=src.engine_id,
                dp_rank=src.dp_rank,
                tp_rank=src_rank,
                pp_rank=src.pp_rank,
            ),
            timeout_ms=int(self.options.transfer_timeout_s * 1000),
            capability=rank_capability(src.capability, src.tp_size, src_rank),
            readers=readers,
        )

    def _release_spec(
        self, src: RemoteSource, src_rank: int, readers: int
    ) -> transfers_pb2.TransferSpec:
        spec = self._spec_to(src, src_rank, readers)
        spec.release = True
        return spec


def missing_feature(spec: transfers_pb2.TransferSpec, features: frozenset[int]) -> str:
    """The first field of ``spec`` in use that a daemon listing ``features``
    (``RegisterWorkerResponse.features``) does not understand, or ''."""
    needs = [
        (any(g.num_tokens for g in spec.groups), registry_pb2.DAEMON_FEATURE_TOKEN_MODE),
        (
            any(g.remote_first_token for g in spec.groups),
            registry_pb2.DAEMON_FEATURE_REMOTE_FIRST_TOKEN,
        ),
        # One reader is what a claim declaring none fixes an open grant at.
        (spec.readers > 1, registry_pb2.DAEMON_FEATURE_OPEN_GRANTS),
        (spec.release, registry_pb2.DAEMON_FEATURE_RELEASE),
    ]
    for used, feature in needs:
        if used and feature not in features:
            return registry_pb2.DaemonFeature.Name(feature)
    return ""


def with_timeout(spec: transfers_pb2.TransferSpec, seconds: float) -> transfers_pb2.TransferSpec:
    """A copy of ``spec`` whose daemon-side deadline is ``seconds`` (at least 1 ms)."""
    out = transfers_pb2.TransferSpec()
    out.CopyFrom(spec)
    out.timeout_ms = max(1, int(seconds * 1000))
    return out


def release_request(spec: transfers_pb2.TransferSpec) -> transfers_pb2.ReleaseRequest:
    """Transfers.Release for a release ``spec`` (one with the deprecated flag)."""
    return transfers_pb2.ReleaseRequest(
        request_id=spec.request_id,
        local_worker=spec.local_worker,
        remote_target=spec.remote_target,
        remote_worker=spec.remote_worker,
        capability=spec.capability,
        readers=spec.readers,
        timeout_ms=spec.timeout_ms,
    )
