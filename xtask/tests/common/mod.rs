//! Helpers shared by the multi-process tests (MPI and the env launcher).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

/// The xtask binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_xtask");

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burn-fsdp-mpi-tests/{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

pub fn tiny_a_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let fx = fixtures().join("qwen3-tiny-a");
    let mut v: Vec<String> = [
        "train-qwen3",
        "--checkpoint",
        fx.to_str().expect("utf-8 path"),
        "--batches",
        fx.join("batches.safetensors").to_str().expect("utf-8 path"),
        "--lr",
        "0.003",
        "--betas",
        "0.9,0.95",
        "--eps",
        "1e-8",
        "--weight-decay",
        "0.1",
        "--quiet",
        "--out-dir",
        out.to_str().expect("utf-8 path"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

pub fn read_metrics(path: &Path) -> (Vec<f64>, Vec<f64>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("metrics line");
            (v["loss"].as_f64().expect("loss"), v["grad_norm"].as_f64().expect("grad_norm"))
        })
        .unzip()
}

pub fn reference(name: &str) -> (Vec<f64>, Vec<f64>) {
    let path = fixtures().join(format!("qwen3-tiny-a/{name}.json"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("fixture json");
    let list = |k: &str| v[k].as_array().expect(k).iter().map(|x| x.as_f64().expect("number")).collect();
    (list("losses"), list("grad_norms"))
}

pub fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "series lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs()).fold(0.0, f64::max)
}

/// Every process below `root` (children, grandchildren, …).
pub fn descendants(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // Fields after the `(comm)`: state, ppid, …
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
        if rest.starts_with('Z') {
            continue;
        }
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) {
            parent_of.push((pid, ppid));
        }
    }
    let mut out = vec![];
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parent_of {
            if pp == p {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}
