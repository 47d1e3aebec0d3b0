//! The memory ledger measured in process against the counting allocator, and the estimator
//! held to it. One test binary (one link of Candle); each module was a test file of its own.
//!
//! The rule of this binary: every test's first statement is `let _serial = crate::serial();`.
//! The allocator (`memory::alloc`) counts every thread of the process, so a test measuring
//! while another test runs would book that test's bytes as its own; holding one lock for the
//! whole of each test runs them one after another. `every_test_holds_the_serial_lock` fails when
//! a test here does not. And every test measures on the one measuring thread
//! (`common::ledger::on_measuring_thread`), never on its own: a thread that multiplied holds a
//! `gemm` slab that is freed when the thread ends, after it let go of the lock, in the middle of
//! the next test's figures.

use std::sync::{Mutex, MutexGuard};

#[path = "../common/mod.rs"]
mod common;

/// Declares the modules and keeps their source, so the rule can be checked on it.
macro_rules! measuring {
    ($($module:ident),* $(,)?) => {
        $(mod $module;)*
        const SOURCES: &[(&str, &str)] = &[
            $((stringify!($module), include_str!(concat!(stringify!($module), ".rs"))),)*
            ("main", include_str!("main.rs")),
        ];
    };
}

measuring!(
    checkpointing_memory,
    memory_ledger,
    memory_sweep,
    steady_steps
);

/// Held for the whole of each test of this binary (the rule above). A test that failed while
/// holding it poisons it; the next still runs.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn every_test_holds_the_serial_lock() {
    let _serial = crate::serial();
    let mut tests = 0;
    for (module, source) in SOURCES {
        let lines: Vec<&str> = source.lines().map(str::trim).collect();
        for (i, line) in lines.iter().enumerate() {
            // A test attribute of any harness (`#[test]`, `#[tokio::test(..)]`, ...).
            let attribute = line.starts_with("#[") && line.contains("test") && line.ends_with(']');
            if !attribute || line.starts_with("#[cfg") {
                continue;
            }
            tests += 1;
            // The function's signature (after any doc comment or attribute), then its first line.
            let mut after = lines[i + 1..].iter().skip_while(|l| !l.contains("fn "));
            let signature = after.next().copied().unwrap_or_default();
            assert_eq!(
                after.next().copied(),
                Some("let _serial = crate::serial();"),
                "{module}.rs: `{signature}` must start by taking `crate::serial()`"
            );
        }
    }
    assert!(
        tests >= 5,
        "found only {tests} tests: the check no longer reads them"
    );
}
