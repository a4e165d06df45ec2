"""PyTorch's whole MoE layer (issue 14): the alternatives to the project's `moe_layer` on the
`op = layer` cases, measured through `torch_moe` (`moe --compare torch`; the GPU only).

The function, from the runner's `layer_case` files: x [T, H], router [H, E], gate_up [E, H, 2F]
(row i of expert e: F gate values then F up values), down [E, F, H], all bf16; logits = x router,
each token's `top_k` experts by softmax (softmax over the E logits in float32, top-k, the k
weights divided by their sum: the softmax of the chosen logits), dropless; out[t] = sum over
its experts e of weight * (silu(x[t] W_gate,e) * (x[t] W_up,e)) W_down,e; bf16 out [T, H].

Implementations:
- `torch_layer_eager`: the layer as Hugging Face transformers' Mixtral sparse-MoE block writes
  it: a one-hot mask of the chosen experts, then a Python loop over the experts that received
  a token (`torch.where` on the mask for its tokens and slots, the tokens gathered, gate and up
  as one matmul, SwiGLU, down, times the weights, `index_add_` into the output). The loop's
  sizes come from the device (`tolist`, `where`), so the host waits for the device inside
  every call and no CUDA graph can hold it: the row is timed eagerly between CUDA events, and
  no capture is tried. (Transformers keeps each expert's weights as `nn.Linear` modules, W
  stored [out, in] and applied as x Wᵀ; here they are the runner's [E, H, 2F] and [E, F, H]
  tensors applied as x W, the same products.)
- `torch_layer_grouped`: the same layer sorted by expert and run on `torch._grouped_mm`: the
  assignments sorted by expert (`argsort`, stable), their tokens gathered, offs from a
  scatter-add of ones, gate and up as one `_grouped_mm` over [E, H, 2F], SwiGLU, down as another, the
  rows times their weights, `index_add_` back. Every shape is static (T * top_k rows), so it
  is graph-captured like the other rows.
- `torch_layer_compile`: `torch_layer_grouped`'s function under `torch.compile` (default
  options, empty Inductor and Triton caches); `compile_s` is the first call's wall time less
  the median call.

With `pass = fwd+bwd` (the arguments' `backward`) a call is the forward with autograd recording
on leaves aliasing x, router, gate_up and down, then `torch.autograd.grad(out, leaves, dy)` with
the runner's dy: it returns out, dx, dW_gate_up and dW_down (the router's gradient is computed,
as every implementation computes it, but is not among the checked outputs). The backward is
autograd's through each formulation (under `torch.compile`, AOTAutograd's compiled backward).
"""
import contextlib

try:
    from . import protocol, torch_cpu, torch_outputs
except ImportError:  # run as a script through torch_moe
    from compare import protocol, torch_cpu, torch_outputs

LIBRARY = "PyTorch"
IMPLEMENTATIONS = ("torch_layer_eager", "torch_layer_grouped", "torch_layer_compile")
OP = "layer"
EAGER_NOTE = ("Hugging Face transformers' Mixtral sparse-MoE block: a one-hot mask of the "
              "chosen experts, a Python loop over the experts with tokens (torch.where, gather, "
              "gate and up in one matmul, SwiGLU, down, index_add_); the host waits for the "
              "device's sizes in every call, so it is timed eagerly (no CUDA graph can hold it) "
              "and its host time includes those waits")
GROUPED_NOTE = ("sorted by expert (argsort, stable), gate and up as one torch._grouped_mm over "
                "[E, H, 2F], SwiGLU, down as another torch._grouped_mm, index_add_ back; static "
                "shapes")
BACKWARD_NOTE = ("fwd+bwd: autograd (torch.autograd.grad of out with the runner's dy) through the "
                 "formulation, the gradients of x, router, gate_up and down; the router's is "
                 "computed but not checked")
COMPILE_NOTE = ("torch.compile of torch_layer_grouped's function, default options, empty "
                "Inductor and Triton caches: compile_s is the first call's wall time less the "
                "median call")

torch = torch_cpu.torch


def unsupported_reason(case, implementation, device="gpu"):
    """Why `implementation` cannot compute `case` on `device`, or None."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if device != "gpu":
        return "PyTorch's MoE layers are measured on the GPU only (device %r)" % (device,)
    if case.get("op") != OP:
        return "%s computes the whole layer (op = layer), not op %r" % (implementation,
                                                                         case.get("op"))
    if case.get("pass") not in ("fwd", "fwd+bwd") or case.get("dtype") != "bf16":
        return "the layer's rows are bf16, fwd or fwd+bwd (pass %r, dtype %r)" % (
            case.get("pass"), case.get("dtype"))
    return None


def backward(args):
    """Whether the call includes the backward (`backward`, else the case's `pass`)."""
    return bool(args.get("backward", args.get("pass") == "fwd+bwd"))


def layout(args):
    """(T, E, top_k, H, F) from the call's arguments; ValueError for sizes that do not fit."""
    t, e, k, h, f = (int(args[key]) for key in ("tokens", "experts", "top_k", "hidden", "width"))
    if min(t, e, k, h, f) <= 0 or k > e:
        raise ValueError("tokens %d, experts %d, top_k %d, hidden %d, width %d: each positive, "
                         "top_k at most the experts" % (t, e, k, h, f))
    if args.get("gate", "softmax") != "softmax" or args.get("capacity") is not None:
        raise ValueError("gate %r, capacity %r: the layer's rows are softmax and dropless"
                         % (args.get("gate"), args.get("capacity")))
    return t, e, k, h, f


def check_inputs(args, inputs):
    """Raises ValueError unless the inputs are x, router, gate_up, down in bf16 of the case's
    shapes, in that order."""
    t, e, _, h, f = layout(args)
    want = [("x", [t, h]), ("router", [h, e]), ("gate_up", [e, h, 2 * f]), ("down", [e, f, h])]
    if backward(args):
        want.append(("dy", [t, h]))
    got = [(i["name"], [int(s) for s in i["shape"]]) for i in inputs]
    if got != want or any(i["dtype"] != "bf16" for i in inputs):
        raise ValueError("inputs %s, expected %s in bf16" % (
            ", ".join("%s %s %s" % (i["name"], i["dtype"], i["shape"]) for i in inputs),
            ", ".join("%s %s" % w for w in want)))


def _gates(x, router, top_k):
    """Each token's experts [T, k] and weights [T, k] (float32): softmax over the logits,
    top-k, divided by their sum."""
    probs = torch.softmax(x @ router, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    return chosen, weights / weights.sum(dim=-1, keepdim=True)


def layer_eager(top_k, width):
    """The Hugging Face Mixtral block's loop (x, router, gate_up, down) -> (out,)."""
    def call(x, router, gate_up, down):
        e = router.shape[1]
        chosen, weights = _gates(x, router, top_k)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, num_classes=e).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for ex in hit.view(-1).tolist():
            slot, tok = torch.where(mask[ex])
            gu = x[tok] @ gate_up[ex]
            act = torch.nn.functional.silu(gu[:, :width]) * gu[:, width:]
            y = (act @ down[ex]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return (out,)
    return call


def layer_grouped(top_k, width):
    """The layer sorted by expert on torch._grouped_mm (x, router, gate_up, down) -> (out,)."""
    def call(x, router, gate_up, down):
        e = router.shape[1]
        chosen, weights = _gates(x, router, top_k)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, top_k, rounding_mode="floor")
        # Rows per expert by scatter_add_ (a static shape, unlike bincount's).
        counts = torch.zeros(e, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(x[tok], gate_up, offs=offs, out_dtype=torch.bfloat16)
        act = torch.nn.functional.silu(gu[:, :width]) * gu[:, width:]
        y = torch._grouped_mm(act, down, offs=offs, out_dtype=torch.bfloat16)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return (torch.zeros_like(x).index_add_(0, tok, y),)
    return call


def with_backward(fwd):
    """A fwd+bwd call (x, router, gate_up, down, dy) -> (out, dx, dW_gate_up, dW_down) from
    `fwd` (x, router, gate_up, down) -> (out,): the forward with autograd recording on leaves
    aliasing the four inputs, then torch.autograd.grad of sum(dy * out) with respect to all
    four (the router's gradient computed, not returned)."""
    def call(x, router, gate_up, down, dy):
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_() for a in (x, router, gate_up, down)]
            (out,) = fwd(*leaves)
            dx, _drouter, dgu, ddown = torch.autograd.grad(out, leaves, dy)
        return out.detach(), dx, dgu, ddown
    return call


def caller(implementation, args):
    """The timed call of `implementation` on the case `args`: (out,) or, with the backward,
    (out, dx, dW_gate_up, dW_down)."""
    _, _, k, _, f = layout(args)
    if implementation == "torch_layer_eager":
        fwd = layer_eager(k, f)
    elif implementation == "torch_layer_grouped":
        fwd = layer_grouped(k, f)
    else:
        fwd = torch.compile(layer_grouped(k, f))
    return with_backward(fwd) if backward(args) else fwd


def notes_of(implementation, args=None):
    notes = {"torch_layer_eager": [EAGER_NOTE], "torch_layer_grouped": [GROUPED_NOTE],
             "torch_layer_compile": [GROUPED_NOTE, COMPILE_NOTE]}[implementation]
    return notes + [BACKWARD_NOTE] if args is not None and backward(args) else notes


def measure_into(job, reply, args):
    """Measures a layer job into `reply` (torch_moe's `_measure_into` for `op = layer`)."""
    case, implementation = job["case"], job["implementation"]
    why = unsupported_reason(args, implementation, job.get("device", "gpu")) \
        or torch_cpu.IMPORT_ERROR
    if why is None and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is None and not hasattr(torch, "_grouped_mm") and implementation != "torch_layer_eager":
        why = "this torch has no torch._grouped_mm"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    caches = (torch_outputs.empty_compile_caches("kp_torch_moe_")
              if implementation == "torch_layer_compile" else contextlib.nullcontext())
    try:
        with caches:
            check_inputs(args, job["files"]["inputs"])
            call = caller(implementation, args)
            fields, window = torch_outputs.measure_on_gpu(
                job, call, notes_of(implementation, args),
                peak_on_second_call=implementation == "torch_layer_compile",
                graph=implementation != "torch_layer_eager")
    except Exception as e:
        status, msg = torch_cpu.classify(e)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return
    if window is not None and implementation == "torch_layer_compile" \
            and fields.get("median_ms") is not None and fields.get("first_call_s") is not None:
        fields["compile_s"] = max(0.0, fields["first_call_s"] - fields["median_ms"] / 1e3)
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)


def self_test(check):
    """Pure checks, then with torch both formulations on a small CPU layer against a float64
    loop (the grouped one where this torch runs _grouped_mm on the CPU)."""
    case = {"op": "layer", "pass": "fwd", "dtype": "bf16"}
    for imp in IMPLEMENTATIONS:
        check(unsupported_reason(case, imp) is None, "%s measures the layer" % imp)
        check(unsupported_reason(dict(case, **{"pass": "fwd+bwd"}), imp) is None,
              "%s measures the layer's backward" % imp)
        check(unsupported_reason(dict(case, **{"pass": "bwd"}), imp) is not None,
              "%s refuses pass bwd" % imp)
        check(BACKWARD_NOTE in notes_of(imp, {"backward": True})
              and BACKWARD_NOTE not in notes_of(imp, {"backward": False}), "%s notes" % imp)
        check("op = layer" in unsupported_reason(dict(case, op="grouped_gemm"), imp),
              "%s refuses the grouped GEMM" % imp)
    check("GPU" in unsupported_reason(case, "torch_layer_eager", "cpu"), "the CPU is refused")
    # Leading strides of 16 bytes or more (H = 16, F = 8 bf16), as torch._grouped_mm needs.
    args = {"tokens": 6, "experts": 4, "top_k": 2, "hidden": 16, "width": 8, "gate": "softmax",
            "capacity": None}
    check(layout(args) == (6, 4, 2, 16, 8), "layout")
    for broken in (dict(args, top_k=5), dict(args, gate="sigmoid"), dict(args, capacity=3)):
        try:
            layout(broken)
            check(False, "layout accepted %r" % broken)
        except ValueError:
            pass
    inputs = [{"name": n, "dtype": "bf16", "shape": s} for n, s in
              (("x", [6, 16]), ("router", [16, 4]), ("gate_up", [4, 16, 16]),
               ("down", [4, 8, 16]))]
    check_inputs(args, inputs)
    try:
        check_inputs(args, inputs[::-1])
        check(False, "check_inputs accepted the inputs reversed")
    except ValueError:
        pass
    try:
        check_inputs(dict(args, backward=True), inputs)
        check(False, "check_inputs accepted a backward without dy")
    except ValueError:
        pass
    check_inputs(dict(args, backward=True),
                 inputs + [{"name": "dy", "dtype": "bf16", "shape": [6, 16]}])
    if torch is None:
        return
    gen = torch.Generator().manual_seed(5)
    t, e, k, h, f = layout(args)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    # Distinct logits: token t prefers experts in a fixed rotation.
    x[:, :e] = torch.tensor([[((i + j) % e) / e for j in range(e)] for i in range(t)],
                            dtype=torch.bfloat16)
    router = torch.zeros(h, e, dtype=torch.bfloat16)
    router[:e, :e] = 4 * torch.eye(e, dtype=torch.bfloat16)
    gate_up = (torch.randn(e, h, 2 * f, generator=gen) / 3).to(torch.bfloat16)
    down = (torch.randn(e, f, h, generator=gen) / 2).to(torch.bfloat16)
    want = _float64_layer(x, router, gate_up, down, k, f)
    inputs = (x, router, gate_up, down)
    runs = [("torch_layer_eager", layer_eager(k, f), inputs),
            ("torch_layer_grouped", layer_grouped(k, f), inputs)]
    if torch.cuda.is_available():
        on_gpu = tuple(a.cuda() for a in inputs)
        runs += [("torch_layer_eager on CUDA", layer_eager(k, f), on_gpu),
                 ("torch_layer_grouped on CUDA", layer_grouped(k, f), on_gpu)]
    for imp, fn, args in runs:
        try:
            (out,) = fn(*args)
        except (RuntimeError, NotImplementedError) as exc:
            # PyTorch's _grouped_mm may be CUDA-only; a refusal on the CPU is logged (the
            # CUDA run above, where there is a GPU, checks the formulation), anything else fails.
            if imp == "torch_layer_grouped" and args[0].device.type == "cpu":
                protocol.log("self-test: torch_layer_grouped not checked on the CPU: %s"
                             % protocol.exc_text(exc))
                continue
            raise
        err = float((out.double().cpu() - want).norm() / want.norm())
        check(out.dtype == torch.bfloat16 and out.shape == (t, h) and err < 2e-2,
              "%s against float64: relative error %.3g" % (imp, err))
        # The backward: against autograd through the float64 layer, with the same dy.
        dy = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(args[0].device)
        try:
            got = with_backward(fn)(*args, dy)
        except (RuntimeError, NotImplementedError) as exc:
            # As above: a CPU torch may run _grouped_mm's forward but not its backward.
            if imp == "torch_layer_grouped" and args[0].device.type == "cpu":
                protocol.log("self-test: torch_layer_grouped's backward not checked on the CPU: %s"
                             % protocol.exc_text(exc))
                continue
            raise
        leaves = [a.double().cpu().requires_grad_() for a in args]
        ref = _float64_layer(*leaves, k, f)
        wants = torch.autograd.grad(ref, leaves, dy.double().cpu())
        for name, g, w in zip(("dx", "dW_gate_up", "dW_down"), got[1:],
                              (wants[0], wants[2], wants[3])):
            gerr = float((g.double().cpu() - w).norm() / w.norm())
            check(g.shape == w.shape and gerr < 3e-2,
                  "%s %s against float64 autograd: relative error %.3g" % (imp, name, gerr))


def _float64_layer(x, router, gate_up, down, top_k, width):
    """The layer in float64, token by token (differentiable by autograd, the routing's
    choice held fixed)."""
    xd, rd, gd, dd = (a.double() for a in (x, router, gate_up, down))
    logits = xd @ rd
    out = torch.zeros_like(xd)
    for t in range(xd.shape[0]):
        top = torch.topk(logits[t], top_k)
        w = torch.softmax(top.values, dim=0)
        for j, ex in enumerate(top.indices.tolist()):
            gu = xd[t] @ gd[ex]
            act = torch.nn.functional.silu(gu[:width]) * gu[width:]
            # w[j], a tensor: the gate weights stay in autograd's graph (the self-test's
            # backward reference differentiates this function).
            out[t] = out[t] + w[j] * (act @ dd[ex])
    return out
