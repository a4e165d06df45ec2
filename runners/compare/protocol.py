"""The job/reply protocol with the Rust runner (`src/runner/protocol.rs`), the output check,
and the server that measures each job in a fresh forked process.

This docstring is the protocol's full description: a comparison module (`torch_sdpa.py`,
`jax_attention.py`, ...) implements `measure(job) -> reply` against it and calls
`protocol.main(measure, LIBRARY)`.

Transport
    The runner starts `python3 -m compare.<module> serve` with PYTHONPATH=runners and writes one
    job per line (JSON) to its standard input; the module answers one reply line (JSON) per job
    on standard output, in order. `serve` forks a fresh process per job (each case is measured
    in a process that ran nothing else) and kills it after
    PROCESS_LIMIT_FACTOR x case_timeout_s + PROCESS_LIMIT_MARGIN_S seconds.

Job
    {"case": {...}, "implementation": "torch_flash", "timing": {...}, "l2_bytes": int,
     "files": {...}}
    - case: the document's case parameters, copied into the reply's row unchanged. Attention:
      batch, heads, kv_heads, head_dim, causal, dtype ("bf16", "fp16", "fp32"), pass ("fwd" or
      "fwd+bwd"); "seq_len" when the query and key lengths are equal, else "seq_len_q" and
      "seq_len_kv"; "scale" only when it is not 1/sqrt(head_dim); "kv_lens" (text,
      comma-separated) only for per-sequence key lengths. Do not parse these: use
      files.arguments.
    - timing: schema::TimingConfig (warmup_ms, repeats, min_sample_ms, max_inner,
      l2_rotation_factor, case_timeout_s, launch_bound_ratio, runs); `timing.py` implements
      the protocol it describes.
    - files.inputs: [{"name", "dtype", "shape", "path"}, ...] in argument order. Raw files,
      row-major, little-endian, 2 bytes per bf16/fp16 element and 4 per fp32 element: the exact
      bits the project's kernels get. Attention: "q" [B, H, Tq, D], "k" and "v"
      [B, KVH, Tkv, D], and for pass "fwd+bwd" a 4th input "do" [B, H, Tq, D]: the gradient of
      the loss with respect to the output (standard normal values, the runner's bits).
    - files.output: {"dtype", "shape"} of the output O.
    - files.check: {"ranges": [[start, len], ...], "reference": path, "reference_kind",
      "tolerance", "checked"}: flat (row-major) indices of the checked output elements and,
      in the raw little-endian float64 file `reference`, their float64 reference values in
      range order (computed by the runner on the CPU from the same input bits).
    - files.gradients (pass "fwd+bwd" only, else absent): [{"name": "dQ", "input": "q",
      "output": {"dtype", "shape"}, "check": {...}}, {"name": "dK", "input": "k", ...},
      {"name": "dV", "input": "v", ...}]: each gradient to produce, checked exactly like O.
    - files.arguments: the call's arguments, authoritative: batch, heads, kv_heads, head_dim,
      seq_len_q, seq_len_kv, causal, causal_alignment ("bottom_right"), scale (the value to
      use, default included), kv_lens (a list of B lengths, or null).
    - files.flops: FLOPs of one call by the suite's rule (copy it into the row).

The attention function
    O = softmax(scale * Q K^T + mask) V per (batch, head); query head h reads kv head
    h // (heads // kv_heads) (GQA). Batch entry b sees only its first L_b keys (L_b = kv_lens[b],
    or seq_len_kv); keys at or past L_b are padding. Causal is aligned bottom-right: query i sees
    key j iff j <= i + L_b - seq_len_q. A row that sees no key has O = 0 and zero gradients.
    A library whose own convention differs (PyTorch's is_causal aligns top-left when the lengths
    differ) must be given an explicit mask or answer "unsupported" with the reason.

One call (what is timed)
    - pass "fwd": O from Q, K, V.
    - pass "fwd+bwd": the forward, then the backward of the loss sum(dO * O) with the job's dO:
      dQ, dK, dV = vjp(O; dO) (PyTorch: out = sdpa(q, k, v, ...);
      torch.autograd.grad(out, (q, k, v), do)). Both inside the timed call, with dO a fixed
      input tensor (not drawn in the call). FLOPs of such a call are 3.5 x the forward's.
    Inputs are rotated through ceil(l2_rotation_factor x L2 / bytes of one input set) copies
    (timing.input_sets). Report CUDA-graph replay where capture works (timing "graph_replay",
    with the eager median in eager_median_ms), else eager event timing ("events"); a module
    with no device events times by the host's clock around the calls and a wait for their
    results ("wall_clock": the CPU, JAX).

The check (first call only, before timing)
    For each output in order O, then each gradient of files.gradients: scan the WHOLE tensor
    for non-finite values (a NaN anywhere fails the row: status "error", message
    "non-finite output at element i of n of <name> ..."); then
    rel_err_k = ||got - ref||_2 / ||ref||_2 over that output's checked elements (got read in the
    output's dtype, as float64; the output's own L2 norm when the reference is all zero there).
    The row's accuracy: rel_err = the largest rel_err_k (any NaN makes it NaN: never fold with
    max(), which drops NaN), metric "rel_l2", reference = check.reference_kind, tolerance =
    check.tolerance, checked = check.checked + "; rel_l2 O 1.23e-03, dQ ..., dK ..., dV ...;
    largest dK" (checked_text() writes it). A non-finite rel_err is an "error" row.

Reply (one JSON line)
    {"row": schema::Row, "window": [t0, t1], "libraries": {...}, "pid": n}
    - row: make_row(case, implementation, library, status, message, **fields) with status one of
      "ok", "oom", "unsupported" (with the reason), "error", "timeout"; an ok row has median_ms,
      q1_ms, q3_ms, inner_calls, samples, input_sets, l2_rotation_reached, timing, host_ms,
      first_call_s, flops, memory (arguments_mb, outputs_mb: every output, gradients included,
      temporaries_mb, residuals_mb: what the forward keeps for the backward, peak_mb,
      reserved_peak_mb, workspace_mb, peak_method), accuracy, notes (e.g. whether TF32 was
      allowed for fp32).
    - window: wall-clock seconds (Unix) of the timed span; libraries: versions seen.
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
TIMING_METHODS = ("events", "graph_replay", "wall_clock")
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


def finish_reply(reply, case, implementation, library, fields, window):
    """Sets reply["row"] from a measurement's `fields`: an `error` row with its message when the
    output check failed (`fields["message"]`), else an `ok` row with the fields; and
    reply["window"] (the machine-state window of the timed loop) when there is one."""
    if "message" in fields:
        reply["row"] = make_row(case, implementation, library, "error", fields["message"])
    else:
        reply["row"] = make_row(case, implementation, library, "ok", None, **fields)
    if window is not None:
        reply["window"] = window


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
    for where, check in [("files.check", files["check"])] + [
            ("files.gradients[%d].check" % i, g.get("check")) for i, g in
            enumerate(files.get("gradients") or [])]:
        if not isinstance(check, dict):
            raise JobError("%s is missing" % where)
        for key in ("ranges", "reference", "tolerance", "checked"):
            if key not in check:
                raise JobError("%s lacks %s" % (where, key))
    for i, g in enumerate(files.get("gradients") or []):
        for key in ("name", "input", "output"):
            if key not in g:
                raise JobError("files.gradients[%d] lacks %s" % (i, key))
    if not isinstance(files.get("arguments", {}), dict):
        raise JobError("files.arguments is not an object")
    return job


def outputs(files):
    """[(name, output spec, check)]: ("O", files.output, files.check), then the gradients."""
    return [("O", files["output"], files["check"])] + [
        (g["name"], g["output"], g["check"]) for g in files.get("gradients") or []]


def worst(errors):
    """The largest error; NaN when any is NaN (max() would drop it)."""
    w = float("-inf")
    for e in errors:
        if e != e:
            return float("nan")
        w = max(w, e)
    return w


def checked_text(described, errors):
    """accuracy.checked: the runner's description and, with several outputs, each one's
    rel_l2 and the largest (src/runner/own.rs `checked_text`)."""
    if len(errors) < 2:
        return described
    largest = None
    for name, e in errors:
        if largest is None or (largest[1] == largest[1] and (e != e or e > largest[1])):
            largest = (name, e)
    each = ", ".join("%s %s" % (n, rust_exp(e)) for n, e in errors)
    return "%s; rel_l2 %s; largest %s" % (described, each, largest[0])


def rust_exp(x):
    """`{:.2e}` as Rust writes it: 1.23e-3 (no zero padding, no plus sign)."""
    if x != x:
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    m, e = ("%.2e" % x).split("e")
    return "%se%d" % (m, int(e))


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
    """||got - ref||_2 / ||ref||_2; NaN for a non-finite value; for an all-zero reference (no
    scale of its own) the absolute error ||got||_2, as src/runner/protocol.rs does."""
    num = den = 0.0
    for g, r in zip(got, reference):
        if not math.isfinite(g):
            return float("nan")
        num += (g - r) * (g - r)
        den += r * r
    if den > 0:
        return math.sqrt(num / den)
    return math.sqrt(num)


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


ONE_ROW_CAUSAL_NOTE = ("one query row: bottom-right causal hides no key (the row sees keys "
                       "0..L-1), so no causal mask is applied")


def effective_causal(args):
    """Whether a call's causal mask hides any key: `causal` (aligned bottom-right) with more
    than one query row. With one query row, row 0 sees every key j <= 0 + L - 1, so the
    bottom-right mask is empty and a library is called without one (its own is_causal aligns
    top-left, which would hide every key but the first)."""
    return bool(args.get("causal")) and int(args.get("seq_len_q", 0)) != 1


def one_row_causal_note(args):
    """[`ONE_ROW_CAUSAL_NOTE`] for a causal call of one query row, else None."""
    if bool(args.get("causal")) and not effective_causal(args):
        return ONE_ROW_CAUSAL_NOTE
    return None


def empty_rows(args):
    """How many (batch entry, query row) pairs of a call see no key: all seq_len_q rows of an
    entry whose key length is 0, and with the causal mask (aligned bottom-right) the first
    seq_len_q - L rows of an entry with L < seq_len_q keys. The reference gives those rows O = 0
    and no gradient; a library's masked softmax over a row with every key masked may not."""
    tq, tkv = int(args["seq_len_q"]), int(args["seq_len_kv"])
    lens = args.get("kv_lens") or [tkv] * int(args["batch"])
    n = 0
    for length in lens:
        if length == 0:
            n += tq
        elif args["causal"]:
            n += max(0, tq - int(length))
    return n


def empty_rows_note(args):
    """The row note for a call with rows that see no key ([`empty_rows`]), or None."""
    n = empty_rows(args)
    if n == 0:
        return None
    return ("%d of %d query rows (per head) see no key: the reference gives them O = 0 and no "
            "gradient, so a library that writes anything else there is off by those rows' share "
            "of the error" % (n, int(args["batch"]) * int(args["seq_len_q"])))


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


# How much of a case process's last output line a failed row quotes.
LAST_OUTPUT_CHARS = 300


def last_output_line(text):
    """The last non-blank line of a case process's output (stdout and stderr together), cut
    to LAST_OUTPUT_CHARS, or None: what a row quotes when the process ended without a reply,
    e.g. the library's last words before a crash in native code."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line:
            return line if len(line) <= LAST_OUTPUT_CHARS else line[:LAST_OUTPUT_CHARS] + "…"
    return None


# How much of a case process's output is kept to find its last line.
OUTPUT_TAIL_BYTES = 65536


class _OutputRelay:
    """Copies what a case process writes to its output file on to this process's stderr (the
    runner's log) as it comes, and keeps the last OUTPUT_TAIL_BYTES of it."""

    def __init__(self, path):
        self.file = open(path, "rb")
        self.tail = b""

    def pump(self):
        data = self.file.read()
        if data:
            self.tail = (self.tail + data)[-OUTPUT_TAIL_BYTES:]
            try:
                sys.stderr.flush()
                os.write(2, data)
            except OSError:  # a closed stderr must not stop the case from being timed and reaped
                pass

    def close(self):
        """The rest of the output, a closing newline if it lacked one; its last line or None."""
        self.pump()
        self.file.close()
        if self.tail and not self.tail.endswith(b"\n"):
            try:
                os.write(2, b"\n")
            except OSError:
                pass
        return last_output_line(self.tail.decode("utf-8", errors="replace"))


def run_forked(job, measure, library):
    """Measure `job` in a forked child under the process limit; returns the reply.

    The child's stdout and stderr go to a file, copied on to this process's stderr as they come
    (_OutputRelay); a row for a child that ended without a reply (killed by a signal, a bad exit, the
    time limit) quotes its last output line, which for a crash in native code is often the
    only word on where it happened."""
    fd, path = tempfile.mkstemp(prefix="kp-reply-", suffix=".json")
    os.close(fd)
    out_fd, out_path = tempfile.mkstemp(prefix="kp-case-output-", suffix=".log")
    relay = None
    pid = None
    status = None
    try:
        relay = _OutputRelay(out_path)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                os.dup2(out_fd, 2)
                os.close(out_fd)
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
        os.close(out_fd)
        out_fd = None
        limit = process_limit_s(job["timing"])
        t0 = time.time()
        waited = 0.0
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            waited = time.time() - t0
            if waited > limit:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pid = None
                break
            relay.pump()
            time.sleep(0.02)
        pid = None if status is not None else pid
        last = relay.close()
        said = "; its last output: %s" % last if last else "; it wrote no output"
        if status is None:
            return failed_reply(job, library, "timeout", "killed after %.0f s (limit %.0f s)%s"
                                % (waited, limit, said))
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
                            "the case process ended (%s) without a row%s" % (why, said))
    finally:
        # Whatever went wrong here, no child is left running or unreaped, no file open.
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
        if out_fd is not None:
            os.close(out_fd)
        if relay is not None:
            relay.file.close()
        for p in (path, out_path):
            try:
                os.remove(p)
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
    # One query row: bottom-right causal hides nothing.
    check(not effective_causal({"causal": True, "seq_len_q": 1}), "one causal row is unmasked")
    check(effective_causal({"causal": True, "seq_len_q": 2}), "two causal rows are masked")
    check(not effective_causal({"causal": False, "seq_len_q": 2}), "not causal")
    check(one_row_causal_note({"causal": True, "seq_len_q": 1}) == ONE_ROW_CAUSAL_NOTE and
          one_row_causal_note({"causal": True, "seq_len_q": 3}) is None, "one-row note")
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
    check(rel_l2([0.0, 0.0], [0.0, 0.0]) == 0.0, "zero reference, zero output")
    base = dict(batch=2, seq_len_q=40, seq_len_kv=100, causal=True, kv_lens=[100, 37])
    check(empty_rows(base) == 3, "causal with 37 keys for 40 queries: 3 empty rows")
    check(empty_rows(dict(base, causal=False)) == 0, "no causal mask: no empty row")
    check(empty_rows(dict(base, causal=False, kv_lens=[0, 5])) == 40, "key length 0")
    check(empty_rows(dict(base, kv_lens=None)) == 0, "no key lengths, more keys than queries")
    check("3 of 80" in empty_rows_note(base), "empty-row note")
    check(rel_l2([0.0, 1e-3], [0.0, 0.0]) == 1e-3, "zero reference: the absolute error")
    # The row's error over several outputs keeps a NaN (max() would not).
    check(max(1e-3, float("nan")) == 1e-3, "max can drop a NaN: why worst() exists")
    check(worst([1e-3, float("nan"), 2e-3]) != worst([1e-3, float("nan"), 2e-3]), "worst NaN")
    check(worst([1e-3, 4e-3]) == 4e-3, "worst")
    text = checked_text("x", [("O", 1e-3), ("dQ", 4e-3), ("dK", 2e-3)])
    check(text == "x; rel_l2 O 1.00e-3, dQ 4.00e-3, dK 2.00e-3; largest dQ",
          "checked_text as Rust writes it: %r" % text)
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
    bwd = json.loads(json.dumps(good))
    bwd["files"]["gradients"] = [{"name": "dQ", "input": "q", "output": {"dtype": "bf16",
                                  "shape": [1]}, "check": dict(good["files"]["check"])}]
    bwd["files"]["arguments"] = {"scale": 0.125, "kv_lens": None}
    job = parse_job(json.dumps(bwd))
    check([n for n, _, _ in outputs(job["files"])] == ["O", "dQ"], "outputs in order")
    del bwd["files"]["gradients"][0]["check"]["reference"]
    try:
        parse_job(json.dumps(bwd))
        check(False, "parse_job accepted a gradient check without reference")
    except JobError:
        pass
    check(last_output_line("a\n  b c \n\n") == "b c" and last_output_line(" \n") is None,
          "last_output_line")
    check(last_output_line("x" * 400).endswith("…"), "a long last line is cut")
    if hasattr(os, "fork"):
        # A case process killed by a signal after printing: the row says which signal and
        # quotes the last line it printed (here on stdout, which the child sends to stderr).
        def crash(_job):
            sys.stderr.write("warming up\n")
            print("Generating code for the reduction ...", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
            return {}

        def silent_exit(_job):
            os._exit(7)

        def crash_quietly(job):
            # No core file from the deliberate crash (the test runs in the repository).
            try:
                import resource
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            except (ImportError, ValueError, OSError):
                pass
            return crash(job)

        job = parse_job(json.dumps(good))
        row = run_forked(job, crash_quietly, "lib")["row"]
        check(row["status"] == "error" and "killed by signal %d" % signal.SIGSEGV
              in row["message"] and row["message"].endswith(
                  "its last output: Generating code for the reduction ..."),
              "a crash's row quotes the last output: %r" % row.get("message"))
        row = run_forked(job, silent_exit, "lib")["row"]
        check("exit status 7" in row["message"] and "it wrote no output" in row["message"],
              "a silent exit's row: %r" % row.get("message"))
        row = run_forked(job, lambda j: {"row": make_row(j["case"], "x", "lib", "ok")}, "lib")
        check(row["row"]["status"] == "ok", "a reply passes through run_forked")
    for broken in ("{", "[]", json.dumps(dict(good, timing={})),
                   json.dumps({k: v for k, v in good.items() if k != "files"})):
        try:
            parse_job(broken)
            check(False, "parse_job accepted %s" % broken[:60])
        except JobError:
            pass
    return failures


def main(measure, library, argv=None, module_self_test=None):
    """Entry point of a library module: `serve`, `self-test`, or `job FILE` (measure one job
    in this process and print the reply). `module_self_test` is the module's own self-test
    (returning failures, this module's checks included), or None for this module's alone."""
    ap = argparse.ArgumentParser(description="kernelpages comparison module (%s)" % library)
    ap.add_argument("command", choices=("serve", "self-test", "job"))
    ap.add_argument("file", nargs="?", help="job JSON file (for `job`)")
    args = ap.parse_args(argv)
    if args.command == "self-test":
        failures = (module_self_test or self_test)()
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
