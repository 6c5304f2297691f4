//! Crash consistency (issue #44): a W = 3 in-process job saving every step is SIGKILLed at 20
//! points spread over its run — before, between and inside its saves. Every time, `--resume`
//! of the save directory picks the latest complete checkpoint (a step directory whose
//! `index.json` was not written is never taken) and trains on bit for bit as the uninterrupted
//! run did.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

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
    let (mut partial_seen, mut resumed_from, mut finished) = (0, Vec::new(), 0);
    for k in 0..KILLS {
        // Kill times spread over the run, from a fifth of it (after the first save) to its end.
        let at = took.mul_f64(0.2 + 0.75 * k as f64 / KILLS as f64);
        let save = dir.join(format!("save-{k}"));
        let out = dir.join(format!("killed-{k}"));
        let save_arg = save.display().to_string();
        let argv = args(&out, &["--save-dir", &save_arg, "--save-every", "1"]);
        let mut child =
            Command::new(EXE).args(&argv).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(at);
        if let Ok(Some(status)) = child.try_wait() {
            // Timing: it finished first; then every step was saved.
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
            assert!(
                !r.status.success(),
                "kill {k} at {at:?}: a resume with no complete checkpoint must fail"
            );
            continue;
        }
        if steps.iter().any(|p| p.ends_with("step-000008") && p.join("index.json").is_file()) {
            // Killed after the last save: nothing left to run (the CLI says so).
            resumed_from.push(8);
            continue;
        }
        let r = run(&dir, &format!("resume-{k}"), &["--resume", &save.display().to_string()]);
        assert!(r.status.success(), "kill {k} at {at:?}: resume failed: {}", text(&r));
        let got = metrics(&dir.join(format!("resume-{k}.jsonl")));
        let first = *got.keys().next().unwrap_or(&8);
        resumed_from.push(first);
        for (step, m) in &got {
            assert_eq!(Some(m), want.get(step), "kill {k} at {at:?}: step {step} after resuming differs");
        }
        assert_eq!(got.keys().last(), Some(&7), "kill {k}: the resumed run reached the last step");
    }
    eprintln!(
        "{KILLS} kill points over {took:?}: resumed from steps {resumed_from:?}; {partial_seen} left a step \
         directory without its index (killed inside a save); {finished} runs finished first"
    );
    assert!(finished < KILLS / 2, "most kills must land in the run: {finished} finished first");
    let _ = std::fs::remove_dir_all(&dir);
}
