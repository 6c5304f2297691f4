//! Helpers shared by the multi-process tests (MPI and the env launcher).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

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

/// What [`kill_rank_mid_run`] saw.
pub struct Killed {
    /// The launcher's exit status.
    pub status: ExitStatus,
    /// Its stdout and stderr.
    pub text: String,
    /// Time from the kill to the launcher's exit.
    pub after_kill: Duration,
    /// Rank processes still alive half a second after the launcher exited.
    pub orphans: Vec<u32>,
}

/// Starts `train-qwen3 <launcher_args> --world-size 4 --steps 2000 --timeout 20` writing to
/// `out`, waits until training is under way, SIGKILLs the rank process whose rank
/// `rank_of(pid)` says is `victim`, and waits (at most 60 s) for the launcher to exit.
pub fn kill_rank_mid_run(
    out: &Path,
    launcher_args: &[&str],
    rank_of: impl Fn(u32) -> Option<usize>,
    victim: usize,
) -> Killed {
    let mut child: Child = Command::new(EXE)
        .arg("train-qwen3")
        .args(launcher_args)
        .args(["--world-size", "4", "--steps", "2000", "--timeout", "20", "--quiet", "--out-dir"])
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("xtask");
    let metrics = out.join("metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 2 {
        assert!(start.elapsed() < Duration::from_secs(120), "training never started");
        assert!(child.try_wait().expect("wait").is_none(), "the job ended before the kill");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ranks: Vec<u32> = descendants(child.id()).into_iter().filter(|p| rank_of(*p).is_some()).collect();
    assert!(ranks.len() >= 4, "expected 4 rank processes, found {ranks:?}");
    let pid = ranks.iter().copied().find(|p| rank_of(*p) == Some(victim)).expect("the victim's process");
    let killed_at = Instant::now();
    assert!(Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill").success());
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the job did not end within 60 s of the kill");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let after_kill = killed_at.elapsed();
    let o = child.wait_with_output().expect("output");
    std::thread::sleep(Duration::from_millis(500));
    let orphans = ranks
        .iter()
        .copied()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists() && rank_of(*p).is_some())
        .collect();
    Killed { status, text: text(&o), after_kill, orphans }
}
