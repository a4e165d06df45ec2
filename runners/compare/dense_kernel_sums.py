"""What the dense kernel-sum modules (`torch_kernel_sums`, `jax_kernel_sums`) share: the ops
they take, the case checks, the device a job names, and the size an out-of-memory row reports.
"""

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol  # noqa: E402
else:
    from . import protocol

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


def measure_into(job, reply, library, why, run, classify):
    """Fills `reply["row"]` (and `reply["window"]`) for one job: `unsupported` with `why` when
    it is not None; else `run(job)` -> (fields, window), an `error` row when the fields carry
    the check's `message`, `ok` otherwise; an exception from `run` becomes the row
    `classify(exc)` names, an `oom` message prefixed with the dense matrix's size."""
    case, implementation = job["case"], job["implementation"]
    if why is not None:
        reply["row"] = protocol.make_row(case, implementation, library, "unsupported", why)
        return
    try:
        fields, window = run(job)
    except Exception as e:
        status, msg = classify(e)
        if status == "oom":
            msg = oom_message(job["files"]["arguments"], msg)
        reply["row"] = protocol.make_row(case, implementation, library, status, msg)
        return
    protocol.finish_reply(reply, case, implementation, library, fields, window)
