"""Adapters on a model: install (``add_adapters``), save and load only the adapters, merge them into the base."""
import os
from collections.abc import Sequence

import torch
from torch import nn

from fastdist.adapters.methods import METHODS, Adapter
from fastdist.adapters.quant import QuantLinear, replace_submodule
from fastdist.ops.quant4 import quantize4

__all__ = ["AdaptedLinear", "add_adapters", "adapter_parameters", "adapter_state_dict", "load_adapters", "merge",
           "save_adapters"]


class AdaptedLinear(nn.Module):
    """A frozen base (:class:`QuantLinear` or ``nn.Linear``) plus a trainable adapter: ``base(x) + adapter(x)``.

    Args:
        base: the layer to adapt; its parameters are frozen here.
        adapter: the adapter, built for ``base``'s shape.
    """

    def __init__(self, base: nn.Module, adapter: Adapter) -> None:
        super().__init__()
        self.base, self.adapter = base, adapter
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def in_features(self) -> int:
        """The base layer's input features."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base layer's output features."""
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x) + adapter(x)``, in the base output's dtype.

        Args:
            x: the input ``[..., in_features]``.

        Returns:
            The output ``[..., out_features]``.
        """
        return self.adapter.add_to(self.base(x), x)


def _matches(name: str, targets: Sequence[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def add_adapters(model: nn.Module, method: "str | type[Adapter]", r: int | None = None,
                 target_modules: Sequence[str] = ("q_proj", "v_proj"), **options: object) -> nn.Module:
    """Wraps every targeted linear layer of ``model`` (in place) with an adapter; everything else is frozen.

    Args:
        model: a model whose targeted layers are :class:`QuantLinear` or ``nn.Linear``.
        method: ``"lora"``, ``"qalora"``, ``"qbara"`` or ``"qahira"`` (or the class: ``LoRA``, ``QALoRA``, ...).
        r: the parameter budget as a LoRA rank (unused by ``"qahira"``, whose size is fixed by the layer).
        target_modules: layer names (or name suffixes after a dot), as PEFT's ``target_modules``.
        **options: passed to the adapter (``alpha``; ``group`` for ``"qalora"``, default the layer's quantization
            block).

    Returns:
        ``model``, whose only trainable parameters are the adapters'.

    Raises:
        ValueError: unknown method, no layer matched, a matched layer that is not linear, or a layer shape the
            pooling does not divide (named in the message).
    """
    if isinstance(method, type) and issubclass(method, Adapter):
        method = method.method
    if method not in METHODS:
        raise ValueError(f"add_adapters: method must be one of {sorted(METHODS)}, got {method!r}")
    if method != "qahira" and (r is None or r < 1):
        raise ValueError(f"add_adapters: method {method!r} needs a rank r >= 1, got {r}")
    if getattr(model, "_fastdist_merged", False):
        raise ValueError("add_adapters: this model's adapters were merged already")
    targets = [(name, m) for name, m in model.named_modules() if _matches(name, target_modules)
               and not isinstance(m, AdaptedLinear) and ".adapter" not in name and ".base" not in name]
    if not targets:
        raise ValueError(f"add_adapters: no layer of the model matches target_modules = {list(target_modules)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, base in targets:
        if not isinstance(base, (QuantLinear, nn.Linear)):
            raise ValueError(f"add_adapters: layer '{name}' is a {type(base).__name__}, not a linear layer")
        kwargs = dict(options)
        if method == "qalora":
            kwargs.setdefault("group", getattr(base, "block", 64))
        adapter = METHODS[method](base.in_features, base.out_features, r=r, name=name, **kwargs)
        device = base.packed.device if isinstance(base, QuantLinear) else base.weight.device
        replace_submodule(model, name, AdaptedLinear(base, adapter.to(device)))
    return model


def _adapted(model: nn.Module) -> list[tuple[str, AdaptedLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AdaptedLinear)]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (the trainable ones).

    Args:
        model: a model with adapters installed by :func:`add_adapters`.

    Returns:
        The parameters of every adapter of ``model``, to hand to the optimizer.
    """
    return [p for _, m in _adapted(model) for p in m.adapter.parameters()]


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors, keyed by their path in ``model`` (as PEFT's ``get_peft_model_state_dict``)."""
    return {f"{name}.adapter.{k}": v.detach().clone() for name, m in _adapted(model)
            for k, v in m.adapter.state_dict().items()}


def save_adapters(model: nn.Module, path: str | os.PathLike) -> None:
    """Writes the adapters' weights and configurations (not the base) to ``path``.

    Args:
        model: a model with adapters installed by :func:`add_adapters`.
        path: the file to write (``torch.save`` format), read back by :func:`load_adapters`.
    """
    configs = {name: {**m.adapter.config(), "shape": [m.out_features, m.in_features]} for name, m in _adapted(model)}
    torch.save({"configs": configs, "state": adapter_state_dict(model)}, path)


def load_adapters(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Loads adapters written by :func:`save_adapters` into ``model``: installs them where ``model`` has none yet,
    then copies the weights.

    Args:
        model: the model the adapters were made for (its base, quantized or not); adapters it has already must
            match the saved ones' methods.
        path: a file written by :func:`save_adapters`.

    Returns:
        ``model``, with the saved adapters' weights.

    Raises:
        ValueError: a saved layer missing from ``model``, or with another shape or method (named in the message).
    """
    saved = torch.load(path, map_location="cpu", weights_only=True)
    adapted = dict(_adapted(model))
    modules = dict(model.named_modules())
    for name, config in saved["configs"].items():
        if name not in modules:
            raise ValueError(f"load_adapters: the saved adapter of layer '{name}' has no such layer in the model")
        layer = modules[name]
        shape = [layer.out_features, layer.in_features]
        if shape != config["shape"]:
            raise ValueError(f"load_adapters: layer '{name}' has shape {shape}, the saved adapter was made for "
                             f"{config['shape']}")
        options = {k: v for k, v in config.items() if k not in ("method", "shape")}
        if name in adapted:
            if adapted[name].adapter.method != config["method"]:
                raise ValueError(f"load_adapters: layer '{name}' has a {adapted[name].adapter.method} adapter, the "
                                 f"saved one is {config['method']}")
        else:
            add_adapters(model, config["method"], options.pop("r", None), [name], **options)
    state = saved["state"]
    for name, m in _adapted(model):
        own = m.adapter.state_dict()
        for key, value in own.items():
            full = f"{name}.adapter.{key}"
            if full not in state:
                raise ValueError(f"load_adapters: no saved tensor for '{full}'")
            if state[full].shape != value.shape:
                raise ValueError(f"load_adapters: '{full}' has shape {list(value.shape)} in the model, "
                                 f"{list(state[full].shape)} saved")
        m.adapter.load_state_dict({k: state[f"{name}.adapter.{k}"] for k in own})
    return model


def _merge_layer(m: AdaptedLinear) -> tuple[nn.Module, dict]:
    base, adapter = m.base, m.adapter
    with torch.no_grad():
        delta = adapter.delta_weight()
        if isinstance(base, nn.Linear):
            base.weight += delta.to(base.weight.dtype)
            return base, {"into": "float weight"}
        exact = (base.scheme == "int4" and adapter.method in ("qalora", "qahira")
                 and adapter.pool_in % base.block == 0 and adapter.repeat_out % base.block_rows == 0)
        if exact:
            # dW is constant on each quantization block: w' + dW = q scale + (zero + dW[block])
            base.zeros += delta[::base.block_rows, ::base.block]
            return base, {"into": "int4 zero points"}
        target = base.dequantized_weight() + delta
        if adapter.method in ("lora", "qbara"):
            linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                               device=target.device)
            linear.weight.copy_(target)
            if base.bias is not None:
                linear.bias.copy_(base.bias)
            linear.requires_grad_(False)
            return linear, {"into": "float weight"}
        # no exact merge into these blocks: requantize the merged weight, and say how far it moved
        packed, scales, zeros = quantize4(target, base.scheme, base.block, base.block_rows)
        base.packed.copy_(packed)
        base.scales.copy_(scales)
        if zeros is not None:
            base.zeros.copy_(zeros)
        error = (base.dequantized_weight() - target).abs()
        return base, {"into": "requantized", "max_abs_error": error.max().item(),
                      "mean_abs_error": error.mean().item()}


def merge(model: nn.Module) -> dict[str, dict]:
    """Merges every adapter into its base layer (in place) and removes it.

    LoRA and Q-BaRA merge into float weights (a quantized base becomes an ``nn.Linear`` holding ``w' + dW``).
    QA-LoRA and QA-HiRA merge into the int4 zero points exactly (the model stays 4-bit) when every quantization block
    lies inside one of the adapter's [h, g] tiles (the pooling g a multiple of ``block`` and the repeat h a multiple
    of ``block_rows``: QA-LoRA with its group a multiple of the block; QA-HiRA on ``block=4, block_rows=8`` or
    smaller); otherwise (NF4, or blocks that straddle pooling groups) the merged weight is
    requantized and the error reported.

    Returns:
        ``{layer name: {"into": ..., and for a requantized layer "max_abs_error", "mean_abs_error"}}``.

    Raises:
        ValueError: the model has no adapters, or was merged already.
    """
    if getattr(model, "_fastdist_merged", False):
        raise ValueError("merge: this model's adapters were merged already")
    layers = _adapted(model)
    if not layers:
        raise ValueError("merge: the model has no adapters (add_adapters first)")
    report = {}
    for name, m in layers:
        merged, report[name] = _merge_layer(m)
        replace_submodule(model, name, merged)
    model._fastdist_merged = True
    return report
