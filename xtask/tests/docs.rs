//! The documentation is true: its links resolve, every error excerpt of the troubleshooting
//! page is produced by the command (or API call) it names, and the getting-started path runs
//! as written.
//!
//! Commands run with `sh` in a fresh directory holding a link to the repository's `tests/`
//! (so relative fixture paths work as from the repository root), with a `cargo` on `PATH`
//! that runs `cargo xtask ARGS` as this build's xtask binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::EXE;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("repository root")
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fresh working directory with `tests/` linked and a `cargo` shim; returns (dir, PATH).
fn sandbox(name: &str) -> (PathBuf, String) {
    let dir = common::scratch(&format!("docs-{name}"));
    std::os::unix::fs::symlink(repo().join("tests"), dir.join("tests")).expect("link tests/");
    let bin = dir.join(".bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let shim = bin.join("cargo");
    std::fs::write(
        &shim,
        format!(
            "#!/bin/sh\n# `cargo xtask ARGS` as the xtask binary under test.\n\
             case \"$1\" in xtask|xtask-metax|xtask-mpi) shift; exec '{EXE}' \"$@\";; esac\n\
             echo \"cargo shim: only 'cargo xtask' runs here: $*\" >&2; exit 2\n"
        ),
    )
    .expect("write shim");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&shim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    (dir, path)
}

/// Runs `script` with `sh -c` in `dir`; returns (success, stdout + stderr).
fn sh(dir: &Path, path: &str, script: &str) -> (bool, String) {
    let o = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("PATH", path)
        .env_remove("QWEN3_TOKENIZER")
        .output()
        .expect("sh");
    (o.status.success(), common::text(&o))
}

/// Whether `text` holds the pieces of `excerpt` (split at `…`) in order.
fn matches_excerpt(text: &str, excerpt: &str) -> bool {
    let mut rest = text;
    for piece in excerpt.split('…').map(str::trim).filter(|p| !p.is_empty()) {
        match rest.find(piece) {
            Some(i) => rest = &rest[i + piece.len()..],
            None => return false,
        }
    }
    true
}

/// The `code` spans of a markdown table cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// Rows of the markdown table that follows `heading` in `text`, as cells.
fn table_after(text: &str, heading: &str) -> Vec<Vec<String>> {
    let start = text.find(heading).unwrap_or_else(|| panic!("no `{heading}` section"));
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            // Cells are split at `|` outside code spans (excerpts may contain `\|`).
            let mut cells = vec![String::new()];
            let mut in_code = false;
            let mut chars = l.trim().trim_matches('|').chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    '\\' if chars.peek() == Some(&'|') => {
                        cells.last_mut().expect("cell").push('|');
                        chars.next();
                    }
                    '`' => {
                        in_code = !in_code;
                        cells.last_mut().expect("cell").push(c);
                    }
                    '|' if !in_code => cells.push(String::new()),
                    _ => cells.last_mut().expect("cell").push(c),
                }
            }
            cells.into_iter().map(|c| c.trim().to_owned()).collect()
        })
        .collect()
}

#[test]
fn every_troubleshooting_excerpt_is_what_its_command_prints() {
    let page = read("docs/troubleshooting.md");
    let rows = table_after(&page, "## Messages of `cargo xtask`");
    assert!(rows.len() >= 10, "the command table has {} rows", rows.len());
    let mut failures = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let (excerpts, commands) = (code_spans(&row[0]), code_spans(&row[1]));
        assert!(
            !excerpts.is_empty() && commands.len() == 1,
            "row {}: one excerpt and one command: {row:?}",
            i + 1
        );
        let (dir, path) = sandbox(&format!("trouble-{i}"));
        let (ok, out) = sh(&dir, &path, &commands[0]);
        if ok {
            failures.push(format!("`{}` succeeded; expected `{}`:\n{out}", commands[0], excerpts[0]));
        }
        for e in &excerpts {
            if !matches_excerpt(&out, e) {
                failures.push(format!("`{}` did not print `{e}`; it printed:\n{out}", commands[0]));
            }
        }
        // Failures are one clean line each: no panic, no backtrace.
        if out.contains("panicked") || out.contains("stack backtrace") {
            failures.push(format!("`{}` panicked:\n{out}", commands[0]));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_library_s_messages_in_troubleshooting_are_the_api_s() {
    let page = read("docs/troubleshooting.md");
    let rows = table_after(&page, "## Messages of the library");
    let produced = api_messages();
    let mut failures = Vec::new();
    for row in &rows {
        for e in code_spans(&row[0]) {
            if !produced.iter().any(|m| matches_excerpt(m, &e)) {
                failures.push(format!("no API call of this test produces `{e}`"));
            }
        }
    }
    assert!(rows.len() >= 5, "the library table has {} rows", rows.len());
    assert!(failures.is_empty(), "{}\nproduced:\n{}", failures.join("\n"), produced.join("\n"));
}

/// The messages the library gives for the situations of the troubleshooting page.
fn api_messages() -> Vec<String> {
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{DType, Tensor};
    use burn_fsdp::{
        DeviceMesh, Fsdp, FsdpConfig, LocalGroup, MixedPrecisionPolicy, ProcessGroup, Tag, launch,
    };
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[derive(Module, Debug)]
    struct Net<B: burn::tensor::backend::Backend> {
        layers: Vec<Linear<B>>,
    }
    type Inner = NdArray<f32>;
    type B = Autodiff<Inner>;
    let net =
        || Net::<B> { layers: (0..2).map(|_| LinearConfig::new(4, 4).init(&Default::default())).collect() };
    let out = Mutex::new(Vec::new());
    let keep = |e: String| {
        out.lock().expect("lock").push(e.clone());
        Err::<(), String>(e)
    };

    // reshard_after_forward without BalancedCheckpointing; bf16 on NdArray.
    let mp = MixedPrecisionPolicy { param_dtype: Some(DType::BF16), ..Default::default() };
    let configs = [
        FsdpConfig { reshard_after_forward: true, ..Default::default() },
        FsdpConfig { reshard_after_forward: false, mp_policy: mp, ..Default::default() },
    ];
    for config in configs {
        let _ = launch(2, Duration::from_secs(20), |g: Arc<LocalGroup>| {
            let mesh = DeviceMesh::<Inner>::new_1d(g, Default::default());
            match Fsdp::wrap(net(), &mesh, config.clone()) {
                Ok(_) => Ok(()),
                Err(e) => keep(e.to_string()),
            }
        });
    }
    let t = || Tensor::<Inner, 1>::zeros([2], &Default::default());
    let gather = |g: &LocalGroup, tag: &str| match g.all_gather(t(), &Tag::new(tag)) {
        Ok(_) => Ok(()),
        Err(e) => keep(e.to_string()),
    };
    // A rank that never arrives.
    let _ = launch(3, Duration::from_millis(300), |g: Arc<LocalGroup>| {
        if g.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900));
            return Ok(());
        }
        gather(&g, "model.layers.0:all-gather")
    });
    // Ranks that disagree on the collective.
    let _ = launch(2, Duration::from_secs(20), |g: Arc<LocalGroup>| {
        gather(&g, if g.rank() == 1 { "model.layers.1:all-gather" } else { "model.layers.0:all-gather" })
    });
    // A rank that fails: its peers' collectives end with the reason.
    let _ = launch(3, Duration::from_secs(20), |g: Arc<LocalGroup>| {
        if g.rank() == 2 {
            return Err("out of memory".to_owned());
        }
        gather(&g, "model.layers.0:all-gather")
    });
    out.into_inner().expect("lock")
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_link_of_the_docs_resolves() {
    let root = repo();
    let mut pages = vec![root.join("README.md"), root.join("burn-metax-backend/README.md")];
    for e in std::fs::read_dir(root.join("docs")).expect("docs/").flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            pages.push(e.path());
        }
    }
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("page");
        for (i, _) in text.match_indices("](") {
            let Some(end) = text[i + 2..].find(')') else { continue };
            let target = &text[i + 2..i + 2 + end];
            if target.starts_with("http") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            checked += 1;
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let resolved =
                if file.is_empty() { page.clone() } else { page.parent().expect("dir").join(file) };
            if !resolved.exists() {
                broken.push(format!("{}: {target} (no such file)", page.display()));
                continue;
            }
            if !anchor.is_empty() {
                let body = std::fs::read_to_string(&resolved).unwrap_or_default();
                let found = body
                    .lines()
                    .filter(|l| l.starts_with('#'))
                    .any(|l| slug(l.trim_start_matches('#')) == anchor);
                if !found {
                    broken.push(format!("{}: {target} (no heading #{anchor})", page.display()));
                }
            }
        }
        // Paths named in code spans that look like repository files must exist too.
        for span in text.split('`').skip(1).step_by(2) {
            if span.starts_with("docs/") && span.ends_with(".md") && !root.join(span).exists() {
                broken.push(format!("{}: `{span}` (no such file)", page.display()));
            }
        }
    }
    assert!(checked >= 15, "only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The shell blocks of a markdown page.
fn sh_blocks(text: &str) -> Vec<String> {
    text.split("```sh\n").skip(1).map(|b| b.split("```").next().unwrap_or_default().to_owned()).collect()
}

#[test]
fn getting_started_runs_as_written() {
    let page = read("docs/getting-started.md");
    let (dir, path) = sandbox("getting-started");
    // Stands in for Qwen3-0.6B (below): Qwen3's vocabulary, tiny everything else.
    let config = qwen3_burn::Qwen3Config {
        vocab_size: 151_936,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 8,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        tie_word_embeddings: true,
    };
    let device = Default::default();
    config.init::<burn::backend::NdArray<f32>>(&device).save(&config, dir.join("vocab-tiny")).expect("save");
    let blocks = sh_blocks(&page);
    assert!(blocks.len() >= 6, "getting-started has {} sh blocks", blocks.len());
    let mut ran = 0;
    for block in &blocks {
        // Step 1 (clone, toolchain) and step 6 (`cargo test`, which is what runs this) are
        // the reader's machine's business; the generate line with a placeholder needs a model.
        if block.contains("git clone") || block.contains("cargo test") {
            continue;
        }
        let mut script = String::from("set -e\n");
        for line in block.lines() {
            if line.contains("--checkpoint DIR") {
                continue;
            }
            // The one step not run here: Qwen3-0.6B needs ~10 GB. The same commands run with a
            // model that has Qwen3's vocabulary and is tiny in everything else.
            script.push_str(&line.replace("--preset 0.6b", "--checkpoint vocab-tiny"));
            script.push('\n');
        }
        let (ok, out) = sh(&dir, &path, &script);
        assert!(ok, "getting-started block failed:\n{block}\noutput:\n{out}");
        assert!(!out.contains("panicked"), "{out}");
        ran += 1;
    }
    assert!(ran >= 4, "ran {ran} blocks");
    // What the page says the runs leave behind.
    let runs: Vec<PathBuf> =
        std::fs::read_dir(dir.join("runs")).expect("runs/").flatten().map(|e| e.path()).collect();
    for file in ["metrics.jsonl", "loss.png", "summary.json"] {
        assert!(runs.iter().any(|r| r.join(file).is_file()), "no runs/<timestamp>/{file}");
    }
    assert!(dir.join("runs/tiny-a-trained/config.json").is_file(), "--export of step 4");
    assert!(dir.join("runs/text-model/model.safetensors").is_file(), "--export of step 5");
    // The tiny models of steps 2–4 are refused by generate, as the page says.
    let (ok, out) = sh(&dir, &path, "cargo xtask generate --checkpoint runs/tiny-a-trained --prompt hi");
    assert!(!ok && out.contains("vocabulary"), "{out}");
}

/// The first fenced block of `lang` after `heading` in `text`.
fn block_after(text: &str, heading: &str, lang: &str) -> String {
    let at = text.find(heading).unwrap_or_else(|| panic!("no section `{heading}`"));
    let rest = &text[at..];
    let start =
        rest.find(&format!("```{lang}\n")).unwrap_or_else(|| panic!("no {lang} block after `{heading}`"));
    let body = &rest[start + lang.len() + 4..];
    body[..body.find("```").expect("an unclosed block")].to_owned()
}

#[test]
fn the_own_crate_copy_paste_builds_and_trains_outside_the_workspace() {
    // docs/user-guide.md's dependency lines and program, as a new crate outside the workspace
    // (its own target directory, the workspace's lock file so that no index is needed).
    let page = read("docs/user-guide.md");
    let heading = "## Use burn-fsdp in your own crate";
    let deps =
        block_after(&page, heading, "toml").replace("<this repository>", &repo().display().to_string());
    let program = block_after(&page, heading, "rust");
    let dir = common::scratch("own-crate");
    std::fs::create_dir_all(dir.join("src")).expect("src");
    let manifest =
        format!("[package]\nname = \"my-trainer\"\nversion = \"0.1.0\"\nedition = \"2024\"\n\n{deps}");
    std::fs::write(dir.join("Cargo.toml"), manifest).expect("Cargo.toml");
    std::fs::write(dir.join("src/main.rs"), &program).expect("main.rs");
    std::fs::copy(repo().join("Cargo.lock"), dir.join("Cargo.lock")).expect("Cargo.lock");
    assert!(program.lines().count() <= 40, "the program grew: {} lines", program.lines().count());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = repo().join("target/own-crate");
    let o = Command::new(cargo)
        .args(["run", "--offline", "--quiet", "--target-dir"])
        .arg(&target)
        .current_dir(&dir)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo run");
    let t = common::text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("loss over both ranks: 3.9301 → 0.0085"), "{t}");
}
