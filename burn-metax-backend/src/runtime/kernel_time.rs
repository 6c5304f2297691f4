//! Device time spent in kernels, measured by the device's own timers: a profiling switch, off by
//! default, per device.
//!
//! While it is on for a device, the server records a timing event on the launch's stream just
//! before each kernel launch and another just after it. The start event completes when the
//! stream reaches the launch (when the previous work on that stream is done, or when the host
//! queued it, whichever is later), the end event when the kernel has finished; their difference
//! is the kernel's time on the device, which does not include the time the device waited for
//! the host. [`take_kernel_time`] waits for the recorded events and sums them, so that a
//! benchmark can set the device's busy time against a step's wall time: the share of the step
//! spent in kernels, the rest being time the device waited for the host.
//!
//! What it counts: the kernels this crate's server launches on the device (CubeCL's and fused
//! ones), from any thread or stream; at most 2^20 launches wait for a take, later ones are
//! counted as untimed. It does not count copies, nor the kernels a collective library (MCCL,
//! NCCL) queues itself. Kernels that overlap on two streams are each counted whole, so the sum
//! can exceed the wall time when streams run side by side. Where the device is idle, a start event completes when the host
//! records it, so a kernel's time then also holds the host's launch call (a few microseconds):
//! the figure errs towards the device, by at most that much per launch.
//!
//! Two events per launch cost host time, so a benchmark times its steps' wall time with the
//! switch off and measures the kernel time on a separate step (`cargo xtask gpu-bench`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::driver::{Driver, DriverError, EventHandle, StreamHandle};

/// The kernel time of one device since the last [`take_kernel_time`] (or since the switch was
/// turned on).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelTime {
    /// Launches timed.
    pub launches: u64,
    /// Launches made while the switch was on that could not be timed (an event could not be
    /// created or recorded); they are not in [`Self::busy_ms`].
    pub untimed: u64,
    /// The sum over the timed launches of the device time from the launch's start to its end,
    /// in milliseconds.
    pub busy_ms: f64,
}

impl KernelTime {
    /// The sum of two measurements (e.g. of two devices).
    pub fn plus(&self, other: &Self) -> Self {
        Self {
            launches: self.launches + other.launches,
            untimed: self.untimed + other.untimed,
            busy_ms: self.busy_ms + other.busy_ms,
        }
    }
}

/// The timing state of one device.
struct DeviceTimer {
    platform: &'static str,
    device: usize,
    on: bool,
    /// The driver the events were created by (set by the first timed launch).
    driver: Option<Arc<dyn Driver>>,
    /// (start, end) of each timed launch not yet summed.
    pending: Vec<(EventHandle, EventHandle)>,
    /// Timing events ready to be recorded again.
    free: Vec<EventHandle>,
    untimed: u64,
}

static TIMERS: Mutex<Vec<DeviceTimer>> = Mutex::new(Vec::new());
/// At most this many launches per device wait for [`take_kernel_time`]; later ones go untimed,
/// so that timing left on without a take holds a bounded number of events.
const MAX_PENDING: usize = 1 << 20;
/// How long [`take_kernel_time`] waits for the timed kernels to finish.
const WAIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
/// How many devices have the switch on: the launch path reads only this while it is 0.
static ON: AtomicUsize = AtomicUsize::new(0);

fn timers() -> MutexGuard<'static, Vec<DeviceTimer>> {
    // Each update leaves the list valid: a panic cannot leave it half changed.
    TIMERS.lock().unwrap_or_else(|e| e.into_inner())
}

fn find<'a>(timers: &'a mut [DeviceTimer], platform: &str, device: usize) -> Option<&'a mut DeviceTimer> {
    timers.iter_mut().find(|t| t.platform == platform && t.device == device)
}

/// Turns kernel timing on or off for device `device` of platform `platform` (a
/// [`super::Platform::NAME`], e.g. `"cuda-proxy"`), from the next launch on; returns whether it
/// was on. Turning it off keeps what was measured for [`take_kernel_time`].
///
/// ```
/// use burn_metax_backend::runtime::{set_kernel_timing, take_kernel_time};
///
/// assert!(!set_kernel_timing("metax-emu", 62, true));
/// assert!(set_kernel_timing("metax-emu", 62, false));
/// // Nothing was launched on that device meanwhile.
/// assert_eq!(take_kernel_time("metax-emu", 62).unwrap().launches, 0);
/// ```
pub fn set_kernel_timing(platform: &'static str, device: usize, on: bool) -> bool {
    let mut timers = timers();
    let timer = match find(&mut timers, platform, device) {
        Some(timer) => timer,
        None => {
            timers.push(DeviceTimer {
                platform,
                device,
                on: false,
                driver: None,
                pending: Vec::new(),
                free: Vec::new(),
                untimed: 0,
            });
            timers.last_mut().expect("just pushed")
        }
    };
    let before = std::mem::replace(&mut timer.on, on);
    match (before, on) {
        (false, true) => {
            ON.fetch_add(1, Ordering::AcqRel);
        }
        (true, false) => {
            ON.fetch_sub(1, Ordering::AcqRel);
        }
        _ => {}
    }
    before
}

/// Waits for the kernels timed on device `device` of platform `platform` since the last call,
/// and returns their count and device time; the events are kept for the next launches.
///
/// The wait happens on a thread of its own, bound to the device, so the caller's current device
/// is left as it was.
///
/// # Errors
/// A driver call failed (the device is poisoned), or the timed kernels had not finished after
/// 10 minutes.
pub fn take_kernel_time(platform: &str, device: usize) -> Result<KernelTime, DriverError> {
    let (driver, pending, untimed) = {
        let mut timers = timers();
        let Some(timer) = find(&mut timers, platform, device) else {
            return Ok(KernelTime::default());
        };
        (timer.driver.clone(), std::mem::take(&mut timer.pending), std::mem::take(&mut timer.untimed))
    };
    let Some(driver) = driver else {
        return Ok(KernelTime { untimed, ..KernelTime::default() });
    };
    let summed = std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<f64, DriverError> {
                driver.set_device(device)?;
                let mut busy_ms = 0.0;
                let deadline = std::time::Instant::now() + WAIT_TIMEOUT;
                for &(start, end) in &pending {
                    // Polled with a deadline: a device that never gets there is an error, not a
                    // hang of the caller.
                    while !driver.event_query(end)? {
                        if std::time::Instant::now() > deadline {
                            return Err(DriverError::Timeout {
                                call: "the kernel timers' event wait",
                                seconds: WAIT_TIMEOUT.as_secs(),
                            });
                        }
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                    // Reached: returns at once, with the device's error if it has one.
                    driver.event_synchronize(end)?;
                    busy_ms += f64::from(driver.event_elapsed_ms(start, end)?);
                }
                Ok(busy_ms)
            })
            .join()
            .unwrap_or_else(|_| Err(DriverError::InvalidArgument("the kernel-time thread panicked".into())))
    });
    let launches = pending.len() as u64;
    // The events go back to the pool whatever the outcome: recording an event again is valid
    // whether or not its last record completed.
    if let Some(timer) = find(&mut timers(), platform, device) {
        timer.free.extend(pending.into_iter().flat_map(|(a, b)| [a, b]));
    }
    Ok(KernelTime { launches, untimed, busy_ms: summed? })
}

/// A launch being timed: its start event is recorded.
pub(crate) struct TimedLaunch {
    platform: &'static str,
    device: usize,
    start: EventHandle,
    end: EventHandle,
}

/// Two timing events of the device's pool (created if the pool is short).
fn take_events(timer: &mut DeviceTimer, driver: &Arc<dyn Driver>) -> Option<(EventHandle, EventHandle)> {
    let mut get = || timer.free.pop().map_or_else(|| driver.event_create(true).ok(), Some);
    let start = get()?;
    match get() {
        Some(end) => Some((start, end)),
        None => {
            timer.free.push(start);
            None
        }
    }
}

/// Called by the server just before a launch on `stream`: records the start event if timing is
/// on for the device. `None` when it is off, or when the events could not be had (counted as
/// untimed).
pub(crate) fn before_launch(
    platform: &'static str,
    device: usize,
    driver: &Arc<dyn Driver>,
    stream: StreamHandle,
) -> Option<TimedLaunch> {
    if ON.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut timers = timers();
    let timer = find(&mut timers, platform, device).filter(|t| t.on)?;
    timer.driver.get_or_insert_with(|| driver.clone());
    if timer.pending.len() >= MAX_PENDING {
        timer.untimed += 1;
        return None;
    }
    let Some((start, end)) = take_events(timer, driver) else {
        timer.untimed += 1;
        return None;
    };
    if driver.event_record(start, stream).is_err() {
        timer.free.extend([start, end]);
        timer.untimed += 1;
        return None;
    }
    Some(TimedLaunch { platform, device, start, end })
}

impl TimedLaunch {
    /// Called by the server just after the launch was queued on `stream` (`launched`: whether it
    /// was): records the end event and keeps the pair for [`take_kernel_time`].
    pub(crate) fn after_launch(self, driver: &Arc<dyn Driver>, stream: StreamHandle, launched: bool) {
        let recorded = launched && driver.event_record(self.end, stream).is_ok();
        let mut timers = timers();
        // Device timers are never removed: `before_launch` found this one.
        let Some(timer) = find(&mut timers, self.platform, self.device) else { return };
        if recorded {
            timer.pending.push((self.start, self.end));
        } else {
            timer.free.extend([self.start, self.end]);
            if launched {
                timer.untimed += 1;
            }
        }
    }
}
