"""The timing protocol of `src/harness.rs`, for the alternatives: warm-up by time, calls per
sample, samples under the case time limit, median and quartiles, host time per call, input
rotation. Framework-neutral: a timer is any callable `time_calls(inner) -> (device_ms,
host_ms)`; `EventTimer` and `GraphTimer` are PyTorch's (the torch module is passed in).
"""

import math
import time

# Fewest samples a row keeps when the time limit stops sampling early (src/harness.rs
# MIN_SAMPLES).
MIN_SAMPLES = 3
# Most input sets rotated through (src/harness.rs MAX_INPUT_SETS).
MAX_INPUT_SETS = 64
# Fraction of the free device memory the rotated input sets may take (Python side only: the
# frameworks keep their own caches).
ROTATION_MEMORY_FRACTION = 0.5


class CaseTimeout(Exception):
    """The case passed `case_timeout_s` with fewer than MIN_SAMPLES samples."""


class BadTime(Exception):
    """A timer returned a non-finite or non-positive time."""


def quantile(sorted_xs, p):
    """Linear interpolation between closest ranks (numpy.percentile's default):
    h = (n-1)p; q = x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h])."""
    n = len(sorted_xs)
    if n == 0:
        raise ValueError("quantile of no samples")
    h = (n - 1) * min(max(p, 0.0), 1.0)
    lo = int(math.floor(h))
    hi = min(lo + 1, n - 1)
    return float(sorted_xs[lo] + (h - lo) * (sorted_xs[hi] - sorted_xs[lo]))


def summarize(samples_ms):
    """(median, q1, q3) of per-call times."""
    xs = sorted(samples_ms)
    return quantile(xs, 0.5), quantile(xs, 0.25), quantile(xs, 0.75)


def choose_inner(one_call_ms, min_sample_ms, max_inner):
    """inner = clamp(ceil(min_sample_ms / one_call_ms), 1, max_inner)."""
    max_inner = max(1, int(max_inner))
    if not (one_call_ms > 0.0) or not math.isfinite(one_call_ms):
        return max_inner
    return int(min(max(math.ceil(min_sample_ms / one_call_ms), 1), max_inner))


def input_sets(set_bytes, l2_bytes, factor, free_bytes=None):
    """(n, reached): n = ceil(factor * l2 / set_bytes) clamped to 1..MAX_INPUT_SETS and, with
    `free_bytes`, to ROTATION_MEMORY_FRACTION of it; reached = n * set_bytes / l2."""
    if set_bytes <= 0:
        return 1, float(factor)
    n = max(1, int(math.ceil(factor * l2_bytes / float(set_bytes))))
    n = min(n, MAX_INPUT_SETS)
    if free_bytes is not None:
        n = max(1, min(n, int(ROTATION_MEMORY_FRACTION * free_bytes // set_bytes)))
    reached = n * float(set_bytes) / l2_bytes if l2_bytes > 0 else float(factor)
    return n, reached


def _check(device_ms, host_ms):
    for v in (device_ms, host_ms):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
            raise BadTime("timer returned %r ms" % (v,))
    if device_ms <= 0.0:
        raise BadTime("timer returned %r ms of device time" % (device_ms,))


def measure(time_calls, timing, clock=time.perf_counter, start=None, fixed_inner=None):
    """The protocol of src/harness.rs `measure`, on `time_calls(inner) -> (device_ms, host_ms)`:

    1. warm-up by time: batches of 1, 2, 4, ... calls (at most max_inner) until their event
       time adds up to `warmup_ms` (skipped when `fixed_inner` is given: a graph replays
       already-warm calls);
    2. inner = ceil(min_sample_ms / the last warm-up batch's time per call), clamped to
       1..max_inner (one timed call sizes it when warmup_ms is 0), or `fixed_inner`;
    3. `repeats` samples, each device time / inner and host time / inner.

    Time limit, counted from `start` (default: now): before each sample, when it would end
    past case_timeout_s and MIN_SAMPLES samples exist, sampling stops and keeps them; past the
    limit with fewer, CaseTimeout. Returns a dict: median, q1, q3, samples, host_ms, inner,
    warmup_calls, warmup_ms, cut_short.
    """
    t_start = clock() if start is None else start
    limit = max(0.0, float(timing["case_timeout_s"]))
    max_inner = max(1, int(timing["max_inner"]))

    def elapsed(t):
        return t - t_start

    def timeout(t):
        return CaseTimeout("case_timeout_s (%g s) passed after %.1f s with fewer than %d samples"
                           % (limit, elapsed(t), MIN_SAMPLES))

    warm_calls, warm_ms = 0, 0.0
    last_per_call = None
    if fixed_inner is None:
        batch = 1
        while warm_ms < float(timing["warmup_ms"]):
            t = clock()
            if elapsed(t) > limit:
                raise timeout(t)
            d, h = time_calls(batch)
            _check(d, h)
            warm_calls += batch
            warm_ms += d
            last_per_call = d / batch
            batch = min(batch * 2, max_inner)
        if last_per_call is None:
            d, h = time_calls(1)
            _check(d, h)
            last_per_call = d
        inner = choose_inner(last_per_call, float(timing["min_sample_ms"]), max_inner)
        expected = last_per_call * inner
    else:
        inner = int(fixed_inner)
        expected = 0.0
    device, host = [], []
    cut_short = False
    for _ in range(max(1, int(timing["repeats"]))):
        t = clock()
        if elapsed(t) + expected * 1e-3 > limit and len(device) >= MIN_SAMPLES:
            cut_short = True
            break
        if elapsed(t) > limit:
            raise timeout(t)
        d, h = time_calls(inner)
        _check(d, h)
        expected = max(d, h)
        device.append(d / inner)
        host.append(h / inner)
    median, q1, q3 = summarize(device)
    return {"median": median, "q1": q1, "q3": q3, "samples": len(device),
            "host_ms": summarize(host)[0], "inner": inner, "warmup_calls": warm_calls,
            "warmup_ms": warm_ms, "cut_short": cut_short}


def launch_bound(host_ms, eager_device_ms, ratio):
    """host time per call >= ratio x eager device time per call (schema::Row::launch_bound)."""
    return host_ms >= ratio * eager_device_ms


class EventTimer(object):
    """`inner` eager calls back to back between two CUDA events; the host time is the wall
    time from before the first call to after the last call returned."""

    def __init__(self, torch, call, sets):
        self.torch, self.call, self.sets = torch, call, sets
        self.pos = 0
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, inner):
        sets, call = self.sets, self.call
        self.start.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            self.pos = (self.pos + 1) % len(sets)
            call(*sets[self.pos])
        host = (time.perf_counter() - t0) * 1e3
        self.end.record()
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end)), host


def measure_eager_then_graph(torch, call, sets, timing, start, graph=True):
    """The GPU modules' timing: the protocol on eager calls (`EventTimer`), then on a CUDA graph
    of the same calls (`GraphTimer`, sized by the eager inner count) when capture works, both
    counted against the case limit from `start`. Returns (reported, method, eager, graph_error):
    the graph's measurement and "graph_replay", or the eager one and "events" with the
    exception that stopped the capture (None when `graph` is False: a call that synchronises
    with the host, which no graph can hold, is not tried). A CaseTimeout from either passes
    through."""
    eager = measure(EventTimer(torch, call, sets), timing, start=start)
    if not graph:
        return eager, "events", eager, None
    try:
        gt = GraphTimer(torch, call, sets, eager["inner"])
        try:
            graph = measure(gt, timing, start=start, fixed_inner=gt.inner)
        finally:
            gt.close()
    except CaseTimeout:
        raise
    except Exception as e:
        torch.cuda.synchronize()
        return eager, "events", eager, e
    return graph, "graph_replay", eager, None


def graph_calls(inner, n_sets):
    """Calls a CUDA graph holds: `inner`, raised to a whole number of passes over the input
    sets when there are more sets than calls, so that replaying it rotates through every set
    (a graph replays the same calls on the same buffers each time)."""
    inner, n_sets = max(1, int(inner)), max(1, int(n_sets))
    if inner >= n_sets:
        return inner
    return inner * int(math.ceil(n_sets / float(inner)))


class GraphTimer(object):
    """A CUDA graph of `graph_calls(inner, len(sets))` calls (rotating through every input
    set), captured once after a warm-up on a side stream as PyTorch requires, replayed between
    two CUDA events. `self.inner` is the number of calls one replay makes."""

    def __init__(self, torch, call, sets, inner):
        self.torch = torch
        self.inner = graph_calls(inner, len(sets))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                call(*sets[i % len(sets)])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(self.inner):
                call(*sets[i % len(sets)])
        torch.cuda.synchronize()
        self.graph.replay()  # first replay: uploads the graph
        torch.cuda.synchronize()
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, inner):
        if inner != self.inner:
            raise ValueError("the graph holds %d calls, asked for %d" % (self.inner, inner))
        self.start.record()
        t0 = time.perf_counter()
        self.graph.replay()
        host = (time.perf_counter() - t0) * 1e3
        self.end.record()
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end)), host

    def close(self):
        self.graph.reset()
        self.graph = None


def self_test(check):
    """Pure checks of this module (no framework): `check(cond, what)`."""
    import random
    import statistics
    rng = random.Random(5)
    for n in list(range(1, 12)) + [20, 31]:
        xs = sorted(rng.uniform(0.1, 10.0) for _ in range(n))
        if n >= 2:
            q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = med = q3 = xs[0]
        got = (quantile(xs, 0.25), quantile(xs, 0.5), quantile(xs, 0.75))
        for a, b in zip(got, (q1, med, q3)):
            check(abs(a - b) <= 1e-12 * max(1.0, abs(b)), "quantile n=%d" % n)
    check(summarize([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.75, 3.25), "summarize 1..4")
    check(choose_inner(0.3, 5.0, 100) == 17 and choose_inner(10.0, 5.0, 100) == 1, "inner")
    # A graph of 2 calls over 8 input sets holds 8 calls, so every set is used; 17 over 8
    # stays 17.
    check(graph_calls(2, 8) == 8 and graph_calls(3, 8) == 9 and graph_calls(17, 8) == 17,
          "graph_calls")
    l2 = 62914560
    check(input_sets(3 * 4 * 8 * 16384 * 128 * 2, l2, 3.0)[0] == 1, "rotation big case")
    check(input_sets(3 * 1 * 1 * 128 * 64 * 2, l2, 3.0)[0] == 64, "rotation cap 64")
    n, reached = input_sets(10 * 2 ** 20, l2, 3.0, free_bytes=40 * 2 ** 20)
    check(n == 2 and reached < 3.0, "rotation memory cap: %r" % ((n, reached),))

    timing = {"warmup_ms": 100.0, "repeats": 9, "min_sample_ms": 5.0, "max_inner": 100,
              "case_timeout_s": 100.0}

    class Fake(object):
        """Device time per call, host time per call; every 5th batch a 10 ms outlier."""

        def __init__(self, per_call, host_per_call):
            self.per_call, self.host, self.calls = per_call, host_per_call, []

        def __call__(self, inner):
            self.calls.append(inner)
            host = self.host * inner
            device = max(self.per_call * inner, host)
            if len(self.calls) % 5 == 0:
                device += 10.0
            return device, host

    f = Fake(0.5, 0.01)
    m = measure(f, timing)
    warm = f.calls[:-9]
    check(warm == [1, 2, 4, 8, 16, 32, 64, 100], "warm-up batches by time: %r" % warm)
    check(m["warmup_ms"] >= 100.0 and m["warmup_calls"] == sum(warm), "warm-up length")
    check(m["inner"] == 10 and abs(m["median"] - 0.5) < 1e-12, "inner and median: %r" % m)
    f = Fake(0.01, 0.03)
    m = measure(f, timing)
    check(launch_bound(m["host_ms"], m["median"], 0.8), "host-bound calls are launch-bound")
    f = Fake(1.0, 0.03)
    m = measure(f, timing)
    check(not launch_bound(m["host_ms"], m["median"], 0.8), "device-bound calls are not")
    m = measure(Fake(0.5, 0.01), timing, fixed_inner=7)
    check(m["inner"] == 7 and m["warmup_calls"] == 0, "graph timing: fixed inner, no warm-up")

    ticks = [0]

    def clock():
        t = ticks[0] * 2.0
        ticks[0] += 1
        return t

    short = dict(timing, warmup_ms=0.0, repeats=10, min_sample_ms=1.0, max_inner=1,
                 case_timeout_s=10.0)
    m = measure(Fake(1.0, 0.0), short, clock=clock)
    check(m["cut_short"] and MIN_SAMPLES <= m["samples"] < 10, "limit keeps samples: %r" % m)
    ticks[0] = 0
    try:
        measure(Fake(1.0, 0.0), dict(short, case_timeout_s=1.0), clock=lambda: clock() * 1.0)
        check(False, "timeout must raise")
    except CaseTimeout:
        pass
