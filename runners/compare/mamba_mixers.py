"""mamba_ssm's kernels for SSD and the selective scan, measured by the kernelpages protocol
(`sequence_mixers --compare mamba`, GPU only): the implementations Mamba's own models call.

Implementation `mamba_ssm`, per mixer (inputs as `torch_mixers` documents them):
- `ssd`: `mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C,
  chunk_size=64, D=D)`, Mamba-2's Triton kernels, dt already positive (no softplus, no bias),
  B and C per group as the runner gives them: y_t = S_t C_t + D x_t with
  S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, the runner's definition. Output in x's dtype.
- `selective_scan`: `mamba_ssm.ops.selective_scan_interface.selective_scan_fn` (the CUDA
  extension `selective_scan_cuda`) on channel-first views (u, delta [B, D, T], B and C
  [B, N, T]), delta already positive and in u's dtype; `unsupported` with the reason where the extension is
  not importable (PyPI has no binary wheel for this image's torch and CUDA, and the machine
  cannot build it: `runners/mamba_wheel.py` carries the Python sources and Triton kernels).
- the gated delta rule and Based: `unsupported` (not in the library).
`pass = fwd+bwd` runs the library's backward through autograd (`torch_mixers.with_backward`).

The package's `__init__` imports the CUDA extension, so this module registers `mamba_ssm` as
a bare package over its folder and imports the Triton submodules from it. The library is
imported in the job's own process, never in the server (Triton queries the device). Timing,
memory and checks are `torch_outputs.measure_on_gpu`'s, the peak read on a second call (the
first compiles and autotunes the Triton kernels).

    PYTHONPATH=runners python3 -m compare.mamba_mixers serve | self-test | job FILE
"""
import importlib
import importlib.util
import os
import sys
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_mixers, torch_outputs  # noqa: E402
else:
    from . import protocol, torch_mixers, torch_outputs

LIBRARY = "mamba_ssm"
IMPLEMENTATIONS = ("mamba_ssm",)
MIXERS = ("ssd", "selective_scan")
DTYPES = torch_mixers.DTYPES
PASSES = ("fwd", "fwd+bwd")
CHUNK = 64
NOT_IN_LIBRARY = "mamba_ssm has no %s (its kernels are Mamba-1's selective scan and Mamba-2's SSD)"
MIXER_NOTES = {
    "ssd": "mamba_chunk_scan_combined (Triton), chunk_size %d, dt as given (no softplus, no "
           "bias), D per head" % CHUNK,
    "selective_scan": "selective_scan_fn (the CUDA extension) on channel-first views of the "
                      "runner's [B, T, D] and [B, T, N] inputs (the library makes them "
                      "contiguous: four transposing copies inside the timed call), delta as "
                      "given in u's dtype (no softplus, no bias)",
}

torch = torch_mixers.torch


def _spec():
    try:
        return importlib.util.find_spec("mamba_ssm")
    except (ImportError, ValueError):
        return None


def library_version():
    """mamba_ssm's version from its metadata (without importing it), or None."""
    try:
        from importlib import metadata
        return metadata.version("mamba_ssm")
    except Exception:
        return None


def unsupported_reason(case, implementation, device="gpu"):
    """Why `implementation` cannot compute `case` (`mixer`, `dtype`, `pass`) on `device`, or
    None (the extension's presence is checked at measuring time)."""
    if implementation not in IMPLEMENTATIONS:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(IMPLEMENTATIONS))
    if device != "gpu":
        return "mamba_ssm's kernels are Triton and CUDA kernels for GPUs: no CPU rows"
    mixer = case.get("mixer")
    if mixer == "gated_delta":
        return NOT_IN_LIBRARY % "gated delta rule"
    if mixer == "based":
        return NOT_IN_LIBRARY % "Based (linear attention with a window)"
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


def bare_package():
    """Registers `mamba_ssm` as a package over its folder without running its `__init__`
    (which imports the CUDA extension); returns None, or why the package is not there."""
    if "mamba_ssm" in sys.modules:
        return None
    spec = _spec()
    if spec is None or not spec.submodule_search_locations:
        return "mamba_ssm is not installed (runners/fetch_wheels.sh builds its wheel)"
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["mamba_ssm"] = pkg
    return None


def load_ops(mixer):
    """The library's function for `mixer` (in the job's process: Triton starts here)."""
    if mixer == "ssd":
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined") \
            .mamba_chunk_scan_combined
    return importlib.import_module("mamba_ssm.ops.selective_scan_interface").selective_scan_fn


def caller(args, op):
    """The call on the mixer's inputs (files.inputs, in order) returning (y,)."""
    if args["mixer"] == "ssd":
        def ssd(x, dt, a, b, c, d):
            return (op(x, dt, a, b, c, CHUNK, D=d),)
        return ssd

    def scan(u, delta, a, b, c, d):
        # Channel-first views: u, delta [B, D, T]; B, C [B, N, T]; y back to [B, T, D]. The
        # extension wants delta in u's dtype (the runner's delta is float32): rounded to bf16
        # in bf16 cases, as Mamba's own block passes it; autograd takes the gradient back to
        # the float32 input.
        y = op(u.transpose(1, 2), delta.to(u.dtype).transpose(1, 2), a, b.transpose(1, 2),
               c.transpose(1, 2), D=d)
        return (y.transpose(1, 2).contiguous(),)
    return scan


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    return torch_outputs.measure_with_library(job, _measure_into, "mamba_ssm", library_version)


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    args = torch_mixers.arguments(job)
    device = "gpu" if torch_mixers.on_gpu(job) else "cpu"
    why = unsupported_reason(args, implementation, device) or torch_mixers.IMPORT_ERROR \
        or bare_package()
    if why is None and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", why)
        return
    try:
        op = load_ops(args["mixer"])
    except Exception as e:
        text = protocol.exc_text(e)
        if args["mixer"] == "selective_scan" and "selective_scan_cuda" in text:
            text = ("mamba_ssm's selective scan is the CUDA extension selective_scan_cuda, "
                    "not built for this image (no binary wheel for its torch and CUDA; the "
                    "carried wheel has the Python sources and Triton kernels only): %s" % text)
        reply["row"] = protocol.make_row(case, implementation, LIBRARY, "unsupported", text)
        return
    try:
        torch_mixers.check_inputs(args, job["files"]["inputs"])
        call = caller(args, op)
        notes = [MIXER_NOTES[args["mixer"]], torch_outputs.TRITON_PEAK_NOTE]
        if args["dtype"] == "fp32":
            notes.append(torch_outputs.triton_fp32_note())
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
    """Pure checks (no torch, no library needed); with the library, its import path."""
    failures = protocol.self_test()

    def check(cond, what):
        if not cond:
            failures.append("mamba_mixers: " + what)

    ssd = {"mixer": "ssd", "pass": "fwd", "dtype": "bf16", "heads": 8, "groups": 2}
    check(unsupported_reason(ssd, "mamba_ssm") is None, "ssd bf16 runs")
    check(unsupported_reason(dict(ssd, **{"pass": "fwd+bwd"}), "mamba_ssm") is None,
          "ssd's backward runs")
    check(unsupported_reason(dict(ssd, mixer="selective_scan"), "mamba_ssm") is None,
          "the scan is asked for (the extension decides)")
    check("gated delta" in (unsupported_reason(dict(ssd, mixer="gated_delta"), "mamba_ssm")
                            or ""), "gated delta is not in the library")
    check("Based" in (unsupported_reason(dict(ssd, mixer="based"), "mamba_ssm") or ""),
          "based is not in the library")
    check("GPU" in (unsupported_reason(ssd, "mamba_ssm", "cpu") or ""), "no CPU rows")
    check("groups" in (unsupported_reason(dict(ssd, groups=3), "mamba_ssm") or ""),
          "heads not a multiple of groups")
    check("unknown" in unsupported_reason(ssd, "mamba_triton"), "other names are unknown")
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
