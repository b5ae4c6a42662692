"""fastdist.tp.CostModel (alpha-beta all-reduce + GEMM table, T(k) of the overlap) and fastdist.tp.plan (the
tensor-parallel degree per op, an integer program): the formulas as specified, calibration identical on every
rank, plans optimal against brute force and fast for 48 layers."""
import itertools
import time

import pytest
from fastdist.tp import CostModel, ModelConfig, TPOp, plan
from fastdist.tp.cost import CHUNK_CHOICES
from fastdist.tp.planner import plan_cost
from tp_on_ranks import CALIBRATION_SHAPE


def _model(**kw):
    base = {"alpha": 10e-6, "beta": 1e9, "gemm_overhead": 0.0, "gemm_rate": 1e10, "world_size": 2}
    base.update(kw)
    return CostModel(**base)


def test_predict_follows_the_overlap_formula():
    m = _model()
    op = TPOp("row", 1024, 512, 256, 2)
    G = 2 * 1024 * 512 * 256 / 1e10
    C_alpha, C_beta = 2 * 10e-6, op.comm_bytes / 1e9  # 2(t-1) alpha, 2(t-1)/t B / beta with t = 2
    assert m.predict(op, 1) == pytest.approx(G + C_alpha + C_beta)
    for k in (2, 4, 8):
        g, c = G / k, C_alpha + C_beta / k
        assert m.predict(op, k) == pytest.approx(g + c + (k - 1) * max(g, c))
    assert m.allreduce_time(op.comm_bytes) == pytest.approx(C_alpha + C_beta)


def test_predict_adds_the_collectives_compute_to_every_overlapped_step():
    m = _model(comm_compute_table={0: 50e-6, 2**20: 50e-6 + 0.5e-9 * 2**20})  # S(B) = 50 us + 0.5 ns/B
    op = TPOp("row", 1024, 512, 256, 2)
    G = 2 * 1024 * 512 * 256 / 1e10
    C_alpha, C_beta = 2 * 10e-6, op.comm_bytes / 1e9
    assert m.predict(op, 1) == pytest.approx(G + C_alpha + C_beta)  # sequential: the collective's time is all of it
    for k in (2, 4, 8):
        g, c, s = G / k, C_alpha + C_beta / k, 50e-6 + 0.5e-9 * op.comm_bytes / k
        assert m.predict(op, k) == pytest.approx(g + c + (k - 1) * max(g + s, c))


def test_collective_compute_is_interpolated_in_the_measured_sizes_and_proportional_past_them():
    m = _model(comm_compute_table={1000: 1e-3, 3000: 2e-3})
    assert m.comm_compute_time(2000) == pytest.approx(1.5e-3)
    assert m.comm_compute_time(500) == pytest.approx(1e-3)
    assert m.comm_compute_time(6000) == pytest.approx(4e-3)
    assert _model().comm_compute_time(6000) == 0.0


def test_all_reduce_time_is_interpolated_in_the_measured_sizes_and_alpha_beta_outside_them():
    m = _model(allreduce_table={1000: 1e-3, 3000: 2e-3})
    assert m.allreduce_time(2000) == pytest.approx(1.5e-3)
    assert m.allreduce_time(6000) == pytest.approx(2 * 10e-6 + 6000 / 1e9)  # 2(t-1) alpha + 2(t-1)/t B / beta
    assert m.allreduce_time(2000, world_size=4) == pytest.approx(6 * 10e-6 + 1.5 * 2000 / 1e9)  # other ranks


def test_choose_chunks_keeps_one_chunk_when_the_collective_is_mostly_compute():
    # A fast link: the all-reduce is a fifth of the GEMM and its bandwidth term is all processor time (CPU gloo),
    # so overlapping it hides nothing while every chunk pays a message's latency.
    op = TPOp("row", 2048, 1024, 1024, 2)
    G = 2 * 2048 * 1024 * 1024 / 1e10
    beta = op.comm_bytes / (0.2 * G)
    fast = _model(alpha=0.6e-3, beta=beta, comm_compute_table={0: 0.3e-3, op.comm_bytes: 0.3e-3 + op.comm_bytes / beta})
    assert fast.choose_chunks((2048, 1024, 1024)) == 1
    free = _model(alpha=0.6e-3, beta=beta)  # the same link with a collective that costs the GEMM nothing
    assert free.choose_chunks((2048, 1024, 1024)) > 1


def test_column_backward_prediction_overlaps_the_weight_gradient_gemm_with_the_last_all_reduce():
    m = _model()
    op = TPOp("column", 1024, 256, 512, 2)  # local shard: in 256, out 512; backward dX = dY W is 1024x512x256
    G = 2 * 1024 * 512 * 256 / 1e10
    G_dw = 2 * 512 * 1024 * 256 / 1e10
    C_alpha, C_beta = 2 * 10e-6, op.comm_bytes / 1e9
    assert op.comm_bytes == 1024 * 256 * 4  # the input gradient
    assert m.predict(op, 1) == pytest.approx(G + max(C_alpha + C_beta, G_dw))
    g, c = G / 4, C_alpha + C_beta / 4
    assert m.predict(op, 4) == pytest.approx(g + 3 * max(g, c) + max(c, G_dw))


def test_choose_chunks_splits_when_communication_is_comparable_and_not_when_latency_dominates():
    assert CostModel().choose_chunks((1024, 512, 256)) == 4  # uncalibrated: the default
    assert CostModel().choose_chunks((3, 512, 256)) == 3     # never more chunks than rows
    balanced = _model(beta=2 * 1024 * 256 * 4 / (2 * 1024 * 512 * 256 / 1e10))  # C_beta == G
    assert balanced.choose_chunks((1024, 512, 256)) in (4, 8)
    latency_bound = _model(alpha=1.0)  # one message costs far more than the GEMM
    assert latency_bound.choose_chunks((1024, 512, 256)) == 1
    gemm_only = _model(beta=1e18, alpha=1e-12, gemm_overhead=5e-6)  # chunks only add launches
    assert gemm_only.choose_chunks((1024, 512, 256)) == 1


def test_the_best_predicted_gain_is_bounded_by_two():
    m = _model(beta=2 * 1024 * 256 * 4 / (2 * 1024 * 512 * 256 / 1e10), alpha=0.0)
    op = TPOp("row", 1024, 512, 256, 2)
    gain = m.predict(op, 1) / min(m.predict(op, k) for k in (2, 4, 8))
    assert 1.3 < gain <= 2.0


def test_cost_model_state_dict_round_trips():
    m = _model(gemm_table={(4, 8, 8, "torch.float32"): 1e-5}, comm_compute_table={4096: 2e-5, 65536: 1e-4})
    m.choose_chunks((1024, 8, 8))
    copy = CostModel()
    copy.load_state_dict(m.state_dict())
    assert copy.state_dict() == m.state_dict()
    assert copy.gemm_time(4, 8, 8) == 1e-5


class _FixedPredictions(CostModel):
    """A calibrated model whose T(k) are given: what choose_chunks decides from them."""

    def __init__(self, predicted, error):
        super().__init__(alpha=1e-6, beta=1e9, gemm_rate=1e9, world_size=2, error=error)
        self.predicted = predicted

    def predict(self, op, k):
        return self.predicted[k]


@pytest.mark.parametrize(("predicted", "error", "chosen"), [
    ({1: 1.00, 2: 0.97, 4: 0.96, 8: 0.99}, 0.05, 1),   # a 4% gain inside a 5% error: the plain path
    ({1: 1.00, 2: 0.97, 4: 0.96, 8: 0.99}, 0.00, 2),   # no error: the fewest chunks within 3% of the best
    ({1: 1.00, 2: 0.80, 4: 0.70, 8: 0.72}, 0.10, 4),   # a 30% gain beyond a 10% error: split
    ({1: 1.00, 2: 0.80, 4: 0.70, 8: 0.72}, 0.20, 2),   # within 20% of the best, 2 chunks do
    ({1: 1.00, 2: 0.80, 4: 0.70, 8: 0.72}, 0.50, 1),   # the model cannot tell a 30% gain from its error
])
def test_choose_chunks_takes_a_split_only_when_its_predicted_gain_exceeds_the_measured_error(predicted, error,
                                                                                             chosen):
    assert _FixedPredictions(predicted, error).choose_chunks((1024, 512, 256)) == chosen


def test_calibration_gives_every_rank_the_same_positive_model(tp_ranks):
    (state0, text), (state1, _) = tp_ranks(2, "calibrate")
    assert state0 == state1
    assert state0["alpha"] > 0 and state0["beta"] > 0 and state0["gemm_rate"] > 0
    assert state0["error"] > 0  # measured: the prediction misses and the samples' spread
    rows, _, out_features = CALIBRATION_SHAPE
    compute = dict(state0["comm_compute_table"])  # S at the 2-, 4-, 8-way chunks' float32 output bytes
    assert sorted(compute) == sorted(-(-rows // k) * out_features * 4 for k in CHUNK_CHOICES[1:])
    assert all(v >= 0 for v in compute.values())
    assert len(state0["gemm_table"]) == len(CHUNK_CHOICES)  # the shape and its 2-, 4-, 8-way chunks
    assert text.startswith("CostModel(alpha=")


SMALL = ModelConfig(layers=2, hidden=1024, heads=16, seq_len=512, global_batch=8)


def _brute_force(config, world, memory_limit, model=None):
    from fastdist.tp.planner import NOMINAL, op_cost
    degrees = [d for d in (1, 2, 4, 8) if world % d == 0]
    best = None
    for combo in itertools.product(degrees, repeat=2 * config.layers):
        assignment = [(i // 2, ("attention", "mlp")[i % 2], d) for i, d in enumerate(combo)]
        memory = sum(op_cost(config, world, d, op, model or NOMINAL)[1] for _, op, d in assignment)
        if memory <= memory_limit:
            cost = plan_cost(config, world, assignment, model)
            if best is None or cost < best[0] - 1e-15:
                best = (cost, assignment)
    return best


@pytest.mark.parametrize("memory_gb", [1000, 0.2, 0.15])
def test_plan_is_optimal_against_brute_force(memory_gb):
    got = plan(SMALL, 8, memory_gb * 1e9)
    cost, _ = _brute_force(SMALL, 8, memory_gb * 1e9)
    assert got.step_time_s == pytest.approx(cost, rel=1e-6)
    assert got.memory_per_rank <= memory_gb * 1e9


def test_plan_uses_more_tensor_parallelism_when_memory_is_tight():
    loose = plan(SMALL, 8, 1000e9)
    tight = plan(SMALL, 8, 0.15e9)
    assert max(d for *_, d in tight.degrees) > min(d for *_, d in loose.degrees)
    assert tight.memory_per_rank < loose.memory_per_rank


def test_plan_raises_when_nothing_fits():
    with pytest.raises(ValueError, match="no assignment of tensor-parallel degrees fits memory_limit"):
        plan(SMALL, 8, 1e6)


@pytest.mark.timing
def test_plan_solves_a_48_layer_model_in_under_a_second():
    config = ModelConfig(layers=48, hidden=8192, heads=64, seq_len=2048, global_batch=16)
    plan(SMALL, 8, 1e12)  # imports scipy
    start = time.perf_counter()
    p = plan(config, 16, 160e9, max_degree=8)
    assert time.perf_counter() - start < 1.0
    assert len(p.degrees) == 96 and p.solve_s < 1.0


def test_calibration_is_cached_in_a_file_keyed_by_hardware_and_shapes(tp_ranks):
    for got in tp_ranks(2, "calibration_cache"):
        # measured and saved; the same calibration again: loaded, not measured; another calibration: measured
        assert got["sources"] == ["measured", "cache", "measured"]
        assert got["again"] == got["first"] and got["loaded"] == got["first"]
        key = got["first"]["key"]
        assert "2 ranks" in key and "gloo" in key and f"shapes [{list(CALIBRATION_SHAPE)}]" in key
        assert got["keys"] == sorted([key, got["other_key"]]) and got["other_key"] != key
