"""fastdist.netsim: the simulated cluster (namespaces, shaped links, guaranteed teardown).

Tests that build namespaces need root and iproute2; they are marked `netsim` and skipped with the reason
`netsim.available()` gives. Helper processes load netsim.py on its own (it imports nothing from torch), so
each starts in a few tens of milliseconds.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fastdist import netsim

# A helper process's preamble: load netsim.py standalone, as `netsim`.
_LOAD = textwrap.dedent(f"""\
    import importlib.util, json, os, socket, sys, time
    _spec = importlib.util.spec_from_file_location("netsim", {netsim.__file__!r})
    netsim = importlib.util.module_from_spec(_spec)
    sys.modules["netsim"] = netsim
    _spec.loader.exec_module(netsim)
""")


def _helper(code, *args, env=None):
    """A Python process running `code` (after the preamble) with sys.argv[1:] = args."""
    # SIGINT back to its default: a test runner started as a background job has it ignored, and an
    # ignored SIGINT is (rightly) left alone by the cluster, which would defeat the Ctrl-C tests.
    return subprocess.Popen([sys.executable, "-c", _LOAD + textwrap.dedent(code), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"helper exited with {proc.returncode}:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def _netns_names():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _tagged(tag):
    return sorted(n for n in _netns_names() if n.startswith(tag + "-"))


# --------------------------------------------------------------------------------------------------
# rates, delays, parameters (no root needed)

@pytest.mark.parametrize("text, bits", [
    ("1gbit", 10**9), ("10gbit", 10**10), ("100mbit", 10**8), ("2.5gbit", 2_500_000_000), ("800kbit", 800_000),
    ("1Gbit", 10**9), (" 40 gbit ", 4 * 10**10), ("1 Gbit/s", 10**9), ("1e9", 10**9), ("1mibit", 2**20),
    ("12345", 12345), ("5bit", 5), (1_000_000, 1_000_000),
])
def test_parse_rate_reads_tc_units_and_plain_integers_as_bits_per_second(text, bits):
    assert netsim.parse_rate(text) == bits
    assert isinstance(netsim.parse_rate(text), int)


@pytest.mark.parametrize("bad, match", [
    ("", "cannot parse"), ("fast", "cannot parse"), ("1 gigabit", "cannot parse"), ("1gbit2", "cannot parse"),
    ("-1gbit", "cannot parse"), ("0", "at least 1 bit"), ("0mbit", "at least 1 bit"), (0, "positive"),
    (-5, "positive"), ("10mbps", "bytes per second"), ("1gbps", "bytes per second"), (1.5, "integer"),
    (None, "integer"), (True, "integer"),
])
def test_parse_rate_rejects_bad_input_with_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        netsim.parse_rate(bad)


@pytest.mark.parametrize("bits, text", [
    (10**9, "1 Gbit/s"), (10**10, "10 Gbit/s"), (2_500_000_000, "2.5 Gbit/s"), (10**8, "100 Mbit/s"),
    (800_000, "800 kbit/s"), (999, "999 bit/s"), (0, "0 bit/s"),
])
def test_format_rate_writes_readable_units_that_parse_rate_reads_back(bits, text):
    assert netsim.format_rate(bits) == text
    if bits:
        assert netsim.parse_rate(text) == bits
    with pytest.raises(ValueError):
        netsim.format_rate(-1)


def test_parse_delay_reads_seconds_and_units_and_rejects_garbage():
    assert netsim.parse_delay(None) == 0.0
    assert netsim.parse_delay("1ms") == pytest.approx(1e-3)
    assert netsim.parse_delay("250us") == pytest.approx(250e-6)
    assert netsim.parse_delay(0.5) == 0.5
    assert netsim.parse_delay("2") == 2.0
    for bad in ("soon", "-1ms", -0.1, "1 parsec", True):
        with pytest.raises(ValueError):
            netsim.parse_delay(bad)
    assert netsim.format_delay(0.001) == "1 ms" and netsim.format_delay(250e-6) == "250 us"


def test_label_and_rate_are_known_before_the_cluster_is_built():
    c = netsim.Cluster(4, rate="1gbit")
    assert c.label == "netsim: 4 hosts, 1 Gbit/s links, no added delay, MTU 1500"
    assert c.rate_bits == 10**9
    assert netsim.Cluster(1, rate="2.5gbit", delay="1ms", mtu=9000).label == \
        "netsim: 1 host, 2.5 Gbit/s links, 1 ms one-way delay, MTU 9000"
    with pytest.raises(RuntimeError, match="not started|new"):
        c.hosts
    with pytest.raises(RuntimeError):
        c.placement(0)
    c.close()  # closing a cluster that was never built is a no-op


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_hosts=0), "num_hosts"), (dict(num_hosts=254), "num_hosts"), (dict(num_hosts=2.0), "num_hosts"),
    (dict(num_hosts=2, mtu=10), "mtu"), (dict(num_hosts=2, name="a/b"), "name"),
    (dict(num_hosts=2, rate="fast"), "rate"), (dict(num_hosts=2, delay="later"), "delay"),
])
def test_cluster_rejects_bad_arguments_before_touching_the_system(kwargs, match):
    with pytest.raises(ValueError, match=match):
        netsim.Cluster(**kwargs)


@pytest.mark.parametrize("rate", ["10mbit", "100mbit", "1gbit", "10gbit"])
def test_tbf_burst_covers_a_timer_tick_and_the_queue_holds_many_frames(rate):
    bits = netsim.parse_rate(rate)
    burst, limit = netsim.shaping(bits, mtu=1500)
    assert burst >= bits / 8 / netsim._kernel_hz() and burst >= 2 * 1514
    assert limit >= burst + 1000 * 1514 and limit >= burst + bits / 8 * 0.010
    _, limit_with_delay = netsim.shaping(bits, mtu=1500, delay_s=0.005)
    assert limit_with_delay >= limit + bits / 8 * 0.010  # plus the round trip's bandwidth-delay product


def test_available_explains_why_without_root(monkeypatch):
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    ok, why = netsim._probe()
    assert not ok and "root" in why


def test_enter_namespace_names_the_missing_namespace():
    with pytest.raises(FileNotFoundError, match="fdsim-no-such-namespace"):
        netsim.enter_namespace("fdsim-no-such-namespace")
    with pytest.raises(ValueError):
        netsim.enter_namespace("../etc")


def test_counters_of_the_calling_namespace_include_loopback():
    assert netsim.tx_bytes("lo") >= 0 and netsim.rx_bytes("lo") >= 0
    with pytest.raises(ValueError, match="no interface"):
        netsim.tx_bytes("fdsim-none")


# --------------------------------------------------------------------------------------------------
# building and tearing down

@pytest.mark.netsim
def test_namespaces_exist_inside_the_with_block_and_are_all_gone_after_it():
    handler_before = signal.getsignal(signal.SIGTERM)
    with netsim.Cluster(3, rate="1gbit", name="life") as c:
        if handler_before is signal.SIG_DFL:  # SIGTERM would kill us without cleanup: netsim takes it over
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        names = c.namespaces
        assert len(names) == 4 and all(n.startswith("fdsim-") and c.tag in n for n in names)
        assert set(names) <= _netns_names()
        assert [h.ip for h in c.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert all(h.ifname == "eth0" for h in c.hosts) and c.master_addr == "198.18.0.1"
        netns, env = c.placement(2)
        assert netns == c.hosts[2].netns
        assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == "198.18.0.1"
        with pytest.raises(ValueError, match="rank"):
            c.placement(3)
        shown = subprocess.run(["tc", "-n", c.bridge_netns, "qdisc", "show", "dev", "p1"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "rate 1Gbit" in shown
        shown = subprocess.run(["tc", "-n", c.hosts[1].netns, "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "rate 1Gbit" in shown
    assert not set(names) & _netns_names()
    assert not c.is_up
    assert signal.getsignal(signal.SIGTERM) is handler_before  # handed back
    c.close()  # idempotent


@pytest.mark.netsim
def test_nothing_appears_in_the_root_namespace_while_a_cluster_is_up():
    def root_state():
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines()}
        addrs = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
        routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True,
                                check=True).stdout
        return names, addrs, routes

    before_links, _, _ = root_state()
    with netsim.Cluster(2, rate="1gbit"):
        links, addrs, routes = root_state()
    assert links <= before_links, f"new interfaces in the root namespace: {links - before_links}"
    assert "198.18." not in addrs and "198.18." not in routes


@pytest.mark.netsim
def test_cluster_is_removed_when_the_body_raises():
    with pytest.raises(ZeroDivisionError):
        with netsim.Cluster(2, rate="100mbit") as c:
            tag = c.tag
            assert len(_tagged(tag)) == 3
            1 / 0
    assert _tagged(tag) == []


@pytest.mark.netsim
def test_a_setup_failing_half_way_removes_what_it_had_built(monkeypatch):
    real_run = netsim._run
    calls = []

    def failing_run(argv, **kwargs):
        calls.append(argv)
        if argv[0] == "tc" and any(a.endswith("-h1") for a in argv):
            raise netsim.NetsimError("injected failure")
        return real_run(argv, **kwargs)

    monkeypatch.setattr(netsim, "_run", failing_run)
    c = netsim.Cluster(3, rate="100mbit")
    with pytest.raises(netsim.NetsimError, match="injected"):
        c.start()
    created = [a[3] for a in calls if a[:3] == ["ip", "netns", "add"]]
    assert len(created) == 3  # switch, host 0, host 1: a real partial state was torn down
    assert _tagged(c.tag) == []
    assert not c.is_up
    with pytest.raises(RuntimeError, match="built once"):
        c.start()


@pytest.mark.netsim
def test_concurrent_clusters_get_distinct_names():
    with netsim.Cluster(2) as a, netsim.Cluster(2) as b:
        assert a.tag != b.tag and not set(a.namespaces) & set(b.namespaces)
        assert set(a.namespaces + b.namespaces) <= _netns_names()
    assert _tagged(a.tag) == [] and _tagged(b.tag) == []


# --------------------------------------------------------------------------------------------------
# traffic

_SERVER = """
    netsim.enter_namespace(sys.argv[1])
    srv = socket.socket(); srv.bind((sys.argv[2], 5000)); srv.listen(4)
    print("ready", flush=True)
    conn, peer = srv.accept()
    msg = conn.recv(100)
    conn.sendall(b"pong:" + msg)
    conn.close()
    print(json.dumps({"peer": peer[0], "msg": msg.decode()}), flush=True)
"""

_CLIENT = """
    netsim.enter_namespace(sys.argv[1])
    s = socket.create_connection((sys.argv[2], 5000), timeout=10)
    s.sendall(b"ping")
    print(json.dumps({"reply": s.recv(100).decode(), "local": s.getsockname()[0]}), flush=True)
"""


@pytest.mark.netsim
def test_two_hosts_reach_each_other_over_tcp_through_the_switch():
    with netsim.Cluster(3, rate="1gbit") as c:
        src, dst = c.hosts[0], c.hosts[2]
        server = _helper(_SERVER, dst.netns, dst.ip)
        assert server.stdout.readline().strip() == "ready"
        client = _helper(_CLIENT, src.netns, dst.ip)
        assert _finish(client) == {"reply": "pong:ping", "local": src.ip}
        assert _finish(server) == {"peer": src.ip, "msg": "ping"}


_RECEIVER = """
    netsim.enter_namespace(sys.argv[1])
    srv = socket.socket(); srv.bind((sys.argv[2], 5001)); srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = memoryview(bytearray(4 << 20))
    got, t0 = 0, None
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        got += n
    conn.close()
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}), flush=True)
"""

_SENDER = """
    netsim.enter_namespace(sys.argv[1])
    nbytes = int(sys.argv[3])
    tx0 = netsim.tx_bytes()
    s = socket.create_connection((sys.argv[2], 5001), timeout=60)
    chunk, left = memoryview(bytes(4 << 20)), nbytes
    while left:
        left -= s.send(chunk[:min(left, len(chunk))])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the receiver closes once it has everything: all bytes have left this host by now
    s.close()
    print(json.dumps({"tx": netsim.tx_bytes() - tx0}), flush=True)
"""


@pytest.mark.netsim
@pytest.mark.timing
@pytest.mark.parametrize("rate, megabytes", [("200mbit", 25), ("500mbit", 50)])
def test_a_shaped_link_delivers_its_configured_rate_within_20_percent(rate, megabytes):
    nbytes = megabytes * 10**6
    with netsim.Cluster(2, rate=rate) as c:
        src, dst = c.hosts
        outside_tx0 = src.tx_bytes()
        receiver = _helper(_RECEIVER, dst.netns, dst.ip)
        assert receiver.stdout.readline().strip() == "ready"
        sender = _helper(_SENDER, src.netns, dst.ip, nbytes)
        sent = _finish(sender)
        got = _finish(receiver)
        outside_tx = src.tx_bytes() - outside_tx0
        stats = c.link_stats(0)
    assert got["bytes"] == nbytes
    throughput = nbytes * 8 / got["seconds"]
    # The rate counts Ethernet frames; TCP payload is 1448 of each 1514-byte frame (95.6 %).
    assert 0.8 * c.rate_bits <= throughput <= 1.2 * c.rate_bits, \
        f"{netsim.format_rate(throughput)} payload on a {netsim.format_rate(c.rate_bits)} link"
    assert sent["tx"] >= nbytes and outside_tx >= nbytes  # the sender's NIC counted at least the payload
    assert stats["tx"]["bytes"] >= nbytes  # and it all went through the host's tbf


def _all_reduce_on_the_cluster(numel):
    import torch
    import torch.distributed as dist

    t = torch.full((numel,), float(dist.get_rank() + 1))
    tx0 = netsim.tx_bytes()
    dist.all_reduce(t)
    return {"sum": t, "tx": netsim.tx_bytes() - tx0,
            "netns": os.environ["FASTDIST_NETSIM_NETNS"], "gloo_if": os.environ["GLOO_SOCKET_IFNAME"]}


@pytest.mark.netsim
def test_gloo_ranks_placed_on_the_cluster_all_reduce_over_the_shaped_links():
    import torch

    distributed = pytest.importorskip("fastdist.distributed")
    numel = 1 << 20  # 4 MB of float32
    with netsim.Cluster(2, rate="1gbit") as c:
        results = distributed.spawn(_all_reduce_on_the_cluster, 2, numel, backend="gloo", cluster=c, timeout=120)
        assert [r["netns"] for r in results] == [h.netns for h in c.hosts]
    for r in results:
        assert torch.equal(r["sum"], torch.full((numel,), 1.0 + 2.0))  # ranks 0 and 1 contributed 1 and 2
        assert r["gloo_if"] == "eth0"
        assert r["tx"] >= numel * 4 // 2  # each rank sent at least its half of the ring over eth0


# --------------------------------------------------------------------------------------------------
# teardown when the process is interrupted

_HOLDER = """
    c = netsim.Cluster(2, rate="100mbit")
    c.start() if os.environ.get("NO_WITH") else c.__enter__()
    print(json.dumps(c.namespaces), flush=True)
    if os.environ.get("NO_WITH"):
        sys.exit(0)  # neither close() nor a with block: atexit must tear down
    time.sleep(60)
"""


def _start_holder(env=None):
    proc = _helper(_HOLDER, env=env)
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=30)[1]
    names = json.loads(line)
    return proc, names


@pytest.mark.netsim
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_sigterm_or_ctrl_c_to_the_holding_process_tears_the_cluster_down(sig, code):
    proc, names = _start_holder()
    assert set(names) <= _netns_names()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err  # an uncaught KeyboardInterrupt exits "killed by SIGINT"
    assert not set(names) & _netns_names()


_SLOW_SETUP = """
    real_run = netsim._run
    def run_then_stall(argv, **kwargs):
        result = real_run(argv, **kwargs)
        if argv[:3] == ["ip", "netns", "add"] and argv[3].endswith("-h0"):
            print(json.dumps(argv[3][:-len("-h0")]), flush=True)
            time.sleep(60)  # half built: the switch and host 0 exist, hosts 1 and 2 do not
        return result
    netsim._run = run_then_stall
    with netsim.Cluster(3, rate="100mbit"):
        pass
"""


@pytest.mark.netsim
def test_sigterm_during_setup_removes_the_half_built_cluster():
    proc = _helper(_SLOW_SETUP)
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=30)[1]
    tag = json.loads(line)
    assert _tagged(tag) == [f"{tag}-br", f"{tag}-h0"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _tagged(tag) == []


@pytest.mark.netsim
def test_a_cluster_left_open_is_torn_down_at_interpreter_exit():
    proc, names = _start_holder(env={"NO_WITH": "1"})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not set(names) & _netns_names()


@pytest.mark.netsim
def test_cleanup_removes_the_leftovers_of_a_process_killed_with_sigkill():
    proc, names = _start_holder()
    proc.kill()
    proc.wait(timeout=30)
    assert set(names) <= _netns_names()  # SIGKILL cannot be caught: the namespaces are left behind
    with netsim.Cluster(2) as mine:  # a live cluster of a running process survives only_dead=True
        removed = netsim.cleanup(only_dead=True)
        assert set(names) <= set(removed)
        assert not set(names) & _netns_names()
        assert set(mine.namespaces) <= _netns_names()
    assert not set(names) & set(netsim.cleanup(only_dead=True))  # idempotent


@pytest.mark.netsim
def test_plain_cleanup_keeps_the_live_clusters_of_running_processes_and_removes_those_of_killed_ones():
    proc, theirs = _start_holder()
    try:
        with netsim.Cluster(2) as mine:
            netsim.cleanup()  # what `fastdist-bench --netsim-cleanup` runs while both clusters are in use
            assert set(theirs) <= _netns_names() and set(mine.namespaces) <= _netns_names()
            proc.kill()
            proc.wait(timeout=30)
            removed = netsim.cleanup()
            assert set(theirs) <= set(removed) and not set(theirs) & _netns_names()
            assert set(mine.namespaces) <= _netns_names()
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.mark.netsim
def test_cleanup_removes_a_namespace_whose_owner_pid_now_belongs_to_another_process():
    # Named after this running process's pid with another start time: the process that made it is gone, and its
    # pid went to us.
    stale = f"{netsim.PREFIX}{os.getpid()}-s1-1-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netsim.Cluster(1) as mine:
            removed = netsim.cleanup()
            assert stale in removed and stale not in _netns_names()
            assert set(mine.namespaces) <= _netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


# --------------------------------------------------------------------------------------------------
# latency

@pytest.mark.netsim
def test_delay_without_netem_in_the_kernel_raises_netsim_unavailable_naming_sch_netem():
    if netsim._kernel_option("CONFIG_NET_SCH_NETEM") != "n":
        pytest.skip("this kernel has (or may have) sch_netem")
    c = netsim.Cluster(2, rate="1gbit", delay="1ms")
    with pytest.raises(netsim.NetsimUnavailable, match="CONFIG_NET_SCH_NETEM") as info:
        c.start()
    assert "netem" in str(info.value)
    assert not c.is_up and (not c.tag or _tagged(c.tag) == [])
