"""JAX's dense kernel sums, measured by the kernelpages protocol (`kernel_sums --compare jax`,
on the GPU or with `--device cpu` the CPU; the job's `device` says which).

Implementation `jax_dense`: the formulation a JAX user writes, jitted, written over the N x M
matrix (XLA may fuse it away: at dim 1 the product over one dimension becomes elementwise and
the whole sum one fusion, 8.1 GB of peak at N = 10^6 against the matrix's 4 TB). Squared
distances come from the matrix product, |x|^2 + |y|^2 - 2 x.y (clamped at 0, with
`precision=HIGHEST` so that no TF32 pass is taken on a GPU), then:
- `rbf_mv`: `jnp.exp(sq * (-1 / (2 sigma^2))) @ b`;
- `kde`: the same kernel's row sums times (2 pi sigma^2)^(-dim/2) / M;
- `kernel_lse`: `jax.nn.logsumexp(g - sq / epsilon, axis=1)`, and with the gradient
  (`pass = fwd+bwd`) the value and `jax.vjp`'s gradient with respect to x for a cotangent of
  ones, in one jitted call.
sigma and epsilon are the runner's (`files.arguments`), so every implementation computes the
same function. Each job is measured as `jax_measure.measure_jitted` does (a fresh process, the
first call timed apart, every output checked, `jax_attention.DispatchTimer`, peak memory from
the device or the resident set). A case whose N x M matrix does not fit is an `oom` row with
the size asked.

    PYTHONPATH=runners python3 -m compare.jax_kernel_sums serve | self-test | job FILE
"""

import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import dense_kernel_sums, jax_attention, jax_measure, protocol  # noqa: E402
else:
    from . import dense_kernel_sums, jax_attention, jax_measure, protocol

LIBRARY = "JAX"
IMPLEMENTATIONS = ("jax_dense",)
OPS = dense_kernel_sums.OPS
DENSE_NOTE = ("the dense formulation: N x M squared distances (from a matrix product at "
              "precision HIGHEST) and kernel values, as XLA compiles it (it may fuse the "
              "matrix away, as at dim 1: the peak memory says what was held)")

jax, jnp, np = jax_attention.jax, jax_attention.jnp, jax_attention.np
IMPORT_ERROR = jax_attention.IMPORT_ERROR


def platform_of(job):
    """JAX's platform for the job's device (`gpu` when the job names none)."""
    return jax_measure.platform_of(job)


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
    why = why or jax_measure.platform_problem(job)
    dense_kernel_sums.measure_into(job, reply, LIBRARY, why, _measure, jax_attention.classify)


def _measure(job):
    return jax_measure.measure_jitted(job, build(job["files"]["arguments"]), [DENSE_NOTE])


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
