"""Fine-tuning quantized models with pooled low-rank adapters (Q-BaRA, QA-HiRA) and their baselines (LoRA, QA-LoRA).

``quantize_model`` turns a model's linear layers into frozen 4-bit :class:`QuantLinear` layers (NF4 or asymmetric
INT4 blocks, computed by the fused ``fastdist.ops.qlinear``); ``add_adapters`` puts a trainable adapter on the
targeted layers; ``save_adapters`` / ``load_adapters`` move only the adapters; ``merge`` folds them into the base
(exactly into the int4 zero points for QA-LoRA and QA-HiRA when the blocks allow it).
"""
from fastdist.adapters.methods import Adapter, LoRA, QAHiRA, QALoRA, QBaRA
from fastdist.adapters.model import (AdaptedLinear, adapter_parameters, adapter_state_dict, add_adapters,
                                     load_adapters, merge, save_adapters)
from fastdist.adapters.quant import QuantLinear, quantize_model

__all__ = ["AdaptedLinear", "Adapter", "LoRA", "QAHiRA", "QALoRA", "QBaRA", "QuantLinear", "adapter_parameters",
           "adapter_state_dict", "add_adapters", "load_adapters", "merge", "quantize_model", "save_adapters"]
