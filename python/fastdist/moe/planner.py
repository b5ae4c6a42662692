"""Expert placement: which ranks hold a replica of which expert, decided from the last step's token counts.

Everything here is pure integer/float arithmetic on a count matrix ``counts[s, e]`` (tokens that rank ``s`` routes to
expert ``e``, kept after capacity), so every rank computes the same plan from the same all-gathered counts and no plan
is ever broadcast. Experts are owned contiguously: rank ``r`` owns ``[r E/R, (r+1) E/R)``.

A token of rank ``s`` for expert ``e`` is computed on ``s`` when ``s`` owns or holds a replica of ``e``, else at the
owner. From a plan follow, per rank ``r``: ``H[r]`` tokens computed, ``OUT[r]`` tokens sent to other ranks, ``IN[r]``
tokens received.

Cost model (Pro-Prophet, arXiv 2411.10003, section 4; constants measured by :func:`fastdist.moe.calibrate`)::

    T_a2a   = alpha + max_r max(IN[r], OUT[r]) * d * bytes / a2a_bytes_per_s
    T_fec   = max_r H[r] * flops_per_token / flops_per_s           (expert forward)
    T_bec   = 2 T_fec
    T_trans = max_r max(params sent by r, params received by r) * bytes / p2p_bytes_per_s
    T_agg   = T_trans                                               (the gradients go back the same way)
    T       = 4 T_a2a + 3 T_fec + max(0, T_trans - T_fec - T_fnec) + max(0, T_agg - T_bec - T_bnec)

T_trans is the busiest rank's replica traffic on point-to-point links (the layer sends each replica from its owner
to its holder) rather than the paper's ``sum / R``, which assumes a perfectly spread broadcast.

Ranks that share a host's cores (more ranks than the cores fit at the ranks' thread counts; never on GPUs here) do
not compute side by side: T_fec is then the time the host's processor sharing takes to finish all its ranks' H[r]
(:func:`shared_makespan`), with flops_per_s a rank's rate when it runs alone. Balance buys less there: once the
busiest rank runs alone it gets a whole core's worth of the host.
"""
import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["CostModel", "Plan", "Planner", "loads", "plan_prophet", "plan_replicate_topk", "plan_shadow",
           "shared_makespan"]


def shared_makespan(work: Sequence[float], slots: int) -> float:
    """Time for jobs of ``work`` that share ``slots`` full-speed processors fairly -- each running job at
    min(1, slots / running) -- to all finish: the CPU scheduler's processor sharing. Equals max(work) when there
    are no more jobs than slots.

    Args:
        work: one job per rank, in a rank's solo time units.
        slots: the processors the jobs share.
    """
    elapsed = done = 0.0
    work = sorted(float(w) for w in work)
    for i, w in enumerate(work):
        rate = min(1.0, slots / (len(work) - i))
        elapsed += (w - done) / rate
        done = w
    return elapsed


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Constants of the cost model (seconds, bytes, flops) and the layer's shape."""
    d_model: int
    d_ff: int
    a2a_alpha_s: float          # all-to-all latency
    a2a_bytes_per_s: float      # all-to-all bandwidth per rank
    flops_per_s: float          # expert GEMM throughput
    p2p_bytes_per_s: float      # replica parameter / gradient link rate
    elem_bytes: int = 4
    nec_fwd_s: float = 0.0      # non-expert compute the replica traffic can hide behind (forward)
    nec_bwd_s: float = 0.0      # (backward)
    # compute seconds a replica transfer takes from the computation beside it, per byte sent or received: on a CPU,
    # gloo and the network stack copy every byte on the cores that compute, so overlapping hides only the
    # transfer's waiting
    p2p_compute_s_per_byte: float = 0.0
    # the layer's own work per routed assignment, forward + backward: gate, route, layout, permute and combine. The
    # same under every plan, so it never changes a choice; it makes the prediction a layer time, not an expert time
    overhead_s_per_assignment: float = 0.0
    # Ranks that share cores: host index of every group rank, and per host how many ranks it runs at full speed at
    # once. Empty: every rank computes on its own device (GPUs; or ranks on their own cores).
    rank_hosts: tuple = ()
    host_slots: tuple = ()

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs of one token through one expert."""
        return 4 * self.d_model * self.d_ff  # two GEMMs, 2 flops per multiply-add

    @property
    def params_per_expert(self) -> int:
        """Parameters of one expert (two weights, two biases)."""
        return 2 * self.d_model * self.d_ff + self.d_model + self.d_ff

    def compute_tokens(self, h: np.ndarray) -> float:
        """The expert compute of per-rank loads ``h`` in a rank's solo token-times: max(h) on dedicated devices, the
        slowest host's processor-sharing makespan where ranks share cores."""
        if not self.rank_hosts:
            return float(np.max(h)) if len(h) else 0.0
        hosts = np.asarray(self.rank_hosts)
        return max(shared_makespan(np.asarray(h)[hosts == host], slots) for host, slots in enumerate(self.host_slots))

    def time(self, counts: np.ndarray, plan: "Plan") -> tuple[float, dict[str, float]]:
        """Predicted seconds of one forward + backward of the layer under ``plan``, and its parts.

        Args:
            counts: ``[ranks, experts]`` tokens each rank routes to each expert.
            plan: the replicas.

        Returns:
            (total seconds, {part: seconds}) with the parts of the module docstring's formula.
        """
        h, inbound, outbound = loads(counts, plan)
        world = counts.shape[0]
        t_a2a = self.a2a_alpha_s + max(int(np.max(np.maximum(inbound, outbound))), 0) * self.d_model * \
            self.elem_bytes / self.a2a_bytes_per_s
        t_fec = self.compute_tokens(h) * self.flops_per_token / self.flops_per_s
        t_bec = 2 * t_fec
        sent = np.zeros(world, dtype=np.int64)
        received = np.zeros(world, dtype=np.int64)
        per_rank = counts.shape[1] // world
        for e, holder in plan.replicas:
            sent[e // per_rank] += 1
            received[holder] += 1
        t_trans = int(np.max(np.maximum(sent, received))) * self.params_per_expert * self.elem_bytes / \
            self.p2p_bytes_per_s if plan.replicas else 0.0
        t_ptrans = max(0.0, t_trans - t_fec - self.nec_fwd_s)
        t_pagg = max(0.0, t_trans - t_bec - self.nec_bwd_s)
        # parameters out in forward, gradients back in backward: each costs its bytes' compute on both ends
        t_tcomp = 2 * int(np.max(sent + received)) * self.params_per_expert * self.elem_bytes * \
            self.p2p_compute_s_per_byte
        t_overhead = int(counts.sum(axis=1).max()) * self.overhead_s_per_assignment
        total = 4 * t_a2a + 3 * t_fec + t_ptrans + t_pagg + t_tcomp + t_overhead
        return total, {"a2a": t_a2a, "fec": t_fec, "trans": t_trans, "ptrans": t_ptrans, "pagg": t_pagg,
                       "trans_compute": t_tcomp, "overhead": t_overhead}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Replicas as sorted (expert, holder rank) pairs; the owner never appears as a holder."""
    replicas: tuple = ()

    def holders(self, expert: int) -> list[int]:
        """The ranks holding a replica of ``expert``."""
        return [r for e, r in self.replicas if e == expert]

    def replicated_on(self, rank: int) -> list[int]:
        """The experts ``rank`` holds a replica of."""
        return [e for e, r in self.replicas if r == rank]

    def with_replica(self, expert: int, rank: int) -> "Plan":
        """This plan plus a replica of ``expert`` on ``rank``."""
        return Plan(tuple(sorted(set(self.replicas) | {(expert, rank)})))


def destinations(counts_shape: tuple[int, int], plan: Plan) -> np.ndarray:
    """``dest[s, e]``: the rank that computes rank ``s``'s tokens for expert ``e`` under ``plan``, for a count
    matrix of shape ``counts_shape`` = (ranks, experts)."""
    world, experts = counts_shape
    per_rank = experts // world
    dest = np.repeat((np.arange(experts) // per_rank)[None, :], world, axis=0)
    for e, holder in plan.replicas:
        dest[holder, e] = holder
    return dest


def loads(counts: np.ndarray, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H, IN, OUT) per rank under ``plan``, int64 arrays: tokens computed, received from and sent to other ranks.

    Args:
        counts: ``[ranks, experts]`` tokens each rank routes to each expert.
        plan: the replicas.
    """
    counts = np.asarray(counts, dtype=np.int64)
    world = counts.shape[0]
    dest = destinations(counts.shape, plan)
    h = np.zeros(world, dtype=np.int64)
    np.add.at(h, dest.reshape(-1), counts.reshape(-1))
    remote = dest != np.arange(world)[:, None]
    outbound = np.where(remote, counts, 0).sum(axis=1)
    inbound = np.zeros(world, dtype=np.int64)
    np.add.at(inbound, dest[remote], counts[remote])
    return h, inbound, outbound


def _check(counts, max_replicas_per_rank):
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] % counts.shape[0]:
        raise ValueError(f"fastdist: counts must be [ranks, experts] with ranks dividing experts, got {counts.shape}")
    if (counts < 0).any():
        raise ValueError("fastdist: counts must be >= 0")
    if max_replicas_per_rank < 0:
        raise ValueError(f"fastdist: max_replicas_per_rank must be >= 0, got {max_replicas_per_rank}")
    return counts


def plan_prophet(counts: np.ndarray, cost: CostModel, max_replicas_per_rank: int = 2, budget: int | None = None,
                 stop_alpha: float = 0.05, width: int = 4,
                 from_shadow: bool = True) -> tuple[Plan, list[tuple[Plan, float]]]:
    """Pro-Prophet's greedy search. Returns (best plan, [(plan, predicted time) of every state visited]).

    Each step takes the most loaded rank (ties: lower rank) and its `width` experts with the most tokens from other
    ranks. For each such expert the candidate moves are: a replica on the rank sending it the most tokens, one on
    the second, or replicas on every sender (among ranks below `max_replicas_per_rank`). The step makes the move
    with the lowest predicted time (ties: more tokens moved, then lower expert id, then lower ranks) -- the paper's
    choice of expert and senders, refined by the cost model so that replicas whose traffic costs more than they
    save are passed over. The best state by predicted time wins (the starting plan included), so more budget never
    predicts worse. A search stops after `budget` steps (default ranks * max_replicas_per_rank), when
    max(H) - min(H) < stop_alpha * sum(counts) / ranks, or when no replica can be added.

    With `from_shadow`, a second search starts from the FasterMoE-style shadowing plan, so the search space includes
    it and the result never predicts worse than shadowing (a greedy step can be myopic where whole-expert
    broadcasts pay off together).

    Args:
        counts: ``[ranks, experts]`` tokens each rank routes to each expert (ranks dividing experts).
        cost: the cost model that judges every move.
        max_replicas_per_rank: replicas one rank may hold.
        budget: the most steps of a search (default ranks * max_replicas_per_rank).
        stop_alpha: the balance at which a search stops, as a fraction of the mean load.
        width: experts of the busiest rank considered per step.
        from_shadow: also search from the shadowing plan.

    Raises:
        ValueError: a bad count matrix or a negative replica limit.
    """
    best_plan, history = _greedy(counts, cost, Plan(), max_replicas_per_rank, budget, stop_alpha, width)
    if from_shadow:
        seeded_plan, seeded = _greedy(counts, cost, plan_shadow(counts, cost, max_replicas_per_rank),
                                      max_replicas_per_rank, budget, stop_alpha, width)
        if cost.time(counts, seeded_plan)[0] < cost.time(counts, best_plan)[0]:
            best_plan = seeded_plan
        history = history + seeded
    return best_plan, history


def _greedy(counts, cost, start, max_replicas_per_rank, budget, stop_alpha, width):
    counts = _check(counts, max_replicas_per_rank)
    world, experts = counts.shape
    budget = world * max_replicas_per_rank if budget is None else budget
    per_rank = experts // world
    plan = start
    best_plan, best_time = plan, cost.time(counts, plan)[0]
    history = [(plan, best_time)]
    held = np.bincount(np.array([r for _, r in plan.replicas], dtype=np.int64), minlength=world)
    for _ in range(budget):
        h, _, _ = loads(counts, plan)
        if h.max() - h.min() < stop_alpha * counts.sum() / world:
            break
        busiest = int(np.argmax(h))
        dest = destinations(counts.shape, plan)
        # Experts computed on the busiest rank, by their tokens from other ranks, most first.
        remote_tokens = np.where((dest == busiest) & (np.arange(world)[:, None] != busiest), counts, 0).sum(axis=0)
        candidates = []
        for e in sorted(range(experts), key=lambda e: (-remote_tokens[e], e)):
            if remote_tokens[e] == 0 or len({c[1] for c in candidates}) >= width:
                break
            senders = [s for s in range(world) if dest[s, e] == busiest and s != busiest and s != e // per_rank
                       and held[s] < max_replicas_per_rank and counts[s, e] > 0]
            ranked = sorted(senders, key=lambda s: (-counts[s, e], s))
            groups = [ranked[:1], ranked[1:2], ranked] if len(ranked) > 2 else [[s] for s in ranked]
            for group in groups:
                if not group:
                    continue
                trial = plan
                for s in group:
                    trial = trial.with_replica(e, s)
                moved = int(sum(counts[s, e] for s in group))
                candidates.append((cost.time(counts, trial)[0], -moved, e, tuple(group), trial))
        if not candidates:
            break
        t, _, _, holders, plan = min(candidates, key=lambda c: c[:4])
        held[list(holders)] += 1
        history.append((plan, t))
        if t < best_time:
            best_plan, best_time = plan, t
    return best_plan, history


def plan_shadow(counts: np.ndarray, cost: CostModel, max_replicas_per_rank: int = 2) -> Plan:
    """FasterMoE-style shadowing: broadcast the heaviest experts to every rank while the cost model says it helps
    (at most ``max_replicas_per_rank`` experts; ``counts`` as for :func:`plan_prophet`)."""
    counts = _check(counts, max_replicas_per_rank)
    world, experts = counts.shape
    per_rank = experts // world
    plan, best = Plan(), cost.time(counts, Plan())[0]
    for step, e in enumerate(sorted(range(experts), key=lambda e: (-counts[:, e].sum(), e))):
        if step >= max_replicas_per_rank:
            break
        trial = plan
        for r in range(world):
            if r != e // per_rank:
                trial = trial.with_replica(e, r)
        t = cost.time(counts, trial)[0]
        if t >= best:
            break
        plan, best = trial, t
    return plan


def plan_replicate_topk(counts: np.ndarray, max_replicas_per_rank: int = 2) -> Plan:
    """Replicates the ``max_replicas_per_rank`` heaviest experts of ``counts`` on every rank, whatever the cost."""
    counts = _check(counts, max_replicas_per_rank)
    world, experts = counts.shape
    per_rank = experts // world
    plan = Plan()
    for e in sorted(range(experts), key=lambda e: (-counts[:, e].sum(), e))[:max_replicas_per_rank]:
        for r in range(world):
            if r != e // per_rank:
                plan = plan.with_replica(e, r)
    return plan


class Planner:
    """Chooses the plan for the next step from this step's counts; checks its model against measured steps.

    A new plan replaces the current one only when it is predicted (on the same counts) to be at least
    ``replan_gain`` faster, and a plan with replicas is used only when it beats the plan without any by more than
    the model's measured error: the predicted gain, net of the replicas' transfers, must exceed what the model is
    observed to get wrong. Each step's measured time (:meth:`observe`) corrects the predictions of its kind of plan
    (with replicas, or without) by the measured/predicted ratio of recent steps of that kind, so a machine slower or
    busier than at calibration, or replicas costing more than modelled, move the choice back to no replicas; a
    kind's measurements older than ``recheck_steps`` are forgotten, so replicas are tried again after that many
    steps. Pure and deterministic: equal inputs (counts and measured times, which the layer takes as the slowest
    rank's) give equal plans on every rank.

    A search costs milliseconds of Python on the cores the ranks compute on, so the search is skipped while its last
    result stands: when the last search kept the plan, the next one waits twice as many planning steps (up to
    ``max_search_interval``), unless the current plan's corrected prediction on this step's counts moves from the
    one at that search by more than the margin a new plan must beat (the model's error), which searches at once.
    A search that changes the plan resets the wait to one step.

    Args:
        strategy: ``"prophet"``, ``"shadow"``, ``"replicate_topk"`` or ``"none"``.
        cost: the cost model (None until calibrated; "replicate_topk" and "none" do not need it).
        max_replicas_per_rank, budget, stop_alpha: as for :func:`plan_prophet`.
        plan_interval: reconsider the plan every this many steps.
        replan_gain: the predicted gain a new plan needs, as a fraction; also the model's error until measured.
        recheck_steps: how long a measurement counts, in steps.
        window: the measurements per kind of plan that correct and judge the model.
        max_search_interval: the most planning steps between two searches while the load holds (1: search every
            planning step).
    """

    def __init__(self, strategy: str, cost: CostModel | None, max_replicas_per_rank: int = 2, plan_interval: int = 1,
                 replan_gain: float = 0.03, budget: int | None = None, stop_alpha: float = 0.05,
                 recheck_steps: int = 64, window: int = 16, max_search_interval: int = 8):
        if strategy not in ("prophet", "shadow", "replicate_topk", "none"):
            raise ValueError(f"fastdist: balance must be 'prophet', 'shadow', 'replicate_topk' or 'none', "
                             f"got {strategy!r}")
        if plan_interval < 1:
            raise ValueError(f"fastdist: plan_interval must be >= 1, got {plan_interval}")
        if max_search_interval < 1:
            raise ValueError(f"fastdist: max_search_interval must be >= 1, got {max_search_interval}")
        self.strategy = strategy
        self.cost = cost
        self.max_replicas_per_rank = max_replicas_per_rank
        self.plan_interval = plan_interval
        self.replan_gain = replan_gain
        self.budget = budget
        self.stop_alpha = stop_alpha
        self.recheck_steps = recheck_steps
        self.window = window
        self.max_search_interval = max_search_interval
        self.plan = Plan()
        self.steps = 0
        self.replans = 0
        self.last_counts = None
        self.last_plan = Plan()     # the plan the step of last_counts ran
        self.measured = []          # [step, 1 with replicas / 0 without, measured / predicted seconds]
        self.searches = 0
        self.searched = None        # the last search's [step, planning steps to the next, corrected prediction]

    def propose(self, counts: np.ndarray) -> Plan:
        """The strategy's plan for ``counts``, before hysteresis."""
        if self.strategy == "none":
            return Plan()
        if self.strategy == "prophet":
            return plan_prophet(counts, self.cost, self.max_replicas_per_rank, self.budget, self.stop_alpha)[0]
        if self.strategy == "shadow":
            return plan_shadow(counts, self.cost, self.max_replicas_per_rank)
        return plan_replicate_topk(counts, self.max_replicas_per_rank)

    def observe(self, seconds: float) -> None:
        """Records the measured seconds of the step that :meth:`update` saw last (its counts and plan).

        Args:
            seconds: the layer's forward + backward time of that step (> 0; other values are ignored).
        """
        if self.cost is None or self.last_counts is None or not seconds > 0:
            return
        predicted = self.cost.time(self.last_counts, self.last_plan)[0]
        if predicted > 0:
            kind = int(bool(self.last_plan.replicas))
            self.measured.append([self.steps, kind, seconds / predicted])
            if sum(m[1] == kind for m in self.measured) > self.window:  # keep a window of each kind
                self.measured.remove(next(m for m in self.measured if m[1] == kind))

    def _ratios(self, replicated):
        recent = [ratio for step, kind, ratio in self.measured
                  if kind == replicated and self.steps - step < self.recheck_steps]
        return recent[-self.window:]

    def correction(self, plan: Plan) -> float:
        """Measured over predicted seconds of recent steps of ``plan``'s kind (with replicas or without), the median;
        a kind not measured lately takes the other kind's, and 1 when neither was."""
        ratios = self._ratios(bool(plan.replicas)) or self._ratios(not plan.replicas)
        return float(np.median(ratios)) if ratios else 1.0

    def model_error(self) -> float:
        """The model's relative error left after :meth:`correction`: the mean deviation of recent measured/predicted
        ratios from their kind's median; ``replan_gain`` until three steps are measured."""
        deviations = []
        for replicated in (False, True):
            ratios = self._ratios(replicated)
            if ratios:
                middle = float(np.median(ratios))
                deviations += [abs(r / middle - 1.0) for r in ratios]
        return float(np.mean(deviations)) if len(deviations) >= 3 else self.replan_gain

    def predicted(self, counts: np.ndarray, plan: Plan) -> float:
        """The model's seconds for ``plan`` on ``counts``, corrected by the measured steps of its kind."""
        return self.cost.time(counts, plan)[0] * self.correction(plan)

    def update(self, counts: np.ndarray) -> Plan:
        """Records this step's counts; every plan_interval steps reconsiders the plan. Returns the plan to use next."""
        counts = np.asarray(counts, dtype=np.int64)
        self.last_counts = counts.copy()
        self.last_plan = self.plan
        self.steps += 1
        if self.steps % self.plan_interval:
            return self.plan
        if self.strategy in ("replicate_topk", "none"):
            proposal = self.propose(counts)
        else:
            # Replicas only where they beat no replicas by more than the model is seen to err.
            margin = max(self.replan_gain, self.model_error())
            if self._last_search_stands(counts, margin):
                return self.plan
            proposal = self.propose(counts)
            self.searches += 1
            if not (proposal != self.plan and self._clearly_better(counts, proposal, self.plan, self.replan_gain)):
                proposal = self.plan
            if proposal.replicas and not self._clearly_better(counts, proposal, Plan(), margin):
                proposal = Plan()
            wait = 1 if proposal != self.plan or self.searched is None else \
                min(2 * self.searched[1], self.max_search_interval)
            self.searched = [self.steps, wait, self.predicted(counts, proposal)]
        if proposal != self.plan:
            self.plan = proposal
            self.replans += 1
        return self.plan

    def _last_search_stands(self, counts, margin):
        """Whether the last search's result holds for ``counts``: its wait is not over and the plan's corrected
        prediction moved by no more than ``margin`` since."""
        if self.searched is None:
            return False
        step, wait, prediction = self.searched
        if self.steps - step >= wait * self.plan_interval or not prediction > 0:
            return False
        return abs(self.predicted(counts, self.plan) / prediction - 1.0) <= margin

    def _clearly_better(self, counts, proposal, current, gain):
        return self.predicted(counts, proposal) < (1 - gain) * self.predicted(counts, current)

    def state_dict(self) -> dict:
        """The plan, step counters, last counts, measured steps and the last search, as plain data."""
        return {"plan": [list(p) for p in self.plan.replicas], "steps": self.steps, "replans": self.replans,
                "last_counts": None if self.last_counts is None else self.last_counts.tolist(),
                "last_plan": [list(p) for p in self.last_plan.replicas], "measured": [list(m) for m in self.measured],
                "searches": self.searches, "searched": None if self.searched is None else list(self.searched),
                "strategy": self.strategy}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            ValueError: the state is another strategy's.
        """
        if state["strategy"] != self.strategy:
            raise ValueError(f"fastdist: planner state is for balance={state['strategy']!r}, this layer uses "
                             f"{self.strategy!r}")
        self.plan = Plan(tuple(sorted(tuple(p) for p in state["plan"])))
        self.steps = state["steps"]
        self.replans = state["replans"]
        self.last_counts = None if state["last_counts"] is None else np.asarray(state["last_counts"], dtype=np.int64)
        self.last_plan = Plan(tuple(sorted(tuple(p) for p in state.get("last_plan", []))))
        self.measured = [list(m) for m in state.get("measured", [])]
        self.searches = state.get("searches", 0)
        self.searched = None if state.get("searched") is None else list(state["searched"])
