"""Compressed pipeline boundaries inside torch.distributed.pipelining's schedules.

:class:`CompressedTransportMixin` goes before torch's ``PipelineStage`` in a stage class (``make_stage`` builds
one) and replaces only what crosses the wire: the P2P ops that torch's schedules (``ScheduleGPipe``,
``Schedule1F1B``, fastdist.parallel's own) post, and the receive buffers they read. The schedule still decides when
each microbatch's activation and gradient move; the stage now sends, in place of the dense tensor, one frame of
fastdist.compress's P2P format (a small pickled header, then the packet's tensors: TopK values and indices,
quantized codes, scales, all in one byte buffer) and decodes what it receives:

- activations go forward compressed by ``fwd`` (TopK, Quantize, Chain, ErrorFeedback, EF21, AQ-SGD);
- gradients go back compressed by ``bwd``; with ``backward_mask="reuse"`` and a TopK-type ``fwd`` only the
  gradient at the forward's kept positions travels (k values per row, no indices: both ends know them), which is
  the exact derivative of the masking, as :class:`~fastdist.compress.StageBoundary` does;
- AQ-SGD keeps its per-sample store on both ends of each link; the sender takes the batch's sample ids from
  :func:`fastdist.compress.batch` around ``schedule.step`` and splits them into microbatches as the schedule
  splits the batch.

torch posts a receive before the frame arrives, so its size must be known: both ends compute one capacity per
direction from the compressor's configuration and the activation's shape (a probe packet of that shape; TopK's k
and the quantized sizes do not depend on the values; AQ-SGD's bound is the larger of an all-new and an all-seen
microbatch), and a frame never exceeds it. gloo takes a message shorter than the posted buffer, so a frame goes
out at its own size; where the backend matches sizes exactly (NCCL) it is padded to the capacity.

Checks: at set-up both ends of every link compare their configurations (compress.p2p.check_same_pair: a mismatch
raises MismatchError on both ranks, naming the fields, before any activation moves). Every frame carries the
sender's compressor fingerprint and a number: activations are numbered, and a gradient names the activation it
answers, so a skipped or reordered microbatch raises instead of decoding the wrong one; a stateful compressor's
shared state (AQ-SGD's entries of the microbatch, EF21's estimate) is digested by the sender and compared by the
receiver. The end that finds a mismatch sends the other end a mismatch frame (it raises there at its next receive
on the link) and raises.

Every link uses one compressor configuration: a stage's ``fwd`` compresses its outgoing activation, and a copy of
it with fresh state (with ``store`` as its AQ-SGD store) decodes the incoming one; likewise ``bwd`` compresses the
gradient this stage sends back and a copy decodes the gradient it receives.
"""
from __future__ import annotations

import copy
import datetime
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fastdist.compress.aqsgd import AQSGD
from fastdist.compress.boundary import check_boundary_arguments, current_batch
from fastdist.compress.compressors import Compressor, Identity, Packet
from fastdist.compress.p2p import (_MISMATCH, MISMATCH_SEND_WAIT_S, _check_digest, _digest_of, _exact_sizes,
                                   _ReportedMismatch, check_same_pair, decode_frame, encode_frame)
from fastdist.compress.stores import MemoryStore, SampleStore
from fastdist.distributed import CallCounter, MismatchError, fingerprint
from fastdist.ops import topk_decompress

__all__ = ["CompressedPipelineStage", "CompressedTransportMixin", "frame_capacities", "make_stage"]

_SLACK = 256  # header bytes a frame may need beyond its probe's (larger frame numbers, counts in the metadata)
_MIN_CAPACITY = 1024  # room for a mismatch frame on every direction
_PROBE_NUMBER = 2**40


def _probe_frames(c: Compressor, shape: tuple, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """(packet, frame) pairs whose frame sizes bound those ``c`` sends for a tensor of ``shape`` (made on copies:
    ``c`` is untouched)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    if isinstance(c, AQSGD):
        rows = x.shape[0] if x.dim() > 1 else 1
        probe = AQSGD(copy.deepcopy(c.c), MemoryStore(rows, torch.float32), warmup_epochs=1)
        ids = torch.arange(rows)
        calls = [lambda: probe.compress(x, ids), lambda: (probe.set_epoch(1), probe.compress(x, ids))[1]]
    else:
        probe = copy.deepcopy(c)
        calls = [lambda: probe.compress(x)]
    frames = []
    for call in calls:  # AQ-SGD: every sample new (sent in full), then every sample seen (the compressed changes)
        packet = call()
        frames.append((packet, encode_frame(packet, device, 0, _PROBE_NUMBER, _digest_of(probe, sending=True))))
    return frames


def frame_capacities(fwd: Compressor, bwd: Compressor, backward_mask: str, shape: tuple, dtype: torch.dtype,
                     device: torch.device | str = "cpu", training: bool = True) -> tuple[int, int]:
    """The receive buffer sizes (bytes) of one link: (activation frames, gradient frames).

    Both ends compute them alike from the link's configuration and the activation's shape and dtype.

    Args:
        fwd: the activation's compressor; bwd: the gradient's.
        backward_mask: ``"reuse"`` or ``"independent"``.
        shape: one microbatch's activation shape; dtype: its dtype.
        device: where frames are assembled.
        training: False: the forward-only frames (no gradient; 0 for it).
    """
    device = torch.device(device)
    frames = _probe_frames(fwd, tuple(shape), dtype, device)
    fwd_cap = max(_MIN_CAPACITY, max(f.numel() for _, f in frames) + _SLACK)
    if not training:
        return fwd_cap, 0
    kept = fwd.kept_indices(frames[0][0]) if backward_mask == "reuse" else None
    grad_shape = tuple(kept[0].shape) if kept is not None else tuple(shape)
    (_, grad), = _probe_frames(bwd, grad_shape, dtype, device)
    return fwd_cap, max(_MIN_CAPACITY, grad.numel() + _SLACK)


class _Link:
    """This stage's end of one link: the two compressors, the frame numbers, the capacities, the buffers."""

    def __init__(self, name: str, peer_stage: int, fwd: Compressor, bwd: Compressor):
        self.name, self.peer_stage = name, peer_stage
        self.fwd, self.bwd = fwd, bwd
        self.counter = CallCounter()  # activations sent (outgoing link) or received (incoming link)
        self.capacity = {"fwd": 0, "bwd": 0}
        self.buffers = {}  # (direction, "send"|"recv", chunk) -> uint8 tensor of the capacity
        self.pending = {}  # chunk -> (activation number, kept indices or None, shape, dtype)
        self.mismatch_sends = []

    def buffer(self, direction: str, kind: str, chunk: int, device: torch.device) -> torch.Tensor:
        cap = self.capacity[direction]
        key = (direction, kind, chunk)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() != cap or buf.device != device:
            buf = self.buffers[key] = torch.empty(cap, dtype=torch.uint8, device=device)
        return buf

    def state_dict(self) -> dict:
        return {"fwd": self.fwd.state_dict(), "bwd": self.bwd.state_dict(), "count": self.counter.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.fwd.load_state_dict(state["fwd"])
        self.bwd.load_state_dict(state["bwd"])
        self.counter.load_state_dict(state["count"])


def _receiving_copy(c: Compressor, store: SampleStore | None, who: str) -> Compressor:
    """The compressor that decodes what a stage with ``c`` sends: ``c``'s configuration with fresh state."""
    if not isinstance(c, AQSGD):
        return copy.deepcopy(c)
    if store is None:
        if not isinstance(c.store, MemoryStore):
            raise ValueError(f"fastdist.parallel.{who}: an AQ-SGD 'fwd' over a {type(c.store).__name__} needs "
                             "'store=' for the incoming link's entries (a second store: each link end keeps its own)")
        store = MemoryStore(c.store.capacity, c.store.dtype)
    if store is c.store:
        raise ValueError(f"fastdist.parallel.{who}: 'store' must not be the fwd compressor's own store (the incoming "
                         "and outgoing links keep different entries)")
    return copy.deepcopy(c, memo={id(c.store): store})


class CompressedTransportMixin:
    """Compressed activations and gradients between pipeline stages, driven by torch's schedules.

    Put it before ``PipelineStage`` (and after mixins that override the compute, e.g. recompute):
    ``type("Stage", (CompressedTransportMixin, PipelineStage), {})``. Every stage of the pipeline must use it
    with the same compressor configuration, one stage per rank (GPipe, 1F1B, fastdist.parallel's schedules).

    Args (keyword, besides PipelineStage's):
        fwd: the activation's compressor (None: uncompressed).
        bwd: the gradient's compressor (None: uncompressed; never AQ-SGD).
        backward_mask: ``"reuse"`` (the gradient at the forward's kept positions) or ``"independent"``.
        store: the AQ-SGD store of the incoming activations (default: a MemoryStore like ``fwd``'s).
        at_inference: compress in forward-only (eval) steps too, with ``fwd.stateless()``; default: send dense.
        check_every: digest a stateful compressor's shared state in every ``check_every``-th frame (0: never).

    ``transport_state_dict()`` / ``load_transport_state_dict()`` hold the compressors' state and frame counts;
    ``wire_bytes`` counts the bytes this stage sent in each direction.
    """

    def __init__(self, *args: Any, fwd: Compressor | None = None, bwd: Compressor | None = None,
                 backward_mask: str = "reuse", store: SampleStore | None = None, at_inference: bool = False,
                 check_every: int = 1, **kwargs: Any):
        who = type(self).__name__
        check_boundary_arguments(who, fwd, bwd, backward_mask)
        if store is not None and not isinstance(store, SampleStore):
            raise TypeError(f"fastdist.parallel.{who}: 'store' must be a MemoryStore or MmapStore, got "
                            f"{type(store).__name__}")
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 0:
            raise ValueError(f"fastdist.parallel.{who}: 'check_every' must be an int >= 0, got {check_every!r}")
        super().__init__(*args, **kwargs)
        if self.num_stages != self.group_size:
            # several stages per rank (interleaved, V-shaped schedules): torch's set-up then interleaves the stages'
            # blocking P2P in an order the pair checks here do not follow
            raise NotImplementedError(f"fastdist.parallel.{who}: one stage per rank of the pipeline group (got "
                                      f"{self.num_stages} stages on {self.group_size} ranks): GPipe, 1F1B and "
                                      "fastdist.parallel's single-stage schedules")
        fwd = fwd if fwd is not None else Identity()
        bwd = bwd if bwd is not None else Identity()
        self.backward_mask, self.at_inference, self.check_every = backward_mask, bool(at_inference), check_every
        self.link_config = {"fwd": fwd.config(), "bwd": bwd.config(), "backward_mask": backward_mask,
                            "at_inference": self.at_inference}
        s = self.stage_index
        self._out = None if self.is_last else _Link(f"stage {s}->{s + 1}", s + 1, fwd, copy.deepcopy(bwd))
        self._in = None if self.is_first else _Link(f"stage {s - 1}->{s}", s - 1,
                                                    _receiving_copy(fwd, store, who), bwd)
        self._links_checked = False
        self._training = True
        self.wire_bytes = {"fwd": 0, "bwd": 0}

    # -- state
    def transport_state_dict(self) -> dict:
        """The compressors' state and the activations counted on each link of this stage."""
        return {name: link.state_dict() for name, link in (("out", self._out), ("in", self._in)) if link}

    def load_transport_state_dict(self, state: dict) -> None:
        """Restores what :meth:`transport_state_dict` returned (every stage must restore the same step)."""
        for name, link in (("out", self._out), ("in", self._in)):
            if link is not None:
                link.load_state_dict(state[name])

    # -- set-up: the pair checks and the capacities, when the schedule prepares the stage
    def _prepare_forward_infra(self, num_microbatches: int, args: Any, kwargs: dict | None = None,
                               has_backward: bool = False) -> Any:
        if not self._links_checked:
            for link in (self._in, self._out):  # the previous link first: the pipeline's pairs meet in order
                if link is not None:
                    ends = tuple(sorted((self.stage_index, link.peer_stage)))
                    check_same_pair(f"fastdist.parallel pipeline link {link.name}",
                                    {**self.link_config, "ends": ends}, self._peer(link), self.group)
            self._links_checked = True
        out = super()._prepare_forward_infra(num_microbatches, args, kwargs, has_backward)
        self._training = bool(has_backward)
        for link, metas, what in ((self._in, self._stage_meta.inputs, "input"),
                                  (self._out, self._stage_meta.outputs, "output")):
            if link is None:
                continue
            if metas is None or len(metas) != 1 or not metas[0].dtype.is_floating_point:
                raise ValueError(f"fastdist.parallel.{type(self).__name__}: stage {self.stage_index}'s {what} across "
                                 f"link {link.name} must be one floating-point tensor, got {metas}")
            fwd, bwd = self._active(link.fwd), link.bwd
            link.capacity["fwd"], link.capacity["bwd"] = frame_capacities(
                fwd, bwd, self.backward_mask, tuple(metas[0].shape), metas[0].dtype, self.device, self._training)
        return out

    def _peer(self, link: _Link) -> int:
        return self._resolve_peer_global_rank(link.peer_stage)

    def _active(self, c: Compressor) -> Compressor:
        """The activation compressor of this step: ``c`` in training; at inference its stateless form or none."""
        if self._training:
            return c
        return c.stateless() if self.at_inference else Identity()

    def _digest(self, c: Compressor, number: int) -> torch.Tensor | None:
        if self.check_every == 0 or number % self.check_every:
            return None
        return _digest_of(c, sending=True)

    def _frame_op(self, link: _Link, direction: str, chunk: int, packet: Packet, c: Compressor,
                  number: int) -> dist.P2POp:
        """The isend of ``packet``'s frame on ``link`` (its buffer is this chunk's, alive until the next step)."""
        cap = link.capacity[direction]
        buf = link.buffer(direction, "send", chunk, self.device)

        def room(n):
            if n > cap:
                raise RuntimeError(f"fastdist.parallel: a {direction} frame of {n} bytes on link {link.name} exceeds "
                                   f"the {cap} bytes both ends agreed on (the activation's shape changed since the "
                                   "schedule's first step?)")
            return buf[:n]

        frame = encode_frame(packet, self.device, fingerprint(c.config()), number, self._digest(c, number), room)
        message = buf if _exact_sizes(self.device) else frame
        self.wire_bytes[direction] += message.numel()
        return dist.P2POp(dist.isend, message, self._peer(link), self.group)

    def _recv_op(self, link: _Link, direction: str, chunk: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, link.buffer(direction, "recv", chunk, self.device), self._peer(link),
                          self.group)

    def _decode(self, link: _Link, direction: str, chunk: int, c: Compressor, check_number) -> tuple:
        """The packet received for ``chunk`` on ``link``, its number (checked by ``check_number``) and its tensor.
        A mismatch found here goes to the other end in a mismatch frame on the other direction, then raises."""
        what = f"fastdist.parallel pipeline link {link.name} {'activation' if direction == 'fwd' else 'gradient'}"
        src = self._peer(link)
        try:
            packet = decode_frame(link.buffer(direction, "recv", chunk, self.device), src, fingerprint(c.config()),
                                  what)
            number = check_number(packet.local["number"])
            out = c.decompress(packet)
            if "state_digest" in packet.local:
                _check_digest(f"{what} {number}: {type(c).__name__} state", packet.local["state_digest"],
                              _digest_of(c, sending=False), src)
        except _ReportedMismatch:
            raise
        except MismatchError as e:
            later = range(chunk + 1, len(self.args_recv_info))
            raise self._tell(link, "bwd" if direction == "fwd" else "fwd", e, direction, later) from None
        return packet, number, out

    def _tell(self, link: _Link, direction: str, error: MismatchError, drain: str, chunks: range) -> MismatchError:
        """Sends the other end of ``link`` a mismatch frame carrying ``error`` on ``direction`` and returns
        ``error`` to raise. The frames of this step's later ``chunks`` that the other end may be sending on ``drain``
        are received (and dropped), so that a schedule waiting for those sends reaches the receive where the mismatch
        frame waits. Waits at most MISMATCH_SEND_WAIT_S in all: the other end may never post its receive."""
        cap = link.capacity[direction] or _MIN_CAPACITY
        packet = Packet(_MISMATCH, (), torch.float32, {}, {"name": error.name, "values_by_rank": error.values_by_rank})
        buf = torch.zeros(cap, dtype=torch.uint8, device=self.device)
        frame = encode_frame(packet, self.device, 0, 0, None, lambda n: buf[:n])
        handles = [dist.isend(buf if _exact_sizes(self.device) else frame, self._peer(link), group=self.group)]
        handles += [dist.irecv(link.buffer(drain, "recv", chunk, self.device), self._peer(link), group=self.group)
                    for chunk in chunks]
        link.mismatch_sends.append((buf, handles))
        deadline = time.monotonic() + MISMATCH_SEND_WAIT_S
        for handle in handles:
            try:
                handle.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:  # not taken in time, or the other end is gone: raise the error anyway
                break
        return error

    # -- forward: activations
    def _chunk_sample_ids(self, chunk: int) -> torch.Tensor | None:
        ids = current_batch().get("sample_ids")
        if ids is None:
            return None
        return torch.tensor_split(torch.as_tensor(ids), len(self.args_recv_info), 0)[chunk]

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """The isend of this microbatch's compressed activation frame to the next stage."""
        link = self._out
        if link is None:
            return []
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        y = outputs[0].detach()
        c = self._active(link.fwd)
        if isinstance(c, AQSGD):
            epoch = current_batch().get("epoch")
            if epoch is not None:
                c.set_epoch(epoch)
            packet = c.compress(y, self._chunk_sample_ids(fwd_chunk_id))
        else:
            packet = c.compress(y)
        number = link.counter.take()
        kept = c.kept_indices(packet) if self._training and self.backward_mask == "reuse" else None
        if self._training:
            link.pending[fwd_chunk_id] = (number, kept, y.shape, y.dtype)
        return [self._frame_op(link, "fwd", fwd_chunk_id, packet, c, number)]

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        """The irecv of this microbatch's activation frame from the previous stage."""
        return [] if self._in is None else [self._recv_op(self._in, "fwd", fwd_chunk_id)]

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> tuple[torch.Tensor, ...]:
        link = self._in
        c = self._active(link.fwd)

        def count(theirs):
            number = link.counter.take()
            link.counter.check(f"fastdist.parallel pipeline link {link.name} activation",
                               {self._peer(link): theirs, dist.get_rank(): number})
            return number

        packet, number, x = self._decode(link, "fwd", fwd_chunk_id, c, count)
        if self._training:
            kept = c.kept_indices(packet) if self.backward_mask == "reuse" else None
            link.pending[fwd_chunk_id] = (number, kept, None, None)
        info = self.args_recv_info[fwd_chunk_id][0]
        meta = info.tensor_meta
        grad = meta.requires_grad and self.has_backward and torch.is_grad_enabled()
        x = x.to(self.device, meta.dtype).detach().requires_grad_(grad)
        info.buffer = x
        return (x,)

    # -- backward: gradients
    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """The isend of the gradient of this microbatch's input, compressed (at the forward's kept positions with
        ``backward_mask="reuse"``), to the previous stage."""
        link = self._in
        if not self.has_backward or link is None:
            return []
        self._check_chunk_id(bwd_chunk_id)
        (grad,) = self.bwd_cache.pop(bwd_chunk_id)[:1]
        number, kept, _, _ = link.pending.pop(bwd_chunk_id)
        if grad is None:
            grad = torch.zeros_like(self.args_recv_info[bwd_chunk_id][0].buffer)
        if kept is not None:
            indices, d = kept
            grad = grad.reshape(indices.shape[0], d).gather(1, indices.long().to(grad.device))
        packet = link.bwd.compress(grad.contiguous())
        return [self._frame_op(link, "bwd", bwd_chunk_id, packet, link.bwd, number)]

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        """The irecv of this microbatch's gradient frame from the next stage."""
        if not self.has_backward or self._out is None:
            return []
        return [self._recv_op(self._out, "bwd", bwd_chunk_id)]

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> tuple[torch.Tensor, ...]:
        link = self._out
        number, kept, shape, dtype = link.pending.pop(bwd_chunk_id)

        def answers(theirs):
            if theirs != number:
                raise MismatchError(f"fastdist.parallel pipeline link {link.name} gradient order (a backward skipped "
                                    "or added on one end, or run in another order)",
                                    {self._peer(link): f"sent the gradient of activation {theirs}",
                                     dist.get_rank(): f"expected the gradient of activation {number}"})
            return number

        _, _, grad = self._decode(link, "bwd", bwd_chunk_id, link.bwd, answers)
        if kept is not None:
            indices, d = kept
            grad = topk_decompress(grad.to(torch.float32).contiguous(), indices, d)
        return (grad.reshape(shape).to(dtype),)


class CompressedPipelineStage(CompressedTransportMixin, PipelineStage):
    """torch's ``PipelineStage`` with compressed boundaries (see :class:`CompressedTransportMixin`)."""


def make_stage(submod: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
               group: dist.ProcessGroup | None = None, fwd: Compressor | None = None, bwd: Compressor | None = None,
               backward_mask: str = "reuse", store: SampleStore | None = None, **options: Any
               ) -> CompressedPipelineStage:
    """A pipeline stage whose activations and gradients cross compressed, for torch's schedules.

    Args:
        submod: this stage's module: takes the previous stage's output (the first stage: the batch's inputs) and
            returns one tensor.
        stage_index: this stage; num_stages: all of them (one per rank of ``group``).
        device: where the stage runs.
        group: the pipeline's process group (None: the default group).
        fwd, bwd, backward_mask, store: see :class:`CompressedTransportMixin`.
        **options: ``at_inference``, ``check_every``, and PipelineStage's ``input_args`` / ``output_args``.

    Returns:
        The stage; hand it to ``ScheduleGPipe`` / ``Schedule1F1B`` / ``fastdist.parallel``'s schedules.
    """
    return CompressedPipelineStage(submod, stage_index, num_stages, torch.device(device), group=group, fwd=fwd,
                                   bwd=bwd, backward_mask=backward_mask, store=store, **options)


# ---- measurement: this transport against the ways a user can compress pipeline boundaries today ----

BOUNDARY_METHODS = ["dense-1f1b", "naive-topk-1f1b", "stageboundary-gpipe", "transport-gpipe", "transport-1f1b"]
"""dense-1f1b: torch's PipelineStage and Schedule1F1B, uncompressed (torch as it is).
naive-topk-1f1b: what a user can do with torch's schedules today: the first stage's module ends in TopK and packs
    values and indices (as floats) in one tensor, the next unpacks them; the gradient of the packed tensor goes back
    uncompressed.
stageboundary-gpipe: fastdist.compress.StageBoundary (its own P2P) under a hand-written GPipe loop.
transport-gpipe / transport-1f1b: this module's stage under torch's ScheduleGPipe / Schedule1F1B.
Every compressed method: TopK(ratio) per sample forward; the compressed ones with mask reuse send the gradient's
k values per row as 8-bit codes."""


class _Block(nn.Module):
    """A stage of the measured pipeline: hidden -> expand x hidden -> hidden MLP, GELU, residual."""

    def __init__(self, hidden: int, expand: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, expand * hidden), nn.Linear(expand * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class _PackTopK(nn.Module):
    """The naive sender: the k largest magnitudes of each sample and their indices, as one float tensor [B, 2k]."""

    def __init__(self, ratio: float):
        super().__init__()
        self.ratio = ratio

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], -1)
        k = max(1, int(self.ratio * rows.shape[1] + 0.999999))
        idx = rows.abs().topk(k, dim=1).indices
        return torch.cat([rows.gather(1, idx), idx.to(rows.dtype)], dim=1)


class _UnpackTopK(nn.Module):
    """The naive receiver: scatters the packed values back into a dense tensor of ``shape`` (per sample)."""

    def __init__(self, shape: tuple):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        k = packed.shape[1] // 2
        values, idx = packed[:, :k], packed[:, k:].detach().long()
        dense = values.new_zeros(packed.shape[0], math.prod(self.shape))
        return dense.scatter(1, idx, values).reshape(packed.shape[0], *self.shape)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


class _Method:
    """One method's pipeline on this rank (a stage of 2): its module, optimizer, and schedule or link."""

    def __init__(self, method: str, config: dict, rank: int):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        from fastdist.compress import Quantize, StageBoundary, TopK

        torch.manual_seed(0)
        self.method, self.rank, self.n = method, rank, config["microbatches"]
        shape = (config["seq"], config["hidden"])
        block = _Block(config["hidden"], config["expand"])
        self.opt = torch.optim.SGD(block.parameters(), lr=1e-3)
        self.link = self.stage = self.schedule = None
        module = block
        if method == "naive-topk-1f1b":
            module = nn.Sequential(block, _PackTopK(config["ratio"])) if rank == 0 else \
                nn.Sequential(_UnpackTopK(shape), block)
        if method == "stageboundary-gpipe":
            self.block = block
            self.link = StageBoundary(0, 1, fwd=TopK(config["ratio"]), bwd=Quantize(8), backward_mask="reuse")
            return
        if method.startswith("transport"):
            self.stage = make_stage(module, rank, 2, "cpu", fwd=TopK(config["ratio"]), bwd=Quantize(8))
        elif method == "naive-topk-1f1b":  # static shapes: torch's shape inference would unpack uninitialized indices
            mb = torch.zeros(config["batch"] // self.n, *shape)
            packed = _PackTopK(config["ratio"])(mb).requires_grad_()
            self.stage = PipelineStage(module, rank, 2, torch.device("cpu"), input_args=mb if rank == 0 else packed,
                                       output_args=packed if rank == 0 else mb.clone().requires_grad_())
        else:
            self.stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        kind = ScheduleGPipe if method.endswith("gpipe") else Schedule1F1B
        self.schedule = kind(self.stage, self.n, loss_fn=_mse)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> int:
        """One training step; returns the bytes this rank sent (frames, or the tensors torch sent)."""
        self.opt.zero_grad()
        if self.link is not None:
            sent = self._gpipe_loop(x, target)
        else:
            before = sum(getattr(self.stage, "wire_bytes", {}).values())
            if self.rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=target)
            sent = sum(getattr(self.stage, "wire_bytes", {}).values()) - before
            if not hasattr(self.stage, "wire_bytes"):  # torch sends the tensors as they are
                cache = self.stage._stage_meta.outputs if self.rank == 0 else self.stage._stage_meta.inputs
                sent = self.n * math.prod(cache[0].shape) * cache[0].dtype.itemsize
        self.opt.step()
        return sent

    def _gpipe_loop(self, x, target):
        """StageBoundary as its docs show it, in a GPipe loop: every forward, then every backward in order."""
        sent, pending = 0, []
        if self.rank == 0:
            for mb in x.tensor_split(self.n):
                pending.append(self.link.send(self.block(mb)))
                sent += self.link.stats["fwd_wire_bytes"]
            for token in pending:
                token.backward()
        else:
            for y in target.tensor_split(self.n):
                pending.append(_mse(self.block(self.link.recv()), y) / self.n)
            for loss in pending:
                loss.backward()
                sent += self.link.stats["bwd_wire_bytes"]
        return sent


def boundary_bench_rank(config: dict) -> list | None:
    """Runs the boundary comparison on this rank of 2 (a collective); the rows on rank 0, None on rank 1.

    Args:
        config: batch, seq, hidden, expand, microbatches, ratio, steps, warmup, methods (BOUNDARY_METHODS' names).
    """
    import statistics

    from fastdist.bench.launch import pin_local_rank
    from fastdist.bench.toolkit import all_max, all_sum, rounds, together

    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise ValueError("fastdist.parallel.transport: the boundary comparison runs on 2 ranks (one stage each)")
    pin_local_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(config["batch"], config["seq"], config["hidden"], generator=g)
    target = torch.randn(x.shape, generator=g)
    methods = {m: _Method(m, config, rank) for m in config["methods"]}
    times = {m: [] for m in methods}
    wire = {m: [] for m in methods}
    for _, m, timed in rounds(list(methods), config["warmup"], config["steps"], "boundaries", enabled=rank == 0):
        with together() as watch:
            sent = methods[m].step(x, target)
        seconds, = all_max([watch.seconds])
        sent, = all_sum([sent])
        if timed:
            times[m].append(seconds)
            wire[m].append(sent)
    if rank != 0:
        return None
    return [{"method": m, "time_ms": statistics.median(times[m]) * 1e3, "samples_ms": [t * 1e3 for t in times[m]],
             "wire_bytes": statistics.median(wire[m])} for m in methods]


def compare_boundaries(net: str = "100mbit", *, batch: int = 8, seq: int = 4096, hidden: int = 16, expand: int = 1,
                       microbatches: int = 4, ratio: float = 0.1, steps: int = 7, warmup: int = 2,
                       methods: list | None = None, timeout: float = 900.0) -> dict:
    """The boundary comparison on 2 local ranks (a simulated cluster at ``net``, or loopback): this transport under
    torch's schedules against StageBoundary in a GPipe loop, naive TopK packing and uncompressed 1F1B.

    Args:
        net: "loopback" or a link rate netsim can shape ("100mbit"; needs root, else loopback, said in the label).
        batch, seq, hidden: the activation [batch, seq, hidden] float32 of a step; expand: the MLP's expansion.
        microbatches: per step; ratio: TopK's kept fraction per sample.
        steps, warmup: timed and untimed steps per method (interleaved, warm-up first).
        methods: a subset of BOUNDARY_METHODS (default all).
        timeout: seconds for the whole run.

    Returns:
        The payload: ``env``, ``config``, ``rows`` (method, time_ms (median step), samples_ms, wire_bytes per step,
        speedup over naive-topk-1f1b, vs_stageboundary), ``load_average`` (before and after).
    """
    import os

    from fastdist.bench import report
    from fastdist.bench.launch import run_ranks

    config = {"batch": batch, "seq": seq, "hidden": hidden, "expand": expand, "microbatches": microbatches,
              "ratio": ratio, "steps": steps, "warmup": warmup, "methods": list(methods or BOUNDARY_METHODS)}
    unknown = sorted(set(config["methods"]) - set(BOUNDARY_METHODS))
    if unknown:
        raise ValueError(f"fastdist.parallel.transport: unknown methods {unknown}; choose from {BOUNDARY_METHODS}")
    load = os.getloadavg()
    launch = run_ranks(boundary_bench_rank, config, ranks=2, net=net, timeout=timeout, backend="gloo")
    rows = launch.result
    report.set_speedups(rows, "naive-topk-1f1b")
    report.set_speedups(rows, "stageboundary-gpipe", key="vs_stageboundary")
    return {"env": report.launch_environment(launch), "config": config, "rows": rows,
            "load_average": [load, os.getloadavg()]}


def boundary_tables(result: dict) -> list:
    """The comparison's table (a fastdist.bench.report Part list) of what :func:`compare_boundaries` returned."""
    from fastdist.bench import report
    from fastdist.bench.report import col, fixed, integer, times

    c = result["config"]
    caption = (f"2 stages (one rank each), activation [{c['batch']}, {c['seq']}, {c['hidden']}] float32 per step in "
               f"{c['microbatches']} microbatches, TopK {c['ratio']:g} per sample (+ 8-bit gradient with mask reuse "
               f"where compressed); median of {c['steps']} steps after {c['warmup']} warm-up; "
               f"{result['env'].get('network')}.")
    columns = [col("method", "method"), col("step (ms)", "time_ms", fixed(1)),
               col("vs naive", "speedup", times(2)), col("vs StageBoundary", "vs_stageboundary", times(2)),
               col("wire (B/step, both ways)", "wire_bytes", integer)]
    return [report.Part("boundaries", columns, result["rows"], caption)]
