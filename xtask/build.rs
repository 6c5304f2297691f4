//! Whether this machine can run the network-fault tests (`tests/net_faults.rs`): they build
//! their own network of namespaces joined by veth pairs, which takes root (`CAP_NET_ADMIN`)
//! and iproute2. Where it cannot, they are reported as *ignored, with the reason* in cargo's
//! summary (`#[cfg_attr(not(netns_tests), ignore = "…")]`), never passed.
//!
//! `NETNS_TESTS=1` turns them on and `NETNS_TESTS=0` off; unset, this script probes by doing
//! what the tests do, once: it adds a named network namespace, a veth pair inside it, and
//! deletes the namespace again (which deletes the pair).

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
        _ => {
            let ns = format!("bfsdp-probe-{}", std::process::id());
            let made = succeeds("ip", &["netns", "add", &ns]);
            let veth = made
                && succeeds(
                    "ip",
                    &["-n", &ns, "link", "add", "bfp0", "type", "veth", "peer", "name", "bfp1"],
                );
            if made {
                succeeds("ip", &["netns", "delete", &ns]);
            }
            veth
        }
    };
    if on {
        println!("cargo::rustc-cfg=netns_tests");
    }
}
