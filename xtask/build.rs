//! Whether this machine can run the network-fault tests (`tests/net_faults.rs`): they build
//! their own network of namespaces joined by veth pairs, which takes root (`CAP_NET_ADMIN`)
//! and iproute2. Where it cannot, they are reported as *ignored, with the reason* in cargo's
//! summary (`#[cfg_attr(not(netns_tests), ignore = "…")]`), never passed.
//!
//! `NETNS_TESTS=1` turns them on and `NETNS_TESTS=0` off; unset, this script probes: `ip` runs,
//! and a network namespace can be made (`unshare --net true`, which leaves nothing behind).

use std::process::{Command, Stdio};

fn succeeds(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn main() {
    println!("cargo::rustc-check-cfg=cfg(netns_tests)");
    println!("cargo::rerun-if-env-changed=NETNS_TESTS");
    println!("cargo::rerun-if-changed=build.rs");
    let on = match std::env::var("NETNS_TESTS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => succeeds("ip", &["-V"]) && succeeds("unshare", &["--net", "true"]),
    };
    if on {
        println!("cargo::rustc-cfg=netns_tests");
    }
}
