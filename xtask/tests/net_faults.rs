//! Network faults (issue #44): a multi-process job (`--launcher env`, one process per rank)
//! whose ranks live in network namespaces of their own, each joined to this test's namespace
//! by a veth pair on test addresses the test creates (198.18.0.0/15, the range set aside for
//! network tests). Rank `k ≥ 1` reaches rank 0 only through a fault-injecting TCP proxy run
//! by the test: latency, loss (a lost segment costs one retransmission timeout, as TCP
//! recovers it), a bandwidth cap. A partition is a link set down; a stalled peer is SIGSTOP.
//!
//! This kernel has no `tc netem`, hence the proxy. The tests need root and iproute2; where
//! the build could not make a network namespace they are reported as ignored, with the
//! reason (`build.rs`, `NETNS_TESTS`).
//!
//! Each test runs the real `xtask` binary, as users do.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{EXE, fixtures, scratch, text};

/// The tests share the machine's two cores and time their peers out: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const RANK0_PORT: u16 = 29500;
const PROXY_PORT: u16 = 29600;

fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("running ip");
    assert!(o.status.success(), "ip {}: {}", args.join(" "), text(&o));
}

// ---------------------------------------------------------------------------------------
// The network.

/// One namespace per rank, rank `k`'s joined to this namespace by a veth pair on
/// 198.18.(base + k).0/24: `.1` here, `.2` in the namespace. Removed on drop.
struct Net {
    names: Vec<String>,
    base: u8,
}

impl Net {
    /// `slot` keeps the tests' subnets apart (16 ranks each).
    fn new(slot: u8, world: usize) -> Net {
        remove_stale_namespaces();
        let pid = std::process::id();
        let base = 16 * slot;
        let names: Vec<String> = (0..world).map(|k| format!("bfsdp-{pid}-{slot}-{k}")).collect();
        let mut net = Net { names: Vec::new(), base };
        for (k, ns) in names.iter().enumerate() {
            ip(&["netns", "add", ns]);
            net.names.push(ns.clone());
            let (host, inner) = (net.host_if(k), format!("bfr{k}"));
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner, "netns", ns]);
            ip(&["addr", "add", &format!("{}/24", net.host_addr(k)), "dev", &host]);
            ip(&["link", "set", &host, "up"]);
            ip(&["-n", ns, "addr", "add", &format!("{}/24", net.ns_addr(k)), "dev", &inner]);
            ip(&["-n", ns, "link", "set", &inner, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// This namespace's end of rank `k`'s link.
    fn host_if(&self, k: usize) -> String {
        format!("bfh{}-{}-{k}", std::process::id() % 100_000, self.base / 16)
    }

    fn host_addr(&self, k: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.base + k as u8, 1)
    }

    fn ns_addr(&self, k: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.base + k as u8, 2)
    }

    /// A partition: rank `k`'s link goes down.
    fn cut(&self, k: usize) {
        ip(&["link", "set", &self.host_if(k), "down"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so the pair.
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

/// Namespaces left by an earlier run of these tests that was killed before its cleanup.
fn remove_stale_namespaces() {
    let Ok(o) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name.strip_prefix("bfsdp-").and_then(|r| r.split('-').next()) else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "delete", name]).output();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The proxy.

/// What the proxy does to each direction of every connection it carries.
#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    /// Added to every segment's delivery (one way).
    latency: Duration,
    /// Probability that a TCP segment (1 448 bytes) is lost. A chunk with lost segments is
    /// delivered `retransmit` late, and everything behind it waits (TCP delivers in order).
    loss: f64,
    /// What a loss costs: with SACK, the segments of one window are resent together after
    /// duplicate ACKs, one round trip later (fast retransmit).
    retransmit: Duration,
    /// Bytes per second, when capped.
    rate: Option<f64>,
}

/// A TCP proxy from `listen` to `upstream`, on threads of this process; stops on drop.
struct Proxy {
    stop: Arc<AtomicBool>,
    /// Segments delivered late as "lost", over all connections.
    lost: Arc<AtomicU64>,
    /// The rank side of every connection it carries.
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Proxy {
    fn start(listen: SocketAddr, upstream: SocketAddr, faults: Faults, seed: u64) -> Proxy {
        let listener = TcpListener::bind(listen).unwrap_or_else(|e| panic!("proxy on {listen}: {e}"));
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicU64::new(0));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (stop2, lost2, conns2) = (stop.clone(), lost.clone(), conns.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop2.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((down, _)) => {
                        n += 1;
                        if let Ok(c) = down.try_clone() {
                            conns2.lock().unwrap_or_else(|p| p.into_inner()).push(c);
                        }
                        let (stop, lost) = (stop2.clone(), lost2.clone());
                        std::thread::spawn(move || carry(down, upstream, faults, seed + n, stop, lost));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Proxy { stop, lost, conns }
    }

    /// Closes both directions of every connection it carries, with the processes at either
    /// end still running: each end reads the end of its stream.
    fn cut_connections(&self) {
        for c in self.conns.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// One connection: waits for rank 0 to listen, then pumps both ways.
fn carry(
    down: TcpStream,
    upstream: SocketAddr,
    f: Faults,
    seed: u64,
    stop: Arc<AtomicBool>,
    lost: Arc<AtomicU64>,
) {
    let _ = down.set_nonblocking(false);
    let start = Instant::now();
    let up = loop {
        match TcpStream::connect(upstream) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(60) && !stop.load(Ordering::SeqCst) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(_) => return,
        }
    };
    for s in [&down, &up] {
        let _ = s.set_nodelay(true);
    }
    let (d2, u2) = (down.try_clone().expect("clone"), up.try_clone().expect("clone"));
    let l2 = lost.clone();
    std::thread::spawn(move || pump(d2, u2, f, seed * 2, l2));
    pump(up, down, f, seed * 2 + 1, lost);
}

/// Copies `from` to `to` with the faults: a reader stamps each chunk with its delivery time
/// (never before the previous one's), a writer delivers at that time, paced by the cap.
fn pump(mut from: TcpStream, to: TcpStream, f: Faults, seed: u64, lost: Arc<AtomicU64>) {
    let (tx, rx) = channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || {
        let mut to = to;
        let mut free_at = Instant::now();
        while let Ok((at, chunk)) = rx.recv() {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            if let Some(rate) = f.rate {
                // The link is busy until the previous chunk has gone out at `rate`.
                let now = Instant::now();
                if free_at > now {
                    std::thread::sleep(free_at - now);
                }
                free_at = free_at.max(now) + Duration::from_secs_f64(chunk.len() as f64 / rate);
            }
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut last = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut at = Instant::now() + f.latency;
        let mut lost_here = 0;
        for _ in 0..n.div_ceil(1448) {
            // xorshift64: a segment is lost with probability `loss`.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            lost_here += u64::from(((rng >> 11) as f64 / (1u64 << 53) as f64) < f.loss);
        }
        if lost_here > 0 {
            at += f.retransmit;
            lost.fetch_add(lost_here, Ordering::Relaxed);
        }
        last = last.max(at);
        if tx.send((last, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.join();
}

// ---------------------------------------------------------------------------------------
// The job.

/// `train-qwen3` on the tiny-b fixture (12 rows a step: 4 per rank at W = 3).
fn tiny_b(out: &Path, extra: &[&str]) -> Vec<String> {
    let fx = fixtures().join("qwen3-tiny-b");
    let mut v = vec!["train-qwen3".to_owned(), "--checkpoint".to_owned(), fx.display().to_string()];
    v.push("--batches".into());
    v.push(fx.join("batches.safetensors").display().to_string());
    v.extend(["--quiet", "--out-dir"].iter().map(|s| s.to_string()));
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `train-qwen3 --launcher env` on the built-in tiny model and synthetic data.
fn builtin(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> =
        ["train-qwen3", "--launcher", "env", "--quiet", "--out-dir"].iter().map(|s| s.to_string()).collect();
    v.push(out.display().to_string());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Rank `k` of a `world`-rank job over `net`, in its namespace: rank 0 listens on its own
/// address, the others reach it through their proxy.
fn start_rank(net: &Net, k: usize, world: usize, args: &[String]) -> Child {
    let (addr, port) = if k == 0 { (net.ns_addr(0), RANK0_PORT) } else { (net.host_addr(k), PROXY_PORT) };
    Command::new("ip")
        .args(["netns", "exec", &net.names[k], EXE])
        .args(args)
        .env("RANK", k.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", "0")
        .env("MASTER_ADDR", addr.to_string())
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ip netns exec")
}

/// A proxy for every rank `k ≥ 1` of `net`, to rank 0.
fn proxies(net: &Net, world: usize, faults: Faults) -> Vec<Proxy> {
    let rank0 = SocketAddr::from((net.ns_addr(0), RANK0_PORT));
    (1..world)
        .map(|k| {
            Proxy::start(SocketAddr::from((net.host_addr(k), PROXY_PORT)), rank0, faults, 1000 * k as u64)
        })
        .collect()
}

/// Waits for every rank (at most `limit`), killing what is left after it.
fn wait_all(ranks: Vec<Child>, limit: Duration) -> Vec<(Output, Duration)> {
    let start = Instant::now();
    let mut ranks: Vec<Option<Child>> = ranks.into_iter().map(Some).collect();
    let mut ended: Vec<Option<Duration>> = vec![None; ranks.len()];
    while ended.iter().any(Option::is_none) && start.elapsed() < limit {
        for (c, e) in ranks.iter_mut().zip(&mut ended) {
            if e.is_none() && c.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some()) {
                *e = Some(start.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<usize> = (0..ranks.len()).filter(|k| ended[*k].is_none()).collect();
    for k in &left {
        if let Some(c) = ranks[*k].as_mut() {
            let _ = c.kill();
        }
    }
    let outs: Vec<(Output, Duration)> = ranks
        .iter_mut()
        .zip(&ended)
        .map(|(c, e)| (c.take().expect("child").wait_with_output().expect("output"), e.unwrap_or(limit)))
        .collect();
    assert!(left.is_empty(), "rank(s) {left:?} were still running {limit:?} on (killed): {}", show(&outs));
    outs
}

/// Rank `k`'s one error line (`error: rank k: …`) holds `named`; prints it.
fn assert_error_names(outs: &[(Output, Duration)], k: usize, named: &str) {
    let t = text(&outs[k].0);
    let line = t
        .lines()
        .find(|l| l.starts_with(&format!("error: rank {k}: ")))
        .unwrap_or_else(|| panic!("no error line of rank {k}: {}", show(outs)));
    assert!(line.contains(named), "rank {k} should name `{named}`: {line}");
    println!("{line}");
}

fn show(outs: &[(Output, Duration)]) -> String {
    outs.iter().enumerate().map(|(k, (o, t))| format!("\n--- rank {k} ({t:?}): {}", text(o))).collect()
}

/// `step → (loss, grad norm)` of a metrics file, as exact bits, and the tokens/s of each step.
fn metrics(path: &Path) -> (BTreeMap<u64, (u64, u64)>, Vec<f64>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut bits = BTreeMap::new();
    let mut tps = Vec::new();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("a metrics line");
        let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {l}"));
        bits.insert(v["step"].as_u64().expect("step"), (f("loss").to_bits(), f("grad_norm").to_bits()));
        tps.push(f("tokens_per_sec"));
    }
    (bits, tps)
}

/// Median step time in ms of a run with `tokens` per step, from its tokens/s (step 0, which
/// also starts up, left out).
fn median_step_ms(tps: &[f64], tokens: f64) -> f64 {
    let mut ms: Vec<f64> = tps.iter().skip(1).map(|t| 1000.0 * tokens / t).collect();
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

/// Waits until the job's rank 0 has written `n` metrics lines.
fn wait_for_steps(metrics: &Path, n: usize, ranks: &mut [Child]) {
    let start = Instant::now();
    while std::fs::read_to_string(metrics).map_or(0, |t| t.lines().count()) < n {
        for (k, c) in ranks.iter_mut().enumerate() {
            assert!(c.try_wait().expect("wait").is_none(), "rank {k} ended before the fault");
        }
        assert!(start.elapsed() < Duration::from_secs(180), "training never got under way");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A W = 3 job over a fault-free network of `slot` (the built-in tiny model on synthetic data,
/// for as long as it takes), once rank 0 logged 3 steps.
fn training_job(slot: u8, dir: &Path, timeout: u64) -> (Net, Vec<Proxy>, Vec<Child>) {
    let net = Net::new(slot, 3);
    let px = proxies(&net, 3, Faults::default());
    let args = builtin(dir, &["--steps", "100000", "--timeout", &timeout.to_string()]);
    let mut ranks: Vec<Child> = (0..3).map(|k| start_rank(&net, k, 3, &args)).collect();
    wait_for_steps(&dir.join("metrics.jsonl"), 3, &mut ranks);
    (net, px, ranks)
}

/// `step → (loss, grad norm)` as exact bits.
type Bits = BTreeMap<u64, (u64, u64)>;

/// tiny-b's 12 steps at W = 3 on loopback with `launcher` (its ranks on this machine), in
/// `dir/loopback`: the exact losses and grad norms, the tokens/s of each step, the wall time.
fn on_loopback(dir: &Path, launcher: &str) -> (Bits, Vec<f64>, Duration) {
    let lo = dir.join("loopback");
    let start = Instant::now();
    let o = Command::new(EXE)
        .args(tiny_b(&lo, &["--launcher", launcher, "--world-size", "3", "--timeout", "60"]))
        .output()
        .expect("xtask");
    let wall = start.elapsed();
    assert!(o.status.success(), "{}", text(&o));
    let (bits, tps) = metrics(&lo.join("metrics.jsonl"));
    assert_eq!(bits.len(), 12, "tiny-b has 12 steps");
    (bits, tps, wall)
}

fn out_dir(name: &str) -> PathBuf {
    scratch(&format!("net-{name}"))
}

// ---------------------------------------------------------------------------------------
// The tests.

#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn twenty_ms_latency_and_one_percent_loss_train_bit_for_bit_as_on_loopback() {
    let _one = serial();
    let dir = out_dir("latency");
    // Loopback: the env launcher starts the 3 ranks on this machine.
    let (want, lo_tps, lo_wall) = on_loopback(&dir, "env");

    let net = Net::new(0, 3);
    let latency = Duration::from_millis(20);
    let faults = Faults { latency, loss: 0.01, retransmit: 2 * latency, rate: None };
    let px = proxies(&net, 3, faults);
    let out = dir.join("netns");
    let args = tiny_b(&out, &["--launcher", "env", "--timeout", "60"]);
    let start = Instant::now();
    let ranks: Vec<Child> = (0..3).map(|k| start_rank(&net, k, 3, &args)).collect();
    let outs = wait_all(ranks, Duration::from_secs(300));
    let wall = start.elapsed();
    for (k, (o, _)) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {k} failed: {}", show(&outs));
    }
    let (got, tps) = metrics(&out.join("metrics.jsonl"));
    assert_eq!(got, want, "losses and grad norms across the faulty links differ from loopback's");
    let lost: u64 = px.iter().map(|p| p.lost.load(Ordering::Relaxed)).sum();
    let tokens = tokens_per_step();
    println!(
        "W = 3 tiny-b, 12 steps, bit-identical: loopback median step {:.1} ms (run {lo_wall:.1?}); \
         20 ms one-way latency + 1% segment loss ({lost} segments lost, each resent one 40 ms round trip late): \
         median step {:.1} ms (run {wall:.1?})",
        median_step_ms(&lo_tps, tokens),
        median_step_ms(&tps, tokens),
    );
    assert!(lost > 0, "the 1% loss never struck: the test would not test it");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Tokens a step of tiny-b trains on (rows × seq, from its batches' header).
fn tokens_per_step() -> f64 {
    let path = fixtures().join("qwen3-tiny-b/batches.safetensors");
    let bytes = std::fs::read(&path).expect("batches");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("header length")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let shape: Vec<f64> = header["tokens"]["shape"]
        .as_array()
        .expect("tokens shape")
        .iter()
        .map(|d| d.as_f64().expect("dim"))
        .collect();
    shape[1] * (shape[2] - 1.0)
}

#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn a_partition_mid_run_fails_every_rank_within_the_timeout_naming_the_unreachable_rank() {
    let _one = serial();
    let dir = out_dir("partition");
    let timeout = 10;
    let (net, _px, ranks) = training_job(1, &dir, timeout);
    net.cut(2);
    let outs = wait_all(ranks, Duration::from_secs(3 * timeout));
    println!(
        "partition of rank 2's link: the ranks ended after {:?}",
        outs.iter().map(|o| o.1).collect::<Vec<_>>()
    );
    for (k, (o, took)) in outs.iter().enumerate() {
        let t = text(o);
        assert!(!o.status.success(), "rank {k} must fail: {}", show(&outs));
        assert!(!t.contains("panicked"), "rank {k}: {t}");
        // The collective timeout plus its grace (a quarter of it) and a step's time.
        assert!(*took < Duration::from_secs(timeout * 3 / 2 + 3), "rank {k} took {took:?}: {}", show(&outs));
        let named = if k == 2 { "rank 0 is unreachable" } else { "rank(s) [2] did not arrive" };
        assert_error_names(&outs, k, named);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn a_stalled_peer_is_named_by_the_others_and_leaves_its_checkpoints_resumable_bit_for_bit() {
    let _one = serial();
    let dir = out_dir("stall");
    // The uninterrupted run (in-process: the env launcher equals it bit for bit).
    let full = dir.join("full");
    let o = Command::new(EXE).args(tiny_b(&full, &["--world-size", "3"])).output().expect("xtask");
    assert!(o.status.success(), "{}", text(&o));
    let (want, _) = metrics(&full.join("metrics.jsonl"));

    let net = Net::new(2, 3);
    let _px = proxies(&net, 3, Faults::default());
    let timeout = 10;
    let save = dir.join("save");
    let out = dir.join("stalled");
    let save_arg = save.display().to_string();
    let args = tiny_b(
        &out,
        &[
            "--launcher",
            "env",
            "--timeout",
            &timeout.to_string(),
            "--save-dir",
            &save_arg,
            "--save-every",
            "1",
        ],
    );
    let mut ranks: Vec<Child> = (0..3).map(|k| start_rank(&net, k, 3, &args)).collect();
    wait_for_steps(&out.join("metrics.jsonl"), 4, &mut ranks);
    let victim = ranks[2].id().to_string();
    assert!(Command::new("kill").args(["-STOP", &victim]).status().expect("kill").success());
    let stopped = Instant::now();
    // The others: an error naming rank 2 within the timeout (and its grace).
    let mut others: Vec<Child> = ranks.drain(..2).collect();
    let mut victim_child = ranks.pop().expect("rank 2");
    let deadline = Duration::from_secs(timeout * 3 / 2 + 5);
    let mut ended = [None, None];
    while ended.iter().any(Option::is_none) && stopped.elapsed() < deadline {
        for (c, e) in others.iter_mut().zip(&mut ended) {
            if e.is_none() && c.try_wait().expect("wait").is_some() {
                *e = Some(stopped.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-CONT", &victim]).status().expect("kill").success());
    if ended.iter().any(Option::is_none) {
        for c in others.iter_mut().chain([&mut victim_child]) {
            let _ = c.kill();
        }
        panic!("ranks 0 and 1 did not end within {deadline:?} of rank 2's SIGSTOP: {ended:?}");
    }
    let mut outs: Vec<(Output, Duration)> = others
        .into_iter()
        .zip(ended)
        .map(|(c, e)| (c.wait_with_output().expect("output"), e.unwrap_or(deadline)))
        .collect();
    outs.extend(wait_all(vec![victim_child], Duration::from_secs(30)));
    println!(
        "SIGSTOP of rank 2: ranks 0 and 1 ended after {:?} (timeout {timeout} s)",
        [outs[0].1, outs[1].1]
    );
    for (k, (o, _)) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {k} must fail: {}", show(&outs));
        assert_error_names(&outs, k, "rank(s) [2] did not arrive");
    }
    // After SIGCONT rank 2 ended too; whatever it wrote on its way out, the save directory
    // resumes from its latest complete checkpoint and trains on bit for bit.
    let resumed = dir.join("resumed");
    let o = Command::new(EXE)
        .args(tiny_b(&resumed, &["--world-size", "3", "--resume", &save_arg]))
        .output()
        .expect("xtask");
    assert!(o.status.success(), "resume after the stall: {}", text(&o));
    let (got, _) = metrics(&resumed.join("metrics.jsonl"));
    assert!(!got.is_empty() && got.keys().next() >= Some(&1), "resumed from step {:?}", got.keys().next());
    for (step, m) in &got {
        assert_eq!(Some(m), want.get(step), "step {step} after resuming differs from the uninterrupted run");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn a_one_gbit_link_completes_and_prefetch_overlaps_its_transfers() {
    let _one = serial();
    let dir = out_dir("gbit");
    let net = Net::new(3, 3);
    let faults = Faults { rate: Some(1e9 / 8.0), ..Faults::default() };
    let _px = proxies(&net, 3, faults);
    // The built-in tiny model (0.7 M parameters): each step moves megabytes through rank 0.
    let run = |name: &str, extra: &[&str]| {
        let mut args = builtin(&dir.join(name), &["--steps", "6", "--timeout", "120"]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = dir.join(name);
        let ranks: Vec<Child> = (0..3).map(|k| start_rank(&net, k, 3, &args)).collect();
        let outs = wait_all(ranks, Duration::from_secs(300));
        for (k, (o, _)) in outs.iter().enumerate() {
            assert!(o.status.success(), "{name}: rank {k} failed: {}", show(&outs));
        }
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).expect("summary"))
                .expect("summary json");
        let (bits, tps) = metrics(&out.join("metrics.jsonl"));
        let mut tps: Vec<f64> = tps.into_iter().skip(1).collect();
        tps.sort_by(f64::total_cmp);
        (bits, tps[tps.len() / 2], summary)
    };
    let (on_bits, on_tps, on) = run("prefetch", &[]);
    let (off_bits, off_tps, _) = run("no-prefetch", &["--no-prefetch"]);
    assert_eq!(on_bits, off_bits, "prefetch changes the results");
    let hidden = &on["collectives_per_step"]["overlap"];
    println!(
        "1 Gbit/s links, W = 3, built-in tiny model: median tokens/s with prefetch {on_tps:.0}, without \
         {off_tps:.0} (prefetch {:.2}× as fast); with prefetch, gathers hidden: forward {} of {}, backward \
         {} of {}; reduce-scatters async: {}",
        on_tps / off_tps,
        hidden["forward_gathers_prefetched"],
        hidden["forward_gathers_prefetched"].as_u64().unwrap_or(0)
            + hidden["forward_gathers_exposed"].as_u64().unwrap_or(0),
        hidden["backward_gathers_prefetched"],
        hidden["backward_gathers_prefetched"].as_u64().unwrap_or(0)
            + hidden["backward_gathers_exposed"].as_u64().unwrap_or(0),
        hidden["async_reduce_scatters"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn a_connection_closed_mid_run_with_both_processes_alive_fails_every_rank_at_once() {
    let _one = serial();
    let dir = out_dir("cut");
    let timeout = 30;
    let (_net, px, ranks) = training_job(4, &dir, timeout);
    // Rank 2's connection (its proxy is the second): no timeout is needed to notice.
    px[1].cut_connections();
    let outs = wait_all(ranks, Duration::from_secs(timeout));
    println!(
        "rank 2's connection closed: the ranks ended after {:?}",
        outs.iter().map(|o| o.1).collect::<Vec<_>>()
    );
    for (k, (o, took)) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {k} must fail: {}", show(&outs));
        assert!(*took < Duration::from_secs(5), "rank {k} took {took:?}: {}", show(&outs));
        let named =
            if k == 2 { "the connection to rank 0 was lost" } else { "rank 2 lost its connection to rank 0" };
        assert_error_names(&outs, k, named);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------
// MPI across namespaces.

/// One namespace per rank and a hub namespace that routes between them: rank `k`'s namespace
/// is joined to the hub by a veth pair on 198.18.(base + k).0/24 (`.1` in the hub, `.2` in the
/// rank's, its default route). For jobs whose ranks connect to each other directly (MPI's TCP
/// transport), not through this process. Forwarding is switched on in the hub only: this
/// machine's own network settings are untouched. Removed on drop.
#[cfg(feature = "mpi")]
struct HubNet {
    hub: String,
    /// Rank `k`'s namespace is this followed by `k`.
    leaf_prefix: String,
    leaves: Vec<String>,
    base: u8,
}

#[cfg(feature = "mpi")]
impl HubNet {
    fn new(slot: u8, world: usize) -> HubNet {
        remove_stale_namespaces();
        let pid = std::process::id();
        let base = 16 * slot;
        let hub = format!("bfsdp-{pid}-{slot}-hub");
        ip(&["netns", "add", &hub]);
        let leaf_prefix = format!("bfsdp-{pid}-{slot}-");
        let mut net = HubNet { hub: hub.clone(), leaf_prefix: leaf_prefix.clone(), leaves: Vec::new(), base };
        ip(&["-n", &hub, "link", "set", "lo", "up"]);
        let forward = Command::new("ip")
            .args(["netns", "exec", &hub, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            .output()
            .expect("ip netns exec");
        assert!(forward.status.success(), "forwarding in the hub: {}", text(&forward));
        for k in 0..world {
            let ns = format!("{leaf_prefix}{k}");
            ip(&["netns", "add", &ns]);
            net.leaves.push(ns.clone());
            let (hub_if, inner) = (format!("bfh{k}"), format!("bfr{k}"));
            ip(&[
                "link", "add", &hub_if, "netns", &hub, "type", "veth", "peer", "name", &inner, "netns", &ns,
            ]);
            let subnet = |host: u8| format!("198.18.{}.{host}/24", base + k as u8);
            ip(&["-n", &hub, "addr", "add", &subnet(1), "dev", &hub_if]);
            ip(&["-n", &hub, "link", "set", &hub_if, "up"]);
            ip(&["-n", &ns, "addr", "add", &subnet(2), "dev", &inner]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &ns, "route", "add", "default", "via", &format!("198.18.{}.1", base + k as u8)]);
        }
        net
    }

    /// The addresses of every link, as one prefix (the 16 subnets of this slot).
    fn prefix(&self) -> String {
        format!("198.18.{}.0/20", self.base)
    }

    /// Bytes rank `k` sent over its link.
    fn sent(&self, k: usize) -> u64 {
        let path = format!("/sys/class/net/bfr{k}/statistics/tx_bytes");
        let o = Command::new("ip")
            .args(["netns", "exec", &self.leaves[k], "cat", &path])
            .output()
            .expect("ip netns exec");
        assert!(o.status.success(), "{path}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().parse().expect("a byte count")
    }
}

#[cfg(feature = "mpi")]
impl Drop for HubNet {
    fn drop(&mut self) {
        for ns in self.leaves.iter().chain([&self.hub]) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

/// `--launcher mpi` with every rank in a network namespace of its own: Open MPI's TCP
/// transport only (no shared memory), so every collective crosses the veth links and the hub's
/// routing. mpirun runs in the hub; each rank is started through `ip netns exec` into its own
/// namespace (a wrapper script reads the rank from `OMPI_COMM_WORLD_RANK`), and reaches
/// mpirun's PMIx server on the hub's address (PMIx listens on loopback by default, which a
/// rank's namespace does not share). Training is bit-identical to the same MPI job on
/// loopback, and each rank sent more than the whole model's bytes over its link.
#[cfg(feature = "mpi")]
#[test]
#[cfg_attr(
    not(netns_tests),
    ignore = "needs root and iproute2 to build network namespaces (set NETNS_TESTS=1 to force)"
)]
fn mpi_ranks_in_namespaces_of_their_own_train_bit_for_bit_as_on_loopback() {
    use std::os::unix::fs::PermissionsExt;

    let _one = serial();
    let dir = out_dir("mpi");
    let (want, lo_tps, lo_wall) = on_loopback(&dir, "mpi");

    let net = HubNet::new(5, 3);
    let wrapper = dir.join("in-rank-namespace.sh");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nexec ip netns exec \"$BFSDP_NS_PREFIX$OMPI_COMM_WORLD_RANK\" \"$@\"\n",
    )
    .expect("wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out = dir.join("netns");
    let mut line: Vec<String> = ["netns", "exec", &net.hub].map(String::from).to_vec();
    line.extend(xtask::launch::mpirun_prefix(None, 3));
    line.extend(["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include"].map(String::from));
    line.push(net.prefix());
    line.extend(["-x", "BFSDP_NS_PREFIX"].map(String::from));
    line.push(wrapper.display().to_string());
    line.push(EXE.to_owned());
    line.extend(tiny_b(&out, &["--launcher", "mpi", "--world-size", "3", "--timeout", "60"]));
    let start = Instant::now();
    let job = Command::new("ip")
        .args(&line)
        .env("BFSDP_NS_PREFIX", &net.leaf_prefix)
        .env("PMIX_MCA_ptl_tcp_remote_connections", "1")
        .env("PMIX_MCA_ptl_tcp_if_include", net.prefix())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ip netns exec mpirun");
    let outs = wait_all(vec![job], Duration::from_secs(300));
    let wall = start.elapsed();
    assert!(outs[0].0.status.success(), "the MPI job across namespaces failed: {}", show(&outs));
    let (got, tps) = metrics(&out.join("metrics.jsonl"));
    assert_eq!(got, want, "losses and grad norms across the namespaces differ from loopback's");

    let model = std::fs::metadata(fixtures().join("qwen3-tiny-b/model.safetensors")).expect("tiny-b").len();
    let sent: Vec<u64> = (0..3).map(|k| net.sent(k)).collect();
    let tokens = tokens_per_step();
    println!(
        "W = 3 tiny-b over MPI, 12 steps, bit-identical: loopback median step {:.1} ms (run {lo_wall:.1?}); \
         one namespace per rank, TCP through the hub: median step {:.1} ms (run {wall:.1?}); \
         bytes sent per rank {sent:?} (the model: {model})",
        median_step_ms(&lo_tps, tokens),
        median_step_ms(&tps, tokens),
    );
    for (k, s) in sent.iter().enumerate() {
        assert!(*s > model, "rank {k} sent {s} bytes over its link, less than the model's {model}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
