//! Records the git commit the binaries are built from (`KP_GIT_COMMIT`), so a runner copied to
//! another machine still reports what it runs. `-dirty` marks uncommitted changes to tracked
//! files. Outside a git checkout nothing is set.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs");
    println!("cargo:rerun-if-changed=.git/index");
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
