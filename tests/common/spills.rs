//! The compile-and-spill check shared by the GPU test binaries (NVRTC only, no GPU).

/// The kernel file `name` (`src`, prelude included) compiles for sm_90a and sm_80 with
/// exactly `entries` in its PTX, to machine code for sm_90a, and ptxas reports no spill for any
/// entry there (registers printed with `--nocapture`). Ampere's compile stops at PTX
/// ([`ptx_for_ampere`]). Needs NVRTC only, not a GPU.
#[allow(dead_code)] // not every test binary that includes this file calls it
pub fn compiles_without_spills(name: &str, src: &str, entries: &[String]) {
    compiles_without_spills_on(name, src, entries, &[], &["sm_90a", "sm_80"]);
}

/// As [`compiles_without_spills`] for the architectures `archs` (the first must be `sm_90a`,
/// where ptxas reports; `sm_80` is compiled to PTX only), and no wgmma advisory from ptxas for
/// any entry; the entries of `entries` also in `sm90_only` (kernels the source compiles only
/// for sm_90a, behind `__CUDA_ARCH_FEAT_SM90_ALL`) must be absent from every other
/// architecture's PTX. Returns the reports of `entries`.
#[allow(dead_code)] // not every test binary that includes this file calls it
pub fn compiles_without_spills_on(
    name: &str,
    src: &str,
    entries: &[String],
    sm90_only: &[String],
    archs: &[&str],
) -> Vec<kernelpages::gpu::PtxasReport> {
    // SAFETY: only tries to dlopen the library.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    assert!(present, "libnvrtc.so.13 not found on the loader path");
    assert_eq!(archs.first(), Some(&"sm_90a"));
    // One compile per architecture gives the PTX, and for sm_90a the machine code and
    // ptxas's report.
    let mut reports = Vec::new();
    for &arch in archs {
        let text = &if arch == "sm_80" {
            ptx_for_ampere(name, src)
        } else {
            let compiled = kernelpages::gpu::compile_with_report(name, src, arch)
                .unwrap_or_else(|e| panic!("{name} {arch}: {e}"));
            assert!(!compiled.cubin.is_empty(), "{name} {arch}: no machine code");
            if arch == "sm_90a" {
                reports = compiled.reports;
            }
            compiled.ptx
        };
        let mut expected = 0;
        for f in entries {
            let here = arch == "sm_90a" || !sm90_only.contains(f);
            assert_eq!(
                text.contains(&format!(".entry {f}(")),
                here,
                "{f} in the {arch} PTX of {name}: expected {here}"
            );
            expected += usize::from(here);
        }
        assert_eq!(text.matches(".entry ").count(), expected, "{name} {arch}");
    }
    for f in entries {
        let r = reports
            .iter()
            .find(|r| &r.kernel == f)
            .unwrap_or_else(|| panic!("no ptxas report for {f}"));
        eprintln!(
            "{}: {} registers, {} spill bytes",
            r.kernel, r.registers, r.spill_bytes
        );
        assert_eq!(r.spill_bytes, 0, "{r:?}");
        // A wgmma pipeline ptxas had to break (fences injected around the products) runs,
        // but slowly: refused like a spill.
        assert!(r.wgmma_advisories.is_empty(), "{r:?}");
    }
    reports
        .into_iter()
        .filter(|r| entries.contains(&r.kernel))
        .collect()
}

/// The PTX of `src` for Ampere (`compute_80`): NVRTC's front end and NVVM, where an error in
/// the CUDA C shows, without ptxas (about 40 % of an sm_80 compile of the flash kernels on
/// CI's machine). ptxas runs for sm_90a, the device the suites are measured on; the runner on
/// an Ampere GPU compiles for sm_80 through ptxas as usual. Skipping it here keeps CI under
/// ten minutes. NVVM copies inline `asm` into the PTX unchecked, where only ptxas would refuse
/// a Hopper instruction, so the PTX is scanned for them instead ([`hopper_only`]): one left
/// outside its `__CUDA_ARCH__` guard fails here. Panics with NVRTC's log, naming `name`.
#[allow(dead_code)] // not every test binary that includes this file calls it
pub fn ptx_for_ampere(name: &str, src: &str) -> String {
    let ptx = kernelpages::gpu::nvrtc_compile(name, src, "compute_80")
        .unwrap_or_else(|e| panic!("{name} compute_80: {e}"))
        .to_src();
    let found = hopper_only(&ptx);
    assert!(
        found.is_empty(),
        "{name}: sm_90 instructions in the sm_80 PTX: {found:?}"
    );
    ptx
}

/// The lines of `ptx` with an instruction sm_80 does not have (PTX ISA 8: introduced with
/// sm_90): wgmma, setmaxnreg, the bulk (TMA) copies, stmatrix, elect.sync, mbarrier's
/// try_wait and the cluster fence, anything with the `::cluster` scope, and vector
/// reductions and atomics (`red.global.add.v2.f32`).
#[allow(dead_code)] // not every test binary that includes this file calls it
pub fn hopper_only(ptx: &str) -> Vec<&str> {
    const OPS: [&str; 7] = [
        "wgmma.",
        "setmaxnreg.",
        "cp.async.bulk",
        "stmatrix.",
        "elect.sync",
        "mbarrier.try_wait",
        "fence.mbarrier_init",
    ];
    ptx.lines()
        .map(str::trim)
        .filter(|line| {
            // An instruction, after its guard predicate if it has one (`@%p1 wgmma...`).
            let op = match line.strip_prefix('@') {
                Some(rest) => rest
                    .split_once(char::is_whitespace)
                    .map_or("", |x| x.1.trim()),
                None => line,
            };
            let vector = [".v2.", ".v4.", ".v8."].iter().any(|v| op.contains(v));
            OPS.iter().any(|o| op.starts_with(o))
                || op.contains("::cluster")
                || ((op.starts_with("red.") || op.starts_with("atom.")) && vector)
        })
        .collect()
}
