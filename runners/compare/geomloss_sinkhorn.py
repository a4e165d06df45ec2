"""geomloss's Sinkhorn step, measured by the kernelpages protocol (`kernel_sums --compare
geomloss`, op `sinkhorn` only; on the GPU, or with `--device cpu` the CPU: the job's `device`
says which).

geomloss (Feydy et al., `SamplesLoss("sinkhorn", p=2, blur=...)`) solves with a fixed
epsilon-annealing schedule and no tolerance: it has no solve to the runner's L1 marginal
tolerance, so its `solve` rows are `unsupported` with that reason. What every Sinkhorn solver
repeats, and what the `iteration` rows time, is geomloss's soft-min (its C-transform, the loop's
only work on the N x M pairs), called as its Sinkhorn loop calls it:

- `geomloss_tensorized`: `softmin_tensorized` on the two cost matrices C_xy and C_yx built by
  geomloss's `squared_distances(x, y) / 2` (SamplesLoss's cost for p = 2), held in memory
  (`backend="tensorized"`);
- `geomloss_online`: `softmin_online` with the KeOps reduction SamplesLoss builds for
  `backend="online"` on one cloud (`lse_genred(cost_formulas[2], dim)`, the formula
  `SqDist(X,Y) / IntCst(2)`): no N x M matrix. It needs pykeops; without it (or when KeOps
  fails to compile) the row says why.

The cost |x - y|^2 / 2 and epsilon = blur^2 are the runner's. One iteration is the runner's: g
from f, then f from g, with log-weights log(1/N). geomloss's own loop differs in two ways the
rows leave out: it updates f and g together from the previous pair and averages each with its
previous value (the same two soft-mins), and with `debias=True`, its default, it adds the
soft-min of each cloud against itself, two more per iteration.

- pass `iteration`: a timed call builds what the backend holds (the two cost matrices, or
  nothing online), then runs ITERATIONS iterations from f = 0; the row's times are the call's
  divided by ITERATIONS. The check is a separate call of one iteration from f0 (the soft-min of
  g = 0), the runner's float64 reference.

Each job runs in a fresh process (torch_outputs.measure_on_cpu / measure_on_gpu: first call
timed apart, peak memory from the resident set or the caching allocator, CUDA graph replay on
the GPU).

    PYTHONPATH=runners python3 -m compare.geomloss_sinkhorn serve | self-test | job FILE
"""

import contextlib
import math
import os
import shutil
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import dense_kernel_sums, protocol, torch_cpu, torch_outputs  # noqa: E402
    from compare import torch_sdpa  # noqa: E402
else:
    from . import dense_kernel_sums, protocol, torch_cpu, torch_outputs, torch_sdpa

LIBRARY = "geomloss"
IMPLEMENTATIONS = ("geomloss_tensorized", "geomloss_online")
# Iterations per timed call of the `iteration` pass (as ott_sinkhorn's).
ITERATIONS = 10
# SamplesLoss's cost for p = 2 on the online backend (`cost_formulas[2]`), for the notes.
ONLINE_COST = "SqDist(X,Y) / IntCst(2)"

torch = torch_cpu.torch
IMPORT_ERROR = torch_cpu.IMPORT_ERROR
geomloss = None
samples = None
squared_distances = None


def load_geomloss():
    """Imports geomloss (once) into this module's globals; returns why it cannot, or None.

    Called in the job's own process, never at module import: geomloss imports pykeops, whose
    import initialises the CUDA driver (`cuInit`, in KeOps's configuration), and a CUDA driver
    initialised in the server makes every process it forks fail to initialise CUDA ("CUDA driver
    initialization failed": all GPU rows were `unsupported` on the H200 at 9a3c050)."""
    global geomloss, samples, squared_distances, IMPORT_ERROR
    if IMPORT_ERROR is not None or geomloss is not None:
        return IMPORT_ERROR
    try:
        import geomloss as module
        try:  # geomloss 0.3 keeps SamplesLoss's solvers under _legacy
            from geomloss._legacy import sinkhorn_samples as samples
            from geomloss._legacy.utils import squared_distances
        except ImportError:  # geomloss 0.2
            from geomloss import sinkhorn_samples as samples
            from geomloss.utils import squared_distances
        geomloss = module
    except Exception as e:
        IMPORT_ERROR = "geomloss not importable: %s" % protocol.exc_text(e)
    return IMPORT_ERROR


def keops_problem():
    """Why geomloss's online backend cannot run here (pykeops missing), or None."""
    try:
        import pykeops  # noqa: F401
        from pykeops.torch import generic_logsumexp  # noqa: F401
    except Exception as e:
        return ("geomloss's online backend needs pykeops (KeOps), not importable: %s"
                % protocol.exc_text(e))
    return None


@contextlib.contextmanager
def fresh_keops_folder():
    """KeOps's build folder set to a new empty one for the block (removed afterwards, the
    previous one restored), so that a job's first call generates and compiles its reduction
    and KeOps's bindings from nothing: `first_call_s` is a cold start, as `torch_outputs.
    empty_compile_caches` makes it for torch.compile."""
    import pykeops
    folder = tempfile.mkdtemp(prefix="kp_keops_")
    before = pykeops.get_build_folder()
    pykeops.set_build_folder(folder)
    try:
        yield folder
    finally:
        pykeops.set_build_folder(before)
        shutil.rmtree(folder, ignore_errors=True)


def unsupported_reason(case, implementation):
    """Why `implementation` cannot compute `case`, or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if case.get("op") != "sinkhorn":
        return "geomloss is measured on op sinkhorn only, not %r" % (case.get("op"),)
    if case.get("pass") == "solve":
        return ("geomloss runs a fixed epsilon-annealing schedule with no tolerance "
                "(SamplesLoss has no stopping rule): it has no solve to the runner's L1 "
                "marginal tolerance to time; its iteration rows time its soft-min")
    if case.get("pass") != "iteration":
        return "unknown sinkhorn pass %r" % (case.get("pass"),)
    return None


def softmins(implementation, x, y, eps):
    """(f_from_g, g_from_f): geomloss's soft-mins of the clouds x `[n, dim]` and y `[m, dim]`
    (float32 tensors on one device), uniform weights; f_from_g(g) = -eps log sum_j b_j
    exp((g_j - |x_i - y_j|^2 / 2) / eps), g_from_f the same with the clouds swapped. Builds the
    cost matrices (tensorized) or the KeOps reduction (online) first, once."""
    n, m = x.shape[0], y.shape[0]
    a_log = torch.full((1, n), -math.log(n), dtype=x.dtype, device=x.device)
    b_log = torch.full((1, m), -math.log(m), dtype=x.dtype, device=x.device)
    if implementation == "geomloss_tensorized":
        xb, yb = x.unsqueeze(0), y.unsqueeze(0)
        c_xy = squared_distances(xb, yb) / 2
        c_yx = squared_distances(yb, xb) / 2

        def f_from_g(g):
            return samples.softmin_tensorized(eps, c_xy, b_log + g / eps)

        def g_from_f(f):
            return samples.softmin_tensorized(eps, c_yx, a_log + f / eps)
        return f_from_g, g_from_f
    log_conv = samples.lse_genred(samples.cost_formulas[2], x.shape[1], dtype=str(x.dtype)[6:])

    def f_from_g(g):
        return samples.softmin_online(eps, (x, y), b_log + g / eps, log_conv=log_conv)

    def g_from_f(f):
        return samples.softmin_online(eps, (y, x), a_log + f / eps, log_conv=log_conv)
    return f_from_g, g_from_f


def iteration_calls(implementation, eps):
    """(timed, first): functions of (x, y); `timed` runs ITERATIONS iterations from f = 0 and
    returns (f,), `first` one iteration from f0 (the soft-min of g = 0) and returns (f,), the
    runner's reference (f `[n]`)."""

    def timed(x, y):
        f_from_g, g_from_f = softmins(implementation, x, y, eps)
        f = torch.zeros((1, x.shape[0]), dtype=x.dtype, device=x.device)
        for _ in range(ITERATIONS):
            f = f_from_g(g_from_f(f))
        return (f.view(-1),)

    def first(x, y):
        f_from_g, g_from_f = softmins(implementation, x, y, eps)
        f0 = f_from_g(torch.zeros((1, y.shape[0]), dtype=y.dtype, device=y.device))
        return (f_from_g(g_from_f(f0)).view(-1),)

    return timed, first


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        # After the measurement: the version queries must not load anything before the first
        # call is timed.
        reply["libraries"] = (torch_sdpa.libraries() if dense_kernel_sums.on_gpu(job)
                              else torch_cpu.libraries())
        if geomloss is not None:
            reply["libraries"]["geomloss"] = getattr(geomloss, "__version__", "unknown")
        keops = sys.modules.get("pykeops")
        if keops is not None:
            reply["libraries"]["pykeops"] = getattr(keops, "__version__", "unknown")
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    on_gpu = dense_kernel_sums.on_gpu(job)
    why = unsupported_reason(case, implementation) or load_geomloss()
    if why is None and on_gpu and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is None and implementation == "geomloss_online":
        why = keops_problem()
    run = _measure_gpu if on_gpu else _measure_cpu
    if why is None and implementation == "geomloss_online":
        with fresh_keops_folder():
            dense_kernel_sums.measure_into(job, reply, LIBRARY, why, run, _classify)
        return
    dense_kernel_sums.measure_into(job, reply, LIBRARY, why, run, _classify)


def _classify(exc):
    status, msg = torch_cpu.classify(exc)
    if isinstance(exc, RuntimeError) and "not enough memory" in str(exc).lower():
        status = "oom"
    return status, msg


def _notes(implementation):
    if implementation == "geomloss_online":
        held = ("softmin_online with KeOps's log-sum-exp reduction of %s (backend "
                "\"online\"): never an N x M matrix; first_call_s includes KeOps's code "
                "generation and compilation (each job starts from an empty KeOps build "
                "folder)" % ONLINE_COST)
    else:
        held = ("softmin_tensorized on the cost matrices C_xy and C_yx (squared_distances / 2, "
                "backend \"tensorized\"): holds two N x M matrices")
    return [held,
            "each timed call builds them and runs %d iterations (g from f, then f from g) "
            "from f = 0; the times are per iteration (the call's / %d); the check is one "
            "iteration from f0 in a separate call" % (ITERATIONS, ITERATIONS),
            "geomloss's own loop updates f and g together, averaged with the previous pair (the "
            "same two soft-mins), and by default (debias=True) adds each cloud's soft-min "
            "against itself, two more per iteration, which these rows leave out"]


def _check_first(job, load, first):
    """torch_outputs' check, on `first`'s one iteration instead of the timed call's outputs;
    the timed call's f (ITERATIONS iterations) is scanned for non-finite values first."""

    def check(files, results):
        (f,) = results
        bad = (~torch.isfinite(f)).nonzero()
        if bad.numel():
            return {"message": "the timed call's f after %d iterations is not finite at row %d "
                               "of %d" % (ITERATIONS, int(bad[0, 0]), f.numel())}, None
        inputs = tuple(load(t) for t in files["inputs"])
        return torch_outputs.check_outputs(files, first(*inputs))
    return check


def _per_iteration(fields):
    """The row's times per iteration: the call's divided by ITERATIONS."""
    if "message" in fields:
        return fields
    for key in ("median_ms", "q1_ms", "q3_ms", "host_ms", "eager_median_ms"):
        if fields.get(key) is not None:
            fields[key] = fields[key] / ITERATIONS
    return fields


def _measure_cpu(job):
    implementation = job["implementation"]
    timed, first = iteration_calls(implementation, float(job["files"]["arguments"]["epsilon"]))
    check = _check_first(job, torch_cpu.load_input, first)
    fields, window = torch_outputs.measure_on_cpu(job, timed, _notes(implementation),
                                                  check=check)
    return _per_iteration(fields), window


def _measure_gpu(job):
    implementation = job["implementation"]
    timed, first = iteration_calls(implementation, float(job["files"]["arguments"]["epsilon"]))
    device = torch.device("cuda")
    check = _check_first(job, lambda t: torch_sdpa.load_input(t, device), first)
    # KeOps's reduction is not a CUDA graph's to capture (it synchronises on the host).
    graph = implementation == "geomloss_tensorized"
    notes = _notes(implementation)
    if not graph:
        notes.append("timed eagerly: KeOps calls are not captured in a CUDA graph")
    fields, window = torch_outputs.measure_on_gpu(job, timed, notes, check=check, graph=graph)
    return _per_iteration(fields), window


def self_test():
    """Pure checks; with torch and geomloss, one tensorized iteration against float64 and the
    timed call's fixed point against the first iteration's direction, on the CPU."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("geomloss_sinkhorn: " + what)

    # Before anything below imports it: importing this module must not import geomloss (and
    # with it pykeops, whose import initialises CUDA in the server that forks the jobs).
    check(geomloss is None and "pykeops" not in sys.modules,
          "importing the module imported geomloss or pykeops")
    check(unsupported_reason({"op": "sinkhorn", "pass": "iteration"},
                             "geomloss_tensorized") is None, "an iteration is measured")
    check("no tolerance" in unsupported_reason({"op": "sinkhorn", "pass": "solve"},
                                               "geomloss_tensorized"),
          "a solve is refused with the reason")
    check("sinkhorn only" in unsupported_reason({"op": "kde"}, "geomloss_online"),
          "kernel sums are refused")
    check("unknown" in unsupported_reason({"op": "sinkhorn", "pass": "iteration"}, "keops"),
          "other names are unknown")
    if torch is not None and load_geomloss() is None:
        # numpy and the reference only here: importing the module needs neither.
        import numpy as np
        if __package__ in (None, ""):
            from compare.sinkhorn_reference import reference_f1
        else:
            from .sinkhorn_reference import reference_f1
        rng = np.random.default_rng(5)
        x = rng.random((40, 3)).astype(np.float32)
        y = rng.random((30, 3)).astype(np.float32)
        eps = 0.05
        want = reference_f1(x, y, eps)
        timed, first = iteration_calls("geomloss_tensorized", eps)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        got = first(xt, yt)[0].double().numpy()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        check(err < 1e-5, "one iteration vs float64: rel_l2 %.2e" % err)
        f = timed(xt, yt)[0]
        check(f.shape == (40,) and bool(torch.isfinite(f).all()), "timed call's f: %r"
              % (tuple(f.shape),))
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
