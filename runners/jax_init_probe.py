"""Where a JAX comparison row's start-up goes: the time a freshly forked process takes to start
JAX's GPU backend (`jax.devices("gpu")`), as the comparison server's forks do it, under four
set-ups of the parent process. A device experiment, not a measurement for the site.

The attention grid's JAX rows spend about 3.6 s each before their first call whatever the
case's size (kernels/TUNING.md, "Where a run's time goes"). Candidates:
- `default`: the parent imports jax and forks (what `compare.jax_attention serve` does now);
- `no_prealloc`: the same with XLA_PYTHON_CLIENT_PREALLOCATE=false in the child (no 75 %
  pool claimed at start);
- `preload`: the parent also dlopens the CUDA PJRT plugin's shared library (RTLD_GLOBAL)
  before forking, without starting any backend, so the children find it mapped;
- `preload_no_prealloc`: both.
Each set-up forks `--repeats` children one after another; each child reports the seconds of
its `jax.devices("gpu")` and of a first tiny jitted call, and whether the parent had touched
the GPU (it must not have: a CUDA context does not survive fork).

Usage (on the GPU machine): python3 runners/jax_init_probe.py [--repeats 3]
Prints one line per child and a median per set-up.
"""

import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import time


def plugin_libraries():
    """The CUDA PJRT plugin's shared libraries of the installed jax_plugins package(s)."""
    try:
        import jax_plugins
    except ImportError:
        return []
    found = []
    for root in getattr(jax_plugins, "__path__", []):
        found += glob.glob(os.path.join(root, "xla_cuda*", "*.so"))
    return sorted(found)


def child(report_fd, no_prealloc):
    """In the forked child: time the backend's start and a first call; write JSON to the pipe."""
    if no_prealloc:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    out = {}
    try:
        import jax
        import jax.numpy as jnp
        t0 = time.perf_counter()
        devices = jax.devices("gpu")
        out["devices_s"] = time.perf_counter() - t0
        out["devices"] = [str(d) for d in devices]
        t0 = time.perf_counter()
        jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(jnp.ones(8)))
        out["first_call_s"] = time.perf_counter() - t0
    except Exception as e:  # the row of a failed set-up says why
        out["error"] = "%s: %s" % (type(e).__name__, e)
    os.write(report_fd, json.dumps(out).encode())
    os._exit(0)


def run(setup, repeats):
    no_prealloc = setup in ("no_prealloc", "preload_no_prealloc")
    results = []
    for _ in range(repeats):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child(w, no_prealloc)
        os.close(w)
        chunks = []
        while True:
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
        os.close(r)
        os.waitpid(pid, 0)
        res = json.loads(b"".join(chunks) or b"{}")
        print("%-20s %s" % (setup, json.dumps(res)), flush=True)
        results.append(res)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    try:
        import jax  # noqa: F401  (imported once in the parent, as the server does; no backend)
    except ImportError as e:
        print("jax is not importable: %s" % e)
        return 2
    libs = plugin_libraries()
    print("plugin libraries: %s" % (libs or "none found"), flush=True)
    summary = {}
    # Preloading cannot be undone in this process, so the set-ups without it run first.
    for setup in ("default", "no_prealloc", "preload", "preload_no_prealloc"):
        if setup == "preload":
            t0 = time.perf_counter()
            for lib in libs:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            print("parent dlopen of the plugin: %.3f s" % (time.perf_counter() - t0),
                  flush=True)
        res = run(setup, args.repeats)
        times = [r["devices_s"] for r in res if "devices_s" in r]
        summary[setup] = statistics.median(times) if times else None
    print("median jax.devices('gpu') in a fresh fork, s: %s" % json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
