"""Fused lookups: tables a model calls one by one (``emb_a(ids_a)``, ``emb_b(ids_b)``) share one exchange.

A table bound to a :class:`LookupFusion` does not look up when called: it records the call and returns a
*deferred output*, a tensor of the output's shape, dtype and device without data. The first torch operation on
any deferred output of the fusion (``torch.stack``, ``+``, a matmul, ...) looks up every call recorded so far in one
exchange per row width and dtype (:func:`fastdist.embedding.lookup`: one header-and-ids AlltoAll, one rows AlltoAll
forward, one gradient-rows AlltoAll backward), and the operation runs on the real outputs. Reading metadata
(``shape``, ``dtype``, ``dim()``, ``size()``, ...) does not look up.

Every rank runs the same model code, so every rank records the same calls and looks them up at the same point,
in the same order; where ranks differ (data-dependent control flow), the exchange's header check raises
``MismatchError`` on every rank, naming the tables. Calls under ``torch.compile`` are looked up at once (the
lookup is a graph break there). Prefetches of bound tables are fused too (:meth:`LookupFusion.defer_prefetch`), and
the fused lookup of the same tables finishes them. A deferred output passed straight into a custom
``torch.autograd.Function``
(which torch does not route through ``__torch_function__``) is materialized inside its forward but autograd
would not reach the table through it: its backward raises rather than drop the table's gradient.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._pytree import tree_map

__all__ = ["LookupFusion", "fuse_lookups"]

# Metadata a deferred output answers by itself, without looking up (the wrapper has the output's metadata).
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_sparse.__get__,
             torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.element_size}


class _Deferred(torch.Tensor):
    """A table's output that is looked up, with every other pending call of its fusion, at its first use."""

    @staticmethod
    def __new__(cls, shape, dtype, device, requires_grad, fusion):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, shape, dtype, device, requires_grad, fusion):
        self.fusion, self.value = fusion, None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_materialize, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"fastdist: a deferred embedding output reached {func} below autograd without being "
                           "looked up; call fastdist.embedding.LookupFusion.flush() first, or bind no fusion")


def _materialize(x):
    if isinstance(x, _Deferred):
        if x.value is None:
            x.fusion.flush()
        if x.value is None:
            raise RuntimeError("fastdist: this deferred embedding output's lookup raised; it has no value")
        return x.value
    return x


def _refuse_gradient(_):
    raise RuntimeError("fastdist: a deferred embedding output was used by an operation torch does not route "
                       "through __torch_function__ (a custom autograd.Function's apply): its gradient cannot reach "
                       "the table. Call fastdist.embedding.LookupFusion.flush() (or use the output in a torch op) "
                       "before the Function, or build the model with hybrid_parallel(fuse=False)")


class LookupFusion:
    """Defers the lookups of the tables bound to it and makes every call recorded before the first use of a
    result one exchange (per row width and dtype). ``hybrid_parallel`` binds every table it shards to one fusion;
    :func:`fuse_lookups` binds tables built by hand. Holds no process group (the tables do) and pickles."""

    def __init__(self) -> None:
        self._queue: list = []  # (table, inputs, grad mode, deferred output)
        self._prefetches: list = []  # (table, inputs, rows_ahead), issued together (issue_prefetches)
        self.tables: list = []  # the tables bound to it

    def __getstate__(self) -> dict:
        return {"_queue": [], "_prefetches": [], "tables": self.tables}

    def bind(self, table: torch.nn.Module) -> None:
        """Binds a ``ShardedEmbedding``: its calls are deferred and fused, and so are its prefetches.

        Args:
            table: the ``ShardedEmbedding`` to bind.
        """
        table.fusion = self
        if not any(t is table for t in self.tables):
            self.tables.append(table)

    def defer(self, module: torch.nn.Module, inputs: tuple) -> torch.Tensor:
        """Records ``module``'s call and returns its deferred output. Bad input is not judged here: the exchange
        refuses it on every rank when it runs.

        Args:
            module: a bound ``ShardedEmbedding``.
            inputs: its forward's ``(ids, offsets, per_sample_weights)``.
        """
        grad = torch.is_grad_enabled()
        out = _Deferred(_output_shape(module, *inputs), module.weight.dtype, module.weight.device,
                        grad and module.weight.requires_grad, self)
        if out.requires_grad:
            with torch._C.DisableTorchFunctionSubclass():
                out.register_hook(_refuse_gradient)
        self._queue.append((module, inputs, grad, out))
        return out

    @property
    def pending(self) -> int:
        """How many recorded calls wait for their lookup."""
        return len(self._queue)

    def flush(self) -> None:
        """Looks up every recorded call: one exchange per (process group, row width, dtype, grad mode), in the
        order of each kind's first call. A collective: every rank flushes at the same point (the same model code
        does). Called by the first use of any deferred output; calling it by hand is harmless."""
        from fastdist.embedding.sharded import lookup
        if not self._queue:
            return
        self.issue_prefetches()  # a prefetch not issued yet: issued now, finished by the lookup
        queue, self._queue = self._queue, []
        kinds: dict = {}
        for entry in queue:
            m, _, grad, _ = entry
            kinds.setdefault((id(m.group), m.embedding_dim, m.weight.dtype, grad), []).append(entry)
        for entries in kinds.values():
            route, ids = entries[0][0]._prefetch, [id(e[0]) for e in entries]
            if route is not None and len(set(ids)) == len(ids) and sorted(ids) == sorted(map(id, route.modules)):
                at = {id(m): i for i, m in enumerate(route.modules)}  # the prefetch's order, so it is finished
                entries.sort(key=lambda e: at[id(e[0])])
            with torch.set_grad_enabled(entries[0][2]):
                outs = lookup([e[0] for e in entries], [e[1] for e in entries], entries[0][0].group)
            for (_, _, _, deferred), y in zip(entries, outs):
                deferred.value = y

    def defer_prefetch(self, module: torch.nn.Module, inputs: tuple, rows_ahead: bool) -> None:
        """Records ``module``'s prefetch; issues the fusion's prefetches together once every bound table has one.

        Args:
            module: a bound ``ShardedEmbedding``.
            inputs: the next batch's ``(ids, offsets, per_sample_weights)``.
            rows_ahead: as :meth:`ShardedEmbedding.prefetch`.

        Raises:
            RuntimeError: ``module`` has a prefetch pending already (no lookup since).
        """
        if module._prefetch is not None or any(m is module for m, _, _ in self._prefetches):
            raise RuntimeError("fastdist: ShardedEmbedding.prefetch called twice without a lookup in between")
        self.flush()  # calls recorded before the prefetch are this batch's: looked up first
        self._prefetches.append((module, inputs, rows_ahead))
        if {id(t) for t in self.tables} <= {id(m) for m, _, _ in self._prefetches}:
            self.issue_prefetches()

    def issue_prefetches(self) -> None:
        """Issues the recorded prefetches: one per (process group, row width, dtype, rows_ahead), in call order.
        A collective; called when every bound table has one, when the backward reaches the tables, or before a
        lookup, the same point on every rank."""
        from fastdist.embedding.sharded import prefetch
        queue, self._prefetches = self._prefetches, []
        kinds: dict = {}
        for entry in queue:
            m, _, ahead = entry
            kinds.setdefault((id(m.group), m.embedding_dim, m.weight.dtype, ahead), []).append(entry)
        for (_, _, _, ahead), entries in kinds.items():
            prefetch([e[0] for e in entries], [e[1] for e in entries], entries[0][0].group, ahead)


def _output_shape(module, ids, offsets, psw) -> tuple:
    """The shape the lookup will return (a placeholder for input the exchange will refuse)."""
    dim = module.embedding_dim
    if not isinstance(ids, torch.Tensor):
        return (0, dim)
    if module.mode is None:
        return (*ids.shape, dim)
    if ids.dim() == 2:
        return (ids.shape[0], dim)
    return (offsets.numel() if isinstance(offsets, torch.Tensor) else 0, dim)


def fuse_lookups(tables: Iterable[torch.nn.Module]) -> LookupFusion:
    """Binds ``tables`` (``ShardedEmbedding`` modules, or modules holding them) to one new :class:`LookupFusion`
    and returns it; ``hybrid_parallel`` does this for the tables it shards unless ``fuse=False``.

    Args:
        tables: the tables, or models whose ``ShardedEmbedding`` submodules are bound.
    """
    from fastdist.embedding.sharded import ShardedEmbedding
    fusion = LookupFusion()
    for t in tables:
        for m in t.modules():
            if isinstance(m, ShardedEmbedding):
                fusion.bind(m)
    return fusion
