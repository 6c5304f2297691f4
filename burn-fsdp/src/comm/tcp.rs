//! Ranks in separate processes or on separate machines, joined through the launcher's
//! environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`: the
//! variables `torchrun` sets) and connected over TCP.
//!
//! [`EnvRank::from_env`] reads the variables; [`TcpGroup::connect`] joins the job: rank 0
//! listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects to it, and rank 0 refuses
//! a rank started with another `WORLD_SIZE` (or a duplicate `RANK`) with an error that names
//! both values. The connection then serves two purposes:
//!
//! - the out-of-band exchange device communicators need before they exist (NCCL's and MCCL's
//!   128-byte unique id): [`TcpGroup::broadcast_bytes`];
//! - a [`ProcessGroup`] on host buffers of any backend, like gloo in PyTorch: every
//!   collective goes through a hub thread in rank 0's process, which checks that all ranks
//!   issued the same collective (kind, tag, dtype, length) and reduces in rank order with the
//!   same loop as [`LocalGroup`](crate::comm::local::LocalGroup) and `MpiGroup` — so the three are
//!   bit-identical. It is simple rather than fast (rank 0 relays every byte); use MPI or a
//!   device communicator for bandwidth.
//!
//! Failures: a rank whose process dies closes its connection, and rank 0 then fails every
//! pending and later collective of every rank with [`CommError::PeerFailed`] naming it; if
//! rank 0 dies, the others see their connection close. A rank that is alive but silent
//! (stalled, or cut off by the network) is named too: a collective that some members have not
//! joined within the timeout of the first one's arrival fails on every rank with
//! [`CommError::Timeout`] listing them, and a rank that rank 0 cannot write to within the
//! timeout is declared unreachable. A rank that hears nothing from rank 0 for the timeout
//! plus a grace (a quarter of it, at most 5 s) fails with `PeerFailed` naming rank 0 as
//! unreachable. [`ProcessGroup::abort`] fails the job for everybody at once.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use burn_fsdp::comm::tcp::{EnvRank, TcpGroup};
//!
//! // Started as `RANK=1 WORLD_SIZE=4 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 my-trainer`.
//! let env = EnvRank::from_env().unwrap().expect("not started by an env launcher");
//! let world = TcpGroup::connect(&env, Duration::from_secs(60)).unwrap();
//! // e.g. NCCL's unique id, made by rank 0 and sent to everybody:
//! let id = world.broadcast_bytes(0, (env.rank == 0).then(|| vec![7u8; 128])).unwrap();
//! assert_eq!(id.len(), 128);
//! ```

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::comm::host::{dtype_code, dtype_of_code, from_bytes, reduce_bytes, to_bytes};
use crate::comm::{CollectiveKind, CommCounters, CommError, CommStats, ProcessGroup, ReduceOp, Tag};

/// `MASTER_PORT` when the variable is not set (as torchrun).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// An invalid or incomplete launcher environment; the message names the variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EnvError(pub String);

/// This process's place in a job, from the launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvRank {
    /// `RANK`: this process's rank in the job.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: the rank on this machine, which picks the device (default: `RANK`).
    pub local_rank: usize,
    /// `MASTER_ADDR`: where rank 0 listens (default `127.0.0.1`).
    pub master_addr: String,
    /// `MASTER_PORT` (default [`DEFAULT_MASTER_PORT`]).
    pub master_port: u16,
}

impl EnvRank {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`.
    ///
    /// `Ok(None)` when neither `RANK` nor `WORLD_SIZE` is set (not started by such a
    /// launcher); an error naming the variable when one is missing or malformed.
    pub fn from_env() -> Result<Option<Self>, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over any variable lookup (for tests and embedding).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, EnvError> {
        let (rank, world) = match (var("RANK"), var("WORLD_SIZE")) {
            (None, None) => return Ok(None),
            (Some(_), None) => return Err(EnvError("RANK is set but WORLD_SIZE is not".into())),
            (None, Some(_)) => return Err(EnvError("WORLD_SIZE is set but RANK is not".into())),
            (Some(r), Some(w)) => (r, w),
        };
        let num = |name: &str, v: &str| -> Result<usize, EnvError> {
            v.trim()
                .parse::<usize>()
                .map_err(|_| EnvError(format!("{name}={v:?} is not a non-negative integer")))
        };
        let rank = num("RANK", &rank)?;
        let world_size = num("WORLD_SIZE", &world)?;
        if world_size == 0 {
            return Err(EnvError("WORLD_SIZE=0: a job needs at least one rank".into()));
        }
        if rank >= world_size {
            return Err(EnvError(format!("RANK={rank} is not below WORLD_SIZE={world_size}")));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", &v)?,
            None => rank,
        };
        let master_addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".to_owned());
        let master_port = match var("MASTER_PORT") {
            Some(v) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| EnvError(format!("MASTER_PORT={v:?} is not a port number")))?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(Self { rank, world_size, local_rank, master_addr, master_port }))
    }
}

// ---------------------------------------------------------------------------------------
// Wire format: frames of `u64 length` + body; bodies start with a message code.

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSED: u8 = 3;
const REQUEST: u8 = 4;
const RESPONSE: u8 = 5;
const FAILED: u8 = 6;
const ABORT: u8 = 7;
const BYE: u8 = 8;
/// The hub's verdict on a round some members did not join within the timeout.
const TIMED_OUT: u8 = 9;
const MAGIC: &[u8; 8] = b"bfsdp-t1";

/// The byte exchange used by `split` and `broadcast_bytes` (not a counted collective).
const EXCHANGE: u8 = 100;

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u64(b.len() as u64);
        s.0.extend_from_slice(b);
        s
    }
}

struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn u8(&mut self) -> Result<u8, String> {
        let (&v, rest) = self.0.split_first().ok_or("truncated message")?;
        self.0 = rest;
        Ok(v)
    }
    fn u64(&mut self) -> Result<u64, String> {
        if self.0.len() < 8 {
            return Err("truncated message".into());
        }
        let (v, rest) = self.0.split_at(8);
        self.0 = rest;
        let mut a = [0u8; 8];
        a.copy_from_slice(v);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = usize::try_from(self.u64()?).map_err(|_| "length overflow")?;
        if self.0.len() < n {
            return Err("truncated message".into());
        }
        let (v, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(v)
    }
    fn string(&mut self) -> Result<String, String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
}

fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    w.write_all(&(body.len() as u64).to_le_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// Writes one frame to `s`, giving up with [`std::io::ErrorKind::TimedOut`] once `limit`
/// has passed (however the kernel splits the writes): a peer whose link is down or that
/// stopped reading cannot hold the writer longer.
fn write_frame_within(s: &TcpStream, body: &[u8], limit: Duration) -> std::io::Result<()> {
    let deadline = Instant::now() + limit;
    let len = (body.len() as u64).to_le_bytes();
    // A small frame goes out in one write (one segment: the socket does not wait to merge).
    let joined: Vec<u8>;
    let parts: [&[u8]; 2] = if body.len() <= 64 << 10 {
        joined = [&len[..], body].concat();
        [&joined, &[]]
    } else {
        [&len, body]
    };
    for part in parts {
        let mut rest = part;
        while !rest.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            s.set_write_timeout(Some(left))?;
            match (&*s).write(rest) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Reads one frame. What a peer declares is not taken on trust: a process that is not a rank
/// (a port scanner, a stale job) sending a huge length costs at most the first 64 MiB until its
/// bytes arrive, and no length above 1 TiB is accepted.
fn read_frame(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    const FIRST: u64 = 64 << 20;
    let invalid = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidData, msg);
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > 1 << 40 {
        return Err(invalid(format!("a frame of {len} bytes declared: not a burn-fsdp rank")));
    }
    let len = usize::try_from(len).map_err(|_| invalid(format!("a frame of {len} bytes: too large here")))?;
    // Allocated in two steps, the whole length only once the first 64 MiB arrived (one copy of
    // them at most).
    let first = len.min(FIRST as usize);
    let mut body = vec![0u8; first];
    r.read_exact(&mut body)?;
    if len > first {
        body.resize(len, 0);
        r.read_exact(&mut body[first..])?;
    }
    Ok(body)
}

/// One collective call as the hub sees it.
#[derive(Debug, Clone)]
struct Request {
    gid: u64,
    seq: u64,
    members: Vec<usize>,
    kind: u8,
    tag: String,
    dtype: u8,
    elems: u64,
    extra: u64,
    data: Vec<u8>,
}

impl Request {
    fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default().u8(REQUEST).u64(self.gid).u64(self.seq).u64(self.members.len() as u64);
        for m in &self.members {
            e = e.u64(*m as u64);
        }
        e.u8(self.kind)
            .bytes(self.tag.as_bytes())
            .u8(self.dtype)
            .u64(self.elems)
            .u64(self.extra)
            .bytes(&self.data)
            .0
    }

    fn decode(d: &mut Dec<'_>) -> Result<Self, String> {
        let gid = d.u64()?;
        let seq = d.u64()?;
        let n = d.u64()? as usize;
        let members = (0..n).map(|_| d.u64().map(|v| v as usize)).collect::<Result<_, _>>()?;
        Ok(Self {
            gid,
            seq,
            members,
            kind: d.u8()?,
            tag: d.string()?,
            dtype: d.u8()?,
            elems: d.u64()?,
            extra: d.u64()?,
            data: d.bytes()?.to_vec(),
        })
    }

    fn describe(&self) -> String {
        let kind = kind_from_code(self.kind).map(|k| k.name()).unwrap_or("exchange");
        format!("{kind} `{}` ({} elements, dtype #{}, arg {})", self.tag, self.elems, self.dtype, self.extra)
    }
}

fn kind_from_code(c: u8) -> Option<CollectiveKind> {
    CollectiveKind::ALL.iter().copied().find(|k| k.index() as u8 == c)
}

// ---------------------------------------------------------------------------------------
// The hub: runs in rank 0's process, matches requests, computes and sends the results.

enum ToHub {
    Frame(usize, Vec<u8>),
    Closed(usize),
}

/// Where the hub sends a rank's messages.
enum Outlet {
    /// A socket, and how long one frame's write may block in all.
    Remote(TcpStream, Duration),
    /// Rank 0's hub to rank 0's link.
    Local(Sender<Vec<u8>>),
    /// Rank 0's link to its hub.
    Hub(Sender<ToHub>),
}

impl Outlet {
    /// Sends one frame; a remote write gives up after the socket's write timeout.
    fn send(&mut self, body: &[u8]) -> std::io::Result<()> {
        let gone = || std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        match self {
            Outlet::Remote(w, limit) => write_frame_within(w, body, *limit),
            Outlet::Local(tx) => tx.send(body.to_vec()).map_err(|_| gone()),
            Outlet::Hub(tx) => tx.send(ToHub::Frame(0, body.to_vec())).map_err(|_| gone()),
        }
    }

    /// Bounds how long a remote frame's write may block.
    fn set_write_limit(&mut self, t: Duration) {
        if let Outlet::Remote(_, limit) = self {
            *limit = t;
        }
    }
}

/// The requests of one collective call received so far.
struct Round {
    /// When the first of them arrived.
    started: Instant,
    slots: Vec<Option<Request>>,
}

struct Hub {
    outlets: Vec<Outlet>,
    rounds: HashMap<(u64, u64), Round>,
    failed: Option<Vec<u8>>,
    left: Vec<bool>,
    /// A round that some members have not joined this long after it started fails the job,
    /// naming them.
    timeout: Duration,
}

fn failed_frame(rank: usize, reason: &str) -> Vec<u8> {
    Enc::default().u8(FAILED).u64(rank as u64).bytes(reason.as_bytes()).0
}

impl Hub {
    fn run(mut self, rx: Receiver<ToHub>) {
        // How often rounds are checked against the timeout.
        let tick = (self.timeout / 20).clamp(Duration::from_millis(10), Duration::from_millis(500));
        loop {
            match rx.recv_timeout(tick) {
                Ok(ToHub::Frame(rank, body)) => self.on_frame(rank, &body),
                Ok(ToHub::Closed(rank)) => {
                    if !self.left[rank] {
                        self.left[rank] = true;
                        self.fail(
                            rank,
                            &format!(
                                "rank {rank} lost its connection to rank 0 (its process died or was killed, or the connection was reset)"
                            ),
                        );
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
            self.check_rounds();
            if self.left.iter().all(|l| *l) {
                return;
            }
        }
    }

    /// Fails the job when a round has waited the timeout for some of its members: they are
    /// stalled, or the network between them and rank 0 is down. Every rank then errors with
    /// [`CommError::Timeout`] naming them.
    fn check_rounds(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let Some(round) = self.rounds.values().find(|r| r.started.elapsed() >= self.timeout) else {
            return;
        };
        let Some(first) = round.slots.iter().flatten().next() else { return };
        let missing: Vec<usize> = round
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_none())
            .filter_map(|(i, _)| first.members.get(i).copied())
            .collect();
        let mut frame = Enc::default().u8(TIMED_OUT).u64(missing.len() as u64);
        for r in &missing {
            frame = frame.u64(*r as u64);
        }
        self.broadcast_failure(frame.0, &missing);
    }

    fn fail(&mut self, rank: usize, reason: &str) {
        self.broadcast_failure(failed_frame(rank, reason), &[rank]);
    }

    /// Sends `frame` to every rank still connected, the `culprits` (which may not be
    /// reading) after the others.
    fn broadcast_failure(&mut self, frame: Vec<u8>, culprits: &[usize]) {
        if self.failed.is_some() {
            return;
        }
        // The other processes first, rank 0's own link last: once rank 0 hears of the failure
        // its process may end, and with it this thread, before a later peer was told. A
        // culprit that stopped reading holds each write for at most a second.
        let n = self.outlets.len();
        let order = (1..n)
            .filter(|r| !culprits.contains(r))
            .chain(culprits.iter().copied().filter(|r| *r != 0 && *r < n))
            .chain(0..n.min(1));
        for r in order {
            if !self.left[r] {
                self.outlets[r].set_write_limit(self.timeout.min(Duration::from_secs(1)));
                let _ = self.outlets[r].send(&frame);
            }
        }
        self.rounds.clear();
        self.failed = Some(frame);
    }

    /// Sends `frame` to rank `r`; a rank that cannot take it within the timeout (its link is
    /// down, or its process stopped reading) fails the job.
    fn send_to(&mut self, r: usize, frame: &[u8]) {
        if self.left[r] {
            return;
        }
        if let Err(e) = self.outlets[r].send(frame) {
            self.left[r] = true;
            let why = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                format!(
                    "rank {r} is unreachable: rank 0 could not send to it within {:?} (the network between them is down, or its process is stalled)",
                    self.timeout
                )
            } else {
                format!("rank {r} lost its connection to rank 0 ({e})")
            };
            self.fail(r, &why);
        }
    }

    fn on_frame(&mut self, rank: usize, body: &[u8]) {
        let mut d = Dec(body);
        match d.u8() {
            Ok(BYE) => self.left[rank] = true,
            Ok(ABORT) => {
                let reason = d.string().unwrap_or_default();
                self.fail(rank, &reason);
            }
            Ok(REQUEST) => match Request::decode(&mut d) {
                Ok(req) => self.on_request(rank, req),
                Err(e) => self.fail(rank, &format!("rank {rank} sent a malformed request: {e}")),
            },
            _ => self.fail(rank, &format!("rank {rank} sent an unknown message")),
        }
    }

    fn on_request(&mut self, rank: usize, req: Request) {
        if let Some(frame) = &self.failed {
            let frame = frame.clone();
            let _ = self.outlets[rank].send(&frame);
            return;
        }
        let Some(pos) = req.members.iter().position(|m| *m == rank) else {
            return self
                .fail(rank, &format!("rank {rank} issued {} in a group it is not in", req.describe()));
        };
        let key = (req.gid, req.seq);
        let round = self
            .rounds
            .entry(key)
            .or_insert_with(|| Round { started: Instant::now(), slots: vec![None; req.members.len()] });
        let slots = &mut round.slots;
        if let Some(first) = slots.iter().flatten().next() {
            let same = first.kind == req.kind
                && first.tag == req.tag
                && first.dtype == req.dtype
                && first.elems == req.elems
                && first.extra == req.extra
                && first.members == req.members;
            if !same {
                let first_rank = first.members[slots.iter().position(|s| s.is_some()).unwrap_or(0)];
                let msg = format!(
                    "collective mismatch at call #{} of the group: rank {rank} issued {}, rank {first_rank} issued {}",
                    req.seq,
                    req.describe(),
                    first.describe()
                );
                return self.fail(rank, &msg);
            }
        }
        if pos >= slots.len() || slots[pos].is_some() {
            return self.fail(rank, &format!("rank {rank} issued call #{} twice", req.seq));
        }
        slots[pos] = Some(req);
        if slots.iter().all(|s| s.is_some()) {
            let reqs: Vec<Request> =
                self.rounds.remove(&key).into_iter().flat_map(|r| r.slots).flatten().collect();
            match complete(&reqs) {
                Ok(results) => {
                    for (i, (req, data)) in reqs.iter().zip(results).enumerate() {
                        let r = req.members[i];
                        let frame = Enc::default().u8(RESPONSE).u64(req.gid).u64(req.seq).bytes(&data).0;
                        self.send_to(r, &frame);
                        if self.failed.is_some() {
                            return;
                        }
                    }
                }
                Err(msg) => self.fail(reqs[0].members[0], &msg),
            }
        }
    }
}

/// The per-member results of a complete round (requests in member order).
fn complete(reqs: &[Request]) -> Result<Vec<Vec<u8>>, String> {
    let w = reqs.len();
    let first = &reqs[0];
    let same = |v: Vec<u8>| vec![v; w];
    if first.kind == EXCHANGE {
        let mut all = Enc::default();
        for r in reqs {
            all = all.bytes(&r.data);
        }
        return Ok(same(all.0));
    }
    let kind = kind_from_code(first.kind).ok_or("unknown collective")?;
    if let Some(r) = reqs.iter().position(|r| r.data.len() != first.data.len()) {
        return Err(format!(
            "{} `{}`: rank {} contributed {} bytes, rank {} {}",
            kind,
            first.tag,
            reqs[r].members[r],
            reqs[r].data.len(),
            first.members[0],
            first.data.len()
        ));
    }
    let reduce = |parts: Vec<&[u8]>| -> Result<Vec<u8>, String> {
        let dtype = dtype_of_code(first.dtype).ok_or("unknown dtype")?;
        let op = match first.extra {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Avg,
            _ => ReduceOp::Max,
        };
        reduce_bytes(&parts, dtype, op).map_err(|e| format!("{kind} `{}`: {e}", first.tag))
    };
    Ok(match kind {
        CollectiveKind::AllGather => same(reqs.iter().flat_map(|r| r.data.iter().copied()).collect()),
        CollectiveKind::AllReduce => same(reduce(reqs.iter().map(|r| r.data.as_slice()).collect())?),
        CollectiveKind::ReduceScatter => {
            let chunk = first.data.len() / w;
            (0..w)
                .map(|k| reduce(reqs.iter().map(|r| &r.data[k * chunk..(k + 1) * chunk]).collect()))
                .collect::<Result<_, _>>()?
        }
        CollectiveKind::Broadcast => {
            let root = first.extra as usize;
            same(reqs.get(root).ok_or("broadcast root outside the group")?.data.clone())
        }
        CollectiveKind::Barrier => same(Vec::new()),
    })
}

// ---------------------------------------------------------------------------------------
// The link: this process's connection to the hub, shared by all its groups.

/// Why this process's collectives fail from now on.
enum Failure {
    /// A rank failed (died, aborted, issued a mismatching collective, could not be reached).
    Peer(usize, String),
    /// The hub waited the timeout for these ranks to join a round.
    Missing(Vec<usize>),
}

#[derive(Default)]
struct Inbox {
    responses: HashMap<(u64, u64), Vec<u8>>,
    failed: Option<Failure>,
    closed: bool,
}

struct Link {
    out: Mutex<Outlet>,
    inbox: Mutex<Inbox>,
    cv: Condvar,
    hub: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
    /// How long past `timeout` a rank waits for the hub's verdict (the hub times a round
    /// from the first request it receives, which may have crossed the network after this
    /// rank's clock started) before it gives up on the hub itself.
    grace: Duration,
    /// Whether the hub is in another process (rank 0's): silence then means rank 0 is
    /// unreachable.
    remote: bool,
}

/// [`Link::grace`] of a job of several ranks.
fn grace(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_secs(5))
}

impl Link {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, body: &[u8]) -> std::io::Result<()> {
        self.out.lock().unwrap_or_else(|p| p.into_inner()).send(body)
    }

    /// Files a message from the hub.
    fn deliver(&self, body: &[u8]) {
        let mut d = Dec(body);
        let mut inbox = self.inbox();
        match d.u8() {
            Ok(RESPONSE) => {
                if let (Ok(gid), Ok(seq), Ok(data)) = (d.u64(), d.u64(), d.bytes()) {
                    inbox.responses.insert((gid, seq), data.to_vec());
                }
            }
            Ok(FAILED) => {
                let rank = d.u64().unwrap_or(0) as usize;
                let reason = d.string().unwrap_or_default();
                inbox.failed.get_or_insert(Failure::Peer(rank, reason));
            }
            Ok(TIMED_OUT) => {
                let n = d.u64().unwrap_or(0).min(1 << 20);
                let missing = (0..n).map_while(|_| d.u64().ok().map(|r| r as usize)).collect();
                inbox.failed.get_or_insert(Failure::Missing(missing));
            }
            _ => {
                inbox.failed.get_or_insert(Failure::Peer(0, "rank 0 sent an unknown message".into()));
            }
        }
        self.cv.notify_all();
    }

    fn hub_lost(&self) {
        self.fail_with(
            "the connection to rank 0 was lost (its process died or was killed, or the connection was reset)",
        );
    }

    fn fail_with(&self, reason: &str) {
        let mut inbox = self.inbox();
        if !inbox.closed {
            inbox.failed.get_or_insert(Failure::Peer(0, reason.into()));
        }
        self.cv.notify_all();
    }

    /// A request could not be sent (`e`): the connection to rank 0 is gone, or nothing
    /// could be written to it within the timeout. What rank 0 sent before it went (most
    /// likely why it went: another rank's failure) may still be on its way through the
    /// reader, which reports the loss itself once it has read everything; give it a moment
    /// before reporting the loss here.
    fn send_failed(&self, e: std::io::Error) {
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(2));
        let mut inbox = self.inbox();
        while inbox.failed.is_none() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            inbox = self.cv.wait_timeout(inbox, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(inbox);
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            self.fail_with(&format!(
                "rank 0 is unreachable: nothing could be sent to it within {:?} (the network between them is down, or its process is stalled)",
                self.timeout
            ));
        } else {
            self.hub_lost();
        }
    }

    /// Waits for the response to `(gid, seq)`.
    fn wait(
        &self,
        key: (u64, u64),
        kind: CollectiveKind,
        tag: &Tag,
        rank: usize,
    ) -> Result<Vec<u8>, CommError> {
        let deadline = Instant::now() + self.timeout + self.grace;
        let mut inbox = self.inbox();
        loop {
            if let Some(data) = inbox.responses.remove(&key) {
                return Ok(data);
            }
            match &inbox.failed {
                Some(Failure::Peer(failed_rank, reason)) => {
                    return Err(CommError::PeerFailed {
                        kind,
                        tag: tag.clone(),
                        rank,
                        failed_rank: *failed_rank,
                        reason: reason.clone(),
                    });
                }
                Some(Failure::Missing(missing)) => {
                    return Err(CommError::Timeout {
                        kind,
                        tag: tag.clone(),
                        rank,
                        missing: missing.clone(),
                        timeout: self.timeout,
                    });
                }
                None => {}
            }
            let now = Instant::now();
            if now >= deadline {
                if !self.remote {
                    return Err(CommError::Stalled { kind, tag: tag.clone(), rank, timeout: self.timeout });
                }
                // The hub would have named the missing ranks by now: it is rank 0 that
                // cannot be heard.
                return Err(CommError::PeerFailed {
                    kind,
                    tag: tag.clone(),
                    rank,
                    failed_rank: 0,
                    reason: format!(
                        "rank 0 is unreachable: no answer from it within {:?} (the network between them is down, or its process is stalled)",
                        self.timeout + self.grace
                    ),
                });
            }
            inbox = self.cv.wait_timeout(inbox, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let failed = {
            let mut inbox = self.inbox();
            inbox.closed = true;
            inbox.failed.is_some()
        };
        let _ = self.send(&[BYE]);
        if let Some(hub) = self.hub.lock().unwrap_or_else(|p| p.into_inner()).take()
            && !failed
        {
            // Rank 0 serves the others' last collectives (sub-groups without rank 0 too):
            // wait until everybody left, but not forever. (After a failure there is nothing
            // left to serve, and an unreachable rank would never leave.)
            let deadline = Instant::now() + self.timeout;
            while !hub.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Outlet::Remote(w, _) = &*self.out.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Start-up.

fn io_err(what: &str, e: impl std::fmt::Display) -> CommError {
    CommError::BadInput {
        kind: CollectiveKind::Barrier,
        tag: Tag::new("connect"),
        rank: 0,
        msg: format!("{what}: {e}"),
    }
}

fn start_error(rank: usize, msg: String) -> CommError {
    CommError::BadInput { kind: CollectiveKind::Barrier, tag: Tag::new("connect"), rank, msg }
}

fn resolve(env: &EnvRank) -> Result<Vec<std::net::SocketAddr>, CommError> {
    let addrs: Vec<_> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| start_error(env.rank, format!("MASTER_ADDR={}: {e}", env.master_addr)))?
        .collect();
    if addrs.is_empty() {
        return Err(start_error(env.rank, format!("MASTER_ADDR={} resolves to no address", env.master_addr)));
    }
    Ok(addrs)
}

fn reader_thread(
    mut stream: BufReader<TcpStream>,
    on_frame: impl Fn(Vec<u8>) + Send + 'static,
    on_close: impl FnOnce() + Send + 'static,
) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("fsdp-tcp-reader".into())
        .spawn(move || {
            while let Ok(frame) = read_frame(&mut stream) {
                on_frame(frame);
            }
            on_close();
        })
        .unwrap_or_else(|e| panic!("cannot start a thread: {e}"))
}

/// Rank 0: accepts the other ranks, checks their hellos and starts the hub.
fn serve(env: &EnvRank, timeout: Duration) -> Result<Arc<Link>, CommError> {
    let addrs = resolve(env)?;
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
        start_error(
            0,
            format!(
                "rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {}:{}: {e}",
                env.master_addr, env.master_port
            ),
        )
    })?;
    listener.set_nonblocking(true).map_err(|e| io_err("listener", e))?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    let mut refusals = Vec::new();
    while peers.iter().skip(1).any(Option::is_none) {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..env.world_size).filter(|r| peers[*r].is_none()).collect();
            let mut msg = format!(
                "rank 0: rank(s) {missing:?} did not connect to {}:{} within {timeout:?}",
                env.master_addr, env.master_port
            );
            for r in &refusals {
                msg.push_str(&format!("; {r}"));
            }
            return Err(start_error(0, msg));
        }
        let (mut stream, _) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(io_err("accepting a rank", e)),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(timeout));
        let Ok(hello) = read_frame(&mut stream) else { continue };
        let mut d = Dec(&hello);
        let ok = d.u8() == Ok(HELLO) && d.bytes().ok() == Some(&MAGIC[..]);
        let (rank, world) = (d.u64().unwrap_or(u64::MAX) as usize, d.u64().unwrap_or(0) as usize);
        let refusal = if !ok {
            Some("a process that is not a burn-fsdp rank connected to MASTER_PORT".to_owned())
        } else if world != env.world_size {
            Some(format!(
                "rank {rank} was started with WORLD_SIZE={world} but rank 0 with WORLD_SIZE={}",
                env.world_size
            ))
        } else if rank == 0 || rank >= env.world_size || peers[rank].is_some() {
            Some(format!("a second process claims RANK={rank}; every rank must be started once"))
        } else {
            None
        };
        match refusal {
            Some(msg) => {
                let _ = write_frame(&mut stream, &Enc::default().u8(REFUSED).bytes(msg.as_bytes()).0);
                if world != env.world_size && ok {
                    return Err(start_error(0, msg));
                }
                refusals.push(msg);
            }
            None => peers[rank] = Some(stream),
        }
    }
    let (hub_tx, hub_rx) = channel::<ToHub>();
    let (own_tx, own_rx) = channel::<Vec<u8>>();
    let mut outlets = vec![Outlet::Local(own_tx)];
    for (rank, stream) in peers.into_iter().enumerate().skip(1) {
        let Some(stream) = stream else { continue };
        let w = stream.try_clone().map_err(|e| io_err("socket", e))?;
        write_frame_within(&w, &[WELCOME], timeout)
            .map_err(|e| io_err(&format!("greeting rank {rank}"), e))?;
        let _ = stream.set_read_timeout(None);
        // A rank whose link is down (or whose process stopped reading) holds a write for at
        // most the timeout; it is then declared unreachable.
        outlets.push(Outlet::Remote(w, timeout));
        let (tx, tx2) = (hub_tx.clone(), hub_tx.clone());
        // Detached: it ends when the peer closes its connection.
        drop(reader_thread(
            BufReader::new(stream),
            move |f| {
                let _ = tx.send(ToHub::Frame(rank, f));
            },
            move || {
                let _ = tx2.send(ToHub::Closed(rank));
            },
        ));
    }
    let hub =
        Hub { outlets, rounds: HashMap::new(), failed: None, left: vec![false; env.world_size], timeout };
    let hub = std::thread::Builder::new()
        .name("fsdp-tcp-hub".into())
        .spawn(move || hub.run(hub_rx))
        .map_err(|e| io_err("starting the hub thread", e))?;
    // Rank 0's own requests enter the hub's queue directly; the hub's answers come back on
    // `own_rx`, which a small thread files like a socket reader would.
    let link = Arc::new(Link {
        out: Mutex::new(Outlet::Hub(hub_tx)),
        inbox: Mutex::default(),
        cv: Condvar::new(),
        hub: Mutex::new(Some(hub)),
        timeout,
        grace: grace(timeout),
        remote: false,
    });
    let weak = Arc::downgrade(&link);
    std::thread::Builder::new()
        .name("fsdp-tcp-inbox".into())
        .spawn(move || {
            while let Ok(f) = own_rx.recv() {
                match weak.upgrade() {
                    Some(link) => link.deliver(&f),
                    None => break,
                }
            }
        })
        .map_err(|e| io_err("starting a thread", e))?;
    Ok(link)
}

/// Ranks ≥ 1: connects to rank 0 (retrying until it listens) and says hello.
fn join(env: &EnvRank, timeout: Duration) -> Result<Arc<Link>, CommError> {
    let addrs = resolve(env)?;
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match TcpStream::connect(&addrs[..]) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(start_error(
                    env.rank,
                    format!(
                        "rank {} could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {}:{} within {timeout:?}: {e}",
                        env.rank, env.master_addr, env.master_port
                    ),
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let _ = stream.set_nodelay(true);
    let hello = Enc::default().u8(HELLO).bytes(MAGIC).u64(env.rank as u64).u64(env.world_size as u64).0;
    write_frame(&mut stream, &hello).map_err(|e| io_err("saying hello to rank 0", e))?;
    let _ = stream.set_read_timeout(Some(timeout));
    let answer = read_frame(&mut stream)
        .map_err(|e| start_error(env.rank, format!("rank {}: no answer from rank 0: {e}", env.rank)))?;
    let mut d = Dec(&answer);
    match d.u8() {
        Ok(WELCOME) => {}
        Ok(REFUSED) => {
            let msg = d.string().unwrap_or_default();
            return Err(start_error(env.rank, format!("rank 0 refused rank {}: {msg}", env.rank)));
        }
        _ => return Err(start_error(env.rank, "rank 0 sent an unknown answer".into())),
    }
    let _ = stream.set_read_timeout(None);
    let writer = stream.try_clone().map_err(|e| io_err("socket", e))?;
    let link = Arc::new(Link {
        out: Mutex::new(Outlet::Remote(writer, timeout)),
        inbox: Mutex::default(),
        cv: Condvar::new(),
        hub: Mutex::new(None),
        timeout,
        grace: grace(timeout),
        remote: true,
    });
    let (w1, w2) = (Arc::downgrade(&link), Arc::downgrade(&link));
    let reader = reader_thread(
        BufReader::new(stream),
        move |f| {
            if let Some(l) = w1.upgrade() {
                l.deliver(&f)
            }
        },
        move || {
            if let Some(l) = w2.upgrade() {
                l.hub_lost()
            }
        },
    );
    // The reader ends when the link shuts the socket down on drop; it is not joined there
    // (it may hold the last reference for a moment), so detach it.
    drop(reader);
    Ok(link)
}

// ---------------------------------------------------------------------------------------
// The group.

/// One rank's handle on a group of processes connected over TCP (see the [module
/// docs](self)).
pub struct TcpGroup {
    link: Arc<Link>,
    /// Global ranks of the members, in group-rank order.
    members: Vec<usize>,
    rank: usize,
    gid: u64,
    seq: Mutex<u64>,
    splits: AtomicU64,
    counters: CommCounters,
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup").field("rank", &self.rank).field("members", &self.members).finish()
    }
}

fn fnv(parts: &[u64]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for b in p.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl TcpGroup {
    /// Joins the job described by `env` as its world group. Returns once every rank has
    /// connected; errors (on every rank) when a rank was started with another `WORLD_SIZE`,
    /// or when rank 0 cannot be reached or not every rank arrives within `timeout`.
    /// `timeout` is also the collective timeout.
    pub fn connect(env: &EnvRank, timeout: Duration) -> Result<Arc<Self>, CommError> {
        let link = if env.world_size == 1 {
            // Nobody to talk to: a link that never sends.
            let (tx, _rx) = channel();
            Arc::new(Link {
                out: Mutex::new(Outlet::Local(tx)),
                inbox: Mutex::default(),
                cv: Condvar::new(),
                hub: Mutex::new(None),
                timeout,
                grace: Duration::ZERO,
                remote: false,
            })
        } else if env.rank == 0 {
            serve(env, timeout)?
        } else {
            join(env, timeout)?
        };
        Ok(Arc::new(Self::with(link, (0..env.world_size).collect(), env.rank, 0)))
    }

    fn with(link: Arc<Link>, members: Vec<usize>, rank: usize, gid: u64) -> Self {
        Self {
            link,
            members,
            rank,
            gid,
            seq: Mutex::new(0),
            splits: AtomicU64::new(0),
            counters: CommCounters::default(),
        }
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.link.timeout
    }

    fn next_seq(&self) -> u64 {
        let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        *s += 1;
        *s
    }

    /// Sends one request (`head` = message code, dtype code, elements, extra argument) and
    /// waits for its answer.
    fn call(
        &self,
        ckind: CollectiveKind,
        tag: &Tag,
        head: (u8, u8, u64, u64),
        data: Vec<u8>,
    ) -> Result<Vec<u8>, CommError> {
        let (kind, dtype, elems, extra) = head;
        let seq = self.next_seq();
        let req = Request {
            gid: self.gid,
            seq,
            members: self.members.clone(),
            kind,
            tag: tag.0.clone(),
            dtype,
            elems,
            extra,
            data,
        };
        if let Err(e) = self.link.send(&req.encode()) {
            self.link.send_failed(e);
        }
        self.link.wait((self.gid, seq), ckind, tag, self.rank)
    }

    /// Every member's `data`, in group-rank order (any lengths).
    fn exchange(&self, data: &[u8], tag: &Tag) -> Result<Vec<Vec<u8>>, CommError> {
        if self.members.len() == 1 {
            return Ok(vec![data.to_vec()]);
        }
        let all = self.call(CollectiveKind::AllGather, tag, (EXCHANGE, 0, 0, 0), data.to_vec())?;
        let mut d = Dec(&all);
        (0..self.members.len())
            .map(|_| d.bytes().map(<[u8]>::to_vec))
            .collect::<Result<_, _>>()
            .map_err(|e| self.bad(CollectiveKind::AllGather, tag, e))
    }

    fn bad(&self, kind: CollectiveKind, tag: &Tag, msg: String) -> CommError {
        CommError::BadInput { kind, tag: tag.clone(), rank: self.rank, msg }
    }

    /// Rank `root`'s bytes on every rank (e.g. a device communicator's unique id); only
    /// `root` passes `Some`.
    pub fn broadcast_bytes(&self, root: usize, data: Option<Vec<u8>>) -> Result<Vec<u8>, CommError> {
        let tag = Tag::new("broadcast-bytes");
        if root >= self.members.len() {
            return Err(self.bad(
                CollectiveKind::Broadcast,
                &tag,
                format!("root {root} outside the group of {}", self.members.len()),
            ));
        }
        if (self.rank == root) != data.is_some() {
            return Err(self.bad(
                CollectiveKind::Broadcast,
                &tag,
                "exactly the root passes the bytes".into(),
            ));
        }
        let mut all = self.exchange(&data.unwrap_or_default(), &tag)?;
        Ok(all.swap_remove(root))
    }

    /// Splits the group like `MPI_Comm_split`: members passing the same `color` form a new
    /// group, ordered by `key` (then by rank). Every member must call it.
    pub fn split(&self, color: u32, key: u32) -> Result<Arc<Self>, CommError> {
        let n = self.splits.fetch_add(1, Ordering::SeqCst);
        let tag = Tag::new(format!("split #{n}"));
        let mine = [color.to_le_bytes(), key.to_le_bytes()].concat();
        let all = self.exchange(&mine, &tag)?;
        let mut picked: Vec<(u32, usize)> = Vec::new();
        for (r, b) in all.iter().enumerate() {
            if b.len() != 8 {
                return Err(self.bad(CollectiveKind::AllGather, &tag, "malformed split request".into()));
            }
            let c = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let k = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            if c == color {
                picked.push((k, r));
            }
        }
        picked.sort();
        let members: Vec<usize> = picked.iter().map(|(_, r)| self.members[*r]).collect();
        let rank = picked.iter().position(|(_, r)| *r == self.rank).unwrap_or(0);
        let gid = fnv(&[self.gid, n, color as u64]);
        Ok(Arc::new(Self::with(self.link.clone(), members, rank, gid)))
    }

    fn collective<B: Backend>(
        &self,
        kind: CollectiveKind,
        tag: &Tag,
        input: Tensor<B, 1>,
        extra: u64,
        out_len: impl Fn(usize) -> usize,
    ) -> Result<Tensor<B, 1>, CommError> {
        let device = input.device();
        let (bytes, dtype, n) = to_bytes(input);
        self.counters.record(kind, bytes.len() as u64);
        let code = dtype_code(dtype)
            .ok_or_else(|| self.bad(kind, tag, format!("dtype {dtype:?} is not supported over TCP")))?;
        let out = self.call(kind, tag, (kind.index() as u8, code, n as u64, extra), bytes)?;
        let m = out_len(n);
        if out.len() != m * dtype.size() {
            return Err(self.bad(
                kind,
                tag,
                format!("rank 0 answered {} bytes, expected {}", out.len(), m * dtype.size()),
            ));
        }
        Ok(from_bytes::<B>(out, m, dtype, &device))
    }
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
    }
}

impl<B: Backend> ProcessGroup<B> for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }

    fn all_gather(&self, input: Tensor<B, 1>, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        let w = self.members.len();
        if w == 1 {
            return Ok(input);
        }
        self.collective(CollectiveKind::AllGather, tag, input, 0, |n| n * w)
    }

    fn reduce_scatter(
        &self,
        input: Tensor<B, 1>,
        op: ReduceOp,
        tag: &Tag,
    ) -> Result<Tensor<B, 1>, CommError> {
        let w = self.members.len();
        if w == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::ReduceScatter;
        let total = input.shape().num_elements();
        if !total.is_multiple_of(w) {
            return Err(self.bad(kind, tag, format!("{total} elements do not split into {w} chunks")));
        }
        self.collective(kind, tag, input, op_code(op), |n| n / w)
    }

    fn all_reduce(&self, input: Tensor<B, 1>, op: ReduceOp, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        if self.members.len() == 1 {
            return Ok(input);
        }
        self.collective(CollectiveKind::AllReduce, tag, input, op_code(op), |n| n)
    }

    fn broadcast(&self, input: Tensor<B, 1>, root: usize, tag: &Tag) -> Result<Tensor<B, 1>, CommError> {
        let w = self.members.len();
        if w == 1 {
            return Ok(input);
        }
        let kind = CollectiveKind::Broadcast;
        if root >= w {
            return Err(self.bad(kind, tag, format!("root {root} outside the group of {w}")));
        }
        self.collective(kind, tag, input, root as u64, |n| n)
    }

    fn barrier(&self, tag: &Tag) -> Result<(), CommError> {
        if self.members.len() == 1 {
            return Ok(());
        }
        self.counters.record(CollectiveKind::Barrier, 0);
        let kind = CollectiveKind::Barrier;
        self.call(kind, tag, (kind.index() as u8, 0, 0, 0), Vec::new()).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let global = self.members[self.rank];
        {
            let mut inbox = self.link.inbox();
            inbox.failed.get_or_insert(Failure::Peer(global, reason.to_owned()));
        }
        self.link.cv.notify_all();
        let _ = self.link.send(&Enc::default().u8(ABORT).bytes(reason.as_bytes()).0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray;

    fn env_of(pairs: &[(&str, &str)]) -> Result<Option<EnvRank>, EnvError> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        EnvRank::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn env_parsing_names_the_variable() {
        assert_eq!(env_of(&[]).unwrap(), None);
        let e = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.master_addr.as_str(), e.master_port),
            (1, 4, 1, "10.0.0.1", 1234)
        );
        let e = env_of(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")]).unwrap().unwrap();
        assert_eq!(
            (e.local_rank, e.master_addr.as_str(), e.master_port),
            (1, "127.0.0.1", DEFAULT_MASTER_PORT)
        );
        for (pairs, needle) in [
            (vec![("RANK", "1")], "WORLD_SIZE"),
            (vec![("WORLD_SIZE", "2")], "RANK"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "not below WORLD_SIZE"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE=0"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")], "MASTER_PORT"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")], "LOCAL_RANK"),
        ] {
            let err = env_of(&pairs).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should name {needle}");
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn env(rank: usize, world: usize, port: u16) -> EnvRank {
        EnvRank {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    /// Runs `f` on `world` threads, each joined through TCP.
    fn run<T: Send + 'static>(
        world: usize,
        f: impl Fn(Arc<TcpGroup>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let f = Arc::new(f);
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let g =
                        TcpGroup::connect(&env(r, world, port), Duration::from_secs(20)).expect("connect");
                    f(g)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    fn vals(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn collectives_match_local_group_bit_for_bit() {
        let world = 3;
        let input = |r: usize| -> Vec<f32> {
            (0..6).map(|i| (i as f32 + 0.1) * 10f32.powi(r as i32 * 3 - 3)).collect()
        };
        let tcp = run(world, move |g| {
            let d = Default::default();
            let t = |r: usize| Tensor::<B, 1>::from_floats(input(r).as_slice(), &d);
            let me = g.rank;
            let ag = vals(ProcessGroup::<B>::all_gather(&*g, t(me), &Tag::new("ag")).unwrap());
            let rs =
                vals(ProcessGroup::<B>::reduce_scatter(&*g, t(me), ReduceOp::Avg, &Tag::new("rs")).unwrap());
            let ar = vals(ProcessGroup::<B>::all_reduce(&*g, t(me), ReduceOp::Sum, &Tag::new("ar")).unwrap());
            let mx = vals(ProcessGroup::<B>::all_reduce(&*g, t(me), ReduceOp::Max, &Tag::new("mx")).unwrap());
            let bc = vals(ProcessGroup::<B>::broadcast(&*g, t(me), 2, &Tag::new("bc")).unwrap());
            ProcessGroup::<B>::barrier(&*g, &Tag::new("b")).unwrap();
            (ag, rs, ar, mx, bc)
        });
        let local = crate::comm::local::launch(world, Duration::from_secs(20), move |g| {
            let d = Default::default();
            let t = |r: usize| Tensor::<B, 1>::from_floats(input(r).as_slice(), &d);
            let me = ProcessGroup::<B>::rank(&*g);
            let ag = vals(ProcessGroup::<B>::all_gather(&*g, t(me), &Tag::new("ag"))?);
            let rs = vals(ProcessGroup::<B>::reduce_scatter(&*g, t(me), ReduceOp::Avg, &Tag::new("rs"))?);
            let ar = vals(ProcessGroup::<B>::all_reduce(&*g, t(me), ReduceOp::Sum, &Tag::new("ar"))?);
            let mx = vals(ProcessGroup::<B>::all_reduce(&*g, t(me), ReduceOp::Max, &Tag::new("mx"))?);
            let bc = vals(ProcessGroup::<B>::broadcast(&*g, t(me), 2, &Tag::new("bc"))?);
            Ok::<_, CommError>((ag, rs, ar, mx, bc))
        })
        .unwrap();
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (a, b) in tcp.iter().zip(&local) {
            assert_eq!(bits(&a.0), bits(&b.0));
            assert_eq!(bits(&a.1), bits(&b.1));
            assert_eq!(bits(&a.2), bits(&b.2));
            assert_eq!(bits(&a.3), bits(&b.3));
            assert_eq!(bits(&a.4), bits(&b.4));
        }
        assert_eq!(tcp[0].0.len(), 18);
        assert_eq!(tcp[1].4, input(2));
    }

    #[test]
    fn split_groups_and_byte_broadcast() {
        let out = run(4, |g| {
            let me = g.rank;
            let id = g.broadcast_bytes(0, (me == 0).then(|| vec![42u8; 128])).unwrap();
            // Rows of a 2x2 mesh: {0,1} and {2,3}; columns: {0,2} and {1,3}.
            let row = g.split((me / 2) as u32, (me % 2) as u32).unwrap();
            let col = g.split((me % 2) as u32, (me / 2) as u32).unwrap();
            let d = Default::default();
            let x = Tensor::<B, 1>::from_floats([me as f32], &d);
            let r = vals(ProcessGroup::<B>::all_gather(&*row, x.clone(), &Tag::new("row")).unwrap());
            let c = vals(ProcessGroup::<B>::all_gather(&*col, x, &Tag::new("col")).unwrap());
            (id, r, c, row.rank, col.rank)
        });
        for (me, (id, r, c, rr, cr)) in out.into_iter().enumerate() {
            assert_eq!(id, vec![42u8; 128]);
            let base = (me / 2) * 2;
            assert_eq!(r, vec![base as f32, base as f32 + 1.0]);
            assert_eq!(c, vec![(me % 2) as f32, (me % 2) as f32 + 2.0]);
            assert_eq!((rr, cr), (me % 2, me / 2));
        }
    }

    #[test]
    fn mismatch_and_abort_fail_every_rank() {
        let out = run(3, |g| {
            let d = Default::default();
            let x = Tensor::<B, 1>::from_floats([1.0, 2.0], &d);
            let tag = if g.rank == 1 { "other" } else { "same" };
            ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new(tag)).unwrap_err().to_string()
        });
        for e in &out {
            assert!(e.contains("mismatch") && e.contains("other") && e.contains("same"), "{e}");
        }
        let out = run(3, |g| {
            let d = Default::default();
            if g.rank == 2 {
                ProcessGroup::<B>::abort(&*g, "rank 2 ran out of data");
                return String::new();
            }
            let x = Tensor::<B, 1>::from_floats([1.0], &d);
            let started = Instant::now();
            let e = ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new("x")).unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(10));
            e.to_string()
        });
        assert!(out[0].contains("ran out of data") && out[1].contains("ran out of data"), "{out:?}");
    }

    #[test]
    fn wrong_world_size_is_refused_at_start() {
        let port = free_port();
        let r0 = std::thread::spawn(move || {
            TcpGroup::connect(&env(0, 2, port), Duration::from_secs(10)).map(|_| ())
        });
        let r1 = TcpGroup::connect(&env(1, 3, port), Duration::from_secs(10)).map(|_| ());
        let e0 = r0.join().unwrap().unwrap_err().to_string();
        let e1 = r1.unwrap_err().to_string();
        for e in [e0, e1] {
            assert!(e.contains("WORLD_SIZE=3") && e.contains("WORLD_SIZE=2"), "{e}");
        }
    }

    #[test]
    fn missing_rank_times_out_with_its_number() {
        let port = free_port();
        let e = TcpGroup::connect(&env(0, 3, port), Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("[1, 2]") && e.contains("did not connect"), "{e}");
        let e =
            TcpGroup::connect(&env(1, 3, free_port()), Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("could not reach rank 0"), "{e}");
    }

    #[test]
    fn a_dead_peer_fails_the_others_quickly() {
        // Rank 2 "dies": its link is dropped without saying bye would need a real process;
        // dropping its socket mid-job closes the connection the same way.
        let port = free_port();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = TcpGroup::connect(&env(r, 3, port), Duration::from_secs(20)).unwrap();
                    if r == 2 {
                        if let Outlet::Remote(w, _) = &*g.link.out.lock().unwrap() {
                            w.shutdown(std::net::Shutdown::Both).unwrap();
                        }
                        return String::new();
                    }
                    let started = Instant::now();
                    let x = Tensor::<B, 1>::from_floats([1.0], &Default::default());
                    let e = ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new("x")).unwrap_err();
                    assert!(started.elapsed() < Duration::from_secs(10));
                    e.to_string()
                })
            })
            .collect();
        let out: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(out[0].contains("rank 2") && out[1].contains("rank 2"), "{out:?}");
    }

    #[test]
    fn a_rank_that_stops_issuing_collectives_is_named_by_every_rank_within_the_timeout() {
        // Rank 2 is alive and connected but stalled (as under SIGSTOP, or with its link down):
        // the hub names it once the round has waited the timeout.
        let port = free_port();
        let timeout = Duration::from_millis(800);
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = TcpGroup::connect(&env(r, 3, port), timeout).unwrap();
                    if r == 2 {
                        std::thread::sleep(Duration::from_millis(2500));
                    }
                    let started = Instant::now();
                    let x = Tensor::<B, 1>::from_floats([1.0], &Default::default());
                    let e = ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new("x")).unwrap_err();
                    (e.to_string(), started.elapsed())
                })
            })
            .collect();
        let out: Vec<(String, Duration)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (r, (e, took)) in out.iter().enumerate() {
            assert!(e.contains("rank(s) [2] did not arrive"), "rank {r}: {e}");
            if r < 2 {
                assert!(*took >= timeout && *took < timeout * 2, "rank {r} took {took:?}");
            } else {
                assert!(*took < Duration::from_millis(200), "the stalled rank hears at once: {took:?}");
            }
        }
    }

    /// A fake rank 0 that welcomes one rank and then does what `then` says with the stream.
    fn fake_rank0(port: u16, then: impl FnOnce(TcpStream) + Send + 'static) -> JoinHandle<()> {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_frame(&mut s).unwrap();
            write_frame(&mut s, &[WELCOME]).unwrap();
            then(s)
        })
    }

    #[test]
    fn a_stranger_declaring_a_huge_frame_is_refused_and_the_job_starts() {
        // Before the real rank 1, a process that is not a rank connects to MASTER_PORT and
        // declares a frame of 2^63 bytes, then closes: rank 0 allocates nothing for it.
        let port = free_port();
        let rank0 = std::thread::spawn(move || TcpGroup::connect(&env(0, 2, port), Duration::from_secs(20)));
        let mut s = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        s.write_all(&(1u64 << 63).to_le_bytes()).unwrap();
        s.write_all(b"not a rank").unwrap();
        drop(s);
        let g1 = TcpGroup::connect(&env(1, 2, port), Duration::from_secs(20)).unwrap();
        let g0 = rank0.join().unwrap().unwrap();
        let x = Tensor::<B, 1>::from_floats([1.0], &Default::default());
        let h = std::thread::spawn(move || {
            ProcessGroup::<B>::all_reduce(&*g1, x, ReduceOp::Sum, &Tag::new("x")).map(vals)
        });
        let y = Tensor::<B, 1>::from_floats([2.0], &Default::default());
        assert_eq!(
            vals(ProcessGroup::<B>::all_reduce(&*g0, y, ReduceOp::Sum, &Tag::new("x")).unwrap()),
            [3.0]
        );
        assert_eq!(h.join().unwrap().unwrap(), [3.0]);
    }

    #[test]
    fn a_silent_rank_0_is_named_unreachable_after_the_timeout_and_grace() {
        let port = free_port();
        let (tx, rx) = channel::<()>();
        let hub = fake_rank0(port, move |s| {
            // Reads nothing, answers nothing, until the test is done.
            let _ = rx.recv();
            drop(s);
        });
        let timeout = Duration::from_millis(400);
        let g = TcpGroup::connect(&env(1, 2, port), timeout).unwrap();
        let started = Instant::now();
        let x = Tensor::<B, 1>::from_floats([1.0], &Default::default());
        let e = ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new("x")).unwrap_err();
        let took = started.elapsed();
        let e = e.to_string();
        assert!(e.contains("rank 0 failed: rank 0 is unreachable: no answer from it within 500ms"), "{e}");
        assert!(took >= timeout + grace(timeout) && took < Duration::from_secs(2), "{took:?}");
        tx.send(()).unwrap();
        hub.join().unwrap();
    }

    #[test]
    fn a_rank_that_stops_reading_is_declared_unreachable_by_rank_0() {
        // Rank 1 (a raw socket) joins an all-gather of 16 MiB and then reads nothing: the hub's
        // write of the result blocks until the write timeout, and rank 0 errors naming rank 1.
        let port = free_port();
        let timeout = Duration::from_millis(1000);
        let n = 4 << 20;
        let rank1 = std::thread::spawn(move || {
            let mut s = loop {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(s) => break s,
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            let hello = Enc::default().u8(HELLO).bytes(MAGIC).u64(1).u64(2).0;
            write_frame(&mut s, &hello).unwrap();
            assert_eq!(read_frame(&mut s).unwrap(), vec![WELCOME]);
            let req = Request {
                gid: 0,
                seq: 1,
                members: vec![0, 1],
                kind: CollectiveKind::AllGather.index() as u8,
                tag: "x".into(),
                dtype: dtype_code(burn::tensor::DType::F32).unwrap(),
                elems: n as u64,
                extra: 0,
                data: vec![0u8; 4 * n],
            };
            write_frame(&mut s, &req.encode()).unwrap();
            std::thread::sleep(Duration::from_secs(4));
            drop(s);
        });
        let g = TcpGroup::connect(&env(0, 2, port), timeout).unwrap();
        let x = Tensor::<B, 1>::zeros([n], &Default::default());
        // Rank 0's result comes first; the hub then blocks writing rank 1's.
        ProcessGroup::<B>::all_gather(&*g, x, &Tag::new("x")).unwrap();
        let started = Instant::now();
        let x = Tensor::<B, 1>::from_floats([1.0], &Default::default());
        let e = ProcessGroup::<B>::all_reduce(&*g, x, ReduceOp::Sum, &Tag::new("y")).unwrap_err().to_string();
        assert!(e.contains("rank 1 is unreachable: rank 0 could not send to it within 1s"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        drop(g);
        rank1.join().unwrap();
    }
}
