"""Sharded checkpoints of an :class:`~fastdist.parallel.Engine` through ``torch.distributed.checkpoint`` (DCP).

Every rank writes only the pieces of the model (and optimizer state) it holds, keyed and placed as in the user's
unparallelized model: a stage's tensors under the model's names, a tensor-parallel shard as the rows or columns of
the full tensor it holds, an expert-parallel MoE layer's experts as its slice of the expert dimension. Replicas
(data-parallel copies, a tied parameter on two stages) write one copy: DCP's planner removes duplicates. Loading
asks DCP for the pieces this rank holds on its own mesh, so a checkpoint written on one mesh loads on any other (and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into the plain model's state dict).

A tensor-parallel shard of a fused qkv weight holds rows from several places of the full weight; DCP's own sharded
types (DTensor's Shard placements) describe one contiguous block per rank, so each contiguous run of rows is one DCP
chunk here, described through DCP's chunk protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``) and resolved by the planners below.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["load_sharded", "save_sharded"]

MODEL, OPTIMIZER = "model.", "optimizer."


class _Chunks:
    """This rank's pieces of one tensor of the full model: ``[(offsets into the full tensor, view)]``."""

    def __init__(self, full_size: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.full_size = torch.Size(full_size)
        self.pieces = pieces

    def size(self) -> torch.Size:
        return self.full_size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.size()),
                              properties=TensorProperties.create_from_tensor(view), size=self.full_size))
                for offsets, view in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.size()) for offsets, view in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self.pieces:
            if torch.Size(offsets) == index.offset:
                return view
        raise ValueError(f"fastdist.parallel: no piece of {index.fqn} at {tuple(index.offset)} on this rank")


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Chunks):  # written from a copy: a view would carry its whole storage
            return obj.__get_tensor_shard__(index).detach().cpu().contiguous()
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, _Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        # DCP's set-up replaces every value of a type it does not know by None; the keys are top-level, so the
        # flattened dict holds them under the same names
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Chunks):  # read straight into the parameter's (or state's) own memory
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


def _row_runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, full start, length)`` of every run of consecutive row indices."""
    runs, values = [], rows.tolist()
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, values[start], i - start))
            start = i
    return runs


def _chunks(engine, name: str, t: torch.Tensor) -> torch.Tensor | _Chunks:
    """``t`` (this rank's tensor of parameter ``name``, or optimizer state of its shape) as pieces of the full
    model's tensor; a tensor every rank of its stage holds whole is returned as it is."""
    layout, layer = engine._layouts.get(name), engine._experts.get(name)
    if layer is not None:
        return _Chunks((layer.num_experts, *t.shape[1:]),
                       [((layer.first_expert,) + (0,) * (t.dim() - 1), t)])
    if layout is None:
        return t
    tp = engine.plan.mesh[1]
    if layout.cols is not None:  # the [out, in] weight's columns cols[0]:cols[1]
        full, pieces = (t.shape[0], t.shape[1] * tp), [((0, layout.cols[0]), t)]
    else:  # rows of the [out, in] weight (its bias: of the [out] vector)
        full = (t.shape[0] * tp, *t.shape[1:])
        pieces = [((first,) + (0,) * (t.dim() - 1), t[local:local + n]) for local, first, n in _row_runs(layout.rows)]
    if layout.transposed:  # the user's tensor is [in, out]
        full, pieces = full[::-1], [(offsets[::-1], view.t()) for offsets, view in pieces]
    return _Chunks(full, pieces)


def _model_items(engine) -> dict[str, Any]:
    return {MODEL + name: _chunks(engine, name, t) if isinstance(t, torch.Tensor) else t
            for name, t in engine.module.state_dict(keep_vars=False).items()}


def _optimizer_items(engine) -> dict[str, Any]:
    """The optimizer's state by parameter name (``optimizer.state.<name>.<key>``) and each parameter's group's
    hyper-parameters (``optimizer.group.<name>``), under every name the parameter has in the user's model."""
    items = {}
    names = {id(p): n for n, p in engine._named_optimizer_params()}
    for group in engine.optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            for alias in engine._aliases.get(names[id(p)], [names[id(p)]]):
                items[f"{OPTIMIZER}group.{alias}"] = pickle.dumps(hyper)  # one object: DCP would flatten a dict
                for k, v in engine.optimizer.state.get(p, {}).items():
                    key = f"{OPTIMIZER}state.{alias}.{k}"
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                        items[key] = _chunks(engine, names[id(p)], v)
                    else:
                        items[key] = v
    return items


def save_sharded(engine, path: str | os.PathLike, optimizer: bool = True) -> None:
    """Writes ``engine``'s model (and optimizer) state to the DCP checkpoint directory ``path``: each rank its own
    pieces. A collective: every rank calls it with the same ``path`` (a directory every rank can reach)."""
    items = _model_items(engine)
    if optimizer:
        items.update(_optimizer_items(engine))
    items["steps"] = engine._steps
    dcp.save(items, checkpoint_id=os.fspath(path), planner=_SavePlanner())


def load_sharded(engine, path: str | os.PathLike, optimizer: bool = True) -> None:
    """Reads what :func:`save_sharded` wrote, on any mesh and plan: each rank reads the pieces its stage and shards
    hold, straight into its parameters, and rebuilds its optimizer's state from theirs. A collective.

    Raises:
        RuntimeError: the checkpoint lacks a tensor of this rank's stage (another model), or the optimizer state
            (saved with ``optimizer=False``).
        ValueError: a tensor's full shape differs from the saved one.
    """
    path = os.fspath(path)
    items = _model_items(engine)
    items["steps"] = engine._steps
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state_items = {}
    if optimizer:
        named = engine._named_optimizer_params()
        for name, p in named:
            items[f"{OPTIMIZER}group.{name}"] = None
            prefix = f"{OPTIMIZER}state.{name}."
            for key, md in saved.items():
                if not key.startswith(prefix):
                    continue
                if isinstance(md, TensorStorageMetadata):  # room for it, in this rank's shape
                    target = _chunks(engine, name, torch.empty_like(p.detach()))
                    if tuple(md.size) != tuple(target.size()):
                        target = torch.empty(md.size, dtype=md.properties.dtype)
                else:
                    target = None
                state_items[key] = target
        items.update(state_items)
    dcp.load(items, checkpoint_id=path, planner=_LoadPlanner())
    with torch.no_grad():  # module extra state (an MoE layer's planner) comes back as objects
        for key, value in items.items():
            if key.startswith(MODEL) and not isinstance(value, (torch.Tensor, _Chunks)):
                engine.module.get_submodule(key[len(MODEL):].rpartition(".")[0]).set_extra_state(value)
    engine._steps = int(items["steps"])
    if not optimizer:
        return
    state, groups = {}, []
    for i, (name, p) in enumerate(engine._named_optimizer_params()):
        prefix = f"{OPTIMIZER}state.{name}."
        entry = {}
        for key, value in state_items.items():
            if key.startswith(prefix):
                if isinstance(value, _Chunks):  # the pieces were read into views of one tensor of p's shape
                    value = _base_of(value, p)
                entry[key[len(prefix):]] = value
        if entry:
            state[i] = entry
    index = {id(p): i for i, (_, p) in enumerate(engine._named_optimizer_params())}
    names = {id(p): n for n, p in engine._named_optimizer_params()}
    for g in engine.optimizer.param_groups:
        hyper = pickle.loads(items[f"{OPTIMIZER}group.{names[id(g['params'][0])]}"]) if g["params"] else {}
        groups.append({**hyper, "params": [index[id(p)] for p in g["params"]]})
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _base_of(chunks: _Chunks, p: torch.Tensor) -> torch.Tensor:
    """The tensor of ``p``'s shape whose views ``chunks`` holds."""
    view = chunks.pieces[0][1]
    base = view._base if view._base is not None else view
    if base.shape != p.shape:
        raise RuntimeError(f"fastdist.parallel: an optimizer state read for a parameter of shape {tuple(p.shape)} "
                           f"has shape {tuple(base.shape)}")
    return base
