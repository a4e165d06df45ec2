#!/usr/bin/env python3
"""Measure PyTorch's scaled_dot_product_attention backends by the kernelpages protocol.

Started by the Rust `attention` runner (`--compare torch`) on the GPU machine:

    python3 runners/compare_attention.py --request REQ.json --output ROWS.json

REQ.json names the timing parameters, the L2 size, the seed, the implementations
(`torch_flash`, `torch_cudnn`, `torch_efficient`, `torch_math`) and the cases. The script writes
one row per (case, implementation), in that order, each deserialising as `kernelpages::schema::Row`,
into ROWS.json:

    {"libraries": {...}, "rows": [Row, ...], "finished": bool}

ROWS.json is rewritten atomically (ROWS.json.tmp, then os.replace) after every row, so a crash
keeps the rows that ran; `finished` is true only once every row is written.

Other entry points:

    python3 runners/compare_attention.py --self-test       # pure-Python checks, no torch needed
    python3 runners/compare_attention.py --memory-case JSON  # internal: one call in a fresh process

Standard library only, apart from torch (which may be missing: every row is then `unsupported`).
"""

import argparse
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
import traceback
import warnings

LIBRARY = "PyTorch"

# implementation name -> SDPBackend member name
BACKENDS = {
    "torch_flash": "FLASH_ATTENTION",
    "torch_cudnn": "CUDNN_ATTENTION",
    "torch_efficient": "EFFICIENT_ATTENTION",
    "torch_math": "MATH",
}

# dtype spelling in the case -> (torch dtype attribute, bytes per element, tolerance of rel_l2)
DTYPES = {
    "bf16": ("bfloat16", 2, 1e-2),
    "fp16": ("float16", 2, 5e-3),
}
DTYPE_ALIASES = {"bfloat16": "bf16", "f16": "fp16", "float16": "fp16", "half": "fp16"}

TIMING_KEYS = ("warmup_calls", "repeats", "min_sample_ms", "max_inner", "l2_rotation_factor",
               "case_timeout_s")
CASE_INT_KEYS = ("batch", "heads", "seq_len", "head_dim")

MAX_INPUT_SETS = 64
# Fraction of the free device memory the rotated input sets may take.
ROTATION_MEMORY_FRACTION = 0.5
MESSAGE_CHARS = 500
PEAK_METHOD_SUBPROCESS = "torch.cuda.max_memory_allocated in a fresh process"
PEAK_METHOD_IN_PROCESS = (
    "torch.cuda.max_memory_allocated in-process after reset_peak_memory_stats "
    "(peak above the baseline, plus one input set)")
BACKWARD_MESSAGE = "backward not implemented in the comparison script yet"
# The source location torch appends to each warning it raises from C++.
TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")
# The fresh memory process needs its case time plus the torch import and CUDA start-up.
MEMORY_PROCESS_MIN_TIMEOUT_S = 30.0

# Fields of schema::Row and schema::Memory / schema::Accuracy (deny_unknown_fields there).
ROW_FIELDS = ("case", "implementation", "library", "default", "status", "message", "median_ms",
              "q1_ms", "q3_ms", "inner_calls", "samples", "input_sets", "compile_s", "memory",
              "accuracy", "flops", "tflops")
ROW_REQUIRED = ("case", "implementation", "library", "default", "status")
ROW_U32 = ("inner_calls", "samples", "input_sets")
ROW_F64 = ("median_ms", "q1_ms", "q3_ms", "compile_s", "flops", "tflops")
MEMORY_FIELDS = ("arguments_mb", "outputs_mb", "temporaries_mb", "residuals_mb", "peak_mb",
                 "peak_method")
ACCURACY_FIELDS = ("rel_err", "metric", "reference", "tolerance", "checked")
STATUSES = ("ok", "oom", "unsupported", "error", "timeout")


def log(msg):
    sys.stderr.write("[compare_attention] " + msg + "\n")
    sys.stderr.flush()


def clip(text, limit=MESSAGE_CHARS):
    text = str(text).strip()
    if len(text) > limit:
        return text[:limit] + "..."
    return text


def exc_text(exc):
    """`TypeName: message`, the first MESSAGE_CHARS characters."""
    return clip("%s: %s" % (type(exc).__name__, exc))


# ---------------------------------------------------------------------------------------------
# Pure helpers (checked by --self-test)
# ---------------------------------------------------------------------------------------------

def quantile(sorted_xs, p):
    """Linear interpolation between closest ranks (numpy.percentile's default):
    h = (n-1)p; q = x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h])."""
    n = len(sorted_xs)
    if n == 0:
        raise ValueError("quantile of no samples")
    h = (n - 1) * p
    lo = int(math.floor(h))
    if lo >= n - 1:
        return float(sorted_xs[n - 1])
    frac = h - lo
    return float(sorted_xs[lo] + frac * (sorted_xs[lo + 1] - sorted_xs[lo]))


def summarize(samples_ms):
    """(median, q1, q3) of the per-call times of the samples."""
    xs = sorted(samples_ms)
    return quantile(xs, 0.5), quantile(xs, 0.25), quantile(xs, 0.75)


def choose_inner(t_one_ms, min_sample_ms, max_inner):
    """inner = clamp(ceil(min_sample_ms / t_one), 1, max_inner)."""
    max_inner = max(1, int(max_inner))
    if not (t_one_ms > 0.0) or not math.isfinite(t_one_ms):
        return max_inner
    return int(min(max(math.ceil(min_sample_ms / t_one_ms), 1), max_inner))


def rotation_sets(factor, l2_bytes, set_bytes, free_bytes=None):
    """n = max(1, ceil(factor * l2 / set_bytes)), capped at 64 and at the memory available."""
    n = max(1, int(math.ceil(factor * l2_bytes / float(set_bytes))))
    n = min(n, MAX_INPUT_SETS)
    if free_bytes is not None:
        n = min(n, max(1, int(ROTATION_MEMORY_FRACTION * free_bytes // set_bytes)))
    return n


def affordable_samples(remaining_s, sample_ms):
    """How many samples of `sample_ms` fit in `remaining_s` seconds."""
    if remaining_s <= 0.0:
        return 0
    if not (sample_ms > 0.0):
        return 1 << 30
    return int(math.floor(remaining_s * 1e3 / sample_ms))


def attention_flops(case):
    """4 B H T^2 D, halved when causal (forward pass)."""
    b, h, t, d = (int(case[k]) for k in ("batch", "heads", "seq_len", "head_dim"))
    f = 4.0 * b * h * t * t * d
    if case.get("causal", False):
        f /= 2.0
    return f


def pick_slices(batch, heads, count, seed):
    """(batch, head) slices to check: the first and the last, then distinct random others."""
    total = batch * heads
    count = max(1, min(int(count), total))
    chosen = [0]
    if count >= 2 and total - 1 not in chosen:
        chosen.append(total - 1)
    rng = random.Random(seed * 7919 + 17)
    rest = [i for i in range(total) if i not in chosen]
    chosen += rng.sample(rest, count - len(chosen)) if count > len(chosen) else []
    return [(i // heads, i % heads) for i in chosen]


def pick_rows(seq_len, count, seed):
    """Sorted query rows to check: a random subset that always includes the last row."""
    count = max(1, min(int(count), seq_len))
    if count >= seq_len:
        return list(range(seq_len))
    rng = random.Random(seed * 104729 + 3)
    rows = rng.sample(range(seq_len - 1), count - 1) + [seq_len - 1]
    return sorted(rows)


def canonical_dtype(name):
    name = str(name)
    return DTYPE_ALIASES.get(name, name)


def case_label(case):
    return "B%s H%s/%s T%s D%s %s %s %s" % (
        case.get("batch"), case.get("heads"), case.get("kv_heads", case.get("heads")),
        case.get("seq_len"), case.get("head_dim"),
        "causal" if case.get("causal") else "full", case.get("dtype"), case.get("pass"))


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def make_row(case, implementation, status, message=None, **fields):
    """A dict that deserialises as schema::Row: absent (None) fields are left out, unknown fields
    and non-finite numbers are refused."""
    if status not in STATUSES:
        raise ValueError("unknown status %r" % (status,))
    row = {"case": case, "implementation": implementation, "library": LIBRARY,
           "default": False, "status": status}
    if message is not None:
        row["message"] = str(message)
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
        row[key] = value
    return row


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


def checked_text(n_slices, batch, heads, n_rows, seq_len):
    return "%d of %d (batch, head) slices x %d of %d query rows" % (
        n_slices, batch * heads, n_rows, seq_len)


# ---------------------------------------------------------------------------------------------
# Request
# ---------------------------------------------------------------------------------------------

class RequestError(Exception):
    pass


def _need(d, key, kinds, where):
    if key not in d:
        raise RequestError("%s lacks %r" % (where, key))
    v = d[key]
    if isinstance(v, bool) and bool not in kinds:
        raise RequestError("%s.%s must be a number, not %r" % (where, key, v))
    if not isinstance(v, kinds):
        raise RequestError("%s.%s has the wrong type: %r" % (where, key, v))
    return v


def parse_request(text):
    """Validate the request document; raises RequestError naming what is wrong."""
    try:
        req = json.loads(text)
    except ValueError as e:
        raise RequestError("not valid JSON: %s" % e)
    if not isinstance(req, dict):
        raise RequestError("the request must be a JSON object")
    timing = _need(req, "timing", (dict,), "request")
    for key in TIMING_KEYS:
        v = _need(timing, key, (int, float), "timing")
        if not math.isfinite(v) or v < 0:
            raise RequestError("timing.%s must be a finite number >= 0, not %r" % (key, v))
    if int(timing["repeats"]) < 1:
        raise RequestError("timing.repeats must be >= 1")
    l2 = _need(req, "l2_bytes", (int, float), "request")
    if l2 < 0:
        raise RequestError("l2_bytes must be >= 0")
    _need(req, "seed", (int,), "request")
    impls = _need(req, "implementations", (list,), "request")
    for name in impls:
        if name not in BACKENDS:
            raise RequestError("unknown implementation %r (known: %s)"
                               % (name, ", ".join(BACKENDS)))
    if "memory_subprocess" in req:
        _need(req, "memory_subprocess", (bool,), "request")
    for key in ("check_rows", "check_slices"):
        if key in req:
            if _need(req, key, (int,), "request") < 1:
                raise RequestError("%s must be >= 1" % key)
    cases = _need(req, "cases", (list,), "request")
    for i, case in enumerate(cases):
        where = "cases[%d]" % i
        if not isinstance(case, dict):
            raise RequestError("%s must be an object" % where)
        for key in CASE_INT_KEYS:
            if _need(case, key, (int,), where) < 1:
                raise RequestError("%s.%s must be >= 1" % (where, key))
        if "kv_heads" in case and _need(case, "kv_heads", (int,), where) < 1:
            raise RequestError("%s.kv_heads must be >= 1" % where)
        _need(case, "causal", (bool,), where)
        _need(case, "dtype", (str,), where)
        _need(case, "pass", (str,), where)
    return req


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def write_rows(path, libraries, rows, finished):
    doc = {"libraries": libraries, "rows": rows, "finished": bool(finished)}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def library_versions(torch_mod):
    libs = {"python": platform.python_version()}
    if torch_mod is None:
        return libs
    libs["torch"] = str(torch_mod.__version__)
    cuda = getattr(torch_mod.version, "cuda", None)
    if cuda:
        libs["cuda_torch"] = str(cuda)
    try:
        v = torch_mod.backends.cudnn.version()
        if v:
            libs["cudnn"] = str(v)
    except Exception:
        pass
    try:
        import triton  # noqa: F401
        libs["triton"] = str(triton.__version__)
    except Exception:
        pass
    return libs


# ---------------------------------------------------------------------------------------------
# Torch side
# ---------------------------------------------------------------------------------------------

def import_torch():
    """(torch, None) or (None, reason)."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        return torch, None
    except BaseException as e:  # an ImportError, or whatever a broken install raises
        if isinstance(e, KeyboardInterrupt):
            raise
        return None, "torch is not importable: %s" % exc_text(e)


class CaseTimeout(Exception):
    pass


class Inputs(object):
    """Shape, dtype and sizes of one case."""

    def __init__(self, torch, case):
        self.b = int(case["batch"])
        self.h = int(case["heads"])
        self.hk = int(case.get("kv_heads", case["heads"]))
        self.t = int(case["seq_len"])
        self.d = int(case["head_dim"])
        self.causal = bool(case["causal"])
        self.dtype_name = canonical_dtype(case["dtype"])
        attr, self.elem, self.tolerance = DTYPES[self.dtype_name]
        self.dtype = getattr(torch, attr)
        self.q_shape = (self.b, self.h, self.t, self.d)
        self.kv_shape = (self.b, self.hk, self.t, self.d)
        self.q_bytes = self.b * self.h * self.t * self.d * self.elem
        self.kv_bytes = self.b * self.hk * self.t * self.d * self.elem
        self.set_bytes = self.q_bytes + 2 * self.kv_bytes
        self.out_bytes = self.q_bytes
        self.gqa = self.hk != self.h

    def make_sets(self, torch, seed, n):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(int(seed))
        sets = []
        for _ in range(n):
            q = torch.randn(self.q_shape, generator=gen, device="cuda", dtype=self.dtype)
            k = torch.randn(self.kv_shape, generator=gen, device="cuda", dtype=self.dtype)
            v = torch.randn(self.kv_shape, generator=gen, device="cuda", dtype=self.dtype)
            sets.append((q, k, v))
        return sets

    def caller(self, torch):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        causal = self.causal
        if self.gqa:
            def call(q, k, v):
                return sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        else:
            def call(q, k, v):
                return sdpa(q, k, v, is_causal=causal)
        return call


def backend_context(torch, implementation):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, BACKENDS[implementation])])


def classify(torch, exc):
    """(status, message) for an exception raised by a torch call."""
    if isinstance(exc, CaseTimeout):
        return "timeout", str(exc)
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    text = str(exc)
    if (oom is not None and isinstance(exc, oom)) or (
            isinstance(exc, RuntimeError) and "CUDA" in text and "out of memory" in text.lower()):
        return "oom", exc_text(exc)
    if isinstance(exc, RuntimeError) and "No available kernel" in str(exc):
        return "unsupported", exc_text(exc)
    return "error", exc_text(exc)


def with_warnings(message, caught):
    """Append the reasons torch gave as warnings (why a backend refused) to `message`."""
    texts = []
    for w in caught:
        t = TRIGGERED.sub("", str(w.message)).strip()
        if t and t not in texts:
            texts.append(t)
    if not texts:
        return message
    return message + " | warnings: " + clip(" ".join(texts))


def reference_error(torch, inp, out, q, k, v, slices, rows):
    """rel_l2 of `out` against a float64 on-device reference over the checked rows."""
    group = inp.h // inp.hk
    scale = 1.0 / math.sqrt(inp.d)
    idx = torch.tensor(rows, device=q.device, dtype=torch.long)
    num = torch.zeros((), dtype=torch.float64, device=q.device)
    den = torch.zeros((), dtype=torch.float64, device=q.device)
    if inp.causal:
        keys = torch.arange(inp.t, device=q.device).unsqueeze(0)  # [1, T]
        masked = keys > idx.unsqueeze(1)  # [R, T]: key j after query i
    for b, h in slices:
        hk = h // group
        q64 = q[b, h].index_select(0, idx).to(torch.float64)  # [R, D]
        k64 = k[b, hk].to(torch.float64)  # [T, D]
        v64 = v[b, hk].to(torch.float64)
        s = (q64 @ k64.transpose(0, 1)) * scale  # [R, T]
        if inp.causal:
            s = s.masked_fill(masked, float("-inf"))
        ref = torch.softmax(s, dim=-1) @ v64  # [R, D]
        got = out[b, h].index_select(0, idx).to(torch.float64)
        num += ((got - ref) ** 2).sum()
        den += (ref ** 2).sum()
    return math.sqrt(float(num.item()) / float(den.item())) if float(den.item()) > 0 else \
        float("nan")


def memory_in_process(torch, call, qkv, inp):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call(*qkv)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    above = peak - base
    return {"peak_mb": (above + inp.set_bytes) / 1e6,
            "temporaries_mb": max(0, above - inp.out_bytes) / 1e6,
            "peak_method": PEAK_METHOD_IN_PROCESS}


def memory_subprocess(case, implementation, seed, timeout_s):
    """(figures dict, None) or (None, why) from `--memory-case` in a fresh process."""
    payload = json.dumps({"case": case, "implementation": implementation, "seed": seed})
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-case", payload]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout_s, universal_newlines=True)
    except subprocess.TimeoutExpired:
        return None, "memory subprocess timed out after %g s; peak_mb not measured" % timeout_s
    except Exception as e:
        return None, "memory subprocess did not start: %s" % exc_text(e)
    result = None
    for line in reversed(proc.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    if proc.returncode != 0 or not isinstance(result, dict) or "peak_mb" not in result:
        why = (result or {}).get("message") if isinstance(result, dict) else None
        if not why:
            why = (proc.stderr or proc.stdout or "").strip()[-MESSAGE_CHARS:]
        return None, clip("memory subprocess failed (exit %s), peak_mb not measured: %s"
                          % (proc.returncode, why))
    return {"peak_mb": float(result["peak_mb"]),
            "temporaries_mb": float(result["temporaries_mb"]),
            "peak_method": PEAK_METHOD_SUBPROCESS}, None


def memory_case_main(payload):
    """Child process: one input set, one call; print the allocator figures as JSON."""
    try:
        spec = json.loads(payload)
        case, implementation, seed = spec["case"], spec["implementation"], int(spec["seed"])
    except Exception as e:
        print(json.dumps({"error": "request", "message": "bad --memory-case JSON: %s"
                          % exc_text(e)}))
        return 2
    torch, why = import_torch()
    if torch is None:
        print(json.dumps({"error": "unsupported", "message": why}))
        return 3
    try:
        if not torch.cuda.is_available():
            print(json.dumps({"error": "unsupported", "message": "no CUDA device visible to torch"}))
            return 3
        inp = Inputs(torch, case)
        call = inp.caller(torch)
        with torch.no_grad(), backend_context(torch, implementation):
            qkv = inp.make_sets(torch, seed, 1)[0]
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = call(*qkv)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            out_bytes = out.numel() * out.element_size()
        print(json.dumps({
            "peak_mb": peak / 1e6,
            "temporaries_mb": max(0, peak - base - out_bytes) / 1e6,
            "base_bytes": base, "peak_bytes": peak, "output_bytes": out_bytes,
        }))
        return 0
    except Exception as e:
        status, msg = classify(torch, e)
        print(json.dumps({"error": status, "message": msg}))
        return 4


def measure(torch, req, case, case_index, implementation):
    """Run one (case, implementation); returns a row dict."""
    timeout_s = float(req["timing"]["case_timeout_s"])
    t_start = time.perf_counter()
    seed = int(req["seed"]) + case_index
    notes = []
    caught = []
    failure = None
    try:
        fields = _time_case(torch, req, case, seed, implementation, t_start, notes, caught)
    except Exception as e:
        status, msg = classify(torch, e)
        if status == "unsupported":
            msg = with_warnings(msg, caught)
        failure = (status, msg)
    # Every tensor of the case is gone with _time_case's frame (and the exception): release the
    # cached blocks so that the next case and the fresh memory process start clean.
    _free_cache(torch)
    if failure is not None:
        return make_row(case, implementation, failure[0], failure[1])
    if "accuracy" not in fields:  # non-finite output
        return make_row(case, implementation, "error", fields["message"])
    if req.get("memory_subprocess", True):
        figures, why = memory_subprocess(
            case, implementation, seed,
            max(timeout_s, MEMORY_PROCESS_MIN_TIMEOUT_S) if timeout_s > 0 else 600.0)
        if figures is not None:
            fields["memory"].update(figures)
        else:
            notes.append(why)
    return make_row(case, implementation, "ok", "; ".join(notes) if notes else None, **fields)


def _time_case(torch, req, case, seed, implementation, t_start, notes, caught):
    """Time one (case, implementation) and check its accuracy; returns the Row fields.
    Torch errors propagate to the caller, which classifies them."""
    timing = req["timing"]
    timeout_s = float(timing["case_timeout_s"])
    inp = Inputs(torch, case)
    call = inp.caller(torch)

    def elapsed():
        return time.perf_counter() - t_start

    def check_time(what):
        if timeout_s > 0 and elapsed() > timeout_s:
            raise CaseTimeout("case_timeout_s (%g s) exceeded during %s after %.1f s"
                              % (timeout_s, what, elapsed()))

    free = None
    try:
        free = torch.cuda.mem_get_info()[0]
    except Exception:
        pass
    n_sets = rotation_sets(float(timing["l2_rotation_factor"]), float(req["l2_bytes"]),
                           inp.set_bytes, free)
    with torch.no_grad(), backend_context(torch, implementation):
        sets = inp.make_sets(torch, seed, n_sets)
        torch.cuda.synchronize()

        # First call: backend selection, plan / heuristics, lazy module loading.
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            try:
                t0 = time.perf_counter()
                out = call(*sets[0])
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
            finally:
                caught.extend(recorded)
        del out
        check_time("the first call")

        pos = [0]

        def next_set():
            pos[0] = (pos[0] + 1) % n_sets
            return sets[pos[0]]

        for _ in range(int(timing["warmup_calls"])):
            call(*next_set())
            torch.cuda.synchronize()
            check_time("warmup")

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        qkv = next_set()
        start.record()
        call(*qkv)
        end.record()
        end.synchronize()
        t_one = start.elapsed_time(end)
        inner = choose_inner(t_one, float(timing["min_sample_ms"]), int(timing["max_inner"]))

        repeats = int(timing["repeats"])
        if timeout_s > 0:
            # Keep a share of the budget for the accuracy check.
            remaining = timeout_s - elapsed() - max(0.05 * timeout_s, 2.0 * compile_s)
            fit = affordable_samples(remaining, inner * t_one)
            if fit < 1:
                raise CaseTimeout(
                    "one sample (%d calls of %.3f ms) would exceed case_timeout_s (%g s); "
                    "the first call took %.2f s" % (inner, t_one, timeout_s, compile_s))
            if fit < repeats:
                notes.append("repeats reduced from %d to %d to fit case_timeout_s (%g s)"
                             % (repeats, fit, timeout_s))
                repeats = fit

        samples = []
        for _ in range(repeats):
            start.record()
            for _ in range(inner):
                call(*next_set())
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        median, q1, q3 = summarize(samples)

        # Accuracy on input set 0.
        q, k, v = sets[0]
        out = call(q, k, v)
        slices = pick_slices(inp.b, inp.h, req.get("check_slices", 2), seed)
        rows = pick_rows(inp.t, req.get("check_rows", 256), seed)
        rel_err = reference_error(torch, inp, out, q, k, v, slices, rows)
        del out
        if not math.isfinite(rel_err):
            return {"message": "non-finite output (rel_err %r against the float64 reference)"
                               % rel_err}

        memory = {"arguments_mb": inp.set_bytes / 1e6, "outputs_mb": inp.out_bytes / 1e6}
        if not req.get("memory_subprocess", True):
            memory.update(memory_in_process(torch, call, sets[0], inp))
    flops = attention_flops(case)
    return dict(
        median_ms=median, q1_ms=q1, q3_ms=q3, inner_calls=inner, samples=len(samples),
        input_sets=n_sets, compile_s=compile_s, memory=memory,
        accuracy={"rel_err": rel_err, "metric": "rel_l2", "reference": "float64_device",
                  "tolerance": inp.tolerance,
                  "checked": checked_text(len(slices), inp.b, inp.h, len(rows), inp.t)},
        flops=flops, tflops=flops / (median * 1e-3) / 1e12 if median > 0 else None)


def _free_cache(torch):
    try:
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def fmt_row(i, n, case, row):
    s = "case %d/%d %s %s: %s" % (i + 1, n, case_label(case), row["implementation"],
                                  row["status"])
    if "median_ms" in row:
        s += " median %.4f ms" % row["median_ms"]
    if "tflops" in row:
        s += " %.1f TFLOP/s" % row["tflops"]
    if "accuracy" in row:
        s += " rel_err %.2e" % row["accuracy"]["rel_err"]
    if row.get("message"):
        s += " (%s)" % clip(row["message"], 200)
    return s


def run(req, output):
    torch, why = import_torch()
    if torch is not None:
        try:
            if not torch.cuda.is_available():
                why = "no CUDA device visible to torch"
            else:
                torch.zeros(1, device="cuda")  # create the context outside any timing
                torch.cuda.synchronize()
        except Exception as e:
            why = "CUDA initialisation failed: %s" % exc_text(e)
    libraries = library_versions(torch)
    rows = []
    write_rows(output, libraries, rows, False)
    cases = req["cases"]
    for ci, case in enumerate(cases):
        for implementation in req["implementations"]:
            try:
                if why is not None:
                    row = make_row(case, implementation, "unsupported", why)
                elif case["pass"] != "fwd":
                    if case["pass"] == "fwd+bwd":
                        row = make_row(case, implementation, "unsupported", BACKWARD_MESSAGE)
                    else:
                        row = make_row(case, implementation, "unsupported",
                                       "unknown pass %r" % case["pass"])
                elif canonical_dtype(case["dtype"]) not in DTYPES:
                    row = make_row(case, implementation, "unsupported",
                                   "dtype %r is not measured by the comparison script (bf16, fp16)"
                                   % case["dtype"])
                elif int(case["heads"]) % int(case.get("kv_heads", case["heads"])) != 0:
                    row = make_row(case, implementation, "unsupported",
                                   "heads (%s) is not a multiple of kv_heads (%s)"
                                   % (case["heads"], case.get("kv_heads")))
                else:
                    row = measure(torch, req, case, ci, implementation)
            except Exception as e:  # a bug here must not lose the other rows
                traceback.print_exc(file=sys.stderr)
                row = make_row(case, implementation, "error",
                               clip("comparison script failed: %s" % exc_text(e)))
            rows.append(row)
            write_rows(output, libraries, rows, False)
            log(fmt_row(ci, len(cases), case, row))
    write_rows(output, libraries, rows, True)
    return 0


# ---------------------------------------------------------------------------------------------
# Self-test
# ---------------------------------------------------------------------------------------------

def self_test():
    import statistics
    import tempfile
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    rng = random.Random(5)
    for n in list(range(1, 12)) + [20, 31, 100]:
        xs = sorted(rng.uniform(0.1, 10.0) for _ in range(n))
        if n >= 2:
            q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = med = q3 = xs[0]
        got = (quantile(xs, 0.25), quantile(xs, 0.5), quantile(xs, 0.75))
        for a, b in zip(got, (q1, med, q3)):
            check(abs(a - b) <= 1e-12 * max(1.0, abs(b)), "quantile n=%d: %r vs %r" % (n, a, b))
        check(abs(quantile(xs, 0.5) - statistics.median(xs)) < 1e-12, "median n=%d" % n)
        check(quantile(xs, 0.0) == xs[0] and quantile(xs, 1.0) == xs[-1], "ends n=%d" % n)
    check(summarize([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.75, 3.25), "summarize 1..4")
    try:
        quantile([], 0.5)
        check(False, "quantile of nothing must raise")
    except ValueError:
        pass

    check(choose_inner(0.01, 5.0, 100) == 100, "inner clamps high")
    check(choose_inner(10.0, 5.0, 100) == 1, "inner clamps low")
    check(choose_inner(0.3, 5.0, 100) == 17, "inner ceil")
    check(choose_inner(0.0, 5.0, 100) == 100, "inner of zero time")
    l2 = 62914560
    check(rotation_sets(3.0, l2, 3 * 4 * 8 * 16384 * 128 * 2) == 1, "rotation big case")
    check(rotation_sets(3.0, l2, 3 * 4 * 8 * 4096 * 128 * 2) == 2, "rotation 4096 case")
    check(rotation_sets(3.0, l2, 3 * 1 * 1 * 128 * 64 * 2) == 64, "rotation cap 64")
    check(rotation_sets(3.0, l2, 10 * 2 ** 20) == 18, "rotation ceil")
    check(rotation_sets(3.0, l2, 10 * 2 ** 20, free_bytes=40 * 2 ** 20) == 2, "rotation memory")
    check(affordable_samples(1.0, 100.0) == 10 and affordable_samples(-1.0, 1.0) == 0,
          "affordable samples")
    case = {"batch": 4, "heads": 8, "kv_heads": 8, "seq_len": 4096, "head_dim": 128,
            "causal": True, "dtype": "bf16", "pass": "fwd"}
    check(attention_flops(case) == 4.0 * 4 * 8 * 4096 * 4096 * 128 / 2, "flops causal")
    check(attention_flops(dict(case, causal=False)) == 4.0 * 4 * 8 * 4096 * 4096 * 128,
          "flops full")
    s = pick_slices(4, 8, 2, 1234)
    check(s == [(0, 0), (3, 7)], "slices first and last: %r" % (s,))
    s4 = pick_slices(4, 8, 4, 1234)
    check(len(set(s4)) == 4 and s4[:2] == s and s4 == pick_slices(4, 8, 4, 1234),
          "slices deterministic, distinct")
    check(pick_slices(1, 1, 2, 0) == [(0, 0)], "single slice")
    r = pick_rows(4096, 256, 1234)
    check(len(r) == 256 and r == sorted(set(r)) and r[-1] == 4095 and r[0] >= 0,
          "rows sorted, distinct, include last")
    check(r == pick_rows(4096, 256, 1234), "rows deterministic")
    check(pick_rows(100, 256, 1) == list(range(100)), "rows all when fewer")
    check(TRIGGERED.sub("", "Flash attention requires q,k,v to have the same last dimension "
                        "(Triggered internally at /pytorch/aten/src/sdp_utils.cpp:123.)")
          == "Flash attention requires q,k,v to have the same last dimension", "strip location")
    check(checked_text(2, 4, 8, 256, 4096)
          == "2 of 32 (batch, head) slices x 256 of 4096 query rows", "checked text")

    ok = make_row(case, "torch_flash", "ok", None, median_ms=1.5, q1_ms=1.4, q3_ms=1.6,
                  inner_calls=4, samples=10, input_sets=1, compile_s=0.25,
                  memory={"arguments_mb": 100.0, "outputs_mb": 33.0, "temporaries_mb": 0,
                          "peak_mb": None, "peak_method": PEAK_METHOD_SUBPROCESS},
                  accuracy={"rel_err": 3e-3, "metric": "rel_l2", "reference": "float64_device",
                            "tolerance": 1e-2, "checked": "x"},
                  flops=1e12, tflops=None)
    check(set(ok) <= set(ROW_FIELDS), "ok row fields")
    check("message" not in ok and "tflops" not in ok and "peak_mb" not in ok["memory"],
          "absent fields omitted")
    check(ok["case"] is case and ok["library"] == LIBRARY and ok["default"] is False,
          "row basics")
    check(isinstance(ok["inner_calls"], int) and isinstance(ok["median_ms"], float),
          "row number types")
    bad = make_row(case, "torch_math", "oom", "CUDA out of memory")
    check(sorted(bad) == sorted(ROW_REQUIRED + ("message",)), "failed row fields")
    for args, kw in (((case, "x", "crashed"), {}),
                     ((case, "x", "ok"), {"median_ms": float("nan")}),
                     ((case, "x", "ok"), {"speed": 1.0}),
                     ((case, "x", "ok"), {"memory": {"bytes": 1}}),
                     ((case, "x", "ok"), {"accuracy": {"rel_err": 1.0}})):
        try:
            make_row(*args, **kw)
            check(False, "make_row accepted %r %r" % (args[2], kw))
        except ValueError:
            pass
    check(json.loads(json.dumps(ok, allow_nan=False)) == ok, "row JSON round trip")

    good = {"timing": {"warmup_calls": 3, "repeats": 10, "min_sample_ms": 5.0, "max_inner": 100,
                       "l2_rotation_factor": 3.0, "case_timeout_s": 120.0},
            "l2_bytes": l2, "seed": 1234, "implementations": list(BACKENDS),
            "memory_subprocess": True, "check_rows": 256, "check_slices": 2, "cases": [case]}
    parse_request(json.dumps(good))
    for broken in ("{", "[]", json.dumps(dict(good, cases=[{"batch": 1}])),
                   json.dumps(dict(good, implementations=["torch_nope"])),
                   json.dumps({k: v for k, v in good.items() if k != "timing"}),
                   json.dumps(dict(good, seed="1"))):
        try:
            parse_request(broken)
            check(False, "parse_request accepted %s" % broken[:80])
        except RequestError:
            pass

    d = tempfile.mkdtemp()
    path = os.path.join(d, "rows.json")
    write_rows(path, {"python": "3"}, [ok, bad], False)
    back = json.load(open(path))
    check(back["rows"] == [ok, bad] and back["finished"] is False, "write_rows round trip")
    check(not os.path.exists(path + ".tmp"), "no .tmp left")
    os.remove(path)
    os.rmdir(d)

    for f in failures:
        log("self-test FAILED: " + f)
    if failures:
        return 1
    log("self-test passed")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--request", help="request JSON file")
    ap.add_argument("--output", help="rows JSON file, rewritten after every row")
    ap.add_argument("--self-test", action="store_true", help="check the pure helpers and exit")
    ap.add_argument("--memory-case", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    if args.memory_case is not None:
        return memory_case_main(args.memory_case)
    if not args.request or not args.output:
        ap.error("--request and --output are required")
    try:
        with open(args.request) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        log("cannot read request file %s: %s" % (args.request, exc_text(e)))
        return 2
    try:
        req = parse_request(text)
    except RequestError as e:
        log("malformed request file %s: %s" % (args.request, e))
        return 2
    return run(req, args.output)


if __name__ == "__main__":
    sys.exit(main())
