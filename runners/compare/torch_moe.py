"""PyTorch's alternatives to the project's MoE grouped GEMM (issue 14), measured by the kernelpages
protocol (`moe --compare torch`, on the GPU or with `--device cpu` the CPU: the job's `device`
says which; the whole layer on the GPU only).

The function, from the runner's `files.arguments` (`rows` M = tokens x top_k, `experts` E,
`hidden` K, `width` N, `counts`: rows per expert, zeros allowed, `offsets`: their E + 1
cumulative sums from 0 to M): Y [M, N] = x [M, K] times w [E, K, N] group by group,
Y[r] = x[r] w[e] for offsets[e] <= r < offsets[e + 1]; bf16 inputs and outputs.

Implementations:
- `torch_grouped_mm`: `torch._grouped_mm(x, w, offs=offs, out_dtype=torch.bfloat16)`, offs the
  int32 group ends (offsets[1:]) on the device, built once per case outside the timed call (as a
  router hands them over). On compute capability 9.x and 10.x this is PyTorch's CUTLASS grouped
  GEMM (TMA, warp-specialised), one kernel over every expert's rows after a one-block kernel
  that reads offs on the device and writes each group's pointers and sizes; on other devices
  PyTorch falls back to one at::mm_out per expert with offs copied to the host in every call
  (no CUDA graph then; the row's notes say which path ran). Refused (`unsupported`) where
  PyTorch 2.11 refuses the call: K or N not a multiple of 8 (each operand's leading stride must
  be a multiple of 16 bytes), 1,024 experts or more on the CUTLASS path, M past int32.
- `torch_loop`: the loop a user writes, `torch.cat([xe @ we for xe, we in zip(x.split(counts),
  w.unbind(0))])`: one cuBLAS GEMM per non-empty expert (an empty expert's [0, K] slice gives a
  [0, N] product and launches nothing), then one concatenation. x.split and w.unbind slice as
  x[offsets[e]:offsets[e + 1]] and w[e] would, but are one autograd node each, so the backward
  concatenates dX and stacks dW once instead of summing E zero-padded full-size gradients.
- `torch_bmm_padded`: cuBLAS's strided-batched GEMM over the experts padded to the largest
  group, C = max(counts) rows: the rows scattered into a zero [E * C, K] tensor (`index_copy_`,
  in place
  with each row's padded position, an index built once per case from `counts` outside the
  timed call; the scatter and the gather are in it), `torch.bmm` of its [E, C, K] view with w,
  and the valid rows gathered back to [M, N] (`index_select`). The products compute E x C / M
  times the useful FLOPs (the row's notes give the ratio; the row's FLOPs stay the useful
  ones). A case whose padded tensors do not fit the free device memory is an `oom` row with
  the size asked, without a call.
- `torch_dense`: the ceiling, not the grouped function: one dense `x @ w[0]` ([M, K] x [K, N],
  the grouped product's FLOPs, every row times expert 0's weights). Its outputs are scanned for
  non-finite values only and its accuracy left out: they are not the reference's.

With `pass = fwd+bwd` a call is the forward with autograd recording on leaves aliasing x and w
(w[0] for `torch_dense`), then `torch.autograd.grad(y, (x, w), dy)` with the runner's dY; it
returns Y, dX [M, K] and dW [E, K, N] (`torch_dense`: the gradient of w[0], [K, N]). Every
backward is autograd's: `torch_grouped_mm` through PyTorch's derivative of `_grouped_mm`
(dX = _grouped_mm(dY, w^T, offs), and dW = _grouped_mm(x^T, dY, offs), the product grouped
along the reduction, [E, K, N], zero for an empty expert); `torch_loop` two cuBLAS GEMMs per
non-empty expert (dX_e = dY_e w_e^T, dW_e = x_e^T dY_e); `torch_bmm_padded` dY scattered into a zero
[E, C, N] tensor, two batched GEMMs on the padded tensors and dX gathered back; `torch_dense`
the two GEMMs of the dense product.

For each job, in a fresh process (`torch_outputs.measure_on_gpu`): the runner's inputs (x, w and
for the backward dy) are uploaded; the first call is timed by wall clock; every output is
scanned for non-finite values and the runner's checked rows of Y and dX and slices of every
expert's dW (an empty expert's zeros included) compared with its float64 reference; peak memory
from the caching allocator (`max_memory_allocated`, reset before the upload, read after the
first call; cuBLAS workspaces apart, as `torch_sdpa` does; offs and the padding index are
allocated before the reset); eager calls timed between CUDA events, then a CUDA graph of the same
calls replayed (`graph_replay`, the reported time; the eager median kept as
`eager_median_ms`), since the loop's small GEMMs are bounded by the host's launches.

The whole layer's implementations (`torch_layer_eager`, `torch_layer_grouped`,
`torch_layer_compile`, on the `op = layer` cases) are `torch_moe_layer`'s; this module hands
their jobs over.

    PYTHONPATH=runners python3 -m compare.torch_moe serve | self-test | job FILE
"""
import functools
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_cpu, torch_moe_layer, torch_outputs, torch_sdpa  # noqa: E402
else:
    from . import protocol, torch_cpu, torch_moe_layer, torch_outputs, torch_sdpa

LIBRARY = "PyTorch"
IMPLEMENTATIONS = ("torch_grouped_mm", "torch_loop", "torch_bmm_padded", "torch_dense")
OPS = ("grouped_gemm",)
PASSES = ("fwd", "fwd+bwd")
# torch._grouped_mm's stride rule (aten/src/ATen/native/GroupedMMUtils.h,
# check_valid_strides_and_return_transposed): each operand's leading stride a multiple of
# 16 bytes, 8 bf16 elements.
GROUPED_MM_ALIGN = 8
# Compute capability majors on which torch._grouped_mm runs the CUTLASS grouped kernel
# (_grouped_mm_cuda: sm90_only, sm100_only); elsewhere it loops over the groups.
GROUPED_MM_MAJORS = (9, 10)
# The CUTLASS path's TORCH_CHECK (aten/src/ATen/native/cuda/GroupMM.cu): fewer than 1,024 groups.
GROUPED_MM_GROUPS = 1024
INT32_MAX = 2 ** 31 - 1
LOOP_NOTE = ("a Python loop of E torch.matmul calls (one cuBLAS GEMM per non-empty expert) "
             "and torch.cat")
DENSE_NOTE = ("a dense product of the same FLOPs (every row times expert 0's weights): the FLOP "
              "ceiling, not the grouped result; not checked against the reference")
BACKWARD_NOTES = {
    "torch_grouped_mm": ("fwd+bwd: autograd through PyTorch's derivative of _grouped_mm: "
                         "dX = _grouped_mm(dY, w^T, offs), dW = _grouped_mm(x^T, dY, offs) "
                         "(grouped along the reduction)"),
    "torch_loop": ("fwd+bwd: autograd: two cuBLAS GEMMs per non-empty expert "
                   "(dX_e = dY_e w_e^T, dW_e = x_e^T dY_e), one cat of dX, one stack of dW"),
    "torch_bmm_padded": ("fwd+bwd: autograd: dY scattered into a zero [E, C, N] tensor, two "
                         "batched GEMMs on the padded tensors (dX and dW), dX gathered back"),
    "torch_dense": ("fwd+bwd: autograd's two GEMMs of the dense product (dX [M, K], dW of "
                    "w[0] [K, N])"),
}

torch = torch_cpu.torch
IMPORT_ERROR = torch_cpu.IMPORT_ERROR


def unsupported_reason(case, implementation, device="gpu"):
    """Why `implementation` cannot compute `case` (its parameters: `op`, `pass`, `dtype`) on
    `device`, or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if device not in ("gpu", "cpu"):
        return "unknown device %r (gpu or cpu)" % (device,)
    if case.get("op") not in OPS:
        return "op %r is not measured (%s)" % (case.get("op"), ", ".join(OPS))
    if case.get("pass") not in PASSES:
        return "pass %r: fwd or fwd+bwd" % (case.get("pass"),)
    if case.get("dtype") != "bf16":
        return "dtype %r: the grouped GEMM's alternatives take bf16 (as the project's kernel)" % (
            case.get("dtype"),)
    return None


def arguments(job):
    """The call's arguments (files.arguments, authoritative) over the case's parameters."""
    return dict(job["case"], **(job["files"].get("arguments") or {}))


def backward(args):
    """Whether the call includes the backward (`backward`, else the case's `pass`)."""
    return bool(args.get("backward", args.get("pass") == "fwd+bwd"))


def cumulative(counts):
    """[0, c0, c0 + c1, ...]: the E + 1 offsets of `counts`."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def group_layout(args):
    """(M, E, K, N, counts, offsets) from the call's arguments, checked against each other (E
    counts >= 0 summing to M, offsets their cumulative sums); raises ValueError naming the
    mismatch."""
    m, e, k, n = (int(args[key]) for key in ("rows", "experts", "hidden", "width"))
    counts = [int(c) for c in args["counts"]]
    offsets = [int(o) for o in args["offsets"]]
    if len(counts) != e or min(counts, default=0) < 0 or sum(counts) != m:
        raise ValueError(protocol.clip("counts %s: expected %d counts >= 0 summing to rows = %d"
                                       % (counts, e, m)))
    if offsets != cumulative(counts):
        raise ValueError(protocol.clip("offsets %s are not the cumulative sums of the counts"
                                       % (offsets,)))
    if min(m, k, n) <= 0:
        raise ValueError("rows %d, hidden %d, width %d: each must be positive" % (m, k, n))
    return m, e, k, n, counts, offsets


def group_ends(offsets):
    """torch._grouped_mm's offs: each group's end row, offsets[1:] (E values)."""
    return [int(o) for o in offsets[1:]]


def grouped_mm_refusal(args, capability, version=None):
    """Why torch._grouped_mm (PyTorch `version`, None when it has no _grouped_mm) refuses the
    call on a device of `capability` (major, minor), or None."""
    if version is None:
        return "this torch has no torch._grouped_mm"
    k, n, e, m = int(args["hidden"]), int(args["width"]), int(args["experts"]), int(args["rows"])
    if k % GROUPED_MM_ALIGN or n % GROUPED_MM_ALIGN:
        return ("torch._grouped_mm (torch %s) needs each operand's leading stride to be a "
                "multiple of 16 bytes: hidden K = %d and width N = %d must be multiples of %d "
                "bf16 elements" % (version, k, n, GROUPED_MM_ALIGN))
    if capability[0] in GROUPED_MM_MAJORS and e >= GROUPED_MM_GROUPS:
        return ("torch._grouped_mm's CUTLASS kernel (torch %s, sm_%d%d) takes fewer than %d "
                "groups: experts = %d" % (version, capability[0], capability[1],
                                          GROUPED_MM_GROUPS, e))
    if m > INT32_MAX:
        return "torch._grouped_mm's offs are int32: rows M = %d exceed 2^31 - 1" % m
    return None


# What torch._grouped_mm runs on the CPU (PyTorch 2.15's profile: aten::_grouped_mm, then one
# aten::mm per group after reading offs with .item()).
GROUPED_MM_CPU_NOTE = ("torch._grouped_mm on the CPU: PyTorch's CPU implementation, one aten::mm "
                       "per expert with offs read on the host")


def on_cpu_text(note):
    """A note written for CUDA, said of the CPU (the same calls, the CPU's GEMMs)."""
    return (note.replace("cuBLAS strided-batched GEMM (torch.bmm)", "torch.bmm")
            .replace("cuBLAS GEMMs", "CPU GEMMs").replace("cuBLAS GEMM", "CPU GEMM"))


def grouped_mm_note(capability):
    """Which torch._grouped_mm path runs on a device of `capability` (major, minor; None for
    the CPU)."""
    if capability is None:
        return GROUPED_MM_CPU_NOTE
    sm = "sm_%d%d" % tuple(capability[:2])
    if capability[0] in GROUPED_MM_MAJORS:
        return ("torch._grouped_mm on %s: PyTorch's CUTLASS grouped GEMM (TMA, warp-specialised), "
                "one kernel over every expert's rows after a one-block kernel reading offs on the "
                "device" % sm)
    return ("torch._grouped_mm on %s: PyTorch's fallback (its CUTLASS kernel is for sm_90 and "
            "sm_100 only), one at::mm_out per expert with offs copied to the host in every call"
            % sm)


def padded_capacity(counts):
    """C: the rows each expert is padded to (the largest group)."""
    return max((int(c) for c in counts), default=0)


def padded_ratio(counts):
    """E x C / M: the padded products' FLOPs over the useful ones (None without rows)."""
    m = sum(int(c) for c in counts)
    if m == 0:
        return None
    return len(counts) * padded_capacity(counts) / float(m)


def padded_rows(counts, capacity):
    """Each row's position in the padded [E * capacity] layout: row j of expert e goes to
    e * capacity + j."""
    out = []
    for e, c in enumerate(counts):
        out.extend(range(e * capacity, e * capacity + int(c)))
    return out


def padded_bytes(args):
    """Bytes of the padded bf16 tensors one torch_bmm_padded call holds at least: x and y
    padded (E * C * (K + N)) and, with the backward, their gradients as many again."""
    e, k, n = int(args["experts"]), int(args["hidden"]), int(args["width"])
    tensors = e * padded_capacity(args["counts"]) * (k + n) * 2
    return 2 * tensors if backward(args) else tensors


def padded_text(args):
    """What `padded_bytes` counts, in words, with its size."""
    return "the padded x and y (E x C = %d x %d rows)%s alone are %.2f GB" % (
        int(args["experts"]), padded_capacity(args["counts"]),
        " and their gradients" if backward(args) else "", padded_bytes(args) / 1e9)


def tensors_text(args):
    """The call's own tensors (inputs and outputs), in words, with their size."""
    m, e, k, n = (int(args[key]) for key in ("rows", "experts", "hidden", "width"))
    size = 2 * (m * k + e * k * n + m * n)
    what = "x, w and y"
    if backward(args):
        size *= 2
        what = "x, w, y, dy, dX and dW"
    return "%s are %.2f GB" % (what, size / 1e9)


class DoesNotFit(Exception):
    """The padded tensors exceed the free device memory: an `oom` row, no call."""


def fits_padded(args, free):
    """Raises DoesNotFit when `padded_bytes(args)` exceed `free` bytes."""
    if padded_bytes(args) > free:
        raise DoesNotFit("%s; the free device memory is %.2f GB" % (padded_text(args),
                                                                    free / 1e9))


def formulation_notes(implementation, args, capability):
    """The row's notes on what `implementation` computes for `args` on a device of
    `capability` (None: the CPU, whose GEMMs are PyTorch's CPU ones)."""
    notes = _formulation_notes(implementation, args, capability)
    return notes if capability is not None else [on_cpu_text(n) for n in notes]


def _formulation_notes(implementation, args, capability):
    if implementation == "torch_grouped_mm":
        notes = [grouped_mm_note(capability)]
    elif implementation == "torch_loop":
        notes = [LOOP_NOTE]
    elif implementation == "torch_bmm_padded":
        counts = args["counts"]
        ratio = padded_ratio(counts)
        notes = ["cuBLAS strided-batched GEMM (torch.bmm) over the E experts padded to the "
                 "largest group (C = %d rows): the rows scattered into a zero [E, C, K] tensor "
                 "and the valid rows gathered back" % padded_capacity(counts)]
        if ratio is not None:
            notes.append("padded FLOPs: %.2fx the useful ones (E x C / M = %d x %d / %d); the "
                         "row's FLOPs count the useful ones"
                         % (ratio, len(counts), padded_capacity(counts), sum(counts)))
    else:
        notes = [DENSE_NOTE]
    if backward(args):
        notes.append(BACKWARD_NOTES[implementation])
    return notes


def forward(implementation, args, device):
    """The forward (x, w) -> y of `implementation`, with its per-case constants (offs, the
    padding index) built on `device`; `torch_dense`'s takes w[0] [K, N] for w."""
    counts = [int(c) for c in args["counts"]]
    if implementation == "torch_grouped_mm":
        offs = torch.tensor(group_ends(args["offsets"]), dtype=torch.int32, device=device)
        return lambda x, w: torch._grouped_mm(x, w, offs=offs, out_dtype=torch.bfloat16)
    if implementation == "torch_loop":
        return lambda x, w: torch.cat([xe @ we for xe, we in zip(x.split(counts), w.unbind(0))])
    if implementation == "torch_bmm_padded":
        e, cap = len(counts), padded_capacity(counts)
        rows = torch.tensor(padded_rows(counts, cap), dtype=torch.long, device=device)

        def padded(x, w):
            # In place: one padded buffer, not a zero tensor and a copy of it.
            xp = x.new_zeros(e * cap, x.shape[1])
            xp.index_copy_(0, rows, x)
            yp = torch.bmm(xp.view(e, cap, x.shape[1]), w)
            return yp.view(e * cap, w.shape[2]).index_select(0, rows)
        return padded
    return lambda x, w0: x @ w0


def with_backward(fwd, weights):
    """A fwd+bwd call (x, w, dy) -> (y, dX, dW) from `fwd` (x, weights(w)) -> y: the forward
    with autograd recording on leaves aliasing x and weights(w), then torch.autograd.grad of
    sum(dy * y) with respect to both."""
    def call(x, w, dy):
        with torch.enable_grad():
            xl = x.detach().requires_grad_()
            wl = weights(w).detach().requires_grad_()
            y = fwd(xl, wl)
            dx, dw = torch.autograd.grad(y, (xl, wl), dy)
        return y.detach(), dx, dw
    return call


def caller(implementation, args, device):
    """The timed call on the job's inputs (x, w[, dy]) returning the outputs in the protocol's
    order: (Y,) or (Y, dX, dW)."""
    fwd = forward(implementation, args, device)
    dense = implementation == "torch_dense"
    if backward(args):
        return with_backward(fwd, (lambda w: w[0]) if dense else (lambda w: w))
    if dense:
        return lambda x, w: (fwd(x, w[0]),)
    return lambda x, w: (fwd(x, w),)


def check_inputs(args, inputs):
    """Raises ValueError unless the job's inputs are x [M, K], w [E, K, N] (and for the backward
    dy [M, N]) in bf16, in that order."""
    m, e, k, n, _, _ = group_layout(args)
    want = [("x", [m, k]), ("w", [e, k, n])] + ([("dy", [m, n])] if backward(args) else [])
    got = [(t["name"], [int(s) for s in t["shape"]]) for t in inputs]
    if got != want or any(t["dtype"] != "bf16" for t in inputs):
        raise ValueError("inputs %s, expected %s in bf16" % (
            ", ".join("%s %s %s" % (t["name"], t["dtype"], t["shape"]) for t in inputs),
            ", ".join("%s %s" % w for w in want)))


def scan_outputs(files, results):
    """`torch_outputs.check_outputs`'s form for outputs that are not the reference's function
    (the dense ceiling): each whole output scanned for non-finite values, nothing compared:
    ({"message": ...}, None) at the first non-finite value, else (None, None)."""
    for (name, _spec, _check), tensor in zip(protocol.outputs(files), results):
        flat = tensor.detach().contiguous().view(-1)
        bad = (~torch.isfinite(flat)).nonzero()
        if bad.numel():
            msg, _ = protocol.check_output(int(bad[0, 0]), flat.numel(), [], [])
            if name != "O":
                msg = msg.replace(" (unwritten", " of %s (unwritten" % name)
            return {"message": msg}, None
    return None, None


def classify(exc):
    if isinstance(exc, DoesNotFit):
        return "oom", str(exc)
    status, msg = torch_cpu.classify(exc)
    if isinstance(exc, RuntimeError) and "not enough memory" in str(exc).lower():
        status = "oom"
    return status, msg


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        # After the measurement: the version queries must not load anything before the first
        # call is timed.
        reply["libraries"] = (torch_sdpa.libraries() if job.get("device", "gpu") == "gpu"
                              else torch_cpu.libraries())
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    args = arguments(job)
    if implementation in torch_moe_layer.IMPLEMENTATIONS:
        torch_moe_layer.measure_into(job, reply, args)
        return
    on_gpu = job.get("device", "gpu") == "gpu"
    why = unsupported_reason(args, implementation, job.get("device", "gpu")) or IMPORT_ERROR
    if why is None and on_gpu and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is None and on_gpu and implementation == "torch_grouped_mm":
        why = grouped_mm_refusal(args, torch.cuda.get_device_capability(),
                                 str(torch.__version__) if hasattr(torch, "_grouped_mm")
                                 else None)
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    try:
        fields, window = (_measure_gpu if on_gpu else _measure_cpu)(job, args)
    except Exception as e:
        status, msg = classify(e)
        if status == "oom" and not isinstance(e, DoesNotFit):
            sizes = tensors_text(args)
            if implementation == "torch_bmm_padded":
                sizes += "; " + padded_text(args)
            msg = "%s: %s" % (sizes, msg)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def _measure_gpu(job, args):
    implementation = job["implementation"]
    check_inputs(args, job["files"]["inputs"])
    notes = formulation_notes(implementation, args, torch.cuda.get_device_capability())
    call = caller(implementation, args, torch.device("cuda"))
    fit = functools.partial(fits_padded, args) if implementation == "torch_bmm_padded" else None
    check = scan_outputs if implementation == "torch_dense" else torch_outputs.check_outputs
    return torch_outputs.measure_on_gpu(job, call, notes, fit=fit, check=check)


def args_for_notes():
    """Small arguments for the self-test's note checks."""
    return {"rows": 10, "experts": 4, "hidden": 8, "width": 16, "counts": [3, 0, 5, 2],
            "offsets": [0, 3, 3, 8, 10], "backward": False}


def _measure_cpu(job, args):
    implementation = job["implementation"]
    check_inputs(args, job["files"]["inputs"])
    notes = formulation_notes(implementation, args, None)
    call = caller(implementation, args, torch.device("cpu"))
    check = scan_outputs if implementation == "torch_dense" else torch_outputs.check_outputs
    return torch_outputs.measure_on_cpu(job, call, notes, check=check, grad=backward(args))


def _reference(x, w, counts, dy=None):
    """The grouped product (and with dy its gradients) in Python floats from nested lists:
    (Y, dX, dW) as lists, dX and dW None without dy."""
    m, k, n = len(x), len(w[0]), len(w[0][0])
    experts = []
    for e, c in enumerate(counts):
        experts.extend([e] * c)
    y = [[sum(x[r][i] * w[experts[r]][i][j] for i in range(k)) for j in range(n)]
         for r in range(m)]
    if dy is None:
        return y, None, None
    dx = [[sum(dy[r][j] * w[experts[r]][i][j] for j in range(n)) for i in range(k)]
          for r in range(m)]
    dw = [[[sum(x[r][i] * dy[r][j] for r in range(m) if experts[r] == e) for j in range(n)]
           for i in range(k)] for e in range(len(counts))]
    return y, dx, dw


def _differ(got, want):
    """The largest absolute difference between a tensor and nested lists of the same shape."""
    flat_got = got.float().reshape(-1).tolist()
    flat_want = torch.tensor(want, dtype=torch.float64).reshape(-1).tolist()
    if len(flat_got) != len(flat_want):
        return float("inf")
    return max((abs(a - b) for a, b in zip(flat_got, flat_want)), default=0.0)


def self_test():
    """Pure checks of this module (no torch needed), then torch_cpu's and the shared ones; with
    torch, each implementation's call on small bf16 CPU tensors (an empty expert included)
    against the grouped product and its gradients in Python floats (exact: small integers)."""
    failures = torch_cpu.self_test()

    def check(cond, what):
        if not cond:
            failures.append("torch_moe: " + what)

    case = {"op": "grouped_gemm", "pass": "fwd", "dtype": "bf16"}
    for imp in IMPLEMENTATIONS:
        check(unsupported_reason(case, imp) is None, "%s measures bf16" % imp)
        check(unsupported_reason(dict(case, **{"pass": "fwd+bwd"}), imp) is None,
              "%s measures the backward" % imp)
    check("bf16" in unsupported_reason(dict(case, dtype="fp16"), "torch_loop"),
          "fp16 is refused")
    check(unsupported_reason(case, "torch_loop", "cpu") is None, "the CPU is measured")
    check("unknown device" in unsupported_reason(case, "torch_loop", "tpu"),
          "other devices are refused")
    cpu_notes = formulation_notes("torch_loop", dict(args_for_notes(), backward=True), None)
    check(all("cuBLAS" not in n for n in cpu_notes) and "CPU GEMM" in cpu_notes[0],
          "CPU notes name the CPU's GEMMs: %r" % cpu_notes)
    check(formulation_notes("torch_grouped_mm", args_for_notes(), None) == [GROUPED_MM_CPU_NOTE],
          "grouped_mm's CPU note")
    check("unknown" in unsupported_reason(case, "grouped_mma_sync"), "other names are unknown")
    check("pass" in unsupported_reason(dict(case, **{"pass": "bwd"}), "torch_dense"),
          "unknown passes are refused")
    check("op" in unsupported_reason(dict(case, op="gather"), "torch_dense"),
          "unknown ops are refused")
    args = {"rows": 10, "experts": 4, "hidden": 8, "width": 16, "counts": [3, 0, 5, 2],
            "offsets": [0, 3, 3, 8, 10], "backward": False}
    check(cumulative([3, 0, 5, 2]) == args["offsets"], "cumulative counts")
    check(group_layout(args) == (10, 4, 8, 16, [3, 0, 5, 2], [0, 3, 3, 8, 10]), "layout")
    for broken in (dict(args, counts=[3, 0, 5, 3]), dict(args, counts=[3, 0, 7]),
                   dict(args, offsets=[0, 3, 8, 8, 10]), dict(args, counts=[4, -1, 5, 2])):
        try:
            group_layout(broken)
            check(False, "group_layout accepted %r" % broken)
        except ValueError:
            pass
    check(group_ends(args["offsets"]) == [3, 3, 8, 10], "offs are the group ends")
    check(padded_capacity([3, 0, 5, 2]) == 5 and padded_capacity([]) == 0, "capacity")
    check(padded_ratio([3, 0, 5, 2]) == 2.0 and padded_ratio([4, 4]) == 1.0, "padded ratio")
    check(padded_ratio([0, 0]) is None, "no rows, no ratio")
    check(padded_rows([2, 0, 1], 2) == [0, 1, 4], "padded rows")
    check(padded_bytes(args) == 4 * 5 * 24 * 2 and
          padded_bytes(dict(args, backward=True)) == 2 * 4 * 5 * 24 * 2, "padded bytes")
    check(padded_text(args) == "the padded x and y (E x C = 4 x 5 rows) alone are 0.00 GB",
          "padded text: %r" % padded_text(args))
    check(backward({"pass": "fwd+bwd"}) and not backward(dict(args, **{"pass": "fwd+bwd"})),
          "the arguments' backward is authoritative")
    try:
        fits_padded(args, 100)
        check(False, "a padded call larger than the free memory must not fit")
    except DoesNotFit as e:
        check(classify(e)[0] == "oom" and "free device memory" in str(e), "oom: %s" % e)
    fits_padded(args, 10 ** 9)
    check(grouped_mm_refusal(args, (9, 0), "2.11.0") is None, "grouped_mm on sm_90")
    check(grouped_mm_refusal(args, (8, 0), "2.11.0") is None, "grouped_mm falls back on sm_80")
    check("16 bytes" in grouped_mm_refusal(dict(args, width=1410), (9, 0), "2.11.0"),
          "N not a multiple of 8 is refused")
    check("16 bytes" in grouped_mm_refusal(dict(args, hidden=12), (8, 0), "2.11.0"),
          "K not a multiple of 8 is refused everywhere")
    check("1024" in grouped_mm_refusal(dict(args, experts=1024), (10, 0), "2.11.0"),
          "1,024 groups are refused on the CUTLASS path")
    check(grouped_mm_refusal(dict(args, experts=1024), (8, 6), "2.11.0") is None,
          "the fallback takes any number of groups")
    check("int32" in grouped_mm_refusal(dict(args, rows=2 ** 31), (9, 0), "2.11.0"),
          "rows past int32 are refused")
    check("no torch._grouped_mm" in grouped_mm_refusal(args, (9, 0)), "no _grouped_mm")
    check("CUTLASS" in grouped_mm_note((9, 0)) and "sm_90" in grouped_mm_note((9, 0)),
          "the CUTLASS path's note")
    check("fallback" in grouped_mm_note((8, 9)) and "sm_89" in grouped_mm_note((8, 9)),
          "the fallback's note")
    check(formulation_notes("torch_dense", args, (9, 0)) == [DENSE_NOTE], "dense note")
    check(formulation_notes("torch_loop", args, (9, 0)) == [LOOP_NOTE], "loop note")
    padded = formulation_notes("torch_bmm_padded", dict(args, backward=True), (9, 0))
    check(len(padded) == 3 and "2.00x" in padded[1] and "4 x 5 / 10" in padded[1] and
          padded[2] == BACKWARD_NOTES["torch_bmm_padded"], "padded notes: %r" % padded)
    check(len(formulation_notes("torch_grouped_mm", args, (9, 0))) == 1, "grouped_mm notes")
    inputs = [{"name": "x", "dtype": "bf16", "shape": [10, 8]},
              {"name": "w", "dtype": "bf16", "shape": [4, 8, 16]}]
    check_inputs(args, inputs)
    for broken, bad_args in ((inputs[:1], args), (inputs, dict(args, backward=True)),
                             ([inputs[0], dict(inputs[1], dtype="fp16")], args),
                             ([inputs[1], inputs[0]], args)):
        try:
            check_inputs(bad_args, broken)
            check(False, "check_inputs accepted %r" % broken)
        except ValueError:
            pass
    check(arguments({"case": {"pass": "fwd", "rows": 1}, "files": {"arguments": {"rows": 2}}})
          == {"pass": "fwd", "rows": 2}, "arguments over the case")
    if torch is not None:
        _torch_checks(check, args)
    torch_moe_layer.self_test(check)
    return failures


def _torch_checks(check, args):
    """Each implementation on small bf16 CPU tensors against `_reference` (`torch._grouped_mm`
    where this torch runs it on the CPU), then the dense ceiling's scan."""
    gen = torch.Generator().manual_seed(3)

    def ints(*shape):  # small integers: every product and sum is exact in bf16 and float32
        return torch.randint(-2, 3, shape, generator=gen).to(torch.bfloat16)

    m, e, k, n, counts, _ = group_layout(args)
    x, w, dy = ints(m, k), ints(e, k, n), ints(m, n)
    y_ref, dx_ref, dw_ref = _reference(x.float().tolist(), w.float().tolist(), counts,
                                       dy.float().tolist())
    cpu = torch.device("cpu")
    for imp in ("torch_grouped_mm", "torch_loop", "torch_bmm_padded"):
        try:
            (y,) = caller(imp, args, cpu)(x, w)
            y2, dx, dw = caller(imp, dict(args, backward=True), cpu)(x, w, dy)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            if imp == "torch_grouped_mm":  # a torch whose _grouped_mm is CUDA-only
                protocol.log("self-test: torch._grouped_mm not checked on the CPU: %s"
                             % protocol.exc_text(exc))
                continue
            raise
        check(y.dtype == torch.bfloat16 and y.shape == (m, n), "%s: Y's dtype and shape" % imp)
        check(_differ(y, y_ref) == 0.0 and _differ(y2, y_ref) == 0.0, "%s: Y" % imp)
        check(_differ(dx, dx_ref) == 0.0, "%s: dX" % imp)
        check(dw.shape == (e, k, n) and _differ(dw, dw_ref) == 0.0, "%s: dW" % imp)
        check(float(dw[1].abs().max()) == 0.0, "%s: the empty expert's dW is zero" % imp)
    (y,) = caller("torch_dense", args, cpu)(x, w)
    _, dx, dw = caller("torch_dense", dict(args, backward=True), cpu)(x, w, dy)
    y_dense, dx_dense, dw_dense = _reference(x.float().tolist(), w[:1].float().tolist(), [m],
                                             dy.float().tolist())
    check(_differ(y, y_dense) == 0.0 and _differ(dx, dx_dense) == 0.0, "dense Y and dX")
    check(dw.shape == (k, n) and _differ(dw, dw_dense[0]) == 0.0, "dense dW is w[0]'s")
    files = {"output": {}, "check": {}, "gradients": [{"name": "dX", "output": {}, "check": {}},
                                                      {"name": "dW", "output": {}, "check": {}}]}
    check(scan_outputs(files, (y, dx, dw)) == (None, None), "a finite dense call passes")
    dw[2, 5] = float("nan")
    failed, accuracy = scan_outputs(files, (y, dx, dw))
    check(accuracy is None and "element %d of %d of dW" % (2 * n + 5, k * n) in failed["message"],
          "a NaN in the dense dW fails the row: %r" % (failed,))


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
