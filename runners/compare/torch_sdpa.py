"""PyTorch's scaled_dot_product_attention backends, measured by the kernelpages protocol.

Implementations: `torch_flash` (FlashAttention-2), `torch_cudnn` (cuDNN), `torch_efficient`
(memory-efficient), `torch_math` (the reference composition). For each job, in a fresh
process: the runner's Q, K, V (and dO) bits are uploaded; the first call is timed by wall
clock (`first_call_s`: backend selection, plans, lazy library loading), its peak memory read
from the caching allocator (`max_memory_allocated` and `max_memory_reserved`, reset before the
upload; the cuBLAS workspaces apart), every output scanned for non-finite values and the
runner's checked elements compared with the runner's float64 reference; then the timing
protocol of `timing` on eager calls (events, with the host time per call) and, where capture
works, on a CUDA graph of the same calls (`graph_replay`, the reported time; the eager median
is kept as `eager_median_ms`).

A "fwd+bwd" call is `out = sdpa(q, k, v, ...)` then `torch.autograd.grad(out, (q, k, v), do)`
with the runner's dO (protocol.py describes the protocol). The call's arguments come from the
job's `files.arguments`: `scale=` always, `enable_gqa=True` when kv_heads < heads. PyTorch's
`is_causal` aligns the mask top-left when seq_len_q != seq_len_kv, and SDPA takes no key
lengths, so those cases get an explicit boolean mask built bottom-right ([B, 1, Tq, Tkv]);
the flash backend takes no mask and answers `unsupported` there, with the reason. One causal
query row (a decoding step) sees every key, so it is called without a causal mask
(`protocol.effective_causal`): every backend runs it unless per-sequence key lengths still
need the explicit mask.

    PYTHONPATH=runners python3 -m compare.torch_sdpa serve | self-test | job FILE
"""

import math
import os
import platform
import re
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, timing  # noqa: E402
else:
    from . import protocol, timing

LIBRARY = "PyTorch"

# implementation name -> SDPBackend member name
BACKENDS = {
    "torch_flash": "FLASH_ATTENTION",
    "torch_cudnn": "CUDNN_ATTENTION",
    "torch_efficient": "EFFICIENT_ATTENTION",
    "torch_math": "MATH",
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PEAK_METHOD = ("torch.cuda.max_memory_allocated (reset before the inputs' upload, read after "
               "the first call) in a fresh process running only this case; cuBLAS workspaces "
               "apart")
# The source location torch appends to each warning it raises from C++.
TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")
# Test hook: plant a NaN at this flat index of the first call's output (tests/compare_script.rs).
PLANT_NAN_ENV = "KP_COMPARE_PLANT_NAN"

try:  # imported once in the server, before any fork; CUDA is initialised in each child
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
    if getattr(torch.version, "cuda", None):
        libs["cuda_torch"] = str(torch.version.cuda)
    try:
        v = torch.backends.cudnn.version()
        if v:
            libs["cudnn"] = str(v)
    except Exception:
        pass
    try:
        import triton
        libs["triton"] = str(triton.__version__)
    except Exception:
        pass
    return libs


def classify(exc):
    """(status, message) for an exception raised by a torch call."""
    if isinstance(exc, timing.CaseTimeout):
        return "timeout", str(exc)
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    text = str(exc)
    if (oom is not None and isinstance(exc, oom)) or (
            isinstance(exc, RuntimeError) and "out of memory" in text.lower()):
        return "oom", protocol.exc_text(exc)
    if isinstance(exc, RuntimeError) and "No available kernel" in text:
        return "unsupported", protocol.exc_text(exc)
    return "error", protocol.exc_text(exc)


def with_warnings(message, caught):
    """Append the reasons torch gave as warnings (why a backend refused) to `message`."""
    texts = []
    for w in caught:
        t = TRIGGERED.sub("", str(w.message)).strip()
        if t and t not in texts:
            texts.append(t)
    return message + (" | warnings: " + protocol.clip(" ".join(texts)) if texts else "")


def arguments(job):
    """The call's arguments (protocol.py: files.arguments), with defaults for an older runner."""
    args = dict(job["files"].get("arguments") or {})
    case = job["case"]
    q_shape = job["files"]["inputs"][0]["shape"]
    k_shape = job["files"]["inputs"][1]["shape"]
    args.setdefault("seq_len_q", q_shape[2])
    args.setdefault("seq_len_kv", k_shape[2])
    args.setdefault("heads", q_shape[1])
    args.setdefault("kv_heads", k_shape[1])
    args.setdefault("causal", bool(case.get("causal")))
    args.setdefault("scale", 1.0 / math.sqrt(q_shape[3]))
    args.setdefault("kv_lens", None)
    return args


def needs_mask(args):
    """True when PyTorch's own is_causal cannot express the case: bottom-right causal with
    different lengths (unless one query row, which the mask leaves whole:
    protocol.effective_causal), or per-sequence key lengths."""
    differ = int(args["seq_len_q"]) != int(args["seq_len_kv"])
    return args["kv_lens"] is not None or (protocol.effective_causal(args) and differ)


def unsupported_reason(job):
    case, implementation = job["case"], job["implementation"]
    if implementation not in BACKENDS:
        return "unknown implementation %r (known: %s)" % (implementation, ", ".join(BACKENDS))
    if case.get("pass") not in ("fwd", "fwd+bwd"):
        return "unknown pass %r" % case.get("pass")
    if case.get("dtype") not in DTYPES:
        return "dtype %r is not measured by the comparison module (bf16, fp16, fp32)" % (
            case.get("dtype"),)
    args = arguments(job)
    if int(args["heads"]) % int(args["kv_heads"]) != 0:
        return "heads (%s) is not a multiple of kv_heads (%s)" % (args["heads"],
                                                                  args["kv_heads"])
    if implementation == "torch_flash" and needs_mask(args):
        return ("PyTorch's flash backend takes no attention mask, and its is_causal aligns the "
                "mask top-left when seq_len_q != seq_len_kv; this case needs bottom-right "
                "causal or per-sequence key lengths")
    return None


def load_input(t, device):
    """A runner input file as a device tensor of its dtype and shape."""
    with open(t["path"], "rb") as f:
        raw = bytearray(f.read())
    data = torch.frombuffer(raw, dtype=torch.uint8)
    return data.view(getattr(torch, DTYPES[t["dtype"]])).reshape(t["shape"]).to(device)


def bottom_right_mask(args, device):
    """Boolean [B, 1, Tq, Tkv]: True where query i of batch entry b may see key j (j < L_b and,
    when causal, j <= i + L_b - Tq)."""
    b = int(args.get("batch") or (len(args["kv_lens"]) if args["kv_lens"] else 1))
    tq, tkv = int(args["seq_len_q"]), int(args["seq_len_kv"])
    lens = args["kv_lens"] if args["kv_lens"] is not None else [tkv] * b
    lens = torch.tensor(lens, device=device).view(-1, 1, 1, 1)
    i = torch.arange(tq, device=device).view(1, 1, -1, 1)
    j = torch.arange(tkv, device=device).view(1, 1, 1, -1)
    mask = j < lens
    if args["causal"]:
        mask = mask & (j <= i + lens - tq)
    return mask


def caller(job, device):
    """The timed call: (q, k, v) -> out for "fwd"; (q, k, v, do) -> (out, dq, dk, dv) for
    "fwd+bwd" (q, k, v must require grad)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    args = arguments(job)
    kw = {"scale": float(args["scale"])}
    if int(args["kv_heads"]) != int(args["heads"]):
        kw["enable_gqa"] = True
    if needs_mask(args):
        kw["attn_mask"] = bottom_right_mask(args, device)
    else:
        kw["is_causal"] = protocol.effective_causal(args)
    if job["case"].get("pass") != "fwd+bwd":
        return lambda q, k, v: sdpa(q, k, v, **kw)

    def fwd_bwd(q, k, v, do):
        out = sdpa(q, k, v, **kw)
        return (out,) + tuple(torch.autograd.grad(out, (q, k, v), do))
    return fwd_bwd


def cublas_workspace_bytes():
    """Bytes the cuBLAS/cuBLASLt workspaces hold in the caching allocator (released to
    measure them; the next matrix product allocates them again)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    clear()
    torch.cuda.synchronize()
    return max(0, before - torch.cuda.memory_allocated())


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    case, implementation = job["case"], job["implementation"]
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        # After the measurement: the version queries must not load anything before the first
        # call is timed.
        reply["libraries"] = libraries()
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = IMPORT_ERROR or unsupported_reason(job)
    if why is None and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return reply
    caught = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            try:
                fields, window = _measure(job, caught)
            finally:
                caught.extend(recorded)
    except Exception as e:
        status, msg = classify(e)
        if status == "unsupported":
            msg = with_warnings(msg, caught)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return reply
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)
    return reply


def _measure(job, caught):
    case, implementation = job["case"], job["implementation"]
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # CUDA context, outside every figure
    torch.cuda.synchronize()
    notes = []
    if implementation == "torch_math" and case.get("dtype") != "fp32":
        allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
        if allowed is None or not allowed():
            notes.append("float32 accumulation: PyTorch's math backend computes bf16/fp16 "
                         "inputs in float32 (reduced-precision reduction not allowed)")
    if case.get("dtype") == "fp32":
        notes.append("fp32: TF32 %s (torch.backends.cuda.matmul.allow_tf32 = %s, "
                     "torch.backends.cudnn.allow_tf32 = %s)" % (
                         "allowed" if torch.backends.cuda.matmul.allow_tf32 else "not allowed",
                         torch.backends.cuda.matmul.allow_tf32,
                         torch.backends.cudnn.allow_tf32))
    if needs_mask(arguments(job)):
        notes.append("explicit boolean mask [B, 1, Tq, Tkv], built bottom-right: PyTorch's "
                     "is_causal aligns top-left when seq_len_q != seq_len_kv")
    one_row = protocol.one_row_causal_note(arguments(job))
    if one_row:
        notes.append(one_row)
    empty = protocol.empty_rows_note(arguments(job))
    if empty:
        notes.append(empty)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = sdpa_kernel([getattr(SDPBackend, BACKENDS[implementation])])
    return measure_call(job, device, caller(job, device), backend,
                        lambda set0, before: _residual_bytes(job, set0, device, before), notes)


def measure_call(job, device, call, context, residual_bytes, notes):
    """Measures `call` (`caller`'s form) on the job's inputs inside `context`: the first call
    (wall time, peak memory, the check of every output), the residuals (`residual_bytes(set0,
    allocated_before)`, forward + backward only), then the timing protocol over rotated input
    sets, eager and as a CUDA graph. Returns (fields, window); `notes` (a list) gets the timing
    notes appended and becomes the row's notes."""
    case, files, tcfg = job["case"], job["files"], job["timing"]
    bwd = case.get("pass") == "fwd+bwd"
    grad_mode = torch.enable_grad() if bwd else torch.no_grad()
    with grad_mode, context:
        # Peak memory: reset before the upload, read after the first call.
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        base_reserved = torch.cuda.memory_reserved()
        set0 = tuple(load_input(t, device) for t in files["inputs"])
        if bwd:
            set0 = tuple(x.requires_grad_(True) for x in set0[:3]) + set0[3:]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = call(*set0)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        results = result if bwd else (result,)
        peak = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.max_memory_reserved() - base_reserved
        workspace = cublas_workspace_bytes()
        ws = workspace or 0
        set_bytes = sum(x.numel() * x.element_size() for x in set0)
        out_bytes = sum(x.numel() * x.element_size() for x in results)

        # The check on the first call's outputs: each whole output for non-finite values, then
        # the runner's elements against the runner's float64 reference.
        plant = os.environ.get(PLANT_NAN_ENV)
        errors = []
        for (name, _spec, check), tensor in zip(protocol.outputs(files), results):
            flat = tensor.detach().contiguous().view(-1)  # logical order, whatever the layout
            if plant and name == "O":
                flat[int(plant)] = float("nan")
            bad = (~torch.isfinite(flat)).nonzero()
            bad_index = int(bad[0, 0]) if bad.numel() else None
            idx = torch.tensor(protocol.flat_indices(check["ranges"]), dtype=torch.long,
                               device=device)
            got = flat.index_select(0, idx).double().cpu().tolist()
            reference = protocol.read_f64(check["reference"])
            msg, rel_err = protocol.check_output(bad_index, flat.numel(), got, reference)
            del flat, idx, got
            if msg is not None:
                if name != "O":
                    msg = msg.replace(" (unwritten", " of %s (unwritten" % name)
                return {"message": msg}, None
            errors.append((name, rel_err))
        del result, results
        rel_err = protocol.worst(e for _, e in errors)
        check = files["check"]
        # What the forward keeps for the backward: memory still held after a forward with
        # autograd recording (its output and the tensors its graph saved), after the first
        # call, so that call's time is cold.
        residuals = None
        if bwd:
            torch.cuda.synchronize()
            residuals = residual_bytes(set0, torch.cuda.memory_allocated())

        # Timing over rotated copies of the inputs.
        free = torch.cuda.mem_get_info()[0]
        n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                            float(tcfg["l2_rotation_factor"]), free)

        def copy(x):
            y = x.detach().clone()
            return y.requires_grad_(True) if x.requires_grad else y
        sets = [set0] + [tuple(copy(x) for x in set0) for _ in range(n_sets - 1)]
        torch.cuda.synchronize()
        window0 = protocol.unix_now()
        reported, method, eager, graph_error = timing.measure_eager_then_graph(
            torch, call, sets, tcfg, time.perf_counter())
        window = [window0, protocol.unix_now()]
        del sets

    graph = reported if graph_error is None else None
    if graph_error is not None:
        notes.append("CUDA graph capture failed, timed eagerly: %s"
                     % protocol.exc_text(graph_error))
    for m, what in ((eager, "eager"), (graph, "graph")):
        if m is not None and m["cut_short"]:
            notes.append("%s timing: %d of %d samples, the %g s case limit stopped sampling"
                         % (what, m["samples"], int(tcfg["repeats"]),
                            float(tcfg["case_timeout_s"])))
    fields = dict(
        median_ms=reported["median"], q1_ms=reported["q1"], q3_ms=reported["q3"],
        inner_calls=reported["inner"], samples=reported["samples"], input_sets=n_sets,
        l2_rotation_reached=reached, timing=method, host_ms=eager["host_ms"],
        eager_median_ms=eager["median"] if graph is not None else None,
        first_call_s=first_call_s, flops=files.get("flops"), bytes=files.get("bytes"),
        memory={"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6,
                "temporaries_mb": max(0, peak - ws - set_bytes - out_bytes) / 1e6,
                "residuals_mb": residuals / 1e6 if residuals is not None else None,
                "peak_mb": max(0, peak - ws) / 1e6,
                "reserved_peak_mb": max(0, reserved - ws) / 1e6,
                "workspace_mb": workspace / 1e6 if workspace else None,
                "peak_method": PEAK_METHOD},
        accuracy={"rel_err": rel_err, "metric": "rel_l2",
                  "reference": check.get("reference_kind", "float64_cpu"),
                  "tolerance": check["tolerance"],
                  "checked": protocol.checked_text(check["checked"], errors)},
        notes=notes)
    return fields, window


def _residual_bytes(job, set0, device, before):
    """Bytes a forward with autograd recording keeps until its backward: memory allocated after
    `out = sdpa(...)` (out alive, its graph holding the saved tensors) minus `before`."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    args = arguments(job)
    kw = {"scale": float(args["scale"])}
    if int(args["kv_heads"]) != int(args["heads"]):
        kw["enable_gqa"] = True
    if needs_mask(args):
        kw["attn_mask"] = bottom_right_mask(args, device)
    else:
        kw["is_causal"] = protocol.effective_causal(args)
    mask_bytes = kw["attn_mask"].numel() if "attn_mask" in kw else 0
    q, k, v = set0[:3]
    out = sdpa(q, k, v, **kw)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - mask_bytes
    del out
    torch.cuda.synchronize()
    return max(0, held)


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY))
