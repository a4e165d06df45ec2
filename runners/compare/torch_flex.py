"""PyTorch's `flex_attention` under `torch.compile`, measured by the kernelpages protocol.

Implementation: `torch_flex`. The case's modification comes from `files.arguments["mask"]`
(the masks grid: `none`, `causal`, `sliding_window(W)`, `document`, `prefix_lm(P)`, `alibi`,
`softcap(C)`, with `documents`, each batch entry's document lengths, for `document`), else
from `causal`. Each is written here as PyTorch's `mask_mod` / `score_mod` with the suite's
conventions: causal aligned bottom-right (query i sees key j iff j <= i + Tkv - Tq), ALiBi's
slope 2^(-8 (h + 1) / H) times (j - i - (Tkv - Tq)) added to the scaled score, soft-capping
C * tanh(score / C). The block mask comes from `create_block_mask` (PyTorch's default block
size), per batch entry only for `document`, before the first call and outside every figure.

For each job, in a fresh process with empty Inductor and Triton caches (TORCHINDUCTOR_CACHE_DIR
and TRITON_CACHE_DIR point at a new folder, removed afterwards), so that the first call
compiles as it would on a fresh machine: `torch.compile(flex_attention)` with default options
is called once (`first_call_s`), its outputs checked like every other row's, then timed by the
protocol of `torch_sdpa.measure_call` (eager events, then a CUDA graph of the same calls where
capture works). `compile_s` is the first call's wall time less the median call time: dynamo's
tracing and Inductor's and Triton's compilation, forward and (for "fwd+bwd") backward.

    PYTHONPATH=runners python3 -m compare.torch_flex serve | self-test | job FILE
"""

import contextlib
import math
import os
import re
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_outputs, torch_sdpa  # noqa: E402
else:
    from . import protocol, torch_outputs, torch_sdpa

LIBRARY = "PyTorch"
IMPLEMENTATION = "torch_flex"
torch = torch_sdpa.torch

COMPILE_NOTE = ("torch.compile(flex_attention), default options, empty Inductor and Triton "
                "caches: compile_s is the first call's wall time less the median call")


def mask_name(args):
    """The case's modification: `files.arguments["mask"]`, else causal or none."""
    return args.get("mask") or ("causal" if args["causal"] else "none")


def parse_mask(name):
    """(kind, argument) of a modification name, e.g. ("sliding_window", 1024); raises
    ValueError for a name this module does not know."""
    if name in ("none", "causal", "document", "alibi"):
        return name, None
    m = re.fullmatch(r"(sliding_window|prefix_lm|softcap)\(([^)]*)\)", name)
    if m is None:
        raise ValueError("unknown mask %r" % (name,))
    kind, arg = m.group(1), m.group(2)
    try:
        value = float(arg) if kind == "softcap" else int(arg)
    except ValueError:
        raise ValueError("mask %r: %r is not a number" % (name, arg)) from None
    if kind == "prefix_lm":
        if value < 0:
            raise ValueError("mask %r: the prefix length must not be negative" % (name,))
    elif not (math.isfinite(value) and value > 0):
        raise ValueError("mask %r: the argument must be a finite number above 0" % (name,))
    return kind, value


def mods(args, device):
    """(mask_mod or None, score_mod or None, per_batch) for the case's modification, written
    with tensors so that flex_attention can compile them; `per_batch` when the mask reads the
    batch index (the block mask is then built per batch entry)."""
    kind, value = parse_mask(mask_name(args))
    tq, tkv, heads = int(args["seq_len_q"]), int(args["seq_len_kv"]), int(args["heads"])
    off = tkv - tq

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off

    if kind == "none":
        return None, None, False
    if kind == "causal":
        return causal, None, False
    if kind == "sliding_window":
        def window(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + off) & (q_idx + off - kv_idx < value)
        return window, None, False
    if kind == "prefix_lm":
        def prefix(b, h, q_idx, kv_idx):
            return (kv_idx < value) | (kv_idx <= q_idx + off)
        return prefix, None, False
    if kind == "document":
        lengths = args.get("documents")
        if not lengths:
            raise ValueError("mask `document` needs files.arguments.documents")
        ids = torch.cat([
            torch.repeat_interleave(torch.arange(len(ls), dtype=torch.int32),
                                    torch.tensor(ls, dtype=torch.int64))
            for ls in lengths]).view(len(lengths), tkv).to(device)

        def document(b, h, q_idx, kv_idx):
            # The query's position among the keys, clamped: a row before the first key
            # (Tq > Tkv) sees nothing through the causal term, but `&` evaluates both sides.
            pos = torch.clamp(q_idx + off, min=0)
            return (kv_idx <= q_idx + off) & (ids[b, kv_idx] == ids[b, pos])
        return document, None, True
    if kind == "alibi":
        slopes = torch.exp2(-8.0 * (torch.arange(heads, dtype=torch.float32, device=device)
                                    + 1.0) / heads)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - off)
        return causal, alibi, False
    cap = float(value)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return None, softcap, False


def unsupported_reason(job):
    case, implementation = job["case"], job["implementation"]
    if implementation != IMPLEMENTATION:
        return "unknown implementation %r (known: %s)" % (implementation, IMPLEMENTATION)
    if case.get("pass") not in ("fwd", "fwd+bwd"):
        return "unknown pass %r" % case.get("pass")
    if case.get("dtype") not in torch_sdpa.DTYPES:
        return "dtype %r is not measured by the comparison module (bf16, fp16, fp32)" % (
            case.get("dtype"),)
    args = torch_sdpa.arguments(job)
    if args["kv_lens"] is not None:
        return "per-sequence key lengths are not written as a flex_attention mask here"
    if int(args["heads"]) % int(args["kv_heads"]) != 0:
        return "heads (%s) is not a multiple of kv_heads (%s)" % (args["heads"],
                                                                  args["kv_heads"])
    try:
        parse_mask(mask_name(args))
    except ValueError as e:
        return str(e)
    return None


def caller(job, device, compiled):
    """(call, block-mask seconds): the timed call in `torch_sdpa.caller`'s form, with the
    block mask built once here."""
    from torch.nn.attention.flex_attention import create_block_mask
    args = torch_sdpa.arguments(job)
    mask_mod, score_mod, per_batch = mods(args, device)
    kw = {"scale": float(args["scale"])}
    if int(args["kv_heads"]) != int(args["heads"]):
        kw["enable_gqa"] = True
    if score_mod is not None:
        kw["score_mod"] = score_mod
    t0 = time.perf_counter()
    if mask_mod is not None:
        b = int(args["batch"]) if per_batch else None
        kw["block_mask"] = create_block_mask(mask_mod, b, None, int(args["seq_len_q"]),
                                             int(args["seq_len_kv"]), device=device)
    torch.cuda.synchronize()
    mask_s = time.perf_counter() - t0
    if job["case"].get("pass") != "fwd+bwd":
        return (lambda q, k, v: compiled(q, k, v, **kw)), mask_s, kw

    def fwd_bwd(q, k, v, do):
        out = compiled(q, k, v, **kw)
        return (out,) + tuple(torch.autograd.grad(out, (q, k, v), do))
    return fwd_bwd, mask_s, kw


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        reply["libraries"] = torch_sdpa.libraries()
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = torch_sdpa.IMPORT_ERROR or unsupported_reason(job)
    if why is None and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return reply
    caught = []
    try:
        with torch_outputs.empty_compile_caches("kp_torch_flex_"), \
                warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            try:
                fields, window = _measure(job)
            finally:
                caught.extend(recorded)
    except Exception as e:
        status, msg = torch_sdpa.classify(e)
        if status == "unsupported":
            msg = torch_sdpa.with_warnings(msg, caught)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, status, msg)
        return reply
    protocol.finish_reply(reply, case, implementation, LIBRARY, fields, window)
    return reply


def _measure(job):
    from torch.nn.attention.flex_attention import flex_attention
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # CUDA context, outside every figure
    torch.cuda.synchronize()
    compiled = torch.compile(flex_attention)
    call, mask_s, kw = caller(job, device, compiled)
    args = torch_sdpa.arguments(job)
    notes = [COMPILE_NOTE,
             "modification `%s`; block mask by create_block_mask in %.3f s, before the first "
             "call: outside the time and the memory figures" % (mask_name(args), mask_s)]

    def residual_bytes(set0, before):
        q, k, v = set0[:3]
        out = compiled(q, k, v, **kw)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del out
        torch.cuda.synchronize()
        return max(0, held)

    fields, window = torch_sdpa.measure_call(job, device, call, contextlib.nullcontext(),
                                             residual_bytes, notes)
    if fields.get("median_ms") is not None and fields.get("first_call_s") is not None:
        fields["compile_s"] = max(0.0, fields["first_call_s"] - fields["median_ms"] / 1e3)
    return fields, window


def self_test():
    """The module's checks that need no GPU: mask names (and the protocol's own)."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append(what)
    check(parse_mask("sliding_window(1024)") == ("sliding_window", 1024), "sliding_window")
    check(parse_mask("softcap(30)") == ("softcap", 30.0), "softcap")
    check(parse_mask("prefix_lm(0)") == ("prefix_lm", 0), "prefix_lm(0)")
    for bad in ("diagonal", "softcap(0)", "sliding_window(x)", "softcap", "softcap(inf)",
                "prefix_lm(-5)"):
        try:
            parse_mask(bad)
            check(False, "accepted %r" % bad)
        except ValueError:
            pass
    check(mask_name({"causal": True}) == "causal", "causal from the case")
    check(mask_name({"causal": False, "mask": "alibi"}) == "alibi", "mask from the arguments")
    torch_outputs.check_empty_compile_caches(check)
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
