"""Stateless compressors: TopK, Quantize, and TopK-then-Quantize, with the Packet they put on the wire.

Every compressor has ``compress(x) -> Packet``, ``decompress(packet) -> tensor`` (same shape and dtype as ``x``),
``wire_bytes(packet)`` and ``roundtrip(x) -> (x_hat, packet)``. A tensor is seen as ``[B, D]`` with ``B = x.shape[0]``
(one row per sample) and ``D`` the rest; a 0-d or 1-d tensor is one row.
"""
import dataclasses

import torch

from fastdist.ops import (dequantize, quantize, topk_bitmap_to_indices, topk_compress, topk_decompress,
                          topk_indices_to_bitmap)
from fastdist.ops.topk import topk_k

__all__ = ["Chain", "Compressor", "Identity", "Packet", "Quantize", "TopK", "as_rows", "check_compressible",
           "check_compressor"]


@dataclasses.dataclass
class Packet:
    """A compressed tensor: what crosses the wire (``tensors``) and the small header needed to rebuild it.

    kind:    which compressor made it ("dense", "topk", "quant", "chain", or a stateful wrapper's kind)
    shape:   the original shape; dtype: the original dtype
    tensors: name -> tensor; their bytes are the wire bytes
    meta:    name -> int, sizes the receiver could not infer (k, D, ...); a few bytes in a header
    local:   name -> tensor that this end already has or has derived (the sender's TopK indices, the receiver's
             decoded ones), so that decompress and kept_indices do not compute it twice; never sent
    """
    kind: str
    shape: tuple
    dtype: torch.dtype
    tensors: dict
    meta: dict = dataclasses.field(default_factory=dict)
    local: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def wire_bytes(self) -> int:
        """The bytes of the tensors that cross the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed ``[B, D]``: ``B = x.shape[0]`` (0-d and 1-d tensors are one row)."""
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], -1)


def check_compressible(x: torch.Tensor, who: str) -> None:
    """Raises unless ``x`` is what every compressor accepts: a non-empty floating-point tensor.

    Args:
        x: the input to compress.
        who: the compressor's name, for the message.

    Raises:
        TypeError: ``x`` is not a tensor, or not floating point.
        ValueError: ``x`` is empty.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fastdist.compress.{who}: expected a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"fastdist.compress.{who}: expected a floating-point tensor, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"fastdist.compress.{who}: cannot compress an empty tensor (shape {tuple(x.shape)})")


def check_compressor(c: "Compressor", who: str) -> None:
    """Raises TypeError unless ``c`` is a :class:`Compressor` (the inner compressor of a stateful wrapper).

    Args:
        c: the object given as a compressor.
        who: the wrapper's name, for the message.
    """
    if not isinstance(c, Compressor):
        raise TypeError(f"fastdist.compress.{who}: expected a compressor, got {type(c).__name__}")


class Compressor:
    """Base: subclasses implement compress / decompress and config(); the stateful ones state_dict too.

    Subclasses' methods keep these docstrings' contracts.
    """

    name = "compressor"

    def compress(self, x: torch.Tensor) -> Packet:
        """The packet that carries ``x`` (the sending end; a stateful compressor updates its state).

        Args:
            x: a non-empty floating-point tensor.
        """
        raise NotImplementedError

    def decompress(self, packet: Packet) -> torch.Tensor:
        """The tensor a packet carries, of the original shape and dtype (the receiving end)."""
        raise NotImplementedError

    def wire_bytes(self, packet: Packet) -> int:
        """The bytes ``packet`` puts on the wire."""
        return packet.wire_bytes()

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, Packet]:
        """(decompress(compress(x)), packet): what the receiving end sees, computed in one process."""
        packet = self.compress(x)
        return self.decompress(packet), packet

    def kept_indices(self, packet: Packet) -> tuple[torch.Tensor, int] | None:
        """For a sparsifying compressor, (indices int32 [rows, k], d): the positions of x viewed [rows, d] that the
        packet keeps, so that the exact derivative of the masking (the forward mask applied to the gradient) can be
        formed; None when the output is not a masking of the input."""
        return None

    def stateless(self) -> "Compressor":
        """The compressor to apply where no state may change (inference): itself for stateless ones."""
        return self

    def config(self) -> dict:
        """A plain dict of the settings both ends must agree on (fingerprinted across ranks)."""
        return {"name": self.name}

    def shared_state(self, sending: bool) -> torch.Tensor | None:
        """The state that the two ends of a link hold bit for bit alike after the last message: this end's copy, as
        it is after its last ``compress`` (``sending``) or ``decompress``; None when the ends share no state (the
        stateless compressors, and classic error feedback, whose residual only the sender has). Links compare the
        ends' digests of it (:func:`~fastdist.distributed.state_digest`)."""
        return None

    def state_dict(self) -> dict:
        """The compressor's state (empty for stateless ones)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            ValueError: a stateless compressor given state.
        """
        if state:
            raise ValueError(f"fastdist.compress.{self.name}: stateless, but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class Identity(Compressor):
    """No compression: the tensor itself is the packet (the baseline every table compares with)."""

    name = "none"

    def compress(self, x: torch.Tensor) -> Packet:
        check_compressible(x, "Identity")
        return Packet("dense", tuple(x.shape), x.dtype, {"x": x.detach().contiguous()})

    def decompress(self, packet: Packet) -> torch.Tensor:
        return packet.tensors["x"]


class TopK(Compressor):
    """Keeps the k = ceil(ratio * D) largest magnitudes of each row (per="sample") or of the whole tensor
    (per="tensor"); ties go to the lower index.

    Encoding: values + int32 indices (4k bytes of indices), or values + a bitmap of the row (D / 8 bytes) when that
    is smaller (k > D / 32), or as forced by ``encoding="indices"|"bitmap"``. Values keep x's dtype.

    Args:
        ratio: the fraction of each row (or of the tensor) kept, in (0, 1].
        per: ``"sample"`` (each row) or ``"tensor"`` (the whole tensor as one row).
        encoding: ``"auto"``, ``"indices"`` or ``"bitmap"``.
    """

    name = "topk"

    def __init__(self, ratio: float, per: str = "sample", encoding: str = "auto"):
        if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"fastdist.compress.TopK: 'ratio' must be in (0, 1], got {ratio!r}")
        if per not in ("sample", "tensor"):
            raise ValueError(f"fastdist.compress.TopK: 'per' must be \"sample\" or \"tensor\", got {per!r}")
        if encoding not in ("auto", "indices", "bitmap"):
            raise ValueError(f"fastdist.compress.TopK: 'encoding' must be \"auto\", \"indices\" or \"bitmap\", got "
                             f"{encoding!r}")
        self.ratio, self.per, self.encoding = float(ratio), per, encoding

    def config(self) -> dict:
        return {"name": self.name, "ratio": self.ratio, "per": self.per, "encoding": self.encoding}

    def _rows(self, x):
        return x.reshape(1, -1) if self.per == "tensor" else as_rows(x)

    def _uses_bitmap(self, k, d):
        if self.encoding != "auto":
            return self.encoding == "bitmap"
        return (d + 7) // 8 < 4 * k

    def compress(self, x: torch.Tensor) -> Packet:
        check_compressible(x, "TopK")
        rows = self._rows(x.detach())
        d = rows.shape[1]
        k = topk_k(self.ratio, d)
        values, indices = topk_compress(rows, k)
        meta = {"rows": rows.shape[0], "k": k, "d": d}
        if self._uses_bitmap(k, d):
            tensors = {"values": values, "bitmap": topk_indices_to_bitmap(indices, d)}
            return Packet("topk", tuple(x.shape), x.dtype, tensors, meta, {"indices": indices})
        return Packet("topk", tuple(x.shape), x.dtype, {"values": values, "indices": indices}, meta)

    def indices(self, packet: Packet) -> torch.Tensor:
        """int32 ``[B, k]``: the kept positions of each row of ``packet``, ascending (decoded from the bitmap once
        per packet)."""
        if "indices" in packet.tensors:
            return packet.tensors["indices"]
        if "indices" not in packet.local:
            packet.local["indices"] = topk_bitmap_to_indices(packet.tensors["bitmap"], packet.meta["d"],
                                                             packet.meta["k"])
        return packet.local["indices"]

    def decompress(self, packet: Packet) -> torch.Tensor:
        values = packet.tensors["values"]
        return topk_decompress(values, self.indices(packet), packet.meta["d"]).reshape(packet.shape)

    def kept_indices(self, packet: Packet) -> tuple[torch.Tensor, int] | None:
        return self.indices(packet), packet.meta["d"]


class Quantize(Compressor):
    """Quantizes to ``bits`` (1, 2, 4, 8) with scales per tensor, per row (``granularity="row"``, x as [B, D]), per
    column (``"column"``: one scale per feature across the batch; the codes are laid out column by column) or per
    group of G consecutive values (``granularity=G``, G must divide D). minmax sends a float32 scale and zero
    point per group, absmax a scale only. Stochastic rounding draws a fresh seed per call (``seed`` + call count,
    kept in state_dict) so successive calls are independent but reproducible.

    Args:
        bits: 1, 2, 4 or 8.
        scheme: ``"minmax"`` (scale and zero point) or ``"absmax"`` (scale only).
        granularity: ``"tensor"``, ``"row"``, ``"column"`` or a group size G.
        stochastic: round stochastically instead of to nearest.
        seed: the first stochastic call's seed.
    """

    name = "quant"

    def __init__(self, bits: int, scheme: str = "minmax", granularity: str | int = "row", stochastic: bool = False,
                 seed: int = 0):
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"fastdist.compress.Quantize: 'bits' must be 1, 2, 4 or 8, got {bits!r}")
        if scheme not in ("minmax", "absmax"):
            raise ValueError(f"fastdist.compress.Quantize: 'scheme' must be \"minmax\" or \"absmax\", got {scheme!r}")
        if granularity not in ("tensor", "row", "column") and not (isinstance(granularity, int) and granularity >= 1):
            raise ValueError("fastdist.compress.Quantize: 'granularity' must be \"tensor\", \"row\", \"column\" or a "
                             f"group size >= 1, got {granularity!r}")
        self.bits, self.scheme, self.granularity = bits, scheme, granularity
        self.stochastic, self.seed = bool(stochastic), int(seed)
        self.calls = 0

    def config(self) -> dict:
        return {"name": self.name, "bits": self.bits, "scheme": self.scheme, "granularity": self.granularity,
                "stochastic": self.stochastic, "seed": self.seed}

    def _group(self, x):
        if self.granularity == "tensor":
            return x.numel()
        if self.granularity == "column":
            return as_rows(x).shape[0]  # the transposed rows are the columns
        d = as_rows(x).shape[1]
        if self.granularity == "row":
            return d
        if d % self.granularity:
            raise ValueError(f"fastdist.compress.Quantize: group size {self.granularity} must divide the row length "
                             f"{d} (x of shape {tuple(x.shape)})")
        return self.granularity

    def compress(self, x: torch.Tensor) -> Packet:
        check_compressible(x, "Quantize")
        x = x.detach()
        group = self._group(x)
        seed = (self.seed + self.calls) % 2**63
        if self.stochastic:
            self.calls += 1
        src = as_rows(x).t() if self.granularity == "column" else x
        packed, scales, zeros = quantize(src.contiguous(), self.bits, self.scheme, group, self.stochastic, seed)
        tensors = {"packed": packed, "scales": scales}
        if self.scheme == "minmax":
            tensors["zeros"] = zeros
        return Packet("quant", tuple(x.shape), x.dtype, tensors, {"group": group})

    def decompress(self, packet: Packet) -> torch.Tensor:
        t = packet.tensors
        zeros = t.get("zeros")
        if zeros is None:
            zeros = torch.zeros_like(t["scales"])
        group = packet.meta["group"]
        if self.granularity == "column":  # codes of the transposed [D, B] view
            d = t["scales"].numel()
            out = dequantize(t["packed"], t["scales"], zeros, self.bits, self.scheme, group, (d, group))
            return out.t().reshape(packet.shape).to(packet.dtype)
        out = dequantize(t["packed"], t["scales"], zeros, self.bits, self.scheme, group, packet.shape)
        return out.to(packet.dtype)

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])


class Chain(Compressor):
    """TopK, then Quantize of the kept values (``[B, k]``): indices or bitmap + packed codes + scales.

    Args:
        topk: the sparsifier.
        quant: the quantizer of the kept values, per ``"row"`` or per ``"tensor"``.
    """

    name = "chain"

    def __init__(self, topk: TopK, quant: Quantize):
        if not isinstance(topk, TopK) or not isinstance(quant, Quantize):
            raise TypeError("fastdist.compress.Chain: expected Chain(TopK(...), Quantize(...)), got "
                            f"Chain({type(topk).__name__}, {type(quant).__name__})")
        if quant.granularity not in ("row", "tensor"):
            raise ValueError("fastdist.compress.Chain: quantize the kept values per \"row\" or per \"tensor\" (a "
                             f"group size need not divide k, and columns of kept values are not features), got "
                             f"{quant.granularity!r}")
        self.topk, self.quant = topk, quant

    def config(self) -> dict:
        return {"name": self.name, "topk": self.topk.config(), "quant": self.quant.config()}

    def __repr__(self) -> str:
        return f"Chain({self.topk!r}, {self.quant!r})"

    def compress(self, x: torch.Tensor) -> Packet:
        p = self.topk.compress(x)
        q = self.quant.compress(p.tensors["values"])
        tensors = {name: t for name, t in p.tensors.items() if name != "values"}
        tensors.update({f"q_{name}": t for name, t in q.tensors.items()})
        return Packet("chain", p.shape, p.dtype, tensors, {**p.meta, "group": q.meta["group"]}, p.local)

    def _topk_packet(self, packet, values=None):
        """The TopK packet inside (sharing the chain packet's local tensors), with `values` as its kept values."""
        meta = packet.meta
        tensors = {name: t for name, t in packet.tensors.items() if not name.startswith("q_")}
        if values is not None:
            tensors["values"] = values
        return Packet("topk", packet.shape, packet.dtype, tensors,
                      {"rows": meta["rows"], "k": meta["k"], "d": meta["d"]}, packet.local)

    def decompress(self, packet: Packet) -> torch.Tensor:
        meta = packet.meta
        q_tensors = {name[2:]: t for name, t in packet.tensors.items() if name.startswith("q_")}
        values = self.quant.decompress(Packet("quant", (meta["rows"], meta["k"]), packet.dtype, q_tensors,
                                              {"group": meta["group"]}))
        return self.topk.decompress(self._topk_packet(packet, values))

    def kept_indices(self, packet: Packet) -> tuple[torch.Tensor, int] | None:
        return self.topk.kept_indices(self._topk_packet(packet))

    def state_dict(self) -> dict:
        return {"quant": self.quant.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.quant.load_state_dict(state["quant"])
