"""What the engine's tests run on each rank, and the single-process references they compare with: the models (a GPT
TransformerLM, a nanoGPT GPT with its embedding tied to the head, Hugging Face's GPT2LMHeadModel and LlamaForCausalLM
from small configs), their seeded data, and training loops. Nothing is asserted here; the test bodies compare."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastdist
from fastdist.testing.models import Block, TransformerLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tp"))
import user_models as um  # noqa: E402  (nanoGPT's blocks as nanoGPT writes them)

VOCAB, SEQ, BATCH, STEPS = 64, 16, 8, 5
# fastdist.tp recognises nanoGPT/GPT-2/LLaMA blocks by name; TransformerLM's nn.MultiheadAttention it does not, so
# its MLPs are named (attention stays replicated on the tensor-parallel ranks).
TRANSFORMER_LM_TP = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


class NanoGPT(nn.Module):
    """nanoGPT's GPT (model.py): token and position embeddings, dropout, blocks, final LayerNorm, an LM head whose
    weight is the token embedding's; the forward returns every position's logits."""

    def __init__(self, config: um.GPTConfig, vocab: int):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([um.Block(config) for _ in range(config.n_layer)]),
            ln_f=um.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class MetaReadyGPT(nn.Module):
    """A GPT written for building on the meta device: every tensor comes from its layers' reset_parameters (token
    and position embeddings, fastdist's pre-norm blocks, a final LayerNorm, an LM head); the causal mask and the
    positions are made in the forward."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def nanogpt_init(module: nn.Module) -> None:
    """nanoGPT's ``GPT._init_weights`` (normal(0, 0.02) weights, zero biases), plus its LayerNorm's ones and zeros,
    which its constructor sets: what ``model.apply`` runs to initialize nanoGPT built on the meta device."""
    if isinstance(module, nn.Linear):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, um.LayerNorm):
        torch.nn.init.ones_(module.weight)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)


class MoEBlock(nn.Module):
    """A pre-norm transformer block whose MLP is a fastdist.moe MoELayer (dropless top-2, no replicas, no auxiliary
    loss: a pipeline's loss_fn sees only the last stage's output)."""

    def __init__(self, dim: int, heads: int, experts: int, group):
        super().__init__()
        from fastdist.moe import MoELayer
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.moe = MoELayer(dim, 2 * dim, experts, k=2, dropless=True, balance="none", aux_loss_coef=0.0, group=group)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class MoEGPT(MetaReadyGPT):
    """MetaReadyGPT with MoE blocks, expert parallel over ``group`` (None on one process: every expert here). Its
    values are set by name from seeded generators (:func:`set_moe_values`), so the expert-parallel model on a rank
    holds its slice of the single-process model's experts."""

    def __init__(self, group=None, experts: int = 4, layers: int = 4):
        nn.Module.__init__(self)
        dim = 32
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, 4, experts, group) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB)
        set_moe_values(self)


def set_moe_values(model: nn.Module) -> None:
    """Every parameter from a generator seeded by its name, drawn at the single-process shape (all experts) and
    sliced to this rank's experts."""
    import zlib

    from fastdist.moe import MoELayer
    layers = {f"{path}.{w}": m for path, m in model.named_modules() if isinstance(m, MoELayer)
              for w in ("w1", "b1", "w2", "b2")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            layer = layers.get(name)
            shape = (layer.num_experts, *p.shape[1:]) if layer is not None else p.shape
            value = 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            if layer is not None:
                value = value[layer.first_expert:layer.first_expert + layer.experts_per_rank]
            p.copy_(value + (1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight") else 0.0))


def make_model(name: str, layers: int = 4) -> nn.Module:
    """The seeded model ``name`` ("transformer_lm", "nanogpt", "gpt2", "llama": Hugging Face's, small, built from a
    config, nothing downloaded)."""
    torch.manual_seed(0)
    if name == "transformer_lm":
        return TransformerLM(VOCAB, 32, 4, layers, seq=SEQ)
    if name == "meta_ready_gpt":
        return MetaReadyGPT(VOCAB, 32, 4, layers, SEQ)
    if name == "nanogpt":
        return NanoGPT(um.GPTConfig(block_size=SEQ, n_layer=layers, n_head=4, n_embd=32), VOCAB)
    if name == "gpt2":
        import transformers
        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if name == "moe_gpt":  # one process: every expert on it
        return MoEGPT()
    if name == "llama":
        import transformers
        transformers.logging.set_verbosity_error()
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(config)
    raise KeyError(name)


def batches(steps: int = STEPS, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, next tokens) for every step, seeded."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference(name: str, steps: int = STEPS, layers: int = 4) -> tuple[list[float], dict]:
    """Single-process training: the losses of every step and the state dict after."""
    model = make_model(name, layers)
    opt = make_optimizer(model.parameters())
    losses = []
    for tokens, target in batches(steps):
        opt.zero_grad()
        out = model(tokens)
        loss = loss_fn(out.logits if hasattr(out, "logits") else out, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def train(name: str, mesh, microbatches: int = 2, steps: int = STEPS, layers: int = 4, meta: bool = False,
          optimizer=None, model: nn.Module | None = None, before=None, **options) -> dict:
    """parallelize on ``mesh`` ((dp, tp, pp) or a DeviceMesh) + ``steps`` steps on this rank: losses, the gathered
    state dict (rank 0 only) before and after training, the plan. ``meta``: the model is built on the meta
    device; ``model``: this model instead of ``make_model(name)``; ``before(engine)`` runs before the first step
    (its value is returned as "before")."""
    if model is not None:
        pass
    elif meta:
        with torch.device("meta"):
            model = make_model(name, layers)
    else:
        model = make_model(name, layers)
    shape = mesh if isinstance(mesh, tuple) else tuple(
        mesh.mesh.shape[mesh.mesh_dim_names.index(n)] if n in mesh.mesh_dim_names else 1 for n in ("dp", "tp", "pp"))
    dp = shape[0]
    d = dist.get_rank() // (shape[1] * shape[2]) if dist.is_initialized() else 0  # this rank's dp index
    data = [(x.chunk(dp)[d], y.chunk(dp)[d]) for x, y in batches(steps)]
    options.setdefault("tp_overlap", 2)  # the default "auto" warns on an uncalibrated machine
    if name in ("transformer_lm", "meta_ready_gpt") and shape[1] > 1:
        options.setdefault("tp_plan", TRANSFORMER_LM_TP)
    engine = fastdist.parallel.parallelize(model, mesh=mesh, example_inputs=(data[0][0],), loss_fn=loss_fn,
                                           optimizer=optimizer or make_optimizer, microbatches=microbatches, **options)
    initial = engine.state_dict() if meta else None
    prepared = before(engine) if before is not None else None
    losses = [engine.step(x, y).item() for x, y in data]
    state = engine.state_dict()
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"losses": losses, "state": state if rank == 0 else None, "plan": str(engine.plan),
            "initial": initial if rank == 0 else None,
            "still_meta": meta and all(p.is_meta for p in model.parameters()),
            "stage_params": sum(p.numel() for p in engine.module.parameters()),
            "split_points": engine.plan.split_points, "coordinate": engine.coordinate,
            "wire_bytes": getattr(engine.pipeline_stage, "wire_bytes", None), "engine": engine, "before": prepared}


def error_of(fn, *args, **kwargs) -> str | None:
    """The text of the exception ``fn`` raises (its type first), or None."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test compares the message
        return f"{type(e).__name__}: {e}"
    return None


def bad_input(case: str) -> str | None:
    """The error parallelize raises on this rank for a bad configuration ``case``."""
    model = make_model("transformer_lm")
    tokens, _ = batches(1)[0]
    kwargs = dict(mesh=(1, 1, dist.get_world_size()), example_inputs=(tokens,), loss_fn=loss_fn,
                  optimizer=make_optimizer, microbatches=2)
    if case == "mesh_product":
        kwargs["mesh"] = (1, 1, 3)
    elif case == "more_stages_than_blocks":
        model = make_model("transformer_lm", layers=1)
    elif case == "microbatches":
        kwargs["microbatches"] = 3
    elif case == "no_blocks":
        model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    elif case == "different_models":
        if dist.get_rank() == 1:
            torch.manual_seed(1)
            model = TransformerLM(VOCAB, 32, 4, 4, seq=SEQ)
    elif case == "different_plans":
        kwargs["split_points"] = [1 + dist.get_rank() % 2]
    elif case == "tp_plan_matches_nothing":
        kwargs.update(mesh=(1, 2, 1), tp_plan={"blocks.*.ffn.0": "colwise"}, tp_overlap=2)
    elif case == "moe_not_on_dp_group":  # expert parallel over the whole world, but the mesh is all pipeline
        model = MoEGPT(group=None)
    elif case == "compile_option":
        kwargs["compile"] = "inductor"
    elif case == "init_allocated":
        kwargs["init"] = nanogpt_init
    elif case == "meta_unset":  # TransformerLM's zero positions and causal mask come from its constructor
        with torch.device("meta"):
            model = make_model("transformer_lm")
    elif case == "step_batch":
        engine = fastdist.parallel.parallelize(model, **kwargs)
        target = batches(1)[0][1]
        short = error_of(engine.step, tokens[:4], target[:4])  # every rank: a batch of another shape
        one = error_of(engine.step, tokens[:4] if dist.get_rank() == 1 else tokens, target)  # rank 1 only
        return f"{short} | {one}"
    else:
        raise KeyError(case)
    return error_of(fastdist.parallel.parallelize, model, **kwargs)


def resume(mesh: tuple[int, int, int]) -> dict:
    """Losses of steps 3-5 after saving at step 2 (state_dict + local_state_dict) and resuming in a new engine built
    from other values, beside the losses of the uninterrupted run."""
    first = train("transformer_lm", mesh, steps=2)
    saved, local = first["engine"].state_dict(), first["engine"].local_state_dict()
    whole = train("transformer_lm", mesh, split_points=local["split_points"])
    d = dist.get_rank() // (mesh[1] * mesh[2])
    data = [(x.chunk(mesh[0])[d], y.chunk(mesh[0])[d]) for x, y in batches()][2:]
    model = make_model("transformer_lm")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    options = {"tp_plan": TRANSFORMER_LM_TP, "tp_overlap": 2} if mesh[1] > 1 else {}
    # a time-balanced plan is profiled anew: the saved optimizer state fits the saved split
    engine = fastdist.parallel.parallelize(model, mesh=mesh, example_inputs=(data[0][0],), loss_fn=loss_fn,
                                           optimizer=make_optimizer, microbatches=2,
                                           split_points=local["split_points"], **options)
    engine.load_state_dict(saved)
    engine.load_local_state_dict(local)
    return {"whole": whole["losses"], "resumed": [engine.step(x, y).item() for x, y in data]}


def overhead(steps: int = 40) -> dict:
    """CPU seconds per step of a plain training loop and of parallelize on mesh (1, 1, 1), interleaved, one process,
    one thread (CPU time of this thread: neither other processes' load nor threads earlier tests left running in this
    process count; on one torch thread both loops run forward and backward here)."""
    data = batches(steps, batch=16)
    plain_model, engine_model = make_model("transformer_lm"), make_model("transformer_lm")
    opt = make_optimizer(plain_model.parameters())
    engine = fastdist.parallel.parallelize(engine_model, mesh=(1, 1, 1), example_inputs=(data[0][0],),
                                           loss_fn=loss_fn, optimizer=make_optimizer)

    def plain(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(plain_model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples = {"plain": [], "engine": []}
    try:
        for i, (x, y) in enumerate(data):
            order = (("plain", plain), ("engine", engine.step))
            for name, fn in order if i % 2 else order[::-1]:
                start = time.thread_time()
                fn(x, y)
                samples[name].append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return samples

def case(name: str):
    """The rank function of one named case: "train:<model>:<dp>,<tp>,<pp>", "bad:<case>"."""
    kind, _, rest = name.partition(":")
    if kind == "train":
        model, _, mesh = rest.partition(":")
        return _plain(train(model, tuple(int(d) for d in mesh.split(","))))
    if kind == "bad":
        return bad_input(rest)
    if kind == "compose":
        return compose(rest)
    if kind == "checkpoint":
        return checkpoint(rest)
    if kind == "resume":
        return resume(tuple(int(d) for d in rest.split(",")))
    if kind == "meta":
        model, _, mesh = rest.partition(":")
        init = {"nanogpt": {"init": nanogpt_init, "seed": 5}}.get(model, {})  # else reset_parameters, seed 0
        return _plain(train(model, tuple(int(d) for d in mesh.split(",")), meta=True, steps=3, **init))
    if kind == "gather_to":
        mesh, _, dst = rest.partition(":")
        return gather_to(tuple(int(d) for d in mesh.split(",")), int(dst))
    if kind == "optimizer":
        source, _, target = rest.partition("->")
        return optimizer_moves(*(tuple(int(d) for d in m.split(",")) for m in (source, target)))
    if kind == "dcp":  # dcp:<model>:<source mesh>-><target mesh>
        model, _, meshes = rest.partition(":")
        source, _, target = meshes.partition("->")
        import tempfile
        where = [tempfile.mkdtemp(prefix="fastdist-dcp-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(where, src=0)
        try:
            return sharded_checkpoint(model, *(tuple(int(x) for x in m.split(",")) for m in (source, target)),
                                      where[0])
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                import shutil
                shutil.rmtree(where[0], ignore_errors=True)
    if kind == "compile":
        return compiled(tuple(int(d) for d in rest.split(",")))
    if kind == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("pp", "tp"))
        return _plain(train("transformer_lm", mesh))
    raise KeyError(name)


def checkpoint(name: str) -> dict:
    """A state dict saved by parallelize on mesh (1, 2, 1) after 2 steps, loaded into an engine on (1, 1, 2) built
    from other values, and gathered back from it."""
    trained = train(name, (1, 2, 1), steps=2)
    saved = trained["engine"].state_dict()
    torch.manual_seed(3)
    other = make_model(name)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # far from the saved values
    tokens, target = batches(1)[0]
    engine = fastdist.parallel.parallelize(other, mesh=(1, 1, 2), example_inputs=(tokens,), loss_fn=loss_fn,
                                           optimizer=make_optimizer, microbatches=2)
    engine.load_state_dict(saved)
    reloaded = engine.state_dict()  # a collective: every rank gathers
    first = dist.get_rank() == 0
    return {"saved": saved if first else None, "reloaded": reloaded if first else None}


def gather_to(mesh: tuple[int, int, int], dst: int) -> dict:
    """After a step on ``mesh``: the state dict every rank gathers, and what ``state_dict(dst=dst)`` gives each rank."""
    engine = train("transformer_lm", mesh, steps=1)["engine"]
    full, to_dst = engine.state_dict(), engine.state_dict(dst=dst)
    return {"full": full if dist.get_rank() == dst else None, "to_dst": to_dst,
            "bad_dst": error_of(engine.state_dict, dst=dist.get_world_size())}


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def reference_adamw(saved_after: int = 2, steps: int = STEPS, name: str = "transformer_lm") -> dict:
    """Single-process AdamW training of model ``name``: the losses of every step."""
    model = make_model(name)
    opt = adamw(model.parameters())
    losses = []
    for tokens, target in batches(steps):
        opt.zero_grad()
        out = model(tokens)
        loss = loss_fn(out.logits if hasattr(out, "logits") else out, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


def optimizer_moves(source: tuple[int, int, int], target: tuple[int, int, int]) -> dict:
    """AdamW trained 2 steps on ``source``; its model and optimizer state dicts loaded into an engine on ``target``
    built from other values, which trains 3 more steps; the optimizer state gathered back from ``target``; and the
    same state loaded into the plain model and a torch AdamW, trained the same 3 steps."""
    first = train("transformer_lm", source, steps=2, optimizer=adamw)["engine"]
    model_state, opt_state = first.state_dict(), first.optimizer_state_dict()
    other = make_model("transformer_lm")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    data = batches()
    options = {"tp_plan": TRANSFORMER_LM_TP, "tp_overlap": 2} if target[1] > 1 else {}
    engine = fastdist.parallel.parallelize(other, mesh=target, example_inputs=(data[0][0],), loss_fn=loss_fn,
                                           optimizer=adamw, microbatches=2, **options)
    engine.load_state_dict(model_state)
    engine.load_optimizer_state_dict(opt_state)
    reloaded = engine.optimizer_state_dict()
    resumed = [engine.step(x, y).item() for x, y in data[2:]]
    plain = make_model("transformer_lm")
    plain.load_state_dict(model_state)
    opt = adamw(plain.parameters())
    opt.load_state_dict(fastdist.parallel.engine.plain_optimizer_state_dict(opt_state, plain))
    plain_losses = []
    for x, y in data[2:]:
        opt.zero_grad()
        loss = loss_fn(plain(x), y)
        loss.backward()
        opt.step()
        plain_losses.append(loss.item())
    first_rank = dist.get_rank() == 0
    return {"saved": opt_state if first_rank else None, "reloaded": reloaded if first_rank else None,
            "resumed": resumed, "plain": plain_losses, "whole": reference_adamw()["losses"]}


def _model_on(name: str, mesh: tuple[int, int, int]):
    """(model or None, mesh) for ``train``: the MoE GPT is built on the mesh's dp group, so on a DeviceMesh made
    first; any other model is made by ``make_model``."""
    if name != "moe_gpt":
        return None, mesh
    from torch.distributed.device_mesh import init_device_mesh
    device_mesh = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "tp", "pp"))
    return MoEGPT(group=device_mesh.get_group("dp")), device_mesh


def sharded_checkpoint(model: str, source: tuple[int, int, int], target: tuple[int, int, int], path: str) -> dict:
    """AdamW trained 2 steps on ``source`` and saved with ``save_sharded`` into ``path``; an engine on ``target``
    built from other values loads it (model and optimizer) and trains 3 more steps. The gathered state dicts of
    both, the files each rank wrote, and the losses."""
    import torch.distributed.checkpoint as dcp
    built, source_mesh = _model_on(model, source)
    first = train(model, source_mesh, steps=2, optimizer=adamw, model=built)["engine"]
    first.save_sharded(path)
    saved = first.state_dict()
    other, target_mesh = _model_on(model, target)
    other = other or make_model(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    data = batches()
    d = dist.get_rank() // (target[1] * target[2])
    data = [(x.chunk(target[0])[d], y.chunk(target[0])[d]) for x, y in data]
    options = {"tp_overlap": 2, **({"tp_plan": TRANSFORMER_LM_TP} if model == "transformer_lm" else {})} \
        if target[1] > 1 else {}
    engine = fastdist.parallel.parallelize(other, mesh=target_mesh, example_inputs=(data[0][0],), loss_fn=loss_fn,
                                           optimizer=adamw, microbatches=2, **options)
    engine.load_sharded(path)
    loaded = engine.state_dict()
    steps_after_load = engine._steps
    resumed = [engine.step(x, y).item() for x, y in data[2:]]
    first_rank = dist.get_rank() == 0
    plain = None
    if first_rank:  # DCP's own conversion to one torch.save file: the plain model's names under "model."
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(path, os.path.join(path, "whole.pt"))
        whole = torch.load(os.path.join(path, "whole.pt"), weights_only=False)
        plain = {k[len("model."):]: v for k, v in whole.items() if k.startswith("model.")}
    files = {}  # the files holding each model tensor's chunks
    for index, info in dcp.FileSystemReader(path).read_metadata().storage_data.items():
        if index.fqn.startswith("model."):
            files.setdefault(index.fqn[len("model."):], set()).add(info.relative_path)
    files = {k: sorted(v) for k, v in files.items()}
    return {"saved": saved if first_rank else None, "loaded": loaded if first_rank else None, "resumed": resumed,
            "steps_after_load": steps_after_load, "files": files, "plain": plain,
            "whole": reference_adamw(name=model)["losses"]}


def compiled(mesh: tuple[int, int, int], steps: int = 3) -> dict:
    """The same training with ``compile=True`` (inductor) and eagerly: losses, gathered state dicts (rank 0), and
    how many graphs dynamo captured for the compiled stage."""
    from torch._dynamo.utils import counters
    # a pipeline runs Merak's schedule with recompute on its first stage: compiled blocks under recompute's hooks
    options = dict(schedule="shifted_critical_path", recompute="stage_aware", recompute_ratio=1.0) \
        if mesh[2] > 1 else {}
    counters.clear()
    got = train("transformer_lm", mesh, steps=steps, compile=True, **options)
    graphs = counters["stats"]["unique_graphs"]
    recomputed = getattr(got["engine"].pipeline_stage, "recompute_blocks", 0)
    return {"compiled": _plain(got), "eager": _plain(train("transformer_lm", mesh, steps=steps, **options)),
            "graphs": graphs, "compiled_modules": len(got["engine"].compiled), "recomputed_blocks": recomputed}


def failing_step(where: str, mesh: tuple[int, int, int], failing_rank: int, step: int = 2, how: str = "raise",
                 out_dir: str | None = None, found_by: str = "process table") -> dict:
    """Trains on ``mesh`` until rank ``failing_rank`` fails in step ``step``, in the user's ``loss_fn``
    (``where="loss_fn"``) or in its stage's first block's forward (``"forward"``): it raises (``how="raise"``) or
    its process is killed (``"kill"``: SIGKILL, as the OOM killer does). Every rank's exception, the seconds its
    failing step took, and the steps that returned; with ``out_dir``, a rank that raised also writes that to
    ``out_dir/rank<r>.json`` and raises again (a killed rank's job ends in spawn's RankError, which the test reads).
    ``found_by="heartbeat"``: the ranks publish no process identity, so a dead one is found by its heartbeat."""
    import json
    import signal

    from fastdist.distributed import failure
    if found_by == "heartbeat":
        failure._host_identity = lambda: ""   # as if every rank ran on a host of its own
        failure.DEAD_AFTER_S = 1.5            # the test's bound: spawn waits 5 s for the others of a killed rank
    rank = dist.get_rank()
    failing = rank == failing_rank
    calls = {"step": 0}

    def fail(error):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise error

    def loss(logits, target):
        if failing and where == "loss_fn" and calls["step"] == step:
            fail(ValueError("loss_fn: the user's loss raised"))
        return loss_fn(logits, target)

    model = make_model("transformer_lm")
    d = dist.get_rank() // (mesh[1] * mesh[2])
    data = [(x.chunk(mesh[0])[d], y.chunk(mesh[0])[d]) for x, y in batches(step + 1)]
    engine = fastdist.parallel.parallelize(model, mesh=mesh, example_inputs=(data[0][0],), loss_fn=loss,
                                           optimizer=make_optimizer, microbatches=2, split_points=[2])

    def forward_raises(module, args, output):
        if calls["step"] == step:
            fail(RuntimeError("forward: the user's block raised"))
    if failing and where == "forward":
        engine.module.pipeline_blocks[0].register_forward_hook(forward_raises)
    done = []
    for x, y in data:
        calls["step"] += 1
        start = time.perf_counter()
        try:
            engine.step(x, y)
        except Exception as e:  # noqa: BLE001 - the test reads it
            seconds = time.perf_counter() - start
            again = error_of(engine.step, x, y)
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            got = {"error": f"{type(e).__name__}: {e}", "cause": f"{type(cause).__name__}: {cause}",
                   "notes": getattr(e, "__notes__", []), "seconds": seconds, "steps_done": done,
                   "rank_attr": getattr(e, "rank", None), "died": getattr(e, "died", None), "again": again}
            if out_dir is None:
                return got
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(got, f)
            raise
        done.append(calls["step"])
    return {"error": None, "steps_done": done}


def _plain(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("engine", "before")}


def swap_every_block(engine) -> object:
    """fastdist.memory installed on this rank's stage as on any module: a plan swapping each of its blocks to the
    file store (every saved tensor of 1 KiB or more), applied with ``fm.apply``."""
    import fastdist.memory as fm
    stage = engine.module
    names = [n for n, m in stage.named_modules() if any(m is b for b in stage.pipeline_blocks)]
    plan = fm.Plan("delta", 0, {n: "swap" for n in names}, 0, 0, 0.0, 1.0, True, 1024, 2, "file",
                   fm.Profile([], 0, 0.0, 0.0), {})
    return fm.apply(stage, plan)


def compose(kind: str) -> dict:
    """Trainings that combine the engine with the other parts of fastdist.parallel / fastdist.comm."""
    if kind == "recompute_compress":
        from fastdist.compress import Quantize
        options = dict(schedule="shifted_critical_path",
                       compress_boundaries={"fwd": Quantize(8), "bwd": Quantize(8)})
        with_recompute = train("transformer_lm", (1, 1, 2), recompute="stage_aware", recompute_ratio=1.0, **options)
        without = train("transformer_lm", (1, 1, 2), **options)
        ratios = [s.recompute_ratio for s in with_recompute["engine"].plan.stages]
        stage = with_recompute["engine"].pipeline_stage
        return {"recompute": _plain(with_recompute), "plain": _plain(without), "ratios": ratios,
                "mixins": [b.__name__ for b in type(stage).__mro__], "recomputed_blocks": stage.recompute_blocks}
    if kind == "sketch_hook":
        from fastdist.comm.hooks import SketchState, sketch_hook
        states = []

        def hook(group):
            states.append(SketchState(group, mode="exact"))
            return states[-1], sketch_hook
        result = _plain(train("transformer_lm", (2, 1, 1), dp_comm_hook=hook))
        result["hook_steps"] = states[0].iter
        return result
    if kind == "swap":
        swapped = train("transformer_lm", (1, 1, 2), schedule="1f1b", before=swap_every_block)
        stats = swapped["before"].stats()
        swapped["before"].remove()
        return {"swapped": _plain(swapped), "plain": _plain(train("transformer_lm", (1, 1, 2), schedule="1f1b")),
                "bytes_swapped": stats["bytes_swapped"], "bytes_read": stats["bytes_read"]}
    if kind.startswith("moe:"):
        from torch.distributed.device_mesh import init_device_mesh
        shape = tuple(int(d) for d in kind[4:].split(","))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp", "pp"))
        model = MoEGPT(group=mesh.get_group("dp"))
        result = train("moe_gpt", mesh, model=model)
        local = {n: tuple(p.shape) for n, p in result["engine"].module.named_parameters() if n.endswith(".w1")}
        return {**_plain(result), "local_expert_shapes": local}
    raise KeyError(kind)


def run_on_ranks(names: list[str]) -> dict:
    """Every case of ``names`` on this rank, in order: {name: ("ok", value) | ("error", traceback)}. A case that
    raises does not stop the others (every case raises on all ranks or on none, so the ranks stay in step)."""
    import traceback
    out = {}
    for name in names:
        try:
            out[name] = ("ok", case(name))
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            out[name] = ("error", traceback.format_exc())
    return out
