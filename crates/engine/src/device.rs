//! Device selection: `cpu`, `cuda`, `cuda:N` or `auto` (CUDA when built with it and a GPU answers).

use std::str::FromStr;

use candle_core::Device;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
/// The device `--device` asks for, before it is opened.
pub enum DeviceChoice {
    /// The host CPU.
    Cpu,
    /// The CUDA GPU of this ordinal.
    Cuda(usize),
    #[default]
    /// The first CUDA GPU when one is usable, else the CPU.
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("unknown device `{s}`: expected cpu, cuda, cuda:N or auto");
        match s.trim() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl DeviceChoice {
    /// Open the device. `auto` falls back to the CPU silently; an explicit `cuda` that cannot be
    /// opened is an error that says why.
    pub fn open(self) -> Result<Device, DeviceError> {
        self.open_with(open_cuda)
    }

    /// Open the device as the rank with `local_rank` on its host: one GPU per rank, so the
    /// CUDA ordinal moves up by the local rank (`cuda:N` opens N + local rank; `auto` the
    /// local rank's GPU, else the CPU). The CPU is shared.
    pub fn open_for_rank(self, local_rank: usize) -> Result<Device, DeviceError> {
        self.open_with(|n| open_cuda(n + local_rank))
    }

    /// The selection rules, with the CUDA opener passed in so they are tested without a GPU.
    pub fn open_with(
        self,
        open_cuda: impl FnOnce(usize) -> Result<Device, DeviceError>,
    ) -> Result<Device, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(n),
            DeviceChoice::Auto => Ok(open_cuda(0).unwrap_or(Device::Cpu)),
        }
    }
}

/// Why a device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// CUDA did not open this GPU (no driver, no such ordinal).
    #[error("cannot open cuda:{ordinal}: {err}")]
    Cuda {
        /// The GPU asked for.
        ordinal: usize,
        /// CUDA's answer.
        err: candle_core::Error,
    },
    /// This binary has no CUDA.
    #[error(
        "cannot open cuda:{ordinal}: this gaccwb was built without CUDA; rebuild with \
         `cargo build --release --features cuda`"
    )]
    NotBuilt {
        /// The GPU asked for.
        ordinal: usize,
    },
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device, DeviceError> {
    Device::new_cuda(ordinal).map_err(|err| DeviceError::Cuda { ordinal, err })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt { ordinal })
}

/// "cpu" or "cuda:N", as written in the run header.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda:1".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(1)));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert!("tpu"
            .parse::<DeviceChoice>()
            .unwrap_err()
            .contains("expected cpu, cuda"));
    }

    #[test]
    fn cpu_never_touches_cuda() {
        let device = DeviceChoice::Cpu
            .open_with(|_| panic!("the CUDA opener must not run for --device cpu"))
            .unwrap();
        assert!(device.is_cpu());
    }

    #[test]
    fn explicit_cuda_reports_why_it_cannot_open() {
        let err = DeviceChoice::Cuda(3)
            .open_with(|ordinal| {
                let err = candle_core::Error::Msg("no driver".into());
                Err(DeviceError::Cuda { ordinal, err })
            })
            .unwrap_err();
        assert_eq!(err.to_string(), "cannot open cuda:3: no driver");
    }

    #[test]
    fn auto_tries_the_first_gpu_then_falls_back_to_cpu() {
        let asked = std::cell::Cell::new(None);
        let device = DeviceChoice::Auto
            .open_with(|n| {
                asked.set(Some(n));
                Err(DeviceError::NotBuilt { ordinal: n })
            })
            .unwrap();
        assert_eq!(asked.get(), Some(0));
        assert!(device.is_cpu());
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_says_how_to_get_cuda() {
        let err = DeviceChoice::Cuda(0).open().unwrap_err().to_string();
        assert!(err.contains("built without CUDA"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
        assert!(DeviceChoice::Auto.open().unwrap().is_cpu());
        // One GPU per rank: the third rank on a host asks for the third GPU.
        let err = DeviceChoice::Cuda(0)
            .open_for_rank(2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot open cuda:2"), "{err}");
    }
}
