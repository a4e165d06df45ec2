"""ott-jax's Sinkhorn solver, measured by the kernelpages protocol (`kernel_sums --compare ott`,
op `sinkhorn` only; on the GPU, or with `--device cpu` the CPU: the job's `device` says which).

Implementations (ott-jax 0.6: `ott.solvers.linear.sinkhorn.Sinkhorn`, log domain, on a
`ott.geometry.pointcloud.PointCloud` of the two clouds, uniform weights):
- `ott_dense`: the geometry holds the N x M cost matrix (`batch_size=None`, ott's default);
- `ott_online`: `batch_size=ONLINE_BATCH`, the cost recomputed block by block (O(N) memory).

The runner's conventions, matched: its cost is |x - y|^2 / 2 and ott's `SqEuclidean` is
|x - y|^2, so ott runs at epsilon_ott = 2 epsilon, which gives the same transport plan (ott's
potentials f' relate to the runner's f by f = f' / 2 - epsilon log a_i, since ott's plan is
exp((f'_i + g'_j - C'_ij) / epsilon') without the weights). ott's iteration is the runner's:
g from f, then f from g (`parallel_dual_updates=False`, its default).

- pass `iteration`: a timed call runs ITERATIONS iterations at epsilon, jitted, from ott's zero
  initial potentials; ott evaluates its marginal error once, at the last iteration (it always
  does there); the row's times are the call's divided by ITERATIONS. The check is a separate
  call of one iteration from f0, the soft-min of g = 0, which is what the runner's float64
  reference defines (f after one iteration), compared as f' / 2 - epsilon log a.
- pass `solve`: ott's solver with the runner's stopping rule and schedule: `threshold` = the
  runner's `tol` on the L1 marginal error (`norm_error=1`, checked every `inner_iterations`,
  ott's default 10), at most MAX_ITERATIONS iterations, and epsilon-scaling by the runner's
  `scaling` from the squared diagonal of the clouds' bounding box down to epsilon (ott's
  `Epsilon(target, init, decay)`: epsilon_t = max(init decay^t, 1) target, the runner's
  schedule). The output is the plan's row marginal from the final potentials (ott's
  `marginal(axis=1)`), checked on every row against the weights 1/N. A solve that ends
  unconverged is an `error` row with its iterations and the error reached.

Each job runs in a fresh process as `jax_measure.measure_jitted` measures it (first call timed
apart, peak memory from the device or the resident set).

    PYTHONPATH=runners python3 -m compare.ott_sinkhorn serve | self-test | job FILE
"""

import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import jax_attention, jax_measure, protocol  # noqa: E402
    from compare.sinkhorn_reference import reference_f1  # noqa: E402
else:
    from . import jax_attention, jax_measure, protocol
    from .sinkhorn_reference import reference_f1

LIBRARY = "ott-jax"
IMPLEMENTATIONS = ("ott_dense", "ott_online")
# Iterations per timed call of the `iteration` pass.
ITERATIONS = 10
# Points per block of `ott_online`'s cost (its `batch_size`).
ONLINE_BATCH = 1024
# The runner's cap on a solve's iterations (`sinkhorn::Params::new`'s max_iter).
MAX_ITERATIONS = 10000

jax, jnp, np = jax_attention.jax, jax_attention.jnp, jax_attention.np
IMPORT_ERROR = jax_attention.IMPORT_ERROR
try:
    import ott
    from ott.geometry import epsilon_scheduler, pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn as ott_sinkhorn
except Exception as _e:  # ImportError, or a JAX it does not work with
    ott = None
    IMPORT_ERROR = IMPORT_ERROR or "ott-jax not importable: %s" % protocol.exc_text(_e)


def unsupported_reason(case, implementation):
    """Why `implementation` cannot compute `case`, or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if case.get("op") != "sinkhorn":
        return "ott-jax is measured on op sinkhorn only, not %r" % (case.get("op"),)
    if case.get("pass") not in ("iteration", "solve"):
        return "unknown sinkhorn pass %r" % (case.get("pass"),)
    return None


def geometry(implementation, x, y, epsilon):
    """The point cloud of (x, y) in ott's units, at the runner's `epsilon` (a number, or an
    ott `Epsilon` schedule already in ott's units)."""
    batch = ONLINE_BATCH if implementation == "ott_online" else None
    return pointcloud.PointCloud(x, y, epsilon=epsilon, batch_size=batch)


def runner_f(f_ott, epsilon, n):
    """ott's potential f' as the runner's f: f' / 2 - epsilon log(1/n)."""
    return f_ott / 2.0 + epsilon * math.log(n)


def squared_diagonal(x, y):
    """The squared diagonal of the clouds' common bounding box (the runner's first epsilon)."""
    both = np.concatenate([np.asarray(x, np.float64), np.asarray(y, np.float64)])
    return float(np.sum((both.max(axis=0) - both.min(axis=0)) ** 2))


def iteration_calls(implementation, eps):
    """(timed, check): jitted functions of (x, y); `timed` runs ITERATIONS iterations and
    returns (f',), `check` one iteration from f0 and returns (the runner's f,)."""
    eps_ott = 2.0 * eps

    def run(x, y, iterations, init):
        prob = linear_problem.LinearProblem(geometry(implementation, x, y, eps_ott))
        solver = ott_sinkhorn.Sinkhorn(min_iterations=iterations, max_iterations=iterations,
                                       inner_iterations=iterations)
        return solver(prob) if init is None else solver(prob, init=init(prob))

    def from_f0(prob):
        # f0: the f update against the runner's g = 0, which is g' = epsilon' log b in ott.
        n, m = prob.geom.shape
        log_a, log_b = jnp.log(prob.a), jnp.log(prob.b)
        f0 = prob.geom.update_potential(jnp.zeros(n), eps_ott * log_b, log_a, axis=1)
        return (f0, jnp.zeros(m))

    def timed(x, y):
        return (run(x, y, ITERATIONS, None).f,)

    def check(x, y):
        return (runner_f(run(x, y, 1, from_f0).f, eps, x.shape[0]),)

    return jax.jit(timed), jax.jit(check)


def solve_call(implementation, args, diag2):
    """The jitted solve of (x, y): (row marginal, iterations, converged, L1 error reached,
    transport cost <P, C> in the runner's units)."""
    eps, tol, scaling = float(args["epsilon"]), float(args["tol"]), float(args["scaling"])
    schedule = epsilon_scheduler.Epsilon(target=2.0 * eps, init=max(diag2 / eps, 1.0),
                                         decay=scaling)

    def solve(x, y):
        prob = linear_problem.LinearProblem(geometry(implementation, x, y, schedule))
        solver = ott_sinkhorn.Sinkhorn(threshold=tol, norm_error=1,
                                       max_iterations=MAX_ITERATIONS)
        out = solver(prob)
        errors = out.errors
        last = jnp.max(jnp.where(errors >= 0, jnp.arange(errors.shape[0]), -1))
        return (out.marginal(axis=1), out.n_iters, out.converged,
                errors[jnp.maximum(last, 0)], out.primal_cost / 2.0)

    return jax.jit(solve)


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        reply["libraries"] = jax_attention.libraries()
        if ott is not None:
            reply["libraries"]["ott-jax"] = getattr(ott, "__version__", "unknown")
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = IMPORT_ERROR or unsupported_reason(case, implementation)
    why = why or jax_measure.platform_problem(job)
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    try:
        fields, window = _measure(job)
    except Exception as e:
        status, msg = jax_attention.classify(e)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def _formulation_note(implementation):
    if implementation == "ott_online":
        return ("ott-jax PointCloud with batch_size %d: the cost recomputed block by block, "
                "never an N x M matrix" % ONLINE_BATCH)
    return "ott-jax PointCloud without batch_size: holds the N x M cost matrix"


def _measure(job):
    files, implementation = job["files"], job["implementation"]
    args = files["arguments"]
    eps = float(args["epsilon"])
    notes = [_formulation_note(implementation),
             "ott's cost |x - y|^2 at epsilon' = 2 epsilon: the runner's plan (cost "
             "|x - y|^2 / 2 at epsilon)"]
    if job["case"]["pass"] == "iteration":
        timed, check = iteration_calls(implementation, eps)
        notes.append("each timed call runs %d iterations (g from f, then f from g), with "
                     "ott's marginal-error evaluation at the last; the times are per "
                     "iteration (the call's / %d)" % (ITERATIONS, ITERATIONS))
        fields, window = jax_measure.measure_jitted(job, timed, notes, check_fn=check,
                                                    per_call=ITERATIONS)
        if "message" not in fields:
            n = int(args["n"])
            fields["items"] = 2.0 * n * int(args["m"])
        return fields, window
    x = jax_measure.load_input(files["inputs"][0])
    y = jax_measure.load_input(files["inputs"][1])
    solve = solve_call(implementation, args, squared_diagonal(x, y))
    seen = {}

    def inspect(outs):
        iters, converged, err, cost = (int(outs[1]), bool(outs[2]), float(outs[3]),
                                       float(outs[4]))
        seen.update(iters=iters, err=err, cost=cost)
        if not converged:
            return ("not converged: %d iterations left an L1 marginal error of %.2e above the "
                    "tolerance %g" % (iters, err, float(args["tol"])))
        return None

    notes.append("epsilon-scaling by %g from the squared diagonal of the bounding box, "
                 "threshold %g on ott's L1 marginal error (norm_error=1), checked every 10 "
                 "iterations (ott's inner_iterations default)" % (float(args["scaling"]),
                                                                float(args["tol"])))
    fields, window = jax_measure.measure_jitted(job, solve, notes, inspect=inspect)
    if "message" in fields:
        return fields, window
    n, m = int(args["n"]), int(args["m"])
    fields["items"] = 2.0 * seen["iters"] * n * m
    fields["notes"].append(
        "converged in %d iterations, L1 marginal error %.2e (tolerance %g), transport cost "
        "<P, C> %.6e" % (seen["iters"], seen["err"], float(args["tol"]), seen["cost"]))
    fields["notes"].append("evaluations counted: 2 x iterations x N x M (its marginal-error "
                           "evaluations are timed but not counted)")
    return fields, window


def self_test():
    """Pure checks; with ott-jax, its one iteration against the runner's float64 definition
    and a solve's marginals, on the CPU."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("ott_sinkhorn: " + what)

    check(unsupported_reason({"op": "sinkhorn", "pass": "solve"}, "ott_dense") is None,
          "a solve is measured")
    check("sinkhorn only" in unsupported_reason({"op": "kde"}, "ott_dense"),
          "kernel sums are refused")
    check("unknown" in unsupported_reason({"op": "sinkhorn", "pass": "solve"}, "ott_x"),
          "other names are unknown")
    check(abs(runner_f(2.0, 0.5, 4) - (1.0 + 0.5 * math.log(4))) < 1e-12, "potential units")
    check(squared_diagonal([[0.0, 0.0]], [[3.0, 4.0]]) == 25.0, "squared diagonal")
    if ott is not None and jax is not None:
        rng = np.random.default_rng(3)
        x = rng.random((40, 3)).astype(np.float32)
        y = rng.random((30, 3)).astype(np.float32)
        eps = 0.05
        want = reference_f1(x, y, eps)
        with jax.default_device(jax.devices("cpu")[0]):
            # ott_online is left out: with JAX 0.10 and 0.11 its batching fails inside ott
            # (`jax.interpreters.batching.is_vmappable` is gone), which its rows report.
            _, one = iteration_calls("ott_dense", eps)
            got = np.asarray(one(x, y)[0], np.float64)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            check(err < 1e-5, "one iteration vs float64: rel_l2 %.2e" % err)
            args = {"epsilon": eps, "tol": 1e-3, "scaling": 0.5}
            out = solve_call("ott_dense", args, squared_diagonal(x, y))(x, y)
            r = np.asarray(out[0], np.float64)
            check(bool(out[2]), "the solve converges")
            check(abs(r.sum() - 1.0) < 1e-3 and np.abs(r - 1.0 / 40).sum() < 1e-3,
                  "row marginal meets the weights: %r" % np.abs(r - 1.0 / 40).sum())
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
