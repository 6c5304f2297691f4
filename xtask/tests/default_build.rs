//! xtask's default build (`cargo xtask …`) leaves the MetaX backend out: the default job
//! trains on the CPU, and a first build should not compile CubeCL. What needs the backend
//! says how to get it. CI runs this file on the default build (`cargo test -p xtask --test
//! default_build`); in a build with `--features metax` (the workspace's) it is ignored.

mod common;

use std::process::Command;

use common::{EXE, text};

#[test]
#[cfg_attr(
    feature = "metax",
    ignore = "checks the default build, without --features metax; this build has it"
)]
fn metax_devices_and_backends_name_the_build_that_has_them() {
    for device in ["metax-emu", "metax"] {
        let o = Command::new(EXE)
            .args(["train-qwen3", "--device", device, "--steps", "1", "--quiet"])
            .output()
            .expect("xtask");
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(
            t.contains(&format!("--device {device} needs xtask built with the MetaX backend"))
                && t.contains("cargo xtask-metax train-qwen3"),
            "{t}"
        );
    }
    let o = Command::new(EXE).args(["conformance", "--backend", "metax-emu"]).output().expect("xtask");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "{t}");
    assert!(
        t.contains("backend metax-emu: not available in this build") && t.contains("--features metax"),
        "{t}"
    );
    // The default job itself runs.
    let out = common::scratch("default-build");
    let o = Command::new(EXE)
        .args(["train-qwen3", "--steps", "2", "--quiet", "--out-dir", out.to_str().expect("utf-8")])
        .output()
        .expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics").lines().count(), 2);
}
