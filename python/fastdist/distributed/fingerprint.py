"""Checks that a value (a seed, a size, a split table, a plan) is the same on every rank.

One fixed-size all-gather of a 64-bit fingerprint: it cannot hang on mismatched sizes, and a mismatch
raises on every rank with a message naming the field and each rank's value.
"""
import dataclasses
import enum
import hashlib
import struct

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


def _collective_device(group):
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def check_same(name: str, value: object, group: dist.ProcessGroup | None = None) -> None:
    """Raises MismatchError on every rank of ``group`` if ``value`` is not the same on all of them.

    Every rank of the group must call it (it is a collective). Cost: one all-gather of 8 bytes
    per rank; a second, object all-gather happens only on mismatch, to name each rank's value.

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
    reprs = [None] * world
    dist.all_gather_object(reprs, _short_repr(value), group=group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
    raise MismatchError(name, dict(zip(ranks, reprs)))
