//! Tests that run a peer as another user (the Unix-socket rendezvous and fd
//! passing refuse it): this test binary run again as `OTHER_UID`.

#![forbid(unsafe_code)]

/// The uid the tests run a peer as (`nobody`).
pub(crate) const OTHER_UID: u32 = 65534;

/// Whether this process may run a child as another user (it must be root);
/// says so when it may not.
pub(crate) fn can_switch_user(test: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
    if !root {
        println!("{test}: skipped: needs root to run a peer as uid {OTHER_UID}");
    }
    root
}

/// This test binary run again as uid `OTHER_UID`, running only `test`.
pub(crate) fn child_as_other_user(test: &str) -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--ignored", "--test-threads=1", "--nocapture"])
        .uid(OTHER_UID)
        .gid(OTHER_UID)
        .env_remove("XDG_RUNTIME_DIR")
        .env("TMPDIR", "/tmp");
    c
}
