"""CUDA IPC import on a real GPU and driver: a separate process exports
tensors with the client's exporter, this process (in the daemon's place)
opens them by UUID, reads and writes the worker's bytes through the mapping,
shares one open per cudaMalloc block and closes it with the last user.

Skipped, with the reason, where there is no CUDA GPU or driver."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from cuda_env import REASON, Exporter, copy_in, copy_out
from exporter import expected

from kvmap.core.errors import InvalidArgument, KvmapError
from kvmap.daemon.adapters.cuda_driver import LibCuda
from kvmap.daemon.adapters.cuda_ipc import CudaIpcImporter, CudaMapping, parse_uuid

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(bool(REASON), reason=REASON or "-"),
    pytest.mark.timeout(180),
]

SMALL = 256 << 10  # small-pool sizes: torch carves both from one 2 MiB block
# Bounds the wait for the driver to tear a killed process's memory down, so a
# handle that never stops opening fails the test instead of hanging it.
TEARDOWN_GUARD_S = 60.0


@pytest.fixture(scope="module")
def driver() -> LibCuda:
    return LibCuda()


@pytest.fixture
def importer(driver: LibCuda) -> Iterator[CudaIpcImporter]:
    imp = CudaIpcImporter(lambda: driver)
    yield imp
    assert imp.live_handles() == 0, "a test left an IPC handle open"
    imp.shutdown()


def _open(imp: CudaIpcImporter, s: dict[str, object], **over: object) -> CudaMapping:
    args: dict[str, object] = {
        "handle": bytes.fromhex(str(s["handle"])),
        "offset": s["offset"],
        "size": s["size"],
        "block_size": s["block"],
        "device_uuid": s["uuid"],
        "field": "allocations[0]",
    }
    args.update(over)
    return imp.import_handle(**args)  # type: ignore[arg-type]


def test_the_workers_device_is_found_by_uuid(driver: LibCuda) -> None:
    """The UUID the worker's exporter reports is one of the device UUIDs the daemon's driver
    sees."""
    with Exporter(SMALL) as ex:
        want = parse_uuid(ex.storage(0)["uuid"], "uuid")
    assert want in driver.device_uuids()


def test_reads_and_writes_land_in_the_workers_memory(
    driver: LibCuda, importer: CudaIpcImporter
) -> None:
    """Through the imported mapping the daemon reads exactly the worker's bytes, and bytes it writes
    show up in the worker's tensor without disturbing the rest."""
    with Exporter(SMALL) as ex, _open(importer, ex.storage(0)) as m:
        assert copy_out(driver, m.dev_id, m.address, SMALL) == expected(0, SMALL)
        copy_in(driver, m.dev_id, m.address + 1000, b"kvmap was here")
        assert ex.read(0, 1000, 14) == b"kvmap was here"
        assert ex.read(0, 0, 1000) == expected(0, SMALL)[:1000]


def test_two_storages_of_one_block_share_one_open(
    driver: LibCuda, importer: CudaIpcImporter
) -> None:
    """Two storages the caching allocator put in one cudaMalloc block are imported with one open at
    one block address, each reads its own bytes, and the block closes with its last user."""
    with Exporter(SMALL, SMALL) as ex:
        a, b = ex.storage(0), ex.storage(1)
        assert a["handle"] == b["handle"], "the allocator put them in two blocks"
        with _open(importer, a) as ma:
            with _open(importer, b) as mb:
                assert importer.live_handles() == 1 and ma.block_address == mb.block_address
                assert copy_out(driver, mb.dev_id, mb.address, SMALL) == expected(1, SMALL)
            assert importer.live_handles() == 1  # a still maps the block
            assert copy_out(driver, ma.dev_id, ma.address, 64) == expected(0, 64)
        assert importer.live_handles() == 0


def test_a_block_larger_than_the_real_mapping_is_refused(importer: CudaIpcImporter) -> None:
    """A declared block size beyond the driver's real mapping is INVALID_ARGUMENT on
    cuda_ipc.block_size_bytes, and no handle stays open."""
    with Exporter(SMALL) as ex:
        s = ex.storage(0)
        with pytest.raises(InvalidArgument) as e:
            _open(importer, s, block_size=int(s["block"]) + (64 << 20))
    assert e.value.field == "allocations[0].cuda_ipc.block_size_bytes"
    assert importer.live_handles() == 0


def test_the_handle_of_an_exited_worker_does_not_open(importer: CudaIpcImporter) -> None:
    """Once the exporting worker has been killed (and the driver has torn its memory down, which
    the test waits for), importing its handle fails with an error naming the handle field,
    leaving nothing open."""
    with Exporter(SMALL) as ex:
        s = ex.storage(0)
        ex.kill()
    err = _refused_once_torn_down(importer, s)
    assert "allocations[0].cuda_ipc.handle" in str(err)
    assert importer.live_handles() == 0


def _refused_once_torn_down(imp: CudaIpcImporter, s: dict[str, object]) -> KvmapError:
    """The error importing the handle of a killed exporter gives. The driver tears
    the dead process's memory down after it exits, not at once: until then the
    handle may still open, so each such mapping is closed and the import tried
    again until it is refused."""
    deadline = time.monotonic() + TEARDOWN_GUARD_S
    while True:
        try:
            mapping = _open(imp, s)
        except KvmapError as e:
            return e
        mapping.close()
        assert time.monotonic() < deadline, "the killed exporter's handle still opens"
        time.sleep(0.05)
