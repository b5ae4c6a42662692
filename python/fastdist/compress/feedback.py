"""Error feedback around a compressor: classic EF (a residual on the sender) and EF21 (both ends track an estimate).

One object is one end of a link: the sender calls ``compress``, the receiver (on another rank, with its own object)
calls ``decompress``. In one process (a :class:`~fastdist.compress.Boundary`) ``roundtrip`` does both with one state.
"""
import torch

from fastdist.compress.compressors import Compressor, Packet, check_compressible, check_compressor

__all__ = ["EF21", "ErrorFeedback"]


def _check_shape(state, x, who, what):
    if state is not None and tuple(state.shape) != tuple(x.shape):
        raise ValueError(f"fastdist.compress.{who}: the {what} has shape {tuple(state.shape)} but the input has "
                         f"{tuple(x.shape)}; every call must see the same shape (drop the last partial batch, or "
                         "call reset())")


class ErrorFeedback(Compressor):
    """c = C(x + e); e <- x + e - D(c). The sender keeps the residual e; the receiver needs no state.

    Args:
        c: the compressor C.
    """

    name = "ef"

    def __init__(self, c: Compressor):
        check_compressor(c, "ErrorFeedback")
        self.c = c
        self.residual = None

    def config(self) -> dict:
        return {"name": self.name, "c": self.c.config()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.c!r})"

    def reset(self) -> None:
        """Forgets the residual (e.g. when the input's shape changes)."""
        self.residual = None

    def _corrected(self, x):
        check_compressible(x, "ErrorFeedback")
        x = x.detach()
        _check_shape(self.residual, x, "ErrorFeedback", "residual")
        return x if self.residual is None else x + self.residual

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, Packet]:
        y = self._corrected(x)
        packet = self.c.compress(y)
        x_hat = self.c.decompress(packet)
        self.residual = y - x_hat
        return x_hat, packet

    def compress(self, x: torch.Tensor) -> Packet:
        return self.roundtrip(x)[1]

    def decompress(self, packet: Packet) -> torch.Tensor:
        return self.c.decompress(packet)

    def kept_indices(self, packet: Packet) -> tuple[torch.Tensor, int] | None:
        return self.c.kept_indices(packet)

    def stateless(self) -> Compressor:
        return self.c.stateless()

    def shared_state(self, sending: bool) -> torch.Tensor | None:
        return self.c.shared_state(sending)  # the residual is the sender's alone

    def state_dict(self) -> dict:
        return {"residual": self.residual, "c": self.c.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residual = state["residual"]
        self.c.load_state_dict(state["c"])


class EF21(Compressor):
    """Both ends keep an estimate A of x: the sender sends C(x - A) and both do A <- A + D(c); the receiver's
    output is its A. Sender and receiver estimates are equal bit for bit (the same float operations).

    Args:
        c: the compressor C.
    """

    name = "ef21"

    def __init__(self, c: Compressor):
        check_compressor(c, "EF21")
        self.c = c
        self.sent = None       # the sender's A
        self.received = None   # the receiver's A

    def config(self) -> dict:
        return {"name": self.name, "c": self.c.config()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.c!r})"

    def reset(self) -> None:
        """Forgets both estimates (both ends must reset together)."""
        self.sent = self.received = None

    def compress(self, x: torch.Tensor) -> Packet:
        check_compressible(x, "EF21")
        x = x.detach()
        _check_shape(self.sent, x, "EF21", "estimate")
        a = self.sent if self.sent is not None else torch.zeros_like(x)
        packet = self.c.compress(x - a)
        self.sent = a + self.c.decompress(packet)
        return packet

    def decompress(self, packet: Packet) -> torch.Tensor:
        update = self.c.decompress(packet)
        _check_shape(self.received, update, "EF21", "estimate")
        self.received = update if self.received is None else self.received + update
        return self.received.clone()

    def roundtrip(self, x: torch.Tensor) -> tuple[torch.Tensor, Packet]:
        packet = self.compress(x)
        return self.sent.clone(), packet

    def stateless(self) -> Compressor:
        return self.c.stateless()

    def shared_state(self, sending: bool) -> torch.Tensor | None:
        return self.sent if sending else self.received

    def state_dict(self) -> dict:
        return {"sent": self.sent, "received": self.received, "c": self.c.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sent, self.received = state["sent"], state["received"]
        self.c.load_state_dict(state["c"])
