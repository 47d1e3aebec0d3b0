//! Time this thread spent inside the fused head's kernels (`head`), forward and backward apart:
//! `gaccwb bench` reads it around each step to say how much of the forward and of the backward
//! the LM head and loss took. Per thread, so a reading counts only the steps its own thread ran
//! (the kernels' timers live on the thread that runs the op, whatever pool it fans out to). A
//! call costs two clock reads.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Time in an op's forward and backward kernels, and its forward calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reading {
    /// Time in the op's forward kernel.
    pub forward: Duration,
    /// Time in the op's backward kernel.
    pub backward: Duration,
    /// Forward calls (one per micro-step that ran the op).
    pub calls: u64,
}

impl Reading {
    const ZERO: Reading = Reading {
        forward: Duration::ZERO,
        backward: Duration::ZERO,
        calls: 0,
    };

    /// What was counted between `earlier` and this reading.
    pub fn since(self, earlier: Reading) -> Reading {
        Reading {
            forward: self.forward.saturating_sub(earlier.forward),
            backward: self.backward.saturating_sub(earlier.backward),
            calls: self.calls.saturating_sub(earlier.calls),
        }
    }
}

thread_local! {
    static HEAD: Cell<Reading> = const { Cell::new(Reading::ZERO) };
}

/// The fused head's time on this thread since it started.
pub fn head() -> Reading {
    HEAD.with(Cell::get)
}

/// Which kernel a `Timer` times.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    Backward,
}

/// Adds the time from its making to its drop to this thread's head reading.
pub(super) struct Timer {
    pass: Pass,
    start: Instant,
}

impl Timer {
    /// Times a forward call of the head.
    pub(super) fn head_forward() -> Self {
        Self::on(Pass::Forward)
    }

    /// Times a backward call of the head.
    pub(super) fn head_backward() -> Self {
        Self::on(Pass::Backward)
    }

    fn on(pass: Pass) -> Self {
        Timer {
            pass,
            start: Instant::now(),
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let took = self.start.elapsed();
        HEAD.with(|cell| {
            let mut r = cell.get();
            match self.pass {
                Pass::Forward => {
                    r.forward += took;
                    r.calls += 1;
                }
                Pass::Backward => r.backward += took,
            }
            cell.set(r);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_counts_what_ran_between_on_its_thread() {
        let before = head();
        {
            let _t = Timer::head_forward();
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(Timer::head_backward());
        std::thread::spawn(|| drop(Timer::head_forward()))
            .join()
            .unwrap();
        let d = head().since(before);
        assert_eq!(d.calls, 1);
        assert!(d.forward >= Duration::from_millis(2), "{d:?}");
        assert!(d.backward < d.forward, "{d:?}");
        assert_eq!(head().since(head()).calls, 0);
    }
}
