"""Partial activation recompute inside a torch `PipelineStage`: `RecomputeStageMixin` and `make_stage`.

What a ratio means. A stage's module runs its blocks in order (a transformer stage: an optional embedding, its
run of blocks, an optional norm and head). At ratio r the stage checkpoints the first k = ceil(r * L) of its L
blocks, together with everything its forward runs before them: that head of the stage runs without keeping
activations (only the stage's input is kept) and is recomputed, from the input, before its backward. This is
Merak's meaning, a ratio of the stage's layers, not of its microbatches: recomputing a share of every
microbatch keeps every backward equally long, which 1F1B's steady state needs, and shrinks each stashed
microbatch, which is what stage-aware recompute trades against the number of microbatches a stage stashes.

How. The head's last block gets a forward hook. In the forward the stage module runs with autograd off until
that hook, which turns it back on and passes the block's output through `_Checkpoint`, an identity whose
backward backpropagates through the recomputed head (a reentrant backward, as torch's reentrant checkpoint does).
`recompute_chunk(i)` reruns the head on microbatch i's kept inputs under the RNG state of its forward (so
dropout draws the same mask) and stops at the hook; a schedule may call it early (the shifted critical path
does, before the gradient arrives), else the backward does it on first need. Only the forward/backward of one
chunk and the stage's clean-up are overridden, each calling super(), so the mixin composes with other
`PipelineStage` mixins (P2P transports).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

__all__ = ["RecomputeStage", "RecomputeStageMixin", "SavedActivationMeter", "find_blocks", "make_stage"]

_BLOCK_ATTRIBUTES = ("blocks", "layers", "h")


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks a stage module runs in order: its `blocks`, `layers` or `h` ModuleList, the children of an
    `nn.Sequential`, or else the whole module as one block.

    Args:
        module: The stage's module (a DDP wrapper is looked through).

    Returns:
        The blocks, first to last.
    """
    if isinstance(module, DistributedDataParallel):
        module = module.module
    for name in _BLOCK_ATTRIBUTES:
        blocks = getattr(module, name, None)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
            return list(blocks)
    if isinstance(module, nn.Sequential) and len(module) > 0:
        return list(module)
    return [module]


class _StopRecompute(Exception):
    """Raised by the head's last block during a recompute: the rest of the stage is not needed."""


class _Checkpoint(torch.autograd.Function):
    """Identity on the head's output `h` (computed without autograd); its backward runs the head's backward on the
    recomputed graph and hands back the gradients of the stage's inputs `xs`."""

    @staticmethod
    def forward(ctx: Any, stage: RecomputeStageMixin, mb: int, h: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        ctx.stage, ctx.mb = stage, mb
        ctx.save_for_backward(*xs)  # the kept inputs, so autograd-level memory meters count them
        ctx.mark_dirty(h)  # h itself, no copy; as an output marked dirty (not a view) it may be modified in place
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        stage, mb = ctx.stage, ctx.mb
        h, xs = stage._recomputed.pop(mb, None) or stage._run_head(mb)
        stage._kept.pop(mb, None)
        with torch.enable_grad():
            torch.autograd.backward(h, grad)
        return (None, None, None, *(x.grad for x in xs))


def _detach_like(value: Any) -> Any:
    """`value` with each floating tensor detached (keeping requires_grad), for the head's rerun."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_detach_like(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach_like(v) for k, v in value.items()}
    return value


def _grad_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` that require a gradient, in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _grad_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _grad_leaves(v)]
    return []


class RecomputeStageMixin:
    """Recompute the first ceil(ratio * L) of a stage's L blocks (and what runs before them) in the backward.

    Mix in before torch's `PipelineStage` (and any transport mixin): `class S(RecomputeStageMixin,
    PipelineStage)`. Keyword arguments `recompute_ratio` (default 0) and `blocks` (default `find_blocks(submod)`)
    are taken from the constructor's; the ratio can change between steps with `set_recompute_ratio`.
    """

    def __init__(self, *args: Any, recompute_ratio: float = 0.0, blocks: Sequence[nn.Module] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        inner = self.submod.module if isinstance(self.submod, DistributedDataParallel) else self.submod
        self._blocks = list(blocks) if blocks is not None else find_blocks(inner)
        if not self._blocks:
            raise ValueError(f"stage {self.stage_index}: recompute needs at least one block")
        self._inner = inner
        self._head_end: nn.Module | None = None
        self._mode: str | None = None          # "forward" or "recompute" while the head's hooks act
        self._mb = -1                          # the microbatch the hooks act on
        self._grad_mode = True                 # autograd's state before the forward turned it off
        self._kept: dict[int, tuple] = {}      # mb -> (args, kwargs, rng states): what the head reruns from
        self._recomputed: dict[int, tuple] = {}  # mb -> (head output, inputs) recomputed ahead of the backward
        self._head_out: torch.Tensor | None = None
        self._hooks = [inner.register_forward_pre_hook(self._on_stage_start, with_kwargs=True)]
        self.recompute_ratio = 0.0
        self.set_recompute_ratio(recompute_ratio)

    # ---- configuration ----

    @property
    def recompute_blocks(self) -> int:
        """How many of the stage's blocks are checkpointed (ceil(ratio * L))."""
        return math.ceil(self.recompute_ratio * len(self._blocks) - 1e-9)

    def set_recompute_ratio(self, ratio: float) -> None:
        """Checkpoint the first ceil(`ratio` * L) blocks from the next step on.

        Args:
            ratio: In [0, 1]; 0 turns recompute off.
        """
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0 \
                or math.isnan(ratio):
            raise ValueError(f"stage {self.stage_index}: recompute ratio must be in [0, 1], got {ratio!r}")
        if self._kept or self._recomputed:
            raise RuntimeError(f"stage {self.stage_index}: the recompute ratio cannot change within a step")
        self.recompute_ratio = float(ratio)
        if len(self._hooks) > 1:
            self._hooks.pop().remove()
        k = self.recompute_blocks
        self._head_end = self._blocks[k - 1] if k > 0 else None
        if self._head_end is not None:
            self._hooks.append(self._head_end.register_forward_hook(self._on_head_end))

    # ---- hooks ----

    def _on_stage_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._mode != "forward" or self._head_end is None:
            return
        devices = [self.device] if torch.device(self.device).type == "cuda" else []
        rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])
        self._kept[self._mb] = (args, kwargs, rng)
        self._grad_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(False)

    def _on_head_end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._mode == "recompute":
            self._head_out = output
            raise _StopRecompute
        if self._mode != "forward":
            return None
        torch.set_grad_enabled(self._grad_mode)
        if not self._grad_mode:
            return None
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"stage {self.stage_index}: recompute needs the checkpointed block "
                            f"{type(module).__name__} to return one tensor, got {type(output).__name__}")
        args, kwargs, _ = self._kept[self._mb]
        xs = _grad_leaves((args, kwargs)) or [torch.empty(0, requires_grad=True)]
        return _Checkpoint.apply(self, self._mb, output, *xs)

    # ---- recompute ----

    def _run_head(self, mb: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rerun the stage's head on microbatch `mb`'s kept inputs: (head output with its graph, the inputs it
        takes gradients for, in the order `_Checkpoint` got them)."""
        args, kwargs, (cpu_rng, cuda_rng) = self._kept[mb]
        args, kwargs = _detach_like(args), _detach_like(kwargs)
        xs = _grad_leaves((args, kwargs)) or [torch.empty(0, requires_grad=True)]
        devices = [self.device] if cuda_rng else []
        self._mode, self._head_out = "recompute", None
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                torch.set_rng_state(cpu_rng)
                for d, state in zip(devices, cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                self._inner(*args, **kwargs)
        except _StopRecompute:
            pass
        finally:
            self._mode = None
        h, self._head_out = self._head_out, None
        if h is None:
            raise RuntimeError(f"stage {self.stage_index}: the recompute never reached block "
                               f"{type(self._head_end).__name__}: does the stage's forward run `blocks` in order?")
        return h, xs

    def recompute_chunk(self, mb: int) -> None:
        """Recompute microbatch `mb`'s checkpointed activations now, ahead of its backward (a no-op when the stage
        does not recompute, or has no backward).

        Args:
            mb: The microbatch, forwarded and not yet backwarded this step.
        """
        if mb in self._kept and mb not in self._recomputed and self.has_backward:
            self._recomputed[mb] = self._run_head(mb)

    # ---- PipelineStage overrides ----

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        if self._head_end is None or not self.has_backward or not torch.is_grad_enabled():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._mode, self._mb = "forward", fwd_chunk_id
        grad_mode = torch.is_grad_enabled()
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self._mode = None
            torch.set_grad_enabled(grad_mode)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: torch.Tensor | None = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        try:
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
        finally:
            self._kept.pop(bwd_chunk_id, None)
            self._recomputed.pop(bwd_chunk_id, None)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._kept.clear()
        self._recomputed.clear()


class RecomputeStage(RecomputeStageMixin, PipelineStage):
    """A torch `PipelineStage` with `RecomputeStageMixin`."""


def make_stage(submod: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
               group: dist.ProcessGroup | None = None, recompute_ratio: float = 0.0,
               blocks: Sequence[nn.Module] | None = None, **stage_kwargs: Any) -> RecomputeStage:
    """A pipeline stage over `submod` that recomputes the first ceil(recompute_ratio * L) of its blocks.

    Args:
        submod: The stage's module: forward takes the previous stage's output (the first stage: the batch's
            inputs) and returns one tensor.
        stage_index: This stage (0-based).
        num_stages: Pipeline stages.
        device: The stage's device.
        group: The pipeline's process group (None: the default group).
        recompute_ratio: In [0, 1]; schedules from `build_schedule` set it from their `recompute=`.
        blocks: The blocks the forward runs in order (default: `find_blocks(submod)`).
        **stage_kwargs: Passed on to `PipelineStage` (`input_args`, `output_args`, ...).

    Returns:
        The stage.
    """
    return RecomputeStage(submod, stage_index, num_stages, torch.device(device), group=group,
                          recompute_ratio=recompute_ratio, blocks=blocks, **stage_kwargs)


class SavedActivationMeter:
    """Peak bytes of activations autograd keeps for the backward, while the meter is entered.

    Counts every tensor saved for backward (`torch.autograd.graph.saved_tensors_hooks`) from when it is saved
    until autograd lets it go (its backward ran, or its graph was freed), each storage once, the given
    parameters' storages never. What a stage keeps for recompute is saved through autograd too (the kept inputs
    by `_Checkpoint`, torch's checkpoint its inputs likewise), so recompute schemes are measured alike. Tensors
    kept outside autograd (a pipeline's receive buffers, outputs not yet sent) are not counted.

    Args:
        exclude: Tensors never counted (the stage's parameters and buffers).
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list] = {}  # storage pointer -> [holders alive, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0 or t.device.type == "meta":
            return t
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.current

    def __enter__(self) -> SavedActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor as the meter hands it to autograd; its death is the tensor's release."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
