"""What the PyTorch comparison modules that return whole output tensors share (`torch_kernel_sums`,
`torch_mixers`, `fla_mixers`, `mamba_mixers`, `torch_moe`): checking the outputs against the
runner's float64 reference, the notes for timings the case limit cut short, the measurement of
one call on CUDA or on the CPU, for the Triton libraries their common notes and the library's version in the
reply, and (`empty_compile_caches`, also `torch_flex`'s) the empty compile caches under which a
`torch.compile` row's first call is timed. Imports torch through `torch_cpu` (None without it)."""
import contextlib
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, timing, torch_cpu, torch_sdpa  # noqa: E402
else:
    from . import protocol, timing, torch_cpu, torch_sdpa

torch = torch_cpu.torch


# The environment variables that place TorchInductor's and Triton's on-disk caches.
COMPILE_CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextlib.contextmanager
def empty_compile_caches(prefix):
    """TorchInductor's and Triton's caches in a new empty folder (named from `prefix`) for the
    block, so that a first call under torch.compile compiles everything (its compile_s is a cold
    compile, not a cache hit from an earlier job); afterwards the folder is removed and the
    variables are as before. Yields the folder."""
    folder = tempfile.mkdtemp(prefix=prefix)
    saved = {name: os.environ.get(name) for name in COMPILE_CACHE_VARS}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(folder, "triton")
    try:
        yield folder
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(folder, ignore_errors=True)


def check_empty_compile_caches(check):
    """empty_compile_caches's contract, for the modules' self-tests (no torch needed)."""
    before = {name: os.environ.get(name) for name in COMPILE_CACHE_VARS}
    with empty_compile_caches("kp_selftest_") as folder:
        check(os.path.isdir(folder) and not os.listdir(folder), "the cache folder starts empty")
        for name in COMPILE_CACHE_VARS:
            check(os.environ.get(name, "").startswith(folder), "%s points into it" % name)
        open(os.path.join(folder, "left.txt"), "w").close()
    check(not os.path.exists(folder), "the cache folder is removed afterwards")
    check({name: os.environ.get(name) for name in COMPILE_CACHE_VARS} == before,
          "the variables are restored")


TRITON_PEAK_NOTE = ("peak memory read on a second call (the first compiles and autotunes the "
                    "Triton kernels; first_call_s includes that)")


def triton_fp32_note():
    """What fp32 means for a Triton library's matrix products on this machine."""
    return ("fp32: the library's Triton kernels multiply with tl.dot's default input precision "
            "(%s) except where a kernel asks for more"
            % (os.environ.get("TRITON_F32_DEFAULT") or "tf32 on NVIDIA GPUs: TF32 tensor cores"))


def measure_with_library(job, measure_into, name, version):
    """`measure_into(job, reply)` in this (fresh) process; the reply's libraries are PyTorch's
    and `name` at `version()` when it has one."""
    reply = {}
    try:
        measure_into(job, reply)
    finally:
        libs = torch_sdpa.libraries()
        v = version()
        if v:
            libs[name] = v
        reply["libraries"] = libs
    return reply


def check_outputs(files, results):
    """Each whole output scanned for non-finite values, then the runner's checked elements
    against its float64 reference: ({"message": ...}, None) on a failure, else (None, the
    accuracy dict)."""
    errors = []
    for (name, _spec, check), tensor in zip(protocol.outputs(files), results):
        flat = tensor.detach().contiguous().view(-1)
        bad = (~torch.isfinite(flat)).nonzero()
        bad_index = int(bad[0, 0]) if bad.numel() else None
        idx = torch.tensor(protocol.flat_indices(check["ranges"]), dtype=torch.long,
                           device=flat.device)
        got = flat.index_select(0, idx).double().cpu().tolist()
        reference = protocol.read_f64(check["reference"])
        msg, rel_err = protocol.check_output(bad_index, flat.numel(), got, reference)
        if msg is not None:
            if name != "O":
                msg = msg.replace(" (unwritten", " of %s (unwritten" % name)
            return {"message": msg}, None
        errors.append((name, rel_err))
    check = files["check"]
    return None, {"rel_err": protocol.worst(e for _, e in errors), "metric": "rel_l2",
                  "reference": check.get("reference_kind", "float64_cpu"),
                  "tolerance": check["tolerance"],
                  "checked": protocol.checked_text(check["checked"], errors)}


def cut_short_notes(measurements, tcfg):
    """A note per (measurement, name) the case time limit cut short; a measurement without a
    name (a row timed once) gets the project's own rows' wording (src/runner/own.rs)."""
    notes = []
    for m, what in measurements:
        if m is None or not m["cut_short"]:
            continue
        n, r, t = m["samples"], int(tcfg["repeats"]), float(tcfg["case_timeout_s"])
        if what is None:
            notes.append("%d of %d samples: the %g s case limit stopped sampling" % (n, r, t))
        else:
            notes.append("%s timing: %d of %d samples, the %g s case limit stopped sampling"
                         % (what, n, r, t))
    return notes


def measure_on_cpu(job, call, notes, check=check_outputs, grad=False):
    """Measures `call` (on the job's inputs, in `files.inputs` order, returning a tuple of
    outputs) on the CPU, as the project's CPU rows are measured: the inputs read, the first
    call timed by wall clock, the outputs checked (`check`, `check_outputs`'s form), then the
    shared timing protocol by wall clock over back-to-back calls (`torch_cpu.WallTimer`) on
    copies of the inputs rotated through the last-level cache. Peak memory: the resident set's
    high-water mark over the inputs and the first call. Autograd is off unless `grad` (a call
    that takes gradients). `notes` (the formulation's) follow the timing and thread notes.
    Returns (row fields, window), or (failed fields, None) when the check fails."""
    files, tcfg = job["files"], job["timing"]
    load_before = torch_cpu.load_average()
    with torch.set_grad_enabled(grad):
        base = torch_cpu.reset_peak_rss()
        set0 = tuple(torch_cpu.load_input(t) for t in files["inputs"])
        t0 = time.perf_counter()
        results = call(*set0)
        first_call_s = time.perf_counter() - t0
        r = torch_cpu.rss_bytes()
        peak = r[1] - base if (base is not None and r is not None) else None
        set_bytes = sum(x.numel() * x.element_size() for x in set0)
        out_bytes = sum(x.numel() * x.element_size() for x in results)
        failed, accuracy = check(files, results)
        if failed:
            return failed, None
        del results

        n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                            float(tcfg["l2_rotation_factor"]))
        sets = [set0] + [tuple(x.clone() for x in set0) for _ in range(n_sets - 1)]
        window0 = protocol.unix_now()
        m = timing.measure(torch_cpu.WallTimer(call, sets), tcfg)
        window = [window0, protocol.unix_now()]
        del sets
    all_notes = [torch_cpu.TIMING_NOTE,
                 "PyTorch intra-op threads: %d" % torch.get_num_threads()] + list(notes)
    note = torch_cpu.load_note(load_before, torch_cpu.load_average())
    if note:
        all_notes.append(note)
    all_notes += cut_short_notes([(m, None)], tcfg)
    memory = {"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6}
    if peak is not None:
        memory.update(peak_mb=max(0, peak) / 1e6, peak_method=torch_cpu.PEAK_METHOD,
                      temporaries_mb=max(0, peak - set_bytes - out_bytes) / 1e6)
    fields = dict(
        timing="wall_clock",
        median_ms=m["median"], q1_ms=m["q1"], q3_ms=m["q3"], inner_calls=m["inner"],
        samples=m["samples"], input_sets=n_sets, l2_rotation_reached=reached,
        first_call_s=first_call_s, flops=files.get("flops"), bytes=files.get("bytes"),
        items=files.get("items"), memory=memory, accuracy=accuracy, notes=all_notes)
    return fields, window


# The peak-memory method when the first call compiles and autotunes (measure_on_gpu's
# peak_on_second_call).
PEAK_ON_SECOND_CALL = ("torch.cuda.max_memory_allocated (reset before the inputs' upload and again "
                       "after a first call, read after the second) in a fresh process running "
                       "only this case; cuBLAS workspaces apart")


def measure_on_gpu(job, call, notes, fit=None, peak_on_second_call=False,
                   check=check_outputs, graph=True):
    """Measures `call` (on the job's inputs, in `files.inputs` order, returning a tuple of
    outputs) on CUDA: the inputs uploaded, the first call timed by wall clock, the outputs
    scanned and checked against the runner's float64 reference (`check_outputs`), then eager
    calls between CUDA events and a CUDA graph of them (`timing.measure_eager_then_graph`).
    Peak memory from the caching allocator (reset before the upload; cuBLAS workspaces apart).
    `notes` are the row's notes (the formulation's), to which the timing's are added; `fit`, if
    given, is called with the bytes the device has free (cached blocks included) after the
    upload and raises to refuse the call; `peak_on_second_call` reads the peak (and checks the
    outputs) on a second call, the allocator's counters reset after the first: for libraries
    whose first call compiles and autotunes Triton kernels, whose benchmarking buffers are not
    the call's; `check(files, results)` is the first call's output check, `check_outputs`'s form
    ((failed row fields, None) or (None, the accuracy dict or None)), `check_outputs` unless a
    call's outputs are not the reference's function (torch_moe's dense ceiling scans them only);
    `graph` False times the eager calls alone (a call that waits for the device's values on the
    host, which no CUDA graph can capture; the caller's notes say why).
    Returns (row fields, measurement window) or (failed row fields, None)."""
    files, tcfg = job["files"], job["timing"]
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # CUDA context, outside every figure
    torch.cuda.synchronize()
    with torch.no_grad():
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        base_reserved = torch.cuda.memory_reserved()
        set0 = tuple(torch_sdpa.load_input(t, device) for t in files["inputs"])
        torch.cuda.synchronize()
        if fit is not None:
            cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            fit(torch.cuda.mem_get_info()[0] + cached)
        t0 = time.perf_counter()
        results = call(*set0)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        if peak_on_second_call:
            # The first call compiled and autotuned; its benchmarking buffers are not the call's.
            del results
            torch.cuda.reset_peak_memory_stats()
            results = call(*set0)
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        reserved = torch.cuda.max_memory_reserved() - base_reserved
        workspace = torch_sdpa.cublas_workspace_bytes()
        ws = workspace or 0
        set_bytes = sum(x.numel() * x.element_size() for x in set0)
        out_bytes = sum(x.numel() * x.element_size() for x in results)
        failed, accuracy = check(files, results)
        if failed:
            return failed, None
        del results

        free = torch.cuda.mem_get_info()[0]
        n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                            float(tcfg["l2_rotation_factor"]), free)
        sets = [set0] + [tuple(x.clone() for x in set0) for _ in range(n_sets - 1)]
        torch.cuda.synchronize()
        window0 = protocol.unix_now()
        reported, method, eager, graph_error = timing.measure_eager_then_graph(
            torch, call, sets, tcfg, time.perf_counter(), graph=graph)
        window = [window0, protocol.unix_now()]
        del sets
    notes = list(notes)
    graph = reported if graph_error is None and method == "graph_replay" else None
    if graph_error is not None:
        notes.append("CUDA graph capture failed, timed eagerly: %s"
                     % protocol.exc_text(graph_error))
    notes += cut_short_notes([(eager, "eager"), (graph, "graph")], tcfg)
    fields = dict(
        median_ms=reported["median"], q1_ms=reported["q1"], q3_ms=reported["q3"],
        inner_calls=reported["inner"], samples=reported["samples"], input_sets=n_sets,
        l2_rotation_reached=reached, timing=method, host_ms=eager["host_ms"],
        eager_median_ms=eager["median"] if graph is not None else None,
        first_call_s=first_call_s, flops=files.get("flops"), bytes=files.get("bytes"),
        items=files.get("items"),
        memory={"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6,
                "temporaries_mb": max(0, peak - ws - set_bytes - out_bytes) / 1e6,
                "peak_mb": max(0, peak - ws) / 1e6,
                "reserved_peak_mb": max(0, reserved - ws) / 1e6,
                "workspace_mb": workspace / 1e6 if workspace else None,
                "peak_method": (PEAK_ON_SECOND_CALL if peak_on_second_call
                                else torch_sdpa.PEAK_METHOD)},
        accuracy=accuracy, notes=notes)
    return fields, window
