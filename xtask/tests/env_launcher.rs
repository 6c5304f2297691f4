//! Multi-process FSDP with `--launcher env`: one process per rank, joined through
//! RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT over TCP, on this machine (loopback).
//!
//! Each test runs the real `xtask` binary, as users do.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::*;

/// `--launcher env` on 4 processes reproduces `name.json` and equals the in-process run.
fn check_against_in_process(name: &str, extra: &[&str]) {
    let out = scratch(&format!("env-{name}-{}", extra.join("")));
    let mut args = tiny_a_args(&out, &["--launcher", "env"]);
    args.extend(extra.iter().map(|s| s.to_string()));
    if !extra.iter().any(|a| *a == "--mesh" || *a == "--hsdp") {
        args.extend(["--world-size".to_owned(), "4".to_owned()]);
    }
    let o = Command::new(EXE).args(&args).output().expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    let (env_loss, env_norm) = read_metrics(&out.join("metrics.jsonl"));
    let (ref_loss, ref_norm) = reference(name);
    let (dl, dn) = (max_rel(&env_loss, &ref_loss), max_rel(&env_norm, &ref_norm));
    println!("{name} {extra:?}: 4 env-launched processes vs PyTorch: loss {dl:.2e}, grad norm {dn:.2e}");
    assert!(dl < 1e-4 && dn < 1e-4, "loss {dl:e}, grad norm {dn:e}");

    let local_out = scratch(&format!("env-local-{name}-{}", extra.join("")));
    let mut local = tiny_a_args(&local_out, extra);
    if !extra.iter().any(|a| *a == "--mesh" || *a == "--hsdp") {
        local.extend(["--world-size".to_owned(), "4".to_owned()]);
    }
    let o = Command::new(EXE).args(&local).output().expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    let (l_loss, l_norm) = read_metrics(&local_out.join("metrics.jsonl"));
    assert_eq!(env_loss, l_loss, "env-launched and in-process losses differ");
    assert_eq!(env_norm, l_norm, "env-launched and in-process grad norms differ");
}

#[test]
fn four_processes_reproduce_pytorch_fsdp2_and_the_in_process_run() {
    check_against_in_process("fsdp4", &[]);
}

#[test]
fn four_processes_with_clipping_accumulation_and_a_2d_mesh() {
    check_against_in_process("fsdp4_clip_accum", &["--clip", "1.0", "--grad-accum", "2"]);
    check_against_in_process("fsdp4", &["--mesh", "2x2"]);
    check_against_in_process("fsdp4_clip_accum", &["--hsdp", "2x2", "--clip", "1.0", "--grad-accum", "2"]);
}

#[test]
fn dry_run_prints_every_ranks_environment_and_command() {
    let out = scratch("env-dry");
    let args = tiny_a_args(&out, &["--launcher", "env", "--world-size", "3", "--dry-run"]);
    let o = Command::new(EXE).args(&args).output().expect("xtask");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 3, "{t}");
    for (r, l) in lines.iter().enumerate() {
        assert!(
            l.starts_with(&format!(
                "RANK={r} WORLD_SIZE=3 LOCAL_RANK={r} MASTER_ADDR=127.0.0.1 MASTER_PORT="
            )),
            "{l}"
        );
        assert!(l.contains("--launcher env") && !l.contains("--dry-run"), "{l}");
    }
    assert!(!out.join("metrics.jsonl").exists());
}

/// Starts one rank by hand, with the environment given.
fn start_rank(env: &[(&str, String)], args: &[String]) -> std::process::Child {
    Command::new(EXE)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("xtask")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port()
}

#[test]
fn ranks_started_with_another_world_size_or_config_are_refused() {
    let out = scratch("env-refuse");
    let port = free_port().to_string();
    let base = tiny_a_args(&out, &["--launcher", "env", "--timeout", "20"]);
    // Rank 1 thinks the job has 3 ranks.
    let r0 =
        start_rank(&[("RANK", "0".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.clone())], &base);
    let r1 = start_rank(&[("RANK", "1".into()), ("WORLD_SIZE", "3".into()), ("MASTER_PORT", port)], &base);
    for c in [r0, r1] {
        let o = c.wait_with_output().expect("wait");
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(t.contains("WORLD_SIZE=3") && t.contains("WORLD_SIZE=2"), "{t}");
    }
    // Rank 1 clips gradients: the digest check refuses it before training, naming the flag.
    let port = free_port().to_string();
    let mut other = base.clone();
    other.extend(["--clip".to_owned(), "1.0".to_owned()]);
    let start = Instant::now();
    let r0 =
        start_rank(&[("RANK", "0".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.clone())], &base);
    let r1 = start_rank(&[("RANK", "1".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port)], &other);
    for c in [r0, r1] {
        let o = c.wait_with_output().expect("wait");
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(t.contains("rank 1 was started with different flags"), "{t}");
        assert!(t.contains("than rank 0, in: --clip;"), "only --clip differs: {t}");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default().is_empty());
}

fn env_rank_of(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix("RANK=").and_then(|r| r.parse().ok())
    })
}

#[test]
fn killing_one_rank_mid_run_ends_the_job_with_an_error_and_no_orphans() {
    let k = kill_rank_mid_run(&scratch("env-kill"), &["--launcher", "env"], env_rank_of, 2);
    assert!(!k.status.success(), "the job must fail: {}", k.text);
    assert!(k.text.contains("the job failed"), "{}", k.text);
    assert!(
        k.text.contains("rank 2 lost its connection"),
        "the survivors should name the dead rank: {}",
        k.text
    );
    assert!(k.text.contains("the job failed: rank 2 was killed by signal 9 first"), "{}", k.text);
    // Each survivor: one clean line naming the step and the lost rank; no panic, no backtrace.
    for r in [0, 1, 3] {
        let line =
            k.text.lines().find(|l| l.starts_with(&format!("error: rank {r}: step "))).unwrap_or_else(|| {
                panic!("no error line of rank {r}: {}", k.text);
            });
        assert!(line.contains("rank 2 lost its connection"), "{line}");
    }
    assert!(!k.text.contains("panicked") && !k.text.contains("backtrace"), "{}", k.text);
    println!("job ended {:?} after the kill", k.after_kill);
    assert!(k.after_kill < Duration::from_secs(20), "not within the collective timeout");
    assert!(k.orphans.is_empty(), "orphaned rank processes: {:?}", k.orphans);
}

#[test]
#[cfg_attr(not(feature = "metax"), ignore = "needs xtask built with the MetaX backend (--features metax)")]
fn a_gpu_job_without_the_gpu_libraries_fails_on_every_rank_with_the_reason() {
    let out = scratch("env-metax");
    let o = Command::new(EXE)
        .args(["train-qwen3", "--device", "metax", "--launcher", "env", "--world-size", "2", "--steps", "1"])
        .args(["--timeout", "20", "--quiet", "--out-dir", out.to_str().expect("utf-8")])
        .env("MACA_PATH", out.join("no-sdk-here"))
        .output()
        .expect("xtask");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    // Rank 0 cannot make the MCCL unique id; rank 1 hears it instead of waiting.
    assert!(
        t.contains("rank 0: --device metax") && t.contains("libmccl.so") && t.contains("MACA_PATH"),
        "{t}"
    );
    // Rank 1 hears that rank 0 failed wherever it is: sharing the unique id, or (when rank 0
    // fails first under load) already in the consistency check before it.
    assert!(
        t.contains("rank 0 failed")
            && (t.contains("rank 1: sharing the unique id") || t.contains("consistency: flags")),
        "{t}"
    );
    let o = Command::new(EXE)
        .args(["train-qwen3", "--device", "metax", "--world-size", "2", "--quiet"])
        .output()
        .expect("xtask");
    assert!(!o.status.success() && text(&o).contains("use --launcher env"), "{}", text(&o));
}
