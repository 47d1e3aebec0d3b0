//! How much of the CPUs this process may run on other processes keep busy, read from `/proc`
//! (Linux; elsewhere there is no reading). The pool governor takes it as its first guess and as
//! the sign that load came or went: a pool spread over CPUs that something else is using waits
//! for descheduled workers, and the time that costs is only seen after it is spent.
//!
//! Both sides are counted in the kernel's clock ticks: the busy ticks of each allowed CPU
//! (`/proc/stat`) less this process's own user and system ticks (`/proc/self/stat`), over all the
//! ticks those CPUs counted, so no tick rate is needed.

/// A reading covers at least this many ticks per allowed CPU (0.1 s at the usual 100 Hz), so one
/// tick more or less moves it by at most a tenth of a CPU, however many CPUs there are.
const MIN_TICKS_PER_CPU: u64 = 10;
/// The first reading, which sets where a run starts, asks for less (0.04 s): building a small
/// model and its first windows can take under 0.1 s, and a busy process still reads as most of
/// a CPU, an idle machine as a quarter at most.
const FIRST_TICKS_PER_CPU: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ticks {
    /// Busy ticks of the allowed CPUs.
    busy: u64,
    /// All ticks of the allowed CPUs, idle included.
    total: u64,
    /// This process's own user and system ticks.
    own: u64,
}

/// One reading, in CPUs' worth of time over its span.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Reading {
    /// Other processes, on the allowed CPUs.
    pub others: f64,
    /// This process, all its threads.
    pub own: f64,
}

/// Successive readings of other processes' load on the allowed CPUs.
#[derive(Debug)]
pub(crate) struct OthersLoad {
    cpus: Vec<usize>,
    last: Option<Ticks>,
    /// No reading has been given yet.
    first: bool,
    /// Read into again and again: a reading between windows allocates nothing after the first.
    text: String,
}

impl OthersLoad {
    /// Starts counting now. Without `/proc` (or when it cannot be parsed) every reading is `None`.
    pub(crate) fn start() -> OthersLoad {
        let cpus = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| allowed_cpus(&s))
            .unwrap_or_default();
        let mut load = OthersLoad {
            cpus,
            last: None,
            first: true,
            text: String::new(),
        };
        load.last = load.ticks();
        load
    }

    /// The allowed CPUs, as counted (0 without `/proc`).
    pub(crate) fn cpus(&self) -> usize {
        self.cpus.len()
    }

    /// The load since the last reading: `None` until enough ticks have passed (the count goes
    /// on), or without `/proc`.
    pub(crate) fn take(&mut self) -> Option<Reading> {
        let now = self.ticks()?;
        let last = self.last?;
        let total = now.total.saturating_sub(last.total);
        let per_cpu = if self.first {
            FIRST_TICKS_PER_CPU
        } else {
            MIN_TICKS_PER_CPU
        };
        if total < per_cpu * self.cpus.len() as u64 {
            return None;
        }
        self.last = Some(now);
        self.first = false;
        let busy = now.busy.saturating_sub(last.busy);
        let own = now.own.saturating_sub(last.own);
        let cpus = self.cpus.len() as f64 / total as f64;
        Some(Reading {
            others: busy.saturating_sub(own) as f64 * cpus,
            own: own as f64 * cpus,
        })
    }

    fn ticks(&mut self) -> Option<Ticks> {
        if self.cpus.is_empty() {
            return None;
        }
        self.read("/proc/stat")?;
        let (busy, total) = cpu_ticks(&self.text, &self.cpus)?;
        self.read("/proc/self/stat")?;
        let own = own_ticks(&self.text)?;
        Some(Ticks { busy, total, own })
    }

    fn read(&mut self, path: &str) -> Option<()> {
        use std::io::Read;
        self.text.clear();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_string(&mut self.text))
            .ok()
            .map(drop)
    }
}

/// The CPUs in `Cpus_allowed_list:` of `/proc/self/status` ("0-3,8,10-11").
fn allowed_cpus(status: &str) -> Option<Vec<usize>> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
        if hi < lo || hi - lo > 1 << 16 {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Busy and total ticks over `cpus` from `/proc/stat`'s `cpuN` lines. Busy is user, nice,
/// system, irq and softirq; idle, iowait and steal (time the hypervisor gave elsewhere) are not.
fn cpu_ticks(stat: &str, cpus: &[usize]) -> Option<(u64, u64)> {
    let (mut busy, mut total, mut seen) = (0u64, 0u64, 0usize);
    for line in stat.lines() {
        let Some(rest) = line.strip_prefix("cpu") else {
            continue;
        };
        let mut fields = rest.split_ascii_whitespace();
        let Some(Ok(cpu)) = fields.next().map(str::parse::<usize>) else {
            continue; // the "cpu" line of all CPUs together
        };
        if !cpus.contains(&cpu) {
            continue;
        }
        let t: Vec<u64> = fields
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let [user, nice, system, idle, iowait, irq, softirq, steal] = t[..] else {
            return None;
        };
        busy += user + nice + system + irq + softirq;
        total += user + nice + system + idle + iowait + irq + softirq + steal;
        seen += 1;
    }
    (seen == cpus.len()).then_some((busy, total))
}

/// utime + stime (fields 14 and 15) of `/proc/self/stat`. The command name (field 2) may hold
/// spaces and parentheses, so the fields are counted after its last ')'.
fn own_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allowed_list_is_read_with_ranges_and_singles() {
        let status = "Name:\tgaccwb\nCpus_allowed:\t3\nCpus_allowed_list:\t0-2,5,7-8\n";
        assert_eq!(allowed_cpus(status), Some(vec![0, 1, 2, 5, 7, 8]));
        assert_eq!(allowed_cpus("Cpus_allowed_list:\t3-1\n"), None);
        assert_eq!(allowed_cpus("Name:\tx\n"), None);
    }

    #[test]
    fn only_the_allowed_cpus_are_counted_and_steal_is_not_busy() {
        let stat = "cpu  30 0 0 30 0 0 0 0 0 0\n\
                    cpu0 10 2 3 80 1 1 1 2 0 0\n\
                    cpu1 20 0 0 70 0 0 0 10 0 0\n\
                    intr 1 2 3\n";
        assert_eq!(cpu_ticks(stat, &[0]), Some((17, 100)));
        assert_eq!(cpu_ticks(stat, &[0, 1]), Some((37, 200)));
        assert_eq!(
            cpu_ticks(stat, &[0, 2]),
            None,
            "a CPU missing from the file"
        );
    }

    #[test]
    fn own_ticks_survive_a_command_name_with_spaces_and_parentheses() {
        let stat = "4242 (my (odd) name) R 1 2 3 4 5 6 7 8 9 10 120 35 0 0 20 0 3 0";
        assert_eq!(own_ticks(stat), Some(155));
    }

    /// On Linux a reading comes once enough ticks have passed, and a thread of this process
    /// that spins through it is counted as this process's time.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_spinning_thread_is_this_process_s_time() {
        let mut load = OthersLoad::start();
        let cpus = load.cpus() as f64;
        assert!(cpus >= 1.0);
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        let reading = loop {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            if let Some(r) = load.take() {
                break r;
            }
            assert!(t0.elapsed().as_secs() < 30, "no reading in 30 s");
        };
        // What other processes did meanwhile is not known here, only that the total fits (within
        // a tick on each side: the first reading spans 4 ticks per CPU, and this process's time
        // is counted more finely than the CPUs'), and that the spinning thread was counted. How
        // large a share it got depends on the machine's load (a loaded 2-core machine gave it
        // 0.22 of a CPU) and other tests' threads count too, so no share is asserted.
        let tick = 1.0 / FIRST_TICKS_PER_CPU as f64;
        assert!(
            reading.others >= 0.0 && reading.others + reading.own <= cpus + 2.0 * tick,
            "{reading:?}"
        );
        assert!(reading.own > 0.0, "{reading:?}");
    }
}
