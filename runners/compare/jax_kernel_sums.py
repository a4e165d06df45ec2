"""JAX's dense kernel sums, measured by the kernelpages protocol (`kernel_sums --compare jax`,
on the GPU or with `--device cpu` the CPU; the job's `device` says which).

Implementation `jax_dense`: the formulation a JAX user writes, jitted, holding the N x M
matrix. Squared distances come from the matrix product, |x|^2 + |y|^2 - 2 x.y (clamped at 0,
with `precision=HIGHEST` so that no TF32 pass is taken on a GPU), then:
- `rbf_mv`: `jnp.exp(sq * (-1 / (2 sigma^2))) @ b`;
- `kde`: the same kernel's row sums times (2 pi sigma^2)^(-dim/2) / M;
- `kernel_lse`: `jax.nn.logsumexp(g - sq / epsilon, axis=1)`, and with the gradient
  (`pass = fwd+bwd`) the value and `jax.vjp`'s gradient with respect to x for a cotangent of
  ones, in one jitted call.
sigma and epsilon are the runner's (`files.arguments`), so every implementation computes the
same function. For each job, in a fresh process forked from the server: the runner's fp32
inputs are read and put on the device; the first call (tracing and XLA compilation included)
is timed by wall clock; every output is scanned for non-finite values and the runner's checked
elements compared with the runner's float64 reference; then the shared timing protocol with
`jax_attention.DispatchTimer` (inner calls dispatched back to back, then `block_until_ready`:
JAX has no CUDA events). Peak memory: on a GPU, `memory_stats()` as `jax_attention` reads it;
on the CPU, the resident set's high-water mark (`cpu_host`). A case whose N x M matrix does
not fit is an `oom` row with the size asked.

    PYTHONPATH=runners python3 -m compare.jax_kernel_sums serve | self-test | job FILE
"""

import math
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import cpu_host, dense_kernel_sums, jax_attention, protocol, timing  # noqa: E402
else:
    from . import cpu_host, dense_kernel_sums, jax_attention, protocol, timing

LIBRARY = "JAX"
IMPLEMENTATIONS = ("jax_dense",)
OPS = dense_kernel_sums.OPS
DENSE_NOTE = ("holds the N x M matrix of squared distances (from a matrix product at "
              "precision HIGHEST) and kernel values")

jax, jnp, np = jax_attention.jax, jax_attention.jnp, jax_attention.np
IMPORT_ERROR = jax_attention.IMPORT_ERROR


def platform_of(job):
    """JAX's platform for the job's device (`gpu` when the job names none)."""
    return "gpu" if dense_kernel_sums.on_gpu(job) else "cpu"


def unsupported_reason(case, implementation):
    return dense_kernel_sums.unsupported_reason(case, implementation, IMPLEMENTATIONS)


dense_bytes = dense_kernel_sums.dense_bytes


def build(args):
    """The jitted call on (x, y[, b or g]) returning a tuple of outputs (out[, dX])."""
    op, grad = args["op"], bool(args.get("grad"))
    sigma, eps, dim, m = float(args["sigma"]), float(args["epsilon"]), int(args["dim"]), \
        int(args["m"])
    highest = jax.lax.Precision.HIGHEST

    def sq(x, y):
        cross = jnp.matmul(x, y.T, precision=highest)
        d = jnp.sum(x * x, axis=1)[:, None] + jnp.sum(y * y, axis=1)[None, :] - 2.0 * cross
        return jnp.maximum(d, 0.0)

    if op == "rbf_mv":
        k = -1.0 / (2.0 * sigma * sigma)
        return jax.jit(lambda x, y, b: (jnp.matmul(jnp.exp(sq(x, y) * k), b,
                                                   precision=highest),))
    if op == "kde":
        k = -1.0 / (2.0 * sigma * sigma)
        norm = (2.0 * math.pi * sigma * sigma) ** (-dim / 2.0) / m
        return jax.jit(lambda x, y: (jnp.sum(jnp.exp(sq(x, y) * k), axis=1) * norm,))

    def lse(x, y, g):
        return jax.nn.logsumexp(g[None, :] - sq(x, y) / eps, axis=1)
    if not grad:
        return jax.jit(lambda x, y, g: (lse(x, y, g),))

    def with_grad(x, y, g):
        out, vjp = jax.vjp(lambda xx: lse(xx, y, g), x)
        (dx,) = vjp(jnp.ones_like(out))
        return out, dx
    return jax.jit(with_grad)


def load_input(t):
    """A runner input file (fp32) as a NumPy array of its shape."""
    with open(t["path"], "rb") as f:
        raw = f.read()
    return np.frombuffer(raw, dtype=np.dtype("float32").newbyteorder("<")).reshape(t["shape"])


def check_outputs(outs, files):
    """Whole outputs scanned for non-finite values, then the runner's elements against its
    float64 reference: (message, None) on a failure, else (None, accuracy dict)."""
    errors = []
    for (name, _spec, check), out in zip(protocol.outputs(files), outs):
        flat = jnp.reshape(out, (-1,))
        finite = jnp.isfinite(flat)
        bad_index = None if bool(finite.all()) else int(jnp.argmin(finite))
        idx = np.asarray(protocol.flat_indices(check["ranges"]), dtype=np.int64)
        got = np.asarray(flat[idx]).astype(np.float64).tolist() if idx.size else []
        reference = protocol.read_f64(check["reference"])
        msg, rel_err = protocol.check_output(bad_index, int(flat.size), got, reference)
        if msg is not None:
            return (("%s: %s" % (name, msg)) if name != "O" else msg), None
        errors.append((name, rel_err))
    check = files["check"]
    return None, {"rel_err": protocol.worst(e for _, e in errors), "metric": "rel_l2",
                  "reference": check.get("reference_kind", "float64_cpu"),
                  "tolerance": check["tolerance"],
                  "checked": protocol.checked_text(check["checked"], errors)}


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        reply["libraries"] = jax_attention.libraries()
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = IMPORT_ERROR or unsupported_reason(case, implementation)
    if why is None:
        try:
            if not jax.devices(platform_of(job)):
                why = "no %s device visible to JAX" % platform_of(job)
        except Exception as e:
            why = "no %s backend in JAX: %s" % (platform_of(job), protocol.exc_text(e))
    dense_kernel_sums.measure_into(job, reply, LIBRARY, why, _measure, jax_attention.classify)


def _measure(job):
    files, tcfg = job["files"], job["timing"]
    on_cpu = platform_of(job) == "cpu"
    device = jax.devices(platform_of(job))[0]
    fn = build(files["arguments"])
    load_before = cpu_host.load_average() if on_cpu else None

    def stats():
        try:
            return device.memory_stats() or {}
        except Exception:
            return {}
    base = cpu_host.reset_peak_rss() if on_cpu else stats().get("bytes_in_use", 0)
    host = [load_input(t) for t in files["inputs"]]
    set0 = tuple(jax.device_put(x, device) for x in host)
    jax.block_until_ready(set0)
    t0 = time.perf_counter()
    outs = fn(*set0)
    jax.block_until_ready(outs)
    first_call_s = time.perf_counter() - t0
    if on_cpu:
        r = cpu_host.rss_bytes()
        peak = r[1] - base if (base is not None and r is not None) else None
    else:
        peak_stat = stats().get("peak_bytes_in_use")
        peak = peak_stat - base if peak_stat is not None else None
    set_bytes = sum(x.nbytes for x in host)
    out_bytes = sum(int(o.size) * o.dtype.itemsize for o in outs)
    msg, accuracy = check_outputs(outs, files)
    del outs
    if msg is not None:
        return {"message": msg}, None

    free = None
    s = {} if on_cpu else stats()
    if "bytes_limit" in s:
        free = max(0, s["bytes_limit"] - s.get("bytes_in_use", 0))
    n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                        float(tcfg["l2_rotation_factor"]), free)
    sets = [set0] + [tuple(jax.device_put(x, device) for x in host) for _ in range(n_sets - 1)]
    jax.block_until_ready(sets)
    del host
    window0 = protocol.unix_now()
    m = timing.measure(jax_attention.DispatchTimer(fn, sets), tcfg)
    window = [window0, protocol.unix_now()]
    del sets

    notes = [cpu_host.TIMING_NOTE if on_cpu else jax_attention.TIMING_NOTE,
             jax_attention.FIRST_CALL_NOTE, DENSE_NOTE]
    if on_cpu:
        note = cpu_host.load_note(load_before, cpu_host.load_average())
        if note:
            notes.append(note)
    if m["cut_short"]:
        notes.append("%d of %d samples: the %g s case limit stopped sampling"
                     % (m["samples"], int(tcfg["repeats"]), float(tcfg["case_timeout_s"])))
    memory = {"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6}
    if peak is not None:
        memory.update(peak_mb=max(0, peak) / 1e6,
                      peak_method=cpu_host.PEAK_METHOD if on_cpu else jax_attention.PEAK_METHOD,
                      temporaries_mb=max(0, peak - set_bytes - out_bytes) / 1e6)
    fields = dict(
        timing="wall_clock",
        median_ms=m["median"], q1_ms=m["q1"], q3_ms=m["q3"], inner_calls=m["inner"],
        samples=m["samples"], input_sets=n_sets, l2_rotation_reached=reached,
        host_ms=None if on_cpu else m["host_ms"], first_call_s=first_call_s,
        flops=files.get("flops"), bytes=files.get("bytes"), items=files.get("items"),
        memory=memory, accuracy=accuracy, notes=notes)
    return fields, window


def self_test():
    """Pure checks of this module and the shared ones; with JAX, one pair by hand."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("jax_kernel_sums: " + what)

    check(unsupported_reason({"op": "kde", "dtype": "fp32"}, "jax_dense") is None,
          "kde fp32 is measured")
    check("fp32" in unsupported_reason({"op": "kde", "dtype": "bf16"}, "jax_dense"),
          "bf16 points are refused")
    check("unknown" in unsupported_reason({"op": "kde", "dtype": "fp32"}, "jax_xla"),
          "other names are unknown")
    check(platform_of({"device": "cpu"}) == "cpu" and platform_of({}) == "gpu",
          "the job's device picks the platform")
    check(dense_bytes({"n": 1000, "m": 2000}) == 8e6, "dense size")
    if jax is not None and np is not None:
        args = {"op": "kernel_lse", "grad": True, "sigma": 1.0, "epsilon": 2.0, "dim": 2,
                "m": 1, "n": 1}
        with jax.default_device(jax.devices("cpu")[0]):
            out, dx = build(args)(np.array([[0.0, 0.0]], np.float32),
                                  np.array([[3.0, 4.0]], np.float32),
                                  np.array([1.0], np.float32))
        # One point: lse = g - |x - y|^2 / eps = 1 - 12.5; dX = -(2/eps)(x - y) = (3, 4).
        check(abs(float(out[0]) + 11.5) < 1e-5, "lse of one pair: %r" % float(out[0]))
        check(abs(float(dx[0, 0]) - 3.0) < 1e-5 and abs(float(dx[0, 1]) - 4.0) < 1e-5,
              "gradient of one pair: %r" % np.asarray(dx).tolist())
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
