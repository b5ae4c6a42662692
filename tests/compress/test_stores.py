"""AQ-SGD stores: the file store survives a full disk and a truncated file with a clear error (not SIGBUS), its
state_dict is a snapshot, flipped bytes are caught, and it reopens what it wrote."""
import errno
import os

import pytest
import torch

import store_faults
from fastdist.compress import AQSGD, MemoryStore, MmapStore, Quantize, StoreCorruptedError, StoreIOError
from helpers import randn


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


# ---- a full disk, a truncated file ----

def test_a_full_disk_at_the_first_put_is_a_clear_error_not_sigbus(tmp_path):
    report = store_faults.run_on_a_full_disk("mmap-full-disk", str(tmp_path))
    assert report["signal"] is None, report["stderr"]
    assert report["raised"] == "StoreIOError" and report["is_oserror"], report
    entries = 64 * 1024 * 4
    assert "m.bin" in report["message"] and "No space left on device" in report["message"]
    assert any(f"{n} bytes" in report["message"] for n in range(entries, entries + 8192)), report["message"]


def test_a_refused_preallocation_is_a_clear_error_and_leaves_no_half_made_file(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    path = tmp_path / "m.bin"
    store = MmapStore(path, capacity=4)
    with pytest.raises(StoreIOError, match=rf"{path}.*cannot reserve \d+ bytes.*No space left on device") as info:
        store.put(torch.arange(2), randn(2, 8))
    assert info.value.errno == errno.ENOSPC
    assert not path.exists()
    monkeypatch.undo()
    store.put(torch.arange(2), randn(2, 8))  # the next try starts afresh
    assert torch.equal(store.get(torch.arange(2)), randn(2, 8))


@pytest.mark.parametrize("case", ["mmap-truncated", "mmap-truncated-prefetch"])
def test_a_file_truncated_while_open_is_a_clear_error_on_the_next_get_not_sigbus(tmp_path, case):
    report = store_faults.run(case, str(tmp_path))
    assert report["signal"] is None, report["stderr"]
    assert report["raised"] == "StoreCorruptedError", report
    assert "m.bin" in report["message"] and "truncated" in report["message"]


def test_a_put_into_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "m.bin"
    store = MmapStore(path, capacity=4)
    store.put(torch.arange(2), randn(2, 8))
    os.truncate(path, 4096)
    with pytest.raises(StoreCorruptedError, match="truncated to 4096 bytes"):
        store.put(torch.arange(2), randn(2, 8, seed=1))


# ---- snapshots ----

def test_state_dict_is_a_snapshot_that_later_puts_do_not_change(tmp_path):
    store = MmapStore(tmp_path / "m.bin", capacity=8)
    ids, old = torch.arange(4), randn(4, 16)
    store.put(ids, old)
    state = store.state_dict()
    store.put(ids, randn(4, 16, seed=1))
    store.put(torch.tensor([7]), randn(1, 16, seed=2))
    store.load_state_dict(state)
    assert torch.equal(store.get(ids), old)
    assert len(store) == 4 and not store.contains(torch.tensor([7])).item()


def test_state_dict_without_puts_since_the_last_one_reuses_its_snapshot(tmp_path):
    store = MmapStore(tmp_path / "m.bin", capacity=8)
    store.put(torch.arange(2), randn(2, 4))
    first = store.state_dict()
    assert store.state_dict()["snapshot"] == first["snapshot"]
    store.put(torch.arange(2), randn(2, 4, seed=1))
    assert store.state_dict()["snapshot"] != first["snapshot"]


def test_an_aqsgd_checkpoint_restores_the_store_of_its_step_like_a_memory_store(tmp_path):
    """Checkpoint at epoch 1 through torch.save, train on, restore into a store opened anew: the next step equals a
    memory store's restored from the same checkpoint."""
    ids = torch.tensor([4, 0, 9])
    mm, mem = AQSGD(Quantize(4), MmapStore(tmp_path / "m.bin", 10)), AQSGD(Quantize(4), MemoryStore(10))
    for epoch in range(2):
        for aq in (mm, mem):
            aq.set_epoch(epoch)
            aq.roundtrip(randn(3, 16, seed=epoch), ids)
    torch.save({"mm": mm.state_dict(), "mem": mem.state_dict()}, tmp_path / "ckpt.pt")
    for epoch in range(2, 4):
        mm.set_epoch(epoch)
        mm.roundtrip(randn(3, 16, seed=epoch), ids)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    restored, reference = AQSGD(Quantize(4), MmapStore(tmp_path / "m.bin", 10)), AQSGD(Quantize(4), MemoryStore(10))
    restored.load_state_dict(ckpt["mm"])
    reference.load_state_dict(ckpt["mem"])
    x = randn(3, 16, seed=9)
    assert torch.equal(restored.roundtrip(x, ids)[0], reference.roundtrip(x, ids)[0])


def test_an_empty_state_empties_the_store(tmp_path):
    store = MmapStore(tmp_path / "m.bin", capacity=4)
    empty = store.state_dict()
    store.put(torch.arange(2), randn(2, 4))
    store.load_state_dict(empty)
    assert len(store) == 0 and store.entry_shape is None
    store.put(torch.arange(3), randn(3, 5))  # a new entry shape after the reset
    assert torch.equal(store.get(torch.arange(3)), randn(3, 5))


def test_a_missing_or_damaged_snapshot_is_a_clear_error(tmp_path):
    store = MmapStore(tmp_path / "m.bin", capacity=4)
    store.put(torch.arange(4), randn(4, 8))
    state = store.state_dict()
    _flip_byte(state["snapshot"], os.path.getsize(state["snapshot"]) - 1)
    with pytest.raises(StoreCorruptedError, match="checksum"):
        store.load_state_dict(state)
    os.remove(state["snapshot"])
    with pytest.raises(StoreCorruptedError, match="snapshot.*does not exist"):
        store.load_state_dict(state)


# ---- checksums ----

def test_a_flipped_byte_in_an_entry_is_a_clear_error_naming_the_sample(tmp_path):
    path = tmp_path / "m.bin"
    store = MmapStore(path, capacity=4)
    store.put(torch.tensor([10, 11, 12, 13]), randn(4, 8))  # full: the file ends with sample 13's entry
    _flip_byte(path, os.path.getsize(path) - 1)
    with pytest.raises(StoreCorruptedError, match=r"sample 13 \(slot 3\) fails its checksum"):
        store.get(torch.tensor([12, 13]))
    assert torch.equal(store.get(torch.tensor([10, 11])), randn(4, 8)[:2])  # the others are intact
    unchecked = MmapStore(path, capacity=4, checksums=False)  # the trade: no check, no error
    assert not torch.equal(unchecked.get(torch.tensor([13])), randn(4, 8)[3:])


def test_an_entry_read_back_under_another_sample_id_fails_its_checksum(tmp_path):
    path = tmp_path / "m.bin"
    MmapStore(path, capacity=4).put(torch.tensor([5, 6]), randn(2, 8))
    with open(path, "r+b") as f:  # swap the two ids in the slot table (right after the 4 KiB header)
        f.seek(4096)
        a, b = f.read(8), f.read(8)
        f.seek(4096)
        f.write(b + a)
    with pytest.raises(StoreCorruptedError, match="checksum"):
        MmapStore(path, capacity=4).get(torch.tensor([5]))


# ---- reopening, corrupted files ----

def test_mmap_store_persists_reopens_and_matches_the_memory_store(tmp_path):
    path = tmp_path / "m.bin"
    mem, mm = AQSGD(Quantize(4), MemoryStore(10)), AQSGD(Quantize(4), MmapStore(path, 10))
    ids = torch.tensor([4, 0, 9])
    for epoch in range(3):
        mem.set_epoch(epoch)
        mm.set_epoch(epoch)
        x = randn(3, 16, seed=epoch)
        mm.prefetch(ids)
        assert torch.equal(mem.roundtrip(x, ids)[0], mm.roundtrip(x, ids)[0])
    state = mm.state_dict()
    reopened = MmapStore(path, 10)
    assert torch.equal(reopened.get(ids), mem.store.get(ids))
    again = AQSGD(Quantize(4), MmapStore(path, 10))
    again.load_state_dict(state)
    assert again.epoch == 2 and len(again.store) == 3


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:-100], "bytes, expected"),
    (lambda b: b[:10], "shorter than its header"),
])
def test_a_corrupted_mmap_file_is_a_clear_error(tmp_path, damage, message):
    path = tmp_path / "m.bin"
    store = MmapStore(path, 4)
    store.put(torch.tensor([1, 2]), randn(2, 8))
    store.flush()
    data = path.read_bytes()
    path.write_bytes(damage(data))
    with pytest.raises(StoreCorruptedError, match=message):
        MmapStore(path, 4)


def test_an_mmap_file_opened_with_another_capacity_is_refused(tmp_path):
    path = tmp_path / "m.bin"
    MmapStore(path, 4).put(torch.tensor([1]), randn(1, 8))
    with pytest.raises(StoreCorruptedError, match="capacity 4"):
        MmapStore(path, 5)


def test_mmap_slot_table_with_repeated_ids_is_refused(tmp_path):
    path = tmp_path / "m.bin"
    MmapStore(path, 4).put(torch.tensor([1, 2]), randn(2, 8))
    with open(path, "r+b") as f:  # the second slot's id becomes the first's
        f.seek(4096 + 8)
        f.write((1).to_bytes(8, "little"))
    with pytest.raises(StoreCorruptedError, match="invalid or repeated sample ids"):
        MmapStore(path, 4)
