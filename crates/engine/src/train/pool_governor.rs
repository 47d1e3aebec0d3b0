//! On the CPU's fused path, chooses window by window between the CPU pool (`ops::pool`) and the
//! trainer's thread alone, by timing both. When another process wants the cores, a pool worker
//! can be descheduled in the middle of a product and the product waits for it, so two threads can
//! run slower than one; when the machine is idle the pool wins. The results are the same bits
//! either way (work is split by shape, not by thread count), so only the time is at stake.
//!
//! The governor runs the current choice and, now and then, one window the other way (a probe).
//! It switches when two probes in a row cost less per position, by at least 10% to move onto the
//! trainer's thread alone and 25% to move back onto the pool (one lucky window must not move the
//! work onto the slow side; beside a busy process the pool's windows are the noisy ones). The
//! first probe comes at the
//! fifth window (a run that starts under load must not spend long on the slow choice); probes
//! then back off, doubling the gap up to 512 windows while they cost more than the choice (32
//! after a switch; the same gap again after a probe that was cheaper but not by the margin), and
//! come at once when the current choice's cost jumps by half (load arrived).
//!
//! Timing alone learns of load only after windows have paid for it, so the governor also reads
//! how busy other processes keep the CPUs (`ops::cpu_load`). Until the windows have been timed
//! the choice follows that reading (a run that starts beside a busy process starts on its own
//! thread) and the first timed probe waits for the gap a switch earns; afterwards a reading that
//! turns against the current choice times one window of it and then probes. Without a reading
//! (no `/proc`) the schedule above is all there is.

/// `GACCWB_CPU_POOL`: `auto` (the default), `pool` (always the pool) or `serial` (never).
pub(crate) const POOL_ENV: &str = "GACCWB_CPU_POOL";

/// Ends every line the governor logs: how to take the choice out of its hands.
fn fix_hint() -> String {
    format!("(set {POOL_ENV}=pool or serial to fix the choice)")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// What `GACCWB_CPU_POOL` asks for.
pub(crate) enum PoolChoice {
    /// Time both and keep the faster (the default).
    Auto,
    /// Always the thread pool.
    Pool,
    /// Always the calling thread alone.
    Serial,
}

/// `GACCWB_CPU_POOL` parsed; unset or empty is `auto`.
pub(crate) fn choice_from_env() -> Result<PoolChoice, crate::ops::BadEnvValue> {
    match std::env::var(POOL_ENV).as_deref().map(str::trim) {
        Err(_) | Ok("" | "auto") => Ok(PoolChoice::Auto),
        Ok("pool") => Ok(PoolChoice::Pool),
        Ok("serial") => Ok(PoolChoice::Serial),
        Ok(other) => Err(crate::ops::BadEnvValue {
            var: POOL_ENV,
            value: other.to_string(),
            expected: "\"auto\" (the default), \"pool\" or \"serial\"",
        }),
    }
}

/// Windows whose cost is not trusted (the first ones allocate and fill caches).
const WARM_UP: u64 = 2;
const FIRST_PROBE: u64 = 4;
const AFTER_SWITCH: u64 = 32;
const MAX_INTERVAL: u64 = 512;
/// The probed choice must cost at most this fraction of the current one to win: the trainer's
/// thread alone ...
const WIN: f64 = 0.9;
/// ... and the pool, a stricter bar. Idle, the pool costs about half (it clears this at once);
/// beside a busy process its windows scatter around the serial cost, and a lucky pair of them
/// must not move the run back onto it for a whole interval.
const WIN_TO_POOL: f64 = 0.75;
/// A window this many times the current choice's smoothed cost calls a probe at once.
const JUMP: f64 = 1.5;
/// The CPUs count as contended when other processes leave fewer than this many free (no room
/// for a second thread: the pool's workers would wait on each other) ...
const CONTENDED_BELOW: f64 = 1.5;
/// ... and as free again above this many (a gap, so a reading near the line does not call probe
/// after probe). Where more are free the pool is kept, however many threads it has, and timing
/// decides: one busy process on a 16-CPU machine must not send a 16-thread pool to one thread.
const FREE_ABOVE: f64 = 1.75;

#[derive(Clone, Debug)]
/// Chooses, window by window, whether the fused CPU ops use the thread pool, from their measured cost and other processes' load.
pub(crate) struct PoolGovernor {
    choice: PoolChoice,
    serial: bool,
    /// Smoothed ms per position, indexed by `serial as usize`.
    cost: [Option<f64>; 2],
    windows: u64,
    next_probe: u64,
    interval: u64,
    probing: bool,
    /// The last probe won; the next window probes again to confirm.
    confirming: bool,
    /// Whether other processes kept too many CPUs busy for the pool, as last read.
    contended: Option<bool>,
    /// The load changed: the next window's cost replaces the current choice's smoothed one
    /// (which was measured under the old load) before the probe that follows it.
    restart_cost: bool,
}

impl PoolGovernor {
    /// A governor following `choice`, starting on the pool.
    pub(crate) fn new(choice: PoolChoice) -> PoolGovernor {
        PoolGovernor {
            choice,
            serial: choice == PoolChoice::Serial,
            cost: [None; 2],
            windows: 0,
            next_probe: FIRST_PROBE,
            interval: FIRST_PROBE,
            probing: false,
            confirming: false,
            contended: None,
            restart_cost: false,
        }
    }

    /// Takes a reading of other processes' load: `others` CPUs' worth busy of the `cpus` this
    /// process may run on. Returns a line for the log when it sets the starting choice to the
    /// trainer's thread alone.
    pub(crate) fn load(&mut self, others: f64, cpus: usize) -> Option<String> {
        if self.choice != PoolChoice::Auto || !others.is_finite() {
            return None;
        }
        let free = cpus as f64 - others;
        let contended = match self.contended {
            Some(true) => free <= FREE_ABOVE,
            _ => free < CONTENDED_BELOW,
        };
        let changed = self.contended.replace(contended) != Some(contended);
        if self.windows <= WARM_UP {
            // The reading stands in for the first probes: timed probes start at the gap a
            // switch earns, and a reading that turns calls one sooner.
            self.interval = AFTER_SWITCH;
            self.next_probe = self.windows + AFTER_SWITCH;
            let was = std::mem::replace(&mut self.serial, contended);
            return (contended && !was).then(|| {
                format!(
                    "CPU ops start on the trainer's thread alone: other processes keep {others:.1} of {cpus} CPUs busy {}",
                    fix_hint()
                )
            });
        }
        if changed && contended != self.serial && !self.confirming {
            self.restart_cost = true;
            self.next_probe = self.windows + 1;
        }
        None
    }

    /// Whether the next window runs without the pool. `applies`: the window takes the fused
    /// CPU ops with more than one thread (elsewhere there is nothing to choose).
    pub(crate) fn next_serial(&mut self, applies: bool) -> bool {
        match self.choice {
            PoolChoice::Pool => false,
            PoolChoice::Serial => true,
            PoolChoice::Auto if !applies => false,
            PoolChoice::Auto => {
                self.probing = self.windows >= self.next_probe;
                self.serial ^ self.probing
            }
        }
    }

    /// The current choice, for work outside the windows (evaluation).
    pub(crate) fn serial(&self) -> bool {
        self.serial
    }

    /// Records what a window run with `serial` cost: its time over the positions it computed
    /// (micro-batch × sequence length × K, padding included: the work, whatever the documents'
    /// lengths); returns a line for the log when the choice changes.
    pub(crate) fn observe(&mut self, serial: bool, ms: f64, positions: u64) -> Option<String> {
        if self.choice != PoolChoice::Auto || serial != (self.serial ^ self.probing) {
            return None;
        }
        self.windows += 1;
        if self.windows <= WARM_UP || positions == 0 || !ms.is_finite() {
            self.probing = false;
            return None;
        }
        let cost = ms / positions as f64;
        let slot = &mut self.cost[serial as usize];
        if !self.probing {
            if slot.is_some_and(|c| cost > JUMP * c) {
                self.next_probe = self.windows;
            }
            *slot = match *slot {
                Some(c) if !std::mem::take(&mut self.restart_cost) => Some(0.7 * c + 0.3 * cost),
                _ => Some(cost),
            };
            return None;
        }
        *slot = Some(cost);
        self.probing = false;
        let current = self.cost[self.serial as usize]?;
        let won = cost < if serial { WIN } else { WIN_TO_POOL } * current;
        if won && !self.confirming {
            self.confirming = true;
            self.next_probe = self.windows;
            return None;
        }
        self.confirming = false;
        // A probe that was cheaper, but not by the margin, is asked again as soon; only a
        // probe that cost more backs the probes off.
        self.interval = if won {
            AFTER_SWITCH
        } else if cost < current {
            self.interval
        } else {
            (self.interval * 2).min(MAX_INTERVAL)
        };
        self.next_probe = self.windows + self.interval;
        if !won {
            return None;
        }
        self.serial = serial;
        let (now, was) = if serial {
            ("the trainer's thread alone", "the thread pool")
        } else {
            ("the thread pool", "the trainer's thread alone")
        };
        Some(format!(
            "CPU ops now on {now}: {:.1} µs per position against {:.1} on {was} {}",
            cost * 1e3,
            current * 1e3,
            fix_hint()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `windows` windows whose cost per token depends on the choice; returns the choices.
    fn drive(g: &mut PoolGovernor, windows: usize, cost: impl Fn(bool) -> f64) -> Vec<bool> {
        (0..windows)
            .map(|_| {
                let serial = g.next_serial(true);
                g.observe(serial, cost(serial) * 100.0, 100);
                serial
            })
            .collect()
    }

    /// The windows that ran with `serial` equal to `side`.
    fn windows_on(runs: &[bool], side: bool) -> Vec<usize> {
        (0..runs.len()).filter(|&i| runs[i] == side).collect()
    }

    #[test]
    fn an_idle_machine_keeps_the_pool_and_probes_ever_less() {
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        let runs = drive(&mut g, 2000, |serial| if serial { 1.6 } else { 1.0 });
        let probes = windows_on(&runs, true);
        assert!(!g.serial);
        assert_eq!(probes[..5], [4, 13, 30, 63, 128], "{probes:?}");
        assert!(probes.len() <= 10, "{probes:?}");
    }

    #[test]
    fn load_moves_the_work_to_one_thread_and_back_when_it_goes() {
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        drive(&mut g, 600, |serial| if serial { 1.6 } else { 1.0 });
        // Load arrives: the pool's cost jumps fourfold; a probe comes at once.
        let loaded = drive(&mut g, 5, |serial| if serial { 2.0 } else { 4.0 });
        assert!(g.serial, "{loaded:?}");
        // Load leaves: the periodic probe finds the pool faster again.
        drive(&mut g, 40, |serial| if serial { 1.6 } else { 1.0 });
        assert!(!g.serial);
    }

    #[test]
    fn one_lucky_probe_does_not_switch() {
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        drive(&mut g, 4, |serial| if serial { 2.0 } else { 1.0 });
        // Window 5 is the probe, and it happens to be fast; window 6 confirms it was luck.
        drive(&mut g, 1, |serial| if serial { 0.5 } else { 1.0 });
        assert!(g.confirming);
        drive(&mut g, 1, |serial| if serial { 2.0 } else { 1.0 });
        assert!(!g.serial && !g.confirming);
    }

    #[test]
    fn a_run_that_starts_beside_a_busy_process_starts_on_one_thread() {
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        let line = g.load(1.0, 2).expect("a line for the log");
        assert!(line.contains("1.0 of 2 CPUs"), "{line}");
        let runs = drive(&mut g, 100, |serial| if serial { 1.0 } else { 1.6 });
        assert_eq!(
            windows_on(&runs, false),
            [32, 97],
            "the first probe waits for the reading's gap"
        );
        assert!(g.serial);
        // Many CPUs: one busy process leaves room for the pool; one CPU left free does not.
        assert_eq!(PoolGovernor::new(PoolChoice::Auto).load(1.0, 16), None);
        assert!(PoolGovernor::new(PoolChoice::Auto).load(15.0, 16).is_some());
        // Idle from the start: the pool, nothing to log, and the same gap before probing.
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        assert_eq!(g.load(0.1, 2), None);
        let runs = drive(&mut g, 100, |serial| if serial { 1.6 } else { 1.0 });
        assert_eq!(windows_on(&runs, true), [32, 97]);
    }

    #[test]
    fn a_reading_that_turns_against_the_choice_calls_a_probe_at_once() {
        let mut g = PoolGovernor::new(PoolChoice::Auto);
        g.load(1.0, 2);
        drive(&mut g, 100, |serial| if serial { 1.0 } else { 1.6 });
        assert!(g.serial);
        // A reading just under the line keeps the choice (the gap); a clear one probes the pool.
        g.load(0.4, 2);
        assert!(g.next_serial(true), "no probe for a reading inside the gap");
        g.observe(true, 100.0, 100);
        g.load(0.1, 2);
        let runs = drive(&mut g, 3, |serial| if serial { 1.0 } else { 0.6 });
        assert_eq!(
            runs,
            [true, false, false],
            "a window timed, a probe, its confirmation"
        );
        assert!(!g.serial);
        // Load that arrives while on the pool calls a probe of one thread.
        drive(&mut g, 10, |serial| if serial { 1.0 } else { 0.6 });
        g.load(1.0, 2);
        let runs = drive(&mut g, 3, |serial| if serial { 1.0 } else { 1.6 });
        assert_eq!(
            runs,
            [false, true, true],
            "a window timed, a probe, its confirmation"
        );
        assert!(g.serial);
    }

    #[test]
    fn a_fixed_choice_is_kept() {
        let mut g = PoolGovernor::new(PoolChoice::Pool);
        assert_eq!(g.load(2.0, 2), None);
        assert!(!drive(&mut g, 100, |s| if s { 0.1 } else { 9.0 })
            .iter()
            .any(|&s| s));
        let mut g = PoolGovernor::new(PoolChoice::Serial);
        assert!(drive(&mut g, 100, |s| if s { 9.0 } else { 0.1 })
            .iter()
            .all(|&s| s));
    }
}
