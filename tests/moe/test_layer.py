"""fastdist.moe.MoELayer on 2 and 4 gloo ranks: output and gradients equal a single-process dense reference (all
experts local, same weights, same routing) with balancing off and on, dropless and with capacity, with a rank that
gets no tokens; replicas really carry tokens; mismatched configurations raise on every rank; planner state
round-trips through state_dict."""
import math
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fastdist.distributed import MismatchError, spawn
from fastdist.moe import CostModel, MoELayer, Plan

D, F_DIM, E, K = 8, 16, 8, 2
MIN_CAPACITY = 2
STEPS = 3
# Compute-bound constants: replicating a popular expert pays off, so the planners do place replicas.
COST = CostModel(d_model=D, d_ff=F_DIM, a2a_alpha_s=1e-5, a2a_bytes_per_s=1e9, flops_per_s=1e9,
                 p2p_bytes_per_s=1e10)


def full_weights():
    g = torch.Generator().manual_seed(1234)
    gate = torch.randn(E, D, generator=g) * 0.3
    # Feature 0 of every token is 1 and gate column 0 is 3 * log Zipf(1.2): expert popularity is skewed.
    gate[:, 0] = 3.0 * torch.log(1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** 1.2)
    return {"gate": gate,
            "w1": torch.randn(E, D, F_DIM, generator=g) / math.sqrt(D), "b1": torch.randn(E, F_DIM, generator=g) * 0.1,
            "w2": torch.randn(E, F_DIM, D, generator=g) / math.sqrt(F_DIM), "b2": torch.randn(E, D, generator=g) * 0.1}


def tokens_of(world, rank, step):
    # The last rank has no tokens at step 1 (a replica may still be planned onto it from step 0's counts).
    if rank == world - 1 and step == 1:
        return 0
    return 12 + 5 * rank + 3 * step


def inputs(world, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(tokens_of(world, rank, step), D, generator=g)
    x[:, 0] = 1.0
    return x, torch.randn(x.shape, generator=g)


def _run(config):
    world, rank = dist.get_world_size(), dist.get_rank()
    group = None
    if config.get("ep_size"):  # data parallel x expert parallel: one MoE group per block of ep_size ranks
        ep = config["ep_size"]
        groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(world // ep)]
        group, world, rank = groups[rank // ep], ep, rank % ep
    layer = MoELayer(D, F_DIM, E, k=K, capacity_factor=config["capacity_factor"], dropless=config["dropless"],
                     balance=config["balance"], cost_model=COST, min_capacity=MIN_CAPACITY, max_replicas_per_rank=2,
                     group=group)
    w = full_weights()
    per = E // world
    with torch.no_grad():
        layer.gate.weight.copy_(w["gate"])
        for name in ("w1", "b1", "w2", "b2"):
            getattr(layer, name).copy_(w[name][rank * per:(rank + 1) * per])
    steps = []
    for step in range(STEPS):
        x, grad_out = inputs(world, rank, step)
        x.requires_grad_()
        layer.zero_grad(set_to_none=True)
        if config.get("prefetch"):
            layer.prefetch_replicas()  # as a model would, before its attention: forward must use this transfer
        out = layer(x)
        (out * grad_out).sum().backward()
        steps.append({"out": out.detach(), "x_grad": x.grad, "gate_grad": layer.gate.weight.grad,
                      **{n: getattr(layer, n).grad for n in ("w1", "b1", "w2", "b2")}, "stats": layer.stats()})
    result = {"steps": steps}
    if config.get("state_dict"):
        state = pickle.loads(pickle.dumps(layer.state_dict()))
        twin = MoELayer(D, F_DIM, E, k=K, capacity_factor=config["capacity_factor"], dropless=config["dropless"],
                        balance=config["balance"], cost_model=COST, min_capacity=MIN_CAPACITY, group=group)
        twin.load_state_dict(state)
        result["twin_plan"] = twin.plan.replicas
        result["plan"] = layer.plan.replicas
    return result


def dense_reference(xs, grad_outs, config):
    """All experts in one process: per rank chunk, softmax top-k, capacity in priority order, weighted FFN sum."""
    w = {n: t.clone().requires_grad_() for n, t in full_weights().items()}
    xs = [x.clone().requires_grad_() for x in xs]
    outs = []
    for x in xs:
        tokens = x.shape[0]
        probs = (x @ w["gate"].t()).float().softmax(-1)
        weight, idx = probs.topk(K, dim=-1)
        cap = None if config["dropless"] else max(MIN_CAPACITY, math.ceil(K * tokens * config["capacity_factor"] / E))
        fill = [0] * E
        keep = torch.zeros(tokens, K, dtype=torch.bool)
        for j in range(K):
            for t in range(tokens):
                e = int(idx[t, j])
                keep[t, j] = cap is None or fill[e] < cap
                fill[e] += 1
        out = torch.zeros_like(x)
        for e in range(E):
            t_idx, j_idx = ((idx == e) & keep).nonzero(as_tuple=True)
            if len(t_idx) == 0:
                continue
            h = F.gelu(x[t_idx] @ w["w1"][e] + w["b1"][e]) @ w["w2"][e] + w["b2"][e]
            out = out.index_add(0, t_idx, h * weight[t_idx, j_idx].unsqueeze(1))
        outs.append(out)
    sum((o * g).sum() for o, g in zip(outs, grad_outs)).backward()
    x_grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]  # a rank with no tokens
    return outs, x_grads, {n: t.grad for n, t in w.items()}


CASES = [
    (2, "none", False), (2, "prophet", True), (2, "prophet", False), (2, "shadow", True),
    (4, "prophet", True), (4, "shadow", False), (4, "replicate_topk", True),
]


@pytest.mark.parametrize("world, balance, dropless", CASES)
def test_distributed_layer_equals_the_dense_reference(world, balance, dropless):
    config = {"balance": balance, "dropless": dropless, "capacity_factor": 1.0, "state_dict": balance == "prophet",
              "prefetch": world == 2 and balance == "prophet" and dropless}
    results = spawn(_run, world, config, backend="gloo", timeout=120, threads_per_rank=1)
    per = E // world
    replicated_steps = 0
    dropped = 0
    for step in range(STEPS):
        xs, gs = zip(*(inputs(world, r, step) for r in range(world)))
        outs, x_grads, w_grads = dense_reference(list(xs), list(gs), config)
        for r in range(world):
            got = results[r]["steps"][step]
            torch.testing.assert_close(got["out"], outs[r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["x_grad"], x_grads[r], rtol=1e-5, atol=1e-6)
            for n in ("w1", "b1", "w2", "b2"):
                torch.testing.assert_close(got[n], w_grads[n][r * per:(r + 1) * per], rtol=1e-5, atol=1e-6)
        gate_grad = sum(results[r]["steps"][step]["gate_grad"] for r in range(world))
        # The gate gradient sums every token's contribution, per rank then across ranks: fp32 order differs.
        torch.testing.assert_close(gate_grad, w_grads["gate"], rtol=1e-4, atol=1e-5)
        stats = results[0]["steps"][step]["stats"]
        replicated_steps += bool(stats["replicas"])
        dropped += stats["dropped"]
        assert sum(stats["tokens_per_rank"]) == sum(stats["tokens_per_expert"])
    if balance == "none":
        assert replicated_steps == 0
    else:  # the replica path really ran (steps 1 and 2 use the plan from the step before)
        assert replicated_steps >= 1
    assert (dropped == 0) == dropless or not dropless
    if not dropless:
        assert dropped > 0, "the capacity cases should drop tokens, or they test nothing about dropping"
    if config["state_dict"]:
        assert results[0]["twin_plan"] == results[0]["plan"]
    if balance == "prophet" and dropless and world == 4:  # the skew is strong here, and the planner removes it
        last = results[0]["steps"][-1]["stats"]
        assert last["tokens_max_over_mean_unbalanced"] >= 1.6
        assert last["tokens_max_over_mean"] < last["tokens_max_over_mean_unbalanced"]
        assert last["std_tokens_per_rank_after"] < last["std_tokens_per_rank_before"]


def test_expert_parallel_subgroups_each_equal_the_dense_reference():
    # 4 ranks = 2 data-parallel replicas x 2-rank expert-parallel groups {0, 1} and {2, 3}, both fed the same data:
    # each group must reproduce the 2-rank dense reference, replicas and all (global vs group ranks in the p2p).
    config = {"balance": "prophet", "dropless": True, "capacity_factor": 1.0, "ep_size": 2}
    results = spawn(_run, 4, config, backend="gloo", timeout=120, threads_per_rank=1)
    per = E // config["ep_size"]  # experts each rank of an expert-parallel group owns
    replicated = 0
    for step in range(STEPS):
        xs, gs = zip(*(inputs(2, r, step) for r in range(2)))
        outs, x_grads, w_grads = dense_reference(list(xs), list(gs), config)
        for global_rank in range(4):
            r = global_rank % 2
            got = results[global_rank]["steps"][step]
            torch.testing.assert_close(got["out"], outs[r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["x_grad"], x_grads[r], rtol=1e-5, atol=1e-6)
            for n in ("w1", "b1", "w2", "b2"):
                torch.testing.assert_close(got[n], w_grads[n][r * per:(r + 1) * per], rtol=1e-5, atol=1e-6)
        replicated += bool(results[2]["steps"][step]["stats"]["replicas"])
    assert replicated >= 1


MISMATCHES = {"k": 1, "capacity_factor": 2.0, "num_experts": 2 * E}


def _mismatched():
    messages = {}
    for field, other in MISMATCHES.items():
        kwargs = {"k": K, "capacity_factor": 1.25, "num_experts": E}
        if dist.get_rank() == 1:
            kwargs[field] = other
        try:
            MoELayer(D, F_DIM, kwargs["num_experts"], k=kwargs["k"], capacity_factor=kwargs["capacity_factor"],
                     cost_model=COST)
            messages[field] = None
        except MismatchError as err:
            messages[field] = str(err)
    return messages


def _diverged_plan():
    layer = MoELayer(D, F_DIM, E, k=K, balance="prophet", cost_model=COST)
    if dist.get_rank() == 1:  # as if rank 1's planner had gone its own way: it owns expert 4, "replicated" on 0
        layer.planner.plan = Plan(((4, 0),))
    x, _ = inputs(2, dist.get_rank(), 0)
    try:
        layer(x)
    except MismatchError as err:
        return str(err)
    return None


def test_ranks_that_disagree_on_the_plan_raise_on_every_rank():
    messages = spawn(_diverged_plan, 2, backend="gloo", timeout=60, threads_per_rank=1)
    assert all(m is not None and "'MoELayer plan' differs across ranks" in m for m in messages), messages


def test_mismatched_configuration_raises_on_every_rank():
    per_rank = spawn(_mismatched, 2, backend="gloo", timeout=60, threads_per_rank=1)
    for messages in per_rank:
        for field in MISMATCHES:
            m = messages[field]
            assert m is not None and "'MoELayer configuration' differs across ranks" in m and f"'{field}'" in m


def _measured_steps():
    layer = MoELayer(D, F_DIM, E, k=K, balance="prophet", cost_model=COST, dropless=True)
    for step in range(4):
        x, grad_out = inputs(2, dist.get_rank(), step)
        (layer(x) * grad_out).sum().backward()
    with torch.no_grad():
        layer(inputs(2, dist.get_rank(), 4)[0])  # an evaluation step: nothing measured for it
    layer(inputs(2, dist.get_rank(), 5)[0])
    return layer.planner.measured


def test_every_rank_checks_its_planner_against_the_same_measured_step_times():
    first, second = spawn(_measured_steps, 2, backend="gloo", timeout=60, threads_per_rank=1)
    assert first == second  # the slowest rank's time everywhere: the planners stay in step
    assert [step for step, _, _ in first] == [1, 2, 3, 4]  # steps 0-3 trained; the evaluation step was not timed
    assert all(ratio > 0 for _, _, ratio in first)


def test_single_process_layer_runs_without_a_process_group():
    torch.manual_seed(0)
    layer = MoELayer(D, F_DIM, E, k=K, balance="prophet", cost_model=COST)
    x = torch.randn(10, D, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad is not None and layer.w1.grad is not None
    assert layer.stats()["replicas"] == [] and layer.aux_loss.item() > 0


def test_single_process_layer_in_bfloat16_agrees_with_float32():
    torch.manual_seed(0)
    layer = MoELayer(D, F_DIM, E, k=K, balance="none", dropless=True).to(torch.bfloat16)
    reference = MoELayer(D, F_DIM, E, k=K, balance="none", dropless=True)
    reference.load_state_dict({n: t.float() if isinstance(t, torch.Tensor) else t  # _extra_state is a dict
                               for n, t in layer.state_dict().items()})
    x = torch.randn(40, D).to(torch.bfloat16)
    x[:, 0] = 1.0
    out = layer(x.requires_grad_())
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and layer.w1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x.detach().float()), rtol=2e-2, atol=2e-2)


def test_single_process_layer_under_cpu_bfloat16_autocast_returns_bfloat16_like_the_linears_around_it():
    torch.manual_seed(0)
    layer = MoELayer(D, F_DIM, E, k=K, balance="none", dropless=True)
    linear = torch.nn.Linear(D, D)
    x = torch.randn(40, D)
    x[:, 0] = 1.0
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        beside = linear(x)
    assert out.dtype == beside.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == layer.w1.grad.dtype == torch.float32  # the weights stay float32, as autocast's do
    torch.testing.assert_close(out.float(), layer(x.detach()), rtol=2e-2, atol=2e-2)


def _calibrated():
    from fastdist.moe import calibrate
    return dict(vars(calibrate(None, d_model=32, d_ff=64, tokens=256, num_experts=4, k=2, reps=3)))


def test_calibration_gives_every_rank_the_same_constants_including_transfer_and_layer_work():
    first, second = spawn(_calibrated, 2, backend="gloo", timeout=120, threads_per_rank=1)
    assert first == second  # the slowest rank's figures everywhere: the planners agree
    assert first["flops_per_s"] > 0 and first["a2a_bytes_per_s"] > 0 and first["a2a_alpha_s"] >= 0
    assert first["p2p_compute_s_per_byte"] >= 0
    assert first["overhead_s_per_assignment"] > 0  # gate, route, layout, permute, combine take time


def _calibrated_on_one_core():
    from fastdist.moe import calibrate
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # both ranks on one core, one thread each
    return dict(vars(calibrate(None, d_model=32, d_ff=64, tokens=256, num_experts=4, k=2, reps=3)))


@pytest.fixture(scope="module")
def calibrated_on_one_core():
    """Rank 0's constants calibrated with both ranks on one core."""
    return spawn(_calibrated_on_one_core, 2, backend="gloo", timeout=120, threads_per_rank=1)[0]


def test_calibration_records_ranks_that_share_a_core(calibrated_on_one_core):
    assert calibrated_on_one_core["rank_hosts"] == (0, 0) and calibrated_on_one_core["host_slots"] == (1,)


@pytest.mark.timing
def test_ranks_that_share_a_core_have_their_rate_measured_one_rank_at_a_time(calibrated_on_one_core):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("compares ranks sharing one core with ranks on a core each: needs two cores")
    shared = calibrated_on_one_core
    dedicated, _ = spawn(_calibrated, 2, backend="gloo", timeout=120, threads_per_rank=1)
    assert dedicated["rank_hosts"] == () and dedicated["host_slots"] == ()
    # the rate of a rank alone on the core: close to what it is with a core per rank, not half of it
    assert shared["flops_per_s"] > 0.6 * dedicated["flops_per_s"]
