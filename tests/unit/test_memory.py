"""Memory import: real shared-memory objects (memfd, files, torch-shared
storages) mapped into this process, and the precise errors for bad handles."""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmap.client.fd_handoff import sealed_memfd
from kvmap.client.shm_export import export_tensor, export_tensors
from kvmap.core.errors import InvalidArgument
from kvmap.daemon.adapters import memory

pytestmark = pytest.mark.timeout(30)

SIZE = 3 * 4096


# The daemon's importer: it counts the mappings it made that are open.
# Paths under the temporary directory (where tmp_path lies) are allowed here.
SHM = memory.ShmImporter(path_prefixes=(tempfile.gettempdir(),))


@pytest.fixture(autouse=True)
def no_leaked_mappings() -> Iterator[None]:
    assert SHM.live_mappings() == 0
    yield
    assert SHM.live_mappings() == 0


def _memfd(size: int = SIZE) -> int:
    return sealed_memfd("kvmap-test", size)


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _read(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def _write(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))


def test_fd_mapping_is_shared_both_ways_and_close_unmaps() -> None:
    """A memfd imported by fd is mapped shared: writes through the mapping reach the fd and vice
    versa; close unmaps it, closes the fd, and a second close is harmless."""
    fd = _memfd()
    m = SHM.import_fd(fd, 0, SIZE)
    assert SHM.live_mappings() == 1
    assert m.size == SIZE and memory.is_mapped(m.address)
    _write(m.address + 5000, b"from the daemon")
    assert os.pread(fd, 15, 5000) == b"from the daemon"
    os.pwrite(fd, b"from the worker", 100)
    assert _read(m.address + 100, 15) == b"from the worker"

    address = m.address
    m.close()
    assert m.closed and not memory.is_mapped(address)
    assert not _fd_open(fd)
    m.close()  # idempotent


def test_unaligned_offset_points_address_at_the_allocation() -> None:
    """With an offset that is not page-aligned, the mapping starts at the page boundary below and
    the returned address points exactly at the allocation's first byte."""
    fd = _memfd()
    with SHM.import_fd(fd, 4096 + 100, 2000) as m:
        os.pwrite(fd, b"byte zero", 4096 + 100)
        assert _read(m.address, 9) == b"byte zero"
        assert m.address - m.map_address == 100
        assert m.map_length == 2100


def test_object_smaller_than_offset_plus_size_is_rejected_and_fd_closed() -> None:
    """An object smaller than offset + size is INVALID_ARGUMENT on the given field with the sizes
    spelled out, and the passed fd is closed even though the import failed."""
    fd = _memfd(8192)
    with pytest.raises(InvalidArgument) as err:
        SHM.import_fd(fd, 4096, 8192, field="allocations[0].shm_fd")
    assert err.value.field == "allocations[0].shm_fd"
    assert str(err.value) == (
        "allocations[0].shm_fd: shared-memory object is 8192 bytes, smaller than"
        " offset 4096 + size 8192 = 12288"
    )
    assert not _fd_open(fd)  # consumed even on failure


def test_bad_fd() -> None:
    """A closed fd is INVALID_ARGUMENT on the given field ("not an open file")."""
    fd = _memfd()
    os.close(fd)
    with pytest.raises(InvalidArgument, match=r"^allocations\[2\]\.shm_fd: not an open file"):
        SHM.import_fd(fd, 0, SIZE, field="allocations[2].shm_fd")


def test_pipe_is_not_shared_memory() -> None:
    """A pipe fd is rejected as not a shared-memory object, and the fd is consumed."""
    r, w = os.pipe()
    try:
        with pytest.raises(InvalidArgument, match="not a shared-memory object"):
            SHM.import_fd(r, 0, 10, field="f")
    finally:
        os.close(w)
    assert not _fd_open(r)


def test_read_only_fd_cannot_be_mapped_read_write(tmp_path: Path) -> None:
    """A file descriptor opened read-only is INVALID_ARGUMENT ("cannot map read/write") on the given
    field."""
    sealed = _memfd()
    try:
        fd = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)  # the same memfd, read-only
    finally:
        os.close(sealed)
    with pytest.raises(InvalidArgument, match="f: cannot map read/write"):
        SHM.import_fd(fd, 0, SIZE, field="f")


def test_an_fd_that_can_shrink_is_refused(tmp_path: Path) -> None:
    """A memfd without F_SEAL_SHRINK, and a plain file (which takes no seals), are
    INVALID_ARGUMENT naming the missing seal before anything is mapped; the fd is consumed."""
    unsealed = os.memfd_create("kvmap-unsealed")
    os.ftruncate(unsealed, SIZE)
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * SIZE)
    plain = os.open(path, os.O_RDWR)
    for fd in (unsealed, plain):
        with pytest.raises(InvalidArgument, match=r"f: .*not sealed against shrinking"):
            SHM.import_fd(fd, 0, SIZE, field="f")
        assert not _fd_open(fd)


@pytest.mark.parametrize(
    ("offset", "size", "problem"),
    [(-1, 10, "offset -1 is negative"), (0, 0, "size 0 must be positive")],
)
def test_range_checks(offset: int, size: int, problem: str) -> None:
    """A negative offset or a zero size is INVALID_ARGUMENT with a problem saying which."""
    fd = _memfd()
    with pytest.raises(InvalidArgument) as err:
        SHM.import_fd(fd, offset, size, field="x")
    assert err.value.problem == problem


def test_path_import(tmp_path: Path) -> None:
    """An allocation imported by absolute path is mapped shared: bytes written at the mapped address
    land in the file at the offset, and the mapping is gone after the with block."""
    path = tmp_path / "kv"
    path.write_bytes(b"\0" * SIZE)
    with SHM.import_path(str(path), 4096, 4096) as m:
        _write(m.address, b"hello")
        address = m.address
    assert not memory.is_mapped(address)
    assert path.read_bytes()[4096:4101] == b"hello"


def test_path_errors(tmp_path: Path) -> None:
    """A relative path, a missing file, a symlink and a file smaller than offset + size are each
    INVALID_ARGUMENT on the shm_path field."""
    field = "allocations[0].shm_path"
    with pytest.raises(InvalidArgument, match=r"shm_path: path 'kv' is not absolute"):
        SHM.import_path("kv", 0, 1, field=field)
    with pytest.raises(InvalidArgument, match=r"cannot open .*No such file"):
        SHM.import_path(str(tmp_path / "missing"), 0, 1, field=field)
    target = tmp_path / "target"
    target.write_bytes(b"\0" * SIZE)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(InvalidArgument, match="cannot open"):
        SHM.import_path(str(tmp_path / "link"), 0, 1, field=field)
    with pytest.raises(
        InvalidArgument, match=re.escape(f"{field}: shared-memory object is {SIZE} bytes")
    ):
        SHM.import_path(str(target), 0, SIZE + 1, field=field)


def test_torch_shared_tensor_round_trip() -> None:
    """The worker's export and the daemon's import see the same bytes."""
    kv = torch.zeros(4, 1024, dtype=torch.uint8)
    layer = kv[2]
    fd, size, offset = export_tensor(layer)
    assert kv.is_shared() and size == 4096 and offset == 2048
    # The fd belongs to the storage; the daemon gets its own copy (as SCM_RIGHTS would).
    with SHM.import_fd(os.dup(fd), offset, 1024) as m:
        _write(m.address, b"\x07" * 1024)
        assert int(layer.sum()) == 7 * 1024
        assert int(kv[1].sum()) == 0
        kv[2, 0] = 9
        assert _read(m.address, 1) == b"\x09"
    assert _fd_open(fd)


def test_export_groups_views_by_storage() -> None:
    """export_tensors returns one entry per distinct storage, and each view's storage index and byte
    offset within its storage."""
    a = torch.zeros(8, 256, dtype=torch.float16)
    b = torch.zeros(100, dtype=torch.int32)
    storages, views = export_tensors([a[1], b, a[5, 8:], a])
    assert len(storages) == 2
    assert [v.storage_index for v in views] == [0, 1, 0, 0]
    assert [v.offset_bytes for v in views] == [512, 0, 5 * 512 + 16, 0]
    assert storages[0].size_bytes == 8 * 256 * 2 and storages[1].size_bytes == 400
    assert storages[0].data_ptr == a.untyped_storage().data_ptr()


def test_export_rejects_empty_storage() -> None:
    """Exporting a tensor with an empty storage raises ValueError."""
    with pytest.raises(ValueError, match="storage is empty"):
        export_tensors([torch.zeros(0)])


def test_a_path_outside_the_prefixes_or_through_a_link_is_refused(tmp_path: Path) -> None:
    """shm_path only under an allowed prefix, in normal form, and no symbolic link anywhere
    below the prefix (a linked directory on the way, or the file itself): each is
    INVALID_ARGUMENT on the field saying which, and nothing is mapped."""
    field = "allocations[0].shm_path"
    real = tmp_path / "real"
    real.mkdir()
    (real / "kv").write_bytes(b"\0" * SIZE)
    (tmp_path / "linked-dir").symlink_to(real)
    only_dev_shm = memory.ShmImporter()
    with pytest.raises(InvalidArgument, match=r"not under an allowed shm_path_prefix .*/dev/shm"):
        only_dev_shm.import_path(str(real / "kv"), 0, SIZE, field=field)
    with pytest.raises(InvalidArgument, match="path registrations are disabled"):
        memory.ShmImporter(path_prefixes=()).import_path(str(real / "kv"), 0, SIZE, field=field)
    with pytest.raises(InvalidArgument, match="not in normal form"):
        SHM.import_path(f"{tmp_path}/linked-dir/../real/kv", 0, SIZE, field=field)
    with pytest.raises(InvalidArgument, match=r"cannot open .*symbolic link"):
        SHM.import_path(str(tmp_path / "linked-dir" / "kv"), 0, SIZE, field=field)
    with SHM.import_path(str(real / "kv"), 0, SIZE, field=field) as m:
        assert m.size == SIZE
