"""A collection of sharded tables (whole tables placed on ranks, balanced by size) and ``hybrid_parallel``: every
large embedding of a user's model sharded, the dense rest data-parallel under DDP."""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.distributed import global_ranks
from fastdist.embedding.fused import LookupFusion
from fastdist.embedding.schedule import CollectiveQueue, prioritized_hook
from fastdist.embedding.sharded import ShardedEmbedding, group_rank_and_world, lookup, prefetch

__all__ = ["ShardedEmbeddingCollection", "balance_tables", "hybrid_parallel"]


def balance_tables(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Owner rank of each table: largest first, each to the rank holding the fewest elements so far (ties: the
    lower rank; equal sizes: by name), so every rank computes the same placement.

    Args:
        sizes: ``{table name: its number of elements}``.
        world: the number of ranks to place the tables on.
    """
    load = [0] * world
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


class ShardedEmbeddingCollection(nn.Module):
    """A dict of embedding tables sharded over a group and looked up together: one exchange (three AlltoAlls) per
    row width per call, whatever the number of tables.

    Args:
        tables: ``{name: nn.Embedding or nn.EmbeddingBag}``; each is replaced by its sharded twin with the same rows
            (every rank must pass equal tables, e.g. built from the same seed).
        group: the process group (None: the default group).
        sharding: ``"table"`` (each table whole on one rank, placed by :func:`balance_tables`) or ``"row"`` (every
            table split in row ranges over the group).
        average_gradients: divide the tables' gradients by the group size, as DDP does for dense parameters.
    """

    def __init__(self, tables: Mapping[str, nn.Embedding | nn.EmbeddingBag], *,
                 group: dist.ProcessGroup | None = None, sharding: str = "table",
                 average_gradients: bool = False) -> None:
        super().__init__()
        if not tables:
            raise ValueError("fastdist: ShardedEmbeddingCollection needs at least one table")
        _, world = group_rank_and_world(group)
        owners = balance_tables({n: t.num_embeddings * t.embedding_dim for n, t in tables.items()}, world)
        self.group = group
        self.tables = nn.ModuleDict({
            name: ShardedEmbedding.from_embedding(t, group=group, sharding=sharding, owner=owners[name],
                                                  average_gradients=average_gradients)
            for name, t in tables.items()})
        for name, t in self.tables.items():
            t.table_name = name

    def forward(self, inputs: Mapping[str, torch.Tensor | tuple]) -> dict[str, torch.Tensor]:
        """Looks up every table named in ``inputs`` (the same names on every rank).

        Args:
            inputs: ``{name: ids}`` or ``{name: (ids, offsets)}`` / ``(ids, offsets, per_sample_weights)`` for bags.

        Returns:
            ``{name: the table's output}``.
        """
        out = {}
        for group in self._by_width(inputs):
            args = [a for _, _, a in group]
            for (name, _, _), y in zip(group, lookup([t for _, t, _ in group], args, self.group)):
                out[name] = y
        return out

    def prefetch(self, inputs: Mapping[str, torch.Tensor | tuple], *, rows_ahead: bool = True) -> None:
        """Starts the lookup of the next batch's ``inputs``: call it after this step's forward, before its
        backward; see :meth:`ShardedEmbedding.prefetch`.

        Args:
            inputs: the next batch's inputs, as :meth:`forward` takes them.
            rows_ahead: send the rows the pending update leaves alone before the update (else only the ids).
        """
        for group in self._by_width(inputs):
            prefetch([t for _, t, _ in group], [a for _, _, a in group], self.group, rows_ahead)

    def _by_width(self, inputs):
        """The named tables' ``(name, table, (ids, offsets, per_sample_weights))`` grouped by row width."""
        names = sorted(inputs)
        unknown = [n for n in names if n not in self.tables]
        if unknown:
            raise KeyError(f"fastdist: ShardedEmbeddingCollection has no table {unknown[0]!r}; it has "
                           f"{sorted(self.tables)}")
        by_width: dict = {}
        for name in names:
            table = self.tables[name]
            args = inputs[name] if isinstance(inputs[name], tuple) else (inputs[name],)
            args = tuple(args) + (None,) * (3 - len(args))
            by_width.setdefault((table.embedding_dim, table.weight.dtype), []).append((name, table, args))
        return [by_width[key] for key in sorted(by_width, key=str)]


def _tied_names(model):
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def hybrid_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, min_rows: int = 65536,
                    comm_hook: Callable | None = None, comm_state: object = None,
                    shard: Mapping[str, bool] | None = None, sharding: str = "row", fuse: bool = False,
                    prioritize: bool = False, **ddp_options: object) -> nn.Module:
    """Shards every ``nn.Embedding``/``nn.EmbeddingBag`` of ``model`` with at least ``min_rows`` rows and wraps the
    rest in DDP; the training loop stays the user's (build the optimizer after this call: the tables' parameters
    are now their shards).

    The tables' gradients are averaged over the group, as DDP averages the dense ones, so training equals
    single-process training on the concatenated batch. Their traffic runs on a group of its own (the same ranks),
    so that it never interleaves with DDP's buckets. ``model.state_dict()`` holds full tables (gathered: call it on
    every rank); inside ``fastdist.embedding.sharded_state_dict()`` it holds each rank's shards.

    Args:
        model: the user's model, built alike on every rank (same seed).
        group: the data-parallel group (None: the default group). Every rank of the default group must call this
            (it creates the tables' process group).
        min_rows: tables with fewer rows stay dense and data-parallel.
        comm_hook: a DDP communication hook for the dense part (e.g. ``fastdist.comm.sketch_hook``'s), with
            ``comm_state`` its state.
        shard: ``{module name: bool}`` overriding the size rule per module.
        sharding: the tables' sharding (``"row"`` or ``"table"``).
        fuse: bind the sharded tables to one :class:`~fastdist.embedding.LookupFusion`, so that the tables the
            model calls one by one before using any of their outputs share one exchange per row width (one ids
            and one rows AlltoAll forward, one gradient AlltoAll backward) instead of one each. Off by default:
            on this project's 4-rank runs the fused form was level or slower (half the collectives, but a table's
            gradient rows no longer travel while the next table is still being differentiated).
        prioritize: order the collectives by when the next iteration needs them (the 2D schedule's priority
            queue, :class:`~fastdist.embedding.schedule.CollectiveQueue`): DDP's buckets (through ``comm_hook``,
            or torch's all-reduce hook) are held while any table exchange is in flight or due in this backward,
            and leave as the last one completes. The queue is the returned DDP module's ``collective_queue``.
            Off by default (see docs/embedding.md for its measured effect).
        **ddp_options: passed to ``DistributedDataParallel``.

    Returns:
        The model with its tables sharded, wrapped in DDP when it has dense parameters that train.

    Raises:
        ValueError: a table to shard shares its weight with another module (e.g. a language model's input
            embedding tied to its output layer, which needs the whole table on every rank): keep it dense with
            ``shard={name: False}``; a name in ``shard`` that is not an embedding of the model.
    """
    shard = dict(shard or {})
    modules = dict(model.named_modules())
    for name in shard:
        if not isinstance(modules.get(name), (nn.Embedding, nn.EmbeddingBag)):
            raise ValueError(f"fastdist: hybrid_parallel shard={{{name!r}: ...}} names no nn.Embedding or "
                             "nn.EmbeddingBag of the model")
    chosen = [n for n, m in modules.items() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
              and shard.get(n, m.num_embeddings >= min_rows)]
    tied = _tied_names(model)
    for name in chosen:
        others = [n for n in tied[id(modules[name].weight)] if n != f"{name}.weight"]
        if others:
            raise ValueError(f"fastdist: hybrid_parallel cannot shard {name!r}: its weight is tied to {others} "
                             "(the tied layer needs the whole table on every rank). Keep it data-parallel with "
                             f"shard={{{name!r}: False}}, or untie the weights")
    _, world = group_rank_and_world(group)
    table_group = dist.new_group(global_ranks(group)) if chosen and world > 1 else group
    owners = balance_tables({n: modules[n].num_embeddings * modules[n].embedding_dim for n in chosen}, world)
    fusion = LookupFusion() if fuse else None
    queue = CollectiveQueue() if prioritize and chosen and world > 1 else None
    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        sharded = ShardedEmbedding.from_embedding(modules[name], group=table_group, sharding=sharding,
                                                  owner=owners[name], average_gradients=True)
        sharded.table_name = name
        sharded.queue = queue
        if fusion is not None:
            fusion.bind(sharded)
        setattr(parent, attr, sharded)
    if world == 1:
        return model
    ignored = [n for n, m in model.named_modules() if isinstance(m, ShardedEmbedding) for n in (f"{n}.weight",)]
    if not any(p.requires_grad for n, p in model.named_parameters() if n not in ignored):
        return model
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model, process_group=group, **ddp_options)
    if queue is not None:
        ddp.register_comm_hook(comm_state if comm_hook is not None else ddp.process_group,
                               prioritized_hook(queue, comm_hook))
        queue.add_tables(m for m in model.modules() if isinstance(m, ShardedEmbedding))
        ddp.collective_queue = queue
    elif comm_hook is not None:
        ddp.register_comm_hook(comm_state, comm_hook)
    return ddp
