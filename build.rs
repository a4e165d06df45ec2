//! Records the git commit the binaries are built from (`KP_GIT_COMMIT`), so a runner copied to
//! another machine still reports what it runs. `-dirty` marks uncommitted changes to tracked
//! files. Outside a git checkout nothing is set.
//!
//! Also tells the tests what this machine can run, as cfg flags, so that a test that cannot run
//! here is compiled as `#[ignore = "why"]` and shows as `ignored` in `cargo test`, never as a
//! silent `ok`:
//! - `kp_cuda`: the CUDA driver library (`libcuda.so.1`) is present (a GPU machine);
//! - `kp_nvrtc`: NVRTC (`libnvrtc.so.13`) is on the loader path;
//! - `kp_chromium`: a Chromium binary is on `PATH`;
//! - `kp_python`: `python3` runs;
//! - `kp_torch`, `kp_jax`, `kp_ott`, `kp_geomloss`: `python3` imports `torch`, `jax`, `ott`
//!   (ott-jax), `geomloss` (on
//!   any device: the CPU comparison modules and the JAX module's CPU test hook need no GPU);
//! - `kp_cxx`: `g++` compiles C++20 with `<ucontext.h>` (the CPU emulation of the
//!   sequence-mixer and MoE kernels, whose CUDA threads are ucontext fibers:
//!   `kernels/sequence_mixers/emulate/cuda_shim.h`).
//!
//! On the GPU machine, run the ignored tests with `cargo test -- --include-ignored` (a binary
//! built elsewhere carries the flags of the machine it was built on).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    println!("cargo:rerun-if-changed=.git/index");
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-env-changed=LD_LIBRARY_PATH");
    println!("cargo:rerun-if-env-changed=PYTHONPATH");
    for flag in [
        "kp_cuda",
        "kp_nvrtc",
        "kp_chromium",
        "kp_python",
        "kp_torch",
        "kp_jax",
        "kp_ott",
        "kp_geomloss",
        "kp_cxx",
    ] {
        println!("cargo::rustc-check-cfg=cfg({flag})");
    }
    if find_library("libcuda.so.1") {
        println!("cargo:rustc-cfg=kp_cuda");
    }
    if find_library("libnvrtc.so.13") {
        println!("cargo:rustc-cfg=kp_nvrtc");
    }
    if ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .any(|b| on_path(b).is_some())
    {
        println!("cargo:rustc-cfg=kp_chromium");
    }
    if Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        println!("cargo:rustc-cfg=kp_python");
        for module in ["torch", "jax", "ott", "geomloss"] {
            if Command::new("python3")
                .args(["-c", &format!("import {module}")])
                .output()
                .is_ok_and(|o| o.status.success())
            {
                println!("cargo:rustc-cfg=kp_{module}");
            }
        }
    }
    if cxx20_fibers() {
        println!("cargo:rustc-cfg=kp_cxx");
    }
    record_commit();
}

/// True when `g++ -std=c++20` compiles and links a program that switches to a ucontext fiber
/// and back (`getcontext`, `makecontext`, `swapcontext`: glibc has them, musl does not), as the
/// emulation shim does; the program is written to `OUT_DIR` and not run.
fn cxx20_fibers() -> bool {
    use std::io::Write;
    let Some(out_dir) = std::env::var_os("OUT_DIR") else {
        return false;
    };
    let exe = Path::new(&out_dir).join("kp_cxx_fiber_check");
    let Ok(mut child) = Command::new("g++")
        .args(["-std=c++20", "-x", "c++", "-", "-o"])
        .arg(&exe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    else {
        return false;
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(
            b"#include <ucontext.h>\n#include <concepts>\n\
              static ucontext_t main_ctx, fiber_ctx; static char stack[65536];\n\
              static void fiber() { swapcontext(&fiber_ctx, &main_ctx); }\n\
              int main() { getcontext(&fiber_ctx); fiber_ctx.uc_stack.ss_sp = stack;\n\
              fiber_ctx.uc_stack.ss_size = sizeof stack; fiber_ctx.uc_link = &main_ctx;\n\
              makecontext(&fiber_ctx, fiber, 0); return swapcontext(&main_ctx, &fiber_ctx); }\n",
        );
    }
    child.wait().is_ok_and(|s| s.success())
}

/// `name` as a file in a folder of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// True when the dynamic loader would find `name`: in `LD_LIBRARY_PATH`, the loader cache, or
/// the usual library folders.
fn find_library(name: &str) -> bool {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/targets/x86_64-linux/lib",
        ]
        .map(PathBuf::from),
    );
    if dirs.iter().any(|d| Path::new(d).join(name).exists()) {
        return true;
    }
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(name))
}

fn record_commit() {
    let Ok(out) = Command::new("git").args(["rev-parse", "HEAD"]).output() else {
        return;
    };
    if !out.status.success() {
        return;
    }
    let mut commit = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    if dirty {
        commit.push_str("-dirty");
    }
    println!("cargo:rustc-env=KP_GIT_COMMIT={commit}");
}
