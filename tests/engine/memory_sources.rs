//! Device sources and the sampler: NVML absent is a stated condition, not a panic; a fake source
//! drives the GPU-style path; CPU runs report the allocator; a headless run carries measured and
//! estimated memory events and device samples in one stream.

use std::time::{Duration, Instant};

use candle_core::Device;
use gaccwb::memory::gpu::{
    start_sampler, start_sampler_with, FakeSource, GpuSource, NvmlSource, SampleError,
};
use gaccwb::telemetry::{DeviceEvent, Event, EventSink, MemorySource, Phase};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::common;

use common::TINY;

fn sink() -> (EventSink, UnboundedReceiver<Event>) {
    let (tx, rx) = unbounded_channel();
    (EventSink::new(tx), rx)
}

fn device_events(rx: &mut UnboundedReceiver<Event>) -> Vec<DeviceEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        if let Event::Device(d) = e {
            out.push(d);
        }
    }
    out
}

#[test]
fn a_missing_nvml_library_is_reported_as_unavailable() {
    let mut source = NvmlSource::with_library("/nonexistent/libnvidia-ml.so".as_ref(), 0);
    let reason = source.sample().unwrap_err();
    assert!(matches!(reason, SampleError::Nvml(_)), "{reason}");
    assert!(
        reason.to_string().starts_with("NVML unavailable: "),
        "{reason}"
    );
    assert_eq!(source.unavailable(), Some(&reason));
}

#[test]
fn this_machine_without_nvml_gets_a_reason_not_a_panic() {
    let mut source = NvmlSource::new(0);
    match source.sample() {
        Err(reason) => assert!(matches!(reason, SampleError::Nvml(_)), "{reason}"),
        // A machine with a driver: the reading must carry device memory figures.
        Ok(reading) => assert!(reading.total.unwrap_or(0) > 0),
    }
}

fn gpu_reading(used: u64) -> DeviceEvent {
    DeviceEvent {
        used: Some(used),
        total: Some(80 << 30),
        process_used: Some(used / 2),
        utilization: Some(97),
        temperature_c: Some(61),
        power_w: Some(412.5),
        ..DeviceEvent::default()
    }
}

#[test]
fn fake_gpu_sources_flow_through_the_sampler_at_ten_hertz() {
    let (sink, mut rx) = sink();
    let nvml = FakeSource::new(
        MemorySource::Nvml,
        vec![Ok(gpu_reading(1 << 30)), Ok(gpu_reading(2 << 30))],
    );
    let pool = FakeSource::new(
        MemorySource::CudaPool,
        vec![Ok(DeviceEvent {
            used: Some(3 << 20),
            reserved: Some(8 << 20),
            peak: Some(5 << 20),
            ..DeviceEvent::default()
        })],
    );
    let started = Instant::now();
    let mut handle = start_sampler_with(
        sink,
        vec![Box::new(nvml), Box::new(pool)],
        Duration::from_millis(100),
    );
    std::thread::sleep(Duration::from_millis(550));
    handle.stop();
    let elapsed = started.elapsed().as_secs_f64();
    let events = device_events(&mut rx);
    let nvml: Vec<_> = events
        .iter()
        .filter(|e| e.source == MemorySource::Nvml)
        .collect();
    let pool: Vec<_> = events
        .iter()
        .filter(|e| e.source == MemorySource::CudaPool)
        .collect();
    let rate = nvml.len() as f64 / elapsed;
    assert!(rate >= 9.0, "{} samples in {elapsed:.2}s", nvml.len());
    assert_eq!(nvml[0].used, Some(1 << 30));
    assert_eq!(nvml[1].used, Some(2 << 30));
    assert_eq!(nvml.last().unwrap().power_w, Some(412.5));
    assert!(nvml.windows(2).all(|w| w[0].t_ms < w[1].t_ms));
    assert_eq!(pool[0].reserved, Some(8 << 20));
    assert!(events.iter().all(|e| e.unavailable.is_none()));
}

#[test]
fn an_unavailable_source_says_why_once_and_recovers() {
    let (sink, mut rx) = sink();
    let reason = SampleError::Nvml("driver not loaded".into());
    let flaky = FakeSource::new(
        MemorySource::Nvml,
        vec![
            Err(reason.clone()),
            Err(reason.clone()),
            Err(reason.clone()),
            Ok(gpu_reading(1 << 30)),
        ],
    );
    let mut handle = start_sampler_with(sink, vec![Box::new(flaky)], Duration::from_millis(20));
    std::thread::sleep(Duration::from_millis(150));
    handle.stop();
    let events = device_events(&mut rx);
    let unavailable: Vec<_> = events.iter().filter(|e| e.unavailable.is_some()).collect();
    assert_eq!(unavailable.len(), 1);
    assert_eq!(
        unavailable[0].unavailable.as_deref(),
        Some(reason.to_string().as_str())
    );
    assert!(unavailable[0].used.is_none());
    assert!(events.iter().any(|e| e.used == Some(1 << 30)));
}

#[test]
fn a_cpu_run_samples_the_allocator() {
    let (sink, mut rx) = sink();
    let _ballast = vec![7u8; 8 << 20];
    let mut handle = start_sampler(sink, &Device::Cpu);
    std::thread::sleep(Duration::from_millis(250));
    handle.stop();
    let events = device_events(&mut rx);
    assert!(events.len() >= 2);
    for e in &events {
        assert_eq!(e.source, MemorySource::Allocator);
        let used = e.used.unwrap();
        assert!(used >= 8 << 20, "the 8 MiB ballast is live: {used}");
        assert!(e.peak.unwrap() >= used);
    }
}

#[test]
fn a_headless_run_records_measured_and_estimated_memory_and_device_samples() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.jsonl");
    let mut s = TINY.scenario();
    s.train.steps = 3;
    s.train.micro_batch = 4;
    s.timeline.push(gaccwb::scenario::TimelineEntry {
        step: 1,
        control: gaccwb::control::Control::SetMicroBatch { value: 8 },
    });
    let summary = gaccwb::headless::run(
        s,
        Device::Cpu,
        gaccwb::headless::HeadlessOptions {
            record: Some(path.clone()),
            quiet: true,
        },
    )
    .unwrap();
    assert_eq!(summary.end_reason, Some(gaccwb::end::EndReason::Completed));
    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<Event> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let memory: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Memory(m) => Some(m),
            _ => None,
        })
        .collect();
    let estimates: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Estimate(x) if x.phase == Phase::Backward => Some(x),
            _ => None,
        })
        .collect();
    assert_eq!(
        estimates.len(),
        2,
        "one at the start, one after the micro-batch change"
    );
    assert!(estimates[1].categories.activations > estimates[0].categories.activations);
    let measured = memory
        .iter()
        .filter(|m| m.source == MemorySource::Allocator && m.phase == Phase::Step)
        .count();
    assert_eq!(measured, 3);
    assert!(events.iter().any(|e| matches!(e, Event::Device(_))));
    assert!(summary.peak_memory.is_some());
}
