"""One call from an unmodified model to data x tensor x pipeline parallel training: :func:`parallelize`.

Every rank calls ``parallelize`` with the same model (same structure, same initial values) and the same
arguments. It

1. agrees on the configuration (a clear error on every rank when the ranks disagree, or when the mesh does not
   match the world, the batch does not split into the microbatches, the pipeline has more stages than the model has
   blocks, the model cannot be cut, ...: never a hang);
2. cuts the model into ``pp`` stages (:mod:`fastdist.parallel.partition`: profiled on rank 0, balanced by time or
   parameters, or at ``split_points``), builds this rank's stage and checks it computes its part of the model;
3. shards the stage's transformer blocks over the ``tp`` group with :func:`fastdist.tp.parallelize` (the Oases
   chunked overlap), wraps it in DDP over the ``dp`` group (with ``dp_comm_hook``), and drives it with a pipeline
   schedule from :func:`fastdist.parallel.schedule.build_schedule` over torch's ``PipelineStage`` (with Merak's
   recompute and fastdist's compressed boundaries mixed in when asked for).

A parameter held by two stages (a tied embedding and LM head) gets the sum of both stages' gradients before the
optimizer step, so both copies stay equal. ``Engine.state_dict()`` gathers the full model's state dict, keyed as
the user's model (on every rank, or on one); ``load_state_dict`` takes one and re-shards it to this mesh, and
``optimizer_state_dict`` / ``load_optimizer_state_dict`` do the same for the optimizer's state.
``save_sharded`` / ``load_sharded`` write and read a ``torch.distributed.checkpoint`` directory instead, each rank
its own pieces, re-sharded on load to any mesh.

A stage may hold fastdist.moe ``MoELayer``s expert parallel over the data-parallel group (built with
``group=mesh.get_group("dp")`` of the DeviceMesh passed as ``mesh``): each layer then averages its own experts'
gradients (:func:`fastdist.moe.data_parallel` wraps the stage), and the checkpoints gather and re-slice its experts
like tensor-parallel shards.

A model built on the meta device is allocated stage by stage (each rank its own, with the values the whole model
would get from its init); ``compile=True`` compiles each stage's blocks; a rank whose step raises, or whose process
dies, makes every other rank's step raise :class:`RankFailedError` naming it, at once rather than at the backend's
timeout (:mod:`fastdist.distributed.failure`).
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from fastdist.distributed import check_same, state_digest
from fastdist.distributed.failure import FailureWatch, RankFailedError
from fastdist.parallel import partition as part
from fastdist.parallel.partition import Plan
from fastdist.parallel.tensor import expand_tp_plan, shard_of, shard_stage

__all__ = ["Engine", "ParallelizeError", "RankFailedError", "parallelize", "plain_optimizer_state_dict"]

MESH_DIMS = ("dp", "tp", "pp")


class ParallelizeError(ValueError):
    """A configuration parallelize cannot run, raised on every rank (the message names the rank that found it)."""


_engines_built = 0  # every rank builds engines in the same order (parallelize is collective)


def _agree(what: str, problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raises ParallelizeError on every rank of ``group`` if any rank found a problem (one object all-gather)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem:
            raise ParallelizeError(f"fastdist.parallelize: {problem}")
        return
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, problem, group=group)
    bad = [(r, p) for r, p in enumerate(found) if p]
    if bad:
        rank, message = bad[0]
        others = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise ParallelizeError(f"fastdist.parallelize ({what}): rank {rank}{others}: {message}")


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except (ValueError, TypeError, RuntimeError) as e:
        return None, str(e)


def _as_tuple(args: Any) -> tuple:
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)


def _mesh_shape(mesh: Any) -> tuple[tuple[int, int, int] | None, str | None]:
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or ()
        unknown = [n for n in names if n not in MESH_DIMS]
        if unknown or len(names) != mesh.ndim:
            return None, (f"a DeviceMesh needs dimension names among {MESH_DIMS}, got {names or 'none'}")
        sizes = dict(zip(names, mesh.mesh.shape))
        return tuple(int(sizes.get(n, 1)) for n in MESH_DIMS), None
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 3
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in mesh)):
        return None, f"mesh must be (dp, tp, pp), three ints >= 1, or a DeviceMesh; got {mesh!r}"
    return tuple(int(d) for d in mesh), None


_EXPERT_WEIGHTS = ("w1", "b1", "w2", "b2")


def _expert_layers(model: nn.Module) -> dict[str, Any]:
    """The expert weights' names of ``model``'s expert-parallel MoE layers (fastdist.moe, on a group of more than one
    rank), each with its layer: each rank holds other experts under the same names."""
    from fastdist.moe.layer import MoELayer
    return {f"{path}.{w}" if path else w: m for path, m in model.named_modules()
            if isinstance(m, MoELayer) and m.world > 1 for w in _EXPERT_WEIGHTS}


def _model_structure(model: nn.Module) -> dict:
    """Every parameter's and buffer's shape, dtype and content digest, by name: what must be the same on every rank
    (a model built from another seed differs in the digests; expert-parallel experts differ by design)."""
    out = {}
    experts = _expert_layers(model)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        digest = None if t.is_meta or name in experts else tuple(state_digest(t.detach().cpu()).tolist())
        out[name] = (tuple(t.shape), str(t.dtype), digest)
    return out


def _second_batch(args: tuple, seed: int = 1234) -> tuple:
    """Another microbatch like ``args``: integer inputs redrawn within their range, floating ones from a normal."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
        elif a.is_floating_point():
            out.append(torch.randn(a.shape, generator=g, dtype=a.dtype).to(a.device))
        else:
            lo, hi = int(a.min()), int(a.max())
            out.append(torch.randint(lo, hi + 1, a.shape, generator=g, dtype=a.dtype).to(a.device))
    return tuple(out)


# ---- the engine ----

class Engine:
    """The model parallelized over a (dp, tp, pp) mesh; made by :func:`parallelize`.

    Attributes:
        plan: the :class:`~fastdist.parallel.partition.Plan` (``print(engine.plan)`` shows the stages).
        module: this rank's stage module (tensor-parallel layers in it when tp > 1; not DDP-wrapped).
        pipeline_stage: the torch ``PipelineStage`` the schedule drives (with the recompute and compressed-transport
            mixins when asked for); None when one stage trains without a schedule.
        optimizer: the optimizer over this stage's parameters.
        mesh: the DeviceMesh (None on one process without torch.distributed).
        coordinate: this rank's (dp, tp, pp) indices.
        compiled: the modules of the stage whose forward ``compile=`` compiled (empty without it).

    Args:
        **kw: the attributes above and the private state :func:`parallelize` builds (not made by users).
    """

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    # ---- training ----

    def step(self, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        """One optimizer step over all microbatches of this rank's batch.

        Every rank calls it: ``inputs`` (the model's positional arguments, or one tensor) and ``target`` are this
        data-parallel rank's batch, the same on the tensor- and pipeline-parallel ranks of one data-parallel
        index (the first stage reads ``inputs``, the last ``target``).

        Returns:
            The batch's loss (the mean of the microbatches' ``loss_fn``, averaged over the data-parallel ranks), the
            same value on every rank.
        """
        failed = self._watch.failure if self._watch is not None else None
        if failed is not None:
            raise RankFailedError(f"{failed}; this engine cannot step again (its process groups were aborted)",
                                  failed.rank, failed.step, failed.died)
        inputs = _as_tuple(inputs)
        shapes = {"inputs": [(tuple(a.shape), str(a.dtype)) for a in inputs],
                  "target": (tuple(target.shape), str(target.dtype)), "step": self._steps}
        problem = None
        if shapes["inputs"] != self._input_shapes:
            problem = (f"step() got inputs {shapes['inputs']}; parallelize was built for {self._input_shapes} "
                       "(example_inputs: this rank's whole batch, which every step must match)")
        if self._world > 1:  # after it every rank holds the same shapes, so the same problem or none
            check_same("fastdist.parallel Engine.step", shapes)
        if problem:
            raise ValueError(f"fastdist.parallel: {problem}")
        self._steps += 1
        # A rank whose step raises records itself and aborts its process groups; its peers' collectives then fail
        # and raise RankFailedError naming it (fastdist.distributed.failure), as they do for a rank that died.
        with self._watch.guard(self._steps) if self._watch is not None else contextlib.nullcontext():
            self.optimizer.zero_grad(set_to_none=True)
            if self._schedule is None:
                loss = self._plain_step(inputs, target)
            else:
                loss = self._pipeline_step(inputs, target)
            self._sum_tied_grads()
            self.optimizer.step()
            return self._shared_loss(loss)

    def _plain_step(self, inputs, target):
        m = self.plan.microbatches
        if m == 1:  # plain training: nothing between the user's loop and the model
            loss = self.loss_fn(self._runner(*inputs), target)
            loss.backward()
            return loss.detach()
        xs = [a.tensor_split(m) for a in inputs]
        ys = target.tensor_split(m)
        total = None
        for i in range(m):
            sync = self._ddp is None or i == m - 1
            with contextlib.nullcontext() if sync else self._ddp.no_sync():
                out = self._runner(*(x[i] for x in xs))
                loss = self.loss_fn(out, ys[i])
                (loss / m).backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total / m

    def _pipeline_step(self, inputs, target):
        stage = self.pipeline_stage
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if stage.is_last else {}
        if stage.is_first:
            self._schedule.step(*inputs, **kwargs)
        else:
            self._schedule.step(**kwargs)
        if stage.is_last:
            return torch.stack([l.detach().float() for l in losses]).mean()
        return None

    def _sum_tied_grads(self):
        for group, params in self._tied:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)

    def _shared_loss(self, loss):
        if self._world == 1:
            return loss.detach().float()
        dp, tp, pp = self.plan.mesh
        value = torch.zeros((), dtype=torch.float64)
        if loss is not None:
            value += loss.double() / (dp * tp)
        dist.all_reduce(value)
        return value.float()

    # ---- checkpoints ----

    def state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor]:
        """The full model's state dict, keyed and shaped as the user's model (loadable into it unparallelized):
        tensor-parallel shards gathered, every stage's part collected. A collective: every rank calls it.

        Args:
            dst: None: every rank gets the whole dict. A global rank: only that rank does (the others return an
                empty dict); only the ranks of its data-parallel replica take part, each holding at most its own
                stage's tensors gathered over its tensor-parallel group, so no rank but ``dst`` ever holds the
                whole model.

        Raises:
            ValueError: ``dst`` is not a rank of the world (on every rank).
            MismatchError: the ranks passed different ``dst``.
        """
        parts = self._collect("state_dict", dst, self._local_state)
        if parts is None:
            return {}
        merged = {}
        for p in parts:
            for k, v in p.items():
                merged.setdefault(k, v)
        missing = [k for k in self._keys if k not in merged]
        if missing:
            raise RuntimeError(f"fastdist.parallel: no stage holds {missing[:5]}")
        return {k: merged[k] for k in self._keys}

    def _local_state(self) -> dict[str, torch.Tensor]:
        return {name: self._full(name, t).detach().cpu().clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t)
                for name, t in self.module.state_dict().items()}  # not a tensor: a module's extra state

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's ``t`` of parameter ``name`` as the user's unparallelized model holds it: tensor-parallel shards
        gathered over the tp group, an expert-parallel layer's experts over its (data-parallel) group."""
        layout, layer = self._layouts.get(name), self._experts.get(name)
        if layout is not None:
            return self._gather_tp(t, layout)
        if layer is not None:
            parts = [torch.empty_like(t) for _ in range(layer.world)]
            dist.all_gather(parts, t.detach().contiguous(), group=layer.group)
            return torch.cat(parts)
        return t

    def _shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_full`: this rank's part of the whole model's ``full``."""
        layout, layer = self._layouts.get(name), self._experts.get(name)
        if layout is not None:
            return shard_of(full, layout)
        if layer is not None and full.dim() > 0 and full.shape[0] == layer.num_experts:
            return full[layer.first_expert:layer.first_expert + layer.experts_per_rank]
        return full

    def _collect(self, what: str, dst: int | None, local: Callable[[], Any]) -> list[Any] | None:
        """Every pipeline stage's ``local()`` (built with tensor-parallel gathers) on every rank (``dst`` None), or
        on rank ``dst`` only: then only dst's data-parallel replica builds them, and every other rank gets None."""
        if dst is not None and (isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < self._world):
            raise ValueError(f"fastdist.parallel: {what}(dst={dst!r}): dst must be a rank in [0, {self._world})")
        if self._world > 1:
            check_same(f"fastdist.parallel Engine.{what}", {"dst": dst})
        gather = dst is None or self._world == 1
        where = None if gather else tuple(int(i) for i in (self._grid == dst).nonzero()[0])
        if where is not None and where[0] != self.coordinate[0]:  # another data-parallel replica: the same values
            if self._experts:  # but its own experts, which dst's replica gathers from it
                local()
            return None
        mine = local()
        if where is not None and where[1] != self.coordinate[1]:  # dst's tensor-parallel index sends the stage's
            return None
        if self._world == 1 or self.plan.mesh[2] == 1:
            return [mine]
        parts: list[Any] = [None] * self.plan.mesh[2]
        if gather:
            dist.all_gather_object(parts, mine, group=self._groups["pp"])
            return parts
        dist.gather_object(mine, parts if self._rank == dst else None, dst=dst, group=self._groups["pp"])
        return parts if self._rank == dst else None

    def optimizer_state_dict(self, dst: int | None = None) -> dict[str, Any]:
        """The optimizer's state for the whole model, keyed by the model's parameter names, each tensor of a
        parameter's shape gathered to the full parameter's (``{"state": {name: {"exp_avg": ..., "step": ...}},
        "param_groups": [{hyper-parameters..., "params": [names]}]}``), so :meth:`load_optimizer_state_dict` can
        re-shard it to another mesh; :func:`plain_optimizer_state_dict` turns it into the unparallelized model's
        optimizer state. A collective; ``dst`` as in :meth:`state_dict`."""
        parts = self._collect("optimizer_state_dict", dst, self._local_optimizer_state)
        if parts is None:
            return {}
        state, groups = {}, []
        for p in parts:
            for name, entry in p["state"].items():
                state.setdefault(name, entry)
            groups.extend(g for g in p["param_groups"] if g["params"])
        return {"state": state, "param_groups": groups}

    def _named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [(names[id(p)], p) for g in self.optimizer.param_groups for p in g["params"]]

    def _local_optimizer_state(self) -> dict[str, Any]:
        state = {}
        for name, p in self._named_optimizer_params():
            entry = {}
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    v = self._full(name, v) if v.shape == p.shape else v
                    v = v.detach().cpu().clone()
                entry[k] = v
            if entry:
                for alias in self._aliases.get(name, [name]):
                    state[alias] = entry
        names = {id(p): n for n, p in self._named_optimizer_params()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [a for p in g["params"] for a in self._aliases.get(names[id(p)], [names[id(p)]])]}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what :meth:`optimizer_state_dict` returned on any mesh: each rank takes its parameters' entries,
        sliced to its tensor-parallel shards, and their groups' hyper-parameters (load the model's state too).

        Raises:
            KeyError: a parameter of this rank's stage has no group in ``state_dict``.
            ValueError: a state tensor's shape fits neither the parameter nor its full shape.
        """
        named = self._named_optimizer_params()
        index = {id(p): i for i, (_, p) in enumerate(named)}
        saved = state_dict["state"]
        state = {}
        for i, (name, p) in enumerate(named):
            entry = next((saved[a] for a in self._aliases.get(name, [name]) if a in saved), None)
            if entry is None:
                continue
            mine = {}
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):  # copied: the optimizer updates its state in place (step too)
                    if v.dim() > 0:
                        v = self._shard(name, v) if v.shape != p.shape else v
                        if v.shape != p.shape:
                            raise ValueError(f"fastdist.parallel: load_optimizer_state_dict: {name}'s {k!r} has "
                                             f"shape {tuple(v.shape)}, this rank's parameter {tuple(p.shape)}")
                    v = v.to(p.device).clone()
                mine[k] = v
            state[i] = mine
        groups = []
        for g in self.optimizer.param_groups:
            first = next(n for n, p in named if p is g["params"][0]) if g["params"] else None
            aliases = set(self._aliases.get(first, [first]))
            match = next((sg for sg in state_dict["param_groups"] if aliases & set(sg["params"])), None)
            if match is None:
                raise KeyError(f"fastdist.parallel: load_optimizer_state_dict: no parameter group holds {first}")
            groups.append({**{k: v for k, v in match.items() if k != "params"},
                           "params": [index[id(p)] for p in g["params"]]})
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _gather_tp(self, t, layout):
        group, world = self._groups["tp"], self.plan.mesh[1]
        shards = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(shards, t.contiguous(), group=group)
        if layout.cols is not None:
            full = torch.cat(shards, dim=1)
        else:
            rows = [torch.empty_like(layout.rows) for _ in range(world)]
            dist.all_gather(rows, layout.rows, group=group)
            full = torch.empty((t.shape[0] * world, *t.shape[1:]), dtype=t.dtype)
            for r, s in zip(rows, shards):
                full[r] = s
        return full.t() if layout.transposed else full

    def local_state_dict(self) -> dict:
        """This rank's training state besides the model: the optimizer's state (for this rank's stage and shards),
        the step count and the compressed boundaries' state. Save one per rank with :meth:`state_dict`; with
        :meth:`load_local_state_dict` on the same mesh and plan, training resumes exactly."""
        transport = getattr(self.pipeline_stage, "transport_state_dict", None)
        return {"optimizer": self.optimizer.state_dict(), "steps": self._steps, "mesh": self.plan.mesh,
                "split_points": self.plan.split_points, "transport": transport() if transport is not None else None}

    def load_local_state_dict(self, state: Mapping) -> None:
        """Restores what :meth:`local_state_dict` returned on this rank (load the model's first).

        Raises:
            ValueError: the state was saved on another mesh or with other split points (a time-balanced plan is
                profiled anew: build the engine with ``split_points=`` the saved ones).
        """
        saved = (tuple(state["mesh"]), list(state["split_points"]))
        if saved != (tuple(self.plan.mesh), self.plan.split_points):
            raise ValueError(f"fastdist.parallel: load_local_state_dict: saved on mesh {saved[0]} with split points "
                             f"{saved[1]}, this engine has {self.plan.mesh} and {self.plan.split_points}; build it "
                             f"with mesh={saved[0]} and split_points={saved[1]}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._steps = int(state["steps"])
        if state.get("transport") is not None:
            self.pipeline_stage.load_transport_state_dict(state["transport"])

    def save_sharded(self, path: str, optimizer: bool = True) -> None:
        """Saves the model (and optimizer) through ``torch.distributed.checkpoint`` into the directory ``path``: each
        rank writes its own stage's tensors and tensor- or expert-parallel shards, placed in the full model's
        tensors and keyed by its names (``model.<name>``, ``optimizer.state.<name>.<key>``), so that
        :meth:`load_sharded` re-shards them onto any mesh. A collective (:mod:`fastdist.parallel.checkpoint`).

        Args:
            path: the checkpoint directory (shared by the ranks).
            optimizer: also save the optimizer's state and step count.
        """
        from fastdist.parallel.checkpoint import save_sharded
        save_sharded(self, path, optimizer)

    def load_sharded(self, path: str, optimizer: bool = True) -> None:
        """Loads what :meth:`save_sharded` wrote on any mesh: each rank reads the pieces it holds here, in place
        (the step count too). A collective.

        Args:
            path: the directory :meth:`save_sharded` wrote.
            optimizer: also load the optimizer's state and step count.
        """
        from fastdist.parallel.checkpoint import load_sharded
        load_sharded(self, path, optimizer)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Loads a full model's state dict (as :meth:`state_dict` returns, or the unparallelized model's), each
        rank taking its stage's entries and its tensor-parallel slices."""
        own = self.module.state_dict()
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise KeyError(f"fastdist.parallel: load_state_dict: missing {missing[:5]}")
        with torch.no_grad():
            for name, t in own.items():
                if not isinstance(t, torch.Tensor):  # a module's extra state (get_extra_state)
                    self.module.get_submodule(name.rpartition(".")[0]).set_extra_state(state_dict[name])
                    continue
                full = self._shard(name, state_dict[name])
                if tuple(full.shape) != tuple(t.shape):
                    raise ValueError(f"fastdist.parallel: load_state_dict: {name} has shape {tuple(full.shape)}, "
                                     f"this rank expects {tuple(t.shape)}")
                t.copy_(full)


def plain_optimizer_state_dict(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """:meth:`Engine.optimizer_state_dict`'s result as torch's optimizer state dict for ``model`` unparallelized,
    whose optimizer was built over ``model.parameters()`` in one group (the groups are merged: the first's
    hyper-parameters).

    Args:
        state_dict: what :meth:`Engine.optimizer_state_dict` returned (its state keyed by parameter name).
        model: the unparallelized model, with the parameter names the engine's model had.
    """
    names = [n for n, _ in model.named_parameters()]
    saved = state_dict["state"]
    hyper = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
    def copied(entry):  # the optimizer updates its state in place
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    return {"state": {i: copied(saved[n]) for i, n in enumerate(names) if n in saved},
            "param_groups": [{**hyper, "params": list(range(len(names)))}]}


def _make_pipeline_stage(module, runner, index, num_stages, device, group, in_args, out_args, recompute,
                         compress, blocks):
    from torch.distributed.pipelining import PipelineStage
    bases, kwargs = [], {}
    if recompute:
        from fastdist.parallel.recompute import RecomputeStageMixin
        bases.append(RecomputeStageMixin)
        kwargs["blocks"] = blocks
    if compress is not None:
        from fastdist.parallel.transport import CompressedTransportMixin
        bases.append(CompressedTransportMixin)
        kwargs.update(compress)
    cls = type("Stage", (*bases, PipelineStage), {}) if bases else PipelineStage
    return cls(runner, index, num_stages, device, input_args=in_args, output_args=out_args, group=group, **kwargs)


def _compress_options(compress_boundaries: Any) -> dict | None:
    """``compress_boundaries``: None, a compressor (activations; gradients uncompressed), or a dict of the
    transport's options (``fwd``, ``bwd``, ``backward_mask``, ...)."""
    if compress_boundaries is None:
        return None
    if isinstance(compress_boundaries, Mapping):
        return dict(compress_boundaries)
    return {"fwd": compress_boundaries}


def _describe_compress(options: dict | None) -> str | None:
    if options is None:
        return None
    def shown(v):  # a compressor by its configuration (its repr may carry an address)
        return f"{type(v).__name__}({v.config()})" if callable(getattr(v, "config", None)) else repr(v)
    return ", ".join(f"{k}={shown(v)}" for k, v in sorted(options.items()))


def parallelize(model: nn.Module, mesh: tuple[int, int, int] | DeviceMesh = (1, 1, 1),
                example_inputs: Any = None, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, microbatches: int = 1,
                schedule: str = "1f1b", recompute: str | float = "none", recompute_ratio: float = 0.5,
                tp_overlap: int | str = "auto", compress_boundaries: Any = None,
                dp_comm_hook: Any = None, split_points: Sequence[int | str] | None = None, balance: str = "time",
                *, blocks: str | None = None, tp_plan: Mapping[str, str] | None = None,
                compile: bool | Mapping[str, Any] = False, init: Callable[[nn.Module], None] | None = None,
                seed: int = 0, device: torch.device | str | None = None, profile_reps: int = 5) -> Engine:
    """Parallelizes ``model`` over a (data, tensor, pipeline) mesh and returns the :class:`Engine` that trains it.

    Every rank calls it with the same model (same structure and values: seed before building it) and arguments.

    Args:
        model: an unmodified model whose blocks are an ``nn.ModuleList`` (found, or named by ``blocks=``).
        mesh: ``(dp, tp, pp)`` with ``dp * tp * pp`` = the world size (a DeviceMesh of dims named "dp", "tp",
            "pp" over gloo/CPU is made with ``init_device_mesh``), or such a DeviceMesh.
        example_inputs: this rank's batch for one step (the model's positional arguments, or one tensor): the
            shape every step uses.
        loss_fn: ``loss_fn(output, target)``, a mean over the microbatch; ``output`` is the model's output (its
            ``logits`` for a Hugging Face output).
        optimizer: ``optimizer(params)`` -> a torch optimizer, called with this rank's stage's parameters.
        microbatches: microbatches per step; must divide the batch.
        schedule: "1f1b", "gpipe" or "shifted_critical_path" (fastdist.parallel.schedule).
        recompute: "none", "full", "stage_aware" or a ratio for every stage; ``recompute_ratio`` is the first
            stage's under "stage_aware".
        tp_overlap: ``overlap_chunks`` of fastdist.tp's parallel linears ("auto" or an int; 1: no overlap), or
            "oases": each sharded block runs the Oases sub-batch schedule on its own parameters.
        compress_boundaries: None, a fastdist.compress compressor for the activations crossing stage boundaries,
            or a dict of :class:`fastdist.parallel.transport.CompressedTransportMixin` options (``fwd``, ``bwd``,
            ``backward_mask``, ``store``).
        dp_comm_hook: None, ``(state, hook)`` for DDP's ``register_comm_hook``, or a callable taking the
            data-parallel process group and returning ``(state, hook)`` (e.g. ``lambda g: (SketchState(g),
            sketch_hook)``).
        split_points: the first block of every stage after the first (indices or names such as "blocks.4"):
            overrides the balancing.
        balance: "time" (profiled forward+backward per piece, on rank 0) or "params" (taken for a model with
            expert-parallel fastdist.moe layers, whose pieces cannot run on one rank alone).
        blocks: the path of the block list (default: the largest ``nn.ModuleList`` of alike modules).
        tp_plan: ``{"module.path": "colwise" | "rowwise"}`` with ``*`` wildcards, overriding fastdist.tp's
            block detection (needed for blocks it does not recognise, e.g. ``nn.MultiheadAttention``).
        compile: True (or a dict of ``torch.compile`` options, e.g. ``{"backend": "inductor", "mode": ...}``) to
            compile the forward of every block of this rank's stage (its head or embedding modules on a stage
            without blocks) after tensor-parallel sharding; hooks, the cut and the code between the blocks run
            eagerly. Alike blocks share one compiled graph.
        init: for a model built on the meta device (``with torch.device("meta"): model = GPT(...)``), the
            function ``model.apply`` would call to initialize it (default: each module's ``reset_parameters``).
            Each rank allocates only its stage's tensors and gives them the values the whole model gets on one
            process from ``model.to_empty(device=...); torch.manual_seed(seed); model.apply(init)``, which for
            torch's layers built in the order they are registered is the model built normally after
            ``torch.manual_seed(seed)``. Every floating-point parameter and buffer must be set by ``init``
            (one left unset is an error naming it). Such a model is balanced by time with its pieces allocated
            one at a time on rank 0 (by parameters when a piece cannot run alone), and each stage is checked by
            running it rather than against the whole model.
        seed: the seed of that initialization.
        device: where a meta-device model's stages are allocated (default: this rank's CUDA device when CUDA is
            available, else the CPU).
        profile_reps: profiling repetitions.

    Raises:
        ParallelizeError: on every rank, for a configuration that cannot run (the message names the rank and
            the reason).
        MismatchError: on every rank, when ranks hold different models or arguments.
    """
    global _engines_built
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    shape, problem = _mesh_shape(mesh)
    if problem is None and math.prod(shape) != world:
        problem = (f"the mesh (dp, tp, pp) = {shape} has {math.prod(shape)} ranks but the world has {world}"
                   + ("" if distributed else " (torch.distributed is not initialized)"))
    if problem is None and example_inputs is None:
        problem = "example_inputs (this rank's batch for one step) are needed to cut and profile the model"
    if problem is None and loss_fn is None:
        problem = "loss_fn(output, target) is needed"
    if problem is None and optimizer is None:
        problem = "optimizer (a callable taking the parameters) is needed"
    if problem is None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                            or microbatches < 1):
        problem = f"microbatches must be an int >= 1, got {microbatches!r}"
    example = _as_tuple(example_inputs) if example_inputs is not None else ()
    if problem is None and (not example or not all(isinstance(a, torch.Tensor) for a in example)):
        problem = "example_inputs must be a tensor or a tuple of tensors"
    if problem is None and any(a.dim() == 0 or a.shape[0] % microbatches for a in example):
        problem = (f"the batch ({[tuple(a.shape) for a in example]}) does not split into {microbatches} "
                   "equal microbatches along dimension 0")
    if problem is None and balance not in part.BALANCES:
        problem = f"balance must be one of {part.BALANCES}, got {balance!r}"
    if problem is None:
        _, problem = _attempt(lambda: _recompute_ratio(recompute, recompute_ratio, 0, shape[2], schedule))
    if problem is None and schedule not in _schedule_names():
        problem = f"schedule must be one of {sorted(_schedule_names())}, got {schedule!r}"
    if problem is None and shape[2] > 1 and schedule != "gpipe" and microbatches < shape[2]:
        problem = (f"schedule {schedule!r} needs at least as many microbatches as stages ({shape[2]}), got "
                   f"{microbatches}")
    on_meta, meta_problem = _attempt(lambda: part.is_meta(model))
    problem = problem or meta_problem
    if problem is None and not on_meta and init is not None:
        problem = "init= initializes a model built on the meta device; this model's tensors are already allocated"
    if problem is None and not isinstance(compile, (bool, Mapping)):
        problem = f"compile must be a bool or a dict of torch.compile options, got {compile!r}"
    if problem is None and shape[2] == 1 and (recompute != "none" or compress_boundaries is not None):
        problem = ("recompute and compress_boundaries act on pipeline stages: they need pp > 1 (recompute on one "
                   "stage is not supported yet)")
    _agree("arguments", problem, None)
    dp, tp, pp = shape
    compress = _compress_options(compress_boundaries)
    if distributed and world > 1:
        check_same("fastdist.parallelize arguments", {
            "mesh": shape, "microbatches": microbatches, "schedule": schedule, "recompute": str(recompute),
            "recompute_ratio": float(recompute_ratio), "tp_overlap": str(tp_overlap), "balance": balance,
            "split_points": None if split_points is None else [str(p) for p in split_points], "blocks": blocks,
            "tp_plan": None if tp_plan is None else dict(tp_plan), "compress": _describe_compress(compress),
            "compile": compile if isinstance(compile, bool) else {k: repr(v) for k, v in sorted(compile.items())},
            "engines built before": _engines_built, "meta": on_meta, "seed": seed,
            "init": None if init is None else getattr(init, "__qualname__", repr(init)),
            "example_inputs": [(tuple(a.shape), str(a.dtype)) for a in example]})
        check_same("fastdist.parallelize model", _model_structure(model))

    requested, device = device, next((p.device for p in model.parameters()), torch.device("cpu"))
    if on_meta:
        device = torch.device(requested) if requested is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if distributed and world > 1:
        mesh_obj = mesh if isinstance(mesh, DeviceMesh) else init_device_mesh(device.type, shape,
                                                                                mesh_dim_names=MESH_DIMS)
        groups = {n: (mesh_obj.get_group(n) if n in (mesh_obj.mesh_dim_names or ()) else None) for n in MESH_DIMS}
        names = list(mesh_obj.mesh_dim_names)
        coord_list = mesh_obj.get_coordinate()
        coordinate = tuple(coord_list[names.index(n)] if n in names else 0 for n in MESH_DIMS)
        # global ranks indexed [dp, tp, pp], whatever the order (and presence) of the DeviceMesh's dimensions
        grid = mesh_obj.mesh.permute(*[names.index(n) for n in MESH_DIMS if n in names])
        grid = grid.reshape(dp, tp, pp)
    else:
        mesh_obj, groups, coordinate, grid = None, {n: None for n in MESH_DIMS}, (0, 0, 0), None
    dp_i, tp_i, pp_i = coordinate

    # ---- cut: analyse on every rank (cheap), profile on rank 0, plan everywhere from rank 0's numbers ----
    model_experts = _expert_layers(model)
    micro = tuple(a.tensor_split(microbatches)[0] for a in example)
    analysis, problem = _attempt(lambda: part.analyze(model, tuple(a.to("meta") for a in micro) if on_meta else micro,
                                                      blocks))
    if problem is None and on_meta:  # the stages' own code runs on the real batch
        analysis.example_args = tuple(a.detach() for a in micro)
    if problem is None and pp > analysis.num_blocks:
        problem = (f"{pp} pipeline stages but {type(model).__name__} has only {analysis.num_blocks} blocks in "
                   f"{analysis.blocks_path}: use at most {analysis.num_blocks} stages")
    if problem is None and model_experts:
        dp_ranks = sorted(int(r) for r in grid[:, tp_i, pp_i]) if grid is not None else [0]
        wrong = sorted({name.rpartition(".")[0] for name, layer in model_experts.items()
                        if sorted(layer._group_ranks(layer.group)) != dp_ranks})
        if wrong:
            problem = (f"the MoE layers {wrong[:3]} are expert parallel over another group than this rank's data-"
                       f"parallel ranks {dp_ranks}: build them with group=mesh.get_group('dp') of the DeviceMesh "
                       "passed as mesh=")
    _agree("cutting the model", problem, None)
    costs = None
    if model_experts and balance == "time":  # its pieces all-to-all over the dp group: none can be timed alone
        balance = "params"
    if balance == "time" and split_points is None and pp > 1:
        if dist.get_rank() == 0 or world == 1:
            if on_meta:  # one piece allocated at a time; a piece that cannot run alone: balance by parameters
                try:
                    costs = part.profile_meta_pieces(analysis, device, reps=profile_reps)
                except Exception:  # noqa: BLE001 - any failure of a piece alone: the other ranks wait for the broadcast
                    costs = None
            else:
                costs = part.profile_pieces(analysis, reps=profile_reps)
        if world > 1:
            box = [costs]
            dist.broadcast_object_list(box, src=0)
            costs = box[0]
        if costs is None:
            balance = "params"
    if costs is None:
        costs = part.param_costs(analysis)
    ratios = [_recompute_ratio(recompute, recompute_ratio, s, pp, schedule) for s in range(pp)]
    plan, problem = _attempt(lambda: part.make_plan(
        analysis, costs, pp, balance, split_points, ratios, empty_ends=recompute == "none", mesh=shape,
        schedule=schedule if pp > 1 else "none",
        microbatches=microbatches, recompute=str(recompute), boundaries=_describe_compress(compress)))
    _agree("planning the stages", problem, None)
    if distributed and world > 1:
        check_same("fastdist.parallelize plan", plan)
    mine = plan.stages[pp_i]

    # ---- this rank's stage, checked against the whole model on a second batch ----
    keys = list(model.state_dict().keys())
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    aliases_of = {n: names for names in aliases.values() for n in names}
    stage, problem = _attempt(lambda: part.build_stage(analysis, mine.first_block, mine.last_block, pp_i, pp))
    if problem is None and on_meta:
        unset, problem = _attempt(lambda: part.materialize_stage(model, stage, init, seed, device))
        if unset:
            problem = (f"init left {unset[:8]} of stage {pp_i} unset (a model built on the meta device gets every "
                       "value from init: pass init= a function that sets them, as model.apply would call it)")
        problem = problem or part.probe_stage(stage, analysis, device)
    elif problem is None:
        second = _second_batch(micro)
        problem = part.check_stage(analysis, stage, part.cut_activations(analysis, second), second)
    if problem:
        problem += (f". Cut elsewhere with split_points=[...] (block indices of {analysis.blocks_path}), or name "
                    "another block list with blocks=")
    _agree("checking the stages", problem, None)

    # ---- tied parameters: held by several stages, their gradients summed ----
    tied = []
    if pp > 1:
        canonical = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(p), name)
        by_id = {id(p): canonical[id(p)] for _, p in model.named_parameters(remove_duplicate=False)}
        names_of = dict(model.named_parameters(remove_duplicate=False))
        held = {by_id[id(names_of[n])]: p for n, p in stage.named_parameters() if n in names_of}
        everyone: list[Any] = [None] * pp
        dist.all_gather_object(everyone, sorted(held), group=groups["pp"])
        holders: dict[str, tuple[int, ...]] = {}
        for s, names in enumerate(everyone):
            for n in names:
                holders[n] = holders.get(n, ()) + (s,)
        shared = {n: h for n, h in holders.items() if len(h) > 1}
        for h in sorted(set(shared.values())):
            for d in range(dp):
                for t in range(tp):
                    ranks = [int(grid[d, t, s]) for s in h]
                    g = dist.new_group(ranks)
                    if (d, t) == (dp_i, tp_i) and pp_i in h:
                        tied.append((g, [held[n] for n in sorted(shared) if shared[n] == h]))

    # ---- tensor parallel, data parallel, pipeline ----
    layouts = {}
    if tp > 1:
        expanded = expand_tp_plan(stage, tp_plan)
        _agree("the tensor-parallel plan", None if expanded is None or expanded else
               f"tp_plan {dict(tp_plan)} names no nn.Linear (or Conv1D) of stage {pp_i}: its layers would stay "
               "replicated on the tensor-parallel ranks", None)
        layouts = shard_stage(stage, groups["tp"], expanded, tp_overlap)
    compiled = _compile_blocks(stage.pipeline_blocks, compile)
    runner: nn.Module = stage
    ddp = None
    experts = _expert_layers(stage)
    if dp > 1:
        if experts:  # DDP for the replicated weights; each MoE layer averages its own experts over dp
            from fastdist.moe import data_parallel
            ddp = runner = data_parallel(stage, process_group=groups["dp"])
        else:
            ddp = runner = DistributedDataParallel(stage, process_group=groups["dp"])
        if dp_comm_hook is not None:
            hook = dp_comm_hook(groups["dp"]) if callable(dp_comm_hook) else dp_comm_hook
            ddp.register_comm_hook(*hook)
    opt = optimizer(runner.parameters())
    pipe_stage, sched = None, None
    if pp > 1:
        from fastdist.parallel.schedule import build_schedule
        cuts = analysis.cut_shapes
        in_args = micro if pp_i == 0 else (torch.empty(cuts[mine.first_block][0], dtype=cuts[mine.first_block][1],
                                                       device=device, requires_grad=True),)
        out_shape = analysis.output_shape if pp_i == pp - 1 else cuts[mine.last_block]
        out_args = (torch.empty(out_shape[0], dtype=out_shape[1], device=device,
                                requires_grad=out_shape[1].is_floating_point),)
        pipe_stage = _make_pipeline_stage(stage, runner, pp_i, pp, device, groups["pp"], in_args, out_args,
                                          recompute != "none", compress, stage.pipeline_blocks)
        sched = build_schedule(schedule, pipe_stage, microbatches, loss_fn, recompute=recompute,
                               recompute_ratio=recompute_ratio)
    _engines_built += 1

    def where(rank: int) -> str:
        return f" (mesh coordinate (dp, tp, pp) = {tuple(int(i) for i in (grid == rank).nonzero()[0])})"
    watch = FailureWatch("fastdist.parallel", where) if distributed and world > 1 else None
    return Engine(plan=plan, module=stage, optimizer=opt, mesh=mesh_obj, coordinate=coordinate, loss_fn=loss_fn,
                  _runner=runner, _ddp=ddp, _schedule=sched, pipeline_stage=pipe_stage, _tied=tied, _layouts=layouts,
                  compiled=compiled, _groups=groups, _world=world, _keys=keys, _steps=0, _watch=watch,
                  _aliases=aliases_of, _grid=grid, _experts=experts,
                  _rank=dist.get_rank() if distributed else 0,
                  _input_shapes=[(tuple(a.shape), str(a.dtype)) for a in example])


def _compile_blocks(modules: Sequence[nn.Module], options: bool | Mapping[str, Any]) -> list[nn.Module]:
    """Compiles each module's ``forward`` in place (its hooks stay eager: the stage's cut, recompute's hooks);
    returns the modules compiled."""
    if options is False:
        return []
    kwargs = {} if options is True else dict(options)
    for m in modules:
        m.forward = torch.compile(m.forward, **kwargs)
    return list(modules)


def _schedule_names() -> tuple[str, ...]:
    from fastdist.parallel.schedule import SCHEDULES
    return tuple(SCHEDULES)


def _recompute_ratio(recompute: Any, r0: float, stage: int, stages: int, schedule: str) -> float:
    from fastdist.parallel.schedule import resolve_recompute
    return resolve_recompute(recompute, r0, stage, stages, schedule)
