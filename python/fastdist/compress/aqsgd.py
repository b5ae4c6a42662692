"""AQ-SGD (Wang et al., NeurIPS 2022): compress the change of a sample's activation since its last visit.

Both ends keep m(xi) per training sample xi. A sample's first visit, and every visit during the first
``warmup_epochs`` epochs, is sent uncompressed and stored: m(xi) <- a(xi). Later visits send c = C(a(xi) - m(xi)) and
both ends update m(xi) <- m(xi) + D(c), with the same float operations, so their m stay equal bit for bit and the
receiver's output is its m(xi).

The store of m is samples x activation size, so it is pluggable (``fastdist.compress.stores``):
:class:`~fastdist.compress.MemoryStore` (a tensor in memory) or :class:`~fastdist.compress.MmapStore` (a file).
"""
import torch

from fastdist.compress.compressors import Compressor, Packet, as_rows, check_compressible, check_compressor
from fastdist.compress.stores import SampleStore, check_sample_ids

__all__ = ["AQSGD"]


class AQSGD(Compressor):
    """AQ-SGD over compressor `c` (e.g. Quantize(4)); `store` holds m per sample. compress/roundtrip need the batch's
    sample ids (one per row of x viewed [B, D]); the packet carries them (8 bytes per sample) so that the receiver
    updates the same entries.

    Args:
        c: the compressor of the changes.
        store: a :class:`MemoryStore` or :class:`MmapStore`, one per end.
        warmup_epochs: epochs whose visits are all sent uncompressed.
    """

    name = "aqsgd"

    def __init__(self, c: Compressor, store: SampleStore, warmup_epochs: int = 1):
        check_compressor(c, "AQSGD")
        if not isinstance(store, SampleStore):
            raise TypeError(f"fastdist.compress.AQSGD: 'store' must be a MemoryStore or MmapStore, got "
                            f"{type(store).__name__}")
        if not isinstance(warmup_epochs, int) or warmup_epochs < 0:
            raise ValueError(f"fastdist.compress.AQSGD: 'warmup_epochs' must be an int >= 0, got {warmup_epochs!r}")
        self.c, self.store, self.warmup_epochs = c, store, warmup_epochs
        self.epoch = 0
        self._last_rows = None  # what the last compress / decompress stored: the ends' shared state of the batch

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_last_rows": None}

    def config(self) -> dict:
        return {"name": self.name, "c": self.c.config(), "warmup_epochs": self.warmup_epochs}

    def __repr__(self) -> str:
        return f"AQSGD({self.c!r}, store={type(self.store).__name__}(capacity={self.store.capacity}), " \
               f"warmup_epochs={self.warmup_epochs})"

    def set_epoch(self, epoch: int) -> None:
        """Tells both ends the epoch (the first ``warmup_epochs`` send everything uncompressed)."""
        self.epoch = int(epoch)

    def prefetch(self, sample_ids: torch.Tensor) -> None:
        """Starts reading the stored activations of the next batch's ``sample_ids`` in the background."""
        self.store.prefetch(sample_ids)

    def _ids(self, x, sample_ids):
        if sample_ids is None:
            raise ValueError("fastdist.compress.AQSGD: sample ids are required (one per sample of the batch): pass "
                             "sample_ids=, or use fastdist.compress.batch(sample_ids=...) around the forward pass")
        ids = check_sample_ids(sample_ids, "AQSGD")
        if ids.numel() != as_rows(x).shape[0]:
            raise ValueError(f"fastdist.compress.AQSGD: got {ids.numel()} sample ids for a batch of "
                             f"{as_rows(x).shape[0]} samples (x of shape {tuple(x.shape)})")
        return ids

    def _combine(self, packet, rows_dtype, device, m_old):
        """The rows the receiver outputs (and both ends store): fresh rows as sent, the others m + D(delta)."""
        t, meta = packet.tensors, packet.meta
        fresh = t["fresh"].bool().to(device)
        d = meta["d"]
        delta = None
        if meta["stale"]:
            inner = Packet(meta["inner_kind"], (meta["stale"], d), rows_dtype,
                           {name[2:]: v for name, v in t.items() if name.startswith("d_")},
                           {name[2:]: v for name, v in meta.items() if name.startswith("d_")})
            delta = self.c.decompress(inner).to(torch.float32)
        if meta["stale"] == fresh.numel():  # the steady state: every sample seen before
            return m_old.to(device, torch.float32) + delta
        out = torch.empty(fresh.numel(), d, dtype=torch.float32, device=device)
        out[fresh] = t["full"].to(torch.float32)
        if delta is not None:
            out[~fresh] = m_old.to(device, torch.float32) + delta
        return out

    def compress(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> Packet:
        check_compressible(x, "AQSGD")
        x = x.detach()
        ids = self._ids(x, sample_ids)
        rows = as_rows(x)
        if self.epoch < self.warmup_epochs:
            fresh = torch.ones(ids.numel(), dtype=torch.bool)
        else:
            fresh = ~self.store.contains(ids)
        tensors = {"ids": ids, "fresh": fresh.to(torch.uint8), "full": rows[fresh.to(rows.device)].contiguous()}
        meta = {"d": rows.shape[1], "stale": int((~fresh).sum())}
        m_old = None
        if meta["stale"]:
            m_old = self.store.get(ids[~fresh])
            delta = rows[~fresh.to(rows.device)].to(torch.float32) - m_old.to(rows.device, torch.float32)
            inner = self.c.compress(delta.to(rows.dtype))
            tensors.update({f"d_{name}": v for name, v in inner.tensors.items()})
            meta.update({f"d_{name}": v for name, v in inner.meta.items()})
            meta["inner_kind"] = inner.kind
        packet = Packet("aqsgd", tuple(x.shape), x.dtype, tensors, meta)
        self._last_rows = self._combine(packet, rows.dtype, rows.device, m_old)
        self.store.put(ids, self._last_rows)
        return packet

    def roundtrip(self, x: torch.Tensor, sample_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, Packet]:
        """(what the receiver reconstructs, the packet) of ``x``, the rows of the samples ``sample_ids``."""
        packet = self.compress(x, sample_ids)
        return self._last_rows.reshape(x.shape).to(x.dtype), packet

    def decompress(self, packet: Packet) -> torch.Tensor:
        ids = packet.tensors["ids"]
        fresh = packet.tensors["fresh"].bool()
        m_old = self.store.get(ids[~fresh]) if packet.meta["stale"] else None
        self._last_rows = self._combine(packet, packet.dtype, packet.tensors["full"].device, m_old)
        self.store.put(ids, self._last_rows)
        return self._last_rows.reshape(packet.shape).to(packet.dtype)

    def stateless(self) -> Compressor:
        return self.c.stateless()

    def shared_state(self, sending: bool) -> torch.Tensor | None:
        """The entries the last message stored, as both ends computed them (a diverged entry of a sample in the
        batch shows here); the same whether ``sending`` or not."""
        return self._last_rows

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "store": self.store.state_dict(), "c": self.c.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.store.load_state_dict(state["store"])
        self.c.load_state_dict(state["c"])
