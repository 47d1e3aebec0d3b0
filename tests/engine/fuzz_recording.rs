//! Property tests: the recording reader returns an error or a recording, never panics, on any
//! bytes; and on a valid recording cut anywhere it still reads, with at most one warning.

use gaccwb::control::{Control, Dtype, Origin};
use gaccwb::record::parse_recording;
use gaccwb::scenario::Scenario;
use gaccwb::telemetry::{
    BuildInfo, ControlEvent, EndEvent, Event, Header, PhaseMs, StepEvent, FORMAT_VERSION,
};
use proptest::prelude::*;

const ARBITRARY_CASES: u32 = 2000;
const MUTATION_CASES: u32 = 2000;

fn valid_recording() -> Vec<u8> {
    let mut events = vec![Event::Header(Header {
        version: FORMAT_VERSION,
        config: Scenario::default(),
        device: "cpu".into(),
        build: BuildInfo::current(1),
        params: 1000,
        family: None,
        entropy_floor: Some(0.95),
        tokenizer: None,
        started_unix: 0,
        ranks: None,
        collectives: None,
        memory_budget_bytes: None,
        unified_memory: Some(true),
        writer: None,
    })];
    for step in 1..=5u64 {
        events.push(Event::Step(StepEvent {
            step,
            loss: 3.0 / step as f64,
            grad_norm: 1.5,
            grad_norm_clipped: 1.0,
            lr: 1e-3,
            accum_steps: 2,
            micro_batch: 4,
            tokens: 512,
            tokens_per_s: 1000.0,
            step_ms: 12.5,
            cpu_threads: None,
            skipped: false,
            loss_scale: 65536.0,
            overflow_count: 0,
            dtype: Dtype::F16,
            offload: false,
            host_device_bytes: 0,
            clip: Some(1.0),
            phase_ms: PhaseMs::default(),
            grad_error: (step % 2 == 0).then_some(0.7),
            noise: (step >= 2).then(|| gaccwb::telemetry::NoiseEvent {
                g2: 0.5,
                trace: 40.0,
                b_simple_tokens: Some(80.0),
                b_simple_seqs: (step > 2).then_some(2.5),
                raw_g2: -0.1,
                raw_trace: 38.0,
                windows: step - 1,
            }),
            comm: (step % 3 == 0).then(|| gaccwb::dist::CommEvent {
                ranks: 2,
                sync: gaccwb::control::SyncEvery::MicroBatch,
                per_rank: vec![
                    gaccwb::dist::RankComm {
                        sent_bytes: 1000,
                        received_bytes: 1000,
                        comm_ms: 1.5,
                        gradient_reduces: 2,
                    };
                    2
                ],
                peak_bytes: vec![5_000, 6_000],
            }),
        }));
        events.push(Event::Control(ControlEvent {
            step,
            origin: Origin::Key,
            control: Control::SetAccumSteps { value: 2 },
        }));
    }
    events.push(Event::End(EndEvent {
        step: 5,
        reason: gaccwb::end::EndReason::Completed,
    }));
    let mut out = Vec::new();
    for e in &events {
        serde_json::to_writer(&mut out, e).unwrap();
        out.push(b'\n');
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(ARBITRARY_CASES))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_recording(&bytes, "fuzz.jsonl");
    }

    #[test]
    fn json_looking_lines_never_panic(
        lines in proptest::collection::vec(
            "\\{\"type\":\"(header|step|control|memory|end|x)\"(,\"[a-z_]{1,8}\":(-?[0-9]{1,25}|\"[a-z]{0,5}\"|null|\\{\\}|\\[\\]))*\\}",
            0..8,
        )
    ) {
        let _ = parse_recording(lines.join("\n").as_bytes(), "fuzz.jsonl");
    }

    #[test]
    fn a_valid_recording_cut_anywhere_still_reads(cut in any::<prop::sample::Index>()) {
        let bytes = valid_recording();
        // Keep at least the header line whole: a file with no header is an error, not a cut.
        let header_end = bytes.iter().position(|b| *b == b'\n').unwrap() + 1;
        let at = header_end + cut.index(bytes.len() - header_end + 1);
        let r = parse_recording(&bytes[..at], "fuzz.jsonl");
        prop_assert!(r.is_ok(), "{:?}", r.err());
        prop_assert!(r.unwrap().warnings.len() <= 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(MUTATION_CASES))]

    #[test]
    fn mutated_recordings_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
    ) {
        let mut bytes = valid_recording();
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        if let Err(e) = parse_recording(&bytes, "fuzz.jsonl") {
            // Errors name the file and, for a bad line, its number.
            prop_assert!(e.to_string().starts_with("fuzz.jsonl:"), "{}", e);
        }
    }
}
