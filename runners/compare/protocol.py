"""The job/reply protocol with the Rust runner (`src/runner/protocol.rs`), the output check,
and the server that measures each job in a fresh forked process.

A job (one JSON line) names the case, the implementation, the timing parameters
(schema::TimingConfig), the L2 size and the case files: the input tensors as raw
little-endian files written by the runner (the exact bits the project's kernels get), the
output shape, and the check: `[start, len]` ranges of flat output indices with the float64
reference values of those elements, computed by the runner. A reply is
`{"row": schema::Row, "window": [t0, t1], "libraries": {...}, "pid": n}`.
"""

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from array import array

MESSAGE_CHARS = 500
STATUSES = ("ok", "oom", "unsupported", "error", "timeout")
# Fields of schema::Row, schema::Memory, schema::Accuracy (deny_unknown_fields there).
ROW_FIELDS = ("case", "implementation", "library", "default", "status", "message", "median_ms",
              "q1_ms", "q3_ms", "inner_calls", "samples", "input_sets", "compile_s", "memory",
              "accuracy", "flops", "bytes", "items", "timing", "host_ms", "eager_median_ms",
              "first_call_s", "runs_ms", "l2_rotation_reached", "machine", "notes")
ROW_REQUIRED = ("case", "implementation", "library", "default", "status")
ROW_U32 = ("inner_calls", "samples", "input_sets")
ROW_F64 = ("median_ms", "q1_ms", "q3_ms", "compile_s", "flops", "bytes", "items", "host_ms",
           "eager_median_ms", "first_call_s", "l2_rotation_reached")
MEMORY_FIELDS = ("arguments_mb", "outputs_mb", "temporaries_mb", "residuals_mb", "peak_mb",
                 "peak_method", "reserved_peak_mb", "workspace_mb")
ACCURACY_FIELDS = ("rel_err", "metric", "reference", "tolerance", "checked")
TIMING_METHODS = ("events", "graph_replay")
TIMING_KEYS = ("warmup_ms", "repeats", "min_sample_ms", "max_inner", "l2_rotation_factor",
               "case_timeout_s")


def log(msg):
    sys.stderr.write("[compare] " + msg + "\n")
    sys.stderr.flush()


def clip(text, limit=MESSAGE_CHARS):
    text = str(text).strip()
    return text[:limit] + "..." if len(text) > limit else text


def exc_text(exc):
    """`TypeName: message`, the first MESSAGE_CHARS characters."""
    return clip("%s: %s" % (type(exc).__name__, exc))


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _clean_sub(d, allowed, what):
    out = {}
    for key, value in d.items():
        if key not in allowed:
            raise ValueError("not a %s field: %r" % (what, key))
        if value is None:
            continue
        if isinstance(value, str):
            out[key] = value
        elif _finite(value):
            out[key] = float(value)
        else:
            raise ValueError("%s.%s is not a finite number: %r" % (what, key, value))
    return out


def make_row(case, implementation, library, status, message=None, **fields):
    """A dict that deserialises as schema::Row: absent (None) fields are left out, unknown
    fields and non-finite numbers are refused."""
    if status not in STATUSES:
        raise ValueError("unknown status %r" % (status,))
    row = {"case": case, "implementation": implementation, "library": library,
           "default": False, "status": status}
    if message is not None:
        row["message"] = clip(message, 4 * MESSAGE_CHARS)
    for key, value in fields.items():
        if key not in ROW_FIELDS or key in ROW_REQUIRED or key == "message":
            raise ValueError("not a Row field: %r" % (key,))
        if value is None:
            continue
        if key in ROW_U32:
            value = int(value)
            if not 0 <= value < 2 ** 32:
                raise ValueError("%s out of u32 range: %r" % (key, value))
        elif key in ROW_F64:
            if not _finite(value):
                raise ValueError("%s is not a finite number: %r" % (key, value))
            value = float(value)
        elif key == "memory":
            value = _clean_sub(value, MEMORY_FIELDS, "memory")
            if not value:
                continue
        elif key == "accuracy":
            value = _clean_sub(value, ACCURACY_FIELDS, "accuracy")
            for req in ("rel_err", "metric", "reference", "tolerance"):
                if req not in value:
                    raise ValueError("accuracy lacks %s" % req)
        elif key == "timing":
            if value not in TIMING_METHODS:
                raise ValueError("unknown timing method %r" % (value,))
        elif key in ("notes", "runs_ms"):
            value = list(value)
            if not value:
                continue
        row[key] = value
    return row


class JobError(Exception):
    pass


def parse_job(text):
    """Validate one job line; raises JobError naming what is wrong."""
    try:
        job = json.loads(text)
    except ValueError as e:
        raise JobError("not valid JSON: %s" % e)
    if not isinstance(job, dict):
        raise JobError("a job must be a JSON object")
    for key, kind in (("case", dict), ("implementation", str), ("timing", dict),
                      ("l2_bytes", int), ("files", dict)):
        if not isinstance(job.get(key), kind) or isinstance(job.get(key), bool):
            raise JobError("job.%s is missing or not a %s" % (key, kind.__name__))
    for key in TIMING_KEYS:
        v = job["timing"].get(key)
        if not _finite(v) or v < 0:
            raise JobError("timing.%s must be a finite number >= 0, not %r" % (key, v))
    files = job["files"]
    for key, kind in (("inputs", list), ("output", dict), ("check", dict)):
        if not isinstance(files.get(key), kind):
            raise JobError("files.%s is missing or not a %s" % (key, kind.__name__))
    for i, t in enumerate(files["inputs"]):
        for key in ("name", "dtype", "shape", "path"):
            if key not in t:
                raise JobError("files.inputs[%d] lacks %s" % (i, key))
    check = files["check"]
    for key in ("ranges", "reference", "tolerance", "checked"):
        if key not in check:
            raise JobError("files.check lacks %s" % key)
    return job


def read_f64(path):
    """Raw little-endian float64 as a list."""
    a = array("d")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def flat_indices(ranges):
    """The flat output indices the `[start, len]` ranges cover, in order."""
    out = []
    for start, n in ranges:
        out.extend(range(int(start), int(start) + int(n)))
    return out


def rel_l2(got, reference):
    """||got - ref||_2 / ||ref||_2; NaN for a zero reference or a non-finite value."""
    num = den = 0.0
    for g, r in zip(got, reference):
        if not math.isfinite(g):
            return float("nan")
        num += (g - r) * (g - r)
        den += r * r
    return math.sqrt(num / den) if den > 0 else float("nan")


def check_output(nonfinite_index, length, got, reference):
    """The check of src/runner/protocol.rs `check_output`: (None, rel_err) when every output
    element is finite (`nonfinite_index` is None: the caller scanned the WHOLE output), else
    (message, None). `got` are the output's values at the checked elements."""
    if nonfinite_index is not None:
        return ("non-finite output at element %d of %d (unwritten or overflowed) in the first "
                "call" % (nonfinite_index, length)), None
    if len(got) != len(reference):
        return "checked %d values against %d reference values" % (len(got), len(reference)), None
    e = rel_l2(got, reference)
    if not math.isfinite(e):
        return "relative error is %r against the reference" % e, None
    return None, e


def unix_now():
    return time.time()


def exit_with_parent():
    """A daemon thread ending this process when its parent is gone (re-parented)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.2)

    t = threading.Thread(target=watch, name="parent-watch")
    t.daemon = True
    t.start()


# The hard limit on one case process: PROCESS_LIMIT_FACTOR x case_timeout_s +
# PROCESS_LIMIT_MARGIN_S (src/harness.rs, same names; tests/constants.rs holds them equal).
PROCESS_LIMIT_FACTOR = 1.5
PROCESS_LIMIT_MARGIN_S = 60.0


def process_limit_s(timing):
    """The hard limit on one case process, as src/harness.rs `process_limit_s`."""
    return float(timing["case_timeout_s"]) * PROCESS_LIMIT_FACTOR + PROCESS_LIMIT_MARGIN_S


def failed_reply(job, library, status, message):
    return {"row": make_row(job["case"], job["implementation"], library, status, message)}


def run_forked(job, measure, library):
    """Measure `job` in a forked child under the process limit; returns the reply."""
    fd, path = tempfile.mkstemp(prefix="kp-reply-", suffix=".json")
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.dup2(2, 1)  # stdout is the protocol channel: the child writes none of it
            exit_with_parent()
            reply = measure(job)
            reply.setdefault("pid", os.getpid())
            with open(path, "w") as f:
                json.dump(reply, f, allow_nan=False)
        except BaseException as e:  # a bug must still give a row
            traceback.print_exc()
            try:
                with open(path, "w") as f:
                    json.dump(failed_reply(job, library, "error",
                                           "comparison process failed: %s" % exc_text(e)), f)
            except Exception:
                code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    limit = process_limit_s(job["timing"])
    t0 = time.time()
    status = None
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.time() - t0 > limit:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    try:
        if status is None:
            return failed_reply(job, library, "timeout",
                                "killed after %.0f s (limit %.0f s)" % (time.time() - t0, limit))
        try:
            with open(path) as f:
                text = f.read()
            if text.strip():
                return json.loads(text)
        except ValueError as e:
            return failed_reply(job, library, "error", "bad reply from the case process: %s" % e)
        if os.WIFSIGNALED(status):
            why = "killed by signal %d" % os.WTERMSIG(status)
        else:
            why = "exit status %d" % os.WEXITSTATUS(status)
        return failed_reply(job, library, "error",
                            "the case process ended (%s) without a row" % why)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def serve(measure, library, stdin=None, stdout=None):
    """Reads jobs (JSON lines) until end of input; answers one reply line per job."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    # No watchdog thread here (the server forks; a thread at fork time invites deadlocks):
    # when the runner dies its end of standard input closes and this loop ends.
    for line in stdin:
        line = line.strip()
        if not line:
            continue
        try:
            job = parse_job(line)
        except JobError as e:
            reply = {"row": make_row({}, "?", library, "error", "malformed job: %s" % e)}
        else:
            if hasattr(os, "fork"):
                reply = run_forked(job, measure, library)
            else:
                reply = measure(job)
        stdout.write(json.dumps(reply, allow_nan=False) + "\n")
        stdout.flush()
    return 0


def self_test():
    """Pure checks (no framework); returns the failures."""
    from . import timing
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    timing.self_test(check)
    # The check scans the whole output: a NaN outside the checked ranges fails the row.
    out = [1.0] * 100
    ranges = [[10, 5], [50, 5]]
    reference = [1.0] * 10
    idx = flat_indices(ranges)
    check(idx[:2] == [10, 11] and len(idx) == 10, "flat indices")
    msg, e = check_output(None, len(out), [out[i] for i in idx], reference)
    check(msg is None and e == 0.0, "clean output passes")
    out[99] = float("nan")
    first_bad = next((i for i, x in enumerate(out) if not math.isfinite(x)), None)
    msg, e = check_output(first_bad, len(out), [out[i] for i in idx], reference)
    check(e is None and "element 99 of 100" in msg, "NaN outside the slices fails: %r" % msg)
    check(abs(rel_l2([1.1, 2.0], [1.0, 2.0]) - 0.1 / math.sqrt(5)) < 1e-12, "rel_l2")
    case = {"batch": 1, "seq_len": 8}
    ok = make_row(case, "torch_flash", "PyTorch", "ok", None, median_ms=1.5, q1_ms=1.4,
                  q3_ms=1.6, inner_calls=4, samples=10, input_sets=1, timing="graph_replay",
                  eager_median_ms=2.0, host_ms=0.03, first_call_s=0.2, notes=["x"],
                  memory={"peak_mb": 3.0, "reserved_peak_mb": 4.0, "workspace_mb": None},
                  accuracy={"rel_err": 3e-3, "metric": "rel_l2", "reference": "float64_cpu",
                            "tolerance": 1e-2, "checked": "x"}, flops=1e12)
    check(set(ok) <= set(ROW_FIELDS) and "workspace_mb" not in ok["memory"], "ok row fields")
    for kw in ({"median_ms": float("nan")}, {"speed": 1.0}, {"memory": {"bytes": 1}},
               {"accuracy": {"rel_err": 1.0}}, {"timing": "wallclock"}):
        try:
            make_row(case, "x", "y", "ok", **kw)
            check(False, "make_row accepted %r" % kw)
        except ValueError:
            pass
    good = {"case": case, "implementation": "torch_flash", "l2_bytes": 1,
            "timing": {"warmup_ms": 100.0, "repeats": 10, "min_sample_ms": 5.0, "max_inner": 100,
                       "l2_rotation_factor": 3.0, "case_timeout_s": 120.0},
            "files": {"inputs": [], "output": {"dtype": "bf16", "shape": [1]},
                      "check": {"ranges": [], "reference": "r", "tolerance": 0.01,
                                "checked": "x"}}}
    parse_job(json.dumps(good))
    for broken in ("{", "[]", json.dumps(dict(good, timing={})),
                   json.dumps({k: v for k, v in good.items() if k != "files"})):
        try:
            parse_job(broken)
            check(False, "parse_job accepted %s" % broken[:60])
        except JobError:
            pass
    return failures


def main(measure, library, argv=None):
    """Entry point of a library module: `serve`, `self-test`, or `job FILE` (measure one job
    in this process and print the reply)."""
    ap = argparse.ArgumentParser(description="kernelpages comparison module (%s)" % library)
    ap.add_argument("command", choices=("serve", "self-test", "job"))
    ap.add_argument("file", nargs="?", help="job JSON file (for `job`)")
    args = ap.parse_args(argv)
    if args.command == "self-test":
        failures = self_test()
        for f in failures:
            log("self-test FAILED: " + f)
        if not failures:
            log("self-test passed")
        return 1 if failures else 0
    if args.command == "job":
        if not args.file:
            ap.error("job needs a FILE")
        try:
            with open(args.file) as f:
                job = parse_job(f.read())
        except (OSError, JobError) as e:
            log("cannot use job file %s: %s" % (args.file, e))
            return 2
        print(json.dumps(measure(job), allow_nan=False))
        return 0
    return serve(measure, library)
