"""PyTorch's scaled_dot_product_attention on the CPU, measured by the kernelpages protocol
(`attention --device cpu --compare torch`).

Implementations: `torch_cpu_flash` (the CPU flash-attention kernel, SDPBackend.FLASH_ATTENTION)
and `torch_cpu_math` (the reference composition, SDPBackend.MATH), each forced with
`sdpa_kernel`; "fwd" and "fwd+bwd" (the forward, then `torch.autograd.grad` of the output
against the job's dO, timed together; through `torch_outputs.measure_on_cpu`). For each job, in a fresh process: the runner's Q, K, V bits are read (bf16,
fp16 or fp32); the first call is timed by wall clock (`first_call_s`); its peak memory is the
resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs before the inputs
are read) minus the resident set at the reset, the same method as the project's CPU rows; the
whole output is scanned for non-finite values and the runner's checked elements compared with
the runner's float64 reference; then the timing protocol of `timing` with wall time as the
sample time.

What is timed: `inner` back-to-back calls between two `time.perf_counter()` readings. On the
CPU a call returns when its work is done, so that wall time is the compute time; there is no
separate host time (`host_ms` is left out, as in the project's CPU rows). PyTorch uses
`torch.get_num_threads()` intra-op threads (each row's notes say how many).

    PYTHONPATH=runners python3 -m compare.torch_cpu serve | self-test | job FILE
"""

import os
import platform
import re
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, timing  # noqa: E402
    from compare.cpu_host import (PEAK_METHOD, TIMING_NOTE, load_average,  # noqa: E402,F401
                                  load_note, reset_peak_rss, rss_bytes)
else:
    from . import protocol, timing
    from .cpu_host import (PEAK_METHOD, TIMING_NOTE, load_average, load_note,  # noqa: F401
                           reset_peak_rss, rss_bytes)

LIBRARY = "PyTorch"

# implementation name -> SDPBackend member name
BACKENDS = {
    "torch_cpu_flash": "FLASH_ATTENTION",
    "torch_cpu_math": "MATH",
}
DTYPES = {"bf16": ("bfloat16", "int16"), "fp16": ("float16", "int16"),
          "fp32": ("float32", "float32")}
# Test hook: plant a NaN at this flat index of the first call's output.
PLANT_NAN_ENV = "KP_COMPARE_PLANT_NAN"

try:  # imported once in the server, before any fork
    import torch
    import torch.nn.functional  # noqa: F401
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    IMPORT_ERROR = None
except BaseException as e:  # an ImportError, or whatever a broken install raises
    if isinstance(e, KeyboardInterrupt):
        raise
    torch = None
    IMPORT_ERROR = "torch is not importable: %s" % protocol.exc_text(e)


def libraries():
    libs = {"python": platform.python_version()}
    if torch is None:
        return libs
    libs["torch"] = str(torch.__version__)
    try:
        m = re.search(r"oneDNN v([0-9][0-9.]*)", torch.__config__.show())
        if m:
            libs["onednn"] = m.group(1)
    except Exception:
        pass
    return libs


def classify(exc):
    """(status, message) for an exception raised by a torch call."""
    if isinstance(exc, timing.CaseTimeout):
        return "timeout", str(exc)
    text = str(exc)
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError)
                                        and "out of memory" in text.lower()):
        return "oom", protocol.exc_text(exc)
    if isinstance(exc, RuntimeError) and "No available kernel" in text:
        return "unsupported", protocol.exc_text(exc)
    return "error", protocol.exc_text(exc)


def unsupported_reason(case, implementation):
    if implementation not in BACKENDS:
        return "unknown implementation %r (known: %s)" % (implementation, ", ".join(BACKENDS))
    if case.get("pass") not in ("fwd", "fwd+bwd"):
        return "unknown pass %r (fwd, fwd+bwd)" % case.get("pass")
    if case.get("dtype") not in DTYPES:
        return "dtype %r is not measured (%s)" % (case.get("dtype"), ", ".join(DTYPES))
    if int(case["heads"]) % int(case.get("kv_heads", case["heads"])) != 0:
        return "heads (%s) is not a multiple of kv_heads (%s)" % (case["heads"],
                                                                  case.get("kv_heads"))
    return None


def load_input(t):
    """A runner input file as a CPU tensor of its dtype and shape."""
    name, raw_type = DTYPES[t["dtype"]]
    with open(t["path"], "rb") as f:
        raw = bytearray(f.read())
    x = torch.frombuffer(raw, dtype=getattr(torch, raw_type))
    return x.view(getattr(torch, name)).reshape(t["shape"])


def arguments_unsupported(args):
    """Why PyTorch's is_causal cannot express the call's arguments (protocol.py), or None."""
    if not args:
        return None
    if args.get("kv_lens") is not None:
        return "per-sequence key lengths need an explicit mask: not measured on the CPU yet"
    if protocol.effective_causal(args) and args.get("seq_len_q") != args.get("seq_len_kv"):
        return ("causal with seq_len_q != seq_len_kv: PyTorch's is_causal aligns top-left, the "
                "suite bottom-right")
    return None


def caller(case, args):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # One causal query row sees every key (bottom-right): no mask (protocol.effective_causal).
    tq = args.get("seq_len_q", case.get("seq_len_q", case.get("seq_len", 0)))
    causal = protocol.effective_causal({"causal": case["causal"], "seq_len_q": tq})
    kw = dict(is_causal=causal)
    if args.get("scale") is not None:
        kw["scale"] = float(args["scale"])
    if int(case.get("kv_heads", case["heads"])) != int(case["heads"]):
        kw["enable_gqa"] = True
    return lambda q, k, v: sdpa(q, k, v, **kw)


class WallTimer(object):
    """`inner` calls back to back between two perf_counter readings: (ms, ms)."""

    def __init__(self, call, sets):
        self.call, self.sets, self.pos = call, sets, 0

    def __call__(self, inner):
        t0 = time.perf_counter()
        for _ in range(inner):
            self.pos = (self.pos + 1) % len(self.sets)
            self.call(*self.sets[self.pos])
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        reply["libraries"] = libraries()
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = (IMPORT_ERROR or unsupported_reason(case, implementation)
           or arguments_unsupported(job["files"].get("arguments")))
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return reply
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            if case.get("pass") == "fwd+bwd":
                fields, window = _measure_fwd_bwd(job)
            else:
                fields, window = _measure(job)
    except Exception as e:
        status, msg = classify(e)
        if status == "unsupported":
            texts = [str(w.message) for w in recorded]
            if texts:
                msg += " | warnings: " + protocol.clip(" ".join(texts))
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return reply
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)
    return reply


def _measure_fwd_bwd(job):
    """A "fwd+bwd" job: the forward, then torch.autograd.grad of the output against the job's
    dO (protocol.py), timed together, through torch_outputs.measure_on_cpu (the same reading of
    inputs, check of O, dQ, dK and dV, timing and resident-set peak)."""
    if __package__ in (None, ""):
        from compare import torch_outputs
    else:
        from . import torch_outputs
    case, files = job["case"], job["files"]
    implementation = job["implementation"]
    forward = caller(case, files.get("arguments") or {})

    def fwd_bwd(q, k, v, do):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = forward(q, k, v)
        return (out.detach(),) + tuple(torch.autograd.grad(out, (q, k, v), do))

    notes = []
    one_row = protocol.one_row_causal_note(
        dict(files.get("arguments") or {}, causal=case["causal"]))
    if one_row:
        notes.append(one_row)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, BACKENDS[implementation])]):
        return torch_outputs.measure_on_cpu(job, fwd_bwd, notes, grad=True)


def _measure(job):
    """A "fwd" job through torch_outputs.measure_on_cpu (the same reading of inputs, check,
    timing and resident-set peak as the fwd+bwd jobs), O scanned with a NaN planted at the
    index in KP_COMPARE_PLANT_NAN when it is set (the tests' check that one NaN fails a row)."""
    if __package__ in (None, ""):
        from compare import torch_outputs
    else:
        from . import torch_outputs
    case, files = job["case"], job["files"]
    forward = caller(case, files.get("arguments") or {})

    def check(files, results):
        plant = os.environ.get(PLANT_NAN_ENV)
        if plant:
            out = results[0].contiguous().clone()
            out.view(-1)[int(plant)] = float("nan")
            results = (out,) + tuple(results[1:])
        return torch_outputs.check_outputs(files, results)

    notes = []
    one_row = protocol.one_row_causal_note(
        dict(files.get("arguments") or {}, causal=case["causal"]))
    if one_row:
        notes.append(one_row)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, BACKENDS[job["implementation"]])]):
        return torch_outputs.measure_on_cpu(job, lambda *x: (forward(*x),), notes, check=check)


def self_test():
    """Pure checks of this module (no torch needed), then the shared ones."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("torch_cpu: " + what)

    check(unsupported_reason({"pass": "fwd", "dtype": "fp32", "heads": 8, "kv_heads": 2},
                             "torch_cpu_flash") is None, "fp32 GQA is measured")
    check(unsupported_reason({"pass": "fwd+bwd", "dtype": "bf16", "heads": 8},
                             "torch_cpu_math") is None, "fwd+bwd is measured")
    check("unknown pass" in unsupported_reason({"pass": "bwd", "dtype": "bf16", "heads": 8},
                                               "torch_cpu_math"), "an unknown pass is refused")
    check("unknown" in unsupported_reason({}, "torch_flash"), "GPU names are unknown here")
    check(arguments_unsupported({"causal": True, "seq_len_q": 4, "seq_len_kv": 4,
                                 "kv_lens": None}) is None, "square causal is measured")
    check("top-left" in arguments_unsupported({"causal": True, "seq_len_q": 2,
                                               "seq_len_kv": 20, "kv_lens": None}),
          "bottom-right causal with different lengths is unsupported")
    check(arguments_unsupported({"causal": True, "seq_len_q": 1, "seq_len_kv": 20,
                                 "kv_lens": None}) is None, "one causal row is measured")
    check("key lengths" in arguments_unsupported({"causal": False, "kv_lens": [3, 1]}),
          "key lengths are unsupported")
    n = os.cpu_count() or 1
    check(load_note(n + 2.0, 0.0).endswith("shared the CPU"), "busy machine flagged")
    check("shared" not in load_note(0.0, 0.0), "idle machine not flagged")
    check(load_note(None, 1.0) is None, "no load average, no note")
    if os.path.exists("/proc/self/status"):
        r = rss_bytes()
        check(r is not None and r[1] >= r[0] > 0, "resident set read: %r" % (r,))
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
