"""The swap file store: a file that cannot grow is a clear error at the write that needed the space, naming the file,
the bytes and the cause, and the store stays usable."""
import errno
import os
import sys
from pathlib import Path

import pytest
import torch

from fastdist.memory.store import FileStore, StoreIOError

sys.path.insert(0, str(Path(__file__).parents[1] / "compress"))
import store_faults  # noqa: E402  (the compress tests' child-process runner)


def test_a_full_disk_is_a_clear_error_from_write_naming_the_file_and_the_bytes(tmp_path):
    report = store_faults.run_on_a_full_disk("file-store-full-disk", str(tmp_path))
    assert report["signal"] is None, report["stderr"]
    assert report["raised"] == "StoreIOError" and report["is_oserror"], report
    message = report["message"]
    assert str(tmp_path) in message and f"{1 << 18} bytes" in message and "No space left on device" in message


def test_a_refused_reservation_leaves_the_store_usable(tmp_path, monkeypatch):
    store = FileStore(str(tmp_path))
    data = torch.arange(1 << 12, dtype=torch.float32)
    kept_slot, copy = store.write(data.untyped_storage(), lambda copy: None)
    copy.wait()
    before = store.file_bytes()

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(StoreIOError, match=rf"cannot reserve {1 << 16} bytes at offset {before}") as info:
        store.write(torch.ones(1 << 14).untyped_storage(), lambda copy: None)
    assert info.value.errno == errno.ENOSPC and store.file_bytes() == before
    monkeypatch.undo()
    slot, copy = store.write(torch.ones(1 << 14).untyped_storage(), lambda copy: None)  # the space is tried again
    copy.wait()
    assert slot[0] == before
    storage, copy = store.read(kept_slot)
    copy.wait()
    assert torch.equal(torch.empty(0).set_(storage), data)
    store.close()
