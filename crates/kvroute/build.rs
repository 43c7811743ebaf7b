//! Sets `KVROUTE_GIT_COMMIT` to the commit being built, when git can say (the reports'
//! provenance); without git or a repository the variable stays unset and reports say null.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let Some(commit) = git(&["rev-parse", "HEAD"]) else {
        return;
    };
    println!("cargo:rustc-env=KVROUTE_GIT_COMMIT={commit}");
    // Build again when HEAD moves: HEAD itself (a checkout), and the branch it names (a commit).
    if let (Some(dir), Some(common)) = (
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--git-common-dir"]),
    ) {
        let dir = PathBuf::from(dir);
        let common = if Path::new(&common).is_absolute() {
            PathBuf::from(common)
        } else {
            std::env::current_dir()
                .map(|d| d.join(&common))
                .unwrap_or_default()
        };
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", common.join(branch).display());
        }
        println!("cargo:rerun-if-changed={}", common.join("packed-refs").display());
    }
}
