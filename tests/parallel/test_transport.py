"""Compressed pipeline boundaries inside torch's schedules (fastdist.parallel.transport), on 2 ranks over gloo:
through ScheduleGPipe and Schedule1F1B the losses, gradients and parameters equal a single-process reference that
applies the same compression at the boundary (fastdist.compress.Boundary), bit for bit; mismatched configurations
raise MismatchError on both ranks."""
import pytest
import torch

import transport_ranks as tr
from fastdist.compress import AQSGD, Chain, Identity, MemoryStore, Quantize, TopK
from fastdist.compress.p2p import _digest_of, encode_frame
from fastdist.distributed import spawn
from fastdist.bench import report
from fastdist.parallel.transport import BOUNDARY_METHODS, boundary_tables, frame_capacities, make_stage
from helpers import randn

TIMEOUT = 120
RUNS = [("identity", "1f1b", 1), ("identity", "gpipe", 1), ("topk+quant", "1f1b", 1), ("topk+quant", "gpipe", 1),
        ("topk+quant", "shifted+recompute", 1), ("topk+quant", "1f1b-exact", 1), ("topk-independent", "1f1b", 1),
        ("aqsgd", "1f1b", 2), ("aqsgd", "1f1b-resumed", 2)]


@pytest.fixture(scope="module")
def pipelined():
    """{(config, schedule): (rank 0's result, rank 1's result)} of every run, from one spawn."""
    results = spawn(tr.cases, 2, RUNS, (0.1, 0.2), backend="gloo", timeout=TIMEOUT)
    out = {run[:2]: (results[0]["runs"][i], results[1]["runs"][i]) for i, run in enumerate(RUNS)}
    out["mismatch"] = [r["mismatch"] for r in results]
    out["diverged"] = [r["diverged"] for r in results]
    out["two_stages_per_rank"] = [r["two_stages_per_rank"] for r in results]
    out["bench"] = results[0]["bench"]
    return out


@pytest.fixture(scope="module")
def references():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {config: tr.reference(config, epochs) for config, _, epochs in RUNS}
    finally:
        torch.set_num_threads(threads)


def _assert_matches_reference(got, want, what):
    first, last = got
    assert len(last["losses"]) == len(want["losses"])
    for i, (a, b) in enumerate(zip(last["losses"], want["losses"])):
        assert torch.equal(a, b), f"{what}: microbatch loss {i}: {a.item()} != {b.item()}"
    for step, ref in enumerate(want["grads"]):
        names = set(first["grads"][step]) | set(last["grads"][step])
        assert names == set(ref), what
        for rank in (first, last):
            for name, g in rank["grads"][step].items():
                assert torch.equal(g, ref[name]), f"{what}: step {step} gradient of {name}"
    for rank in (first, last):
        for name, p in rank["params"].items():
            assert torch.equal(p, want["params"][name]), f"{what}: final {name}"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uncompressed_frames_train_exactly_like_one_process(pipelined, references, schedule):
    _assert_matches_reference(pipelined["identity", schedule], references["identity"], f"identity {schedule}")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_topk_then_quantize_with_mask_reuse_equals_the_one_process_boundary(pipelined, references, schedule):
    _assert_matches_reference(pipelined["topk+quant", schedule], references["topk+quant"], f"topk+quant {schedule}")


def test_composes_with_recompute_under_the_shifted_critical_path_schedule(pipelined, references):
    _assert_matches_reference(pipelined["topk+quant", "shifted+recompute"], references["topk+quant"],
                              "topk+quant, RecomputeStageMixin + CompressedTransportMixin, shifted critical path")


def test_frames_padded_to_the_agreed_size_as_nccl_needs_decode_alike(pipelined, references):
    _assert_matches_reference(pipelined["topk+quant", "1f1b-exact"], references["topk+quant"], "padded frames")
    padded = pipelined["topk+quant", "1f1b-exact"][0]["wire_bytes"][0]["fwd"]
    assert padded > pipelined["topk+quant", "1f1b"][0]["wire_bytes"][0]["fwd"] and padded % tr.MICROBATCHES == 0


def test_gradient_with_mask_reuse_sends_k_values_per_row_fewer_bytes_than_independent(pipelined, references):
    _assert_matches_reference(pipelined["topk-independent", "1f1b"], references["topk-independent"], "independent")
    reuse = pipelined["topk+quant", "1f1b"][1]["wire_bytes"][0]["bwd"]
    independent = pipelined["topk-independent", "1f1b"][1]["wire_bytes"][0]["bwd"]
    dense = tr.BATCH * tr.SEQ * tr.DIM * 4
    assert reuse < independent < dense


def test_aqsgd_over_two_epochs_equals_the_one_process_boundary_and_sends_less_once_samples_are_seen(pipelined,
                                                                                                   references):
    _assert_matches_reference(pipelined["aqsgd", "1f1b"], references["aqsgd"], "aqsgd")
    fwd = [step["fwd"] for step in pipelined["aqsgd", "1f1b"][0]["wire_bytes"]]
    dense = tr.BATCH * tr.SEQ * tr.DIM * 4
    assert fwd[0] > dense > fwd[2] and fwd[2] < fwd[0] / 2  # epoch 0: every sample in full; then 4-bit changes


def test_stages_rebuilt_from_their_state_dicts_resume_aqsgd_training_exactly(pipelined, references):
    _assert_matches_reference(pipelined["aqsgd", "1f1b-resumed"], references["aqsgd"], "aqsgd resumed")


def test_forward_only_steps_between_training_steps_send_dense_and_leave_the_aqsgd_state_alone(pipelined, references):
    got = pipelined["aqsgd", "1f1b"][1]["eval_losses"]
    want = references["aqsgd"]["eval_losses"]
    assert len(got) == len(want) == tr.MICROBATCHES
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the training steps after it still match the reference bit for bit (checked above): the stores did not move


def test_mismatched_compressor_configs_raise_on_both_ranks_naming_the_field(pipelined):
    for message in pipelined["mismatch"]:  # TopK(0.1) on rank 0, TopK(0.2) on rank 1
        assert "fwd.ratio" in message and "stage 0->1" in message


def test_a_rank_resumed_alone_raises_mismatch_on_both_ranks_at_its_next_activation(pipelined):
    for name, message, is_mismatch in pipelined["diverged"]:
        assert is_mismatch, f"{name}: {message}"
        assert "stage 0->1 activation call number" in message and "rank 0: 4; rank 1: 0" in message


def test_several_stages_per_rank_are_refused_with_a_clear_error(pipelined):
    for message in pipelined["two_stages_per_rank"]:
        assert "one stage per rank" in message and "4 stages on 2 ranks" in message


def test_the_boundary_comparison_runs_every_method_and_the_transport_sends_what_stageboundary_sends(pipelined):
    rows = {r["method"]: r for r in pipelined["bench"]}
    assert list(rows) == BOUNDARY_METHODS
    wire = {m: r["wire_bytes"] for m, r in rows.items()}
    assert wire["transport-1f1b"] == wire["transport-gpipe"] == wire["stageboundary-gpipe"]
    assert wire["dense-1f1b"] > wire["naive-topk-1f1b"] > wire["transport-1f1b"]
    payload = {"env": {"network": "loopback"}, "rows": pipelined["bench"],
               "config": {"batch": 4, "seq": 64, "hidden": 8, "microbatches": 2, "ratio": 0.1, "steps": 1, "warmup": 1}}
    for r in payload["rows"]:
        r["speedup"] = r["vs_stageboundary"] = 1.0
    assert "transport-1f1b" in report.text_parts(boundary_tables(payload))


def test_the_capacity_both_ends_compute_bounds_every_frame_whatever_the_values():
    shape = (4, 8, 16)
    for fwd, bwd in [(TopK(0.1), Quantize(8)), (Chain(TopK(0.3, per="tensor"), Quantize(4)), Identity()),
                     (Quantize(2, granularity=4), Quantize(8))]:
        cap_fwd, cap_bwd = frame_capacities(fwd, bwd, "reuse", shape, torch.float32)
        for seed in range(3):
            x = randn(*shape, seed=seed) * 10 ** seed
            packet = fwd.compress(x)
            assert encode_frame(packet, torch.device("cpu"), 1, 2**62).numel() <= cap_fwd
            kept = fwd.kept_indices(packet)
            grad = randn(*kept[0].shape, seed=seed) if kept else x
            assert encode_frame(bwd.compress(grad), torch.device("cpu"), 1, 2**62).numel() <= cap_bwd
    aqsgd = AQSGD(Quantize(4), MemoryStore(8), warmup_epochs=0)
    cap_fwd, _ = frame_capacities(aqsgd, Identity(), "reuse", shape, torch.float32)
    for ids in ([0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [0, 1, 2, 3]):  # all new, half seen, half seen, all seen
        packet = aqsgd.compress(randn(*shape, seed=ids[0]), torch.tensor(ids))
        digest = _digest_of(aqsgd, sending=True)
        assert encode_frame(packet, torch.device("cpu"), 1, 2**62, digest).numel() <= cap_fwd


def test_bad_arguments_are_refused_before_any_communication():
    with pytest.raises(TypeError, match="AQ-SGD"):
        make_stage(torch.nn.Linear(2, 2), 0, 2, "cpu", bwd=AQSGD(Quantize(4), MemoryStore(4)))
    with pytest.raises(ValueError, match="backward_mask"):
        make_stage(torch.nn.Linear(2, 2), 0, 2, "cpu", backward_mask="sometimes")
