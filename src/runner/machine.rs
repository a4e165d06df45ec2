//! The machine around the measurements: host facts for the document, and the GPU's state
//! while each row is timed, read through NVML (`nvml-wrapper`, which loads
//! `libnvidia-ml.so.1` at run time). Without NVML the runner still runs and says so.
//!
//! A [`Monitor`] samples the SM and memory clocks, the temperature, the power, the throttle
//! reasons and the processes using the GPU every [`SAMPLE_PERIOD`] on a thread of its own; each
//! row gets the samples of its timed span ([`Monitor::state`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::Nvml;

use crate::harness::quantile;
use crate::schema::MachineState;

use super::protocol::unix_now;

/// Time between two NVML samples.
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(crate::harness::MACHINE_SAMPLE_MS);

/// One NVML sample.
#[derive(Clone, Debug, Default)]
struct Sample {
    at: f64,
    sm_mhz: Option<f64>,
    mem_mhz: Option<f64>,
    temp_c: Option<f64>,
    power_w: Option<f64>,
    throttle: Vec<String>,
    /// Other processes on the GPU as `pid name`, classified when sampled (a case process is
    /// recognised as ours only while it lives).
    others: Vec<String>,
}

/// Fixed facts NVML gives about the device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceFacts {
    /// Enforced power limit, W.
    pub power_limit_w: Option<f64>,
    /// Highest SM clock, MHz.
    pub max_sm_clock_mhz: Option<f64>,
    /// Highest memory clock, MHz.
    pub max_mem_clock_mhz: Option<f64>,
    /// NVML's driver version.
    pub driver_version: Option<String>,
}

/// The NVML sampler, or why there is none.
pub struct Monitor {
    inner: Result<Running, String>,
}

struct Running {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    facts: DeviceFacts,
}

fn throttle_names(bits: nvml_wrapper::bitmasks::device::ThrottleReasons) -> Vec<String> {
    use nvml_wrapper::bitmasks::device::ThrottleReasons as T;
    bits.iter_names()
        .filter(|(_, f)| *f != T::GPU_IDLE && *f != T::NONE)
        .map(|(n, _)| n.to_ascii_lowercase())
        .collect()
}

fn take_sample(dev: &nvml_wrapper::Device<'_>, known_ours: &mut BTreeSet<u32>) -> Sample {
    let mut pids: Vec<u32> = Vec::new();
    for list in [
        dev.running_compute_processes(),
        dev.running_graphics_processes(),
    ]
    .into_iter()
    .flatten()
    {
        pids.extend(list.iter().map(|p| p.pid));
    }
    pids.sort_unstable();
    pids.dedup();
    Sample {
        at: unix_now(),
        sm_mhz: dev.clock_info(Clock::SM).ok().map(f64::from),
        mem_mhz: dev.clock_info(Clock::Memory).ok().map(f64::from),
        temp_c: dev.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
        power_w: dev.power_usage().ok().map(|mw| f64::from(mw) / 1e3),
        throttle: dev
            .current_throttle_reasons()
            .map(throttle_names)
            .unwrap_or_default(),
        others: others(&pids, known_ours),
    }
}

impl Monitor {
    /// Starts sampling the GPU with PCI bus id `pci_bus_id` (or NVML device 0 without one).
    /// Never fails: without NVML, [`Monitor::unavailable`] says why.
    pub fn start(pci_bus_id: Option<&str>) -> Monitor {
        let nvml = match Nvml::init() {
            Ok(n) => Arc::new(n),
            Err(e) => {
                return Monitor {
                    inner: Err(format!("NVML unavailable: {e}")),
                }
            }
        };
        let facts = {
            let dev = match pci_bus_id {
                Some(id) => nvml
                    .device_by_pci_bus_id(id)
                    .or_else(|_| nvml.device_by_index(0)),
                None => nvml.device_by_index(0),
            };
            let dev = match dev {
                Ok(d) => d,
                Err(e) => {
                    return Monitor {
                        inner: Err(format!("NVML unavailable: no device: {e}")),
                    }
                }
            };
            DeviceFacts {
                power_limit_w: dev
                    .enforced_power_limit()
                    .ok()
                    .map(|mw| f64::from(mw) / 1e3),
                max_sm_clock_mhz: dev.max_clock_info(Clock::SM).ok().map(f64::from),
                max_mem_clock_mhz: dev.max_clock_info(Clock::Memory).ok().map(f64::from),
                driver_version: nvml.sys_driver_version().ok(),
            }
        };
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s2, stop2, nvml2) = (samples.clone(), stop.clone(), nvml.clone());
        let id = pci_bus_id.map(str::to_string);
        std::thread::spawn(move || {
            let dev = match &id {
                Some(id) => nvml2
                    .device_by_pci_bus_id(id.as_str())
                    .or_else(|_| nvml2.device_by_index(0)),
                None => nvml2.device_by_index(0),
            };
            let Ok(dev) = dev else { return };
            let mut known_ours = BTreeSet::new();
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let s = take_sample(&dev, &mut known_ours);
                if let Ok(mut v) = s2.lock() {
                    v.push(s);
                    // Keep about an hour of samples.
                    if v.len() > 150_000 {
                        v.drain(..50_000);
                    }
                }
                std::thread::sleep(SAMPLE_PERIOD);
            }
        });
        Monitor {
            inner: Ok(Running {
                samples,
                stop,
                facts,
            }),
        }
    }

    /// Why there is no NVML, when there is none.
    pub fn unavailable(&self) -> Option<&str> {
        self.inner.as_ref().err().map(String::as_str)
    }

    /// The device's fixed facts (empty without NVML).
    pub fn facts(&self) -> DeviceFacts {
        self.inner
            .as_ref()
            .map(|r| r.facts.clone())
            .unwrap_or_default()
    }

    /// Processes using the GPU now (latest sample), other than this process tree.
    pub fn other_processes_now(&self) -> Vec<String> {
        std::thread::sleep(SAMPLE_PERIOD * 2);
        let Ok(r) = &self.inner else {
            return Vec::new();
        };
        let v = r.samples.lock().map(|v| v.last().cloned()).ok().flatten();
        v.map(|s| s.others).unwrap_or_default()
    }

    /// The device's state over `[t0, t1]` (Unix seconds): median SM and memory clocks and
    /// power, highest temperature, every throttle reason and other process seen. When no sample
    /// falls in the span, the nearest one is used. `None` without NVML.
    pub fn state(&self, window: [f64; 2]) -> Option<MachineState> {
        let r = self.inner.as_ref().ok()?;
        // Let the sampler catch up with the end of the span.
        std::thread::sleep(SAMPLE_PERIOD);
        let all = r.samples.lock().ok()?;
        let [t0, t1] = window;
        let mut picked: Vec<&Sample> = all.iter().filter(|s| s.at >= t0 && s.at <= t1).collect();
        if picked.is_empty() {
            let mid = 0.5 * (t0 + t1);
            picked.extend(
                all.iter()
                    .min_by(|a, b| (a.at - mid).abs().total_cmp(&(b.at - mid).abs())),
            );
        }
        if picked.is_empty() {
            return None;
        }
        let median = |f: &dyn Fn(&Sample) -> Option<f64>| {
            let mut v: Vec<f64> = picked.iter().filter_map(|s| f(s)).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            (!v.is_empty()).then(|| quantile(&v, 0.5))
        };
        let mut throttle = BTreeSet::new();
        let mut other = BTreeSet::new();
        for s in &picked {
            throttle.extend(s.throttle.iter().cloned());
            other.extend(s.others.iter().cloned());
        }
        Some(MachineState {
            sm_clock_mhz: median(&|s| s.sm_mhz),
            max_sm_clock_mhz: r.facts.max_sm_clock_mhz,
            mem_clock_mhz: median(&|s| s.mem_mhz),
            temperature_c: picked
                .iter()
                .filter_map(|s| s.temp_c)
                .max_by(|a, b| a.total_cmp(b)),
            power_w: median(&|s| s.power_w),
            power_limit_w: r.facts.power_limit_w,
            throttle_reasons: throttle.into_iter().collect(),
            other_processes: other.into_iter().collect(),
        })
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        if let Ok(r) = &self.inner {
            r.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Parent of `pid` from `/proc/<pid>/stat`.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: read after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// True when `pid` is this process or one of its descendants.
fn ours(pid: u32) -> bool {
    let me = std::process::id();
    let mut p = pid;
    for _ in 0..64 {
        if p == me {
            return true;
        }
        match parent_of(p) {
            Some(pp) if pp != p && pp > 0 => p = pp,
            _ => return false,
        }
    }
    false
}

/// `pid name` of the processes in `pids` that are not this process tree. `known_ours`
/// remembers the pids found to be ours while they lived, so that a case process that has just
/// exited is not reported as another one.
fn others(pids: &[u32], known_ours: &mut BTreeSet<u32>) -> Vec<String> {
    pids.iter()
        .filter(|&&p| {
            if known_ours.contains(&p) {
                return false;
            }
            if ours(p) {
                known_ours.insert(p);
                return false;
            }
            true
        })
        .map(|&p| {
            let name = std::fs::read_to_string(format!("/proc/{p}/comm"))
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "?".into());
            format!("{p} {name}")
        })
        .collect()
}

/// The host CPU model from `/proc/cpuinfo`.
pub fn host_cpu() -> Option<String> {
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    s.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// The document's device for a CPU run (`--device cpu`): the CPU model, its hardware threads
/// and the OS; and the last-level cache size in bytes (the cache rotation's target), 0 when
/// unknown.
pub fn cpu_device() -> (crate::schema::Device, u64) {
    let cpu = host_cpu();
    let device = crate::schema::Device {
        kind: crate::schema::DeviceKind::Cpu,
        name: cpu.clone().unwrap_or_else(|| "unknown CPU".into()),
        compute_capability: None,
        sm_count: None,
        memory_mb: None,
        l2_mb: None,
        driver_version: None,
        cuda_version: None,
        cpu_threads: std::thread::available_parallelism()
            .ok()
            .map(|n| n.get() as u32),
        host_cpu: cpu,
        os: os(),
        nvrtc_arch: None,
        power_limit_w: None,
        max_sm_clock_mhz: None,
        max_mem_clock_mhz: None,
    };
    (device, last_level_cache_bytes().unwrap_or(0))
}

/// The libraries the project's CPU code runs on, by the versions `Cargo.toml` asks for.
pub fn cpu_libraries() -> std::collections::BTreeMap<String, String> {
    [("gemm", "0.18"), ("rayon", "1")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Size of the largest cache of CPU 0, bytes (`/sys/devices/system/cpu/cpu0/cache/index*/`).
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let size = std::fs::read_to_string(e.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1024),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1024 * 1024),
                None => (size, 1),
            },
        };
        num.parse::<u64>().ok().map(|n| n * mult)
    })
    .max()
}

/// The operating system (`/etc/os-release` `PRETTY_NAME`) and kernel release.
pub fn os() -> Option<String> {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| format!("Linux {}", s.trim()));
    match (pretty, kernel) {
        (Some(p), Some(k)) => Some(format!("{p}, {k}")),
        (p, k) => p.or(k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_tree_is_ours() {
        assert!(ours(std::process::id()));
        let mut child = std::process::Command::new("sleep")
            .arg("2")
            .spawn()
            .unwrap();
        assert!(ours(child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        // pid 1 is never ours (unless the test runs as init).
        if std::process::id() != 1 {
            assert!(!ours(1));
            let mut known = BTreeSet::new();
            assert_eq!(others(&[1], &mut known).len(), 1);
            let me = std::process::id();
            assert!(others(&[me], &mut known).is_empty());
            assert!(known.contains(&me), "remembered as ours");
        }
    }

    #[test]
    fn without_nvml_the_monitor_says_so() {
        let m = Monitor::start(None);
        match m.unavailable() {
            Some(why) => {
                assert!(why.starts_with("NVML unavailable"), "{why}");
                assert!(m.state([0.0, 1.0]).is_none());
                assert_eq!(m.facts(), DeviceFacts::default());
            }
            None => {
                // A GPU machine: a state over the last moment exists.
                let now = unix_now();
                std::thread::sleep(SAMPLE_PERIOD * 3);
                assert!(m.state([now, unix_now()]).is_some());
            }
        }
    }

    #[test]
    fn host_facts_read_on_linux() {
        if std::path::Path::new("/proc/cpuinfo").exists() {
            assert!(os().is_some());
            let (d, llc) = cpu_device();
            assert_eq!(d.kind, crate::schema::DeviceKind::Cpu);
            assert!(d.cpu_threads.unwrap() >= 1 && d.os.is_some());
            if std::path::Path::new("/sys/devices/system/cpu/cpu0/cache").exists() {
                assert!(llc > 0);
            }
        }
    }
}
