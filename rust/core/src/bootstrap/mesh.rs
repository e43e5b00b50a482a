//! The local mesh: one Unix connection between every pair of ranks of a group on a host.
//! It carries the host region's descriptor once, then serves as the liveness signal: the
//! kernel closes a process's sockets when it exits, however it exits, so a peer's
//! end-of-file means that rank is gone.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

use super::unix::{Conn, Listener};
use crate::error::{Error, Result};
use crate::memory::HostRegion;

const HELLO_MAGIC: &[u8; 4] = b"RSH1";
const REGION_MAGIC: &[u8; 4] = b"RSR1";

/// Connections to the other local ranks, indexed by local index (None for self), and a
/// pidfd per peer: a socket's end-of-file is not enough when a rank forked children (a
/// DataLoader's workers inherit its sockets and keep them open after it dies), but a
/// pidfd becomes readable when that very process exits.
pub struct LocalMesh {
    conns: Vec<Option<Conn>>,
    pidfds: Vec<Option<OwnedFd>>,
    me: usize,
    /// Group rank of each local index (for messages).
    ranks: Vec<usize>,
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: plain syscall; on success the returned descriptor is ours to own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative return is a fresh descriptor (kernels before 5.3: ENOSYS,
    // and liveness falls back to the sockets alone).
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; timeout 0 never blocks.
    unsafe { libc::poll(&mut p, 1, 0) > 0 && p.revents & libc::POLLIN != 0 }
}

impl LocalMesh {
    /// Connect to every lower local index, accept every higher one. `ranks` are the group
    /// ranks on this host (local index -> group rank); `listener` was bound at a random
    /// name before this rank published it in its record, so peers that read the record
    /// can connect, and it carries the names the peers published (`set_peer_names`).
    /// `watch`: the peers' pidfds (`SetupWatch::fds`), so a peer that dies ends the waits
    /// at once.
    pub fn connect(
        listener: Listener,
        nonce: &[u8; 16],
        ranks: &[usize],
        me: usize,
        deadline: Instant,
        watch: &[RawFd],
    ) -> Result<LocalMesh> {
        let n = ranks.len();
        let mut conns: Vec<Option<Conn>> = (0..n).map(|_| None).collect();
        for (j, slot) in conns.iter_mut().enumerate().take(me) {
            let c = Conn::connect(listener.peer_name(ranks[j])?, deadline, watch).map_err(|e| match e {
                Error::Timeout(m) => {
                    Error::Timeout(format!("rank {} did not accept a connection from rank {} in time: {m}", ranks[j], ranks[me]))
                }
                other => other,
            })?;
            c.send(&hello(nonce, me), None)?;
            *slot = Some(c);
        }
        let mut missing = n - 1 - me;
        while missing > 0 {
            let c = listener.accept(deadline, watch).map_err(|e| match e {
                Error::Timeout(m) => {
                    let late: Vec<String> = (me + 1..n).filter(|&j| conns[j].is_none()).map(|j| format!("rank {}", ranks[j])).collect();
                    Error::Timeout(format!("{} did not connect to rank {} in time ({m})", late.join(", "), ranks[me]))
                }
                other => other,
            })?;
            // A peer of this group sends its hello right after connecting; anything else
            // (a stranger who found the name) is dropped without failing set-up.
            let hello_deadline = deadline.min(Instant::now() + std::time::Duration::from_secs(10));
            let mut buf = [0u8; 24];
            if let Err(e) = c.recv(&mut buf, hello_deadline, watch) {
                if watch_fired(watch) {
                    return Err(e);
                }
                tracing::warn!(error = %e, "dropped a local connection that sent no hello");
                continue;
            }
            let j = u32::from_le_bytes(buf[20..24].try_into().unwrap()) as usize;
            if &buf[..4] != HELLO_MAGIC || buf[4..20] != nonce[..] || j <= me || j >= n || conns[j].is_some() {
                tracing::warn!("dropped a local connection with a foreign hello");
                continue;
            }
            conns[j] = Some(c);
            missing -= 1;
        }
        // Dropping the listener removes the abstract name: nothing named outlives set-up.
        drop(listener);
        // The peer's pid comes from the kernel (SO_PEERCRED), not from what it told us.
        let pidfds =
            conns.iter().map(|c| c.as_ref().and_then(|c| c.peer_cred().ok()).and_then(|cred| pidfd_open(cred.pid as u32))).collect();
        Ok(LocalMesh { conns, pidfds, me, ranks: ranks.to_vec() })
    }

    /// The pid of the peer at local index `j`, as the kernel reports it for its connection
    /// (SO_PEERCRED); None for this rank itself or a connection that is gone.
    pub fn peer_pid(&self, j: usize) -> Option<u32> {
        self.conns.get(j)?.as_ref()?.peer_cred().ok().map(|c| c.pid as u32)
    }

    /// The peers' pidfds, for waits that should end when one exits.
    fn watch(&self) -> Vec<RawFd> {
        self.pidfds.iter().flatten().map(|fd| fd.as_raw_fd()).collect()
    }

    /// Name the peer (local index `j`) in an error from its connection.
    fn naming_peer(&self, j: usize, e: Error) -> Error {
        let r = self.ranks.get(j).copied().unwrap_or(j);
        match e {
            Error::Timeout(m) => Error::Timeout(format!("rank {r} did not answer in time: {m}")),
            Error::PeerFailure(m) => Error::PeerFailure(format!("rank {r}: {m}")),
            Error::Os { context, source } => Error::Os { context: format!("{context} (rank {r})"), source },
            other => other,
        }
    }

    /// Local index 0 creates the region and sends it to the others; they map it.
    pub fn share_region(&self, len: usize, deadline: Instant) -> Result<HostRegion> {
        if self.me == 0 {
            let region = HostRegion::create(len)?;
            let mut msg = [0u8; 12];
            msg[..4].copy_from_slice(REGION_MAGIC);
            msg[4..].copy_from_slice(&(len as u64).to_le_bytes());
            for (j, c) in self.conns.iter().enumerate() {
                if let Some(c) = c {
                    c.send(&msg, Some(region.fd().as_raw_fd())).map_err(|e| self.naming_peer(j, e))?;
                }
            }
            Ok(region)
        } else {
            let c = self.conns[0].as_ref().ok_or_else(|| Error::Internal("no connection to local leader".into()))?;
            let mut msg = [0u8; 12];
            let fd = c.recv(&mut msg, deadline, &self.watch()).map_err(|e| self.naming_peer(0, e))?;
            let got = u64::from_le_bytes(msg[4..].try_into().unwrap()) as usize;
            if &msg[..4] != REGION_MAGIC || got != len {
                return Err(Error::PeerFailure(format!(
                    "local ranks disagree on the host region size ({got} vs {len} bytes): \
                     are RSCCL_* settings the same on every rank?"
                )));
            }
            let fd = fd.ok_or_else(|| Error::PeerFailure("the local leader sent no region descriptor".into()))?;
            HostRegion::open(fd, len)
        }
    }

    /// Send `msg` (and `fd`, if any) to every other local rank and receive theirs: a small
    /// all-gather over the mesh. Returns, per local index, the peer's message and
    /// descriptor (this rank's own slot holds `msg` and no descriptor). Sends never block
    /// for long (messages are small and socket buffers hold them), so every rank can send
    /// first and receive after.
    pub fn all_gather(
        &self,
        msg: &[u8; 64],
        fd: Option<std::os::fd::RawFd>,
        deadline: Instant,
    ) -> Result<Vec<([u8; 64], Option<OwnedFd>)>> {
        for (j, c) in self.conns.iter().enumerate() {
            if let Some(c) = c {
                c.send(msg, fd).map_err(|e| self.naming_peer(j, e))?;
            }
        }
        let watch = self.watch();
        let mut out = Vec::with_capacity(self.conns.len());
        for (j, c) in self.conns.iter().enumerate() {
            match c {
                None => out.push((*msg, None)),
                Some(c) => {
                    let mut buf = [0u8; 64];
                    let got = c.recv(&mut buf, deadline, &watch).map_err(|e| self.naming_peer(j, e))?;
                    out.push((buf, got));
                }
            }
        }
        Ok(out)
    }

    pub fn local_index(&self) -> usize {
        self.me
    }

    /// Local ranks in the mesh (this one included).
    pub fn size(&self) -> usize {
        self.conns.len()
    }

    /// Local indices whose process has gone (exited, or closed its connection).
    pub fn gone(&self) -> Vec<usize> {
        (0..self.conns.len())
            .filter(|&j| self.conns[j].as_ref().is_some_and(|c| c.peer_gone()) || self.pidfds[j].as_ref().is_some_and(exited))
            .collect()
    }
}

fn watch_fired(watch: &[RawFd]) -> bool {
    let mut p: Vec<libc::pollfd> = watch.iter().map(|&w| libc::pollfd { fd: w, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `p` is a valid array of pollfds of the length given; timeout 0 never blocks.
    !p.is_empty() && unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 0) } > 0
}

fn hello(nonce: &[u8; 16], me: usize) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..4].copy_from_slice(HELLO_MAGIC);
    b[4..20].copy_from_slice(nonce);
    b[20..24].copy_from_slice(&(me as u32).to_le_bytes());
    b
}
