"""Sharded embedding tables served by AlltoAll: the lookup exchange and the drop-in ``ShardedEmbedding``.

A table's rows live on their owners only: row sharding splits them in contiguous ranges over the group (the first
``num_embeddings % W`` ranks hold one row more), table sharding keeps the whole table on one rank. A lookup:

1. every rank uniques its batch's ids (``torch.unique``: sorted, with the inverse that expands them again);
2. the unique ids are grouped by owner with ``fastdist.ops.moe_layout`` (a stable counting sort of slots by
   "expert" = owner rank; its per-rank counts are the send splits);
3. one ``all_to_all_single`` of equal parts carries a small header per pair of ranks (count, call number,
   configuration fingerprint, refusal code, the sender's largest count) and the first ``capacity`` ids of the pair:
   it gives the receive splits and checks the call on every rank at once; ids past the capacity (set from the
   previous call's largest count, the same on every rank) follow in a second AlltoAll;
4. each owner reads its rows from its shard and they come back by the reverse ``all_to_all_single``;
5. each table takes its unique ids' rows out of the received ones (inside the exchange's autograd node, whose
   backward puts the tables' gradient rows back in send order in one pass) and ``F.embedding``/``F.embedding_bag``
   expands them to the batch (bags: sum, mean, per-sample weights, padding excluded, as ``nn.EmbeddingBag``).

Backward runs the same path reversed: the expand sums the gradient rows of each unique id locally, an
asynchronous AlltoAll carries one row per unique id to its owner, and a callback at the end of the backward adds
them to the shard's gradient as ``F.embedding``'s backward would (``_RowExchange``), so the exchanges of several
tables overlap each other, the rest of the backward and DDP's all-reduce. Several tables of one width share each
exchange (``lookup`` takes a list), so a model with many tables makes two or three AlltoAlls in the forward and one
in the backward per width per step, not per table.

The next batch's lookup can start early (``prefetch``, EmbRace's lookahead): its ids leave before the backward, the
rows the pending optimizer step will not change when the backward reaches the table, and the next lookup sends only
the rest, so that every row is still read after its last change.

Every rank must make the same lookups in the same order and backpropagate through each (as with DDP): the
AlltoAlls are collectives. A rank whose input is refused (ids out of range, negative, of a float dtype, a bad
offsets tensor) says so in the header, and every rank raises in that same call.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdist.distributed import CallCounter, check_same, fingerprint, global_ranks
from fastdist.ops.moe import moe_layout

__all__ = ["EmbeddingInputError", "ShardedEmbedding", "lookup", "prefetch", "row_ranges"]

_MODES = (None, "sum", "mean")
_ID_DTYPES = (torch.int64, torch.int32)
_HEADER = 5  # per destination: count, call number, configuration fingerprint, refusal code, sender's largest count


class EmbeddingInputError(ValueError):
    """A rank's lookup input was refused; raised on every rank of the exchange, naming the ranks and why."""


def row_ranges(num_embeddings: int, world: int) -> list[tuple[int, int]]:
    """The contiguous ``[start, end)`` row range of each of ``world`` ranks; the first ``num_embeddings % world``
    ranks hold one row more."""
    base, extra = divmod(num_embeddings, world)
    out, start = [], 0
    for r in range(world):
        end = start + base + (r < extra)
        out.append((start, end))
        start = end
    return out


def group_rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank in `group`, its size); (0, 1) without an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedEmbedding(nn.Module):
    """A drop-in for ``nn.Embedding`` (``mode=None``) and ``nn.EmbeddingBag`` (``mode="sum"|"mean"``) whose rows
    are sharded over a process group and served by AlltoAll.

    ``weight`` is this rank's shard (``[rows owned, embedding_dim]``); ``row_start`` is its first row. Any
    element-wise torch optimizer on it (SGD, Adam, Adagrad with dense gradients; SGD, Adagrad, SparseAdam with
    ``sparse=True``) trains exactly as on the unsharded table, since each row's update depends on that row only;
    the row-wise optimizers of ``fastdist.embedding.optim`` do the same on sparse gradients. Create the optimizer
    after the module (its parameter is the shard).

    ``state_dict()`` holds the full table under ``weight`` (gathered: a collective, call it on every rank), which a
    plain ``nn.Embedding`` loads; ``load_state_dict`` of a full table re-shards it, whatever world size saved it.
    Inside :func:`fastdist.embedding.sharded_state_dict` it holds the local shard instead (``weight`` plus
    ``row_start`` and ``num_embeddings``), no collective.

    Args:
        num_embeddings: rows of the full table, ``>= 1``.
        embedding_dim: the row width, ``>= 1``.
        group: the process group the table is sharded over (None: the default group, or no sharding when
            torch.distributed is not initialized).
        sharding: ``"row"`` (contiguous row ranges over the group) or ``"table"`` (the whole table on rank
            ``owner``).
        padding_idx: as ``nn.Embedding``: the row is zero at init, gets no gradient and, in bags, is left out.
        mode: None (``nn.Embedding``), ``"sum"`` or ``"mean"`` (``nn.EmbeddingBag``).
        sparse: as ``nn.Embedding``: the shard's gradient is a sparse COO tensor (rows looked up only).
        owner: the group rank holding the table under ``sharding="table"``.
        dtype: the weights' floating dtype.
        average_gradients: divide the shard's gradient by the group size, as DDP does for dense parameters (each
            rank's loss then being the mean over its own batch); False: the gradient of the sum of the ranks'
            losses, as an unsharded table would get it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: dist.ProcessGroup | None = None,
                 sharding: str = "row", padding_idx: int | None = None, mode: str | None = None,
                 sparse: bool = False, owner: int = 0, dtype: torch.dtype = torch.float32,
                 average_gradients: bool = False) -> None:
        super().__init__()
        if not isinstance(num_embeddings, int) or num_embeddings < 1:
            raise ValueError(f"fastdist: ShardedEmbedding 'num_embeddings' must be an int >= 1, got {num_embeddings!r}")
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"fastdist: ShardedEmbedding 'embedding_dim' must be an int >= 1, got {embedding_dim!r}")
        if sharding not in ("row", "table"):
            raise ValueError(f"fastdist: ShardedEmbedding 'sharding' must be 'row' or 'table', got {sharding!r}")
        if mode not in _MODES:
            raise ValueError(f"fastdist: ShardedEmbedding 'mode' must be None, 'sum' or 'mean', got {mode!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"fastdist: ShardedEmbedding 'padding_idx' must be in [-{num_embeddings}, "
                                 f"{num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        if not dtype.is_floating_point:
            raise ValueError(f"fastdist: ShardedEmbedding 'dtype' must be a floating dtype, got {dtype}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sharding, self.padding_idx, self.mode, self.sparse = sharding, padding_idx, mode, sparse
        self.group, self._detached = group, False
        self.average_gradients = average_gradients
        self.rank, self.world = group_rank_and_world(group)
        if not 0 <= owner < self.world:
            raise ValueError(f"fastdist: ShardedEmbedding 'owner' must be a rank of the group [0, {self.world}), "
                             f"got {owner}")
        self.owner = owner
        if sharding == "row":
            self.ranges = row_ranges(num_embeddings, self.world)
        else:
            self.ranges = [(0, num_embeddings) if r == owner else (num_embeddings, num_embeddings)
                           for r in range(self.world)]
        self.row_start, row_end = self.ranges[self.rank]
        self.weight = nn.Parameter(torch.empty(row_end - self.row_start, embedding_dim, dtype=dtype))
        self.calls = CallCounter()
        self.traffic = {"ids": 0, "rows": 0, "grad_rows": 0, "control": 0}  # sent to other ranks (see lookup)
        self._checked = False
        self._exchange_state: dict = {}  # the tables' fingerprint and the ids' capacity (see _issue_ids)
        self._prefetch = None  # a started lookup of the next batch (see prefetch)
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lookups awaiting their gradient
        self.fusion = None  # a LookupFusion: calls are deferred and looked up together (see fused.py)
        self.queue = None  # a schedule.CollectiveQueue tracking the asynchronous exchanges (hybrid_parallel)
        self.reset_parameters()

    # ---- construction ----

    def reset_parameters(self) -> None:
        """N(0, 1) rows (each rank draws its own shard from the global generator), the padding row zeroed."""
        with torch.no_grad():
            self.weight.normal_()
            self._zero_padding_row()

    def _zero_padding_row(self):
        if self.padding_idx is not None and self.owns(self.padding_idx):
            self.weight[self.padding_idx - self.row_start].zero_()

    @classmethod
    def from_embedding(cls, module: nn.Embedding | nn.EmbeddingBag, *, group: dist.ProcessGroup | None = None,
                       sharding: str = "row", owner: int = 0,
                       average_gradients: bool = False) -> "ShardedEmbedding":
        """The sharded twin of a plain embedding module: same rows (each rank keeps its own), padding, mode and
        sparsity. Every rank must pass an equal table (the usual case: the same model built from the same seed).

        Args:
            module: the ``nn.Embedding`` or ``nn.EmbeddingBag`` to shard.
            group: the process group (None: the default group).
            sharding: ``"row"`` (row ranges over the group) or ``"table"`` (the whole table on ``owner``).
            owner: the group rank holding the table with ``sharding="table"``.
            average_gradients: divide the table's gradient by the group size, as DDP does for dense parameters.

        Raises:
            ValueError: options ``nn.Embedding`` has and the sharded table does not (``max_norm``,
                ``scale_grad_by_freq``, ``mode="max"``, ``include_last_offset``), or a weight that is not finite.
        """
        mode = None
        if isinstance(module, nn.EmbeddingBag):
            if module.mode == "max" or module.include_last_offset:
                raise ValueError("fastdist: ShardedEmbedding does not support EmbeddingBag(mode='max') or "
                                 "include_last_offset=True")
            mode = module.mode
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ValueError("fastdist: ShardedEmbedding does not support max_norm or scale_grad_by_freq")
        out = cls(module.num_embeddings, module.embedding_dim, group=group, sharding=sharding,
                  padding_idx=module.padding_idx, mode=mode, sparse=module.sparse, owner=owner,
                  dtype=module.weight.dtype, average_gradients=average_gradients)
        out.to(module.weight.device)
        out._load_full(module.weight.detach())
        return out

    # ---- layout ----

    def owns(self, row: int) -> bool:
        """Whether this rank holds ``row``."""
        return self.row_start <= row < self.row_start + self.weight.shape[0]

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The group rank owning each of ``ids`` (int64, in range)."""
        if self.sharding == "table":
            return torch.full_like(ids, self.owner)
        ends = torch.tensor([end for _, end in self.ranges[:-1]], dtype=ids.dtype, device=ids.device)
        return torch.bucketize(ids, ends, right=True)

    def config(self) -> dict:
        """What every rank must agree on, checked on first use and carried (fingerprinted) by every exchange."""
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim,
                "sharding": self.sharding, "owner": self.owner if self.sharding == "table" else 0,
                "mode": self.mode, "padding_idx": self.padding_idx, "sparse": self.sparse,
                "dtype": self.weight.dtype, "world": self.world, "average_gradients": self.average_gradients}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, sharding={self.sharding!r}, mode={self.mode!r}, "
                f"padding_idx={self.padding_idx}, rows [{self.row_start}, {self.row_start + self.weight.shape[0]}) "
                f"on rank {self.rank} of {self.world}")

    # ---- forward ----

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``nn.Embedding``'s forward (``mode=None``) or ``nn.EmbeddingBag``'s (1-D ``input`` with ``offsets``, or
        2-D ``input`` of fixed-size bags; ``per_sample_weights`` with ``mode="sum"``).

        Raises:
            EmbeddingInputError: on every rank, when any rank's input was refused.
            MismatchError: on every rank, when the ranks' tables are configured differently.

        A table bound to a :class:`~fastdist.embedding.LookupFusion` (``hybrid_parallel`` binds the tables it
        shards) returns a deferred output instead, looked up with the fusion's other pending calls in one exchange
        at the first use of any of them (see ``fastdist.embedding.fused``).
        """
        inputs = (input, offsets, per_sample_weights)
        fusion = self.fusion
        if fusion is not None and self.world > 1:
            if not torch.compiler.is_compiling():
                return fusion.defer(self, inputs)
            fusion.flush()  # keep the calls' order: the recorded ones first
        return lookup([self], [inputs], self.group)[0]

    def prefetch(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                 per_sample_weights: torch.Tensor | None = None, *, rows_ahead: bool | str = True) -> None:
        """Starts the lookup of the next batch (the 2D schedule's lookahead): call it with the next batch's ids
        (as ``forward`` takes them) after this step's forward, before its backward. The ids leave at once; with
        ``rows_ahead`` the rows this step's update leaves alone follow when the backward reaches the table, and the
        next forward with the same arguments waits only for the rows the update changed; without, that forward
        fetches every row in one AlltoAll. Every rank calls it (a collective). See
        :func:`fastdist.embedding.prefetch` for what it assumes.

        Args:
            input: the next batch's ids, as ``forward`` takes them.
            offsets: the next batch's bag offsets (bags only).
            per_sample_weights: the next batch's per-sample weights (``mode="sum"`` only).
            rows_ahead: send the rows the pending update leaves alone before the update, when the backward
                reaches the table (True) or at once ("now"; see :func:`fastdist.embedding.prefetch`), or only the
                ids (False).

        A table bound to a :class:`~fastdist.embedding.LookupFusion` prefetches with the fusion's other tables in
        one exchange: issued when every table of the fusion has been prefetched, else when the backward reaches the
        tables or at the next lookup, whichever comes first.
        """
        inputs = (input, offsets, per_sample_weights)
        if self.fusion is not None and self.world > 1:
            self.fusion.defer_prefetch(self, inputs, rows_ahead)
        else:
            prefetch([self], [inputs], self.group, rows_ahead)

    def wait_prefetch(self) -> None:
        """Waits until the rows a pending prefetch sent ahead have arrived (no collective; a benchmark's step then
        owns its own traffic). Nothing to wait for when none were sent yet."""
        route = self._prefetch
        if route is not None and route.advanced:
            route.early_work.wait()

    # ---- state ----

    def state_dict(self, *args: Any, sharded: bool = False, **kwargs: Any) -> dict:
        """The module's state: the full table under ``weight`` (gathered: every rank must call it), or with
        ``sharded=True`` this rank's shard as a ``ShardedTensor`` of the full table's shape, which
        ``torch.distributed.checkpoint`` saves without gathering and re-shards on load (any world size). For a
        model holding tables, ``with fastdist.embedding.sharded_state_dict(): model.state_dict()`` does the same.

        Args:
            *args: as ``nn.Module.state_dict``.
            sharded: the local shard as a ``ShardedTensor`` instead of the gathered table.
            **kwargs: as ``nn.Module.state_dict`` (``destination``, ``prefix``, ``keep_vars``).
        """
        if not sharded:
            return super().state_dict(*args, **kwargs)
        with sharded_state_dict():
            return super().state_dict(*args, **kwargs)

    def sharded_weight(self) -> torch.Tensor:
        """This rank's rows as a ``ShardedTensor`` of shape ``[num_embeddings, embedding_dim]`` (its shard at row
        ``row_start``; a rank holding no rows holds no shard), the form ``torch.distributed.checkpoint`` saves and
        re-shards; the plain table without a process group. A collective (the shards' metadata is gathered)."""
        if not dist.is_available() or not dist.is_initialized():
            return self.weight.detach()
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        shards = []
        if self.weight.shape[0]:
            device = self.weight.device
            placement = f"rank:{self.rank}/{device.type}" + (f":{device.index}" if device.index is not None else "")
            shards.append(Shard(self.weight.detach(), ShardMetadata([self.row_start, 0], list(self.weight.shape),
                                                                    placement)))
        return ShardedTensor._init_from_local_shards(shards, [self.num_embeddings, self.embedding_dim],
                                                     process_group=self.group)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if _SHARDED_STATE[0]:
            destination[prefix + "weight"] = self.sharded_weight()
        else:
            destination[prefix + "weight"] = self.full_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        weight = state_dict[key]
        if _is_sharded_tensor(weight):
            self._load_sharded(weight, key, error_msgs)
            return
        start_key, rows_key = prefix + "row_start", prefix + "num_embeddings"
        if start_key in state_dict:  # a shard in the per-rank form of earlier versions
            start, total = int(state_dict[start_key]), int(state_dict[rows_key])
            if (start, total) != (self.row_start, self.num_embeddings) or weight.shape != self.weight.shape:
                error_msgs.append(f"fastdist: {key}: a shard of rows [{start}, {start + weight.shape[0]}) of "
                                  f"{total} does not fit this rank's rows [{self.row_start}, "
                                  f"{self.row_start + self.weight.shape[0]}) of {self.num_embeddings}; load "
                                  "the full table to re-shard")
                return
            self._check_finite(weight, key)
            with torch.no_grad():
                self.weight.copy_(weight)
            return
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"fastdist: {key}: expected the full table of shape "
                              f"{[self.num_embeddings, self.embedding_dim]}, got {list(weight.shape)}")
            return
        self._load_full(weight)

    def _load_sharded(self, weight, key, error_msgs):
        """Loads a ShardedTensor whose local shards hold this rank's rows (as ``torch.distributed.checkpoint``
        leaves the one :meth:`sharded_weight` gave it)."""
        rows = self.weight.shape[0]
        local = [(shard.metadata.shard_offsets, shard.tensor) for shard in weight.local_shards()]
        with warnings.catch_warnings():  # ShardedTensor's deprecation note, on every size(): see docs/embedding.md
            warnings.simplefilter("ignore", FutureWarning)
            size = list(weight.size())
        if size != [self.num_embeddings, self.embedding_dim] or \
                [(list(o), list(t.shape)) for o, t in local if t.numel()] != \
                ([([self.row_start, 0], [rows, self.embedding_dim])] if rows else []):
            error_msgs.append(f"fastdist: {key}: a ShardedTensor of shape {size} whose local shards "
                              f"are not this rank's rows [{self.row_start}, {self.row_start + rows}) of "
                              f"{self.num_embeddings}; load it with torch.distributed.checkpoint into this "
                              "module's state_dict(sharded=True), which re-shards it")
            return
        if rows:
            self._check_finite(local[0][1], key)
            with torch.no_grad():
                self.weight.copy_(local[0][1])

    def _check_finite(self, weight, what):
        bad = ~torch.isfinite(weight).all(-1)
        if bad.any():
            rows = bad.nonzero().flatten()[:5].tolist()
            raise ValueError(f"fastdist: ShardedEmbedding refuses {what} with NaN or infinite values (rows {rows}"
                             f"{'...' if int(bad.sum()) > 5 else ''})")

    def _load_full(self, weight: torch.Tensor) -> None:
        rows = weight[self.row_start:self.row_start + self.weight.shape[0]]
        self._check_finite(rows, "a weight")
        with torch.no_grad():
            self.weight.copy_(rows)

    def full_weight(self) -> torch.Tensor:
        """The full table on every rank (an all-gather of the shards: every rank must call it)."""
        if self.world == 1:
            return self.weight.detach().clone()
        most = max(end - start for start, end in self.ranges)
        padded = self.weight.new_zeros((most, self.embedding_dim))
        padded[:self.weight.shape[0]] = self.weight.detach()
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.group)
        return torch.cat([g[:end - start] for g, (start, end) in zip(gathered, self.ranges)])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["group"], state["_detached"] = None, True  # a process group does not pickle; rebind with attach()
        state["_prefetch"], state["_pending"], state["queue"] = None, None, None  # the queue holds a lock
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pending = weakref.WeakKeyDictionary()

    def attach(self, group: dist.ProcessGroup | None = None) -> None:
        """Binds an unpickled table to ``group``, which must have the rank and size it was built for."""
        rank, world = group_rank_and_world(group)
        if (rank, world) != (self.rank, self.world):
            raise ValueError(f"fastdist: ShardedEmbedding was built for rank {self.rank} of {self.world}, "
                             f"the group has rank {rank} of {world}")
        self.group, self._detached = group, False


_SHARDED_STATE = [False]


def _is_sharded_tensor(value) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    return isinstance(value, ShardedTensor)


class sharded_state_dict:  # noqa: N801  (a context manager used like a function)
    """Inside ``with sharded_state_dict():``, every ShardedEmbedding's ``state_dict()`` holds its local shard as a
    ``ShardedTensor`` (:meth:`ShardedEmbedding.sharded_weight`: no gather; what ``torch.distributed.checkpoint``
    saves and re-shards onto any world size) instead of the gathered full table; ``load_state_dict`` takes either
    form at any time (and the per-rank ``weight``/``row_start``/``num_embeddings`` form of earlier versions)."""

    def __enter__(self):
        self._previous = _SHARDED_STATE[0]
        _SHARDED_STATE[0] = True
        return self

    def __exit__(self, *exc):
        _SHARDED_STATE[0] = self._previous


# ---- the exchange ----

def _refusal(module, ids, offsets, psw):
    """Why this rank's input for ``module`` cannot be looked up (None when it can), checked before any exchange
    so that every rank learns of it in the same call."""
    if not isinstance(ids, torch.Tensor):
        return f"input must be a tensor of ids, got {type(ids).__name__}"
    if ids.dtype not in _ID_DTYPES:
        return f"ids must be int64 or int32, got {ids.dtype}"
    if ids.device != module.weight.device:
        return f"ids are on {ids.device}, the table on {module.weight.device}"
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0:
            return f"ids must be >= 0, got {low}"
        if high >= module.num_embeddings:
            return f"ids must be < num_embeddings = {module.num_embeddings}, got {high}"
    if module.mode is None:
        if offsets is not None or psw is not None:
            return "offsets and per_sample_weights are for bags (mode='sum' or 'mean')"
        return None
    if ids.dim() == 2:
        if offsets is not None:
            return "offsets must be None when the input is 2-D (fixed-size bags)"
    elif ids.dim() == 1:
        if offsets is None:
            return "a 1-D input needs offsets"
        if offsets.dim() != 1 or offsets.dtype not in _ID_DTYPES:
            return f"offsets must be a 1-D int64/int32 tensor, got {offsets.dim()}-D {offsets.dtype}"
        if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())
                                or int(offsets[-1]) > ids.numel()):
            return "offsets must start at 0, not decrease, and not pass the input's length"
    else:
        return f"a bag input must be 1-D (with offsets) or 2-D, got {ids.dim()}-D"
    if psw is not None:
        if module.mode != "sum":
            return "per_sample_weights need mode='sum'"
        if psw.shape != ids.shape or psw.dtype != module.weight.dtype:
            return (f"per_sample_weights must have the input's shape {list(ids.shape)} and the table's dtype "
                    f"{module.weight.dtype}, got {list(psw.shape)} {psw.dtype}")
    return None


def _raise_refusals(mine, group, world, refused_ranks):
    """Every rank raises EmbeddingInputError naming each refusing rank and its reason (one object all-gather, on
    this error path only)."""
    reasons = [None] * world
    dist.all_gather_object(reasons, mine, group=group)
    ranks = global_ranks(group)
    shown = "; ".join(f"rank {ranks[r]}: {reasons[r]}" for r in refused_ranks)
    raise EmbeddingInputError(f"fastdist: ShardedEmbedding refused a lookup ({shown})")


def _configs(modules):
    """The configurations one exchange checks: one table's fields, or {table name: fields}."""
    if len(modules) == 1:
        return modules[0].config()
    return {getattr(m, "table_name", None) or str(i): m.config() for i, m in enumerate(modules)}


def _check_header(modules, headers, group, world, my_refusal):
    """Compares what every rank sent with this call: call numbers, table configurations, refusals."""
    numbers, prints, codes = headers[:, 1].tolist(), headers[:, 2].tolist(), headers[:, 3].tolist()
    if len(set(prints)) > 1:
        # Name the differing fields: the same check_same every rank makes on first use.
        check_same("ShardedEmbedding config", _configs(modules), group)
        raise RuntimeError("fastdist: ShardedEmbedding: the ranks looked up different tables in one call")
    modules[0].calls.check("ShardedEmbedding lookup", dict(zip(global_ranks(group), numbers)))
    refused = [r for r, c in enumerate(codes) if c]
    if refused:
        _raise_refusals(my_refusal, group, world, refused)


class _Route:
    """One exchange's routing: this rank's unique ids grouped by owner, and (once the header has come) the ids it
    serves to the others. Built by :func:`_prepare`, completed by :func:`_issue_ids` and :func:`_receive_ids`."""

    def __init__(self, modules, inputs, group):
        self.modules, self.inputs, self.group = list(modules), list(inputs), group
        self.world, self.rank = modules[0].world, modules[0].rank
        self.work = self.recv_splits = self.recv_ids = None


def _prepare(modules, inputs, group) -> _Route:
    """The exchange's local half: inputs checked, each table's ids uniqued (sorted, with the inverse), offset into
    one id space and grouped by owner with ``moe_layout``; the call numbered."""
    detached = [m for m in modules if m._detached]
    if detached:
        raise RuntimeError("fastdist: this ShardedEmbedding was unpickled without its process group: call "
                           "attach(group) on every rank first")
    route = _Route(modules, inputs, group)
    world, device = route.world, modules[0].weight.device
    refusal = None
    for m, (ids, offsets, psw) in zip(modules, inputs):
        why = _refusal(m, ids, offsets, psw)
        if why is not None:
            refusal = f"table {m.num_embeddings}x{m.embedding_dim}: {why}"
            break
    if world > 1 and not all(m._checked for m in modules):
        check_same("ShardedEmbedding config", _configs(modules), group)
        for m in modules:
            m._checked = True
    if refusal is not None and world == 1:
        raise EmbeddingInputError(f"fastdist: ShardedEmbedding refused a lookup ({refusal})")
    # Unique ids per table, in one id space: table i's ids are offset by the rows of the tables before it.
    uniques, inverses, owners, gid_parts, base = [], [], [], [], 0
    for m, (ids, _, _) in zip(modules, inputs):
        if refusal is None:
            u, inv = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        else:  # this rank sends nothing and raises with the others after the header
            u = inv = torch.zeros(0, dtype=torch.int64, device=device)
        uniques.append(u)
        gid_parts.append(u + base)
        inverses.append(inv)
        owners.append(m.owner_of(u))
        base += m.num_embeddings
    gids, owner = torch.cat(gid_parts), torch.cat(owners)
    _, _, send_counts, permutation, row_of_slot, _, _ = moe_layout(owner.unsqueeze(1), world, world, -1)
    route.refusal, route.uniques, route.inverses, route.owner = refusal, uniques, inverses, owner
    route.row_of_slot, route.send_ids = row_of_slot, gids.index_select(0, permutation)
    route.send_splits = send_counts.tolist()
    route.number = modules[0].calls.take()
    return route


def _issue_ids(route: _Route, async_op: bool) -> None:
    """Starts the header-and-ids ``all_to_all_single`` of equal parts.

    Each pair's part carries its header and the first ``capacity`` of its ids (padded), so that when every pair's
    count fits, the ids cost no round trip of their own; the ids past it follow in a second AlltoAll
    (:func:`_receive_ids`) whose splits the headers gave. Each header also carries its sender's largest count, so
    every rank sees the same maximum and sets the same capacity for the next call of these tables (a quarter above
    it): the parts' size is agreed without a message. The first call of a set of tables has capacity 0.
    """
    modules, world, send_splits = route.modules, route.world, route.send_splits
    key = tuple(id(m) for m in modules)
    states = modules[0]._exchange_state  # per set of tables looked up together (fused sets may vary)
    if key not in states:  # the configuration's fingerprint, computed once per set of tables
        states[key] = {"print": fingerprint(_configs(modules)), "capacity": 0}
    state = route.state = states[key]
    capacity = route.capacity = state["capacity"]
    header = torch.tensor([[count, route.number, state["print"], int(route.refusal is not None), max(send_splits)]
                           for count in send_splits], dtype=torch.int64)
    device = route.send_ids.device
    message = torch.zeros(world, _HEADER + capacity, dtype=torch.int64, device=device)  # NCCL: on device
    message[:, :_HEADER] = header.to(device)
    route.starts = starts = [0]
    for count in send_splits:
        starts.append(starts[-1] + count)
    if capacity:
        for r in range(world):
            first = min(send_splits[r], capacity)
            message[r, _HEADER:_HEADER + first] = route.send_ids[starts[r]:starts[r] + first]
    route.received = torch.empty_like(message)
    route.work = dist.all_to_all_single(route.received, message, group=route.group, async_op=async_op)
    modules[0].traffic["ids"] += (world - 1) * (_HEADER + capacity)  # the equal parts, padding included


def _receive_ids(route: _Route) -> None:
    """Waits for the headers, checks the call on every rank (raising on every rank), sets the next capacity and
    receives the ids past this one's (a second AlltoAll when any pair's count outgrew it)."""
    if route.work is not None:
        route.work.wait()
    modules, world, capacity, received = route.modules, route.world, route.capacity, route.received
    headers = received[:, :_HEADER].cpu()  # the exchange's one device-to-host copy
    _check_header(modules, headers, route.group, world, route.refusal)
    recv_splits = route.recv_splits = headers[:, 0].tolist()
    most = int(headers[:, 4].max())
    route.state["capacity"] = (most + most // 4 + 7) // 8 * 8
    firsts = [received[r, _HEADER:_HEADER + min(recv_splits[r], capacity)] for r in range(world)]
    if most <= capacity:
        route.recv_ids = torch.cat(firsts)
        return
    send_splits, starts, send_ids = route.send_splits, route.starts, route.send_ids
    rest_send = [max(c - capacity, 0) for c in send_splits]
    rest_recv = [max(c - capacity, 0) for c in recv_splits]
    rest_ids = torch.cat([send_ids[starts[r] + send_splits[r] - rest_send[r]:starts[r + 1]] for r in range(world)])
    modules[0].traffic["ids"] += sum(rest_send) - rest_send[route.rank]
    rest = send_ids.new_empty(sum(rest_recv))
    dist.all_to_all_single(rest, rest_ids, rest_recv, rest_send, group=route.group)
    parts, at = [], 0
    for r in range(world):
        parts += [firsts[r], rest[at:at + rest_recv[r]]]
        at += rest_recv[r]
    route.recv_ids = torch.cat(parts)


def _count_rows(route: _Route) -> None:
    traffic, me = route.modules[0].traffic, route.rank  # an exchange's traffic is counted on its first table
    traffic["rows"] += sum(route.recv_splits) - route.recv_splits[me]
    if torch.is_grad_enabled():
        traffic["grad_rows"] += sum(route.send_splits) - route.send_splits[me]


@torch.compiler.disable  # sizes depend on the data and collectives run in between: eager, a graph break under compile
def lookup(modules: Sequence[ShardedEmbedding], inputs: Sequence[tuple], group: dist.ProcessGroup | None) -> list:
    """Looks up several tables of one width in one exchange (two or three AlltoAlls forward, one backward).

    When :func:`prefetch` was called for these tables since their last lookup, the lookup finishes that exchange
    instead (one AlltoAll of the rows the update in between changed), provided every rank's inputs are the ones it
    prefetched; otherwise every rank drops the prefetched rows and looks up afresh.

    Args:
        modules: tables sharded over ``group``, all of one ``embedding_dim`` and dtype.
        inputs: per table ``(ids, offsets, per_sample_weights)`` as its forward takes them.
        group: their process group.

    Returns:
        Per table, what its forward returns.

    The first table's ``traffic`` counts what this rank sent to other ranks: ids (int64 slots, the headers and
    the padding of the equal parts included), rows (its owned rows, ``embedding_dim`` values each), gradient
    rows (sent in the backward, counted when a lookup records one) and control bytes (a prefetch's flags).
    """
    pending = modules[0]._prefetch
    if pending is not None and pending.modules == list(modules):
        out = _finish_prefetch(pending, inputs)
        if out is not None:
            return out
    else:
        _drop_prefetches(modules)
    route = _prepare(modules, inputs, group)
    if route.world > 1:
        _issue_ids(route, async_op=False)
        _receive_ids(route)
        _count_rows(route)
        rows, pieces = _owner_rows(modules, route.recv_ids)
        plan = (route.send_splits, route.recv_splits, group, pieces, _watch(pieces), _slots(route))
        rows = _RowExchange.apply(rows, plan, *[m.weight for m in modules])
        _bind(plan[4], rows)
    else:  # one rank: the unique ids in table order, each table's rows with nn.Embedding's gradient
        rows = torch.cat([_local_rows(m, u) for m, u in zip(modules, route.uniques)])
    return _expand_all(route, rows)


def _slots(route: _Route) -> list | None:
    """Per table, the positions of its unique ids' rows in send order; None when the send order is the unique-id
    order. Unique ids are sorted, so a row-sharded table's come already grouped by owner (one table: no
    reordering); several tables in one exchange, or table sharding, interleave owners."""
    owner = route.owner
    if owner.numel() < 2 or bool((owner[1:] >= owner[:-1]).all()):
        return None
    slot_of_unique, out, start = route.row_of_slot[:, 0].to(owner.device), [], 0
    for u in route.uniques:
        out.append(slot_of_unique[start:start + u.numel()])
        start += u.numel()
    return out


def _expand_all(route: _Route, rows: torch.Tensor | tuple) -> list:
    """Each table's output from the rows of its unique ids: one tensor in unique-id order, or one per table."""
    out, start = [], 0
    for i, (m, u, inv, (ids, offsets, psw)) in enumerate(zip(route.modules, route.uniques, route.inverses,
                                                            route.inputs)):
        mine = rows[i] if isinstance(rows, tuple) else rows[start:start + u.numel()]
        start += u.numel()
        out.append(_expand(m, mine, u, inv, ids, offsets, psw))
    return out


# ---- next-batch prefetch (the 2D schedule's lookahead) ----

@torch.compiler.disable
def prefetch(modules: Sequence[ShardedEmbedding], inputs: Sequence[tuple], group: dist.ProcessGroup | None,
             rows_ahead: bool | str = True) -> None:
    """Starts the next lookup of ``modules`` with ``inputs`` before the pending update of the tables is done.

    The ids leave at once (asynchronously). With ``rows_ahead``, when the backward in flight reaches the tables
    (with ``rows_ahead="now"``: in this call, after the ids have arrived; every row the pending optimizer step will
    change is known by then, since any lookup of these tables after this call finishes or drops the prefetch), each
    owner sends the rows that step will not
    change (asynchronously, flagged), and the next :func:`lookup` of these tables with these inputs sends the
    flagged rest, read after the step. Without it (or with no backward in flight), the lookup sends every row in
    one AlltoAll: only the ids went ahead. Either way every row is read after the last change to it, so the result
    equals the lookup's without prefetch. "Will change" is judged from the table's gradient: the rows of a sparse
    gradient and of the lookups whose gradient has not arrived yet; every row when the gradient is dense (momentum
    and weight decay move rows that were not looked up). So between this call and the lookup, only an optimizer
    step on the tables' gradients may change them. A collective: every rank calls it, in the same order.

    Args:
        modules: tables sharded over ``group``, all of one ``embedding_dim`` and dtype (as :func:`lookup`).
        inputs: per table ``(ids, offsets, per_sample_weights)`` of the next lookup.
        group: their process group.
        rows_ahead: send the rows the pending update leaves alone when the backward reaches the tables (True),
            at once ("now": they travel during the whole backward, at the price of the ids' round trip and the
            flags' AlltoAll in this call), or not (False: only the ids go ahead).

    Raises:
        RuntimeError: a prefetch of one of the tables is already pending (no lookup since).
    """
    if modules[0].world == 1:
        return  # one rank: the lookup reads the table directly
    for m in modules:
        if m._prefetch is not None:
            raise RuntimeError("fastdist: ShardedEmbedding.prefetch called twice without a lookup in between")
    route = _prepare(modules, [tuple(a) + (None,) * (3 - len(a)) for a in inputs], group)
    _issue_ids(route, async_op=True)
    _track(modules, route.work, "prefetch ids")
    route.advanced, route.rows_ahead = False, rows_ahead
    for m in modules:
        m._prefetch = route  # with no backward in flight, the rows are sent at the next lookup
    if rows_ahead == "now":
        _advance(route, update_done=False)


def _drop_prefetches(modules) -> None:
    """Drops the prefetches of ``modules`` that a lookup of another set of tables cannot finish (every rank makes
    the same lookups, so every rank drops the same ones): their transfers are waited for and discarded."""
    for m in modules:
        route = m._prefetch
        if route is None:
            continue
        if route.work is not None:
            route.work.wait()
        if route.advanced:
            route.early_work.wait()
        for t in route.modules:
            t._prefetch = None


def _touched_rows(m: ShardedEmbedding) -> torch.Tensor | bool:
    """The shard's rows the pending update may change: a mask, or True (every row) / False (none)."""
    if not m.weight.requires_grad:
        return False
    pending, g = list(m._pending.values()), m.weight.grad
    if g is None and not pending:
        return False
    if not m.sparse or (g is not None and not g.is_sparse):
        return True
    mask = torch.zeros(m.weight.shape[0], dtype=torch.bool, device=m.weight.device)
    for rows in pending + ([g._indices()[0]] if g is not None else []):
        mask[rows] = True
    return mask


def _advance(route: _Route, update_done: bool) -> None:
    """The prefetch's second half: the ids received, every row the pending update leaves alone sent (async). Which
    rows wait for the update (sent by the lookup) goes first, one byte per requested row, so that every row
    travels once: early or late, never both."""
    route.advanced = True
    try:
        _receive_ids(route)
    except BaseException:  # a refused input or a mismatch, raised on every rank: the prefetch is dropped
        for m in route.modules:
            m._prefetch = None
        raise
    rows, pieces = _owner_rows(route.modules, route.recv_ids)
    late = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    if not update_done:
        for m, where, local in pieces:
            touched = _touched_rows(m)
            if touched is True:
                late[slice(None) if where is None else where] = True
            elif touched is not False:
                hit = touched.index_select(0, local)
                late[slice(None) if where is None else where] = hit
    waits = late.new_empty(sum(route.send_splits), dtype=torch.uint8)  # which of this rank's requests wait
    dist.all_to_all_single(waits, late.to(torch.uint8), route.send_splits, route.recv_splits, group=route.group)
    route.pieces, route.late, route.waits = pieces, late, waits.bool()
    early_send = _segments(~late, route.recv_splits)
    early_recv = _segments(~route.waits, route.send_splits)
    route.early = rows.new_empty((sum(early_recv), rows.shape[1]))
    route.early_work = dist.all_to_all_single(route.early, rows[~late], early_recv, early_send,
                                              group=route.group, async_op=True)
    _track(route.modules, route.early_work, "early rows")
    traffic, me = route.modules[0].traffic, route.rank
    traffic["rows"] += sum(early_send) - early_send[me]
    traffic["control"] += sum(route.recv_splits) - route.recv_splits[me]  # the bytes saying which rows wait


def _segments(flags: torch.Tensor, splits: list) -> list:
    """How many of ``flags`` are set in each consecutive segment of ``splits``."""
    if not flags.numel():
        return [0] * len(splits)
    cuts = torch.tensor(splits, device=flags.device).cumsum(0)
    at = torch.cat([flags.new_zeros(1, dtype=torch.int64), flags.long().cumsum(0)])
    ends = at.index_select(0, cuts)
    return torch.diff(ends, prepend=ends.new_zeros(1)).tolist()


def _finish_prefetch(route: _Route, inputs) -> list | None:
    """The lookup of prefetched tables: the rows not sent ahead are sent now, read after the update; None when a
    rank's inputs are not what it prefetched (every rank then looks up afresh)."""
    modules, dim = route.modules, route.modules[0].embedding_dim
    for m in modules:
        m._prefetch = None
    inputs = [tuple(a) + (None,) * (3 - len(a)) for a in inputs]
    same = all(_same_input(a, b) for a, b in zip(inputs, route.inputs))
    if not route.advanced:  # nothing sent ahead: every row now, in one AlltoAll
        _receive_ids(route)  # a refused input raises here, on every rank
        rows, route.pieces = _owner_rows(modules, route.recv_ids)
        received, agreed = _flagged_exchange(route, rows, route.recv_splits, route.send_splits, same)
        if not agreed:
            return None
    else:
        route.early_work.wait()
        late = route.waits
        late_send, late_recv = _segments(route.late, route.recv_splits), _segments(late, route.send_splits)
        with torch.no_grad():
            fresh, _ = _owner_rows(modules, route.recv_ids[route.late])
        got, agreed = _flagged_exchange(route, fresh, late_send, late_recv, same)
        if not agreed:
            return None
        received = got.new_empty((late.numel(), dim))
        received[~late] = route.early
        received[late] = got
    if torch.is_grad_enabled():
        modules[0].traffic["grad_rows"] += sum(route.send_splits) - route.send_splits[route.rank]
    plan = (route.send_splits, route.recv_splits, route.group, route.pieces, _watch(route.pieces), _slots(route))
    rows = _Prefetched.apply(received, plan, *[m.weight for m in modules])
    _bind(plan[4], rows)
    return _expand_all(route, rows)


def _flagged_exchange(route: _Route, rows: torch.Tensor, send: list, recv: list, same: bool) -> tuple:
    """One AlltoAll of ``rows`` (``send`` per destination, ``recv`` per source), each pair's part led by a row
    whose first value says whether the sender's inputs were the ones it prefetched: (the rows received, whether
    every rank's were)."""
    parts, at = [], 0
    flag = rows.new_full((1, rows.shape[1]), float(same))
    for r in range(route.world):
        parts += [flag, rows[at:at + send[r]]]
        at += send[r]
    got = rows.new_empty((sum(recv) + route.world, rows.shape[1]))
    dist.all_to_all_single(got, torch.cat(parts), [c + 1 for c in recv], [c + 1 for c in send], group=route.group)
    traffic = route.modules[0].traffic
    traffic["rows"] += sum(send) - send[route.rank]
    traffic["control"] += (route.world - 1) * rows.shape[1] * rows.element_size()  # the flag rows
    heads = torch.tensor([0] + recv[:-1]).add(1).cumsum(0).sub(1).tolist()
    keep = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    keep[heads] = False
    return got[keep], bool((got[heads, 0] == 1).all())


def _same_input(a: tuple, b: tuple) -> bool:
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and x is not y and (x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y)):
            return False
    return True


# ---- rows and their gradients ----

def _local_pad(m):
    """The padding row's index in this rank's shard, or None."""
    return m.padding_idx - m.row_start if m.padding_idx is not None and m.owns(m.padding_idx) else None


def _local_rows(m, ids):
    """One rank alone: ``F.embedding`` on the table, its gradient ``nn.Embedding``'s."""
    return F.embedding(ids, m.weight, padding_idx=_local_pad(m), sparse=m.sparse)


def _owner_rows(modules, recv_ids):
    """The rows the owners read for the ids they received (in received order), and per table ``(module, positions
    in the received ids or None for all, local row of each)`` for the backward."""
    base, pieces = 0, []
    with torch.no_grad():
        if len(modules) == 1:
            m = modules[0]
            local = recv_ids - (base + m.row_start)
            return m.weight.index_select(0, local), [(m, None, local)]
        rows = modules[0].weight.new_zeros((recv_ids.numel(), modules[0].embedding_dim))
        for m in modules:
            lo, hi = base + m.row_start, base + m.row_start + m.weight.shape[0]
            base += m.num_embeddings
            where = ((recv_ids >= lo) & (recv_ids < hi)).nonzero().flatten()
            local = recv_ids.index_select(0, where) - lo
            rows.index_copy_(0, where, m.weight.index_select(0, local))
            pieces.append((m, where, local))
    return rows, pieces


class _Pending:
    """A lookup whose gradient rows have not reached the owners yet (weakly held by the tables it read: a graph
    freed without a backward forgets it)."""

    __slots__ = ("__weakref__", "started", "issued", "node")

    def __init__(self):
        self.started = False  # its backward has begun: its rows are all the update will add
        self.issued = False  # its gradient rows are on their way (set by the collective queue, when there is one)
        self.node = None  # the exchange's autograd node (the queue asks whether this backward will run it)


def _bind(token, rows) -> None:
    """Records the exchange's autograd node on its pending lookup."""
    if token is not None:
        token.node = (rows[0] if isinstance(rows, tuple) else rows).grad_fn


def _watch(pieces):
    """Registers a lookup's rows as pending on their tables while gradients are recorded (see prefetch)."""
    if not torch.is_grad_enabled():
        return None
    token = _Pending()
    for m, _, local in pieces:
        if m.weight.requires_grad:  # a table called twice in one exchange has two pieces
            m._pending[token] = torch.cat([m._pending[token], local]) if token in m._pending else local
    return token


class _RowExchange(torch.autograd.Function):
    """Forward: the owners' rows to the ranks that asked for them (``all_to_all_single``). Backward: the gradient
    rows go back to their owners asynchronously, and at the end of the backward they are added to the shards'
    gradients as ``F.embedding``'s backward would (sparse or dense, padding row left out, divided by the group size
    when averaging), so that the exchanges of several tables, the rest of the backward and DDP's all-reduce run at
    the same time instead of one after another. The shards are inputs only to place this node in the graph."""

    @staticmethod
    def forward(ctx, rows, plan, *weights):
        send_splits, recv_splits, group = plan[:3]
        ctx.plan = plan
        out = rows.new_empty((sum(send_splits), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), send_splits, recv_splits, group=group)
        return _by_table(out, plan[5])

    @staticmethod
    def backward(ctx, *grads):
        send_splits, recv_splits, group, pieces, token, slots = ctx.plan
        grad = grads[0] if slots is None else _to_send_order(grads, slots)
        if token is not None:
            token.started = True
        for fusion in {id(m.fusion): m.fusion for m, _, _ in pieces if m.fusion is not None}.values():
            fusion.issue_prefetches()  # the fused prefetches not issued yet leave now, their rows right after
        _advance_prefetches(pieces)
        received = grad.new_empty((sum(recv_splits), grad.shape[1]))
        work = dist.all_to_all_single(received, grad.contiguous(), recv_splits, send_splits, group=group,
                                      async_op=True)
        _track([m for m, _, _ in pieces], work, "gradient rows", token)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _add_gradients(work, received, pieces, token))
        return (None, None) + (None,) * len(pieces)


def _track(modules, work, name: str, token=None) -> None:
    """Tells the tables' collective queue (if any: ``hybrid_parallel(prioritize=True)``) that an exchange of
    theirs is in flight (the gradient rows of the pending lookup ``token``), so that DDP's buckets wait for it."""
    queue = modules[0].queue
    if queue is not None and work is not None:
        queue.track(work, name=name, fulfils=token)


def _by_table(rows, slots):
    """The exchanged rows (send order) as one tensor per table (its unique ids' rows), or as they are when
    ``slots`` is None. Split inside the exchange's autograd node, whose backward puts the tables' gradients back
    in send order in one pass (a reorder and per-table slices of one tensor would each cost a zero-filled
    full-size gradient and a scatter in the backward)."""
    return rows if slots is None else tuple(rows.index_select(0, s) for s in slots)


def _to_send_order(grads, slots):
    out = grads[0].new_empty((sum(s.numel() for s in slots), grads[0].shape[1]))
    for g, s in zip(grads, slots):
        out.index_copy_(0, s, g)
    return out


class _Prefetched(_RowExchange):
    """A prefetched lookup's rows, already exchanged: the forward passes them on, the backward is the exchange's."""

    @staticmethod
    def forward(ctx, rows, plan, *weights):
        ctx.plan = plan
        return _by_table(rows, plan[5])


def _add_gradients(work, received, pieces, token=None):
    """Waits for the gradient rows and adds them to each shard's ``.grad``."""
    work.wait()
    for m, where, local in pieces:
        g = received if where is None else received.index_select(0, where)
        pad = _local_pad(m)
        if pad is not None:
            keep = (local != pad).nonzero().flatten()
            g, local = g.index_select(0, keep), local.index_select(0, keep)
        if m.average_gradients and m.world > 1:
            g = g / m.world  # DDP divides before summing too
        w = m.weight
        if m.sparse:
            update = torch.sparse_coo_tensor(local.unsqueeze(0), g, w.shape, check_invariants=False)
            w.grad = update if w.grad is None else w.grad + update
        else:
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.index_add_(0, local, g)
    for m, _, _ in pieces:
        m._pending.pop(token, None)


def _advance_prefetches(pieces) -> None:
    """Sends the early rows of the prefetches of these tables once every lookup awaiting its gradient has begun
    its backward (so every row the update will change is known), just before this backward's gradient rows: the
    next step's rows then travel during the rest of the backward, DDP's all-reduce and the optimizer step."""
    for m, _, _ in pieces:
        route = m._prefetch
        if route is not None and route.rows_ahead and not route.advanced and all(
                t.started for table in route.modules for t in list(table._pending.keys())):
            _advance(route, update_done=False)


def _expand(module, rows, unique, inverse, ids, offsets, psw):
    """The batch's output from its unique rows: ``nn.Embedding``'s or ``nn.EmbeddingBag``'s semantics on the
    small table of unique rows (the padding id, if looked up, keeps its role)."""
    pad = None
    if module.padding_idx is not None and unique.numel():
        at = int(torch.searchsorted(unique, module.padding_idx))
        if at < unique.numel() and int(unique[at]) == module.padding_idx:
            pad = at
    if module.mode is None:
        return F.embedding(inverse.reshape(ids.shape), rows, padding_idx=pad)
    return F.embedding_bag(inverse.reshape(ids.shape), rows, offsets, mode=module.mode,
                           per_sample_weights=psw, padding_idx=pad)
