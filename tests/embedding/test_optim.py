"""Owner-side row-wise optimizers on sharded tables equal torch's optimizers on the unsharded nn.Embedding(sparse=True):
RowWiseSGD = SGD, RowWiseAdagrad = Adagrad, RowWiseAdam = SparseAdam; torch's own optimizers work on the shard too.
Their state resumes exactly from state_dict."""
import pytest
import torch
from fastdist.embedding import ShardedEmbedding
from fastdist.embedding.optim import RowWiseAdagrad, RowWiseAdam, RowWiseSGD
from helpers import assert_close

import ranks

# torch's own Adagrad (the reference) builds sparse tensors without opting in or out of their invariant checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")

STEPS = 4


def reference_training(name, world):
    """One process, the unsharded table and torch's optimizer; each step's loss sums every rank's batch."""
    case = dict(ranks.TRAIN_CASE, sparse=name != "torch-adam-dense")
    table = ranks.reference_table(case)
    opt = ranks.make_optimizer(name, table.parameters(), sharded=False)
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0
        for rank in range(world):
            ids, offsets, psw, upstream = ranks.batch(case, rank, step)
            loss = loss + (table(ids, offsets, psw) * upstream).sum()
        loss.backward()
        opt.step()
    return table.weight.detach()


def test_sharded_training_equals_torch_optimizers_on_the_unsharded_table(two_ranks):
    names = list(ranks.OPTIMIZERS)
    results = [r["train"] for r in two_ranks]
    for name in names:
        full = torch.cat([w for _, w in sorted((r[name] for r in results), key=lambda s: s[0])])
        want = reference_training(name, 2)
        assert_close(full, want, f"{name}: table after {STEPS} steps", rtol=1e-5, atol=1e-6)
        assert torch.count_nonzero(full[ranks.TRAIN_CASE["pad"]]) == 0, f"{name} updated the padding row"


@pytest.mark.parametrize("cls", [RowWiseSGD, RowWiseAdagrad, RowWiseAdam])
def test_state_dict_resumes_exactly(cls):
    def run(steps, start=None):
        torch.manual_seed(0)
        table = ShardedEmbedding(30, 4, sparse=True)
        opt = cls(table.parameters(), lr=0.1)
        if start is not None:
            table.load_state_dict(start[0])
            opt.load_state_dict(start[1])
        for step in steps:
            g = torch.Generator().manual_seed(step)
            opt.zero_grad()
            table(torch.randint(0, 30, (12,), generator=g)).pow(2).sum().backward()
            opt.step()
        return table, opt

    straight, _ = run(range(4))
    first, opt = run(range(2))
    saved = ({k: v.clone() for k, v in first.state_dict().items()}, opt.state_dict())
    resumed, _ = run(range(2, 4), start=saved)
    assert torch.equal(resumed.weight, straight.weight)


def test_dense_gradients_and_bad_hyper_parameters_are_refused():
    table = ShardedEmbedding(5, 2)
    table(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse=True"):
        RowWiseAdam(table.parameters()).step()
    with pytest.raises(ValueError, match="'lr' must be a finite number"):
        RowWiseSGD(table.parameters(), lr=float("nan"))
    with pytest.raises(ValueError, match=r"'betas\[1\]'"):
        RowWiseAdam(table.parameters(), betas=(0.9, 1.0))
