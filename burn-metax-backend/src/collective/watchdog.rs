//! [`Watchdog`]: a thread that enforces a group's collective timeout while nobody calls the
//! group (e.g. while its rank is blocked reading a tensor that a stalled collective writes).

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the watchdog watches.
pub(crate) trait Watched: Send + Sync + 'static {
    /// Called once on the watchdog thread before the first [`Watched::watch`] (e.g. to make the
    /// device current on it).
    fn prepare_thread(&self);
    /// Checks the collectives in flight; returns how long to sleep before the next check.
    fn watch(&self) -> Duration;
}

type Stop = Arc<(Mutex<bool>, Condvar)>;

/// The watchdog thread of one group; stopped and joined on drop.
pub(crate) struct Watchdog {
    stop: Stop,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts the thread. It holds `target` weakly and ends when it is gone or on drop.
    pub(crate) fn spawn(name: String, target: Weak<dyn Watched>) -> std::io::Result<Self> {
        let stop: Stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread_stop = stop.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || run(&target, &thread_stop))?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

fn run(target: &Weak<dyn Watched>, stop: &Stop) {
    let mut prepared = false;
    loop {
        let pause = {
            let Some(target) = target.upgrade() else { return };
            if !prepared {
                target.prepare_thread();
                prepared = true;
            }
            target.watch()
        };
        let (lock, cv) = &**stop;
        let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
        if *stopped {
            return;
        }
        let (stopped, _) = cv.wait_timeout(stopped, pause).unwrap_or_else(|e| e.into_inner());
        if *stopped {
            return;
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
