//! Device-to-device copies between two servers of one platform (`Tensor::to_device` from one
//! MetaX device to another).
//!
//! burn-cubecl moves a tensor between devices of one runtime through
//! `ServerCommunication::send` on the source server and `recv` on the destination server, each
//! called on its own server thread. These servers copy through the host: `send` reads the
//! source buffer (after the work queued on the source device, by the ordering rule of
//! [`super::server`]) and posts the bytes to a mailbox of the (source, destination) pair;
//! `recv` takes them and writes them into the new buffer on the destination. Peer-to-peer copies
//! (`mcMemcpyPeerAsync`) or MCCL send/recv would avoid the host round trip; this path only has
//! to be correct, as FSDP's collectives do not use it.
//!
//! Messages of one pair are matched in order, as NCCL send/recv pairs are: burn-cubecl submits a
//! transfer's `send` and `recv` together, so transfers between the same two devices issued
//! concurrently from several threads could pair out of order (the same holds for CubeCL's CUDA
//! runtime).

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long `recv` waits for the matching `send` before failing.
pub(crate) const RECV_TIMEOUT: Duration = Duration::from_secs(300);

/// (platform, source device index, destination device index).
type Pair = (&'static str, usize, usize);

#[derive(Default)]
struct Mailboxes {
    queues: Mutex<HashMap<Pair, VecDeque<Vec<u8>>>>,
    posted: Condvar,
}

fn mailboxes() -> &'static Mailboxes {
    static MAILBOXES: OnceLock<Mailboxes> = OnceLock::new();
    MAILBOXES.get_or_init(Mailboxes::default)
}

/// Posts `bytes` from device `src` to device `dst` of `platform`.
pub(crate) fn post(platform: &'static str, src: usize, dst: usize, bytes: Vec<u8>) {
    let boxes = mailboxes();
    let mut queues = boxes.queues.lock().unwrap_or_else(|p| p.into_inner());
    queues.entry((platform, src, dst)).or_default().push_back(bytes);
    boxes.posted.notify_all();
}

/// Takes the oldest message from device `src` to device `dst` of `platform`, waiting up to
/// `timeout` for one; `None` after the timeout.
pub(crate) fn take(platform: &'static str, src: usize, dst: usize, timeout: Duration) -> Option<Vec<u8>> {
    let boxes = mailboxes();
    let deadline = Instant::now() + timeout;
    let mut queues = boxes.queues.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Some(bytes) = queues.get_mut(&(platform, src, dst)).and_then(VecDeque::pop_front) {
            return Some(bytes);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        queues = boxes.posted.wait_timeout(queues, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_of_a_pair_arrive_in_order_and_pairs_are_separate() {
        post("test-transfer", 0, 1, vec![1]);
        post("test-transfer", 0, 1, vec![2]);
        post("test-transfer", 1, 0, vec![3]);
        assert_eq!(take("test-transfer", 1, 0, Duration::ZERO), Some(vec![3]));
        assert_eq!(take("test-transfer", 0, 1, Duration::ZERO), Some(vec![1]));
        assert_eq!(take("test-transfer", 0, 1, Duration::ZERO), Some(vec![2]));
        assert_eq!(take("test-transfer", 0, 1, Duration::from_millis(10)), None);
    }

    #[test]
    fn take_waits_for_a_later_post() {
        let poster = std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            post("test-transfer-wait", 2, 3, vec![7, 8]);
        });
        assert_eq!(take("test-transfer-wait", 2, 3, Duration::from_secs(10)), Some(vec![7, 8]));
        poster.join().unwrap();
    }
}
