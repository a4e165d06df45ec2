//! The compile-and-spill check shared by the GPU test binaries (NVRTC only, no GPU).

/// The kernel file `name` (`src`, prelude included) compiles for sm_90a and sm_80 with
/// exactly `entries` in its PTX, to machine code for both, and ptxas reports no spill for any
/// entry on sm_90a (registers printed with `--nocapture`). Needs NVRTC only, not a GPU.
pub fn compiles_without_spills(name: &str, src: &str, entries: &[String]) {
    compiles_without_spills_on(name, src, entries, &["sm_90a", "sm_80"]);
}

/// As [`compiles_without_spills`] for the architectures `archs` (the first must be `sm_90a`,
/// where ptxas reports), and no wgmma advisory from ptxas for any entry; returns the reports of
/// `entries`.
#[allow(dead_code)] // not every test binary that includes this file calls it
pub fn compiles_without_spills_on(
    name: &str,
    src: &str,
    entries: &[String],
    archs: &[&str],
) -> Vec<kernelpages::gpu::PtxasReport> {
    // SAFETY: only tries to dlopen the library.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    assert!(present, "libnvrtc.so.13 not found on the loader path");
    assert_eq!(archs.first(), Some(&"sm_90a"));
    // One compile per architecture gives the PTX, the machine code and ptxas's report.
    let mut reports = Vec::new();
    for &arch in archs {
        let compiled = kernelpages::gpu::compile_with_report(name, src, arch)
            .unwrap_or_else(|e| panic!("{name} {arch}: {e}"));
        let text = &compiled.ptx;
        for f in entries {
            assert!(
                text.contains(&format!(".entry {f}(")),
                "{f} missing from the {arch} PTX of {name}"
            );
        }
        assert_eq!(
            text.matches(".entry ").count(),
            entries.len(),
            "{name} {arch}"
        );
        assert!(!compiled.cubin.is_empty(), "{name} {arch}: no machine code");
        if arch == "sm_90a" {
            reports = compiled.reports;
        }
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
