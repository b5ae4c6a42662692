"""Rank functions of the embedding tests (spawned; each returns what the test body compares)."""
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastdist.distributed import MismatchError
from fastdist.embedding import EmbeddingInputError, ShardedEmbedding

DIM = 6
CASES = [
    {"seed": 1, "rows": 13},                                              # 13 rows: uneven over 2 and 4 ranks
    {"seed": 2, "rows": 13, "pad": 3, "sparse": True},
    {"seed": 3, "rows": 10, "mode": "sum", "psw": True, "pad": 7},
    {"seed": 4, "rows": 7, "mode": "mean", "sparse": True, "pad": 0},
    {"seed": 5, "rows": 3},                                               # fewer rows than 4 ranks
]


def batch(case: dict, rank: int, step: int = 0):
    """(ids, offsets, per_sample_weights, upstream gradient) of `rank` for `case`: a different batch per rank."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + case["seed"])
    count = case["sizes"][rank] if "sizes" in case else 5 + 3 * rank
    ids = torch.randint(0, case["rows"], (count,), generator=g)
    if case.get("pad") is not None and count:
        ids[0] = case["pad"]
    offsets = psw = None
    if case.get("mode"):
        cuts = torch.randint(0, count + 1, (3,), generator=g).sort().values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
        if case.get("psw"):
            psw = torch.rand(count, generator=g)
        bags = offsets.numel()
    else:
        ids = ids.reshape(-1, 1) if count else ids
        bags = count
    upstream = torch.randn(bags, DIM, generator=g)
    return ids, offsets, psw, upstream


def reference_table(case: dict) -> torch.nn.Module:
    """The unsharded module the sharded one must equal, from the case's seed."""
    torch.manual_seed(case["seed"])
    if case.get("mode"):
        return torch.nn.EmbeddingBag(case["rows"], DIM, mode=case["mode"], padding_idx=case.get("pad"),
                                     sparse=case.get("sparse", False))
    return torch.nn.Embedding(case["rows"], DIM, padding_idx=case.get("pad"), sparse=case.get("sparse", False))


def lookups(cases: list) -> list:
    """Per case: this rank's output, its shard's gradient (dense), and its row range."""
    rank = dist.get_rank()
    out = []
    for case in cases:
        table = ShardedEmbedding.from_embedding(reference_table(case))
        ids, offsets, psw, upstream = batch(case, rank)
        y = table(ids, offsets, psw) if case.get("mode") else table(ids)
        (y.reshape(-1, DIM) * upstream).sum().backward()
        grad = table.weight.grad
        out.append({"y": y.detach(), "grad": grad.to_dense() if grad.is_sparse else grad,
                    "sparse_grad": bool(grad.is_sparse), "start": table.row_start})
    return out


def _error_of(fn):
    try:
        fn()
    except (EmbeddingInputError, MismatchError) as err:
        return type(err).__name__, str(err)
    return None


def refusals() -> dict:
    """Each bad input on rank 1 only: what every rank raised. The group stays usable after each."""
    rank = dist.get_rank()
    table = ShardedEmbedding(11, DIM)
    good = torch.tensor([0, 5, 10])
    bad = {"out of range": torch.tensor([3, 11]), "negative": torch.tensor([-1, 2]),
           "float ids": torch.tensor([1.0, 2.0])}
    out = {name: _error_of(lambda ids=ids: table(ids if rank == 1 else good)) for name, ids in bad.items()}
    out["after"] = table(good).shape  # the group still works
    bags = ShardedEmbedding(11, DIM, mode="sum")
    out["bad offsets"] = _error_of(lambda: bags(good, torch.tensor([1]) if rank == 1 else torch.tensor([0])))
    dim = DIM + (rank == 1)
    out["config"] = _error_of(lambda: ShardedEmbedding(11, dim)(good))
    rows = 11 + (rank == 1)
    out["config rows"] = _error_of(lambda: ShardedEmbedding(rows, DIM)(good))
    return out


def empty_batch_on_one_rank() -> dict:
    """Rank 1 looks nothing up, in a plain and a bag table, forward and backward; the others do."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    table, bags = ShardedEmbedding(9, DIM), ShardedEmbedding(9, DIM, mode="mean")
    ids = torch.tensor([1, 4, 8]) if rank != 1 else torch.zeros(0, dtype=torch.int64)
    y = table(ids)
    b = bags(ids, torch.tensor([0]))
    (y.sum() + b.sum()).backward()
    gc.collect()
    return {"y": y.shape, "b": b.detach(), "grad": table.weight.grad.clone(), "start": table.row_start}


OPTIMIZERS = {
    # name: (fastdist's row-wise optimizer or torch's on the shard, the torch optimizer on the unsharded table)
    "rowwise-sgd": ("RowWiseSGD", torch.optim.SGD, {"lr": 0.5}),
    "rowwise-adagrad": ("RowWiseAdagrad", torch.optim.Adagrad, {"lr": 0.3, "lr_decay": 0.01, "eps": 1e-10}),
    "rowwise-adam": ("RowWiseAdam", torch.optim.SparseAdam, {"lr": 0.1, "betas": (0.8, 0.9)}),
    "torch-sparseadam": ("SparseAdam", torch.optim.SparseAdam, {"lr": 0.1}),
    "torch-adam-dense": ("Adam", torch.optim.Adam, {"lr": 0.1}),
}
TRAIN_CASE = {"seed": 9, "rows": 23, "mode": "sum", "psw": True, "pad": 4}


def make_optimizer(name: str, params, sharded: bool):
    from fastdist.embedding import optim as rowwise
    ours, theirs, options = OPTIMIZERS[name]
    cls = getattr(rowwise, ours, None) or getattr(torch.optim, ours)
    return (cls if sharded else theirs)(params, **options)


def train(names: list, steps: int) -> dict:
    """Per optimizer: this rank's row range and its shard after `steps` steps on its own batches."""
    rank, out = dist.get_rank(), {}
    for name in names:
        case = dict(TRAIN_CASE, sparse=name != "torch-adam-dense")
        table = ShardedEmbedding.from_embedding(reference_table(case))
        opt = make_optimizer(name, table.parameters(), sharded=True)
        for step in range(steps):
            ids, offsets, psw, upstream = batch(case, rank, step)
            opt.zero_grad()
            (table(ids, offsets, psw) * upstream).sum().backward()
            opt.step()
        out[name] = (table.row_start, table.weight.detach().clone())
    return out


def _dlrm_step(model, opts, batch, ahead=None):
    dense, ids, offsets, labels = batch
    for o in opts:
        o.zero_grad()
    loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
    if ahead is not None:  # the next batch's lookups start before this backward, in every sharded table
        for table, next_ids, next_offsets in zip(model.module.embeddings, ahead[1], ahead[2]):
            if isinstance(table, ShardedEmbedding):
                table.prefetch(next_ids, next_offsets)
    loss.backward()
    for o in opts:
        o.step()
    return loss.item()


def dlrm_optimizers(model):
    """The user's split: SparseAdam for the (sparse) tables, Adam for the rest."""
    tables = [p for n, p in model.named_parameters() if "embeddings" in n]
    dense = [p for n, p in model.named_parameters() if "embeddings" not in n]
    return [torch.optim.SparseAdam(tables, lr=0.05), torch.optim.Adam(dense, lr=0.01)]


def gpt_optimizers(model):
    return [torch.optim.Adam(model.parameters(), lr=0.01)]


def hybrid_training(name: str, steps: int, sharding: str = "row", prefetch: bool = False) -> dict:
    """A user's model through hybrid_parallel, trained `steps` steps on this rank's batches (with `prefetch`, each
    step's forward followed by the next batch's prefetch): losses, the full state_dict (gathered tables) and which
    modules were sharded."""
    from fastdist.embedding import ShardedEmbedding, hybrid_parallel
    import models
    rank = dist.get_rank()
    torch.manual_seed(0)
    hooked = []

    def counting_hook(state, bucket):  # torch's plain all-reduce hook, counted: the dense part runs through it
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hooked.append(bucket.index())
        return allreduce_hook(state, bucket)

    if name == "dlrm":
        model = hybrid_parallel(models.DLRM(), min_rows=500, sharding=sharding,
                                comm_hook=counting_hook if sharding == "table" else None)
        opts = dlrm_optimizers(model)

        def step_fn(s):
            ahead = models.dlrm_batch(rank, s + 1) if prefetch and s + 1 < steps else None
            return _dlrm_step(model, opts, models.dlrm_batch(rank, s), ahead)
    else:
        model = hybrid_parallel(models.GPT(tie=False), min_rows=1000)
        opts = gpt_optimizers(model)

        def step_fn(s):
            for o in opts:
                o.zero_grad()
            loss = model(*models.gpt_batch(rank, s))
            loss.backward()
            opts[0].step()
            return loss.item()
    losses = [step_fn(s) for s in range(steps)]
    sharded = sorted(n.removeprefix("module.") for n, m in model.named_modules() if isinstance(m, ShardedEmbedding))
    state = {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}
    del model, opts
    gc.collect()
    return {"losses": losses, "state": state, "sharded": sharded, "hook_calls": len(hooked)}


def tied_refusal() -> str:
    from fastdist.embedding import hybrid_parallel
    import models
    try:
        hybrid_parallel(models.GPT(tie=True), min_rows=1000)
    except ValueError as err:
        return str(err)
    return ""


def collection_tables():
    """A recommender's tables: three of width DIM (one exchange), one narrower (a second)."""
    torch.manual_seed(3)
    return {"user": torch.nn.EmbeddingBag(50, DIM, mode="sum"), "item": torch.nn.EmbeddingBag(31, DIM, mode="mean",
                                                                                          padding_idx=0),
            "hour": torch.nn.Embedding(24, DIM), "city": torch.nn.EmbeddingBag(9, 4, mode="sum")}


def collection_inputs(rank):
    g = torch.Generator().manual_seed(rank)
    out = {}
    for name, t in collection_tables().items():
        ids = torch.randint(0, t.num_embeddings, (4 + rank,), generator=g)
        out[name] = ids if isinstance(t, torch.nn.Embedding) else (ids, torch.tensor([0, 2]))
    return out


def collection() -> dict:
    """The collection's outputs on this rank's inputs, and the tables this rank owns with their gradients."""
    from fastdist.embedding import ShardedEmbeddingCollection
    tables = ShardedEmbeddingCollection(collection_tables(), sharding="table")
    ys = tables(collection_inputs(dist.get_rank()))
    sum(y.sum() * (i + 1) for i, (_, y) in enumerate(sorted(ys.items()))).backward()
    owned = {n: t.weight.grad.clone() for n, t in tables.tables.items() if t.weight.shape[0]}
    return {"y": {n: y.detach() for n, y in ys.items()}, "owned": owned}


def state_dicts() -> dict:
    """A table's full state (gathered) and its sharded state (a ShardedTensor: this rank's rows at their offset);
    the sharded state loads back, another rank's (the legacy per-rank form with another row range, or a
    ShardedTensor of the other rank's rows) is refused."""
    torch.manual_seed(0)
    table = ShardedEmbedding(11, 3, padding_idx=4)
    full = table.state_dict()
    sharded = table.state_dict(sharded=True)["weight"]
    (shard,) = sharded.local_shards()
    other = ShardedEmbedding(11, 3)
    other.load_state_dict({"weight": sharded})
    refused = []
    legacy = {"weight": table.weight.detach(), "row_start": torch.tensor(table.row_start ^ 6),
              "num_embeddings": torch.tensor(11)}
    foreign = ShardedEmbedding(11, 3, sharding="table", owner=0).state_dict(sharded=True)  # all rows on rank 0
    for state in (legacy, foreign):
        try:
            other.load_state_dict(state)
            refused.append("")
        except RuntimeError as err:
            refused.append(str(err))
    shard = {"weight": shard.tensor.clone(), "row_start": shard.metadata.shard_offsets[0]}
    return {"full": full["weight"], "shard": shard,
            "reloaded": torch.equal(other.weight, table.weight), "refused": refused}


def growing_and_shrinking_batches() -> list:
    """Calls whose id counts fit the exchange's capacity, overflow it, then fit again: each output's largest
    difference from the unsharded table (every rank holds the same reference)."""
    rank = dist.get_rank()
    reference = reference_table({"seed": 11, "rows": 97})
    table = ShardedEmbedding.from_embedding(reference)
    errors = []
    for call, count in enumerate([5, 40, 3, 3, 90, 0, 30]):
        g = torch.Generator().manual_seed(100 * call + rank)
        ids = torch.randint(0, 97, (count + 7 * rank,), generator=g)
        diff = (table(ids) - reference(ids)).abs()  # every rank calls, an empty batch too
        errors.append(float(diff.max()) if diff.numel() else 0.0)
    return errors


def compiled() -> dict:
    """A model with a sharded bag table under torch.compile and the same model eager: loss and table gradient."""
    from fastdist.embedding import fuse_lookups
    import models
    rank = dist.get_rank()
    out = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = models.DLRM(table_rows=(300,), sparse=False)
        model.embeddings[0] = ShardedEmbedding.from_embedding(model.embeddings[0])
        fuse_lookups([model])  # as hybrid_parallel binds it: deferred when eager, looked up at once when compiled
        run = torch.compile(model) if name == "compiled" else model
        dense, ids, offsets, labels = models.dlrm_batch(rank, 0, table_rows=(300,))
        loss = F.binary_cross_entropy_with_logits(run(dense, ids, offsets), labels)
        loss.backward()
        out[name] = (loss.item(), model.embeddings[0].weight.grad.clone())
    return out


def traffic_by_vocabulary() -> dict:
    """Bytes a lookup + backward sends for the same distinct ids (scaled to keep their owners) in tables of 1000
    and 1000000 rows."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    base = torch.randint(0, 1000, (64,), generator=g)
    out = {}
    for rows in (1000, 1_000_000):
        table = ShardedEmbedding(rows, DIM, sparse=True)
        table(base * (rows // 1000)).sum().backward()
        out[rows] = dict(table.traffic)
    return out


def suite(world: int, checkpoint: str) -> dict:
    """Everything the tests check on `world` ranks, in one job (each spawn costs seconds of start-up). The 2-rank
    job saves a checkpoint with torch.distributed.checkpoint at `checkpoint`, the 4-rank job (run after it) loads
    it."""
    out = {"lookups": lookups(CASES), "refusals": refusals(), "empty": empty_batch_on_one_rank(),
           "capacity": growing_and_shrinking_batches(),
           "prefetch": {s: prefetch_training(s) for s in ("plain", "2d", "now", "ids", "after-step", "mismatch")},
           "prefetch refusal": prefetch_refusal()}
    if world == 2:
        out["train"] = train(list(OPTIMIZERS), 4)
        out["collection"] = collection()
        out["state"] = state_dicts()
        out["dlrm"] = hybrid_training("dlrm", 3)
        out["dlrm-table"] = hybrid_training("dlrm", 3, sharding="table")
        out["dlrm-prefetch"] = hybrid_training("dlrm", 3, prefetch=True)
        out["dlrm-prioritized"] = prioritized_training()
        out["gpt"] = hybrid_training("gpt", 3)
        out["tied"] = tied_refusal()
        out["compiled"] = compiled()
        out["traffic"] = traffic_by_vocabulary()
        out["prefetch collection"] = {p: prefetch_collection(p) for p in (False, True)}
        out["fused"] = {fuse: fused_training(fuse) for fuse in (True, False, "prefetch")}
        out["deferred"] = deferred_outputs()
        out["checkpoint"] = dcp_save(checkpoint)
    else:
        out["checkpoint"] = {"reloaded": dcp_load(checkpoint)}
    return out


# ---- next-batch prefetch (the 2D schedule) ----

PREFETCH_OPTIMIZERS = ["rowwise-sgd", "rowwise-adagrad", "torch-adam-dense"]
PREFETCH_STEPS = 4
MISMATCH_STEP = 2  # rank 1 looks up other ids than it prefetched at this step, in the "mismatch" schedule


def prefetch_batch(rank: int, step: int):
    """TRAIN_CASE's batch, with ids 0-3 in every step: rows each step updates are looked up again in the next."""
    ids, offsets, psw, upstream = batch(TRAIN_CASE, rank, step)
    ids = ids.clone()
    ids[1:5] = torch.tensor([0, 1, 2, 3])
    return ids, offsets, psw, upstream


def prefetch_training(schedule: str) -> dict:
    """Per optimizer: this rank's outputs at every step and its shard at the end, trained with `schedule`:
    "plain" (no prefetch), "2d" (the next batch prefetched after the forward, before the backward), "now" (the
    same, the rows sent ahead at the prefetch call), "ids" (the same, only the ids sent ahead), "after-step"
    (prefetched after the optimizer step) or "mismatch" (as 2d, but rank 1 prefetches other ids than it looks up
    at MISMATCH_STEP)."""
    rank, out = dist.get_rank(), {}
    for name in PREFETCH_OPTIMIZERS:
        case = dict(TRAIN_CASE, sparse=name != "torch-adam-dense")
        table = ShardedEmbedding.from_embedding(reference_table(case))
        opt = make_optimizer(name, table.parameters(), sharded=True)
        ys = []
        for step in range(PREFETCH_STEPS):
            ids, offsets, psw, upstream = prefetch_batch(rank, step)
            opt.zero_grad()
            y = table(ids, offsets, psw)
            ys.append(y.detach().clone())
            if schedule in ("2d", "now", "ids", "mismatch") and step + 1 < PREFETCH_STEPS:
                ahead = list(prefetch_batch(rank, step + 1)[:3])
                if schedule == "mismatch" and step + 1 == MISMATCH_STEP and rank == 1:
                    ahead[0] = ahead[0].flip(0)  # not what it looks up: every rank looks that step up afresh
                table.prefetch(*ahead, rows_ahead={"ids": False, "now": "now"}.get(schedule, True))
            (y * upstream).sum().backward()
            opt.step()
            if schedule == "after-step" and step + 1 < PREFETCH_STEPS:
                table.prefetch(*prefetch_batch(rank, step + 1)[:3])
        out[name] = {"y": ys, "start": table.row_start, "weight": table.weight.detach().clone(),
                     "traffic": dict(table.traffic)}
    return out


def prefetch_collection_tables():
    torch.manual_seed(5)
    return {"a": torch.nn.EmbeddingBag(30, DIM, mode="sum", sparse=True),
            "b": torch.nn.Embedding(17, DIM, sparse=True, padding_idx=2)}


def prefetch_collection_inputs(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(50 * step + rank)
    a = torch.cat([torch.tensor([0, 29]), torch.randint(0, 30, (5 + rank,), generator=g)])
    b = torch.cat([torch.tensor([1, 2]), torch.randint(0, 17, (4,), generator=g)])
    return {"a": (a, torch.tensor([0, 3])), "b": b}


def prefetch_collection(prefetched: bool) -> list:
    """A row-sharded collection (one exchange for both tables) trained with RowWiseAdagrad: outputs per step."""
    from fastdist.embedding import RowWiseAdagrad, ShardedEmbeddingCollection
    rank = dist.get_rank()
    tables = ShardedEmbeddingCollection(prefetch_collection_tables(), sharding="row")
    opt = RowWiseAdagrad(tables.parameters(), lr=0.3)
    outs = []
    for step in range(PREFETCH_STEPS):
        opt.zero_grad()
        ys = tables(prefetch_collection_inputs(rank, step))
        outs.append({n: y.detach().clone() for n, y in ys.items()})
        if prefetched and step + 1 < PREFETCH_STEPS:
            tables.prefetch(prefetch_collection_inputs(rank, step + 1))
        (ys["a"].sum() * 2 + ys["b"].pow(2).sum()).backward()
        opt.step()
    return outs


def prefetch_refusal() -> tuple:
    """Rank 1 prefetches an id out of range: every rank raises when the prefetch's ids arrive (here: at the
    lookup), and the table works afterwards."""
    rank = dist.get_rank()
    table = ShardedEmbedding(11, DIM)
    table.prefetch(torch.tensor([3, 11]) if rank == 1 else torch.tensor([1]))
    error = _error_of(lambda: table(torch.tensor([1])))
    return error, table(torch.tensor([2, 3])).shape


# ---- sharded checkpoints through torch.distributed.checkpoint ----

def checkpoint_model(seed: int) -> torch.nn.Module:
    """A user's model: a row-sharded table (13 rows: uneven over 2, 3 and 4 ranks) and a dense layer."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"table": torch.nn.EmbeddingBag(13, DIM, mode="sum", padding_idx=5),
                                 "head": torch.nn.Linear(DIM, 2)})
    model["table"] = ShardedEmbedding.from_embedding(model["table"])
    return model


def dcp_save(path: str) -> dict:
    """Saves the model's sharded state with torch.distributed.checkpoint (no gather) and loads it back into a model
    built from another seed: the full state before, and after the round trip."""
    import torch.distributed.checkpoint as dcp
    from fastdist.embedding import sharded_state_dict
    model = checkpoint_model(0)
    with sharded_state_dict():
        dcp.save(model.state_dict(), checkpoint_id=path)
    full = model.state_dict()
    return {"saved": full, "reloaded": dcp_load(path)}


def dcp_load(path: str) -> dict:
    """A model from another seed on this world size, its state loaded from the checkpoint: the full state."""
    import torch.distributed.checkpoint as dcp
    model = checkpoint_model(1)
    state = model["table"].state_dict(sharded=True, prefix="table.")
    state.update(model["head"].state_dict(prefix="head."))
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    return model.state_dict()


# ---- tables called one by one, fused into one exchange ----

class _CountAllToAll:
    """Counts this rank's all_to_all_single calls (the exchanges' collectives) while active."""

    def __enter__(self):
        self.calls, self._original = 0, dist.all_to_all_single

        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)
        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original


def fused_training(fuse: bool | str, steps: int = 3) -> dict:
    """The DLRM through hybrid_parallel(fuse=...): its two sharded tables are called one by one in its forward
    (fuse="prefetch": fused, each table prefetching the next batch after the forward). Losses, the full state
    afterwards, and the AlltoAlls of each step's forward and backward."""
    from fastdist.embedding import hybrid_parallel
    import models
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = hybrid_parallel(models.DLRM(), min_rows=500, fuse=bool(fuse))
    opts = dlrm_optimizers(model)
    losses, forward, backward = [], [], []
    for s in range(steps):
        dense, ids, offsets, labels = models.dlrm_batch(rank, s)
        for o in opts:
            o.zero_grad()
        with _CountAllToAll() as fwd:
            loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
        if fuse == "prefetch" and s + 1 < steps:
            _, next_ids, next_offsets, _ = models.dlrm_batch(rank, s + 1)
            for table, i, o in zip(model.module.embeddings, next_ids, next_offsets):
                if isinstance(table, ShardedEmbedding):
                    table.prefetch(i, o)
        with _CountAllToAll() as bwd:
            loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
        forward.append(fwd.calls)
        backward.append(bwd.calls)
    state = {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}
    sharded = sorted(n.removeprefix("module.") for n, m in model.named_modules() if isinstance(m, ShardedEmbedding))
    del model, opts
    gc.collect()
    return {"losses": losses, "state": state, "sharded": sharded, "forward": forward, "backward": backward}


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def deferred_outputs() -> dict:
    """What a deferred output does before and at its first use: metadata without a lookup, the same table twice
    in one exchange, a call under no_grad, and a custom autograd.Function refused in the backward."""
    from fastdist.embedding import fuse_lookups
    rank = dist.get_rank()
    reference = reference_table({"seed": 12, "rows": 29})
    bags = torch.nn.EmbeddingBag(29, DIM, mode="mean")
    bags.weight.data.copy_(reference.weight.data)
    table, bag_table = ShardedEmbedding.from_embedding(reference), ShardedEmbedding.from_embedding(bags)
    fusion = fuse_lookups([table, bag_table])
    a_ids, b_ids = torch.tensor([[1, 28], [5, 5 + rank]]), torch.tensor([3, 4, 20 + rank])
    a, b, c = table(a_ids), table(b_ids), bag_table(b_ids, torch.tensor([0, 1]))
    metadata = (tuple(a.shape), a.dim(), a.size(-1), b.dtype, len(c), c.requires_grad, fusion.pending)
    total = a.sum() + b.sum() * 2 + c.pow(2).sum()  # the first use: one exchange for the three calls
    after = fusion.pending
    total.backward()
    grad = table.weight.grad.clone()
    want_a, want_b, want_c = reference(a_ids), reference(b_ids), bags(b_ids, torch.tensor([0, 1]))
    outputs_equal = all(torch.equal(x.value, y) for x, y in zip((a, b, c), (want_a, want_b, want_c)))
    with torch.no_grad():
        quiet = table(b_ids)
    quiet_value = quiet + 0
    refused = ""
    try:
        _Scale.apply(table(a_ids)).sum().backward()
    except RuntimeError as err:
        refused = str(err)
    return {"metadata": metadata, "pending after use": after, "outputs equal": outputs_equal,
            "grad": grad, "start": table.row_start, "no_grad": quiet_value.requires_grad,
            "refused": refused}


# ---- the 2D schedule's priority queue ----

STALL_S = 0.3  # rank 1 starts its tables' gradient exchange this late, so rank 0's is in flight meanwhile


class _CollectiveLog:
    """This rank's all_to_all_single and all_reduce calls while active, in issue order, and when each completed:
    a list of [kind, issued (s), done (s) or None], observed from outside the queue."""

    def __enter__(self):
        import time
        self.calls, self._originals = [], (dist.all_to_all_single, dist.all_reduce)

        def logged(kind, fn):
            def call(*args, **kwargs):
                entry = [kind, time.perf_counter(), None]
                self.calls.append(entry)
                work = fn(*args, **kwargs)
                if work is None:
                    entry[2] = time.perf_counter()
                else:
                    work.get_future().add_done_callback(lambda _: entry.__setitem__(2, time.perf_counter()))
                return work
            return call
        dist.all_to_all_single = logged("alltoall", self._originals[0])
        dist.all_reduce = logged("allreduce", self._originals[1])
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_reduce = self._originals


def prioritized_training(steps: int = 3) -> dict:
    """The DLRM through hybrid_parallel(prioritize=True), rank 1 starting its tables' gradient exchange STALL_S
    late in every backward: losses, the full state, how many buckets the queue held, and per step the collectives
    of the backward as _CollectiveLog saw them."""
    import time

    from fastdist.embedding import hybrid_parallel
    import models
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = hybrid_parallel(models.DLRM(), min_rows=500, prioritize=True)
    def stall(module, inputs, out):  # the table's output gradient arrives, rank 1 waits before the exchange
        if rank == 1:
            out.register_hook(lambda grad: time.sleep(STALL_S))

    for m in model.modules():
        if isinstance(m, ShardedEmbedding):
            m.register_forward_hook(stall)
    opts = dlrm_optimizers(model)
    losses, backward = [], []
    for s in range(steps):
        dense, ids, offsets, labels = models.dlrm_batch(rank, s)
        for o in opts:
            o.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids, offsets), labels)
        with _CollectiveLog() as log:
            loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
        backward.append(log.calls)
    state = {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}
    held, idle = model.collective_queue.held, model.collective_queue.idle()
    del model, opts
    gc.collect()
    return {"losses": losses, "state": state, "held": held, "idle": idle, "backward": backward}
