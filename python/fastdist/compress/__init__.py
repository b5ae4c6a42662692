"""Activation and gradient compression for model-parallel training.

Compressors (``compress(x) -> Packet``, ``decompress(packet) -> x``, ``wire_bytes(packet)``, ``roundtrip(x)``):
:class:`TopK`, :class:`Quantize`, :class:`Chain` (TopK then Quantize of the kept values), :class:`Identity`, and the
stateful :class:`ErrorFeedback`, :class:`EF21` and :class:`AQSGD` (with :class:`MemoryStore` / :class:`MmapStore`).

Placement: :class:`Boundary`, an ``nn.Module`` between blocks in one process; :func:`send` / :func:`recv` and
:class:`StageBoundary` between pipeline stages on different ranks (torch.distributed P2P).
"""
from fastdist.compress.aqsgd import AQSGD
from fastdist.compress.boundary import Boundary, batch
from fastdist.compress.compressors import Chain, Compressor, Identity, Packet, Quantize, TopK
from fastdist.compress.feedback import EF21, ErrorFeedback
from fastdist.compress.p2p import StageBoundary, check_same_pair, recv, send
from fastdist.compress.stores import MemoryStore, MmapStore, StoreCorruptedError, StoreFullError, StoreIOError

__all__ = ["AQSGD", "Boundary", "Chain", "Compressor", "EF21", "ErrorFeedback", "Identity", "MemoryStore",
           "MmapStore", "Packet", "Quantize", "StageBoundary", "StoreCorruptedError", "StoreFullError", "StoreIOError",
           "TopK", "batch", "check_same_pair", "recv", "send"]
