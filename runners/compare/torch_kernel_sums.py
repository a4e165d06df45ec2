"""PyTorch's dense kernel sums, measured by the kernelpages protocol (`kernel_sums --compare
torch` on the GPU, `kernel_sums --device cpu --compare torch` on the CPU; the job's `device`
says which).

Implementation `torch_dense`: the formulation a PyTorch user writes, holding the N x M matrix:
- `rbf_mv`: `torch.exp(torch.cdist(x, y).square() * (-1 / (2 sigma^2))) @ b`;
- `kde`: the same kernel's row sums times (2 pi sigma^2)^(-dim/2) / M;
- `kernel_lse`: `torch.logsumexp(g - torch.cdist(x, y).square() / epsilon, dim=1)`, and with
  the gradient (`pass = fwd+bwd`) `torch.autograd.grad(out.sum(), x)` after it in every call.
sigma and epsilon are the runner's (`files.arguments`), so every implementation computes the
same function. For each job, in a fresh process: the runner's fp32 inputs are read (and on the
GPU uploaded); the first call is timed by wall clock; every output (and dX) is scanned for
non-finite values and the runner's checked elements compared with the runner's float64
reference; then the shared timing protocol.
- CPU: peak memory is the resident set's high-water mark over the inputs and the first call
  (the method of the project's CPU rows, `torch_cpu.rss_bytes`); wall time is the sample time.
- GPU: peak memory from the caching allocator (`max_memory_allocated`, reset before the upload,
  read after the first call; cuBLAS workspaces apart, as `torch_sdpa` does); eager calls timed
  between CUDA events, then a CUDA graph of the same calls replayed (`graph_replay`, the
  reported time; the eager median kept as `eager_median_ms`), since short dense calls are
  bounded by the host's launches.
A case whose N x M matrix does not fit is an `oom` row with the size asked.

    PYTHONPATH=runners python3 -m compare.torch_kernel_sums serve | self-test | job FILE
"""
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import dense_kernel_sums, protocol  # noqa: E402
    from compare import torch_cpu, torch_outputs, torch_sdpa  # noqa: E402
else:
    from . import dense_kernel_sums, protocol, torch_cpu, torch_outputs, torch_sdpa

LIBRARY = "PyTorch"
IMPLEMENTATIONS = ("torch_dense",)
OPS = dense_kernel_sums.OPS
DENSE_NOTE = "holds the N x M matrix of distances and kernel values"

torch = torch_cpu.torch
IMPORT_ERROR = torch_cpu.IMPORT_ERROR


def unsupported_reason(case, implementation):
    return dense_kernel_sums.unsupported_reason(case, implementation, IMPLEMENTATIONS)


dense_bytes = dense_kernel_sums.dense_bytes


def caller(args):
    """The call on (x, y[, b or g]) returning a tuple of outputs (out[, dX])."""
    op, grad = args["op"], bool(args.get("grad"))
    sigma, eps, dim, m = float(args["sigma"]), float(args["epsilon"]), int(args["dim"]), \
        int(args["m"])

    def sq(x, y):
        return torch.cdist(x, y).square()

    if op == "rbf_mv":
        k = -1.0 / (2.0 * sigma * sigma)
        return lambda x, y, b: (torch.exp(sq(x, y) * k) @ b,)
    if op == "kde":
        k = -1.0 / (2.0 * sigma * sigma)
        norm = (2.0 * math.pi * sigma * sigma) ** (-dim / 2.0) / m
        return lambda x, y: (torch.exp(sq(x, y) * k).sum(dim=1) * norm,)
    if not grad:
        return lambda x, y, g: (torch.logsumexp(g - sq(x, y) / eps, dim=1),)

    def with_grad(x, y, g):
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            out = torch.logsumexp(g - sq(xr, y) / eps, dim=1)
            (dx,) = torch.autograd.grad(out.sum(), xr)
        return out.detach(), dx
    return with_grad


def classify(exc):
    status, msg = torch_cpu.classify(exc)
    if isinstance(exc, RuntimeError) and "not enough memory" in str(exc).lower():
        status = "oom"
    return status, msg


on_gpu = dense_kernel_sums.on_gpu


def measure(job):
    """Measure one job in this (fresh) process; returns the reply dict."""
    reply = {}
    try:
        _measure_into(job, reply)
    finally:
        # After the measurement: the version queries must not load anything before the first
        # call is timed.
        reply["libraries"] = (torch_sdpa.libraries() if on_gpu(job)
                              else torch_cpu.libraries())
    return reply


def _measure_into(job, reply):
    case, implementation = job["case"], job["implementation"]
    why = IMPORT_ERROR or unsupported_reason(case, implementation)
    if why is None and on_gpu(job) and not torch.cuda.is_available():
        why = "no CUDA device visible to torch"
    run = _measure_gpu if on_gpu(job) else _measure_cpu
    dense_kernel_sums.measure_into(job, reply, LIBRARY, why, run, classify)


def _measure_cpu(job):
    return torch_outputs.measure_on_cpu(job, caller(job["files"]["arguments"]), [DENSE_NOTE])


def _measure_gpu(job):
    notes = [DENSE_NOTE, "fp32: TF32 %s (torch.backends.cuda.matmul.allow_tf32 = %s)" % (
        "allowed" if torch.backends.cuda.matmul.allow_tf32 else "not allowed",
        torch.backends.cuda.matmul.allow_tf32)]
    return torch_outputs.measure_on_gpu(job, caller(job["files"]["arguments"]), notes)


def self_test():
    """Pure checks of this module (no torch needed), then torch_cpu's and the shared ones."""
    failures = torch_cpu.self_test()

    def check(cond, what):
        if not cond:
            failures.append("torch_kernel_sums: " + what)

    check(unsupported_reason({"op": "kde", "dtype": "fp32"}, "torch_dense") is None,
          "kde fp32 is measured")
    check("fp32" in unsupported_reason({"op": "kde", "dtype": "bf16"}, "torch_dense"),
          "bf16 points are refused")
    check("sinc" in unsupported_reason({"op": "sinc", "dtype": "fp32"}, "torch_dense"),
          "unknown ops are refused")
    check("unknown" in unsupported_reason({}, "torch_flash"), "other names are unknown")
    check(dense_bytes({"n": 1000, "m": 2000}) == 8e6, "dense size")
    check(on_gpu({"device": "gpu"}) and not on_gpu({"device": "cpu"}) and on_gpu({}),
          "the job's device picks the path; no device is the GPU")
    if torch is not None:
        args = {"op": "kernel_lse", "grad": True, "sigma": 1.0, "epsilon": 2.0, "dim": 2,
                "m": 1, "n": 1}
        x = torch.tensor([[0.0, 0.0]])
        y = torch.tensor([[3.0, 4.0]])
        g = torch.tensor([1.0])
        out, dx = caller(args)(x, y, g)
        # One point: lse = g - |x - y|^2 / eps = 1 - 12.5; dX = -(2/eps)(x - y) = (3, 4).
        check(abs(float(out[0]) + 11.5) < 1e-5, "lse of one pair: %r" % float(out[0]))
        check(abs(float(dx[0, 0]) - 3.0) < 1e-5 and abs(float(dx[0, 1]) - 4.0) < 1e-5,
              "gradient of one pair: %r" % dx.tolist())
    return failures


if __name__ == "__main__":
    sys.exit(protocol.main(measure, LIBRARY, module_self_test=self_test))
