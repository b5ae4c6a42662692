"""Compressed tensors over torch.distributed point-to-point, and StageBoundary: the autograd-aware link between two
pipeline stages on different ranks (compressed activation forward, compressed gradient backward).

A packet crosses as one frame: a 16-byte prefix (frame bytes, header bytes), the pickled header (kind / shape /
dtype / meta / tensor layout and the sender's configuration fingerprint), then the packet's tensors, each at a
16-byte aligned offset; the receiver's tensors are views into the frame it received. A P2P message costs a
rendezvous round trip whenever the receiver has not posted its receive yet, and a receive must be posted with a
size, so the frame is sent as one message into a receive buffer of `capacity` bytes, which both ends of a
`Channel` track identically; gloo accepts a message smaller than the posted buffer. A frame larger than the
capacity is announced first by a prefix alone (frame bytes, header bytes 0), which raises the capacity on both
ends: a link whose packets keep their size sends one message per packet. NCCL needs the exact size, so there every
frame is announced. Messages between two ranks are matched in order, as torch.distributed P2P is. Both ends of a
StageBoundary check once, at construction, that their configurations agree (a pairwise fingerprint exchange that
raises on both ends, naming the differing fields); every frame also carries the fingerprint, so a receiver never
decodes with a configuration other than the sender's.

What the ends must keep agreeing on while they run is checked in the frames they send anyway. A StageBoundary
numbers its forward frames, and each gradient frame names the forward frame it answers, so a call skipped or added
on one end (or gradients sent back in another order than the sender takes them) raises instead of pairing step n
with step n + 1. A stateful compressor's shared state (EF21's estimate, AQ-SGD's entries of the batch) is digested
after each message (every ``check_every``) by the sender and sent in the frame, and the receiver compares it with
its own before it returns anything. The end that finds a mismatch raises and sends the other end a mismatch frame,
which raises there at its next receive on the link (an end blocked in a send the raising end will never match sees
the connection close instead).
"""
import datetime
import math
import pickle
import struct
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastdist.compress.aqsgd import AQSGD
from fastdist.compress.boundary import check_boundary_arguments
from fastdist.compress.compressors import Compressor, Identity, Packet
from fastdist.distributed import CallCounter, MismatchError, fingerprint, state_digest
from fastdist.ops import topk_decompress

__all__ = ["Channel", "StageBoundary", "check_same_pair", "decode_frame", "encode_frame", "recv", "recv_packet", "send",
           "send_packet"]


def _device(group):
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def _exchange(value_bytes, peer, group, device):
    """Sends our bytes to `peer` and returns theirs; both ends call it at the same time (no deadlock: the send is
    asynchronous)."""
    payload = torch.frombuffer(bytearray(value_bytes), dtype=torch.uint8).to(device)
    n_mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    n_theirs = torch.empty(1, dtype=torch.int64, device=device)
    req = dist.isend(n_mine, peer, group=group)
    dist.recv(n_theirs, peer, group=group)
    req.wait()
    theirs = torch.empty(int(n_theirs.item()), dtype=torch.uint8, device=device)
    req = dist.isend(payload, peer, group=group)
    dist.recv(theirs, peer, group=group)
    req.wait()
    return theirs.cpu().numpy().tobytes()


def _flatten(config, prefix=""):
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_same_pair(name: str, config: dict, peer: int, group: dist.ProcessGroup | None = None) -> None:
    """Raises MismatchError on both ranks of a pair when their ``config`` dicts differ, naming the differing fields.

    Both ranks must call it with each other as ``peer`` (a pairwise exchange of fingerprints; of the configs
    themselves only on a mismatch).

    Args:
        name: what the config configures, for the message.
        config: a dict of plain values (nested dicts allowed).
        peer: the other rank (its global rank, as torch.distributed P2P takes it).
        group: the process group (None: the default group).
    """
    device = _device(group)
    mine = fingerprint(config).to_bytes(8, "little", signed=True)
    if _exchange(mine, peer, group, device) == mine:
        return
    theirs = pickle.loads(_exchange(pickle.dumps(config), peer, group, device))
    a, b = _flatten(config), _flatten(theirs)
    fields = sorted(k for k in set(a) | set(b) if a.get(k, "<missing>") != b.get(k, "<missing>"))
    raise MismatchError(f"{name}: {', '.join(fields)}",
                        {dist.get_rank(): {f: a.get(f, "<missing>") for f in fields},
                         peer: {f: b.get(f, "<missing>") for f in fields}})


_PREFIX = 16  # int64 frame bytes, int64 header bytes (0: an announcement of the next frame's size)
_ALIGN = 16
_MIN_CAPACITY = 4096


def _aligned(n):
    return -(-n // _ALIGN) * _ALIGN


class Channel:
    """One direction of a link as both of its ends see it: the receive buffer size they agree on (it only grows, to
    the largest frame announced) and, on the sending end, the frame buffer reused from message to message. It pickles
    without the frame buffer."""

    def __init__(self):
        self.capacity = _MIN_CAPACITY
        self._frame = None

    def __getstate__(self) -> dict:
        return {"capacity": self.capacity, "_frame": None}

    def frame(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on ``device`` to assemble a frame in, reused while it is large enough."""
        if self._frame is None or self._frame.numel() < nbytes or self._frame.device != device:
            self._frame = torch.empty(max(nbytes, _MIN_CAPACITY), dtype=torch.uint8, device=device)
        return self._frame[:nbytes]


def _host_bytes(buf, begin, end):
    """bytes of uint8 tensor `buf` [begin, end): read in place on the CPU, copied from a device."""
    if buf.device.type == "cpu":
        return buf.numpy()[begin:end].tobytes()
    return buf[begin:end].cpu().numpy().tobytes()


def _exact_sizes(device):
    return device.type != "cpu"  # NCCL matches a receive's size exactly; gloo takes any message that fits


MISMATCH_SEND_WAIT_S = 5.0  # how long a rank that raised waits for its mismatch frame to leave (see _told)
_MISMATCH = "mismatch"  # the kind of the frame that tells the other end of a link it raised MismatchError
_DIGEST = "state_digest"  # the frame tensor that carries the sender's state digest


class _ReportedMismatch(MismatchError):
    """The MismatchError the other end of a link found and sent in a mismatch frame (not to be sent back)."""


def encode_frame(packet: Packet, device: torch.device, config_fingerprint: int = 0, number: int = 0,
                 digest: torch.Tensor | None = None, buffer: Callable[[int], torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """The frame that carries ``packet`` (see the module docstring), assembled on ``device``.

    Args:
        packet: what to encode.
        device: where the frame is assembled (the device the group sends from).
        config_fingerprint: the sender's compressor configuration's fingerprint, checked by the receiver.
        number: the frame's number on its link, in the header.
        digest: the sender's :func:`state_digest` of its shared state after this packet, or None.
        buffer: ``nbytes -> uint8 tensor of nbytes`` to assemble the frame in (None: a fresh tensor).

    Returns:
        The frame: a uint8 tensor whose size is a multiple of 16 bytes.
    """
    named = dict(packet.tensors)
    if digest is not None:
        named[_DIGEST] = digest
    tensors = [t.detach().contiguous() for t in named.values()]
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in zip(named, tensors)]
    header = pickle.dumps((config_fingerprint, number, packet.kind, packet.shape, packet.dtype, packet.meta, layout))
    offsets, end = [], _aligned(_PREFIX + len(header))
    for t in tensors:
        offsets.append(end)
        end = _aligned(end + t.numel() * t.element_size())
    frame = buffer(end) if buffer is not None else torch.empty(end, dtype=torch.uint8, device=device)
    head = struct.pack("<qq", end, len(header)) + header
    frame[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    for t, off in zip(tensors, offsets):
        if t.numel():
            frame[off:off + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    return frame


def decode_frame(buf: torch.Tensor, src: int, config_fingerprint: int | None = None, name: str = "packet") -> Packet:
    """The packet in a frame that :func:`encode_frame` made (``buf`` may be longer than the frame).

    Args:
        buf: the received bytes, a uint8 tensor.
        src: the sending rank, for the messages.
        config_fingerprint: this end's configuration fingerprint, checked against the sender's; None: unchecked.
        name: what the frame carries, for the messages.

    Returns:
        The packet; its tensors are views into ``buf``. ``packet.local`` holds the frame's number (``"number"``)
        and the sender's state digest (``"state_digest"``) if it sent one.

    Raises:
        MismatchError: the sender's configuration fingerprint differs from ``config_fingerprint``, or the sender sent
            a mismatch frame (it raised MismatchError itself).
    """
    end, header_len = struct.unpack("<qq", _host_bytes(buf, 0, _PREFIX))
    if header_len <= 0 or end > buf.numel():
        raise ValueError(f"{name}: not a frame (prefix {end}, {header_len} in a buffer of {buf.numel()} bytes)")
    fp, their_number, kind, shape, dtype, meta, layout = pickle.loads(_host_bytes(buf, _PREFIX, _PREFIX + header_len))
    if kind == _MISMATCH:
        raise _ReportedMismatch(meta["name"], meta["values_by_rank"])
    if config_fingerprint is not None and fp != config_fingerprint:
        raise MismatchError(f"{name}: compressor config", {src: f"fingerprint {fp:#x}",
                                                           dist.get_rank(): f"fingerprint {config_fingerprint:#x}"})
    tensors, off = {}, _aligned(_PREFIX + header_len)
    for t_name, t_dtype, t_shape in layout:
        nbytes = math.prod(t_shape) * t_dtype.itemsize
        tensors[t_name] = buf[off:off + nbytes].view(t_dtype).view(t_shape)
        off = _aligned(off + nbytes)
    local = {"number": their_number}
    if _DIGEST in tensors:
        local[_DIGEST] = tensors.pop(_DIGEST)
    return Packet(kind, shape, dtype, tensors, meta, local)


def send_packet(packet: Packet, dst: int, config_fingerprint: int = 0, group: dist.ProcessGroup | None = None,
                channel: Channel | None = None, number: int = 0, digest: torch.Tensor | None = None,
                in_flight: list | None = None) -> int:
    """Sends a Packet as one frame (see the module docstring).

    Args:
        packet: what to send.
        dst: the receiving rank.
        config_fingerprint: the sender's compressor configuration's fingerprint, checked by the receiver.
        group: the process group (None: the default group).
        channel: the sending end of a Channel whose receiving end is passed to recv_packet, or None for a fresh
            one on both ends.
        number: the frame's number on its link, in the header (``packet.local["number"]`` on the receiving end).
        digest: the sender's :func:`state_digest` of its shared state after this packet, or None.
        in_flight: None to return once the frame has gone; else a list that the messages and their isend handles
            are appended to, and the call returns at once.

    Returns:
        The bytes that went out: prefix, header, padding and tensors (and an announcement's prefix).
    """
    device = _device(group)
    channel = channel if channel is not None else Channel()
    frame = encode_frame(packet, device, config_fingerprint, number, digest, lambda n: channel.frame(n, device))
    end = sent = frame.numel()
    messages = []
    if end > channel.capacity or _exact_sizes(device):
        messages.append(torch.frombuffer(bytearray(struct.pack("<qq", end, 0)), dtype=torch.uint8).to(device))
        channel.capacity = max(channel.capacity, end)
        sent += _PREFIX
    messages.append(frame)
    for message in messages:
        if in_flight is None:
            dist.send(message, dst, group=group)
        else:
            in_flight.append((message, dist.isend(message, dst, group=group)))
    return sent


def recv_packet(src: int, config_fingerprint: int | None = None, group: dist.ProcessGroup | None = None,
                channel: Channel | None = None, name: str = "packet") -> Packet:
    """Receives a Packet sent by :func:`send_packet`.

    Args:
        src: the sending rank.
        config_fingerprint: this end's configuration fingerprint, checked against the sender's; None: unchecked.
        group: the process group (None: the default group).
        channel: the receiving end of the Channel the sender used, or None if it used None.
        name: what the frame carries, for the messages.

    Returns:
        The packet (see :func:`decode_frame`).

    Raises:
        MismatchError: the sender's configuration fingerprint differs from ``config_fingerprint``, or the sender sent
            a mismatch frame (it raised MismatchError itself).
    """
    device = _device(group)
    channel = channel if channel is not None else Channel()
    exact = _exact_sizes(device)
    buf = torch.empty(_PREFIX if exact else channel.capacity, dtype=torch.uint8, device=device)
    dist.recv(buf, src, group=group)
    end, header_len = struct.unpack("<qq", _host_bytes(buf, 0, _PREFIX))
    if header_len == 0:  # an announcement: the frame follows, at its exact size
        channel.capacity = max(channel.capacity, end)
        buf = torch.empty(end if exact else channel.capacity, dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group)
    return decode_frame(buf, src, config_fingerprint, name)


def _check_digest(name, theirs, mine, peer):
    """Raises MismatchError when the sender's state digest ``theirs`` differs from this end's ``mine``."""
    if theirs is None or mine is None:
        return
    mine = mine.to(theirs.device)
    if not torch.equal(theirs, mine):
        raise MismatchError(f"{name} (the ends' compressor states diverged: a state lost, reset or loaded on one "
                            "end only)", {peer: f"digest {theirs.tolist()}",
                                          dist.get_rank(): f"digest {mine.tolist()}"})


def send(t: torch.Tensor, dst: int, compressor: Compressor, group: dist.ProcessGroup | None = None,
         sample_ids: torch.Tensor | None = None) -> Packet:
    """Compresses ``t`` with ``compressor`` and sends it to rank ``dst``.

    Args:
        t: the tensor.
        dst: the receiving rank, which calls :func:`recv` with a compressor of the same configuration.
        compressor: this end's compressor (its state changes as on any compress).
        group: the process group (None: the default group).
        sample_ids: the batch's sample ids, for AQ-SGD.

    Returns:
        The packet sent.
    """
    packet = compressor.compress(t, sample_ids) if isinstance(compressor, AQSGD) else compressor.compress(t)
    send_packet(packet, dst, fingerprint(compressor.config()), group, digest=_digest_of(compressor, sending=True))
    return packet


def _digest_of(compressor, sending):
    state = compressor.shared_state(sending)
    return None if state is None else state_digest(state)


def recv(src: int, compressor: Compressor, group: dist.ProcessGroup | None = None,
         device: torch.device | str | None = None) -> torch.Tensor:
    """Receives what :func:`send` sent from rank ``src`` and decompresses it.

    Args:
        src: the sending rank.
        compressor: this end's compressor (its state, e.g. AQ-SGD's store, is this end's).
        group: the process group (None: the default group).
        device: where to put the result (default: where it arrived).

    Raises:
        MismatchError: the sender's configuration differs, or its compressor state and this end's diverged.
    """
    packet = recv_packet(src, fingerprint(compressor.config()), group)
    out = compressor.decompress(packet)
    _check_digest("recv", packet.local.get(_DIGEST), _digest_of(compressor, sending=False), src)
    return out if device is None else out.to(device)


class _SendActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link, sample_ids):
        ctx.link = link
        ctx.number, ctx.kept = link._send_forward(x.detach(), sample_ids)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.link._recv_backward(ctx.number, ctx.kept, ctx.shape, ctx.dtype), None, None


class _RecvActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, link, device):
        ctx.link = link
        x, ctx.number, ctx.kept = link._recv_forward(device)
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.link._send_backward(grad, ctx.number, ctx.kept)
        return None, None, None


_DETACHED = "detached"  # the group of an unpickled link that was made on a group other than the default one


class StageBoundary:
    """One end of the link between pipeline stage ranks `sender` -> `receiver` (both ends construct it, with the
    same arguments; construction is a pairwise handshake).

    Sender end: ``token = link.send(y, sample_ids=None)`` sends the compressed activation; ``token.backward()`` (or a
    loss that includes it) receives the compressed gradient and continues the backward pass through ``y``.
    Receiver end: ``x = link.recv()`` returns the activation; when the backward pass reaches ``x``, its gradient is
    compressed and sent back. With ``backward_mask="reuse"`` and a TopK-type ``fwd``, only the gradient at the
    forward's kept positions is sent (k values per row, no indices: both ends know them), compressed by ``bwd``.
    ``stats`` holds the last message's wire bytes in each direction.

    While they run, the ends check each other in the frames they send anyway (see the module docstring): activations
    are numbered and gradients name the activation they answer; a stateful compressor's shared state (EF21's
    estimate, AQ-SGD's entries of the batch) is digested by the sender and compared by the receiver. ``state_dict``
    holds both compressors' state and the activation count. The link pickles without its process group: an
    unpickled link made on a group other than the default one needs ``link.group`` set before use.

    Args:
        sender: the rank of the stage before the link.
        receiver: the rank of the stage after it.
        fwd: the activation's compressor (None: uncompressed).
        bwd: the gradient's compressor (None: uncompressed; never AQ-SGD).
        backward_mask: ``"reuse"`` or ``"independent"``, as for :class:`~fastdist.compress.Boundary`.
        group: the process group the ranks are numbered in (None: the default group).
        check_every: digest the compressor state this end sends after every ``check_every``-th message (0: never).
            The default, every message, makes the receiver raise before it returns the first activation of a
            diverged state, for one pass over the state on each end (less than the compression's own passes, and no
            device synchronization on the sender); a larger value trades detection delay for that pass.

    Raises:
        MismatchError: on both ends, when their configurations differ, and while running as described above.
    """

    def __init__(self, sender: int, receiver: int, fwd: Compressor | None = None, bwd: Compressor | None = None,
                 backward_mask: str = "reuse", group: dist.ProcessGroup | None = None, check_every: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("fastdist.compress.StageBoundary needs an initialized torch.distributed process group")
        rank = dist.get_rank()
        if rank not in (sender, receiver) or sender == receiver:
            raise ValueError(f"fastdist.compress.StageBoundary: rank {rank} is neither end of {sender} -> {receiver}")
        check_boundary_arguments("StageBoundary", fwd, bwd, backward_mask)
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 0:
            raise ValueError(f"fastdist.compress.StageBoundary: 'check_every' must be an int >= 0, got "
                             f"{check_every!r}")
        self.sender, self.receiver, self.group = sender, receiver, group
        self.fwd = fwd if fwd is not None else Identity()
        self.bwd = bwd if bwd is not None else Identity()
        self.backward_mask, self.check_every = backward_mask, check_every
        self.is_sender = rank == sender
        self.peer = receiver if self.is_sender else sender
        self.name = f"StageBoundary {sender}->{receiver}"
        self.config = {"fwd": self.fwd.config(), "bwd": self.bwd.config(), "backward_mask": backward_mask}
        check_same_pair(self.name, {**self.config, "ends": (sender, receiver)}, self.peer, group)
        self._fwd_fp, self._bwd_fp = fingerprint(self.fwd.config()), fingerprint(self.bwd.config())
        self._fwd_channel, self._bwd_channel = Channel(), Channel()
        self._activations = CallCounter()  # sent (sender end) or received (receiver end)
        self._mismatch_sends = []  # mismatch frames in flight to the other end (kept alive; see _told)
        self.stats = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["group"] = None if self.group is None else _DETACHED
        state["_mismatch_sends"] = []
        return state

    def state_dict(self) -> dict:
        """Both compressors' state and the activations counted (both ends must restore states of the same step)."""
        return {"fwd": self.fwd.state_dict(), "bwd": self.bwd.state_dict(),
                "activations": self._activations.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state``, what :meth:`state_dict` returned."""
        self.fwd.load_state_dict(state["fwd"])
        self.bwd.load_state_dict(state["bwd"])
        self._activations.load_state_dict(state["activations"])

    # -- autograd-facing API
    def send(self, y: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Sends the compressed activation ``y`` (sender end); ``backward()`` on the returned token (or a loss that
        includes it) receives the gradient and continues the backward pass through ``y``.

        Args:
            y: the activation.
            sample_ids: the batch's sample ids, for an AQ-SGD ``fwd``.

        Returns:
            A 0-d token tensor.
        """
        self._check_end(sending=True)
        return _SendActivation.apply(y, self, sample_ids)

    def recv(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The activation the sender sent (receiver end); its gradient goes back when the backward pass reaches it.

        Args:
            device: where to put it (default: where it arrived).
        """
        self._check_end(sending=False)
        anchor = torch.zeros((), requires_grad=True)
        return _RecvActivation.apply(anchor, self, device)

    def _check_end(self, sending):
        if sending != self.is_sender:
            raise RuntimeError(f"fastdist.compress.{self.name}: rank {dist.get_rank()} is the "
                               f"{'sending' if self.is_sender else 'receiving'} end")
        if isinstance(self.group, str):
            raise RuntimeError(f"fastdist.compress.{self.name} was unpickled without its process group: set "
                               "link.group to the group it was made with")

    # -- the four halves
    def _kept(self, packet):
        if self.backward_mask != "reuse":
            return None
        return self.fwd.kept_indices(packet)

    def _digest(self, compressor, number):
        if self.check_every == 0 or number % self.check_every:
            return None
        return _digest_of(compressor, sending=True)

    def _told(self, error, channel, fp):
        """Sends the other end a mismatch frame carrying ``error`` on ``channel`` and returns ``error`` to raise.

        Waits at most MISMATCH_SEND_WAIT_S for the frame to go out: the other end may be blocked elsewhere, or gone,
        but when it is waiting on this channel, a process that raised and exited before the frame left would leave
        it with "connection closed" instead of the MismatchError."""
        packet = Packet(_MISMATCH, (), torch.float32, {}, {"name": error.name, "values_by_rank": error.values_by_rank})
        first = len(self._mismatch_sends)
        send_packet(packet, self.peer, fp, self.group, channel, in_flight=self._mismatch_sends)
        deadline = time.monotonic() + MISMATCH_SEND_WAIT_S
        for _, handle in self._mismatch_sends[first:]:
            try:
                handle.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:  # not taken in time, or the other end is gone: raise the error anyway
                break
        return error

    def _send_forward(self, x, sample_ids):
        packet = self.fwd.compress(x, sample_ids) if isinstance(self.fwd, AQSGD) else self.fwd.compress(x)
        number = self._activations.take()
        self.stats["fwd_wire_bytes"] = send_packet(packet, self.receiver, self._fwd_fp, self.group,
                                                   self._fwd_channel, number, self._digest(self.fwd, number))
        self.stats["fwd_dense_bytes"] = x.numel() * x.element_size()
        return number, self._kept(packet)

    def _receive(self, forward, check_number):
        """Receives and decompresses the next frame of one direction (the activation's if ``forward``), checking its
        number with ``check_number(the frame's number) -> this end's`` and the sender's state digest. A mismatch found
        here goes to the other end in a mismatch frame on the other direction's channel, then raises.

        Returns:
            (the packet, this end's number of it, the decompressed tensor).
        """
        src, compressor, fp, channel = (self.sender, self.fwd, self._fwd_fp, self._fwd_channel) if forward else \
            (self.receiver, self.bwd, self._bwd_fp, self._bwd_channel)
        what = f"{self.name} {'activation' if forward else 'gradient'}"
        try:
            packet = recv_packet(src, fp, self.group, channel, what)
            number = check_number(packet.local["number"])
            out = compressor.decompress(packet)
            if _DIGEST in packet.local:
                _check_digest(f"{what} {number}: {type(compressor).__name__} state", packet.local[_DIGEST],
                              _digest_of(compressor, sending=False), src)
        except _ReportedMismatch:
            raise
        except MismatchError as e:
            reply, reply_fp = (self._bwd_channel, self._bwd_fp) if forward else (self._fwd_channel, self._fwd_fp)
            raise self._told(e, reply, reply_fp) from None
        return packet, number, out

    def _recv_forward(self, device):
        def count(theirs):
            number = self._activations.take()
            self._activations.check(f"{self.name} activation", {self.sender: theirs, self.receiver: number})
            return number

        packet, number, x = self._receive(True, count)
        return (x if device is None else x.to(device)), number, self._kept(packet)

    def _send_backward(self, grad, number, kept):
        if kept is not None:
            indices, d = kept
            grad = grad.reshape(indices.shape[0], d).gather(1, indices.long().to(grad.device))
        packet = self.bwd.compress(grad.contiguous())
        self.stats["bwd_wire_bytes"] = send_packet(packet, self.sender, self._bwd_fp, self.group,
                                                   self._bwd_channel, number, self._digest(self.bwd, number))

    def _recv_backward(self, number, kept, shape, dtype):
        def answers(theirs):
            if theirs != number:
                raise MismatchError(f"{self.name} gradient order (a backward skipped or added on one end, or run in "
                                    "another order)", {self.receiver: f"sent the gradient of activation {theirs}",
                                                       self.sender: f"expected the gradient of activation {number}"})
            return number

        _, _, grad = self._receive(False, answers)
        if kept is not None:
            indices, d = kept
            grad = topk_decompress(grad.to(torch.float32).contiguous(), indices, d)
        return grad.reshape(shape).to(dtype)
