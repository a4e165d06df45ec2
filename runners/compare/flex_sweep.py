"""How many compiles a seq_len sweep costs PyTorch's `flex_attention` under `torch.compile`, in
one process, as a user's training or serving loop meets the lengths (issue 10: "say how many
compiles a sweep over seq_len costs"; a recompile per length is a known complaint).

One process, fresh Inductor and Triton caches (a new folder, removed afterwards), one
`torch.compile(flex_attention)` with default options, the masks grid's shape (B4 H8 head_dim 128
bf16, square) and modifications (`torch_flex.mods`, built once per mask: the same Python
functions for every length, as a user defines them once). For each mask, the lengths in order:
the block mask (`create_block_mask`), then the first call and `--calls` more; each mask starts
from a fresh dynamo state (`torch._dynamo.reset()`), as a process that meets only that mask. Per (mask,
seq_len) it prints a JSON line: the first call's wall time, the median of the others, their
difference (`compile_s`: dynamo's tracing and Inductor's and Triton's work for this length,
if any), and how many graphs dynamo compiled during the first call (`graphs`, from
`torch._dynamo.utils.counters["stats"]["unique_graphs"]`); a last line per mask sums them and
lists the lengths that compiled.
The project's side of the comparison is the masks grid's own rows: `flex` compiles its
generated source once per (modification, head_dim, dtype), the lengths being kernel
arguments, and reports that compile as every row's `compile_s` (src/attention/flex.rs).

    PYTHONPATH=runners python3 -m compare.flex_sweep [--seq-lens 1024,2048,...] [--masks ...]
        [--device cuda] [--calls 5]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import torch_flex  # noqa: E402
else:
    from . import torch_flex

SEQ_LENS = [1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384]
MASKS = ["causal", "sliding_window(1024)", "prefix_lm(1024)", "alibi", "softcap(30)"]


def sync(device):
    if device == "cuda":
        torch_flex.torch.cuda.synchronize()


def graphs():
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def sweep(masks, seq_lens, device, calls, batch=4, heads=8, head_dim=128):
    """Yields one dict per (mask, seq_len), then one total per mask."""
    torch = torch_flex.torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dtype = torch.bfloat16
    for name in masks:
        # Each mask's sweep starts from a fresh dynamo state (what it learnt about dynamic
        # sizes from an earlier mask would otherwise carry over).
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        # One definition of the modification per mask (square cases: the causal offset is 0
        # at every length), as a user's code would hold it.
        args = {"mask": name, "causal": False, "seq_len_q": 1, "seq_len_kv": 1,
                "heads": heads}
        mask_mod, score_mod, per_batch = torch_flex.mods(args, device)
        if per_batch:
            raise ValueError("mask %s reads the batch index; not swept here" % name)
        total = {"mask": name, "lengths": 0, "graphs": 0, "compile_s": 0.0,
                 "first_call_s": 0.0, "recompiled_lengths": []}
        for t in seq_lens:
            gen = torch.Generator(device="cpu").manual_seed(t)
            q, k, v = (torch.randn(batch, heads, t, head_dim, generator=gen, dtype=torch.float32)
                       .to(device=device, dtype=dtype) for _ in range(3))
            kw = {}
            if score_mod is not None:
                kw["score_mod"] = score_mod
            t0 = time.perf_counter()
            if mask_mod is not None:
                kw["block_mask"] = create_block_mask(mask_mod, None, None, t, t, device=device)
            sync(device)
            mask_s = time.perf_counter() - t0
            g0 = graphs()
            t0 = time.perf_counter()
            out = compiled(q, k, v, **kw)
            sync(device)
            first = time.perf_counter() - t0
            new_graphs = graphs() - g0
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                out = compiled(q, k, v, **kw)
                sync(device)
                times.append(time.perf_counter() - t0)
            if not bool(torch.isfinite(out.float()).all()):
                raise RuntimeError("%s at seq_len %d: a non-finite output" % (name, t))
            median = statistics.median(times)
            row = {"mask": name, "seq_len": t, "block_mask_s": mask_s, "first_call_s": first,
                   "median_call_s": median, "compile_s": max(0.0, first - median),
                   "graphs": new_graphs}
            total["lengths"] += 1
            total["graphs"] += new_graphs
            if new_graphs:
                total["recompiled_lengths"].append(t)
            total["compile_s"] += row["compile_s"]
            total["first_call_s"] += first
            yield row
        yield total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--masks", default=";".join(MASKS),
                   help="modifications separated by ';' (torch_flex's names)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args(argv)
    if torch_flex.torch is None:
        print(json.dumps({"error": "torch is not installed"}))
        return 2
    cache = tempfile.mkdtemp(prefix="kp-flex-sweep-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    try:
        import torch
        import torch._dynamo
        lens = [int(x) for x in a.seq_lens.split(",") if x]
        masks = [m for m in a.masks.split(";") if m]
        env = {"torch": torch.__version__, "device": a.device,
               "recompile_limit": getattr(torch._dynamo.config, "recompile_limit",
                                          getattr(torch._dynamo.config, "cache_size_limit",
                                                  None)),
               "automatic_dynamic_shapes": torch._dynamo.config.automatic_dynamic_shapes}
        print(json.dumps({"setup": env}), flush=True)
        for row in sweep(masks, lens, a.device, a.calls):
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
