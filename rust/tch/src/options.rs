//! What a Rust program sets for a group, and how it learns where it runs: group options over
//! rsccl-core's one settings table (`rsccl_core::config::SETTINGS`, the same fields as
//! Python's `rsccl.Options` and the same RSCCL_* variables), the group timeout, the GPU, and
//! torchrun's launch variables.

use std::time::Duration;

use rsccl_core::config::{Config, SETTINGS};
use rsccl_core::{Error, Result};

/// torch's default process-group timeout (`torch.distributed.default_pg_timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Which GPU a group's CUDA engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaDevice {
    /// `LOCAL_RANK` when libtorch sees CUDA devices (modulo their number: ranks then
    /// share GPUs, which the CUDA engine accepts only where allowed), none otherwise.
    Auto,
    /// This GPU.
    Index(i32),
    /// No CUDA engine: CPU tensors only (CUDA tensors are refused with an error).
    None,
}

/// Settings of one group: the tunables of rsccl-core's settings table (fields as
/// `rsccl.Options` names them; unset ones fall back to their RSCCL_* variable, then to
/// the default), the timeout, and the GPU.
#[derive(Debug, Clone)]
pub struct Options {
    settings: Vec<(String, String)>,
    pub timeout: Duration,
    pub cuda_device: CudaDevice,
}

impl Default for Options {
    fn default() -> Self {
        Options { settings: Vec::new(), timeout: DEFAULT_TIMEOUT, cuda_device: CudaDevice::Auto }
    }
}

impl Options {
    pub fn new() -> Options {
        Options::default()
    }

    /// Set a tunable by its field name (see `settings()`): a number, or a size such as
    /// "8MiB". Unknown fields and bad values are an `Error::Config` naming them.
    pub fn set(mut self, field: &str, value: impl ToString) -> Result<Options> {
        let v = value.to_string();
        self.settings.retain(|(k, _)| k != field);
        self.settings.push((field.to_string(), v));
        // Check now (the environment included), so the error points at this call.
        Config::resolve_values(&self.settings, &|k| std::env::var_os(k))?;
        Ok(self)
    }

    pub fn timeout(mut self, t: Duration) -> Options {
        self.timeout = t;
        self
    }

    pub fn cuda_device(mut self, d: CudaDevice) -> Options {
        self.cuda_device = d;
        self
    }

    /// The (field, value) pairs set so far.
    pub fn items(&self) -> &[(String, String)] {
        &self.settings
    }

    /// Every tunable's value as the group will use it: these options, else the RSCCL_*
    /// variable, else the default.
    pub fn resolved(&self) -> Result<Vec<(&'static str, u64)>> {
        Config::resolve_values(&self.settings, &|k| std::env::var_os(k))
    }

    pub(crate) fn config(&self) -> Result<Config> {
        Config::from_env(&self.settings)
    }
}

/// One row of the settings table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingInfo {
    pub field: &'static str,
    pub env: &'static str,
    pub default: u64,
    pub is_size: bool,
    pub help: String,
}

/// rsccl's tunables: the table `rsccl.settings_table()` shows in Python.
pub fn settings() -> Vec<SettingInfo> {
    SETTINGS
        .iter()
        .map(|s| SettingInfo {
            field: s.field,
            env: s.env,
            default: s.default,
            is_size: s.is_size,
            help: s.help.split_whitespace().collect::<Vec<_>>().join(" "),
        })
        .collect()
}

/// Where this process runs, as torchrun (or a launcher that sets the same variables)
/// tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True); otherwise
    /// rank 0 hosts it.
    pub agent_store: bool,
    /// TORCHELASTIC_RESTART_COUNT: torch's workers keep each restart's keys apart.
    pub restart_count: u64,
}

impl LaunchEnv {
    pub fn from_env() -> Result<LaunchEnv> {
        LaunchEnv::parse(&|k| std::env::var(k).ok())
    }

    /// From `get` (looks a variable up): a pure function, tested without a process.
    pub fn parse(get: &dyn Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let need = |k: &str| -> Result<String> {
            get(k).filter(|v| !v.is_empty()).ok_or_else(|| {
                Error::Config(format!(
                    "{k} is not set: launch with torchrun (torchrun --nproc_per_node=N --no-python ./program), or set \
                     RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                ))
            })
        };
        let num = |k: &str| -> Result<usize> {
            let v = need(k)?;
            v.trim().parse::<usize>().map_err(|_| Error::Config(format!("{k} = {v:?} is not a non-negative integer")))
        };
        let rank = num("RANK")?;
        let world_size = num("WORLD_SIZE")?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!("RANK = {rank} is not a rank of WORLD_SIZE = {world_size}")));
        }
        // Without torchrun a single-host job may leave the local variables out: then every
        // rank is local.
        let local_rank = if get("LOCAL_RANK").is_some() { num("LOCAL_RANK")? } else { rank };
        let local_world_size = if get("LOCAL_WORLD_SIZE").is_some() { num("LOCAL_WORLD_SIZE")? } else { world_size };
        if local_world_size == 0 || local_rank >= local_world_size || local_world_size > world_size {
            return Err(Error::Config(format!(
                "LOCAL_RANK = {local_rank}, LOCAL_WORLD_SIZE = {local_world_size} do not fit WORLD_SIZE = {world_size}"
            )));
        }
        let master_addr = need("MASTER_ADDR")?;
        let port = need("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| Error::Config(format!("MASTER_PORT = {port:?} is not a TCP port")))?;
        let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
        let restart_count = get("TORCHELASTIC_RESTART_COUNT").and_then(|v| v.trim().parse().ok()).unwrap_or(0);
        Ok(LaunchEnv { rank, world_size, local_rank, local_world_size, master_addr, master_port, agent_store, restart_count })
    }

    /// The store prefix of this job's rsccl keys: under torchrun, torch's workers put
    /// theirs under "/worker/attempt_{restart}" (so a restarted job never reads a previous
    /// attempt's keys); rsccl's go below that.
    pub fn key_prefix(&self) -> String {
        if self.agent_store {
            format!("/worker/attempt_{}/rsccl-tch", self.restart_count)
        } else {
            "rsccl-tch".to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        let l = LaunchEnv::parse(&e).unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank, l.local_world_size), (3, 4, 1, 2));
        assert!(l.agent_store);
        assert_eq!(l.key_prefix(), "/worker/attempt_2/rsccl-tch");
    }

    #[test]
    fn bad_variables_are_named() {
        let e = LaunchEnv::parse(&env(&[("WORLD_SIZE", "2")])).unwrap_err().to_string();
        assert!(e.contains("RANK is not set") && e.contains("torchrun"), "{e}");
        let base = [("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "1")];
        let e = LaunchEnv::parse(&env(&base)).unwrap_err().to_string();
        assert!(e.contains("RANK = 2 is not a rank of WORLD_SIZE = 2"), "{e}");
        let e = LaunchEnv::parse(&env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_PORT = \"x\""), "{e}");
        let l = LaunchEnv::parse(&env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "9")])).unwrap();
        assert_eq!((l.local_rank, l.local_world_size, l.agent_store), (1, 2, false));
    }

    #[test]
    fn options_use_the_settings_table() {
        let o = Options::new().set("host_buffer_bytes", "8MiB").unwrap();
        let v = o.resolved().unwrap();
        assert_eq!(v.iter().find(|(f, _)| *f == "host_buffer_bytes").unwrap().1, 8 << 20);
        let e = Options::new().set("no_such_field", 1).unwrap_err().to_string();
        assert!(e.contains("no_such_field") && e.contains("host_buffer_bytes"), "{e}");
        assert!(settings().iter().any(|s| s.env == "RSCCL_HOST_BUFFER_BYTES"));
    }
}
