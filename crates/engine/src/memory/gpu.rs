//! Device sources and the sampler thread.
//!
//! A `GpuSource` gives one `DeviceEvent` reading at a time: NVML (device used/total, this
//! process's memory, utilisation, temperature, power), the CUDA default memory pool
//! (used/reserved/high-water, `cuda` builds only), or the counting allocator on CPU runs. The
//! sampler thread reads its sources at `SAMPLE_INTERVAL` and sends the readings into the run's
//! event stream. A source that cannot answer sends one event saying why
//! ("NVML unavailable: `<reason>`") and stays quiet until the reason changes; nothing panics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::Device;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use super::ledger::{AllocatorMeter, TotalMeter};
use crate::telemetry::EventSink;
use crate::telemetry::{DeviceEvent, Event, MemorySource};

/// 10 Hz: fast enough to see memory swing within a step of the default preset.
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);

/// Something that can report device figures.
pub trait GpuSource: Send {
    /// Which source its readings are tagged with.
    fn source(&self) -> MemorySource;
    /// One reading (`t_ms` is filled by the sampler), or why there is none.
    fn sample(&mut self) -> Result<DeviceEvent, SampleError>;
}

/// Why a device source has no reading; the UI shows its text once, until readings return.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    /// NVML could not be loaded, or did not answer for this GPU (NVML's own words).
    #[error("NVML unavailable: {0}")]
    Nvml(String),
    /// The CUDA driver did not answer a query about the default memory pool.
    #[error("CUDA memory pool: {0}")]
    CudaPool(String),
    /// A scripted source's failure, as scripted (`FakeSource`).
    #[error("{0}")]
    Scripted(String),
}

fn nvml_unavailable(reason: impl std::fmt::Display) -> SampleError {
    SampleError::Nvml(reason.to_string())
}

/// NVML loaded once per process, on first use.
static NVML: OnceLock<Result<Arc<Nvml>, SampleError>> = OnceLock::new();

fn shared_nvml() -> Result<Arc<Nvml>, SampleError> {
    NVML.get_or_init(|| Nvml::init().map(Arc::new).map_err(nvml_unavailable))
        .clone()
}

/// One GPU seen through NVML.
pub struct NvmlSource {
    nvml: Result<Arc<Nvml>, SampleError>,
    index: u32,
    /// The GPU's UUID as NVML spells it (`GPU-…`): NVML numbers every GPU in the machine while
    /// CUDA numbers those `CUDA_VISIBLE_DEVICES` shows, so the ordinal alone can name another
    /// GPU. Set for CUDA devices (`for_cuda`); `index` is the fallback.
    uuid: Option<String>,
    pid: u32,
}

impl NvmlSource {
    /// GPU `index` through the process-wide NVML handle.
    pub fn new(index: u32) -> NvmlSource {
        NvmlSource {
            nvml: shared_nvml(),
            index,
            uuid: None,
            pid: std::process::id(),
        }
    }

    /// The GPU behind Candle's CUDA device `gpu_id`, found by UUID when the driver gives one.
    pub fn for_cuda(device: &Device, gpu_id: usize) -> NvmlSource {
        NvmlSource {
            uuid: cuda_uuid(device),
            ..NvmlSource::new(gpu_id as u32)
        }
    }

    /// This source's GPU in NVML: by UUID when known, else by ordinal.
    fn gpu<'n>(&self, nvml: &'n Nvml) -> Result<nvml_wrapper::Device<'n>, SampleError> {
        match &self.uuid {
            Some(uuid) => nvml
                .device_by_uuid(uuid.as_str())
                .map_err(|e| nvml_unavailable(format!("GPU {uuid}: {e}"))),
            None => nvml
                .device_by_index(self.index)
                .map_err(|e| nvml_unavailable(format!("GPU {}: {e}", self.index))),
        }
    }

    /// GPU `index` through the NVML library at `path` (tests, unusual installs).
    pub fn with_library(path: &std::ffi::OsStr, index: u32) -> NvmlSource {
        let nvml = Nvml::builder()
            .lib_path(path)
            .init()
            .map(Arc::new)
            .map_err(nvml_unavailable);
        NvmlSource {
            nvml,
            index,
            uuid: None,
            pid: std::process::id(),
        }
    }

    /// Why NVML cannot be used, if it cannot.
    pub fn unavailable(&self) -> Option<&SampleError> {
        self.nvml.as_ref().err()
    }
}

impl GpuSource for NvmlSource {
    fn source(&self) -> MemorySource {
        MemorySource::Nvml
    }

    fn sample(&mut self) -> Result<DeviceEvent, SampleError> {
        let nvml = self.nvml.as_ref().map_err(Clone::clone)?;
        let gpu = self.gpu(nvml)?;
        let memory = gpu.memory_info().map_err(nvml_unavailable)?;
        let process_used = gpu.running_compute_processes().ok().and_then(|ps| {
            ps.into_iter()
                .filter(|p| p.pid == self.pid)
                .find_map(|p| match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                })
        });
        Ok(DeviceEvent {
            source: MemorySource::Nvml,
            used: Some(memory.used),
            total: Some(memory.total),
            process_used,
            utilization: gpu.utilization_rates().ok().map(|u| u.gpu),
            temperature_c: gpu.temperature(TemperatureSensor::Gpu).ok(),
            power_w: gpu.power_usage().ok().map(|mw| f64::from(mw) / 1e3),
            ..DeviceEvent::default()
        })
    }
}

/// The counting allocator as a device source (CPU runs): live bytes, lifetime peak, host RAM.
pub struct AllocatorSource {
    host_total: Option<u64>,
}

impl AllocatorSource {
    /// A source reading the counting allocator, with the host's installed RAM as total.
    pub fn new() -> AllocatorSource {
        AllocatorSource {
            host_total: host_memory_total(),
        }
    }
}

impl Default for AllocatorSource {
    fn default() -> Self {
        Self::new()
    }
}

impl GpuSource for AllocatorSource {
    fn source(&self) -> MemorySource {
        MemorySource::Allocator
    }

    fn sample(&mut self) -> Result<DeviceEvent, SampleError> {
        let live = super::alloc::live();
        Ok(DeviceEvent {
            source: MemorySource::Allocator,
            used: Some(live),
            total: self.host_total,
            process_used: Some(live),
            peak: Some(super::alloc::high_water()),
            ..DeviceEvent::default()
        })
    }
}

/// Installed RAM from /proc/meminfo (Linux); `None` elsewhere.
pub fn host_memory_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Scripted readings, for tests and for replaying a device's behaviour without one.
pub struct FakeSource {
    source: MemorySource,
    readings: VecDeque<Result<DeviceEvent, SampleError>>,
    last: Option<Result<DeviceEvent, SampleError>>,
}

impl FakeSource {
    /// Gives `readings` in order, then repeats the last one.
    pub fn new(
        source: MemorySource,
        readings: Vec<Result<DeviceEvent, SampleError>>,
    ) -> FakeSource {
        FakeSource {
            source,
            readings: readings.into(),
            last: None,
        }
    }
}

impl GpuSource for FakeSource {
    fn source(&self) -> MemorySource {
        self.source
    }

    fn sample(&mut self) -> Result<DeviceEvent, SampleError> {
        if let Some(next) = self.readings.pop_front() {
            self.last = Some(next);
        }
        let mut reading = self
            .last
            .clone()
            .unwrap_or_else(|| Err(SampleError::Scripted("no readings scripted".into())))?;
        reading.source = self.source;
        Ok(reading)
    }
}

/// NVML's figure for this process as the ledger's measured total, when the CUDA memory pool
/// cannot be read. NVML has no per-phase peak: the peak is the highest reading taken.
pub struct NvmlMeter {
    source: NvmlSource,
    peak: AtomicU64,
}

impl NvmlMeter {
    /// A meter on NVML's GPU `index`.
    pub fn new(index: u32) -> NvmlMeter {
        NvmlMeter::of(NvmlSource::new(index))
    }

    fn of(source: NvmlSource) -> NvmlMeter {
        NvmlMeter {
            source,
            peak: AtomicU64::new(0),
        }
    }
}

impl TotalMeter for NvmlMeter {
    fn source(&self) -> MemorySource {
        MemorySource::Nvml
    }
    fn unified(&self) -> bool {
        false
    }
    fn live(&self) -> u64 {
        let Ok(nvml) = &self.source.nvml else {
            return 0;
        };
        let used = self
            .source
            .gpu(nvml)
            .ok()
            .and_then(|d| d.running_compute_processes().ok())
            .and_then(|ps| {
                ps.into_iter()
                    .filter(|p| p.pid == self.source.pid)
                    .find_map(|p| match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    })
            })
            .unwrap_or(0);
        self.peak.fetch_max(used, Relaxed);
        used
    }
    fn peak(&self) -> u64 {
        self.live();
        self.peak.load(Relaxed)
    }
    fn reset_peak(&self) {
        self.peak.store(0, Relaxed);
    }
}

/// The measured total for the ledger on `device`: the allocator on the CPU; on CUDA the default
/// memory pool (per-phase high-water marks), else NVML's per-process figure.
pub fn meter_for(device: &Device) -> Box<dyn TotalMeter> {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => cuda_meter(device, gpu_id),
        _ => Box::new(AllocatorMeter),
    }
}

#[cfg(feature = "cuda")]
fn cuda_meter(device: &Device, gpu_id: usize) -> Box<dyn TotalMeter> {
    match super::cuda_pool::CudaPool::for_device(device) {
        Ok(pool) => Box::new(pool),
        Err(_) => Box::new(NvmlMeter::of(NvmlSource::for_cuda(device, gpu_id))),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_meter(device: &Device, gpu_id: usize) -> Box<dyn TotalMeter> {
    Box::new(NvmlMeter::of(NvmlSource::for_cuda(device, gpu_id)))
}

/// The sources that describe `device`: the allocator on CPU; NVML and the memory pool on CUDA.
pub fn sources_for(device: &Device) -> Vec<Box<dyn GpuSource>> {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            let nvml: Box<dyn GpuSource> = Box::new(NvmlSource::for_cuda(device, gpu_id));
            std::iter::once(nvml).chain(pool_source(device)).collect()
        }
        _ => vec![Box::new(AllocatorSource::new())],
    }
}

/// The CUDA device's UUID in NVML's spelling, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[cfg(feature = "cuda")]
fn cuda_uuid(device: &Device) -> Option<String> {
    let cuda = device.as_cuda_device().ok()?;
    let uuid = cuda.cuda_stream().context().uuid().ok()?;
    Some(nvml_uuid(&uuid.bytes.map(|b| b as u8)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_uuid(_device: &Device) -> Option<String> {
    None
}

/// 16 UUID bytes as NVML prints them.
pub fn nvml_uuid(bytes: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| -> String {
        bytes[r].iter().map(|b| format!("{b:02x}")).collect()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

#[cfg(feature = "cuda")]
fn pool_source(device: &Device) -> Option<Box<dyn GpuSource>> {
    let pool = super::cuda_pool::CudaPool::for_device(device).ok()?;
    Some(Box::new(pool))
}

#[cfg(not(feature = "cuda"))]
fn pool_source(_device: &Device) -> Option<Box<dyn GpuSource>> {
    None
}

/// A running sampler; dropping it (or `stop`) ends the thread.
pub struct SamplerHandle {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl SamplerHandle {
    /// Stop the sampler and wait for its thread.
    pub fn stop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for SamplerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sample `device`'s sources at `SAMPLE_INTERVAL` into `sink` until the handle is dropped or
/// nobody listens. `t_ms` counts from this call.
pub fn start_sampler(sink: EventSink, device: &Device) -> SamplerHandle {
    start_sampler_with(sink, sources_for(device), SAMPLE_INTERVAL)
}

/// `start_sampler` with chosen sources and interval.
pub fn start_sampler_with(
    sink: EventSink,
    mut sources: Vec<Box<dyn GpuSource>>,
    interval: Duration,
) -> SamplerHandle {
    let (stop, stopped) = channel::<()>();
    let started = Instant::now();
    let mut reported: Vec<Option<SampleError>> = vec![None; sources.len()];
    let mut sample = move |sources: &mut Vec<Box<dyn GpuSource>>| {
        let t_ms = started.elapsed().as_millis() as u64;
        for (source, last_error) in sources.iter_mut().zip(&mut reported) {
            if let Some(event) = reading(source.as_mut(), t_ms, last_error) {
                if !sink.send(Event::Device(event)) {
                    return false;
                }
            }
        }
        true
    };
    // The first reading is taken here, so even a run shorter than the thread's start-up on a
    // loaded machine has one.
    let alive = sample(&mut sources);
    let thread = std::thread::Builder::new()
        .name("gaccwb-sampler".into())
        .spawn(move || {
            if !alive {
                return;
            }
            loop {
                match stopped.recv_timeout(interval) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                if !sample(&mut sources) {
                    return;
                }
            }
        });
    SamplerHandle {
        stop: Some(stop),
        thread: thread.ok(),
    }
}

/// The event for one reading: the figures, or the reason the source is unavailable the first
/// time that reason is seen.
fn reading(
    source: &mut dyn GpuSource,
    t_ms: u64,
    last_error: &mut Option<SampleError>,
) -> Option<DeviceEvent> {
    match source.sample() {
        Ok(mut event) => {
            *last_error = None;
            event.t_ms = t_ms;
            Some(event)
        }
        Err(reason) if last_error.as_ref() == Some(&reason) => None,
        Err(reason) => {
            let text = reason.to_string();
            *last_error = Some(reason);
            Some(DeviceEvent {
                t_ms,
                source: source.source(),
                unavailable: Some(text),
                ..DeviceEvent::default()
            })
        }
    }
}

/// The device's total memory: installed RAM on the CPU, NVML's total on CUDA.
pub fn device_total(device: &candle_core::Device) -> Option<u64> {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => NvmlSource::new(gpu_id as u32)
            .sample()
            .ok()
            .and_then(|e| e.total),
        _ => host_memory_total(),
    }
}

#[cfg(test)]
mod uuid_tests {
    #[test]
    fn uuid_is_spelled_as_nvml_spells_it() {
        let bytes: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(
            super::nvml_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }
}
