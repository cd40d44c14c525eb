//! What the harness reads from the GPUs, behind a trait: NVML on a real fleet ([`NvmlBackend`]),
//! scripted readings in tests ([`ScriptedGpus`]).
//!
//! Two readers use it: the fleet, which records at start which compute processes its replicas
//! put on their cards ([`FleetGpus`]), and the evidence sampler, which samples clocks, throttle
//! reasons and processes through a cell. An emulated fleet reads no GPU at all: it never opens a
//! backend.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub use nvml_wrapper::bitmasks::device::ThrottleReasons;

/// One reading of a card's clocks.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    /// SM clock, MHz (`None`: not readable).
    pub sm_clock_mhz: Option<u32>,
    /// GPU temperature, °C (`None`: not readable).
    pub temperature_c: Option<u32>,
    /// Current clock-throttle reasons, or why they could not be read.
    pub throttle: Result<ThrottleReasons, String>,
}

/// The processes on a card: only compute ones can spoil a cell (a desktop compositor is a
/// graphics process).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuProcesses {
    /// Pids with a compute context (CUDA), or why NVML could not list them. In a container
    /// these are host pids, which `/proc` may not show.
    pub compute: Result<Vec<u32>, String>,
    /// Pids with a graphics context only.
    pub graphics: Result<Vec<u32>, String>,
}

/// What the harness reads from the GPUs, per NVML device index.
pub trait GpuBackend: Send + Sync + fmt::Debug {
    /// Cards visible to NVML.
    fn device_count(&self) -> Result<u32, String>;
    /// Name of card `device` (`None`: not readable).
    fn name(&self, device: u32) -> Option<String>;
    /// UUID of card `device` (`GPU-…`), to resolve `CUDA_VISIBLE_DEVICES` entries given as UUIDs.
    fn uuid(&self, device: u32) -> Option<String>;
    /// Clocks, temperature and throttle reasons of card `device` now.
    fn read(&self, device: u32) -> Result<GpuReading, String>;
    /// The processes on card `device` now.
    fn processes(&self, device: u32) -> GpuProcesses;
}

/// Opens NVML, or says why it cannot (no library, no driver): evidence, not an error.
pub fn open_nvml() -> Result<Arc<dyn GpuBackend>, String> {
    NvmlBackend::open().map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
}

/// [`GpuBackend`] over `nvml-wrapper`.
pub struct NvmlBackend {
    nvml: nvml_wrapper::Nvml,
}

impl fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NvmlBackend")
    }
}

impl NvmlBackend {
    /// Loads and initialises NVML; `Err("NVML unavailable: …")` without the library or driver.
    pub fn open() -> Result<NvmlBackend, String> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| NvmlBackend { nvml })
            .map_err(|e| format!("NVML unavailable: {e}"))
    }

    fn device(&self, device: u32) -> Result<nvml_wrapper::Device<'_>, String> {
        self.nvml
            .device_by_index(device)
            .map_err(|e| format!("GPU {device}: {e}"))
    }
}

impl GpuBackend for NvmlBackend {
    fn device_count(&self) -> Result<u32, String> {
        self.nvml.device_count().map_err(|e| e.to_string())
    }

    fn name(&self, device: u32) -> Option<String> {
        self.device(device).ok()?.name().ok()
    }

    fn uuid(&self, device: u32) -> Option<String> {
        self.device(device).ok()?.uuid().ok()
    }

    fn read(&self, device: u32) -> Result<GpuReading, String> {
        use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
        let d = self.device(device)?;
        Ok(GpuReading {
            sm_clock_mhz: d.clock_info(Clock::SM).ok(),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            throttle: d.current_throttle_reasons().map_err(|e| e.to_string()),
        })
    }

    fn processes(&self, device: u32) -> GpuProcesses {
        let pids = |r: Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, _>| {
            r.map(|ps| ps.iter().map(|p| p.pid).collect())
                .map_err(|e: nvml_wrapper::error::NvmlError| e.to_string())
        };
        match self.device(device) {
            Ok(d) => GpuProcesses {
                compute: pids(d.running_compute_processes()),
                graphics: pids(d.running_graphics_processes()),
            },
            Err(e) => GpuProcesses {
                compute: Err(e.clone()),
                graphics: Err(e),
            },
        }
    }
}

/// Reasons that say nothing about the card's health: idle, or clocks an operator pinned.
const BENIGN: ThrottleReasons =
    ThrottleReasons::GPU_IDLE.union(ThrottleReasons::APPLICATIONS_CLOCKS_SETTING);

/// True when `reasons` hold anything beyond idle and application clocks (the share calibration
/// measures, `GpuSummary::throttle_share`).
pub fn is_throttling(reasons: ThrottleReasons) -> bool {
    !reasons.difference(BENIGN).is_empty()
}

/// The throttle reasons as the evidence names them, most serious first: `thermal slowdown`
/// (hardware or software), `hardware slowdown`, `power brake`, `power cap`, `sync boost`,
/// `display clocks`.
pub fn throttle_groups(reasons: ThrottleReasons) -> Vec<&'static str> {
    const GROUPS: [(&str, ThrottleReasons); 6] = [
        (
            "thermal slowdown",
            ThrottleReasons::HW_THERMAL_SLOWDOWN.union(ThrottleReasons::SW_THERMAL_SLOWDOWN),
        ),
        ("hardware slowdown", ThrottleReasons::HW_SLOWDOWN),
        ("power brake", ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN),
        ("power cap", ThrottleReasons::SW_POWER_CAP),
        ("sync boost", ThrottleReasons::SYNC_BOOST),
        ("display clocks", ThrottleReasons::DISPLAY_CLOCK_SETTING),
    ];
    GROUPS
        .iter()
        .filter(|(_, flags)| reasons.intersects(*flags))
        .map(|(name, _)| *name)
        .collect()
}

/// The NVML devices of one `CUDA_VISIBLE_DEVICES` value: comma-separated indices, or `GPU-…`
/// UUIDs (a prefix is enough, as for CUDA) looked up through `backend`. Indices are taken as NVML
/// indices, which match CUDA's numbering under `CUDA_DEVICE_ORDER=PCI_BUS_ID` (and on a box of
/// identical cards). MIG instances are not resolved.
pub fn resolve_devices(
    visible: &str,
    backend: Option<&dyn GpuBackend>,
) -> Result<Vec<u32>, String> {
    let mut devices = Vec::new();
    for entry in visible.split(',').map(str::trim) {
        if let Ok(index) = entry.parse::<u32>() {
            devices.push(index);
            continue;
        }
        if entry.starts_with("GPU-")
            && let Some(b) = backend
        {
            let count = b.device_count()?;
            match (0..count).find(|&d| b.uuid(d).is_some_and(|u| u.starts_with(entry))) {
                Some(d) => devices.push(d),
                None => return Err(format!("no card has the UUID {entry}")),
            }
            continue;
        }
        return Err(format!(
            "CUDA_VISIBLE_DEVICES entry {entry:?} is neither an index nor a GPU UUID NVML could look up"
        ));
    }
    if devices.is_empty() {
        return Err("no card given".into());
    }
    Ok(devices)
}

/// Compute pids per NVML device, or why they could not be listed.
pub type PidsByDevice = BTreeMap<u32, Result<BTreeSet<u32>, String>>;

/// What the evidence sampler knows about the fleet's GPUs; [`crate::Fleet::gpus`] fills it.
#[derive(Debug, Clone, Default)]
pub enum FleetGpus {
    /// Not said (or a static fleet, whose cards are managed elsewhere): the sampler opens NVML
    /// itself, and checks every card it shows. A compute process `/proc` cannot see cannot be
    /// told apart, so the foreign-process check says it is unavailable.
    #[default]
    Unknown,
    /// An emulated fleet: no GPU is read and NVML is never opened; the engines' lateness is the
    /// evidence.
    Emulated,
    /// A CPU fleet (llama.cpp): no GPU is read and NVML is never opened.
    Cpu,
    /// A fleet that started its replicas on known cards.
    Started(StartedGpus),
}

/// The cards of a fleet that started its own replicas, and what it saw on them while starting.
#[derive(Debug, Clone)]
pub struct StartedGpus {
    /// The backend the fleet opened, or why it could not (the sampler then reports no GPU).
    pub backend: Result<Arc<dyn GpuBackend>, String>,
    /// Per replica in fleet order: its NVML devices, or why they are not known.
    pub replica_devices: Vec<Result<Vec<u32>, String>>,
    /// Per device of the fleet: the compute pids that appeared on it between spawning the
    /// replicas and their readiness (the fleet's, even where `/proc` cannot see them), or why
    /// the list could not be read. A process already there before the spawn is not the fleet's.
    pub started_pids: PidsByDevice,
}

impl StartedGpus {
    /// Device → the replicas on it, for every replica whose devices are known.
    pub fn devices(&self) -> BTreeMap<u32, Vec<usize>> {
        let mut map: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (replica, devices) in self.replica_devices.iter().enumerate() {
            for &d in devices.iter().flatten() {
                map.entry(d).or_default().push(replica);
            }
        }
        map
    }
}

/// Compute pids on each of `devices` now (for the before/after lists at fleet start).
pub fn compute_pids(
    backend: &dyn GpuBackend,
    devices: impl IntoIterator<Item = u32>,
) -> PidsByDevice {
    devices
        .into_iter()
        .map(|d| {
            let pids = backend
                .processes(d)
                .compute
                .map(|p| p.into_iter().collect())
                .map_err(|e| format!("GPU {d}: compute processes not listed ({e})"));
            (d, pids)
        })
        .collect()
}

/// A scripted [`GpuBackend`] for tests: per card, a queue of readings and of process lists;
/// each call takes the next one, and the last one repeats. Counts every call, so a test can
/// assert that nothing read the GPUs.
#[derive(Debug, Default)]
pub struct ScriptedGpus {
    cards: Vec<ScriptedCard>,
    calls: AtomicUsize,
}

#[derive(Debug, Default)]
struct ScriptedCard {
    uuid: String,
    readings: Mutex<VecDeque<GpuReading>>,
    processes: Mutex<VecDeque<GpuProcesses>>,
}

impl ScriptedGpus {
    /// `cards` cards named `scripted`, UUIDs `GPU-card-<i>`, with nothing scripted yet.
    pub fn new(cards: u32) -> ScriptedGpus {
        ScriptedGpus {
            cards: (0..cards)
                .map(|i| ScriptedCard {
                    uuid: format!("GPU-card-{i}"),
                    ..ScriptedCard::default()
                })
                .collect(),
            calls: AtomicUsize::new(0),
        }
    }

    /// Appends a reading of `device` with these throttle reasons (1410 MHz, 60 °C).
    pub fn push_throttle(&self, device: u32, reasons: ThrottleReasons) -> &ScriptedGpus {
        self.push_reading(
            device,
            GpuReading {
                sm_clock_mhz: Some(1410),
                temperature_c: Some(60),
                throttle: Ok(reasons),
            },
        )
    }

    /// Appends a reading of `device`.
    pub fn push_reading(&self, device: u32, reading: GpuReading) -> &ScriptedGpus {
        lock(&self.cards[device as usize].readings).push_back(reading);
        self
    }

    /// Appends a process list of `device`: these compute and graphics-only pids.
    pub fn push_processes(&self, device: u32, compute: &[u32], graphics: &[u32]) -> &ScriptedGpus {
        lock(&self.cards[device as usize].processes).push_back(GpuProcesses {
            compute: Ok(compute.to_vec()),
            graphics: Ok(graphics.to_vec()),
        });
        self
    }

    /// Calls made so far, of any method.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    fn card(&self, device: u32) -> Result<&ScriptedCard, String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.cards
            .get(device as usize)
            .ok_or_else(|| format!("GPU {device}: no such card"))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The next scripted item: the front one, kept when it is the last.
fn next<T: Clone>(queue: &Mutex<VecDeque<T>>) -> Option<T> {
    let mut q = lock(queue);
    if q.len() > 1 {
        q.pop_front()
    } else {
        q.front().cloned()
    }
}

impl GpuBackend for ScriptedGpus {
    fn device_count(&self) -> Result<u32, String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(self.cards.len() as u32)
    }

    fn name(&self, device: u32) -> Option<String> {
        self.card(device).ok().map(|_| "scripted".to_string())
    }

    fn uuid(&self, device: u32) -> Option<String> {
        self.card(device).ok().map(|c| c.uuid.clone())
    }

    fn read(&self, device: u32) -> Result<GpuReading, String> {
        next(&self.card(device)?.readings).ok_or_else(|| format!("GPU {device}: nothing scripted"))
    }

    fn processes(&self, device: u32) -> GpuProcesses {
        let scripted = self.card(device).ok().and_then(|c| next(&c.processes));
        scripted.unwrap_or_else(|| GpuProcesses {
            compute: Ok(vec![]),
            graphics: Ok(vec![]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_reasons_are_grouped_and_idle_is_not_throttling() {
        let idle = ThrottleReasons::GPU_IDLE | ThrottleReasons::APPLICATIONS_CLOCKS_SETTING;
        assert!(!is_throttling(idle));
        assert!(throttle_groups(idle).is_empty());
        let hot = ThrottleReasons::SW_THERMAL_SLOWDOWN | ThrottleReasons::SW_POWER_CAP;
        assert!(is_throttling(hot));
        assert_eq!(throttle_groups(hot), ["thermal slowdown", "power cap"]);
        assert_eq!(
            throttle_groups(ThrottleReasons::HW_THERMAL_SLOWDOWN),
            ["thermal slowdown"]
        );
    }

    #[test]
    fn visible_devices_resolve_by_index_and_uuid() {
        let gpus = ScriptedGpus::new(4);
        assert_eq!(resolve_devices("3", None), Ok(vec![3]));
        assert_eq!(resolve_devices("0, 2", None), Ok(vec![0, 2]));
        assert_eq!(resolve_devices("GPU-card-2", Some(&gpus)), Ok(vec![2]));
        assert!(resolve_devices("GPU-card-9", Some(&gpus)).is_err());
        assert!(resolve_devices("GPU-card-2", None).is_err());
        assert!(resolve_devices("MIG-1", Some(&gpus)).is_err());
    }

    #[test]
    fn scripted_items_advance_and_the_last_repeats() {
        let gpus = ScriptedGpus::new(1);
        gpus.push_processes(0, &[1], &[])
            .push_processes(0, &[1, 2], &[]);
        assert_eq!(gpus.processes(0).compute, Ok(vec![1]));
        assert_eq!(gpus.processes(0).compute, Ok(vec![1, 2]));
        assert_eq!(gpus.processes(0).compute, Ok(vec![1, 2]));
        assert!(gpus.read(0).is_err(), "nothing scripted");
        assert_eq!(gpus.calls(), 4);
    }
}
