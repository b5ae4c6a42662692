"""Checks that a value (a seed, a size, a split table, a plan) is the same on every rank.

One fixed-size all-gather of a 64-bit fingerprint: it cannot hang on mismatched sizes, and a mismatch
raises on every rank with a message naming the field and each rank's value. A configuration passed as a dict
or a dataclass is checked as a whole and a mismatch names the fields that differ, so a new setting only needs
a new key. `CallCounter` numbers the calls of a per-call exchange, so that a rank that skipped or added a call
is caught by the exchange instead of pairing its call n with a peer's call n + 1.
"""
import dataclasses
import enum
import hashlib
import struct
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist


class MismatchError(RuntimeError):
    """Ranks disagree on a value that must be identical everywhere.

    Args:
        name: what disagrees (e.g. a configuration's name, or its differing fields).
        values_by_rank: {rank: that rank's value}, shown in the message.
    """

    def __init__(self, name: str, values_by_rank: dict):
        self.name = name
        self.values_by_rank = values_by_rank
        shown = "; ".join(f"rank {r}: {v}" for r, v in values_by_rank.items())
        super().__init__(f"fastdist: '{name}' differs across ranks ({shown})")


def _encode(value, out):
    """Appends a canonical, type-tagged byte encoding of `value` to the list `out`."""
    if value is None or isinstance(value, (bool, np.bool_, str, bytes)):
        value = bool(value) if isinstance(value, np.bool_) else value
        out.append(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, enum.Enum):
        out.append(f"enum:{type(value).__qualname__}.{value.name};".encode())
    elif isinstance(value, (int, np.integer)):
        out.append(f"int:{int(value)};".encode())
    elif isinstance(value, (float, np.floating)):
        out.append(f"float:{float(value).hex()};".encode())
    elif isinstance(value, (torch.dtype, torch.device)):
        out.append(f"{type(value).__name__}:{value};".encode())
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        out.append(f"tensor:{t.dtype}:{tuple(t.shape)};".encode())
        out.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        out.append(f"ndarray:{value.dtype.str}:{value.shape};".encode())
        out.append(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, (tuple, list, torch.Size)):
        out.append(f"seq{len(value)}(".encode())
        for v in value:
            _encode(v, out)
        out.append(b")")
    elif isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        out.append(f"dict{len(items)}(".encode())
        for k, v in items:
            _encode(k, out)
            _encode(v, out)
        out.append(b")")
    elif isinstance(value, (set, frozenset)):
        _encode(sorted(value, key=repr), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append(f"dataclass:{type(value).__qualname__}".encode())
        _encode({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, out)
    else:
        raise TypeError(f"fastdist: cannot fingerprint a {type(value).__qualname__}; pass numbers, strings, "
                        "tensors, arrays, dataclasses or containers of them")


def fingerprint(value: object) -> int:
    """A signed 64-bit hash of ``value`` that is identical on every machine for equal values.

    Args:
        value: numbers, strings, dtypes, devices, tensors, arrays, enums, dataclasses, or containers of them.

    Raises:
        TypeError: a value of another type.
    """
    parts = []
    _encode(value, parts)
    digest = hashlib.blake2b(b"".join(parts), digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


def _short_repr(value, limit=200):
    if isinstance(value, torch.Tensor):
        text = f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, fingerprint={fingerprint(value):#x})"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def global_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global rank of each rank of ``group``, in group-rank order (None: the default group)."""
    world = dist.get_world_size(group)
    return [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]


def _fields(value, prefix=""):
    """{dotted field name: leaf value} of a dict or dataclass (nested ones flattened); {"": value} otherwise."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, Mapping) or not value:
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(_fields(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _field_summary(value):
    """{field: (fingerprint, short repr)} and the whole value's: what the ranks exchange on a mismatch."""
    fields = {k: (fingerprint(v), _short_repr(v)) for k, v in _fields(value).items()}
    return fields, _short_repr(value)


def _mismatch(name, summaries, ranks):
    """The MismatchError for gathered `_field_summary`s: the differing fields and each rank's value of them (the
    whole values when no single field differs, e.g. two dataclass types with equal fields)."""
    fields = [f for f, _ in summaries]
    missing = (None, "<missing>")
    names = sorted(set().union(*fields), key=str)
    differing = [f for f in names if len({s.get(f, missing)[0] for s in fields}) > 1]
    if not differing or "" in differing:
        return MismatchError(name, {r: whole for r, (_, whole) in zip(ranks, summaries)})
    shown = {r: ", ".join(f"{f}={s.get(f, missing)[1]}" for f in differing) for r, s in zip(ranks, fields)}
    return MismatchError(f"{name}: {', '.join(differing)}", shown)


def _collective_device(group):
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def check_same(name: str, value: object, group: dist.ProcessGroup | None = None) -> None:
    """Raises MismatchError on every rank of ``group`` if ``value`` is not the same on all of them.

    Every rank of the group must call it (it is a collective). Cost: one all-gather of 8 bytes
    per rank; a second, object all-gather happens only on mismatch, to name each rank's value. A dict or
    dataclass ``value`` is a configuration: a mismatch names the fields that differ (nested ones as ``a.b``)
    and shows only those, so adding a setting to what is checked is adding a key.

    Args:
        name: what is checked, for the message.
        value: anything :func:`fingerprint` takes.
        group: the process group (None: the default group).

    Raises:
        MismatchError: the ranks' values differ (on every rank).
        RuntimeError: no process group is initialized.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"fastdist: check_same('{name}') needs an initialized torch.distributed process group")
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = _collective_device(group)
    mine = torch.tensor([fingerprint(value)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    if len({int(t.item()) for t in gathered}) == 1:
        return
    raise_mismatch(name, value, group)


def raise_mismatch(name: str, value: object, group: dist.ProcessGroup | None = None) -> None:
    """Raises the MismatchError naming the fields of ``value`` that differ across the ranks of ``group``.

    For an exchange of its own that found the ranks' fingerprints of ``value`` differ (e.g. a fingerprint carried
    in a header the call sends anyway): every rank of the group must call it, as check_same does after its
    all-gather. One object all-gather of each rank's fields.

    Args:
        name: what the value is, for the message (e.g. "MoELayer configuration").
        value: this rank's value (a mapping or object whose fields are compared).
        group: the ranks that exchanged it (None: the default group).

    Raises:
        MismatchError: always (on every rank).
    """
    summaries = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, _field_summary(value), group=group)
    raise _mismatch(name, summaries, global_ranks(group))


class CallCounter:
    """Numbers the calls of one per-call exchange (a header, a packet, a routing all-to-all).

    When one rank skips or adds a call, its call n meets a peer's call n + 1 in an exchange whose sizes still match:
    a silent wrong result. Putting the call number in the exchange the call already makes catches it at no extra
    collective: take the number with :meth:`take` before the exchange, send it with the rest, and pass what every
    rank sent to :meth:`check`. The count is state: it is in ``state_dict`` so that a resumed run keeps agreeing
    with ranks that did not restart.

    Example::

        number = self.calls.take()
        header = torch.tensor([fingerprint(config), number, local_size])
        gathered = ...  # the all-gather the call makes anyway
        self.calls.check("sketch_allreduce", dict(zip(global_ranks(group), gathered[:, 1].tolist())))
    """

    def __init__(self) -> None:
        self.calls = 0

    def take(self) -> int:
        """This call's number (0 for the first call); counts the call."""
        number = self.calls
        self.calls += 1
        return number

    @staticmethod
    def check(name: str, numbers_by_rank: Mapping[int, int]) -> None:
        """Raises MismatchError if the ranks' call numbers differ.

        Args:
            name: the API whose calls are numbered, for the message.
            numbers_by_rank: {global rank: the call number it sent}, every rank of the exchange (a pair or a group).

        Raises:
            MismatchError: the numbers differ: a rank skipped or added a call.
        """
        if len(set(numbers_by_rank.values())) > 1:
            raise MismatchError(f"{name} call number (a rank skipped or added a call)",
                                {r: int(n) for r, n in numbers_by_rank.items()})

    def state_dict(self) -> dict:
        """{"calls": the calls counted so far}."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores the count from ``state``, what :meth:`state_dict` returned."""
        self.calls = int(state["calls"])


_DIGEST_SAMPLES = 6


def state_digest(t: torch.Tensor) -> torch.Tensor:
    """A cheap exact digest of ``t``'s bytes, computed where ``t`` lives (no device synchronization): int64
    ``[2 + k]``: the byte count, the sum of its 8-byte words modulo 2**64 (any one changed bit changes it, and it does
    not depend on the order of the additions, so every device and thread count agrees), and k evenly spaced words.

    Args:
        t: any tensor (both ends of a link digest their copies of one state).
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole]
    if words.data_ptr() % 8:
        words = words.clone()
    words = words.view(torch.int64)
    total = words.sum() + raw[whole:].to(torch.int64).sum()
    stride = max(1, words.numel() // _DIGEST_SAMPLES)
    samples = words[::stride][:_DIGEST_SAMPLES]
    count = torch.full((1,), raw.numel(), dtype=torch.int64, device=raw.device)  # a fill: no blocking copy
    return torch.cat([count, total.reshape(1), samples])
