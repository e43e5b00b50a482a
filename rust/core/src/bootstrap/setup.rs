//! Group creation's contract with failures: every wait is bounded by the group timeout; a
//! local rank that dies is noticed at once (its pidfd becomes readable the moment it
//! exits, whatever it was doing); and the error names the rank (group and global), its
//! pid, and what the group was doing ("rank 2 (pid 4711) exited while the group was
//! mapping its shared region").
//!
//! Also the one place that reads the test-only fault hook `RSCCL_TEST_EXIT_AT`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::rendezvous::{RankInfo, Topology};
use crate::error::{Error, Result};

/// The phases of group creation, in order. Each names what the group is doing in errors,
/// and the test hook can stop a rank at any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Publishing this rank's record in the c10d store and reading everyone's.
    Rendezvous,
    /// Connecting the Unix sockets between the ranks of a host.
    Mesh,
    /// Creating (local index 0) or mapping (the others) the host region.
    Region,
    /// Building the CUDA engine: GPU check, kernels, pool, warm-up.
    Cuda,
    /// Building the NCCL engine (groups across hosts): communicators and their warm-up.
    Nccl,
    /// Starting the host engine's threads. Nothing waits here; a death shows at the next
    /// collective.
    Engine,
}

pub const PHASES: &[Phase] = &[Phase::Rendezvous, Phase::Mesh, Phase::Region, Phase::Cuda, Phase::Nccl, Phase::Engine];

impl Phase {
    /// The hook's name for the phase.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Rendezvous => "rendezvous",
            Phase::Mesh => "mesh",
            Phase::Region => "region",
            Phase::Cuda => "cuda",
            Phase::Nccl => "nccl",
            Phase::Engine => "engine",
        }
    }

    /// Completes "while the group was ...".
    pub fn doing(self) -> &'static str {
        match self {
            Phase::Rendezvous => "exchanging rank records in the store",
            Phase::Mesh => "connecting its local sockets",
            Phase::Region => "mapping its shared region",
            Phase::Cuda => "creating its CUDA engine (pool, kernels, warm-up)",
            Phase::Nccl => "creating its NCCL communicators",
            Phase::Engine => "starting its host engine",
        }
    }
}

/// "rank 2 (pid 4711)", or "rank 2 (global rank 5, pid 4711)" where the two differ.
pub fn rank_label(rank: usize, global: usize, pid: u32) -> String {
    if rank == global {
        format!("rank {rank} (pid {pid})")
    } else {
        format!("rank {rank} (global rank {global}, pid {pid})")
    }
}

// ---- the test-only fault hook ----------------------------------------------------------

/// `RSCCL_TEST_EXIT_AT="phase=mesh,rank=2[,group=2][,delay_ms=15]"`: the process whose
/// group rank is `rank` kills itself (SIGKILL, as a crash or the OOM killer would) when
/// its `group`-th group creation (1 = init_process_group, the default) enters `phase`,
/// after `delay_ms` (0, the default: at once; else from a timer thread, so the death
/// lands somewhere inside the phase or later). For tests only; read once, here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitAt {
    pub phase: Phase,
    pub rank: usize,
    pub group: u64,
    pub delay_ms: u64,
}

pub const EXIT_AT_ENV: &str = "RSCCL_TEST_EXIT_AT";

impl ExitAt {
    pub fn parse(spec: &str) -> Result<ExitAt> {
        let bad =
            |why: String| Error::Config(format!("{EXIT_AT_ENV} = {spec:?}: {why} (expected \"phase=mesh,rank=2[,group=1][,delay_ms=0]\")"));
        let (mut phase, mut rank, mut group, mut delay_ms) = (None, None, 1, 0);
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("{part:?} is not key=value")))?;
            let num = || v.trim().parse::<u64>().map_err(|_| bad(format!("{k} = {v:?} is not a number")));
            match k.trim() {
                "phase" => {
                    phase = Some(PHASES.iter().copied().find(|p| p.name() == v.trim()).ok_or_else(|| {
                        bad(format!("no phase {v:?}; phases: {}", PHASES.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")))
                    })?)
                }
                "rank" => rank = Some(num()? as usize),
                "group" => group = num()?,
                "delay_ms" => delay_ms = num()?,
                other => return Err(bad(format!("unknown key {other:?}"))),
            }
        }
        Ok(ExitAt {
            phase: phase.ok_or_else(|| bad("no phase".into()))?,
            rank: rank.ok_or_else(|| bad("no rank".into()))?,
            group,
            delay_ms,
        })
    }
}

fn exit_at() -> Option<&'static ExitAt> {
    static SPEC: OnceLock<Option<ExitAt>> = OnceLock::new();
    SPEC.get_or_init(|| {
        let spec = crate::config::env_var(EXIT_AT_ENV).and_then(|v| v.filter(|v| !v.is_empty()).map(|v| ExitAt::parse(&v)).transpose());
        match spec {
            Ok(x) => x,
            Err(e) => {
                tracing::error!(error = %e, "ignoring the test fault hook");
                None
            }
        }
    })
    .as_ref()
}

/// This process's group creations so far (the hook's `group`).
static CREATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Count a group creation; returns its number (1-based) in this process.
pub fn count_creation() -> u64 {
    CREATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
}

/// The hook: called as creation number `creation` of group rank `rank` enters `phase`.
pub fn entering(phase: Phase, rank: usize, creation: u64) {
    let Some(x) = exit_at() else { return };
    if x.phase != phase || x.rank != rank || x.group != creation {
        return;
    }
    tracing::warn!(phase = phase.name(), rank, creation, delay_ms = x.delay_ms, "{EXIT_AT_ENV}: this rank kills itself");
    let die = || {
        // SAFETY: plain syscalls; SIGKILL of our own process is what the hook is for.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    };
    if x.delay_ms == 0 {
        die();
    } else {
        let d = Duration::from_millis(x.delay_ms);
        let _ = std::thread::Builder::new().name("rsccl-test-exit".into()).spawn(move || {
            std::thread::sleep(d);
            die();
        });
    }
}

// ---- watching the local peers while the group is created ---------------------------------

fn pidfd_open(pid: u32) -> std::result::Result<OwnedFd, i32> {
    // SAFETY: plain syscall; on success the returned descriptor is ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    // SAFETY: a non-negative return is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The other ranks of this host, watched through pidfds opened from their records while
/// the group is created. Opened right after the rendezvous, so a rank that dies at any
/// later step is seen by every wait that polls `fds()`.
pub struct SetupWatch {
    me: usize,
    /// Every group rank's label (for messages), from its record.
    labels: Vec<String>,
    /// (group rank, pidfd) of each local peer we could watch.
    peers: Vec<(usize, OwnedFd)>,
    /// Local peers whose pid was already gone when we looked (ESRCH).
    gone_early: Vec<usize>,
    creation: u64,
}

impl SetupWatch {
    pub fn new(topo: &Topology, infos: &[RankInfo], creation: u64) -> SetupWatch {
        let labels = infos.iter().enumerate().map(|(r, i)| rank_label(r, i.global_rank as usize, i.pid)).collect();
        let my_ns = infos.get(topo.rank).map_or(0, |i| i.pid_ns);
        let mut peers = Vec::new();
        let mut gone_early = Vec::new();
        for &r in topo.local_ranks() {
            let info = &infos[r];
            // A pid from another pid namespace names some other process here: watch only
            // peers that share ours (the sockets still tell when the others leave).
            if r == topo.rank || info.pid_ns == 0 || info.pid_ns != my_ns {
                continue;
            }
            match pidfd_open(info.pid) {
                Ok(fd) => peers.push((r, fd)),
                Err(libc::ESRCH) => gone_early.push(r),
                Err(_) => {} // kernels before 5.3: the sockets alone tell
            }
        }
        SetupWatch { me: topo.rank, labels, peers, gone_early, creation }
    }

    /// A watch of nothing (before the rendezvous).
    pub fn none(me: usize, creation: u64) -> SetupWatch {
        SetupWatch { me, labels: Vec::new(), peers: Vec::new(), gone_early: Vec::new(), creation }
    }

    /// Descriptors that become readable when a local peer exits: waits poll them beside
    /// their own socket.
    pub fn fds(&self) -> Vec<RawFd> {
        self.peers.iter().map(|(_, fd)| fd.as_raw_fd()).collect()
    }

    /// The label of group rank `r`.
    pub fn label(&self, r: usize) -> String {
        self.labels.get(r).cloned().unwrap_or_else(|| format!("rank {r}"))
    }

    /// Group ranks of local peers that have exited, after waiting up to `grace` for one
    /// to (a peer's sockets close a moment before its exit is signalled, so an error that
    /// a closed socket caused may come just before the pidfd says why).
    pub fn exited(&self, grace: Duration) -> Vec<usize> {
        let until = Instant::now() + grace;
        loop {
            let mut out = self.gone_early.clone();
            let mut p: Vec<libc::pollfd> =
                self.peers.iter().map(|(_, fd)| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
            let now = Instant::now();
            let ms = if out.is_empty() { until.saturating_duration_since(now).as_millis().min(1000) as i32 } else { 0 };
            if !p.is_empty() {
                // SAFETY: `p` is a valid array of pollfds of the length given.
                let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
                if rc > 0 {
                    out.extend(self.peers.iter().zip(&p).filter(|(_, q)| q.revents & libc::POLLIN != 0).map(|((r, _), _)| *r));
                }
            }
            if !out.is_empty() || Instant::now() >= until || p.is_empty() {
                out.sort_unstable();
                out.dedup();
                return out;
            }
        }
    }

    /// Run the hook for `phase`, then `f`; turn its failure into the named error the
    /// contract asks for. User errors (bad settings, arguments) pass unchanged.
    pub fn during<T>(&self, phase: Phase, f: impl FnOnce() -> Result<T>) -> Result<T> {
        entering(phase, self.me, self.creation);
        f().map_err(|e| self.explain(phase, e))
    }

    /// Name the rank that exited if one did (whatever failed here: a socket, a CUDA
    /// import of its memory); else keep the error's class and say which phase it came from.
    pub fn explain(&self, phase: Phase, e: Error) -> Error {
        if e.keeps_group_usable() || matches!(e, Error::Internal(_)) {
            return e;
        }
        let gone = self.exited(Duration::from_millis(500));
        if !gone.is_empty() {
            let who: Vec<String> = gone.iter().map(|&r| self.label(r)).collect();
            return Error::PeerFailure(format!(
                "{} exited while the group was {}; {} cannot finish creating it ({e})",
                who.join(", "),
                phase.doing(),
                self.label(self.me)
            ));
        }
        let ctx = format!("while the group was {}", phase.doing());
        match e {
            Error::Timeout(m) => Error::Timeout(format!("{m} ({ctx})")),
            Error::PeerFailure(m) => Error::PeerFailure(format!("{m} ({ctx})")),
            Error::Os { context, source } => Error::Os { context: format!("{context} ({ctx})"), source },
            Error::Cuda(m) => Error::Cuda(format!("{m} ({ctx})")),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::rendezvous::pid_namespace;

    #[test]
    fn exit_at_specs() {
        let x = ExitAt::parse("phase=mesh,rank=2").unwrap();
        assert_eq!(x, ExitAt { phase: Phase::Mesh, rank: 2, group: 1, delay_ms: 0 });
        let x = ExitAt::parse("phase=region, rank=0, group=3, delay_ms=17").unwrap();
        assert_eq!(x, ExitAt { phase: Phase::Region, rank: 0, group: 3, delay_ms: 17 });
        let e = ExitAt::parse("phase=nowhere,rank=1").unwrap_err().to_string();
        assert!(e.contains("no phase \"nowhere\"") && e.contains("rendezvous, mesh, region"), "{e}");
        assert!(ExitAt::parse("rank=1").unwrap_err().to_string().contains("no phase"));
        assert!(ExitAt::parse("phase=mesh,rank=x").is_err());
    }

    #[test]
    fn a_dead_child_is_named() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let info = |pid: u32, g: u32| RankInfo { pid, global_rank: g, pid_ns: pid_namespace(), host_id: "h".into(), ..Default::default() };
        let infos = vec![info(std::process::id(), 4), info(pid, 7)];
        let topo = Topology::from_infos(0, &infos);
        let w = SetupWatch::new(&topo, &infos, 1);
        assert_eq!(w.fds().len(), 1);
        assert!(w.exited(Duration::ZERO).is_empty());
        child.kill().unwrap();
        let e = w.explain(Phase::Region, Error::PeerFailure("a local rank closed its connection".into())).to_string();
        child.wait().unwrap();
        assert!(e.starts_with(&format!("rank 1 (global rank 7, pid {pid}) exited while the group was mapping its shared region")), "{e}");
        assert!(e.contains("rank 0 (global rank 4,"), "{e}");
        // User errors pass unchanged.
        assert!(matches!(w.explain(Phase::Mesh, Error::Config("x".into())), Error::Config(_)));
    }
}
