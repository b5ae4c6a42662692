"""Data parallelism around MoE layers: DDP averages the replicated weights, the layers average their experts.

An expert-parallel MoELayer holds each expert on one rank of its group, and that expert's gradient already sums every
rank's tokens (the all-to-all brought them there). All-reducing it as DDP does would mix different experts, and
leaving it alone gives a gradient ``world`` times the averaged one. `data_parallel` wraps the model in DDP with the
expert weights left out, and has each layer, at the end of backward, sum its expert gradients over the ranks that
hold the same experts (the other expert-parallel groups, when data parallelism spans several) and divide by the
data-parallel size: every parameter then gets the gradient of the loss averaged over the ranks, as with one process
training on the whole batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.moe.layer import MoELayer, ExpertGradientAveraging
from fastdist.distributed import check_same, fingerprint

__all__ = ["aux_loss", "data_parallel", "expert_parameters", "non_expert_parameters"]

_EXPERT_WEIGHTS = ("w1", "b1", "w2", "b2")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights (``w1, b1, w2, b2``) of every MoELayer in ``model``, in module order.

    Args:
        model: any module (a DDP-wrapped one too).
    """
    return [getattr(m, name) for m in model.modules() if isinstance(m, MoELayer) for name in _EXPERT_WEIGHTS]


def non_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``model`` that :func:`expert_parameters` does not list (gates included), in order.

    Args:
        model: any module (a DDP-wrapped one too).
    """
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the load-balancing losses of the MoE layers of ``model`` from their last forward (add it to the
    loss).

    Args:
        model: any module (a DDP-wrapped one too).
    """
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoELayer) and m.aux_loss is not None]
    return sum(losses) if losses else torch.zeros(())


def _replica_groups(layers, group, world):
    """Per layer, the data-parallel ranks that hold the same experts as this rank (None: this rank alone).

    One object all-gather of every layer's expert-parallel ranks; every rank then derives the same partition.
    """
    mine = [list(layer._group_ranks(layer.group)) for layer in layers]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    ranks = sorted(dist.get_global_rank(group, i) if group is not None else i for i in range(world))
    if any(len(e) != len(mine) for e in everyone):
        raise ValueError(f"fastdist: data_parallel: the ranks' models have different numbers of expert-parallel "
                         f"MoE layers ({[len(e) for e in everyone]})")
    made = {}
    replicas_per_layer = []
    for i, layer in enumerate(layers):
        blocks = sorted({tuple(e[i]) for e in everyone})
        if sorted(r for b in blocks for r in b) != ranks or len({len(b) for b in blocks}) != 1:
            raise ValueError(f"fastdist: data_parallel: the expert-parallel groups of MoE layer {i} ({blocks}) do "
                             f"not split the data-parallel ranks {ranks} into equal groups")
        replicas = tuple(b[layer.rank] for b in blocks)
        if len(replicas) > 1 and replicas not in made:
            made[replicas] = dist.new_group(list(replicas), use_local_synchronization=True)
        replicas_per_layer.append(made.get(replicas))
    return replicas_per_layer


_PER_RANK_DDP_OPTIONS = ("device_ids", "output_device", "gradient_as_bucket_view")  # local choices


def _comparable(value):
    try:
        fingerprint(value)
        return value
    except TypeError:
        return repr(value)


def data_parallel(model: nn.Module, process_group: dist.ProcessGroup | None = None,
                  **ddp_options: object) -> DistributedDataParallel:
    """``model`` wrapped for data-parallel training: DDP for every weight but the experts of its expert-parallel
    MoE layers, whose gradients the layers average themselves (module docstring).

    Every rank of ``process_group`` calls it (a collective); each feeds its own part of the global batch, and after
    ``loss.backward()`` every parameter's gradient is that of the loss averaged over the ranks. The expert-parallel
    groups of each layer must split ``process_group`` into equal parts (the whole of it, or several data-parallel
    copies of it). Expert gradients are reduced at the end of every backward, also inside DDP's ``no_sync()``
    (accumulation stays correct; it only communicates more). MoE layers on a group of one rank are plain replicated
    weights: DDP averages them.

    Args:
        model: the model, with its MoE layers constructed on every rank.
        process_group: the data-parallel group (None: the default group).
        **ddp_options: passed to DistributedDataParallel (device_ids, bucket_cap_mb, ...).

    Returns:
        The DistributedDataParallel module; ``.module`` is ``model``.

    Raises:
        RuntimeError: no process group is initialized.
        ValueError: the layers' expert-parallel groups do not split the data-parallel group evenly.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fastdist: data_parallel needs an initialized torch.distributed process group")
    # DDP's options decide its collectives (e.g. find_unused_parameters adds one per step): the same on every rank.
    # Devices differ per rank by design; an option fingerprint cannot take is compared by its repr.
    check_same("data_parallel DDP options", {k: _comparable(v) for k, v in ddp_options.items()
                                             if k not in _PER_RANK_DDP_OPTIONS}, process_group)
    world = dist.get_world_size(process_group)
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer) and m.world > 1]
    for (_, layer), replicas in zip(named, _replica_groups([m for _, m in named], process_group, world)):
        layer._averaging = ExpertGradientAveraging(divisor=world, group=replicas)
    # DDP has no public argument for weights it must neither broadcast nor all-reduce; this is its own mechanism.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, [f"{name}.{w}" if name else w for name, _ in named for w in _EXPERT_WEIGHTS])
    return DistributedDataParallel(model, process_group=process_group, **ddp_options)
