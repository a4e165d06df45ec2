"""What the CPU comparison modules measure of the host itself, framework-neutral: the resident
set's high-water mark (the peak-memory method of the project's CPU rows, src/runner/host.rs)
and the load average around a row.
"""

import os

PEAK_METHOD = ("resident set high-water mark (VmHWM, reset through /proc/self/clear_refs before "
               "the inputs are read, read after the first call) minus the resident set at the "
               "reset, in a fresh process running only this case")
TIMING_NOTE = ("CPU: each sample is the wall time of back-to-back calls (no device clock apart "
               "from the host's; host_ms does not apply)")


def rss_bytes():
    """(VmRSS, VmHWM) of this process in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            text = f.read()
    except OSError:
        return None
    vals = {}
    for line in text.splitlines():
        for key in ("VmRSS:", "VmHWM:"):
            if line.startswith(key):
                vals[key] = int(line.split()[1]) * 1024
    if len(vals) != 2:
        return None
    return vals["VmRSS:"], vals["VmHWM:"]


def reset_peak_rss():
    """Resets VmHWM to VmRSS and returns VmRSS then, or None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    r = rss_bytes()
    return r[0] if r else None


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def load_note(before, after):
    """The remark of src/runner/host.rs `load_note`."""
    if before is None or after is None:
        return None
    threads = os.cpu_count() or 1
    busy = ": other processes shared the CPU" if max(before, after) > threads + 0.5 else ""
    return ("1-minute load average %.1f before and %.1f after this row, on %d hardware "
            "threads%s" % (before, after, threads, busy))
