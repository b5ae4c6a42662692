"""fastdist.adapters: 4-bit models (QuantLinear, quantize_model), the four adapters at equal parameter budgets, their
agreement with PEFT's LoRA, adapter-only save/load, and merging (exact into int4 zero points for QA-LoRA / QA-HiRA)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastdist import adapters
from fastdist.adapters import LoRA, QAHiRA, QALoRA, QBaRA, QuantLinear
from fastdist.ops import dequantize4

METHODS = ["lora", "qalora", "qbara", "qahira"]


class MLP(nn.Module):
    """A small model written the way users write them."""

    def __init__(self, d=64, hidden=128, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up_proj = nn.Linear(d, hidden)
        self.down_proj = nn.Linear(hidden, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down_proj(F.gelu(self.up_proj(h)))
        return self.lm_head(h)


def mlp(seed=0):
    torch.manual_seed(seed)
    return MLP()


def randomize_adapters(model, seed=1):
    """Adapters start at dW = 0; give them a non-zero update, as after training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


TOKENS = torch.randint(32, (4, 9), generator=torch.Generator().manual_seed(2))


def test_quantize_model_replaces_linear_layers_except_skipped_ones_and_freezes_everything():
    model = adapters.quantize_model(mlp(), "nf4", block=32)
    assert isinstance(model.up_proj, QuantLinear) and isinstance(model.down_proj, QuantLinear)
    assert type(model.lm_head) is nn.Linear
    assert not any(p.requires_grad for p in model.parameters())
    assert {"up_proj.packed", "up_proj.scales", "up_proj.bias"} <= set(model.state_dict())


@pytest.mark.parametrize("scheme", ["nf4", "int4"])
def test_a_quantized_model_computes_with_its_dequantized_weights(scheme):
    float_model = mlp()
    model = adapters.quantize_model(mlp(), scheme, block=32)
    with torch.no_grad():
        for name in ("up_proj", "down_proj"):
            getattr(float_model, name).weight.copy_(getattr(model, name).dequantized_weight())
    torch.testing.assert_close(model(TOKENS), float_model(TOKENS), atol=1e-5, rtol=1e-5)


def test_parameter_counts_match_lora_at_the_same_budget():
    def count(m):
        return sum(p.numel() for p in m.parameters())

    for d_in, d_out, r in [(4096, 4096, 8), (64, 128, 4), (4096, 11008, 16)]:
        lora = count(LoRA(d_in, d_out, r))
        assert lora == r * (d_in + d_out)
        assert count(QBaRA(d_in, d_out, r)) == lora  # 2r (d_in/2 + d_out/2) = r (d_in + d_out)
        qalora = QALoRA(d_in, d_out, r, group=32)
        assert lora - (d_in // 32 + d_out) < count(qalora) <= lora  # the largest rank within the budget
    assert count(QAHiRA(4096, 4096)) == count(LoRA(4096, 4096, 64))  # d_out d_in / 32 = 64 (d_in + d_out)
    assert QBaRA(4096, 4096, 8).rank == 16


ADAPTER_CASES = [(LoRA, {"r": 3}), (QALoRA, {"r": 3, "group": 8}), (QBaRA, {"r": 3}), (QAHiRA, {})]


def random_adapter(cls, kwargs):
    """A [48, 32] adapter with every parameter drawn from N(0, 1) (a non-zero update)."""
    torch.manual_seed(0)
    adapter = cls(32, 48, alpha=2.0, **kwargs)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_()
    return adapter


@pytest.mark.parametrize("cls, kwargs", ADAPTER_CASES)
def test_each_adapters_output_is_x_times_its_dense_update(cls, kwargs):
    adapter = random_adapter(cls, kwargs)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(adapter(x), x @ adapter.delta_weight().T, atol=1e-5, rtol=1e-5)
    dw = adapter.delta_weight()
    # constant on [h, g] tiles: the structure merge relies on
    assert torch.equal(dw, dw[::adapter.repeat_out, ::adapter.pool_in].repeat_interleave(adapter.repeat_out, 0)
                       .repeat_interleave(adapter.pool_in, 1))


@pytest.mark.parametrize("cls, kwargs", ADAPTER_CASES)
def test_add_to_gives_the_dense_updates_output_and_gradients(cls, kwargs):
    # AdaptedLinear adds the update with the pooling and repeat folded into the factors (Q-BaRA, QA-LoRA) or by
    # broadcasting over the output repeat (QA-HiRA); values and gradients (to x, to y and to the adapter's
    # parameters) equal those of y + x @ dW.T
    adapter = random_adapter(cls, kwargs)
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = torch.randn(2, 5, 48, requires_grad=True)
    weights = torch.randn(2, 5, 48)
    results = []
    for fn in (lambda: adapter.add_to(y, x), lambda: y + x @ adapter.delta_weight().T):
        out = fn()
        grads = torch.autograd.grad((out * weights).sum(), [x, y, *adapter.parameters()])
        results.append((out, grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_qahira_reaches_a_higher_rank_than_lora_at_the_same_budget():
    torch.manual_seed(0)
    hira, lora = QAHiRA(256, 256), LoRA(256, 256, 4)
    with torch.no_grad():
        for p in (*hira.parameters(), *lora.parameters()):
            p.normal_()
    assert torch.linalg.matrix_rank(hira.delta_weight()) == 32  # min(256/8, 256/4)
    assert torch.linalg.matrix_rank(lora.delta_weight()) == 4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
def test_only_adapter_parameters_train(method, scheme):
    model = adapters.add_adapters(adapters.quantize_model(mlp(), scheme, block=32), method, r=4,
                                  target_modules=["up_proj", "down_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)
    assert isinstance(model.up_proj.adapter, adapters.methods.METHODS[method])
    randomize_adapters(model)
    F.cross_entropy(model(TOKENS).flatten(0, 1), TOKENS.flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.adapter_parameters(model))


def test_lora_equals_peft_lora_on_the_same_base_when_initialized_equally():
    peft = pytest.importorskip("peft")
    base = adapters.quantize_model(mlp(), "nf4", block=32)
    float_model = mlp()
    with torch.no_grad():
        for name in ("up_proj", "down_proj"):
            getattr(float_model, name).weight.copy_(getattr(base, name).dequantized_weight())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj", "down_proj"], lora_dropout=0.0)
    theirs = peft.get_peft_model(float_model, config)
    ours = adapters.add_adapters(base, "lora", r=4, target_modules=["up_proj", "down_proj"], alpha=8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in ("up_proj", "down_proj"):
            layer = getattr(theirs.base_model.model, name)
            layer.lora_A["default"].weight.copy_(torch.randn(layer.lora_A["default"].weight.shape, generator=g))
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g) * .1)
            getattr(ours, name).adapter.A.copy_(layer.lora_A["default"].weight)
            getattr(ours, name).adapter.B.copy_(layer.lora_B["default"].weight)
    trainable_theirs = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert trainable_theirs == sum(p.numel() for p in adapters.adapter_parameters(ours))
    torch.testing.assert_close(ours(TOKENS), theirs(TOKENS), atol=1e-5, rtol=1e-5)


def outputs_before_and_after_merge(method, scheme, block, block_rows=1, **options):
    model = adapters.add_adapters(adapters.quantize_model(mlp(), scheme, block=block, block_rows=block_rows), method,
                                  r=4, target_modules=["up_proj", "down_proj"], **options)
    randomize_adapters(model)
    with torch.no_grad():
        before = model(TOKENS)
        report = adapters.merge(model)
        after = model(TOKENS)
    return model, report, before, after


@pytest.mark.parametrize("method, block, block_rows, options", [
    ("qalora", 32, 1, {}), ("qalora", 16, 1, {"group": 32}), ("qahira", 4, 1, {}), ("qahira", 2, 1, {}),
    ("qahira", 4, 8, {})])  # QA-HiRA on 8 x 4 blocks: one scale and zero per 32 values, as 1-D blocks of 32
def test_qalora_and_qahira_merge_exactly_into_int4_zero_points(method, block, block_rows, options):
    model, report, before, after = outputs_before_and_after_merge(method, "int4", block, block_rows, **options)
    assert all(r == {"into": "int4 zero points"} for r in report.values())
    assert isinstance(model.up_proj, QuantLinear) and isinstance(model.down_proj, QuantLinear)  # still 4-bit
    # only float rounding of zero + dW and of the sums: the merged 4-bit model is the adapter model
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["lora", "qbara"])
@pytest.mark.parametrize("scheme", ["nf4", "int4"])
def test_lora_and_qbara_merge_into_float_weights(method, scheme):
    model, report, before, after = outputs_before_and_after_merge(method, scheme, 32)
    assert type(model.up_proj) is nn.Linear and not model.up_proj.weight.requires_grad
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method, scheme, block", [("qahira", "nf4", 32), ("qalora", "nf4", 32),
                                                   ("qahira", "int4", 32)])
def test_merges_without_an_exact_form_requantize_and_report_the_error(method, scheme, block):
    model, report, before, after = outputs_before_and_after_merge(method, scheme, block)
    assert isinstance(model.up_proj, QuantLinear)
    for name, r in report.items():
        assert r["into"] == "requantized"
        layer = getattr(model, name)
        # the requantization error is at most half a step (int4) or half the widest NF4 gap (-0.696 - -1) times absmax
        step = layer.scales.repeat_interleave(block, 1) * (0.5 if scheme == "int4" else 0.1520)
        assert r["max_abs_error"] <= step.max().item() + 1e-6
    assert (after - before).abs().max() > 0


def test_merging_twice_or_without_adapters_is_refused():
    model, *_ = outputs_before_and_after_merge("qalora", "int4", 32)
    with pytest.raises(ValueError, match="merged already"):
        adapters.merge(model)
    with pytest.raises(ValueError, match="no adapters"):
        adapters.merge(mlp())


@pytest.mark.parametrize("method", METHODS)
def test_saved_adapters_load_into_a_fresh_quantized_model_and_give_the_same_outputs(method, tmp_path):
    model = adapters.add_adapters(adapters.quantize_model(mlp(), "int4", block=32), method, r=4,
                                  target_modules=["up_proj", "down_proj"])
    randomize_adapters(model)
    state = adapters.adapter_state_dict(model)
    assert state and all(".adapter." in k for k in state)  # no base weights
    adapters.save_adapters(model, tmp_path / "a.pt")
    fresh = adapters.load_adapters(adapters.quantize_model(mlp(), "int4", block=32), tmp_path / "a.pt")
    with torch.no_grad():
        torch.testing.assert_close(fresh(TOKENS), model(TOKENS), atol=0, rtol=0)


def test_loading_adapters_into_a_model_of_other_shapes_names_the_layer(tmp_path):
    model = adapters.add_adapters(mlp(), "lora", r=4, target_modules=["up_proj"])
    adapters.save_adapters(model, tmp_path / "a.pt")
    other = MLP(d=64, hidden=96)
    with pytest.raises(ValueError, match=r"layer 'up_proj' has shape \[96, 64\], the saved adapter was made for "
                                         r"\[128, 64\]"):
        adapters.load_adapters(other, tmp_path / "a.pt")


def test_bad_shapes_and_non_finite_weights_name_the_layer():
    with pytest.raises(ValueError, match=r"layer 'down_proj' has in_features = 128, not divisible by block = 48"):
        adapters.quantize_model(mlp(), "nf4", block=48, skip=("lm_head", "up_proj"))
    model = mlp()
    with torch.no_grad():
        model.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match=r"cannot quantize layer 'up_proj': .*must be finite"):
        adapters.quantize_model(model, "nf4", block=32)
    odd = nn.Sequential(nn.Linear(64, 30))
    with pytest.raises(ValueError, match=r"\[30, 64\] of layer '0' must have in_features divisible by 4 and "
                                         r"out_features by 8"):
        adapters.add_adapters(odd, "qahira", target_modules=["0"])
    with pytest.raises(ValueError, match="no layer of the model matches"):
        adapters.add_adapters(mlp(), "lora", r=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="method must be one of"):
        adapters.add_adapters(mlp(), "dora", r=2, target_modules=["up_proj"])
    with pytest.raises(ValueError, match="needs a rank r >= 1"):
        adapters.add_adapters(mlp(), QBaRA, target_modules=["up_proj"])


@pytest.mark.parametrize("method, options, shape, message", [
    ("qbara", {"r": 2}, (63, 64), r"\[64, 63\] of layer '0' must have in_features divisible by 2 and out_features by 2"),
    ("qbara", {"r": 2}, (64, 63), r"\[63, 64\] of layer '0' must have in_features divisible by 2 and out_features by 2"),
    ("qalora", {"r": 2, "group": 32}, (48, 64), r"\[64, 48\] of layer '0' must have in_features divisible by 32"),
    ("qahira", {}, (62, 64), r"\[64, 62\] of layer '0' must have in_features divisible by 4 and out_features by 8"),
])
def test_every_pooling_that_does_not_divide_the_layer_is_refused_naming_it(method, options, shape, message):
    with pytest.raises(ValueError, match=message):
        adapters.add_adapters(nn.Sequential(nn.Linear(*shape)), method, target_modules=["0"], **options)


def test_two_dimensional_blocks_that_do_not_divide_the_output_rows_name_the_layer():
    with pytest.raises(ValueError, match=r"layer 'up_proj' has out_features = 128, not divisible by block_rows = 48"):
        adapters.quantize_model(mlp(), "int4", block=4, block_rows=48, skip=("lm_head", "down_proj"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_weight_refuses_quantization_naming_the_layer(bad):
    model = mlp()
    with torch.no_grad():
        model.down_proj.weight[7, 1] = bad
    with pytest.raises(RuntimeError, match=r"cannot quantize layer 'down_proj': .*must be finite: 1 of"):
        adapters.quantize_model(model, "int4", block=32)


@pytest.mark.parametrize("method, scheme", [("lora", None), ("qbara", "nf4"), ("qalora", "int4"), ("qahira", "int4")])
def test_every_merged_model_refuses_a_second_merge_and_new_adapters(method, scheme):
    model = mlp() if scheme is None else adapters.quantize_model(mlp(), scheme, block=32)
    adapters.add_adapters(model, method, r=4, target_modules=["up_proj"])
    randomize_adapters(model)
    adapters.merge(model)
    with torch.no_grad():
        merged = model(TOKENS)
    with pytest.raises(ValueError, match="merged already"):
        adapters.merge(model)
    with pytest.raises(ValueError, match="merged already"):
        adapters.add_adapters(model, method, r=4, target_modules=["down_proj"])
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), merged, atol=0, rtol=0)  # the refused calls changed nothing


def test_loading_adapters_of_another_method_onto_adapted_layers_is_refused(tmp_path):
    adapters.save_adapters(adapters.add_adapters(mlp(), "lora", r=4, target_modules=["up_proj"]), tmp_path / "a.pt")
    other = adapters.add_adapters(mlp(), "qbara", r=4, target_modules=["up_proj"])
    with pytest.raises(ValueError, match=r"layer 'up_proj' has a qbara adapter, the saved one is lora"):
        adapters.load_adapters(other, tmp_path / "a.pt")


def test_qahira_on_a_quantized_hugging_face_llama_trains_and_merges_into_a_4bit_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    adapters.quantize_model(model, "int4", block=4, block_rows=8)  # 8 x 4 blocks: QA-HiRA merges exactly
    adapters.add_adapters(model, "qahira", target_modules=["q_proj", "v_proj", "o_proj"])
    tokens = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(adapters.adapter_parameters(model), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        before = model(input_ids=tokens).logits
        report = adapters.merge(model)
        after = model(input_ids=tokens).logits
    assert {r["into"] for r in report.values()} == {"int4 zero points"}
    assert all(isinstance(m, QuantLinear) for m in (model.model.layers[0].self_attn.q_proj,
                                                    model.model.layers[1].self_attn.o_proj))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_the_readme_recipe_runs_as_written(tmp_path):
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "README.md")) as f:
        recipes = re.findall(r"<!-- runs in tests/adapters/test_adapters.py -->\n```python\n(.*?)```", f.read(), re.S)
    assert len(recipes) == 1
    recipe = recipes[0].replace("/tmp/adapters.pt", str(tmp_path / "adapters.pt"))
    exec(compile(recipe, "README.md", "exec"), {"__name__": "readme_recipe"})
    assert (tmp_path / "adapters.pt").exists()


@pytest.mark.parametrize("method", METHODS)
def test_an_adapted_4bit_model_compiles_as_one_graph_and_matches_eager(method):
    model = adapters.add_adapters(adapters.quantize_model(mlp(), "nf4", block=32), method, r=2,
                                  target_modules=["up_proj", "down_proj"])
    randomize_adapters(model)

    def output_and_adapter_grads(forward):
        out = forward(TOKENS)
        F.cross_entropy(out.flatten(0, 1), TOKENS.flatten()).backward()
        grads = [p.grad.clone() for p in adapters.adapter_parameters(model)]
        model.zero_grad(set_to_none=True)
        return out.detach(), grads

    eager_out, eager_grads = output_and_adapter_grads(model)
    compiled_out, compiled_grads = output_and_adapter_grads(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(compiled_out, eager_out, atol=1e-5, rtol=1e-5)
    for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)


def _train_adapters(rank_share, steps=3):
    """QBaRA on a 4-bit MLP: SGD steps on `rank_share` of each batch (DDP when a process group is up); the adapters'
    parameters after them and the names DDP reduced."""
    import torch.distributed as dist
    model = adapters.add_adapters(adapters.quantize_model(mlp(), "int4", block=32), "qbara", r=2,
                                  target_modules=["up_proj", "down_proj"])
    randomize_adapters(model)
    wrapped = model
    if dist.is_initialized():
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(adapters.adapter_parameters(model), lr=0.5)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        tokens = torch.randint(32, (8, 9), generator=g)[rank_share]
        loss = F.cross_entropy(wrapped(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    reduced = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {k: v for k, v in adapters.adapter_state_dict(model).items()}, reduced


def ddp_rank(world):
    import torch.distributed as dist
    rank = dist.get_rank()
    return _train_adapters(slice(rank * 8 // world, (rank + 1) * 8 // world))


def test_under_ddp_only_adapters_are_reduced_and_two_ranks_train_like_one_process():
    from fastdist.distributed import spawn
    ranks = spawn(ddp_rank, 2, 2, backend="gloo", timeout=180, threads_per_rank=1)
    want, _ = _train_adapters(slice(None))
    for state, reduced in ranks:
        assert reduced and all(".adapter." in n for n in reduced)  # the 4-bit base holds no parameters to reduce
        for name, value in want.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-5, msg=name)
