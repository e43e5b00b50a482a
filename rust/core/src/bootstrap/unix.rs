//! Unix-domain sockets between the ranks of one host: connection set-up, peer-credential
//! checks, file-descriptor passing (SCM_RIGHTS) and liveness.
//!
//! Sockets live in Linux's abstract namespace: nothing is created in the filesystem, and
//! the name disappears with the last descriptor, so a killed rank leaves nothing behind.
//! Any process in the network namespace could connect to an abstract name, so both ends
//! check the peer's credentials (SO_PEERCRED) and accept only the same user, and the
//! handshake carries a per-group random nonce.
//!
//! Anyone can also read the bound names (/proc/net/unix), and could bind a name first if
//! they could predict it. So no name can be known before its owner has bound it: each
//! rank binds a random name (`Listener::bind_random`) and only then publishes it in its
//! store record; peers connect to the name the record gives.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

fn abstract_addr(name: &[u8]) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > addr.sun_path.len() {
        return Err(Error::Internal(format!("socket name of {} bytes is too long", name.len())));
    }
    // Leading NUL selects the abstract namespace.
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

fn new_socket() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the returned descriptor is owned by the OwnedFd below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Error::last_os("creating a Unix socket"));
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening socket on an abstract name.
pub struct Listener {
    fd: OwnedFd,
    name: String,
    /// The names the group's ranks published (group rank -> name; empty until
    /// `set_peer_names`): the listener travels from the rendezvous to `LocalMesh::connect`
    /// through engines that do not read the records, and carries them along.
    peers: Vec<String>,
}

/// Tries of `bind_random` before it gives up on names that were taken.
const BIND_TRIES: usize = 4;

/// A fresh unpredictable name: "rsccl-" and 16 random bytes in hex.
fn random_name() -> Result<String> {
    let mut b = [0u8; 16];
    // SAFETY: `b` is writable for its 16 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    if n != b.len() as isize {
        return Err(Error::last_os("getrandom for a local socket name"));
    }
    Ok(format!("rsccl-{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>()))
}

impl Listener {
    /// Bind a random name (see the module's note). A name that is taken (someone else
    /// holds it: with 128 random bits, never by chance) is replaced by a new one, a few
    /// times, then it is an error that says so.
    pub fn bind_random(backlog: i32) -> Result<Listener> {
        Listener::bind_first_free(backlog, random_name)
    }

    fn bind_first_free(backlog: i32, mut next_name: impl FnMut() -> Result<String>) -> Result<Listener> {
        let mut taken = Vec::new();
        for _ in 0..BIND_TRIES {
            let name = next_name()?;
            match Listener::bind(&name, backlog) {
                Err(Error::Os { source, .. }) if source.raw_os_error() == Some(libc::EADDRINUSE) => taken.push(format!("@{name}")),
                other => return other,
            }
        }
        Err(Error::PeerFailure(format!(
            "could not bind a local socket for group set-up: the random names {} were all taken by \
             other processes (check /proc/net/unix for who holds them)",
            taken.join(", ")
        )))
    }

    /// The abstract name (without the leading NUL).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Record the socket names the group's ranks published (indexed by group rank).
    pub fn set_peer_names(&mut self, names: Vec<String>) {
        self.peers = names;
    }

    /// The socket name group rank `rank` published.
    pub fn peer_name(&self, rank: usize) -> Result<&str> {
        self.peers
            .get(rank)
            .map(String::as_str)
            .ok_or_else(|| Error::Internal(format!("no socket name of rank {rank} was recorded before the local set-up")))
    }

    pub fn bind(name: &str, backlog: i32) -> Result<Listener> {
        let fd = new_socket()?;
        let (addr, len) = abstract_addr(name.as_bytes())?;
        // SAFETY: `addr` is a valid sockaddr_un of length `len`; `fd` is a socket we own.
        let rc = unsafe { libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) };
        if rc != 0 {
            return Err(Error::last_os(format!("binding the local socket @{name}")));
        }
        // SAFETY: `fd` is a bound socket.
        if unsafe { libc::listen(fd.as_raw_fd(), backlog) } != 0 {
            return Err(Error::last_os(format!("listening on @{name}")));
        }
        Ok(Listener { fd, name: name.to_string(), peers: Vec::new() })
    }

    /// Accept one connection from a process of our own user before `deadline`.
    /// Connections from other users are closed and skipped: anyone can see an abstract
    /// name in /proc/net/unix, and a stranger must not be able to break set-up.
    /// `watch`: descriptors that become readable when a peer exits (see `wait_fd`).
    pub fn accept(&self, deadline: Instant, watch: &[RawFd]) -> Result<Conn> {
        loop {
            wait_fd(self.fd.as_raw_fd(), libc::POLLIN, deadline, watch, || format!("no local rank connected to @{} in time", self.name))?;
            // SAFETY: `self.fd` is a listening socket; null address arguments are allowed.
            let fd = unsafe { libc::accept4(self.fd.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
            if fd < 0 {
                let err = std::io::Error::last_os_error();
                if matches!(err.raw_os_error(), Some(libc::EINTR) | Some(libc::ECONNABORTED) | Some(libc::EAGAIN)) {
                    continue;
                }
                return Err(Error::os(format!("accepting on @{}", self.name), err));
            }
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let conn = Conn { fd: unsafe { OwnedFd::from_raw_fd(fd) } };
            match conn.check_same_user() {
                Ok(()) => return Ok(conn),
                Err(e) => tracing::warn!(socket = %self.name, error = %e, "dropped a local connection"),
            }
        }
    }
}

/// Poll one descriptor for `events` until `deadline`, and the `watch` descriptors (local
/// peers' pidfds, see `SetupWatch`) beside it: one of those readable means a peer exited,
/// an error that the caller's `SetupWatch::explain` turns into one naming that peer.
fn wait_fd(fd: RawFd, events: libc::c_short, deadline: Instant, watch: &[RawFd], what: impl FnOnce() -> String) -> Result<()> {
    let mut p: Vec<libc::pollfd> = std::iter::once(libc::pollfd { fd, events, revents: 0 })
        .chain(watch.iter().map(|&w| libc::pollfd { fd: w, events: libc::POLLIN, revents: 0 }))
        .collect();
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout(what()));
        }
        let ms = (deadline - now).as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `p` is a valid array of pollfds of the length given.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms.max(1)) };
        if rc > 0 {
            if p[1..].iter().any(|q| q.revents != 0) {
                return Err(Error::PeerFailure("a local rank exited".into()));
            }
            return Ok(());
        }
        if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::last_os("polling a local socket"));
        }
    }
}

/// A connected stream to another local rank.
pub struct Conn {
    fd: OwnedFd,
}

impl Conn {
    /// Connect to `name`, retrying while the peer is not listening yet (and none of the
    /// `watch` descriptors says a peer exited, see `wait_fd`).
    pub fn connect(name: &str, deadline: Instant, watch: &[RawFd]) -> Result<Conn> {
        let (addr, len) = abstract_addr(name.as_bytes())?;
        loop {
            let fd = new_socket()?;
            // SAFETY: `addr` is a valid sockaddr_un of length `len`.
            let rc = unsafe { libc::connect(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) };
            if rc == 0 {
                let conn = Conn { fd };
                conn.check_same_user()?;
                return Ok(conn);
            }
            let err = std::io::Error::last_os_error();
            let retry =
                matches!(err.raw_os_error(), Some(libc::ECONNREFUSED) | Some(libc::ENOENT) | Some(libc::EAGAIN) | Some(libc::EINTR));
            if !retry {
                return Err(Error::os(format!("connecting to local rank socket @{name}"), err));
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(format!("connecting to local rank socket @{name}: {err}")));
            }
            // Sleeps 2 ms unless a watched peer exits first.
            let wait_until = (Instant::now() + Duration::from_millis(2)).min(deadline);
            if !watch.is_empty() {
                let mut p: Vec<libc::pollfd> = watch.iter().map(|&w| libc::pollfd { fd: w, events: libc::POLLIN, revents: 0 }).collect();
                // SAFETY: `p` is a valid array of pollfds of the length given.
                if unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 2) } > 0 {
                    return Err(Error::PeerFailure("a local rank exited".into()));
                }
            } else {
                std::thread::sleep(wait_until.saturating_duration_since(Instant::now()));
            }
        }
    }

    /// Refuse peers of another user: the region we share would expose our tensors.
    fn check_same_user(&self) -> Result<()> {
        let cred = self.peer_cred()?;
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        if cred.uid != me {
            return Err(Error::PeerFailure(format!(
                "refusing a local connection from pid {} of uid {} (rsccl accepts only uid {me})",
                cred.pid, cred.uid
            )));
        }
        Ok(())
    }

    pub fn peer_cred(&self) -> Result<libc::ucred> {
        // SAFETY: ucred is plain old data.
        let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` and `len` are valid for writes of the sizes given.
        let rc = unsafe {
            libc::getsockopt(self.fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, &mut cred as *mut _ as *mut libc::c_void, &mut len)
        };
        if rc != 0 {
            return Err(Error::last_os("reading a local peer's credentials"));
        }
        Ok(cred)
    }

    /// Send `data` and, optionally, one descriptor with it (SCM_RIGHTS).
    pub fn send(&self, data: &[u8], fd: Option<RawFd>) -> Result<()> {
        let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
        let mut cmsg_buf = [0u64; 8]; // u64 for alignment; 64 bytes is ample for one fd
                                      // SAFETY: msghdr is plain old data.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            // SAFETY: CMSG_SPACE is a pure size computation.
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
            msg.msg_control = cmsg_buf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space;
            // SAFETY: msg_control points at `space` bytes (<= 64) we own; CMSG_FIRSTHDR
            // returns a pointer inside it, and CMSG_DATA has room for one RawFd.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
            }
        }
        // SAFETY: `msg` points at a valid iovec and (optional) control buffer for the call.
        let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 || n as usize != data.len() {
            return Err(Error::last_os("sending to a local rank"));
        }
        Ok(())
    }

    /// Receive exactly `buf.len()` bytes (sent in one `send`), and a descriptor if one came.
    /// `watch`: see `wait_fd`.
    pub fn recv(&self, buf: &mut [u8], deadline: Instant, watch: &[RawFd]) -> Result<Option<OwnedFd>> {
        wait_fd(self.fd.as_raw_fd(), libc::POLLIN, deadline, watch, || "a local rank did not answer in time".into())?;
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
        let mut cmsg_buf = [0u64; 8];
        // SAFETY: msghdr is plain old data.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = std::mem::size_of_val(&cmsg_buf);
        let n = loop {
            // SAFETY: `msg` points at valid buffers we own for the call; MSG_WAITALL waits
            // for the whole message; MSG_CMSG_CLOEXEC marks received descriptors close-on-exec.
            let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_WAITALL | libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break n;
            }
        };
        if n < 0 {
            return Err(Error::last_os("receiving from a local rank"));
        }
        if n as usize != buf.len() {
            return Err(Error::PeerFailure(format!(
                "a local rank closed its connection during set-up ({n} of {} bytes received)",
                buf.len()
            )));
        }
        // Every descriptor that arrived is owned (and closed unless returned), so a peer
        // sending extra ones cannot leak descriptors into this process.
        let mut received: Vec<OwnedFd> = Vec::new();
        // SAFETY: the kernel filled `msg`'s control buffer; CMSG_FIRSTHDR/NXTHDR walk it
        // within msg_controllen, and an SCM_RIGHTS payload is an array of RawFds whose
        // length follows from cmsg_len.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let payload = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let data = libc::CMSG_DATA(c) as *const RawFd;
                    for i in 0..payload / std::mem::size_of::<RawFd>() {
                        received.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(Error::PeerFailure("a local rank sent more descriptors than expected".into()));
        }
        if received.len() > 1 {
            return Err(Error::PeerFailure(format!("a local rank sent {} descriptors, expected one", received.len())));
        }
        Ok(received.pop())
    }

    /// True once the peer's end is closed (it exited, was killed, or left the group).
    /// After set-up nothing is sent on these connections, so readable means end-of-file.
    pub fn peer_gone(&self) -> bool {
        let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
        // SAFETY: `p` is one valid pollfd; timeout 0 never blocks.
        let rc = unsafe { libc::poll(&mut p, 1, 0) };
        rc > 0 && p.revents & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_passing_and_hangup() {
        let name = format!("rsccl-test-{}", std::process::id());
        let l = Listener::bind(&name, 4).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = std::thread::spawn({
            let name = name.clone();
            move || {
                let c = Conn::connect(&name, deadline, &[]).unwrap();
                let mut buf = [0u8; 5];
                let fd = c.recv(&mut buf, deadline, &[]).unwrap().expect("an fd");
                assert_eq!(&buf, b"hello");
                assert!(fd.as_raw_fd() >= 0);
                c
            }
        });
        let server = l.accept(deadline, &[]).unwrap();
        let devnull = std::fs::File::open("/dev/null").unwrap();
        server.send(b"hello", Some(devnull.as_raw_fd())).unwrap();
        let c = client.join().unwrap();
        assert!(!server.peer_gone());
        drop(c);
        assert!(server.peer_gone());
    }

    #[test]
    fn a_taken_name_is_replaced_then_reported() {
        let squatted = Listener::bind_random(1).unwrap();
        let mut names = vec![squatted.name().to_string(), random_name().unwrap()].into_iter();
        let l = Listener::bind_first_free(1, || Ok(names.next().unwrap())).expect("the second name is free");
        assert_ne!(l.name(), squatted.name());
        let e = Listener::bind_first_free(1, || Ok(squatted.name().to_string())).err().expect("every name taken").to_string();
        assert!(e.contains("were all taken") && e.contains(&format!("@{}", squatted.name())), "{e}");
        let a = Listener::bind_random(1).unwrap();
        let b = Listener::bind_random(1).unwrap();
        assert!(a.name().starts_with("rsccl-") && a.name().len() == 38 && a.name() != b.name(), "{} {}", a.name(), b.name());
    }
}
