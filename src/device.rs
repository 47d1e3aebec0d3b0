//! Device selection: `cpu`, `cuda`, `cuda:N` or `auto` (CUDA when built with it and a GPU answers).

use std::str::FromStr;

use candle_core::Device;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    Cpu,
    Cuda(usize),
    #[default]
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
    pub fn open(self) -> anyhow::Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(n),
            DeviceChoice::Auto => Ok(open_cuda(0).unwrap_or(Device::Cpu)),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> anyhow::Result<Device> {
    Device::new_cuda(ordinal).map_err(|e| anyhow::anyhow!("cannot open cuda:{ordinal}: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> anyhow::Result<Device> {
    anyhow::bail!("cannot open cuda:{ordinal}: this gaccwb was built without CUDA; rebuild with `cargo build --release --features cuda`")
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
}
