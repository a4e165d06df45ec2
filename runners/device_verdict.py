"""The short verdict `device_run.sh` prints last: test results per binary (with the failing
tests), then throughput tables from the runner's documents (TFLOP/s = flops / median time).

    python3 device_verdict.py OUTDIR

Reads OUTDIR/*.tests.log (cargo test output) and OUTDIR/*.json (suite documents); prints at
most ~40 lines. Standard library only (runs on the GPU machine's python3).
"""

import glob
import json
import os
import re
import sys


def tests(out):
    lines = []
    for path in sorted(glob.glob(os.path.join(out, "*.tests.log"))):
        name = os.path.basename(path)[: -len(".tests.log")]
        with open(path, errors="replace") as f:
            text = f.read()
        results = re.findall(r"test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored",
                             text)
        # The harness lists failing tests, indented, after the last "failures:" line.
        failed = []
        if "\nfailures:\n" in text:
            block = text.rsplit("\nfailures:\n", 1)[1]
            for line in block.splitlines():
                if line.startswith("    ") and line.strip():
                    failed.append(line.strip())
                elif failed:
                    break
        if not results:
            lines.append("%-22s no result (timed out or crashed; see %s)" % (name, path))
            continue
        passed = sum(int(r[1]) for r in results)
        nfail = sum(int(r[2]) for r in results)
        ignored = sum(int(r[3]) for r in results)
        verdict = "ok" if nfail == 0 else "FAILED"
        lines.append("%-22s %s: %d passed, %d failed, %d ignored%s" % (
            name, verdict, passed, nfail, ignored,
            (" -- " + ", ".join(failed)) if failed else ""))
        # The first lines of the first few panics: what failed, in the test's own words.
        for m in re.findall(r"panicked at [^\n]*\n([^\n]*(?:\n[^\n]*)?)", text)[:3]:
            kept = [x.strip() for x in m.splitlines() if not x.startswith("stack backtrace")]
            lines.append("    " + " | ".join(kept)[:200])
    return lines


def rows(out):
    found = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        found.extend(doc.get("rows", []))
    return found


def tflops(row):
    if row.get("status") != "ok" or not row.get("median_ms") or not row.get("flops"):
        return None
    return row["flops"] / (row["median_ms"] * 1e-3) / 1e12


def fmt(x):
    return "%6.1f" % x if x is not None else "     -"


def seq_len(case):
    return case.get("seq_len") or case.get("seq_len_q")


def non_aligned(all_rows):
    """flash and math at B1 H24 D64: TFLOP/s at 4092, 4096, 4097 and the loss against 4096."""
    lines = []
    table = {}
    for r in all_rows:
        c = r["case"]
        if (r["implementation"] not in ("flash", "math") or c.get("heads") != 24
                or c.get("head_dim") != 64):
            continue
        if seq_len(c) in (4092, 4096, 4097) and "seq_len" in c:
            table[(r["implementation"], c["pass"], c["causal"], c["seq_len"])] = tflops(r)
    if not table:
        return lines
    lines.append("non-aligned, B1 H24 D64 bf16 (TFLOP/s; loss vs 4096, issue limit 3%):")
    lines.append("  impl  pass     mask      4092   4096   4097   loss4092 loss4097")
    for imp in ("flash", "math"):
        for p in ("fwd", "fwd+bwd"):
            for causal in (False, True):
                a, b, c = (table.get((imp, p, causal, t)) for t in (4092, 4096, 4097))
                if a is None and b is None and c is None:
                    continue
                loss = lambda x: ("%7.1f%%" % (100 * (1 - x / b))) if x and b else "      -"
                lines.append("  %-5s %-8s %-7s %s %s %s %s %s" % (
                    imp, p, "causal" if causal else "full", fmt(a), fmt(b), fmt(c), loss(a),
                    loss(c)))
    return lines


def grouped(all_rows):
    """GQA and MQA cases (heads != kv_heads, one query length): TFLOP/s of flash, flash_sm80,
    cuDNN and FlashAttention-2, and cuDNN's time over flash's (above 1: flash faster)."""
    imps = ("flash", "flash_sm80", "torch_cudnn", "torch_flash")
    table = {}
    for r in all_rows:
        c = r["case"]
        if (r["implementation"] not in imps or "seq_len" not in c or "causal" not in c
                or c.get("kv_heads") in (None, c.get("heads"))):
            continue
        key = (c["batch"], c["heads"], c["kv_heads"], c["seq_len"], c["head_dim"], c["pass"],
               c["causal"])
        table.setdefault(key, {})[r["implementation"]] = r
    if not table:
        return []
    lines = ["grouped heads (TFLOP/s; cuDNN time / flash time):",
             "  shape               pass     mask    " + " ".join("%11s" % i for i in imps)
             + "  cuDNN/flash"]
    for key in sorted(table):
        b, h, kvh, t, d, p, causal = key
        got = table[key]
        cells = " ".join("%11s" % (fmt(tflops(got[i])).strip() if i in got else "")
                         for i in imps)
        ratio = ""
        f, q = got.get("flash"), got.get("torch_cudnn")
        if f and q and tflops(f) and tflops(q):
            ratio = "%.2f" % (q["median_ms"] / f["median_ms"])
        lines.append("  B%d H%d:%d T%d D%d  %-8s %-7s %s  %s" % (
            b, h, kvh, t, d, p, "causal" if causal else "full", cells, ratio))
    return lines


def headline(all_rows):
    """B4 H8 D128 T16384: every implementation, fwd and fwd+bwd."""
    lines = []
    table, imps = {}, []
    for r in all_rows:
        c = r["case"]
        if (c.get("seq_len"), c.get("head_dim"), c.get("batch"), c.get("heads")) != (
                16384, 128, 4, 8) or "causal" not in c:
            # Attention rows only: the sequence mixers' cases share the shape but have no mask.
            continue
        if r["implementation"] not in imps:
            imps.append(r["implementation"])
        acc = r.get("accuracy") or {}
        table[(c["pass"], c["causal"], r["implementation"])] = (tflops(r), acc.get("rel_err"),
                                                                r.get("status"))
    if not table:
        return lines
    lines.append("B4 H8 D128 T16384 bf16 (TFLOP/s/rel_err; notes: FA2 348 fwd, 323 fwd+bwd; "
                 "cuDNN 613, 554):")
    lines.append("  pass     mask    " + " ".join("%12s" % i[:12] for i in imps))
    for p in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            cells = []
            for i in imps:
                t = table.get((p, causal, i))
                if t is None:
                    cells.append("%12s" % "")
                elif t[0] is None:
                    cells.append("%12s" % (t[2] or "?"))
                else:
                    cells.append("%12s" % ("%.1f/%.0e" % (t[0], t[1] or 0)))
            if any(c.strip() for c in cells):
                lines.append("  %-8s %-7s %s" % (p, "causal" if causal else "full",
                                                 " ".join(cells)))
    return lines


def failures(all_rows):
    bad = [r for r in all_rows if r.get("status") not in ("ok", "unsupported")]
    own_unsup = [r for r in all_rows
                 if r.get("status") == "unsupported" and r["implementation"] in ("flash",)
                 and r["case"].get("dtype") != "fp32"]
    lines = ["rows: %d, ok %d, not ok (error/oom/timeout) %d, flash unsupported (not fp32) %d" % (
        len(all_rows), sum(r.get("status") == "ok" for r in all_rows), len(bad), len(own_unsup))]
    for r in (bad + own_unsup)[:6]:
        lines.append("  %s %s %s: %s" % (r["implementation"], r.get("status"),
                                         json.dumps(r["case"], sort_keys=True)[:90],
                                         (r.get("message") or "")[:120]))
    tol = [r for r in all_rows if r.get("status") == "ok" and r.get("accuracy")
           and not r["accuracy"]["rel_err"] <= r["accuracy"]["tolerance"]]
    if tol:
        lines.append("rows over tolerance: %d, e.g. %s %s rel_err %.2e" % (
            len(tol), tol[0]["implementation"], json.dumps(tol[0]["case"], sort_keys=True)[:90],
            tol[0]["accuracy"]["rel_err"]))
    return lines


def cta_orders(out):
    """The wgmma backward's CTA-order probe (cta_order.tests.log): its timing lines, one per
    (shape, order), as the test printed them."""
    path = os.path.join(out, "cta_order.tests.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        found = [line.strip() for line in f if line.startswith("fwd+bwd B")]
    return ["wgmma backward CTA orders (wall clock over 20 calls):"] + ["  " + x for x in found]


def probe_lines(out, log, tag, title):
    """The lines a probe printed with `tag` ("stages", "chunks") before each case (`TAG B...`) in
    OUTDIR/`log`, under `title`: [] when the log is absent. The first such line follows the
    harness's "test NAME ... " on the same line."""
    path = os.path.join(out, log)
    if not os.path.exists(path):
        return []
    marker = tag + " B"
    with open(path, errors="replace") as f:
        found = [line[line.index(marker) + len(tag) + 1:].strip() for line in f if marker in line]
    return [title] + ["  " + x for x in found]


def stages(out):
    """The wgmma backward's stage probe (stages.tests.log): one line per case, the median time of
    each of its kernels over 20 calls, as the test printed them."""
    return probe_lines(out, "stages.tests.log", "stages",
                       "wgmma backward stages (CUDA events, medians of 20 calls):")


def chunks(out):
    """The wgmma backward's chunk probe (chunks.tests.log): one line per (shape, order, chunk
    size), wall clock over 20 calls and the simulated makespan, as the test printed them."""
    return probe_lines(out, "chunks.tests.log", "chunks",
                       "wgmma backward chunk sizes (wall clock over 20 calls):")


def main(out):
    all_rows = rows(out)
    lines = ["==== verdict ===="] + tests(out) + cta_orders(out) + stages(out) + chunks(out)
    if all_rows:
        lines += (non_aligned(all_rows) + grouped(all_rows) + headline(all_rows)
                  + failures(all_rows))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
