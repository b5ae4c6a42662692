"""A simulated cluster on one Linux box: one network namespace per host, shaped links, a switch.

    with netsim.Cluster(4, rate="1gbit") as cluster:
        netns, env = cluster.placement(rank)   # each rank process: enter_namespace(netns), then
                                               # os.environ.update(env), then init torch.distributed

Topology. Host i lives in network namespace ``<tag>-h<i>`` and owns ``eth0`` with address
198.18.0.(i+1)/24 (RFC 2544 benchmarking range; it exists only inside the namespaces). ``eth0`` is one
end of a veth pair whose other end, ``p<i>``, is a port of the Linux bridge ``br0`` living in its own
namespace ``<tag>-br``. Both veth ends are created directly inside their namespaces, so nothing ever
appears in the host's own namespace or routing table. Each link is shaped with tc in both directions --
egress of ``eth0`` (what the host sends) and egress of ``p<i>`` (what the switch delivers to the host) --
so every host has a full-duplex NIC of the given rate on a non-blocking switch. An optional one-way
latency is added with netem where the kernel has it.

The rate counts layer-2 frames (IP packet + 14-byte Ethernet header; no preamble, FCS or inter-frame
gap), so a long TCP stream with timestamps delivers about 1448/1514 = 95.6 % of it as payload.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``); `available()` says whether a
cluster can be built here and why not. Teardown is guaranteed while the process can still run code:
context manager, SIGTERM/SIGHUP (turned into a `Terminated` exception while a cluster is up), Ctrl-C, an
atexit fallback -- and for processes killed with SIGKILL, `cleanup()` (``fastdist-bench --netsim-cleanup``)
removes every leftover namespace. All names start with ``fdsim-<pid>-s<start time>-<n>``: the owning process's
pid and start time (in clock ticks since boot, from /proc), so that cleanup can tell a leftover from a live
cluster even after the owner's pid was reused.

This module imports nothing from torch or the rest of fastdist: a helper process can load the file on its
own (importlib), without the cost of importing torch.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import dataclasses
import errno
import gzip
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from typing import Callable, TypeVar

__all__ = [
    "NetsimUnavailable", "NetsimError", "Terminated", "Host", "Cluster",
    "available", "parse_rate", "format_rate", "parse_delay", "format_delay",
    "enter_namespace", "tx_bytes", "rx_bytes", "cleanup", "list_namespaces",
]

PREFIX = "fdsim-"
NETNS_RUN_DIR = "/var/run/netns"  # where `ip netns` keeps its bind mounts (iproute2's compiled-in default)
IFNAME = "eth0"
SUBNET = "198.18.0"  # RFC 2544 benchmarking network; host i gets SUBNET.(i+1)/24
MAX_HOSTS = 253
CLONE_NEWNET = 0x40000000
_ETH_HEADER = 14

_T = TypeVar("_T")


class NetsimUnavailable(RuntimeError):
    """A simulated cluster cannot be built on this machine (not root, no iproute2, a kernel feature missing)."""


class NetsimError(RuntimeError):
    """A command that builds or tears down the simulated cluster failed."""


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM/SIGHUP arrives while a cluster is up, so that the
    cluster's context manager tears it down. It is a SystemExit, so ``except Exception`` does not swallow
    it, and if nothing catches it the interpreter exits with status 128 + signal number, as a
    process killed by that signal would report in a shell.

    Args:
        signum: the signal that arrived (``signal.SIGTERM`` or ``signal.SIGHUP``).
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(128 + signum)

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


# ---------------------------------------------------------------------------------------------------
# rates and delays

_RATE_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE](?P<exp>[+-]?[0-9]+))?\s*"
                      r"(?P<unit>[a-zA-Z]*)(?P<per>/s)?\s*$")
_RATE_UNITS = {
    "": 1, "bit": 1,
    "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
}


def parse_rate(s: str | int) -> int:
    """A link rate in bits per second.

    Accepts tc's spelling ("800kbit", "100mbit", "1gbit", "2.5gbit", "10gbit"; k/m/g/t are powers of
    1000, ki/mi/gi/ti powers of 1024), the form `format_rate` writes ("1 Gbit/s"), and a plain integer
    (bits/s, as int or str). Raises ValueError for anything else -- in particular for "bps" units, which
    tc reads as *bytes* per second while people usually mean bits.
    """
    if isinstance(s, bool):
        raise ValueError(f"rate must be a string like '1gbit' or an integer number of bits/s, got {s!r}")
    if isinstance(s, int):
        if s <= 0:
            raise ValueError(f"rate must be positive, got {s} bit/s")
        return s
    if not isinstance(s, str):
        raise ValueError(f"rate must be a string like '1gbit' or an integer number of bits/s, got {s!r}")
    m = _RATE_RE.match(s)
    unit = m.group("unit").lower() if m else ""
    if m and unit.endswith("bps"):
        raise ValueError(f"ambiguous rate {s!r}: tc reads 'bps' as bytes per second; "
                         f"write bits, e.g. '{m.group('num')}{unit[:-3]}bit'")
    if m is None or unit not in _RATE_UNITS:
        raise ValueError(f"cannot parse rate {s!r}: expected a number with a unit among bit, kbit, mbit, "
                         f"gbit, tbit (or kibit, mibit, gibit), e.g. '1gbit', '2.5gbit', '100mbit', "
                         f"or an integer number of bits/s")
    value = float(m.group("num")) * 10.0 ** int(m.group("exp") or 0) * _RATE_UNITS[unit]
    bits = int(round(value))
    if not math.isfinite(value) or bits <= 0:
        raise ValueError(f"rate must be at least 1 bit/s, got {s!r}")
    return bits


def format_rate(bits: int | float) -> str:
    """A rate for people: 10**9 -> "1 Gbit/s", 2.5e9 -> "2.5 Gbit/s", 800000 -> "800 kbit/s".

    Args:
        bits: the rate in bits per second, finite and >= 0.

    Raises:
        ValueError: a negative or non-finite rate.
    """
    if bits < 0 or not math.isfinite(bits):
        raise ValueError(f"rate must be a non-negative number of bits/s, got {bits!r}")
    for scale, unit in ((10**12, "Tbit/s"), (10**9, "Gbit/s"), (10**6, "Mbit/s"), (10**3, "kbit/s")):
        if bits >= scale:
            return f"{bits / scale:.6g} {unit}"
    return f"{bits:.6g} bit/s"


_DELAY_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>s|ms|us|µs|ns)?\s*$")
_DELAY_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_delay(d: str | float | int | None) -> float:
    """A one-way latency in seconds: a number of seconds, or a string "500us", "1ms", "0.2s".

    Args:
        d: seconds (int or float), a string of a number and a unit (s, ms, us, µs, ns; none: seconds), or
            None (no delay: 0.0).

    Raises:
        ValueError: a string that does not parse, a bool, or a negative or non-finite delay.
    """
    if d is None:
        return 0.0
    if isinstance(d, bool):
        raise ValueError(f"delay must be seconds or a string like '1ms', got {d!r}")
    if isinstance(d, (int, float)):
        value = float(d)
    elif isinstance(d, str) and (m := _DELAY_RE.match(d)):
        value = float(m.group("num")) * _DELAY_UNITS[m.group("unit")]
    else:
        raise ValueError(f"cannot parse delay {d!r}: expected seconds or a string like '500us', '1ms', '0.2s'")
    if value < 0 or not math.isfinite(value):
        raise ValueError(f"delay must be >= 0, got {d!r}")
    return value


def format_delay(seconds: float) -> str:
    """A delay for people: 0.001 -> "1 ms", 0.00025 -> "250 us".

    Args:
        seconds: the delay in seconds.
    """
    if seconds >= 1:
        return f"{seconds:.6g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.6g} ms"
    return f"{seconds * 1e6:.6g} us"


# ---------------------------------------------------------------------------------------------------
# commands, kernel features, availability

def _run(argv: list[str], *, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """Runs one iproute2 command; raises NetsimError with the command and its stderr on failure."""
    try:
        p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60,
                           stdin=None if input is not None else subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise NetsimUnavailable(f"`{argv[0]}` not found: install iproute2") from e
    except subprocess.TimeoutExpired as e:
        raise NetsimError(f"`{' '.join(argv)}` did not finish within 60 s") from e
    if check and p.returncode != 0:
        raise NetsimError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


_config_cache: dict[str, str] | None = None


def _kernel_config() -> dict[str, str]:
    """The running kernel's build configuration (empty when neither /proc/config.gz nor /boot has it)."""
    global _config_cache
    if _config_cache is None:
        text = ""
        for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
            try:
                opener = gzip.open if path.endswith(".gz") else open
                with opener(path, "rt") as f:
                    text = f.read()
                break
            except OSError:
                continue
        config = {}
        for line in text.splitlines():
            if line.startswith("CONFIG_") and "=" in line:
                key, value = line.split("=", 1)
                config[key] = value
            elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
                config[line[2:-len(" is not set")]] = "n"
        config["_known"] = "y" if text else "n"
        _config_cache = config
    return _config_cache


def _kernel_option(name: str) -> str | None:
    """'y', 'm', 'n' (not set), or None when the kernel's configuration cannot be read."""
    config = _kernel_config()
    if config["_known"] != "y":
        return None
    return config.get(name, "n")


def _kernel_hz() -> int:
    """The kernel's timer frequency (CONFIG_HZ); 100, the lowest usual value, when it cannot be read."""
    try:
        return int(_kernel_config().get("CONFIG_HZ", "100"))
    except ValueError:
        return 100


def _qdisc_missing(kind: str, option: str) -> NetsimUnavailable:
    need = "delay needs" if kind == "netem" else "the simulated cluster needs"
    return NetsimUnavailable(
        f"{need} the {kind} qdisc, which this kernel does not provide (sch_{kind}: built without {option}, "
        f"or the module cannot be loaded); use a kernel built with {option}=y or =m"
        + (", or delay=None" if kind == "netem" else ""))


def _require_netem() -> None:
    state = _kernel_option("CONFIG_NET_SCH_NETEM")
    if state == "n":
        raise NetsimUnavailable(
            "delay needs the netem qdisc, but this kernel has no sch_netem (CONFIG_NET_SCH_NETEM is not set), "
            "so latency cannot be added here; use delay=None, or a kernel built with CONFIG_NET_SCH_NETEM=y/m")
    if state == "m":
        _run(["modprobe", "-q", "sch_netem"], check=False)  # best effort; adding the qdisc will tell


def _tc_error(e: NetsimError, kind: str, option: str) -> Exception:
    text = str(e)
    if "unknown" in text.lower() or "No such file or directory" in text or "not supported" in text.lower():
        return _qdisc_missing(kind, option)
    return e


_available_lock = threading.Lock()
_available_cache: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """(True, "ok") when a simulated cluster can be built here, else (False, why and what to do).

    Checks: Linux, root, `ip` and `tc` on PATH, and -- once per process, cached -- a real probe that
    creates a throw-away namespace with a veth pair, a bridge and a tbf qdisc and removes it again (about
    20 ms). Does not check netem; a Cluster with `delay` checks that itself.
    """
    global _available_cache
    with _available_lock:
        if _available_cache is None:
            _available_cache = _probe()
        return _available_cache


def _basic_problem() -> str | None:
    """Why namespaces cannot be managed here at all (not Linux, not root, no iproute2), or None."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to create network namespaces; run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH: install iproute2"
    return None


def _probe() -> tuple[bool, str]:
    problem = _basic_problem()
    if problem:
        return False, problem
    if not os.path.exists("/proc/self/ns/net"):
        return False, "the kernel has no network namespaces (CONFIG_NET_NS)"
    for option, what in (("CONFIG_VETH", "veth"), ("CONFIG_BRIDGE", "bridge"), ("CONFIG_NET_SCH_TBF", "tbf")):
        if _kernel_option(option) == "n":
            return False, f"the kernel lacks {what} ({option} is not set)"
    name = f"{_owner_prefix()}probe{_next_id()}"
    steps = [
        (["ip", "netns", "add", name], "cannot create a network namespace"),
        (["ip", "-n", name, "link", "add", "fdsim0", "type", "veth", "peer", "name", "fdsim1"],
         "cannot create a veth pair (CONFIG_VETH)"),
        (["ip", "-n", name, "link", "add", "fdsim2", "type", "bridge"], "cannot create a bridge (CONFIG_BRIDGE)"),
        (["tc", "-n", name, "qdisc", "add", "dev", "fdsim0", "root", "tbf", "rate", "1gbit", "burst", "500000",
          "limit", "1000000"], "cannot add a tbf qdisc (CONFIG_NET_SCH_TBF)"),
    ]
    try:
        for argv, what in steps:
            p = _run(argv, check=False)
            if p.returncode != 0:
                return False, f"{what}: `{' '.join(argv)}` says: {p.stderr.strip()}"
        return True, "ok"
    except NetsimUnavailable as e:
        return False, str(e)
    finally:
        if os.path.exists(os.path.join(NETNS_RUN_DIR, name)):
            _run(["ip", "netns", "del", name], check=False)


# ---------------------------------------------------------------------------------------------------
# namespaces from the inside

_libc = None


def _setns(fd: int) -> None:
    global _libc
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def _netns_path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid network namespace name {name!r}")
    return os.path.join(NETNS_RUN_DIR, name)


def enter_namespace(name: str) -> None:
    """Moves the calling *thread* into the network namespace `name` (as made by `ip netns add`).

    Only the calling thread moves; threads it starts afterwards inherit the namespace, threads that already
    exist stay where they are, and sockets opened before keep their namespace. So call it first thing in a
    rank process -- before torch.distributed, gloo or anything else starts threads or opens sockets.
    (Unlike `ip netns exec`, /sys/class/net is not remounted; use `tx_bytes`/`rx_bytes` for counters.)
    Raises FileNotFoundError when there is no such namespace, PermissionError without CAP_SYS_ADMIN.
    """
    path = _netns_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no network namespace named {name!r} (is its cluster up?)",
                                path) from None
    try:
        try:
            _setns(fd)
        except OSError as e:
            if e.errno == errno.EPERM:
                raise PermissionError(errno.EPERM, f"entering network namespace {name!r} needs CAP_SYS_ADMIN "
                                      "(run as root)") from None
            raise
    finally:
        os.close(fd)


def _in_namespace(name: str, fn: Callable[[], _T]) -> _T:
    """Runs fn() in a short-lived helper thread that has entered namespace `name`; the caller stays put."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            enter_namespace(name)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, name=f"fdsim-{name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _net_dev() -> dict[str, list[int]]:
    # /proc/thread-self/net follows the calling thread's namespace; /proc/self/net follows the thread-group
    # leader's (the same thing when the main thread called enter_namespace); /sys/class/net follows neither.
    path = "/proc/thread-self/net/dev" if os.path.exists("/proc/thread-self/net/dev") else "/proc/self/net/dev"
    with open(path) as f:
        lines = f.read().splitlines()[2:]
    table = {}
    for line in lines:
        ifname, _, fields = line.partition(":")
        table[ifname.strip()] = [int(v) for v in fields.split()]
    return table


def _counter_field(ifname: str, index: int, netns: str | None) -> int:
    table = _net_dev() if netns is None else _in_namespace(netns, _net_dev)
    if ifname not in table:
        where = f"network namespace {netns!r}" if netns else "the calling thread's network namespace"
        raise ValueError(f"no interface {ifname!r} in {where} (it has: {', '.join(sorted(table))})")
    return table[ifname][index]


def tx_bytes(ifname: str = IFNAME, netns: str | None = None) -> int:
    """Bytes sent by an interface.

    The kernel counts a TCP segmentation-offload super-packet (up to 64 KiB) with its headers once, so a
    bulk transfer shows the payload plus well under 1 %; the link's rate is charged per 1514-byte frame.

    Args:
        ifname: the interface.
        netns: the network namespace to read it in (by a helper thread); None: the calling thread's.

    Raises:
        ValueError: no such interface there.
    """
    return _counter_field(ifname, 8, netns)


def rx_bytes(ifname: str = IFNAME, netns: str | None = None) -> int:
    """Bytes received by an interface; see `tx_bytes`.

    Args:
        ifname: the interface.
        netns: the network namespace to read it in (by a helper thread); None: the calling thread's.

    Raises:
        ValueError: no such interface there.
    """
    return _counter_field(ifname, 0, netns)


def _disable_ipv6() -> None:
    # Without IPv6 a host's interfaces send nothing on their own (no DAD, router solicitations or MLD
    # reports), so its byte counters hold only what the program sent. Must run before interfaces exist.
    for conf in ("all", "default"):
        try:
            with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            pass  # kernel without IPv6: nothing to silence


# ---------------------------------------------------------------------------------------------------
# the cluster

@dataclasses.dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address, its NIC, and the switch port it is plugged into."""
    index: int
    netns: str
    ip: str
    ifname: str
    bridge_port: str

    def tx_bytes(self) -> int:
        """Bytes this host's NIC has sent (read from outside, by a helper thread)."""
        return tx_bytes(self.ifname, netns=self.netns)

    def rx_bytes(self) -> int:
        """Bytes this host's NIC has received."""
        return rx_bytes(self.ifname, netns=self.netns)


def shaping(rate_bits: int, mtu: int = 1500, delay_s: float = 0.0) -> tuple[int, int]:
    """(burst, limit) in bytes for the tbf qdisc on one direction of a link.

    burst (token-bucket depth) = max(rate/HZ, 2 frames): the bytes the link carries in one kernel timer
    tick (CONFIG_HZ; 100 assumed when unknown) -- 500 KB at 1 Gbit/s and HZ=250, 5 MB at 10 Gbit/s. A
    smaller bucket starves the link: tbf must then split TCP's 64 KiB GSO packets into frames and can
    send only a bucketful per wake-up; rate/HZ lets a single TCP stream reach the 1448/1514 payload share
    of a full frame (bench/README.md has the measurements). The cost: after an idle period up to one
    tick's worth of bytes leaves at memory speed.

    limit (bytes tbf queues before dropping) = burst + max(10 ms at the rate, 1000 frames of 1514 bytes)
    + the round-trip bandwidth-delay product when a delay is added. 1000 frames is Linux's default
    txqueuelen, what a real NIC's queue holds; 10 ms keeps fast links from dropping. The queue matters
    most on the switch port several hosts send to at once (all-to-all, gather): a much smaller limit
    loses packets every few round trips or collapses TCP into retransmission timeouts, while this one
    delivers the payload share with no drops. A full queue adds queueing delay (limit/rate, at most
    about 125 ms at 100 Mbit/s, 14 ms at 10 Gbit/s) -- only while the link is saturated, as on real
    hardware.

    Args:
        rate_bits: the link rate in bits/s.
        mtu: the interfaces' MTU.
        delay_s: the one-way delay added, in seconds.
    """
    rate_bytes = rate_bits / 8
    burst = max(math.ceil(rate_bytes / _kernel_hz()), 2 * (mtu + _ETH_HEADER))
    queue = max(math.ceil(rate_bytes * 0.010), 1000 * (1500 + _ETH_HEADER))
    limit = burst + queue + math.ceil(rate_bytes * 2 * delay_s)
    return burst, limit


_counter_lock = threading.Lock()
_counter = itertools.count(1)


def _next_id() -> int:
    """1, 2, 3, ... per process: with the pid, what makes a cluster's namespace names unique."""
    with _counter_lock:
        return next(_counter)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.]{1,24}$")
# The owner's pid and start time (names made before the start time was recorded have only the pid).
_OWNER_RE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(?:s(\d+)-)?")
_PROBE_RE = re.compile(rf"^{re.escape(PREFIX)}\d+-(?:s\d+-)?probe\d+$")


def _start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat), or None if it is not running (gone,
    or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Fields after the command name (which may hold spaces and parentheses): 3 (state) ... 22 (starttime).
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _owner_prefix() -> str:
    """``fdsim-<pid>-s<start time>-``: how the names of this process's namespaces start."""
    return f"{PREFIX}{os.getpid()}-s{_start_time(os.getpid())}-"


def _owner_alive(name: str) -> bool:
    """Whether the process that created namespace `name` still runs: its pid is in use, by a process that started
    when the owner did (another start time: the owner died and its pid was reused)."""
    m = _OWNER_RE.match(name)
    started = _start_time(int(m.group(1))) if m else None
    return started is not None and (m.group(2) is None or started == int(m.group(2)))


class Cluster:
    """N simulated hosts on a switch, each with a full-duplex link of `rate` (and optional `delay`).

    Built on ``__enter__`` (or `start`), removed on ``__exit__`` (or `close`); see the module docstring for
    how teardown is guaranteed. A cluster is built once; a closed cluster cannot be restarted.

    Args:
        num_hosts: 1..253 hosts (namespaces ``<tag>-h0`` ...; addresses 198.18.0.1 ...).
        rate: link rate, e.g. "1gbit", "10gbit", "100mbit", or bits/s (see `parse_rate`).
        delay: one-way latency between two hosts ("1ms", 0.001, ...), half of it added on each side of each
            link, so a round trip takes 2 x delay; None for none. Needs netem in the kernel, else `start` raises
            NetsimUnavailable naming CONFIG_NET_SCH_NETEM.
        mtu: MTU of every interface (68..65535).
        name: optional label (letters, digits, '_', '.') added to the namespaces' names.

    Raises:
        ValueError: an argument out of its range.
    """

    def __init__(self, num_hosts: int, rate: str | int = "10gbit", delay: str | float | None = None,
                 mtu: int = 1500, name: str | None = None):
        if isinstance(num_hosts, bool) or not isinstance(num_hosts, int) or not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be an integer in 1..{MAX_HOSTS}, got {num_hosts!r}")
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be an integer in 68..65535, got {mtu!r}")
        if name is not None and not _NAME_RE.match(name):
            raise ValueError(f"name must be 1-24 letters, digits, '_' or '.', got {name!r}")
        self.num_hosts = num_hosts
        self.rate_bits = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        self.mtu = mtu
        self.name = name
        self.burst_bytes, self.limit_bytes = shaping(self.rate_bits, mtu, self.delay_s)
        self.tag = ""
        self.bridge_netns = ""
        self._hosts: list[Host] = []
        self._state = "new"  # new -> starting -> up -> closed
        self._owner_pid = os.getpid()

    # -- description ---------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """E.g. "netsim: 4 hosts, 1 Gbit/s links, no added delay, MTU 1500"."""
        hosts = f"{self.num_hosts} host{'s' if self.num_hosts != 1 else ''}"
        delay = f"{format_delay(self.delay_s)} one-way delay" if self.delay_s else "no added delay"
        return f"netsim: {hosts}, {format_rate(self.rate_bits)} links, {delay}, MTU {self.mtu}"

    def __repr__(self) -> str:
        return f"<Cluster {self.tag or '(not started)'} {self._state}: {self.label}>"

    @property
    def is_up(self) -> bool:
        """Whether the cluster is built and not yet removed."""
        return self._state == "up"

    @property
    def hosts(self) -> list[Host]:
        """The hosts, index i = rank i (available once started)."""
        self._require_up()
        return list(self._hosts)

    @property
    def master_addr(self) -> str:
        """Host 0's address: MASTER_ADDR for torch.distributed."""
        self._require_up()
        return self._hosts[0].ip

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this cluster (hosts, then the switch)."""
        self._require_up()
        return [h.netns for h in self._hosts] + [self.bridge_netns]

    def placement(self, rank: int) -> tuple[str, dict[str, str]]:
        """(netns, env) for the process of `rank` (host `rank`): the process calls
        ``enter_namespace(netns)`` first thing, then adds `env` to its environment.

        env points MASTER_ADDR at host 0 and binds gloo and tensorpipe to the shaped interface. For NCCL it
        also gives every host its own NCCL_HOSTID and disables InfiniBand, so that NCCL treats the hosts as
        separate machines and sends over the shaped sockets instead of NVLink/PCIe/shared memory (not
        exercised on a GPU machine yet). MASTER_PORT can be any port: each namespace has all ports free."""
        self._require_up()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_hosts:
            raise ValueError(f"rank must be in 0..{self.num_hosts - 1} on a {self.num_hosts}-host cluster, "
                             f"got {rank!r}")
        host = self._hosts[rank]
        env = {
            "MASTER_ADDR": self.master_addr,
            "GLOO_SOCKET_IFNAME": host.ifname,
            "TP_SOCKET_IFNAME": host.ifname,
            "NCCL_SOCKET_IFNAME": host.ifname,
            "NCCL_HOSTID": host.netns,
            "NCCL_IB_DISABLE": "1",
            "FASTDIST_NETSIM_NETNS": host.netns,
            "FASTDIST_NETSIM_IP": host.ip,
        }
        return host.netns, env

    def link_stats(self, index: int) -> dict[str, dict[str, int]]:
        """tc statistics of host `index`'s link: {"tx": ..., "rx": ...} (host egress, switch-port egress),
        each with bytes, packets, drops, overlimits, backlog of the tbf qdisc."""
        self._require_up()
        host = self._hosts[index]
        return {"tx": _tbf_stats(host.netns, host.ifname), "rx": _tbf_stats(self.bridge_netns, host.bridge_port)}

    def _require_up(self) -> None:
        if self._state != "up":
            state = "not started" if self._state == "new" else self._state
            raise RuntimeError(f"the cluster is {state}: use it inside `with Cluster(...)` or after start()")

    # -- lifecycle -----------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        try:
            self.close()
        except NetsimError as e:
            if exc_type is None:
                raise
            warnings.warn(f"netsim: teardown failed while handling {exc_type.__name__}: {e}", RuntimeWarning)
        return False

    def start(self) -> "Cluster":
        """Builds the namespaces, links and shaping. On any failure (including a signal) everything built
        so far is removed before the exception propagates."""
        if self._state != "new":
            raise RuntimeError(f"a Cluster is built once; this one is {self._state}")
        ok, why = available()
        if not ok:
            raise NetsimUnavailable(f"cannot build a simulated cluster: {why}")
        if self.delay_s:
            _require_netem()
        self._state = "starting"
        self._owner_pid = os.getpid()
        self._plan()
        _register(self)
        try:
            self._build()
        except BaseException as e:
            try:
                self._close_now()
            except NetsimError as teardown_error:  # keep the setup error as the one that propagates
                warnings.warn(f"netsim: removing a half-built cluster after {type(e).__name__} failed: "
                              f"{teardown_error}; run `fastdist-bench --netsim-cleanup`", RuntimeWarning)
            raise
        self._state = "up"
        return self

    def close(self) -> None:
        """Removes every namespace of the cluster (and with them its links and shaping). Idempotent.
        In a process forked from the one that built the cluster it does nothing."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        if os.getpid() != self._owner_pid:
            self._state = "closed"
            return
        self._close_now()

    def _close_now(self) -> None:
        with _DeferSignals() as deferred:
            failures = self._teardown()
            self._state = "closed"
            with _registry_lock:
                _live.pop(id(self), None)
        _unregister(self)  # restores the signal handlers once the last cluster is gone
        deferred.redeliver()
        if failures:
            raise NetsimError("netsim: could not remove " + "; ".join(failures))

    def _plan(self) -> None:
        existing = set(list_namespaces())
        while True:
            tag = f"{_owner_prefix()}{_next_id()}" + (f"-{self.name}" if self.name else "")
            hosts = [Host(i, f"{tag}-h{i}", f"{SUBNET}.{i + 1}", IFNAME, f"p{i}") for i in range(self.num_hosts)]
            names = [h.netns for h in hosts] + [f"{tag}-br"]
            if not existing.intersection(names):  # a leftover of an earlier process with our pid
                break
        self.tag, self._hosts, self.bridge_netns = tag, hosts, f"{tag}-br"

    def _build(self) -> None:
        br = self.bridge_netns
        _run(["ip", "netns", "add", br])
        _in_namespace(br, _disable_ipv6)
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge",
              "stp_state", "0", "forward_delay", "0"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for h in self._hosts:
            _run(["ip", "netns", "add", h.netns])
            _in_namespace(h.netns, _disable_ipv6)
            _run(["ip", "link", "add", h.ifname, "netns", h.netns, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", h.bridge_port, "netns", br, "mtu", str(self.mtu)])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.ifname])
            _run(["ip", "-n", br, "link", "set", h.bridge_port, "master", "br0"])
            self._shape(h.netns, h.ifname)
            self._shape(br, h.bridge_port)
            _run(["ip", "-n", br, "link", "set", h.bridge_port, "up"])
            _run(["ip", "-n", h.netns, "link", "set", h.ifname, "up"])

    def _shape(self, netns: str, dev: str) -> None:
        tbf = ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]
        base = ["tc", "-n", netns, "qdisc", "replace", "dev", dev]
        if not self.delay_s:
            try:
                _run(base + ["root", "handle", "1:"] + tbf)
            except NetsimError as e:
                raise _tc_error(e, "tbf", "CONFIG_NET_SCH_TBF") from e
            return
        # netem holds packets for half the one-way delay, then hands them to tbf, which serializes them at
        # the link rate. netem's queue must hold everything in flight during the delay (counted in packets).
        half_us = max(1, round(self.delay_s / 2 * 1e6))
        packets = max(1000, 2 * math.ceil(self.rate_bits / 8 * self.delay_s / (self.mtu + _ETH_HEADER)))
        try:
            _run(base + ["root", "handle", "1:", "netem", "delay", f"{half_us}us", "limit", str(packets)])
        except NetsimError as e:
            raise _tc_error(e, "netem", "CONFIG_NET_SCH_NETEM") from e
        try:
            _run(base + ["parent", "1:1", "handle", "10:"] + tbf)
        except NetsimError as e:
            raise _tc_error(e, "tbf", "CONFIG_NET_SCH_TBF") from e

    def _teardown(self) -> list[str]:
        failures = []
        names = [h.netns for h in self._hosts] + ([self.bridge_netns] if self.bridge_netns else [])
        for name in names:
            if not os.path.lexists(os.path.join(NETNS_RUN_DIR, name)):
                continue  # never created, or already removed (e.g. by cleanup())
            try:
                _run(["ip", "netns", "del", name])
            except (NetsimError, NetsimUnavailable) as e:
                failures.append(f"{name}: {e}")
        return failures


def _tbf_stats(netns: str, dev: str) -> dict[str, int]:
    import json
    out = _run(["tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev]).stdout
    for q in json.loads(out):
        if q.get("kind") == "tbf":
            return {k: int(q.get(k, 0)) for k in ("bytes", "packets", "drops", "overlimits", "backlog")}
    raise NetsimError(f"no tbf qdisc on {dev} in {netns}")


# ---------------------------------------------------------------------------------------------------
# guaranteed teardown: registry, signals, atexit

_registry_lock = threading.RLock()
_live: dict[int, Cluster] = {}
_installed: dict[int, object] = {}  # signal -> handler that was there before ours
_atexit_registered = False
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _owned() -> list[Cluster]:
    pid = os.getpid()
    return [c for c in _live.values() if c._owner_pid == pid]


def _on_signal(signum: int, frame) -> None:
    if not _owned():  # inherited through fork, or left over: behave as if we had never been installed
        signal.signal(signum, _installed.pop(signum, signal.SIG_DFL))
        signal.raise_signal(signum)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _register(cluster: Cluster) -> None:
    """While a cluster is up: SIGTERM and SIGHUP raise Terminated, and SIGINT raises KeyboardInterrupt even
    where its handler was reset to the default. Only signals whose handler is the default (which would kill
    the process without cleanup) are taken over: an ignored signal stays ignored, and a handler the program
    installed stays in charge (the context manager and atexit still tear down when it exits). Handlers can
    only be set from the main thread; a cluster started in another thread relies on atexit and cleanup()."""
    global _atexit_registered
    with _registry_lock:
        _live[id(cluster)] = cluster
        if not _atexit_registered:
            atexit.register(_atexit_teardown)
            _atexit_registered = True
        if _in_main_thread():
            for signum in (signal.SIGINT,) + _TERMINATING:
                if signum not in _installed and signal.getsignal(signum) is signal.SIG_DFL:
                    _installed[signum] = signal.signal(signum, _on_signal)


def _unregister(cluster: Cluster) -> None:
    with _registry_lock:
        _live.pop(id(cluster), None)
        if not _owned() and _in_main_thread():
            for signum, previous in list(_installed.items()):
                if signal.getsignal(signum) is _on_signal:
                    signal.signal(signum, previous)
                del _installed[signum]


class _DeferSignals:
    """Holds SIGINT/SIGTERM/SIGHUP back while a teardown runs (main thread only), so that a second Ctrl-C
    cannot leave a cluster half removed; `redeliver` raises them again afterwards, to whatever handler is
    in place by then."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.saved: dict[int, object] = {}

    def __enter__(self) -> "_DeferSignals":
        if _in_main_thread():
            for signum in (signal.SIGINT,) + _TERMINATING:
                current = signal.getsignal(signum)
                if current not in (signal.SIG_IGN, None):
                    self.saved[signum] = signal.signal(signum, lambda s, f: self.pending.append(s))
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self.saved.items():
            signal.signal(signum, previous)

    def redeliver(self) -> None:
        for signum in dict.fromkeys(self.pending):
            signal.raise_signal(signum)


def _atexit_teardown() -> None:
    for cluster in _owned():
        try:
            cluster.close()
        except Exception as e:  # noqa: BLE001 - last resort; keep tearing down the others
            print(f"netsim: teardown at exit failed: {e}; run `fastdist-bench --netsim-cleanup`", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------
# leftovers

def list_namespaces() -> list[str]:
    """Names of all fdsim-* network namespaces on this machine (live clusters and leftovers)."""
    try:
        return sorted(n for n in os.listdir(NETNS_RUN_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def cleanup(only_dead: bool = True) -> list[str]:
    """Removes the fdsim-* network namespaces (with their links, bridge and shaping) that no running process owns,
    and returns the names removed. Idempotent. For leftovers of processes killed with SIGKILL:
    ``fastdist-bench --netsim-cleanup``.

    A namespace's owner is the process that created it, named by pid and start time in the namespace's name, so
    a live cluster (this process's or another's) survives and a leftover is removed even after its owner's pid
    was reused.

    Args:
        only_dead: False: also remove the live clusters of running processes (not their `available()` probes,
            which remove themselves).

    Processes still running inside a removed namespace are not touched; the namespace itself disappears
    when the last of them exits.
    """
    if not list_namespaces():
        return []
    problem = _basic_problem()
    if problem:
        raise NetsimUnavailable(f"cannot remove simulated-cluster namespaces: {problem}")
    removed, failed = [], []
    for name in list_namespaces():
        alive = _owner_alive(name)
        if alive and (only_dead or _PROBE_RE.match(name)):
            continue  # a live cluster; or another process's `available()` probe, which removes itself
        p = _run(["ip", "netns", "del", name], check=False)
        if p.returncode == 0 or not os.path.lexists(os.path.join(NETNS_RUN_DIR, name)):
            removed.append(name)
        else:
            failed.append(f"{name}: {p.stderr.strip()}")
    if failed:
        raise NetsimError(f"removed {len(removed)} namespaces but not: " + "; ".join(failed))
    return removed
