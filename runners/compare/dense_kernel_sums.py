"""What the dense kernel-sum modules (`torch_kernel_sums`, `jax_kernel_sums`) share: the ops
they take, the case checks, the device a job names, and the size an out-of-memory row reports.
"""

# The ops a dense module computes (the runner's `op` parameter).
OPS = ("rbf_mv", "kde", "kernel_lse")


def unsupported_reason(case, implementation, implementations):
    """Why `implementation` (one of `implementations`) cannot compute `case`, or None."""
    if implementation not in implementations:
        return "unknown implementation %r (known: %s)" % (implementation,
                                                          ", ".join(implementations))
    if case.get("op") not in OPS:
        return "unknown op %r (%s)" % (case.get("op"), ", ".join(OPS))
    if case.get("dtype") != "fp32":
        return "dtype %r: kernel sums take fp32 points" % (case.get("dtype"),)
    return None


def on_gpu(job):
    """True when the job comes from a GPU run (the job's `device`, `gpu` when absent, as the
    runner's `Job` reads it)."""
    return job.get("device", "gpu") == "gpu"


def dense_bytes(args):
    """Bytes of one float32 N x M matrix."""
    return 4 * int(args["n"]) * int(args["m"])


def oom_message(args, msg):
    """An `oom` row's message: the dense matrix's size, then the framework's words."""
    return "the dense N x M matrix alone is %.2f GB: %s" % (dense_bytes(args) / 1e9, msg)
