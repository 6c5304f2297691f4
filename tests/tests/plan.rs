//! `cargo xtask plan` against measurement (issue #46): the collectives it predicts per rank
//! and step — calls and bytes of every kind, per mesh dimension — equal what `train-qwen3`'s
//! `CommStats` count, exactly, on both fixture models (tied and untied heads, shards even and
//! uneven) over flat FSDP at W = 2, 3, 4, 6, 8, HSDP, data × tensor parallelism, accumulation, bf16,
//! offload and without resharding.
#![allow(clippy::unwrap_used)]

use qwen3_burn::Qwen3Config;
use tests::{fixture, train_args};
use xtask::plan::model::{KINDS, Layout, Mesh, traffic};

/// Runs `train-qwen3` on fixture `case` for two steps with `extra` flags and compares the
/// last step's collectives with the plan of `layout`.
fn check(case: &str, layout: Layout, extra: &[&str]) {
    let config = Qwen3Config::from_file(fixture(&format!("{case}/config.json"))).unwrap();
    let mut argv = vec!["--steps", "2"];
    argv.extend_from_slice(extra);
    let args = train_args(case, &argv);
    let out = args.out_dir.clone().unwrap();
    xtask::train::run(&args).unwrap_or_else(|e| panic!("{case} {extra:?}: {e:#}"));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let measured = &summary["collectives_per_step"];
    let predicted = traffic(&config, &layout);
    let mut dims_seen = 0;
    for (name, m) in measured.as_object().unwrap() {
        if name == "overlap" {
            continue;
        }
        let p = predicted.iter().find(|d| d.name == name);
        for (k, kind) in KINDS.iter().enumerate() {
            let calls = m[*kind].as_u64().unwrap_or_else(|| panic!("no {name}.{kind} in {measured}"));
            let bytes = m["bytes"][*kind].as_u64().unwrap_or_else(|| panic!("no {name}.bytes.{kind}"));
            let (want_calls, want_bytes) = p.map_or((0, 0), |d| (d.traffic.calls[k], d.traffic.bytes[k]));
            assert_eq!(
                (calls, bytes),
                (want_calls, want_bytes),
                "{case} {extra:?}: {name} {kind}: measured (calls, bytes) vs plan"
            );
        }
        dims_seen += usize::from(p.is_some());
    }
    assert_eq!(
        dims_seen,
        predicted.len(),
        "{case} {extra:?}: every planned dimension was measured: {measured}"
    );
    eprintln!("{case} {extra:?}: {} dimension(s), every call and byte as planned", predicted.len());
}

fn layout(mesh: Mesh, rows_per_step: usize, seq: usize) -> Layout {
    Layout::new(mesh, rows_per_step / mesh.data_parallel(), seq)
}

/// tiny-a: tied head, 8 rows × 33 tokens per step, every shard even at W = 2 and 4.
#[test]
fn tiny_a_collectives_are_exactly_as_planned() {
    let l = |mesh| layout(mesh, 8, 33);
    check("qwen3-tiny-a", l(Mesh::Flat(2)), &["--world-size", "2"]);
    check("qwen3-tiny-a", l(Mesh::Flat(4)), &["--world-size", "4"]);
    check("qwen3-tiny-a", l(Mesh::Flat(8)), &["--world-size", "8"]);
    check("qwen3-tiny-a", l(Mesh::Hsdp { replicate: 2, shard: 2 }), &["--hsdp", "2x2"]);
    check("qwen3-tiny-a", l(Mesh::Hsdp { replicate: 2, shard: 4 }), &["--hsdp", "2x4"]);
    check("qwen3-tiny-a", l(Mesh::DpTp { dp: 4, tp: 2 }), &["--mesh", "4x2"]);
    check("qwen3-tiny-a", l(Mesh::DpTp { dp: 2, tp: 2 }), &["--mesh", "2x2"]);
    check(
        "qwen3-tiny-a",
        Layout { grad_accum: 2, ..l(Mesh::DpTp { dp: 2, tp: 2 }) },
        &["--mesh", "2x2", "--grad-accum", "2", "--clip", "1.0"],
    );
    check(
        "qwen3-tiny-a",
        Layout { grad_accum: 2, ..l(Mesh::Flat(4)) },
        &["--world-size", "4", "--grad-accum", "2"],
    );
    check(
        "qwen3-tiny-a",
        Layout { bf16: true, ..l(Mesh::Flat(4)) },
        &["--world-size", "4", "--mixed-precision", "bf16"],
    );
    check("qwen3-tiny-a", Layout { offload: true, ..l(Mesh::Flat(4)) }, &["--world-size", "4", "--offload"]);
    check(
        "qwen3-tiny-a",
        Layout { reshard_after_forward: false, ..l(Mesh::Flat(4)) },
        &["--world-size", "4", "--reshard-after-forward", "false"],
    );
    check(
        "qwen3-tiny-a",
        Layout { activation_checkpointing: true, ..l(Mesh::Flat(2)) },
        &["--world-size", "2", "--activation-checkpointing", "block"],
    );
}

/// tiny-b: untied head, vocabulary 203 and MLP width 100 (uneven shards at W = 3 and 4),
/// 12 rows × 25 tokens per step.
#[test]
fn tiny_b_uneven_shards_collectives_are_exactly_as_planned() {
    let l = |mesh| layout(mesh, 12, 25);
    check("qwen3-tiny-b", l(Mesh::Flat(3)), &["--world-size", "3"]);
    check("qwen3-tiny-b", l(Mesh::Flat(4)), &["--world-size", "4"]);
    check("qwen3-tiny-b", l(Mesh::Flat(6)), &["--world-size", "6"]);
    check("qwen3-tiny-b", l(Mesh::Hsdp { replicate: 2, shard: 3 }), &["--hsdp", "2x3"]);
    check("qwen3-tiny-b", l(Mesh::Hsdp { replicate: 2, shard: 2 }), &["--hsdp", "2x2"]);
    check("qwen3-tiny-b", l(Mesh::DpTp { dp: 2, tp: 2 }), &["--mesh", "2x2"]);
    check("qwen3-tiny-b", l(Mesh::DpTp { dp: 1, tp: 2 }), &["--mesh", "1x2"]);
    check(
        "qwen3-tiny-b",
        Layout { grad_accum: 2, ..l(Mesh::Flat(3)) },
        &["--world-size", "3", "--grad-accum", "2"],
    );
    check(
        "qwen3-tiny-b",
        Layout { bf16: true, ..l(Mesh::Flat(3)) },
        &["--world-size", "3", "--mixed-precision", "bf16"],
    );
}

/// The command's `name: value` lines, and a clear error for a layout the model cannot take.
#[test]
fn plan_prints_the_script_lines_and_refuses_bad_layouts() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: xtask::plan::PlanArgs,
    }
    let parse = |argv: &[&str]| Cli::try_parse_from([&["plan"], argv].concat()).unwrap().plan;
    let c = Qwen3Config::qwen3_8b();
    let args = parse(&["--model", "8b", "--world-size", "64", "--mixed-precision", "bf16"]);
    let (device, e) = (xtask::plan::model::Device::h200(), xtask::plan::model::Efficiency::default());
    let l = Layout { bf16: true, ..layout(Mesh::Flat(64), 128, 4096) };
    let p = xtask::plan::predict(&c, &l, &device, &e);
    let text = xtask::plan::report(&c, &args.model, &p, &device, &e);
    for key in [
        "peak_memory_per_rank_gib: ",
        "between_steps_memory_per_rank_gib: ",
        "comm_bytes_per_rank_per_step: ",
        "predicted_mfu: ",
        "fits: ",
    ] {
        let line =
            text.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no `{key}` line in\n{text}"));
        assert!(!line[key.len()..].trim().is_empty(), "{line}");
    }
    // Eight key/value heads do not split over 16 tensor-parallel ranks.
    let e = xtask::plan::run(&parse(&["--model", "8b", "--mesh", "4x16"])).unwrap_err().to_string();
    assert!(e.contains("key/value heads do not split over tp = 16"), "{e}");
    let e = xtask::plan::run(&parse(&["--model", "/nonexistent/config.json"])).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/config.json"), "{e}");
}

/// docs/scaling.md is what `cargo xtask plan --scaling-table docs/scaling.md` writes.
#[test]
fn docs_scaling_table_is_the_command_s_output() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: xtask::plan::PlanArgs,
    }
    let args = Cli::try_parse_from(["plan", "--scaling-table", "docs/scaling.md"]).unwrap().plan;
    let want = xtask::plan::scaling_table(&args).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/scaling.md");
    let have = std::fs::read_to_string(&path).unwrap();
    assert!(
        have == want,
        "{} is stale: run `cargo xtask plan --scaling-table docs/scaling.md`",
        path.display()
    );
}
