"""JAX's sequence mixers, measured by the kernelpages protocol (`sequence_mixers --compare jax`,
on the GPU or with `--device cpu` the CPU; the job's `device` says which).

Implementation `jax_scan`: the formulation a JAX user writes for a linear recurrence
S_t = a_t * S_{t-1} + b_t, jitted: `jax.lax.associative_scan` over the pairs (a_t, b_t) with
the operator (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2) (Blelloch's scan; Martin and Cundy,
2018, "Parallelizing linear recurrent neural nets over sequence length"), which holds every
step's state at once, then the read-out:
- `ssd` (Mamba-2's SSD, scalar decay per head): a_t = exp(dt_t A_h), b_t = dt_t x_t B_t^T
  ([B, T, H, P, N], B and C repeated from groups to heads), y_t = S_t C_t + D_h x_t;
- `selective_scan` (Mamba-1): a_t = exp(dt_t A) ([B, T, D, N]), b_t = dt_t u_t B_t,
  y_t = S_t . C_t + D u_t.
The gated delta rule's decay is a matrix (I - beta k k^T) per step and Based is attention plus
a window: neither is this recurrence (`unsupported` rows). Inputs are upcast to float32 and
the output cast to the case's dtype; `pass = fwd+bwd` adds `jax.vjp`'s gradients of
sum(dy * y) with respect to every input, in one jitted call. Matrix products at precision
HIGHEST (no TF32 pass on a GPU). Timing, memory and checks are `jax_measure.measure_jitted`'s
(as for `jax_kernel_sums`): a fresh process per job, the first call (tracing and XLA
compilation included) timed apart, every output scanned for non-finite values and the runner's
elements compared with its float64 reference, then `jax_attention.DispatchTimer`. A case whose scanned states do not fit the
memory there is (about three copies of B T H P N, or B T D N, float32 values) is an `oom` row
with the size asked, without a call.

    PYTHONPATH=runners python3 -m compare.jax_mixers serve | self-test | job FILE
"""

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import jax_attention, jax_measure, protocol  # noqa: E402
else:
    from . import jax_attention, jax_measure, protocol

LIBRARY = "JAX"
IMPLEMENTATIONS = ("jax_scan",)
MIXERS = ("ssd", "selective_scan")
DTYPES = ("fp32", "bf16")
PASSES = ("fwd", "fwd+bwd")
INPUTS = {"ssd": ("x", "dt", "a", "b", "c", "d"),
          "selective_scan": ("u", "delta", "a", "b", "c", "d")}
OTHER_MIXERS = ("the gated delta rule's per-step decay is a matrix (I - beta k k^T) and Based "
                "adds a softmax window: JAX's associative-scan formulation is measured for SSD "
                "and the selective scan")
SCAN_NOTE = ("jax.lax.associative_scan over (decay, input) pairs: every step's state held at "
             "once, float32 (bf16 inputs upcast), matrix products at precision HIGHEST")
BACKWARD_NOTE = ("fwd+bwd: jax.vjp of the forward, the gradients of sum(dy * y) with respect to "
                 "every input, in one jitted call")
# Copies of the scanned states a call holds at its peak (the pairs, the scan's partial results
# and its output), for the memory guard; the backward keeps about twice as many.
STATE_COPIES = {"fwd": 3, "fwd+bwd": 6}
CPU_MEMORY_FRACTION = 0.5

jax, jnp, np = jax_attention.jax, jax_attention.jnp, jax_attention.np
IMPORT_ERROR = jax_attention.IMPORT_ERROR


def arguments(job):
    """The call's arguments (files.arguments, authoritative) over the case's parameters."""
    return dict(job["case"], **(job["files"].get("arguments") or {}))


platform_of = jax_measure.platform_of


def unsupported_reason(case, implementation):
    """Why `implementation` cannot compute `case` (its parameters: `mixer`, `dtype`, `pass`),
    or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    mixer = case.get("mixer")
    if mixer in ("gated_delta", "based"):
        return OTHER_MIXERS
    if mixer not in MIXERS:
        return "mixer %r is not measured (%s)" % (mixer, ", ".join(MIXERS))
    if case.get("pass", "fwd") not in PASSES:
        return "pass %r: fwd or fwd+bwd" % (case.get("pass"),)
    if case.get("dtype") not in DTYPES:
        return "dtype %r is not measured (%s)" % (case.get("dtype"), ", ".join(DTYPES))
    if mixer == "ssd" and "heads" in case and "groups" in case:
        heads, groups = int(case["heads"]), int(case["groups"])
        if groups <= 0 or heads % groups != 0:
            return "heads (%d) is not a multiple of groups (%d)" % (heads, groups)
    return None


def state_bytes(args):
    """Bytes of one float32 copy of every step's state: B T H P N (SSD) or B T D N (scan)."""
    b, t = int(args["batch"]), int(args["seq_len"])
    if args["mixer"] == "ssd":
        return 4 * b * t * int(args["heads"]) * int(args["head_dim"]) * int(args["state"])
    return 4 * b * t * int(args["channels"]) * int(args["state"])


class DoesNotFit(Exception):
    """The scanned states exceed the memory there is: an `oom` row, no call."""


def fits(args, available, where):
    """Raises DoesNotFit when the call's states (STATE_COPIES copies) exceed `available`."""
    need = STATE_COPIES[args.get("pass", "fwd")] * state_bytes(args)
    if available is not None and need > available:
        raise DoesNotFit("the associative scan holds every step's state: about %d copies of "
                         "%s float32 values, %.2f GB; %s is %.2f GB"
                         % (STATE_COPIES[args.get("pass", "fwd")],
                            "B*T*H*P*N" if args["mixer"] == "ssd" else "B*T*D*N",
                            need / 1e9, where, available / 1e9))


def _combine(left, right):
    """The linear recurrence's operator: applying `left` then `right`."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def ssd_scan(x, dt, a, b, c, d):
    """SSD by associative scan, float32: x [B, T, H, P], dt [B, T, H], a [H], b and c
    [B, T, G, N], d [H] -> y [B, T, H, P]."""
    x, dt, a, b, c, d = (v.astype(jnp.float32) for v in (x, dt, a, b, c, d))
    heads, groups = x.shape[2], b.shape[2]
    b = jnp.repeat(b, heads // groups, axis=2)  # head h reads group h // (H / G)
    c = jnp.repeat(c, heads // groups, axis=2)
    decay = jnp.exp(dt * a)[..., None, None]                      # [B, T, H, 1, 1]
    inp = (dt[..., None] * x)[..., :, None] * b[..., None, :]     # [B, T, H, P, N]
    _, states = jax.lax.associative_scan(_combine, (decay, inp), axis=1)
    y = jnp.einsum("bthpn,bthn->bthp", states, c, precision=jax.lax.Precision.HIGHEST)
    return y + d[:, None] * x


def selective_scan_scan(u, delta, a, b, c, d):
    """Mamba-1's selective scan by associative scan, float32: u and delta [B, T, D], a [D, N],
    b and c [B, T, N], d [D] -> y [B, T, D]."""
    u, delta, a, b, c, d = (v.astype(jnp.float32) for v in (u, delta, a, b, c, d))
    decay = jnp.exp(delta[..., None] * a)                         # [B, T, D, N]
    inp = (delta * u)[..., None] * b[:, :, None, :]               # [B, T, D, N]
    _, states = jax.lax.associative_scan(_combine, (decay, inp), axis=1)
    return jnp.sum(states * c[:, :, None, :], axis=-1) + d * u


def build(args):
    """The jitted call on the mixer's inputs (then dy for fwd+bwd) returning (y,) or
    (y, gradients in input order)."""
    out_dtype = jnp.bfloat16 if args["dtype"] == "bf16" else jnp.float32
    forward = ssd_scan if args["mixer"] == "ssd" else selective_scan_scan

    def fwd(*inputs):
        return forward(*inputs).astype(out_dtype)
    if args.get("pass", "fwd") == "fwd":
        return jax.jit(lambda *inputs: (fwd(*inputs),))

    def fwd_bwd(*args_):
        *inputs, dy = args_
        # The gradients of sum(dy * y) with y in float32, with respect to float32 copies of the
        # inputs (so that bf16 inputs get float32 gradients, as the runner's kernels write
        # them): the casts are the inputs' and the output's rounding, not part of the function
        # differentiated.
        y, vjp = jax.vjp(forward, *(v.astype(jnp.float32) for v in inputs))
        grads = vjp(dy.astype(jnp.float32))
        return (y.astype(out_dtype),) + tuple(g.astype(jnp.float32) for g in grads)
    return jax.jit(fwd_bwd)


def check_inputs(args, inputs):
    """Raises ValueError unless the job's inputs are the mixer's, by name and in order (then
    dy for a fwd+bwd call)."""
    names = tuple(t["name"] for t in inputs)
    want = INPUTS[args["mixer"]] + (("dy",) if args.get("pass") == "fwd+bwd" else ())
    if names != want:
        raise ValueError("inputs %s, expected %s for %s" % (", ".join(names), ", ".join(want),
                                                             args["mixer"]))


def classify(exc):
    if isinstance(exc, DoesNotFit):
        return "oom", str(exc)
    return jax_attention.classify(exc)


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
    args = arguments(job)
    why = IMPORT_ERROR or unsupported_reason(args, implementation)
    why = why or jax_measure.platform_problem(job)
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    try:
        fields, window = _measure(job, args)
    except Exception as e:
        status, msg = classify(e)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    if window is None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "error",
                                         fields["message"])
        return
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def _measure(job, args):
    check_inputs(args, job["files"]["inputs"])
    if platform_of(job) == "cpu":
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            physical = None
        fits(args, None if physical is None else CPU_MEMORY_FRACTION * physical,
             "half the host's physical memory")
    else:
        fits(args, jax_measure.free_device_bytes(jax.devices("gpu")[0]),
             "the free device memory")
    notes = [SCAN_NOTE] + ([BACKWARD_NOTE] if args.get("pass") == "fwd+bwd" else [])
    return jax_measure.measure_jitted(job, build(args), notes)


def _sequential(decay, inp, readout):
    """The recurrence one step after another in float64 (the self-test's reference): decay and
    inp [T, ...] NumPy arrays, readout(state, t) -> y_t."""
    state = np.zeros(inp.shape[1:], np.float64)
    ys = []
    for t in range(inp.shape[0]):
        state = decay[t] * state + inp[t]
        ys.append(readout(state, t))
    return np.stack(ys)


def self_test():
    """Pure checks of this module and the shared ones; with JAX, both formulations and one
    gradient against float64 step-by-step recurrences."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("jax_mixers: " + what)

    ssd = {"mixer": "ssd", "pass": "fwd", "dtype": "bf16", "heads": 8, "groups": 2}
    check(unsupported_reason(ssd, "jax_scan") is None, "ssd bf16 is measured")
    check(unsupported_reason(dict(ssd, **{"pass": "fwd+bwd"}), "jax_scan") is None,
          "ssd's backward is measured")
    check(unsupported_reason(dict(ssd, mixer="selective_scan", dtype="fp32"), "jax_scan")
          is None, "the scan in fp32 is measured")
    check("associative-scan" in (unsupported_reason(dict(ssd, mixer="based"), "jax_scan") or ""),
          "based is refused with the reason")
    check("groups" in (unsupported_reason(dict(ssd, groups=3), "jax_scan") or ""),
          "heads not a multiple of groups")
    check("unknown" in unsupported_reason(ssd, "jax_xla"), "other names are unknown")
    args = {"mixer": "ssd", "batch": 4, "seq_len": 1024, "heads": 8, "head_dim": 64, "state": 64,
            "pass": "fwd"}
    check(state_bytes(args) == 4 * 4 * 1024 * 8 * 64 * 64, "ssd state bytes")
    try:
        fits(args, 1e9, "test memory")
        check(False, "ssd at T = 1024 fits in 1 GB")
    except DoesNotFit as e:
        check(classify(e)[0] == "oom" and "B*T*H*P*N" in str(e), "oom row: %s" % e)
    fits(args, 1e12, "test memory")
    fits(args, None, "unknown memory")
    check(platform_of({"device": "cpu"}) == "cpu" and platform_of({}) == "gpu",
          "the job's device picks the platform")
    if jax is None or np is None:
        return failures
    rng = np.random.default_rng(5)
    bsz, t_len, heads, groups, p_dim, n_dim, channels = 2, 37, 4, 2, 3, 5, 6
    with jax.default_device(jax.devices("cpu")[0]):
        x = rng.standard_normal((bsz, t_len, heads, p_dim)).astype(np.float32)
        dt = rng.uniform(0.01, 0.3, (bsz, t_len, heads)).astype(np.float32)
        a = -rng.uniform(0.1, 2.0, heads).astype(np.float32)
        b = rng.standard_normal((bsz, t_len, groups, n_dim)).astype(np.float32)
        c = rng.standard_normal((bsz, t_len, groups, n_dim)).astype(np.float32)
        d = rng.standard_normal(heads).astype(np.float32)
        (got,) = build({"mixer": "ssd", "dtype": "fp32"})(x, dt, a, b, c, d)
        want = np.zeros(got.shape)
        for bb in range(bsz):
            for h in range(heads):
                g = h // (heads // groups)
                dec = np.exp(dt[bb, :, h].astype(np.float64) * a[h])[:, None, None]
                inp = (dt[bb, :, h, None] * x[bb, :, h])[:, :, None].astype(np.float64) \
                    * b[bb, :, g][:, None, :]
                want[bb, :, h] = _sequential(dec, inp, lambda s, t: s @ c[bb, t, g]) \
                    + d[h] * x[bb, :, h]
        err = float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))
        check(err < 1e-5, "ssd rel_l2 %g" % err)
        u = rng.standard_normal((bsz, t_len, channels)).astype(np.float32)
        delta = rng.uniform(0.01, 0.3, (bsz, t_len, channels)).astype(np.float32)
        a2 = -rng.uniform(0.1, 2.0, (channels, n_dim)).astype(np.float32)
        b2 = rng.standard_normal((bsz, t_len, n_dim)).astype(np.float32)
        c2 = rng.standard_normal((bsz, t_len, n_dim)).astype(np.float32)
        d2 = rng.standard_normal(channels).astype(np.float32)
        (got,) = build({"mixer": "selective_scan", "dtype": "fp32"})(u, delta, a2, b2, c2, d2)
        want = np.zeros(got.shape)
        for bb in range(bsz):
            dec = np.exp(delta[bb][:, :, None].astype(np.float64) * a2)
            inp = (delta[bb] * u[bb])[:, :, None].astype(np.float64) * b2[bb][:, None, :]
            want[bb] = _sequential(dec, inp, lambda s, t: s @ c2[bb, t]) + d2 * u[bb]
        err = float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))
        check(err < 1e-5, "selective scan rel_l2 %g" % err)
        # fwd+bwd: the gradients of sum(dy * y) against central differences of that sum in
        # float64 (jax's x64 mode off: the differences on the float64 reference above).
        dy = rng.standard_normal(x.shape).astype(np.float32)
        outs = build({"mixer": "ssd", "dtype": "fp32", "pass": "fwd+bwd"})(x, dt, a, b, c, d, dy)
        check(len(outs) == 7 and outs[1].shape == x.shape and outs[3].shape == a.shape,
              "fwd+bwd returns y and 6 gradients of the inputs' shapes")

        def loss(a_vec):
            total = 0.0
            for bb in range(bsz):
                for h in range(heads):
                    g = h // (heads // groups)
                    dec = np.exp(dt[bb, :, h].astype(np.float64) * a_vec[h])[:, None, None]
                    inp = (dt[bb, :, h, None] * x[bb, :, h])[:, :, None].astype(np.float64) \
                        * b[bb, :, g][:, None, :]
                    y = _sequential(dec, inp, lambda s, t: s @ c[bb, t, g]) + d[h] * x[bb, :, h]
                    total += float(np.sum(dy[bb, :, h] * y))
            return total
        a64 = a.astype(np.float64)
        for h in range(heads):
            step = np.zeros(heads)
            step[h] = 1e-5
            fd = (loss(a64 + step) - loss(a64 - step)) / 2e-5
            got_da = float(np.asarray(outs[3])[h])
            check(abs(fd - got_da) <= 1e-3 * (1.0 + abs(fd)),
                  "ssd dA[%d]: vjp %g, finite difference %g" % (h, got_da, fd))
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
