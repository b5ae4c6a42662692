"""The 2D schedule's priority queue: a dense bucket waits while any table exchange is in flight and leaves when the
last one completes; jobs of one priority keep their order; a failing job reaches its waiter. Through
hybrid_parallel(prioritize=True) on 2 ranks, with one rank late to its tables' gradient exchange, each step's dense
all-reduce is issued only after this rank's table exchanges of that backward completed (observed by wrapping
torch.distributed, outside the queue), and training is bit for bit the run without the queue."""
import pytest
import torch
from fastdist.embedding import CollectiveQueue
from fastdist.embedding.schedule import DENSE, TABLES


class FakeWork:
    """A collective's handle whose completion the test decides."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future


def starter(started, name):
    def start():
        started.append(name)
        work = FakeWork()
        started_works[name] = work
        return work.future
    return start


started_works = {}


def test_a_dense_bucket_waits_for_every_table_exchange_in_flight_then_leaves():
    queue, started = CollectiveQueue(log=True), []
    first, second = FakeWork(), FakeWork()
    queue.track(first, TABLES)
    queue.track(second, TABLES)
    out = queue.submit(starter(started, "bucket 0"), DENSE)
    assert started == [] and queue.held == 1
    first.future.set_result(None)
    assert started == []  # one table exchange still in flight
    second.future.set_result(None)
    assert started == ["bucket 0"]
    assert not out.done()
    started_works["bucket 0"].future.set_result(torch.ones(2))
    assert torch.equal(out.value(), torch.ones(2)) and queue.idle()
    kinds = [(kind, priority) for _, kind, _, priority in queue.events]
    assert kinds == [("issue", TABLES), ("issue", TABLES), ("done", TABLES), ("done", TABLES), ("issue", DENSE),
                     ("done", DENSE)]


def test_an_idle_queue_issues_at_once_and_a_table_exchange_never_waits_for_a_bucket():
    queue, started = CollectiveQueue(), []
    queue.submit(starter(started, "bucket 0"), DENSE)
    assert started == ["bucket 0"]
    queue.track(FakeWork(), TABLES)  # issued by the tables whatever is in flight; only counted
    assert queue.held == 0


def test_buckets_keep_their_order_and_a_lower_priority_waits_for_the_buckets():
    queue, started = CollectiveQueue(), []
    table = FakeWork()
    queue.track(table, TABLES)
    queue.submit(starter(started, "bucket 0"), DENSE)
    queue.submit(starter(started, "bucket 1"), DENSE)
    queue.submit(starter(started, "later"), DENSE + 1)
    table.future.set_result(None)
    assert started == ["bucket 0", "bucket 1"]  # DDP's order: every rank issues its group's collectives alike
    started_works["bucket 0"].future.set_result(None)
    assert started == ["bucket 0", "bucket 1"]
    started_works["bucket 1"].future.set_result(None)
    assert started == ["bucket 0", "bucket 1", "later"]


def test_a_job_that_fails_to_start_reaches_its_waiter_and_frees_the_queue():
    queue = CollectiveQueue()

    def broken():
        raise RuntimeError("no such group")

    out = queue.submit(broken, DENSE)
    with pytest.raises(RuntimeError, match="no such group"):
        out.wait()
    assert queue.idle()


def test_prioritized_hybrid_parallel_holds_the_dense_all_reduce_behind_the_tables_and_trains_the_same(two_ranks):
    for rank, r in enumerate(two_ranks):
        ours, plain = r["dlrm-prioritized"], r["dlrm"]
        assert ours["losses"] == plain["losses"], rank
        for key, value in plain["state"].items():
            assert torch.equal(ours["state"][key], value), (rank, key)
        assert ours["idle"], rank
        for step, calls in enumerate(ours["backward"]):
            tables = [c for c in calls if c[0] == "alltoall"]
            dense = [c for c in calls if c[0] == "allreduce"]
            assert len(tables) == 2 and dense, (rank, step, calls)  # a gradient exchange per sharded table
            # every all-reduce (the dense bucket, the small unsharded table's sparse one) after the tables' last
            assert min(c[1] for c in dense) >= max(c[2] for c in tables), (rank, step, calls)
    # rank 1 reached its tables late, so rank 0's dense buckets were ready while its exchanges were in flight
    assert two_ranks[0]["dlrm-prioritized"]["held"] >= 3
