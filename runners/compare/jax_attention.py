"""`jax.nn.dot_product_attention`, measured by the kernelpages protocol.

Implementations: `jax_xla` (`implementation="xla"`, XLA's composition of matrix products and
softmax) and `jax_cudnn` (`implementation="cudnn"`, cuDNN's fused flash attention). Passes:
`fwd` times `jax.jit(dot_product_attention)`; `fwd+bwd` times one jitted function returning
the output and the vector-Jacobian product `(dQ, dK, dV)` for the runner's dO
(`jax.vjp` under `jax.jit`).

For each job, in a fresh process (forked from the server, which imports JAX but never starts a
backend):

- Inputs: the runner's raw files (the exact bits of every other implementation) are read into
  NumPy, transposed from the runner's `[B, H, T, D]` to JAX's `[B, T, N, H]`, and put on the
  GPU. Outputs are transposed back on the device before the check, so the runner's flat
  indices keep their meaning.
- First call: the wall time of the first call, jit tracing and XLA compilation included
  (`first_call_s`; the row's notes say so), until `block_until_ready` returns. No separate
  `compile_s` is recorded.
- Check: every element of the first call's output is tested for NaN/inf on the device, then
  the runner's checked elements are compared with the runner's float64 reference
  (`protocol.check_output`).
- Peak memory: `Device.memory_stats()["peak_bytes_in_use"]` after the first call minus
  `bytes_in_use` before the inputs were put on the device. JAX cannot reset the peak, so it
  also covers XLA's compile-time autotuning buffers when they were larger (`peak_method`
  says so).
- Out of memory (XLA's `RESOURCE_EXHAUSTED`, e.g. `jax_xla` fwd+bwd at T = 16384 asks for
  80 GiB) is an `oom` row with XLA's message; a shape or dtype the cuDNN path refuses (a
  `ValueError` or `NotImplementedError` while tracing) is `unsupported` with its message.

What is timed. JAX has no CUDA-event API, so a sample cannot be timed on the device. A sample
is `inner` calls dispatched back to back (JAX dispatch is asynchronous; calls run in order on
the device's stream), then `block_until_ready` on the last call's outputs:

- the sample's time (`median_ms` etc., per call) is the host wall time from before the first
  dispatch to the return of `block_until_ready`: the device time of the `inner` calls plus one
  dispatch latency at the start and one synchronisation at the end, spread over `inner` calls
  (`min_sample_ms` keeps them small against the sample);
- `host_ms` is the wall time from before the first dispatch to the return of the last dispatch,
  per call. When it approaches the sample time the device waited on the host: the row is then
  launch-bound by the same rule as the other rows (`schema::Row::launch_bound`).

Host and device time are therefore not separated beyond that: there is no CUDA-graph replay
and `timing` is left unset (neither `events` nor `graph_replay` describes it); each row's
notes say how it was timed. Warm-up, calls per sample, samples, the case time limit and the
input rotation are `timing`'s, as for PyTorch.

The job follows protocol.py: inputs `q`, `k`, `v` and, for `pass = fwd+bwd`, `do` (dO,
shaped like O); `files.check` checks O and `files.gradients` dQ, dK, dV, each over its whole
tensor for non-finite values and at the runner's elements against its float64 reference; the
row's `rel_err` is the largest. The call's arguments come from `files.arguments` (seq_len_q,
seq_len_kv, scale, causal, kv_lens). Causal with `seq_len_q != seq_len_kv`, and per-sequence
key lengths, go through an explicit mask aligned bottom-right (JAX's `is_causal` aligns
top-left).

    PYTHONPATH=runners python3 -m compare.jax_attention serve | self-test | job FILE
"""

import math
import os
import platform
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, timing  # noqa: E402
else:
    from . import protocol, timing

LIBRARY = "JAX"

IMPLEMENTATIONS = {"jax_xla": "xla", "jax_cudnn": "cudnn"}
# runner dtype -> (NumPy raw type, JAX dtype name)
DTYPES = {"bf16": ("uint16", "bfloat16"), "fp16": ("uint16", "float16"),
          "fp32": ("float32", "float32")}
CUDNN_DTYPES = ("bf16", "fp16")
DO_NAMES = ("do", "d_o", "dout", "grad_out")
PEAK_METHOD = ("jax Device.memory_stats() peak_bytes_in_use after the first call minus "
               "bytes_in_use before the inputs' upload, in a fresh process running only this "
               "case; JAX cannot reset the peak, so XLA's compile-time autotuning buffers are "
               "included when they were larger")
TIMING_NOTE = ("timed by host wall clock: inner calls dispatched back to back, then "
               "block_until_ready on the last (JAX has no CUDA events); includes one dispatch "
               "and one synchronisation per sample; host_ms is the dispatch time per call")
FIRST_CALL_NOTE = "first_call_s includes jit tracing and XLA compilation"
# Test hook: plant a NaN at this flat index of the first call's output.
PLANT_NAN_ENV = "KP_COMPARE_PLANT_NAN"
# Test hook: the JAX platform to measure on (`gpu`; `cpu` lets the tests run the whole module
# on a machine without a GPU: such rows are not GPU measurements).
PLATFORM_ENV = "KP_COMPARE_JAX_PLATFORM"


def platform_name():
    return os.environ.get(PLATFORM_ENV, "gpu")

try:
    import numpy as np
except ImportError:
    np = None
try:  # imported once in the server, before any fork; no backend is started here
    import jax
    import jax.numpy as jnp
    IMPORT_ERROR = None
except BaseException as e:  # an ImportError, or whatever a broken install raises
    if isinstance(e, KeyboardInterrupt):
        raise
    jax = jnp = None
    IMPORT_ERROR = "jax is not importable: %s" % protocol.exc_text(e)


def libraries():
    libs = {"python": platform.python_version()}
    if jax is None:
        return libs
    libs["jax"] = str(jax.__version__)
    try:
        import jaxlib
        libs["jaxlib"] = str(jaxlib.__version__)
    except Exception:
        pass
    try:  # the CUDA plugin, when installed as a package
        from importlib import metadata
        for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
            try:
                libs[name.replace("-", "_")] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    except Exception:
        pass
    return libs


# ---- the case --------------------------------------------------------------------------------

def arguments(files, case):
    """The call's arguments: `files.arguments` (authoritative, protocol.py), else derived from
    the case parameters (an older runner)."""
    args = dict(files.get("arguments") or {})
    b, h, kv, tq, tkv, d = sizes(case)
    args.setdefault("seq_len_q", tq)
    args.setdefault("seq_len_kv", tkv)
    args.setdefault("scale", scale_of(case))
    args.setdefault("causal", bool(case["causal"]))
    args.setdefault("kv_lens", None)
    return args


def mask_of(args, batch):
    """Boolean [B or 1, 1, Tq, Tkv] (True = attend) when the call needs an explicit mask
    (per-sequence key lengths, or causal with different lengths), else None."""
    tq, tkv = int(args["seq_len_q"]), int(args["seq_len_kv"])
    lens = args.get("kv_lens")
    if lens is None and not (protocol.effective_causal(args) and tq != tkv):
        return None
    lens = list(lens) if lens is not None else [tkv]
    i = np.arange(tq)[None, :, None]
    j = np.arange(tkv)[None, None, :]
    length = np.asarray(lens)[:, None, None]
    m = j < length
    if args["causal"]:
        m = m & (j <= i + length - tq)
    return m[:, None]


def sizes(case):
    """(B, H, KV, Tq, Tkv, D) of a case; seq_len_q/seq_len_kv when present, else seq_len."""
    t = case.get("seq_len")
    tq = int(case.get("seq_len_q", t))
    tkv = int(case.get("seq_len_kv", t))
    heads = int(case["heads"])
    return (int(case["batch"]), heads, int(case.get("kv_heads", heads)), tq, tkv,
            int(case["head_dim"]))


def scale_of(case):
    """The case's softmax scale: `scale` when present, else 1/sqrt(head_dim)."""
    s = case.get("scale")
    return float(s) if s is not None else 1.0 / math.sqrt(int(case["head_dim"]))


def bottom_right_mask(tq, tkv):
    """Boolean [Tq, Tkv]: query i sees key j when j <= i + Tkv - Tq (NumPy; True = attend)."""
    i = np.arange(tq)[:, None]
    j = np.arange(tkv)[None, :]
    return j <= i + (tkv - tq)


def unsupported_reason(case, implementation):
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                         ", ".join(IMPLEMENTATIONS))
    if case.get("pass") not in ("fwd", "fwd+bwd"):
        return "unknown pass %r" % (case.get("pass"),)
    dtype = case.get("dtype")
    if dtype not in DTYPES:
        return "dtype %r is not measured (%s)" % (dtype, ", ".join(DTYPES))
    if implementation == "jax_cudnn" and dtype not in CUDNN_DTYPES:
        return "jax.nn.dot_product_attention(implementation='cudnn') takes bf16 and fp16 only"
    b, h, kv, tq, tkv, d = sizes(case)
    if h % kv != 0:
        return "heads (%d) is not a multiple of kv_heads (%d)" % (h, kv)
    return None


def inputs_by_name(files):
    """{name: tensor file}; the first three are q, k, v when unnamed (see the docstring)."""
    named = {t["name"]: t for t in files["inputs"]}
    for i, name in enumerate(("q", "k", "v")):
        if name not in named and i < len(files["inputs"]):
            named[name] = files["inputs"][i]
    return named


def do_input(named):
    for n in DO_NAMES:
        if n in named:
            return named[n]
    return None


def checks_of(files):
    """[(output name, CheckSpec)]: O, then the gradients of `files.gradients` (protocol.py)."""
    return [(name, check) for name, _spec, check in protocol.outputs(files)]


def classify(exc):
    """(status, message) for an exception raised while tracing, compiling or running."""
    if isinstance(exc, timing.CaseTimeout):
        return "timeout", str(exc)
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "oom", protocol.exc_text(exc)
    if isinstance(exc, (ValueError, NotImplementedError)):
        return "unsupported", protocol.exc_text(exc)
    return "error", protocol.exc_text(exc)


# ---- timing ----------------------------------------------------------------------------------

class DispatchTimer(object):
    """`inner` calls dispatched back to back, then block_until_ready on the last outputs:
    (wall ms to the sync's return, wall ms to the last dispatch's return)."""

    def __init__(self, fn, sets, block=None, clock=time.perf_counter):
        self.fn, self.sets, self.pos, self.clock = fn, sets, 0, clock
        self.block = block or (lambda out: jax.block_until_ready(out))

    def __call__(self, inner):
        fn, sets = self.fn, self.sets
        out = None
        t0 = self.clock()
        for _ in range(inner):
            self.pos = (self.pos + 1) % len(sets)
            out = fn(*sets[self.pos])
        t1 = self.clock()
        self.block(out)
        t2 = self.clock()
        return (t2 - t0) * 1e3, (t1 - t0) * 1e3


# ---- measuring -------------------------------------------------------------------------------

def load_input(t, transpose=True):
    """A runner input file as a NumPy array of its dtype, [B, H, T, D] -> [B, T, H, D]."""
    raw_type, name = DTYPES[t["dtype"]]
    with open(t["path"], "rb") as f:
        raw = f.read()
    x = np.frombuffer(raw, dtype=np.dtype(raw_type).newbyteorder("<"))
    x = x.view(jnp.dtype(name)).reshape(t["shape"])
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if transpose else x


def build(case, args, implementation):
    """The jitted function of the case: (q, k, v) -> (o,) or (q, k, v, do) -> (o, dq, dk, dv),
    all in [B, T, N, H]."""
    b = sizes(case)[0]
    kwargs = dict(scale=float(args["scale"]), implementation=IMPLEMENTATIONS[implementation])
    mask = mask_of(args, b)
    if mask is not None:
        kwargs["mask"] = jnp.asarray(mask)
    else:
        kwargs["is_causal"] = protocol.effective_causal(args)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **kwargs)

    if case["pass"] == "fwd":
        return jax.jit(lambda q, k, v: (attend(q, k, v),))

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        dq, dk, dv = vjp(do)
        return o, dq, dk, dv
    return jax.jit(fwd_bwd)


OUTPUT_INDEX = {"O": 0, "dQ": 1, "dK": 2, "dV": 3}


def check_outputs(outs, files, case):
    """Checks the first call's outputs (in [B, T, N, H]) as the runner's elements ask.
    Returns (message, None) on a failure, else (None, (rel_err, checked words))."""
    errors, words = [], []
    for name, check in checks_of(files):
        i = OUTPUT_INDEX.get(name)
        if i is None or i >= len(outs):
            return "the job checks output %r, which this pass does not produce" % name, None
        flat = jnp.transpose(outs[i], (0, 2, 1, 3)).reshape(-1)
        plant = os.environ.get(PLANT_NAN_ENV)
        if plant and name == "O":
            flat = flat.at[int(plant)].set(jnp.nan)
        finite = jnp.isfinite(flat)
        bad_index = None if bool(finite.all()) else int(jnp.argmin(finite))
        idx = np.asarray(protocol.flat_indices(check["ranges"]), dtype=np.int64)
        got = np.asarray(flat[idx]).astype(np.float64).tolist() if idx.size else []
        reference = protocol.read_f64(check["reference"])
        msg, rel_err = protocol.check_output(bad_index, int(flat.size), got, reference)
        if msg is not None:
            return ("%s: %s" % (name, msg)) if name != "O" else msg, None
        errors.append((name, rel_err))
    return None, (protocol.worst(e for _, e in errors),
                  protocol.checked_text(files["check"]["checked"], errors))


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
    why = IMPORT_ERROR or unsupported_reason(case, implementation)
    named = inputs_by_name(job["files"])
    if why is None and case.get("pass") == "fwd+bwd" and do_input(named) is None:
        why = ("the job carries no dO input (named one of %s) for fwd+bwd"
               % ", ".join(DO_NAMES))
    if why is None:
        try:
            gpus = jax.devices(platform_name())
        except Exception as e:
            gpus, why = [], "no GPU backend in JAX: %s" % protocol.exc_text(e)
        if why is None and not gpus:
            why = "no GPU visible to JAX"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return reply
    try:
        fields, window = _measure(job, named)
    except Exception as e:
        status, msg = classify(e)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return reply
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)
    return reply


def _measure(job, named):
    case, files, tcfg = job["case"], job["files"], job["timing"]
    implementation = job["implementation"]
    device = jax.devices(platform_name())[0]
    args = arguments(files, case)
    fn = build(case, args, implementation)
    order = ["q", "k", "v"] + (["do"] if case["pass"] == "fwd+bwd" else [])
    host = [load_input(named[n] if n != "do" else do_input(named)) for n in order]

    def stats():
        try:
            return device.memory_stats() or {}
        except Exception:
            return {}
    base = stats().get("bytes_in_use", 0)
    set0 = tuple(jax.device_put(x, device) for x in host)
    jax.block_until_ready(set0)
    t0 = time.perf_counter()
    outs = fn(*set0)
    jax.block_until_ready(outs)
    first_call_s = time.perf_counter() - t0
    peak_stat = stats().get("peak_bytes_in_use")
    peak = peak_stat - base if peak_stat is not None else None
    set_bytes = sum(x.nbytes for x in host)
    out_bytes = sum(int(o.size) * o.dtype.itemsize for o in outs)

    msg, checked = check_outputs(outs, files, case)
    del outs
    if msg is not None:
        return {"message": msg}, None
    rel_err, checked_words = checked

    free = None
    s = stats()
    if "bytes_limit" in s:
        free = max(0, s["bytes_limit"] - s.get("bytes_in_use", 0))
    n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                        float(tcfg["l2_rotation_factor"]), free)
    sets = [set0] + [tuple(jax.device_put(x, device) for x in host) for _ in range(n_sets - 1)]
    jax.block_until_ready(sets)
    del host
    window0 = protocol.unix_now()
    m = timing.measure(DispatchTimer(fn, sets), tcfg)
    window = [window0, protocol.unix_now()]
    del sets

    notes = [TIMING_NOTE, FIRST_CALL_NOTE]
    if case.get("dtype") == "fp32":
        try:
            precision = jax.config.jax_default_matmul_precision
        except AttributeError:
            precision = "unknown"
        notes.append("fp32 matrix products at jax_default_matmul_precision=%s (XLA's default "
                     "on GPUs allows TF32 tensor cores)" % (precision,))
    if mask_of(args, 1) is not None:
        notes.append("an explicit mask (bottom-right causal, per-sequence key lengths): "
                     "JAX's is_causal aligns top-left")
    one_row = protocol.one_row_causal_note(args)
    if one_row:
        notes.append(one_row)
    empty = protocol.empty_rows_note(args)
    if empty:
        notes.append(empty)
    if m["cut_short"]:
        notes.append("%d of %d samples: the %g s case limit stopped sampling"
                     % (m["samples"], int(tcfg["repeats"]), float(tcfg["case_timeout_s"])))
    memory = {"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6}
    if peak is not None:
        memory.update(peak_mb=max(0, peak) / 1e6, peak_method=PEAK_METHOD,
                      temporaries_mb=max(0, peak - set_bytes - out_bytes) / 1e6)
    fields = dict(
        timing="wall_clock",
        median_ms=m["median"], q1_ms=m["q1"], q3_ms=m["q3"], inner_calls=m["inner"],
        samples=m["samples"], input_sets=n_sets, l2_rotation_reached=reached,
        host_ms=m["host_ms"], first_call_s=first_call_s, flops=files.get("flops"),
        bytes=files.get("bytes"), memory=memory,
        accuracy={"rel_err": rel_err, "metric": "rel_l2",
                  "reference": files["check"].get("reference_kind", "float64_cpu"),
                  "tolerance": max(c["tolerance"] for _, c in checks_of(files)),
                  "checked": checked_words},
        notes=notes)
    return fields, window


# ---- self-test (no JAX needed) ---------------------------------------------------------------

def self_test():
    """Pure checks of this module, then the shared ones; runs without JAX."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("jax_attention: " + what)

    fwd = {"batch": 2, "heads": 8, "kv_heads": 2, "seq_len": 128, "head_dim": 64,
           "causal": True, "dtype": "bf16", "pass": "fwd"}
    check(sizes(fwd) == (2, 8, 2, 128, 128, 64), "sizes of a self-attention case")
    check(sizes(dict(fwd, seq_len_q=1, seq_len_kv=20))[3:5] == (1, 20), "seq_len_q/kv read")
    check(abs(scale_of(fwd) - 0.125) < 1e-15 and scale_of(dict(fwd, scale=0.3)) == 0.3,
          "scale")
    check(unsupported_reason(fwd, "jax_cudnn") is None, "bf16 GQA on cuDNN is measured")
    check(unsupported_reason(dict(fwd, **{"pass": "fwd+bwd"}), "jax_xla") is None,
          "fwd+bwd is measured")
    check("bf16 and fp16" in unsupported_reason(dict(fwd, dtype="fp32"), "jax_cudnn"),
          "fp32 on cuDNN is unsupported")
    check(unsupported_reason(dict(fwd, dtype="fp32"), "jax_xla") is None, "fp32 on XLA")
    check("multiple" in unsupported_reason(dict(fwd, kv_heads=3), "jax_xla"), "GQA ratio")
    check("unknown" in unsupported_reason(fwd, "torch_flash"), "unknown implementation")

    files = {"inputs": [{"name": "q"}, {"name": "k"}, {"name": "v"}, {"name": "do"}],
             "output": {}, "check": {"ranges": [], "checked": "o"}}
    named = inputs_by_name(files)
    check(do_input(named) == {"name": "do"}, "dO found by name")
    check(do_input(inputs_by_name({"inputs": [{"name": "x"}] * 3})) is None, "no dO")
    check([n for n, _ in checks_of(files)] == ["O"], "O alone without files.gradients")
    files["gradients"] = [{"name": n, "input": n[1].lower(), "output": {}, "check": {}}
                          for n in ("dQ", "dK", "dV")]
    check([n for n, _ in checks_of(files)] == ["O", "dQ", "dK", "dV"], "gradient checks")
    check(all(n in OUTPUT_INDEX for n, _ in checks_of(files)), "every output has an index")
    args = arguments({"arguments": {"seq_len_q": 3, "scale": 0.3}}, fwd)
    check(args["seq_len_q"] == 3 and args["seq_len_kv"] == 128 and args["scale"] == 0.3,
          "files.arguments first, the case after: %r" % (args,))

    check(classify(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                "85899345920 bytes."))[0] == "oom", "XLA OOM is oom")
    check(classify(ValueError("cuDNN does not support head_dim 256"))[0] == "unsupported",
          "a refusal while tracing is unsupported")
    check(classify(RuntimeError("INTERNAL: boom"))[0] == "error", "other failures are errors")
    check(classify(timing.CaseTimeout("x"))[0] == "timeout", "timeouts")

    # The dispatch timer on a fake clock: 3 calls of 1 ms dispatch, a 10 ms sync.
    ticks = {"t": 0.0}
    def clock():
        return ticks["t"]

    def fn(x):
        ticks["t"] += 0.001
        return x

    def block(out):
        ticks["t"] += 0.010
    t = DispatchTimer(fn, [(1,), (2,)], block=block, clock=clock)
    dev, hst = t(3)
    check(abs(dev - 13.0) < 1e-9 and abs(hst - 3.0) < 1e-9, "dispatch timer: %r" % ((dev, hst),))
    m = timing.measure(DispatchTimer(fn, [(1,)], block=block, clock=clock),
                       {"warmup_ms": 0.0, "repeats": 3, "min_sample_ms": 1.0, "max_inner": 4,
                        "case_timeout_s": 1e9}, clock=clock)
    check(m["samples"] == 3 and m["host_ms"] < m["median"], "protocol on the dispatch timer")

    if np is not None:
        mask = bottom_right_mask(2, 5)
        check(mask.sum(axis=1).tolist() == [4, 5], "bottom-right mask, Tq < Tkv")
        check(bottom_right_mask(5, 2).sum(axis=1).tolist() == [0, 0, 0, 1, 2],
              "bottom-right mask, Tq > Tkv")
        a = {"seq_len_q": 2, "seq_len_kv": 5, "causal": True, "kv_lens": None}
        check(mask_of(a, 1)[0, 0].sum(axis=1).tolist() == [4, 5], "mask_of: bottom-right")
        check(mask_of(dict(a, seq_len_q=5), 1) is None, "no mask for equal lengths")
        check(mask_of(dict(a, seq_len_q=1), 1) is None, "no mask for one causal row")
        m = mask_of(dict(a, kv_lens=[5, 0, 3]), 3)
        check(m.shape == (3, 1, 2, 5) and m[:, 0].sum(axis=2).tolist() == [[4, 5], [0, 0], [2, 3]],
              "mask_of: key lengths with causal: %r" % (m[:, 0].sum(axis=2).tolist(),))
        x = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
        y = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        check(y[1, 2, 0, 4] == x[1, 0, 2, 4], "BHSD -> BTNH")
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
