//! Crash consistency (issue #44): a W = 3 in-process job saving every step is SIGKILLed at 20
//! points placed by its progress (when a save starts, and a third or two thirds of a step
//! later) — between and inside its saves. Every time, `--resume`
//! of the save directory picks the latest complete checkpoint (a step directory whose
//! `index.json` was not written is never taken) and trains on bit for bit as the uninterrupted
//! run did. The same holds for deterministic crashes inside chosen writes (the `index.json`
//! of a save, one rank's shard; `BURN_FSDP_CRASH_AT`) and for the multi-process launcher, where
//! one rank's process dies and the others must end.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{EXE, fixtures, scratch, text};

const STEPS: &str = "8";

/// `train-qwen3` on the tiny-b fixture (12 rows a step: 4 per rank at W = 3), W = 3.
fn args(out: &Path, extra: &[&str]) -> Vec<String> {
    let fx = fixtures().join("qwen3-tiny-b");
    let mut v: Vec<String> = ["train-qwen3", "--checkpoint"].iter().map(|s| s.to_string()).collect();
    v.push(fx.display().to_string());
    v.push("--batches".into());
    v.push(fx.join("batches.safetensors").display().to_string());
    v.extend(["--world-size", "3", "--steps", STEPS, "--quiet", "--out-dir"].iter().map(|s| s.to_string()));
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}
const KILLS: usize = 20;

/// `step → (loss, grad norm)` of a metrics file, as exact bits.
fn metrics(path: &Path) -> BTreeMap<u64, (u64, u64)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a metrics line");
            let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {l}")).to_bits();
            (v["step"].as_u64().expect("step"), (f("loss"), f("grad_norm")))
        })
        .collect()
}

fn run(dir: &Path, name: &str, extra: &[&str]) -> std::process::Output {
    let out = dir.join(name);
    let metrics = dir.join(format!("{name}.jsonl"));
    let mut args = args(&out, &["--metrics"]);
    args.push(metrics.display().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(EXE).args(&args).output().expect("xtask runs")
}

#[test]
fn sigkill_at_twenty_points_of_a_saving_run_always_resumes_bit_for_bit() {
    let dir = scratch("crash-save");
    // The uninterrupted run, saving every step, timed.
    let save = dir.join("save-full");
    let save_arg = save.display().to_string();
    let start = Instant::now();
    let full = run(&dir, "full", &["--save-dir", &save_arg, "--save-every", "1"]);
    let took = start.elapsed();
    assert!(full.status.success(), "{}", text(&full));
    let want = metrics(&dir.join("full.jsonl"));
    assert_eq!(want.len(), 8);
    // The step directories a full run saves, in order: the kill points are placed by the
    // run's own progress (a step directory appearing), not by the clock, so that a machine
    // busier or idler than during the timed run moves them along with the run.
    let mut step_dirs: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    step_dirs.sort();
    assert_eq!(step_dirs.len(), 8, "{step_dirs:?}");
    let step_time = took / step_dirs.len() as u32;
    let (mut partial_seen, mut resumed_from, mut finished) = (0, Vec::new(), 0);
    for k in 0..KILLS {
        // Kill point k: when the run starts writing save `k % 7` (one of the first seven), and
        // then 0, 1/3 or 2/3 of a step later: inside a save, between saves, inside a step.
        let mark = &step_dirs[k % 7];
        let after = step_time.mul_f64((k / 7) as f64 / 3.0);
        let at = format!("{mark} + {after:?}");
        let save = dir.join(format!("save-{k}"));
        let out = dir.join(format!("killed-{k}"));
        let save_arg = save.display().to_string();
        let argv = args(&out, &["--save-dir", &save_arg, "--save-every", "1"]);
        let mut child =
            Command::new(EXE).args(&argv).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let deadline = Instant::now() + 10 * took + Duration::from_secs(60);
        let mut ended = None;
        while !save.join(mark).exists() {
            if let Ok(Some(status)) = child.try_wait() {
                ended = Some(status);
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("kill {k}: the run never reached {mark}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if ended.is_none() {
            std::thread::sleep(after);
            ended = child.try_wait().ok().flatten();
        }
        if let Some(status) = ended {
            // It finished first; then every step was saved.
            assert!(status.success(), "kill {k}: the run failed on its own");
            finished += 1;
            continue;
        }
        // SIGKILL: no destructor, no flush, mid-write wherever it was.
        let _ = child.kill();
        let _ = child.wait();
        let steps: Vec<_> =
            std::fs::read_dir(&save).into_iter().flatten().flatten().map(|e| e.path()).collect();
        let complete = steps.iter().filter(|p| p.join("index.json").is_file()).count();
        partial_seen += usize::from(complete < steps.len());
        if complete == 0 {
            // Killed before the first save ended: nothing to resume, and nothing taken.
            let r = run(&dir, &format!("resume-{k}"), &["--resume", &save.display().to_string()]);
            assert!(!r.status.success(), "kill {k} at {at}: a resume with no complete checkpoint must fail");
            continue;
        }
        if steps.iter().any(|p| p.ends_with("step-000008") && p.join("index.json").is_file()) {
            // Killed after the last save: nothing left to run (the CLI says so).
            resumed_from.push(8);
            continue;
        }
        let r = run(&dir, &format!("resume-{k}"), &["--resume", &save.display().to_string()]);
        assert!(r.status.success(), "kill {k} at {at}: resume failed: {}", text(&r));
        let got = metrics(&dir.join(format!("resume-{k}.jsonl")));
        let first = *got.keys().next().unwrap_or(&8);
        resumed_from.push(first);
        for (step, m) in &got {
            assert_eq!(Some(m), want.get(step), "kill {k} at {at}: step {step} after resuming differs");
        }
        assert_eq!(got.keys().last(), Some(&7), "kill {k}: the resumed run reached the last step");
    }
    eprintln!(
        "{KILLS} kill points (a run: {took:?}): resumed from steps {resumed_from:?}; {partial_seen} left a step \
         directory without its index (killed inside a save); {finished} runs finished first"
    );
    assert!(finished < KILLS / 2, "most kills must land in the run: {finished} finished first");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a resume from `save` gives: `None` when the directory holds no complete checkpoint
/// (then the resume must fail), else the first step it trained; every step it trained must
/// equal the uninterrupted run's `want`, to the bit.
fn resume_bit_for_bit(
    dir: &Path,
    save: &Path,
    want: &BTreeMap<u64, (u64, u64)>,
    label: &str,
    launcher: &[&str],
) -> Option<u64> {
    let complete = std::fs::read_dir(save)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("index.json").is_file())
        .count();
    let r = run(
        dir,
        &format!("resume-{label}"),
        &[&["--resume", &save.display().to_string()], launcher].concat(),
    );
    if complete == 0 {
        assert!(!r.status.success(), "{label}: a resume with no complete checkpoint must fail");
        return None;
    }
    assert!(r.status.success(), "{label}: resume failed: {}", text(&r));
    let got = metrics(&dir.join(format!("resume-{label}.jsonl")));
    for (step, m) in &got {
        assert_eq!(Some(m), want.get(step), "{label}: step {step} after resuming differs");
    }
    let first = got.keys().next().copied();
    if first.is_some() {
        assert_eq!(got.keys().last(), Some(&7), "{label}: the resumed run reached the last step");
    }
    first
}

/// A step directory whose index is missing holds the half-written temporary index of the
/// crash (or nothing of it): never a file `index.json` with half its bytes.
fn assert_no_partial_index(save: &Path) {
    for e in std::fs::read_dir(save).into_iter().flatten().flatten() {
        let index = e.path().join("index.json");
        if index.is_file() {
            let text = std::fs::read_to_string(&index).expect("index");
            assert!(
                serde_json::from_str::<serde_json::Value>(&text).is_ok(),
                "{}: half-written",
                index.display()
            );
        }
    }
}

#[test]
fn deterministic_crashes_inside_the_index_and_a_shard_write_resume_bit_for_bit() {
    let dir = scratch("crash-points");
    let full = run(&dir, "full", &[]);
    assert!(full.status.success(), "{}", text(&full));
    let want = metrics(&dir.join("full.jsonl"));
    let mut seen = Vec::new();
    // In-process (one process: the crash ends every rank) and with one process per rank
    // (--launcher env: the crashed rank's peers must end too, and the launcher with them).
    for launcher in [&[][..], &["--launcher", "env"][..]] {
        for point in ["index.json#1", "index.json#3", "index.json#6", "rank-00002-of-00003.safetensors#4"] {
            let label = format!("{}-{}", launcher.len(), point.replace('#', "-"));
            let save = dir.join(format!("save-{label}"));
            let save_arg = save.display().to_string();
            let mut args =
                args(&dir.join(&label), &["--save-dir", &save_arg, "--save-every", "1", "--timeout", "20"]);
            args.extend(launcher.iter().map(|s| s.to_string()));
            let start = Instant::now();
            let o = Command::new(EXE).args(&args).env("BURN_FSDP_CRASH_AT", point).output().expect("xtask");
            assert!(!o.status.success(), "{label}: the crash point was never reached: {}", text(&o));
            assert!(start.elapsed().as_secs() < 20, "{label}: the job took {:?} to end", start.elapsed());
            if !launcher.is_empty() {
                assert!(text(&o).contains("the job failed"), "{label}: {}", text(&o));
            }
            assert_no_partial_index(&save);
            let from = resume_bit_for_bit(&dir, &save, &want, &label, launcher);
            seen.push((label, from));
        }
    }
    eprintln!("crash points → first resumed step (None: nothing complete to resume): {seen:?}");
    // index.json#1 leaves nothing complete; #3 leaves the second save; a shard crash in the
    // fourth save leaves the third.
    let firsts: Vec<Option<u64>> = seen.iter().map(|(_, f)| *f).collect();
    assert_eq!(firsts, [None, Some(2), Some(5), Some(3), None, Some(2), Some(5), Some(3)], "{seen:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigkill_of_one_rank_process_at_five_points_resumes_bit_for_bit() {
    let dir = scratch("crash-env");
    let save = dir.join("save-full");
    let save_arg = save.display().to_string();
    let start = Instant::now();
    let full = run(&dir, "full", &["--save-dir", &save_arg, "--save-every", "1", "--launcher", "env"]);
    let took = start.elapsed();
    assert!(full.status.success(), "{}", text(&full));
    let want = metrics(&dir.join("full.jsonl"));
    let mut seen = Vec::new();
    for k in 0..5 {
        let at = took.mul_f64(0.3 + 0.6 * k as f64 / 5.0);
        let save = dir.join(format!("save-{k}"));
        let save_arg = save.display().to_string();
        let argv = args(
            &dir.join(format!("killed-{k}")),
            &["--save-dir", &save_arg, "--save-every", "1", "--launcher", "env", "--timeout", "20"],
        );
        let mut child =
            Command::new(EXE).args(&argv).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(at);
        // The victim: rank k % 3's process, a child of the launcher.
        let victim = common::descendants(child.id()).into_iter().find(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|e| e.split(|b| *b == 0).any(|kv| kv == format!("RANK={}", k % 3).as_bytes()))
        });
        let Some(victim) = victim else {
            // It finished first: every step was saved.
            assert!(child.wait().expect("wait").success(), "kill {k}: the run failed on its own");
            seen.push((k, Some(8)));
            continue;
        };
        let _ = Command::new("kill").args(["-9", &victim.to_string()]).status();
        let ended = Instant::now();
        let status = child.wait().expect("wait");
        assert!(ended.elapsed().as_secs() < 25, "kill {k}: the job took {:?} to end", ended.elapsed());
        let _ = status;
        assert_no_partial_index(&save);
        seen.push((
            k,
            resume_bit_for_bit(&dir, &save, &want, &format!("env-kill-{k}"), &["--launcher", "env"]),
        ));
    }
    eprintln!("SIGKILL of rank k % 3 at 5 points over {took:?} → first resumed step: {seen:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
