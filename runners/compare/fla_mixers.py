"""flash-linear-attention's Triton kernels for the sequence mixers, measured by the kernelpages
protocol (`sequence_mixers --compare fla`, GPU only). The library is fla-core 0.6 (the `fla`
package's kernels, without its model layers); on a machine without it every row is
`unsupported` and says so.

Implementation `fla_chunk`, per mixer (the runner's `files.arguments`; inputs as
`torch_mixers` documents them), each the chunked kernel a user of the library calls:
- `ssd`: `fla.ops.simple_gla.chunk_simple_gla`, the SSD form with one scalar decay per head
  and step: q = C and k = B (repeated from groups to heads), v = dt * x (computed in float32,
  stored in the case's dtype), g = dt * A (float32 log decays), scale 1, so that
  o_t = C_t^T S_t with S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T; then y = o + D x in
  PyTorch (float32, stored in the case's dtype).
- `gated_delta`: `fla.ops.gated_delta_rule.chunk_gated_delta_rule` with g = log(alpha),
  beta as given (float32), scale 1 (q is pre-scaled by the runner) and k already
  L2-normalised (`use_qk_l2norm_in_kernel=False`): S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T)
  + beta_t v_t k_t^T, o_t = S_t q_t.
- `based`: the two branches as two kernels of the library, summed in float32 by PyTorch:
  `fla.ops.linear_attn.chunk_linear_attn(q, k, v, scale=c, normalize=False)` (the causal,
  unnormalised linear branch) and `fla.ops.attn.parallel_attn(q, k, v, scale=c,
  window_size=W)` (the exact softmax over the keys in [t - W + 1, t]).
- `selective_scan`: `unsupported` (the library has no Mamba-1 selective scan: a decay per
  channel and state element).
From a zero initial state, output in the case's dtype; `pass = fwd+bwd` (SSD, the gated delta
rule and Based)
runs the library's backward kernels through autograd (`torch_mixers.with_backward`), after
checking, for SSD and the gated delta rule, the library's own refusal of its gated backward on
Hopper (`backward_refusal`).

The library is imported in the job's own process, never in the server: importing `fla`
queries the CUDA device (its hardware flags), and the server forks one process per job before
CUDA is initialised. Measurement, memory and timing are `torch_outputs.measure_on_gpu`'s
(allocator peak, eager calls between CUDA events, then a CUDA graph of them), the peak read on
a second call: the first compiles and autotunes the Triton kernels, whose benchmarking buffers
are not the library's.

    PYTHONPATH=runners python3 -m compare.fla_mixers serve | self-test | job FILE
"""
import importlib.util
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_mixers, torch_outputs  # noqa: E402
else:
    from . import protocol, torch_mixers, torch_outputs

LIBRARY = "flash-linear-attention"
IMPLEMENTATIONS = ("fla_chunk",)
MIXERS = ("ssd", "gated_delta", "based")
DTYPES = torch_mixers.DTYPES
PASSES = ("fwd", "fwd+bwd")
# The mixers whose fwd+bwd this module measures (the library's backward kernels, through
# autograd): the SSD row's chunk_simple_gla, chunk_gated_delta_rule, and Based's
# chunk_linear_attn + parallel_attn.
BACKWARD_MIXERS = ("ssd", "gated_delta", "based")
# The mixers whose backward is the library's gated one (g given), which it refuses on Hopper
# with some Triton versions (backward_refusal).
GATED_BACKWARD = ("ssd", "gated_delta")
NO_SCAN = ("flash-linear-attention has no Mamba-1 selective scan (a decay per channel and state "
           "element); on a GPU its SSD-like kernel (simple GLA) is the ssd row")
MIXER_NOTES = {
    "ssd": "chunk_simple_gla: q = C, k = B (repeated from groups to heads), v = dt x, "
           "g = dt A, scale 1; + D x in PyTorch",
    "gated_delta": "chunk_gated_delta_rule: g = log(alpha), scale 1, k normalised by the "
                   "runner (not in the kernel)",
    "based": "chunk_linear_attn (normalize=False) + parallel_attn(window_size=W), summed in "
             "float32 by PyTorch",
}

torch = torch_mixers.torch


def _import_error():
    """Why the library cannot be used here, or None. Looks the package up without importing
    it (an import would initialise CUDA in the server)."""
    if torch_mixers.IMPORT_ERROR:
        return torch_mixers.IMPORT_ERROR
    try:
        found = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return ("flash-linear-attention (the `fla` package, fla-core) is not installed in this "
                "Python: install fla-core and einops, or carry them as wheels")
    return None


IMPORT_ERROR = _import_error()


def library_version():
    """fla-core's version from its metadata (without importing it), or None."""
    try:
        from importlib import metadata
    except ImportError:
        return None
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except Exception:
            continue
    return None


# flash-linear-attention 0.6 refuses its gated backward (chunk_bwd_dqkwg, which simple GLA's
# backward calls) on Hopper with Triton in [3.4.0, 3.7.1) (its issue #640: wrong results), but
# only after the forward has compiled: about 110 s per row on the H200. The same condition,
# checked before the call, answers those rows at once with the library's reason.
BACKWARD_REFUSED_TRITON = ((3, 4, 0), (3, 7, 1))


def version_tuple(text):
    """(major, minor, patch) of a version string such as "3.6.0" or "3.5.0+git1234"."""
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def backward_refusal(triton_version, capability_major):
    """The library's reason for refusing its gated backward with this Triton on a device of
    this compute capability (major), or None where it runs."""
    lo, hi = BACKWARD_REFUSED_TRITON
    if capability_major == 9 and lo <= version_tuple(triton_version) < hi:
        return ("flash-linear-attention refuses its gated backward (chunk_bwd_dqkwg) with Triton "
                "%s on Hopper: Triton >= 3.4.0 and < 3.7.1 give wrong results there (the "
                "library's issue #640; it asks for Triton >= 3.7.1 or tilelang)" % triton_version)
    return None


def unsupported_reason(case, implementation, device="gpu"):
    """Why `implementation` cannot compute `case` (its parameters, or the call's arguments:
    `mixer`, `dtype`, `pass`) on `device` ("gpu" or "cpu"), or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if device != "gpu":
        return "flash-linear-attention's kernels are Triton kernels for GPUs: no CPU rows"
    mixer = case.get("mixer")
    if mixer == "selective_scan":
        return NO_SCAN
    if mixer not in MIXERS:
        return "mixer %r is not measured (%s)" % (mixer, ", ".join(MIXERS))
    if case.get("pass") not in PASSES:
        return "pass %r: fwd or fwd+bwd" % (case.get("pass"),)
    if case.get("pass") == "fwd+bwd" and mixer not in BACKWARD_MIXERS:
        return "fwd+bwd of %s: the backward is measured for %s only" % (
            mixer, ", ".join(BACKWARD_MIXERS))
    if case.get("dtype") not in DTYPES:
        return "dtype %r is not measured (%s)" % (case.get("dtype"), ", ".join(DTYPES))
    if mixer == "ssd" and "heads" in case and "groups" in case:
        heads, groups = int(case["heads"]), int(case["groups"])
        if groups <= 0 or heads % groups != 0:
            return "heads (%d) is not a multiple of groups (%d)" % (heads, groups)
    if mixer == "based" and "window" in case and int(case["window"]) < 1:
        return "window %d: the sliding window holds at least the query's own key" % int(
            case["window"])
    return None


def ssd_arguments(x, dt, a, b, c):
    """chunk_simple_gla's (q, k, v, g) for SSD's inputs (x [B, T, H, P], dt [B, T, H] fp32,
    a [H] fp32, b and c [B, T, G, N]): C and B repeated from G groups to H heads (head h reads
    group h // (H / G)), v = dt x rounded to x's dtype, g = dt a in float32."""
    rep = x.shape[2] // b.shape[2]
    q = c.repeat_interleave(rep, dim=2)
    k = b.repeat_interleave(rep, dim=2)
    v = (dt.float().unsqueeze(-1) * x.float()).to(x.dtype)
    g = dt.float() * a.float().view(1, 1, -1)
    return q, k, v, g


def caller(args, ops):
    """The call on the mixer's inputs (files.inputs, in order) returning (y,); `ops` maps
    chunk_simple_gla, chunk_gated_delta_rule, chunk_linear_attn and parallel_attn to the
    library's functions (`load_ops`)."""
    out_dtype = torch.bfloat16 if args["dtype"] == "bf16" else torch.float32
    mixer = args["mixer"]
    if mixer == "ssd":
        def ssd(x, dt, a, b, c, d):
            q, k, v, g = ssd_arguments(x, dt, a, b, c)
            o, _ = ops["chunk_simple_gla"](q, k, v, g=g, scale=1.0)
            y = o.float() + d.float().view(1, 1, -1, 1) * x.float()
            return (y.to(out_dtype),)
        return ssd
    if mixer == "gated_delta":
        def delta(q, k, v, alpha, beta):
            o, _ = ops["chunk_gated_delta_rule"](q, k, v, g=torch.log(alpha.float()),
                                                  beta=beta, scale=1.0,
                                                  use_qk_l2norm_in_kernel=False)
            return (o.to(out_dtype),)
        return delta
    scale, window = float(args["scale"]), int(args["window"])

    def based(q, k, v):
        o_lin, _ = ops["chunk_linear_attn"](q, k, v, scale=scale, normalize=False)
        o_win = ops["parallel_attn"](q, k, v, scale=scale, window_size=window)
        return ((o_lin.float() + o_win.float()).to(out_dtype),)
    return based


def load_ops():
    """Imports the library's kernels (in the job's process: this initialises CUDA)."""
    from fla.ops.attn import parallel_attn
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.linear_attn import chunk_linear_attn
    from fla.ops.simple_gla import chunk_simple_gla
    return {"chunk_simple_gla": chunk_simple_gla, "chunk_gated_delta_rule": chunk_gated_delta_rule,
            "chunk_linear_attn": chunk_linear_attn, "parallel_attn": parallel_attn}


def formulation_notes(args):
    """The row's notes: the kernel and argument mapping, fp32's matrix-product precision, and
    when the peak memory is read."""
    notes = [MIXER_NOTES[args["mixer"]], torch_outputs.TRITON_PEAK_NOTE]
    if args["dtype"] == "fp32":
        notes.append(torch_outputs.triton_fp32_note())
    return notes


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    return torch_outputs.measure_with_library(job, _measure_into, "fla", library_version)


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    args = torch_mixers.arguments(job)
    device = "gpu" if torch_mixers.on_gpu(job) else "cpu"
    why = unsupported_reason(args, implementation, device) or IMPORT_ERROR
    if why is None and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    # The refusal is of the gated backward (g given): SSD's and the gated delta rule's rows
    # pass g, Based's linear branch (chunk_linear_attn: chunk_simple_gla without g) does not.
    if args.get("pass") == "fwd+bwd" and args.get("mixer") in GATED_BACKWARD:
        try:
            import triton
            refusal = backward_refusal(triton.__version__,
                                       torch.cuda.get_device_capability()[0])
        except Exception:
            refusal = None  # the call itself will say
        if refusal is not None:
            reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", refusal)
            return
    try:
        ops = load_ops()
    except Exception as e:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported",
                                         "flash-linear-attention does not import: %s"
                                         % protocol.exc_text(e))
        return
    try:
        torch_mixers.check_inputs(args, job["files"]["inputs"])
        call, notes = caller(args, ops), formulation_notes(args)
        if args.get("pass") == "fwd+bwd":
            call = torch_mixers.with_backward(call)
            notes.append(torch_mixers.BACKWARD_NOTE + " (the library's backward kernels)")
        fields, window = torch_outputs.measure_on_gpu(job, call, notes,
                                                      peak_on_second_call=True)
    except Exception as e:
        status, msg = torch_mixers.classify(e)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def self_test():
    """The protocol's checks, this module's reasons, and, where torch and the library are
    installed, each mixer's call against the float64 recurrences of `torch_mixers` (T = 70: a
    partial chunk) in bf16 and fp32: the kernels where torch has a GPU, else the library's
    reference formulations in their place (which checks the arguments the calls pass)."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append(what)

    check("selective scan" in (unsupported_reason({"mixer": "selective_scan"}, "fla_chunk")
                               or ""), "the scan is unsupported")
    check("GPU" in (unsupported_reason({"mixer": "ssd"}, "fla_chunk", "cpu") or ""),
          "no CPU rows")
    ok_case = {"mixer": "ssd", "pass": "fwd", "dtype": "bf16", "heads": 8, "groups": 2}
    check(unsupported_reason(ok_case, "fla_chunk") is None, "ssd bf16 runs")
    check(unsupported_reason(dict(ok_case, groups=3), "fla_chunk") is not None,
          "heads not a multiple of groups")
    check(unsupported_reason(dict(ok_case, **{"pass": "fwd+bwd"}), "fla_chunk") is None,
          "ssd's backward runs")
    check(unsupported_reason(dict(ok_case, mixer="based", **{"pass": "fwd+bwd"}), "fla_chunk")
          is None, "based's backward runs")
    check(unsupported_reason(dict(ok_case, mixer="gated_delta", **{"pass": "fwd+bwd"}),
                             "fla_chunk") is None, "gated delta's backward runs")
    check(version_tuple("3.6.0") == (3, 6, 0) and version_tuple("3.5.0+git12ab") == (3, 5, 0)
          and version_tuple("3.7") == (3, 7, 0), "version strings")
    check("#640" in (backward_refusal("3.6.0", 9) or ""), "Triton 3.6 on Hopper: refused")
    check(backward_refusal("3.7.1", 9) is None and backward_refusal("3.3.1", 9) is None,
          "Triton outside [3.4.0, 3.7.1): runs")
    check(backward_refusal("3.6.0", 8) is None, "Triton 3.6 on Ampere: runs")
    if IMPORT_ERROR:
        protocol.log("fla_mixers self-test: the kernels are not checked here (%s)" % IMPORT_ERROR)
        return failures
    if not torch.cuda.is_available():
        # The argument mapping, with the library's own PyTorch reference formulations in place
        # of its kernels (their files loaded alone: the package would import Triton and CUDA).
        protocol.log("fla_mixers self-test: the kernels are not checked here (no CUDA device); "
                     "the calls are, on the library's reference formulations")
        for name, err, bound in errors(naive_ops(), torch.device("cpu")):
            check(err < bound, "%s (reference formulations) rel_l2 %g (bound %g)"
                  % (name, err, bound))
        return failures
    for name, err, bound in errors(load_ops(), torch.device("cuda")):
        check(err < bound, "%s rel_l2 %g (bound %g)" % (name, err, bound))
    return failures


def naive_ops():
    """The library's PyTorch reference formulations (`naive.py` of each op, loaded from their
    files without the package) under the kernels' names and signatures."""
    root = importlib.util.find_spec("fla").submodule_search_locations[0]

    def load(op):
        path = os.path.join(root, "ops", op, "naive.py")
        spec = importlib.util.spec_from_file_location("fla_naive_" + op, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    sg, gd = load("simple_gla"), load("gated_delta_rule")
    la, at = load("linear_attn"), load("attn")
    return {
        "chunk_simple_gla": lambda q, k, v, g, scale: sg.naive_recurrent_simple_gla(
            q, k, v, g, scale=scale),
        "chunk_gated_delta_rule": lambda q, k, v, g, beta, scale, use_qk_l2norm_in_kernel: (
            gd.naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale)),
        "chunk_linear_attn": lambda q, k, v, scale, normalize: la.naive_recurrent_linear_attn(
            q, k, v, scale=scale, normalize=normalize),
        "parallel_attn": lambda q, k, v, scale, window_size: at.naive_parallel_attn(
            q, k, v, scale=scale, window_size=window_size)[0],
    }


def errors(ops, dev, bsz=2, t_len=70, heads=4, groups=2, dim=64):
    """[(what, rel_l2 against float64, bound)] of each mixer's call with `ops` (`load_ops` or
    `naive_ops`) on `dev`, on random inputs rounded to the dtype (the float64 references of
    `torch_mixers` take the rounded values)."""
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    out = []
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        # fp32 through TF32 products: a bf16-sized bound for both.
        bound = 2e-2
        x = rnd(bsz, t_len, heads, dim).to(dtype)
        dt = torch.nn.functional.softplus(rnd(bsz, t_len, heads) - 1.0)
        a = -torch.rand(heads, generator=gen) - 0.1
        b = rnd(bsz, t_len, groups, dim).to(dtype)
        c = rnd(bsz, t_len, groups, dim).to(dtype)
        d = rnd(heads)
        want = torch_mixers._sequential_ssd(x, dt, a, b, c, d)
        (got,) = caller({"mixer": "ssd", "dtype": name}, ops)(
            *(t.to(dev) for t in (x, dt, a, b, c, d)))
        out.append(("ssd %s" % name, torch_mixers._rel(got.cpu(), want), bound))

        q = (rnd(bsz, t_len, heads, dim) * dim ** -0.5).to(dtype)
        k = rnd(bsz, t_len, heads, dim)
        k = (k / k.norm(dim=-1, keepdim=True)).to(dtype)
        v = rnd(bsz, t_len, heads, dim).to(dtype)
        alpha = 0.8 + 0.2 * torch.rand(bsz, t_len, heads, generator=gen)
        beta = torch.rand(bsz, t_len, heads, generator=gen)
        want = torch_mixers._sequential_gated_delta(q, k, v, alpha, beta)
        (got,) = caller({"mixer": "gated_delta", "dtype": name}, ops)(
            *(t.to(dev) for t in (q, k, v, alpha, beta)))
        out.append(("gated_delta %s" % name, torch_mixers._rel(got.cpu(), want), bound))

        scale = dim ** -0.5
        for window in (1, 64, 100):
            want = torch_mixers._sequential_based(q, k, v, scale, window)
            (got,) = caller({"mixer": "based", "dtype": name, "scale": scale,
                             "window": window}, ops)(*(t.to(dev) for t in (q, k, v)))
            out.append(("based %s W=%d" % (name, window), torch_mixers._rel(got.cpu(), want),
                        bound))
    return out


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
