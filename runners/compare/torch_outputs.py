"""What the PyTorch comparison modules that return whole output tensors share (`torch_kernel_sums`,
`torch_mixers`): checking the outputs against the runner's float64 reference, and the notes
for timings the case limit cut short. Imports torch through `torch_cpu` (None without it)."""
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compare import protocol, torch_cpu  # noqa: E402
else:
    from . import protocol, torch_cpu

torch = torch_cpu.torch


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
    return ["%s timing: %d of %d samples, the %g s case limit stopped sampling"
            % (what, m["samples"], int(tcfg["repeats"]), float(tcfg["case_timeout_s"]))
            for m, what in measurements if m is not None and m["cut_short"]]
