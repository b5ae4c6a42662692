"""What the tests of tp.parallelize on users' models (user_models.py) run on each rank: the seeded single-process
models (the ``*_case`` functions, which both sides call) and, on the ranks, the same models parallelized, one
training step's output and every parameter's gradient as this rank holds it. Nothing is asserted here."""
import torch
import torch.distributed as dist
import user_models as um
from fastdist.tp import parallelize

USER_MODELS = ("nanogpt", "gpt2", "llama", "fused_qkv_plan")
# The dict plan a user writes for FusedQKVBlock, naming the fused qkv linear column-wise.
FUSED_QKV_PLAN = {"attention.qkv": "colwise", "attention.out": "rowwise"}


def user_model_case(name):
    """(single-process model, input, output weights) for one of USER_MODELS, every parameter perturbed away from
    its initialization (so that a bias or a norm handled wrongly shows)."""
    torch.manual_seed(10)
    if name == "nanogpt":
        model = um.NanoGPTStack(um.GPTConfig())
        manual = model.h[1].attn  # nanoGPT's attention without flash (torch < 2), in the second block
        manual.flash = False
        manual.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))
    elif name == "gpt2":
        model = um.GPT2Stack(um.GPT2Config())
    elif name == "llama":
        model = um.LlamaStack(um.LlamaConfig())
    elif name == "fused_qkv_plan":
        model = um.FusedQKVBlock()
    else:
        raise KeyError(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model, torch.randn(2, 5, 16), torch.randn(2, 5, 16)


def parallelized_user_model(name):
    """Output, input gradient, {parameter: this rank's gradient} and {module: parallel layer type} of one step of
    the parallelized model (2 overlap chunks)."""
    model, x, weight = user_model_case(name)
    parallelize(model, None, plan=FUSED_QKV_PLAN if name == "fused_qkv_plan" else None, overlap_chunks=2)
    xs = x.clone().requires_grad_()
    out = model(xs)
    (out * weight).sum().backward()
    return {"output": out.detach(), "input_grad": xs.grad,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "parallel": {n: type(m).__name__ for n, m in model.named_modules()
                         if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")}}


def value_error_message(make):
    """str of the ValueError ``make()`` raises, or None when it raises nothing."""
    try:
        make()
    except ValueError as e:
        return str(e)
    return None


def refusals():
    """{case: message} of attentions parallelize must refuse rather than shard wrongly."""
    world = dist.get_world_size()
    mqa = um.LlamaConfig(num_key_value_heads=1)  # one key/value head: it cannot be split over 2 ranks
    return {
        "multi_query": value_error_message(lambda: parallelize(um.LlamaStack(mqa), None, overlap_chunks=1)),
        "width_from_input": value_error_message(lambda: parallelize(um.WidthFromInputAttention(16, 4), None,
                                                         plan={"c_attn": "colwise", "c_proj": "rowwise"})),
        "world": world,
    }


ON_RANKS = {
    **{f"user_model:{name}": (lambda name=name: parallelized_user_model(name)) for name in USER_MODELS},
    "refusals": refusals,
}
