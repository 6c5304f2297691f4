//! Multi-process FSDP over MPI (`--features mpi`): 4 processes on this machine, loopback only.
//!
//! Each test runs the real `xtask` binary under `mpirun`, as users do.
#![cfg(feature = "mpi")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::*;

fn mpirun(n: usize, args: &[&str]) -> Output {
    let mut line = xtask::launch::mpirun_prefix(None, n);
    line.push(EXE.to_owned());
    line.extend(args.iter().map(|s| s.to_string()));
    Command::new(&line[0]).args(&line[1..]).output().expect("running mpirun")
}

#[test]
fn collectives_match_the_in_process_group_bit_for_bit() {
    let o = mpirun(4, &["mpi-selftest", "--mode", "collectives"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    // 9 dtype × size cases + sub-group + digest check, on each of 4 ranks.
    assert_eq!(t.lines().filter(|l| l.starts_with("ok rank")).count(), 4 * 11, "{t}");
}

#[test]
fn mismatched_collectives_are_an_error_on_every_rank() {
    let o = mpirun(4, &["mpi-selftest", "--mode", "mismatch"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert_eq!(t.matches("expected error: collective mismatch").count(), 4, "{t}");
    assert!(t.contains("rank 1 issued all_gather `layers.1`"), "{t}");
}

#[test]
fn an_aborting_rank_stops_its_peers_at_once() {
    let start = Instant::now();
    let o = mpirun(4, &["mpi-selftest", "--mode", "abort", "--timeout", "60"]);
    let t = text(&o);
    assert!(!o.status.success(), "the job must fail: {t}");
    assert_eq!(t.matches("aborted: rank 1 failed: rank 1 injected a failure").count(), 3, "{t}");
    // Well inside the 60 s collective timeout.
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
}

#[test]
fn a_stalled_rank_makes_the_others_time_out() {
    let start = Instant::now();
    let o = mpirun(4, &["mpi-selftest", "--mode", "stall", "--timeout", "2"]);
    let t = text(&o);
    assert!(!o.status.success(), "the job must fail: {t}");
    assert_eq!(t.matches("did not complete within 2s").count(), 3, "{t}");
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
}

/// The 4-process run reproduces PyTorch FSDP2 (`fsdp4.json`) and equals the in-process run.
fn check_against_in_process(name: &str, extra: &[&str]) {
    let out = scratch(&format!("mpi-{name}-{}", extra.join("")));
    let mut args = tiny_a_args(&out, &["--launcher", "mpi", "--world-size", "4"]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = Command::new(EXE).args(&args).output().expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    let (mpi_loss, mpi_norm) = read_metrics(&out.join("metrics.jsonl"));
    let (ref_loss, ref_norm) = reference(name);
    let (dl, dn) = (max_rel(&mpi_loss, &ref_loss), max_rel(&mpi_norm, &ref_norm));
    println!("{name}: 4 MPI processes vs PyTorch FSDP2: loss {dl:.2e}, grad norm {dn:.2e}");
    assert!(dl < 1e-4 && dn < 1e-4, "loss {dl:e}, grad norm {dn:e}");

    let local_out = scratch(&format!("local-{name}-{}", extra.join("")));
    let mut local = tiny_a_args(&local_out, &["--world-size", "4"]);
    local.extend(extra.iter().map(|s| s.to_string()));
    let o = Command::new(EXE).args(&local).output().expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    let (l_loss, l_norm) = read_metrics(&local_out.join("metrics.jsonl"));
    assert_eq!(mpi_loss, l_loss, "MPI and in-process losses differ");
    assert_eq!(mpi_norm, l_norm, "MPI and in-process grad norms differ");
}

#[test]
fn four_processes_reproduce_pytorch_fsdp2_and_the_in_process_run() {
    check_against_in_process("fsdp4", &[]);
}

#[test]
fn four_processes_with_clipping_and_accumulation() {
    check_against_in_process("fsdp4_clip_accum", &["--clip", "1.0", "--grad-accum", "2"]);
}

#[test]
fn dry_run_prints_the_mpirun_line() {
    let out = scratch("dry");
    let args = tiny_a_args(&out, &["--launcher", "mpi", "--world-size", "4", "--dry-run"]);
    let o = Command::new(EXE).args(&args).output().expect("xtask");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains(" -n 4 ") && t.contains(EXE) && t.contains("--launcher mpi"), "{t}");
    assert!(!t.contains("--dry-run"), "{t}");
    assert!(!out.join("metrics.jsonl").exists(), "--dry-run must not train");
}

#[test]
fn a_world_size_other_than_the_jobs_is_refused() {
    let out = scratch("world");
    let args = tiny_a_args(&out, &["--launcher", "mpi", "--world-size", "4"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = mpirun(2, &args);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("ask for 4 ranks but the MPI job has 2 processes"), "{t}");
}

#[test]
fn a_rank_with_another_model_config_is_refused_at_start_up() {
    let out = scratch("config");
    // MPMD: rank 1 gets another learning rate.
    let a = tiny_a_args(&out, &["--launcher", "mpi"]);
    let b: Vec<String> = a.iter().map(|x| if x == "0.003" { "0.01".to_owned() } else { x.clone() }).collect();
    assert_ne!(a, b);
    let mut line = xtask::launch::mpirun_prefix(None, 1);
    line.push(EXE.to_owned());
    line.extend(a);
    line.extend([":", "-n", "1", EXE].map(String::from));
    line.extend(b);
    let o = Command::new(&line[0]).args(&line[1..]).output().expect("mpirun");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains(
            "rank 1 was started with different flags, model config, weights or data than rank 0, in: --lr;"
        ),
        "{t}"
    );
    assert!(
        !out.join("metrics.jsonl").exists()
            || std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default().is_empty()
    );
}

fn mpi_rank_of(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix("OMPI_COMM_WORLD_RANK=").and_then(|r| r.parse().ok())
    })
}

#[test]
fn killing_one_rank_mid_run_ends_the_job_with_an_error_and_no_orphans() {
    let k = kill_rank_mid_run(&scratch("kill"), &["--launcher", "mpi"], mpi_rank_of, 1);
    assert!(!k.status.success(), "the job must fail: {}", k.text);
    assert!(k.text.contains("the MPI job failed"), "{}", k.text);
    println!("job ended {:?} after the kill", k.after_kill);
    assert!(k.orphans.is_empty(), "orphaned rank processes: {:?}", k.orphans);
}

#[test]
fn two_dimensional_meshes_over_mpi_equal_the_in_process_runs() {
    check_against_in_process("fsdp4", &["--mesh", "2x2"]);
    check_against_in_process("fsdp4_clip_accum", &["--hsdp", "2x2", "--clip", "1.0", "--grad-accum", "2"]);
}
