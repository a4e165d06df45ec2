"""One jitted JAX call measured by the kernelpages protocol, on the job's device (`gpu`, or
`cpu` when the job says so): what `jax_kernel_sums` and `jax_mixers` share.

For each job, in a fresh process forked from the server: the runner's inputs are read and put
on the device; the first call (tracing and XLA compilation included) is timed by wall clock;
every output is scanned for non-finite values and the runner's checked elements compared with
its float64 reference; then the shared timing protocol with `jax_attention.DispatchTimer`
(inner calls dispatched back to back, then `block_until_ready`: JAX has no CUDA events). Peak
memory: on a GPU, `memory_stats()` as `jax_attention` reads it; on the CPU, the resident set's
high-water mark (`cpu_host`).
"""

import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import cpu_host, jax_attention, protocol, timing  # noqa: E402
else:
    from . import cpu_host, jax_attention, protocol, timing

jax, jnp, np = jax_attention.jax, jax_attention.jnp, jax_attention.np


def platform_of(job):
    """JAX's platform for the job's device (`gpu` when the job names none)."""
    return "cpu" if job.get("device") == "cpu" else "gpu"


def platform_problem(job):
    """Why JAX cannot run the job on its platform (no device, or no backend), or None."""
    try:
        if not jax.devices(platform_of(job)):
            return "no %s device visible to JAX" % platform_of(job)
    except Exception as e:
        return "no %s backend in JAX: %s" % (platform_of(job), protocol.exc_text(e))
    return None


def load_input(t):
    """A runner input file as a NumPy array of its dtype (bf16 as JAX's bfloat16)."""
    raw_type, name = jax_attention.DTYPES[t["dtype"]]
    with open(t["path"], "rb") as f:
        raw = f.read()
    x = np.frombuffer(raw, dtype=np.dtype(raw_type).newbyteorder("<"))
    return x.view(jnp.dtype(name)).reshape(t["shape"])


def device_stats(device):
    """The device's `memory_stats()` (empty where JAX has none, as on the CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:
        return {}


def free_device_bytes(device):
    """Bytes the device's allocator may still hand out, or None where it does not say."""
    s = device_stats(device)
    return max(0, s["bytes_limit"] - s.get("bytes_in_use", 0)) if "bytes_limit" in s else None


def check_outputs(outs, files):
    """Whole outputs scanned for non-finite values, then the runner's elements (as float32)
    against its float64 reference: (message, None) on a failure, else (None, accuracy)."""
    errors = []
    for (name, _spec, check), out in zip(protocol.outputs(files), outs):
        flat = jnp.reshape(out, (-1,)).astype(jnp.float32)
        finite = jnp.isfinite(flat)
        bad_index = None if bool(finite.all()) else int(jnp.argmin(finite))
        idx = np.asarray(protocol.flat_indices(check["ranges"]), dtype=np.int64)
        got = np.asarray(flat[idx]).astype(np.float64).tolist() if idx.size else []
        reference = protocol.read_f64(check["reference"])
        msg, rel_err = protocol.check_output(bad_index, int(flat.size), got, reference)
        if msg is not None:
            return (("%s: %s" % (name, msg)) if name != "O" else msg), None
        errors.append((name, rel_err))
    check = files["check"]
    return None, {"rel_err": protocol.worst(e for _, e in errors), "metric": "rel_l2",
                  "reference": check.get("reference_kind", "float64_cpu"),
                  "tolerance": check["tolerance"],
                  "checked": protocol.checked_text(check["checked"], errors)}


def measure_jitted(job, fn, notes, check_fn=None, inspect=None, per_call=1):
    """Times the jitted `fn` on the job's inputs (in `files.inputs` order, read by
    `load_input`): (row fields, timing window), or ({"message": ...}, None) when an output
    fails its check. `notes` (the formulation's) follow the timing and first-call notes.

    Options for a call that is not what the row reports (`ott_sinkhorn`'s iterations):
    - `check_fn`: a jitted function on the same inputs whose outputs are checked instead of
      `fn`'s (`fn`'s first call still gives the first-call time and the peak memory);
    - `inspect(outs)`: called with `fn`'s first outputs before they are dropped; what it
      returns (a message) fails the row like a failed check, None passes;
    - `per_call`: the row's unit is 1/per_call of a call: times (median, quartiles, host) are
      divided by it."""
    files, tcfg = job["files"], job["timing"]
    on_cpu = platform_of(job) == "cpu"
    device = jax.devices(platform_of(job))[0]
    load_before = cpu_host.load_average() if on_cpu else None
    base = cpu_host.reset_peak_rss() if on_cpu else device_stats(device).get("bytes_in_use", 0)
    host = [load_input(t) for t in files["inputs"]]
    set0 = tuple(jax.device_put(x, device) for x in host)
    jax.block_until_ready(set0)
    t0 = time.perf_counter()
    outs = fn(*set0)
    jax.block_until_ready(outs)
    first_call_s = time.perf_counter() - t0
    if on_cpu:
        r = cpu_host.rss_bytes()
        peak = r[1] - base if (base is not None and r is not None) else None
    else:
        peak_stat = device_stats(device).get("peak_bytes_in_use")
        peak = peak_stat - base if peak_stat is not None else None
    set_bytes = sum(x.nbytes for x in host)
    out_bytes = sum(int(o.size) * o.dtype.itemsize for o in outs)
    msg = inspect(outs) if inspect is not None else None
    if msg is None and check_fn is not None:
        checked = check_fn(*set0)
        jax.block_until_ready(checked)
        msg, accuracy = check_outputs(checked, files)
        del checked
    elif msg is None:
        msg, accuracy = check_outputs(outs, files)
    del outs
    if msg is not None:
        return {"message": msg}, None

    free = None if on_cpu else free_device_bytes(device)
    n_sets, reached = timing.input_sets(set_bytes, int(job["l2_bytes"]),
                                        float(tcfg["l2_rotation_factor"]), free)
    sets = [set0] + [tuple(jax.device_put(x, device) for x in host) for _ in range(n_sets - 1)]
    jax.block_until_ready(sets)
    del host
    window0 = protocol.unix_now()
    m = timing.measure(jax_attention.DispatchTimer(fn, sets), tcfg)
    window = [window0, protocol.unix_now()]
    del sets

    all_notes = [cpu_host.TIMING_NOTE if on_cpu else jax_attention.TIMING_NOTE,
                 jax_attention.FIRST_CALL_NOTE] + list(notes)
    if on_cpu:
        note = cpu_host.load_note(load_before, cpu_host.load_average())
        if note:
            all_notes.append(note)
    if m["cut_short"]:
        all_notes.append("%d of %d samples: the %g s case limit stopped sampling"
                         % (m["samples"], int(tcfg["repeats"]), float(tcfg["case_timeout_s"])))
    memory = {"arguments_mb": set_bytes / 1e6, "outputs_mb": out_bytes / 1e6}
    if peak is not None:
        memory.update(peak_mb=max(0, peak) / 1e6,
                      peak_method=cpu_host.PEAK_METHOD if on_cpu else jax_attention.PEAK_METHOD,
                      temporaries_mb=max(0, peak - set_bytes - out_bytes) / 1e6)
    fields = dict(
        timing="wall_clock",
        median_ms=m["median"] / per_call, q1_ms=m["q1"] / per_call,
        q3_ms=m["q3"] / per_call, inner_calls=m["inner"],
        samples=m["samples"], input_sets=n_sets, l2_rotation_reached=reached,
        host_ms=None if on_cpu else m["host_ms"] / per_call, first_call_s=first_call_s,
        flops=files.get("flops"), bytes=files.get("bytes"), items=files.get("items"),
        memory=memory, accuracy=accuracy, notes=all_notes)
    return fields, window
