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
        // Only paths that exist are watched: Cargo counts a missing file as changed on every
        // build, so watching an absent `packed-refs` (a fresh clone may have none) would rebuild
        // this crate every time. A branch kept only in `packed-refs` gets its loose ref file when
        // it next moves, so then its directory is watched instead.
        let mut watched = vec![dir.join("HEAD"), common.join("packed-refs")];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            let loose = common.join(branch);
            match loose.parent() {
                Some(parent) if !loose.exists() => watched.push(parent.to_path_buf()),
                _ => watched.push(loose),
            }
        }
        for path in watched.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
