//! torch's c10d TCPStore, spoken from Rust: a client (what every rank uses to join, and what
//! rsccl-core's rendezvous runs on) and a small server (what rank 0 hosts when no torchrun
//! agent serves a store).
//!
//! NOTE [TCPStore wire protocol] (torch 2.11, torch/csrc/distributed/c10d/TCPStore.cpp and
//! TCPStoreLibUvBackend.cpp; both server backends speak it). Integers are little-endian
//! (the host order of every machine torch runs on); a string or payload is a u64 length
//! followed by its bytes. A client's first message is VALIDATE (u8 0) + u32 0x3C85F7CE,
//! with no reply; torch's client then sends PING (u8 13) + u32 nonce and reads the nonce
//! back. Then, one request at a time on the connection:
//!   SET 1: key, value                     -> nothing
//!   GET 3: key                            -> value (empty if absent; clients WAIT first)
//!   ADD 4: key, i64 delta                 -> i64 new value (stored as decimal text)
//!   CHECK 5: u64 n, n keys                -> u8 0 ready / 1 not ready
//!   WAIT 6: u64 n, n keys                 -> u8 0 (STOP_WAITING) once all exist
//!   GETNUMKEYS 7                          -> i64
//!   DELETE_KEY 8: key                     -> i64 number deleted
//!   CANCEL_WAIT 12 (after a WAIT whose reply did not come in time)
//!                                         -> u8 1 (WAIT_CANCELED), possibly after a late 0
//! COMPARE_SET, APPEND, MULTI_GET/SET and the queue commands exist too; rsccl uses none of
//! them and the server here closes a connection that sends them.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rsccl_core::bootstrap::Store;
use rsccl_core::{Error, Result};

const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    CancelWait = 12,
    Ping = 13,
}

impl Query {
    fn from_code(c: u8) -> Option<Query> {
        use Query::*;
        [Validate, Set, Get, Add, Check, Wait, GetNumKeys, DeleteKey, CancelWait, Ping].into_iter().find(|q| *q as u8 == c)
    }
}

const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// One request, built whole and written at once (torch's SendBuffer does the same).
struct Request(Vec<u8>);

impl Request {
    fn new(q: Query) -> Request {
        Request(vec![q as u8])
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u64(b.len() as u64);
        s.0.extend_from_slice(b);
        s
    }
}

/// A client connection to a c10d TCPStore (torchrun's agent store, Python's
/// `torch.distributed.TCPStore`, or `StoreServer`). Requests are serialized on the one
/// connection, as torch's client does.
pub struct TcpStore {
    conn: Mutex<Conn>,
    addr: String,
    /// Bound of a reply that should come at once (everything but WAIT).
    timeout: Duration,
}

struct Conn {
    sock: TcpStream,
    /// A read timed out mid-reply: the stream is out of step, nothing more can be read.
    broken: Option<String>,
}

impl TcpStore {
    /// Connect to the store at `host:port`, retrying until `timeout` (the server may not
    /// listen yet: rank 0 or the agent starts it), then validate as torch's client does.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        let sock = loop {
            let attempt = (host, port)
                .to_socket_addrs()
                .map_err(|e| Error::Config(format!("cannot resolve the store address {addr} (MASTER_ADDR/MASTER_PORT): {e}")))?
                .map(|a| TcpStream::connect_timeout(&a, deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))
                .find_map(|r| r.ok());
            if let Some(s) = attempt {
                break s;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "could not connect to the store at {addr} within {:.1} s: is the torchrun agent (or rank 0, which hosts \
                     the store without torchrun) running, and are MASTER_ADDR/MASTER_PORT right?",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_secs(1));
        };
        let _ = sock.set_nodelay(true);
        let store = TcpStore { conn: Mutex::new(Conn { sock, broken: None }), addr, timeout };
        {
            let mut c = store.conn.lock();
            store.send(&mut c, Request::new(Query::Validate).u32(VALIDATION_MAGIC))?;
            let nonce = std::process::id();
            store.send(&mut c, Request::new(Query::Ping).u32(nonce))?;
            let back = u32::from_le_bytes(store.read_n::<4>(&mut c, store.timeout, "PING")?);
            if back != nonce {
                return Err(Error::PeerFailure(format!(
                    "the server at {} is not a c10d TCPStore (it answered PING {nonce} with {back})",
                    store.addr
                )));
            }
        }
        Ok(store)
    }

    /// The address this store connected to (host:port).
    pub fn address(&self) -> &str {
        &self.addr
    }

    fn lost(&self, e: std::io::Error) -> Error {
        Error::PeerFailure(format!(
            "lost the connection to the store at {} ({e}): did the torchrun agent or rank 0 (which hosts the store) exit?",
            self.addr
        ))
    }

    fn send(&self, c: &mut Conn, r: Request) -> Result<()> {
        if let Some(why) = &c.broken {
            return Err(Error::PeerFailure(why.clone()));
        }
        c.sock.write_all(&r.0).map_err(|e| self.lost(e))
    }

    /// Read exactly `buf.len()` bytes within `limit`; Ok(false) if nothing at all arrived
    /// in time (the stream is still in step), an error if the reply stopped midway.
    fn read_within(&self, c: &mut Conn, buf: &mut [u8], limit: Duration, what: &str) -> Result<bool> {
        if let Some(why) = &c.broken {
            return Err(Error::PeerFailure(why.clone()));
        }
        let deadline = Instant::now() + limit;
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            c.sock.set_read_timeout(Some(left)).map_err(|e| self.lost(e))?;
            match c.sock.read(&mut buf[got..]) {
                Ok(0) => return Err(self.lost(std::io::Error::new(ErrorKind::UnexpectedEof, "the store closed the connection"))),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) && Instant::now() >= deadline => {
                    if got == 0 {
                        return Ok(false);
                    }
                    let why = format!("the store at {} stopped answering in the middle of a {what} reply", self.addr);
                    c.broken = Some(why.clone());
                    return Err(Error::PeerFailure(why));
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => return Err(self.lost(e)),
            }
        }
        Ok(true)
    }

    fn read_n<const N: usize>(&self, c: &mut Conn, limit: Duration, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if !self.read_within(c, &mut b, limit, what)? {
            c.broken = Some(format!("the store at {} did not answer a {what} request within {:.1} s", self.addr, limit.as_secs_f64()));
            return Err(Error::Timeout(c.broken.clone().unwrap_or_default()));
        }
        Ok(b)
    }

    fn read_bytes(&self, c: &mut Conn, what: &str) -> Result<Vec<u8>> {
        let n = u64::from_le_bytes(self.read_n::<8>(c, self.timeout, what)?) as usize;
        let mut v = vec![0u8; n];
        if n > 0 && !self.read_within(c, &mut v, self.timeout, what)? {
            return Err(Error::PeerFailure(format!("the store at {} stopped answering a {what} reply", self.addr)));
        }
        Ok(v)
    }

    fn keys(r: Request, keys: &[&str]) -> Request {
        keys.iter().fold(r.u64(keys.len() as u64), |r, k| r.bytes(k.as_bytes()))
    }

    /// Block until every key exists, at most `timeout`; the same error torch raises
    /// (a timeout) otherwise.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut c = self.conn.lock();
        self.wait_locked(&mut c, keys, timeout)
    }

    fn wait_locked(&self, c: &mut Conn, keys: &[&str], timeout: Duration) -> Result<()> {
        self.send(c, Self::keys(Request::new(Query::Wait), keys))?;
        let mut b = [0u8; 1];
        if self.read_within(c, &mut b, timeout, "WAIT")? {
            return self.expect(b[0], STOP_WAITING, "WAIT");
        }
        // As torch's client: cancel, then read the server's answer (a STOP_WAITING that
        // crossed the cancel may come first).
        self.send(c, Request::new(Query::CancelWait))?;
        let mut r = self.read_n::<1>(c, self.timeout, "CANCEL_WAIT")?[0];
        if r == STOP_WAITING {
            r = self.read_n::<1>(c, self.timeout, "CANCEL_WAIT")?[0];
        }
        self.expect(r, WAIT_CANCELED, "CANCEL_WAIT")?;
        Err(Error::Timeout(format!("wait timeout after {} ms, keys: {}", timeout.as_millis(), keys.join(", "))))
    }

    fn expect(&self, got: u8, want: u8, what: &str) -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(Error::PeerFailure(format!("the store at {} answered {what} with {got}, expected {want}", self.addr)))
        }
    }

    /// Whether every key exists now.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut c = self.conn.lock();
        self.send(&mut c, Self::keys(Request::new(Query::Check), keys))?;
        Ok(self.read_n::<1>(&mut c, self.timeout, "CHECK")?[0] == 0)
    }

    pub fn delete_key(&self, key: &str) -> Result<bool> {
        let mut c = self.conn.lock();
        self.send(&mut c, Request::new(Query::DeleteKey).bytes(key.as_bytes()))?;
        Ok(i64::from_le_bytes(self.read_n::<8>(&mut c, self.timeout, "DELETE_KEY")?) == 1)
    }

    pub fn num_keys(&self) -> Result<i64> {
        let mut c = self.conn.lock();
        self.send(&mut c, Request::new(Query::GetNumKeys))?;
        Ok(i64::from_le_bytes(self.read_n::<8>(&mut c, self.timeout, "GETNUMKEYS")?))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut c = self.conn.lock();
        self.send(&mut c, Request::new(Query::Set).bytes(key.as_bytes()).bytes(value))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut c = self.conn.lock();
        self.wait_locked(&mut c, &[key], timeout)?;
        self.send(&mut c, Request::new(Query::Get).bytes(key.as_bytes()))?;
        self.read_bytes(&mut c, "GET")
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut c = self.conn.lock();
        self.send(&mut c, Request::new(Query::Add).bytes(key.as_bytes()).i64(delta))?;
        Ok(i64::from_le_bytes(self.read_n::<8>(&mut c, self.timeout, "ADD")?))
    }
}

/// Keys under `prefix/`, as torch's PrefixStore: one group's keys apart from another's.
pub struct PrefixStore {
    inner: Arc<TcpStore>,
    prefix: String,
}

impl PrefixStore {
    pub fn new(inner: Arc<TcpStore>, prefix: impl Into<String>) -> PrefixStore {
        PrefixStore { inner, prefix: prefix.into() }
    }

    fn key(&self, k: &str) -> String {
        format!("{}/{k}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
}

/// The keys and values a `StoreServer` holds; connections wait on `changed`.
#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A c10d TCPStore server (the subset rsccl's clients and torch's use for rendezvous:
/// see NOTE [TCPStore wire protocol]), for jobs launched without torchrun: rank 0 hosts
/// it on MASTER_PORT, as `init_process_group("env://")` does in Python. One thread per
/// connection; stops accepting when dropped (connections end with their clients).
pub struct StoreServer {
    port: u16,
    stop: Arc<AtomicBool>,
}

/// How often a connection blocked in WAIT looks for a CANCEL_WAIT or a closed peer.
const WAIT_POLL: Duration = Duration::from_millis(50);

impl StoreServer {
    /// Listen on `bind:port` (port 0: any free port, see `port()`).
    pub fn start(bind: &str, port: u16) -> Result<StoreServer> {
        let listener = TcpListener::bind((bind, port))
            .map_err(|e| Error::os(format!("rsccl could not host the store on {bind}:{port} (MASTER_PORT taken?)"), e))?;
        let port = listener.local_addr().map_err(|e| Error::os("store address", e))?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let st = stop.clone();
        std::thread::Builder::new()
            .name("rsccl-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(sock) = conn else { continue };
                    let (t, s) = (table.clone(), st.clone());
                    let _ = std::thread::Builder::new().name("rsccl-store-conn".into()).spawn(move || {
                        let _ = serve(sock, &t, &s);
                    });
                }
            })
            .map_err(|e| Error::os("starting the store thread", e))?;
        Ok(StoreServer { port, stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn read_exact(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_u64(s: &mut TcpStream) -> std::io::Result<u64> {
    Ok(u64::from_le_bytes(read_exact(s, 8)?.try_into().expect("8 bytes")))
}

/// A string or payload; the libuv server's limits (8 MiB) bound what a peer can make us allocate.
fn read_blob(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let n = read_u64(s)?;
    if n > 8 << 20 {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "payload over 8 MiB"));
    }
    read_exact(s, n as usize)
}

fn read_keys(s: &mut TcpStream) -> std::io::Result<Vec<String>> {
    let n = read_u64(s)?;
    if n > 128 * 1024 {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "too many keys"));
    }
    (0..n).map(|_| read_blob(s).map(|b| String::from_utf8_lossy(&b).into_owned())).collect()
}

fn blob(v: &[u8]) -> Vec<u8> {
    let mut out = (v.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(v);
    out
}

/// One client connection, until it closes or breaks the protocol.
fn serve(mut s: TcpStream, t: &Table, stop: &AtomicBool) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut validated = false;
    loop {
        let mut q = [0u8; 1];
        if s.read(&mut q)? == 0 || stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let query = Query::from_code(q[0]);
        if !validated {
            if query != Some(Query::Validate) || u32::from_le_bytes(read_exact(&mut s, 4)?.try_into().expect("4")) != VALIDATION_MAGIC {
                return Ok(()); // not a TCPStore client
            }
            validated = true;
            continue;
        }
        let reply = match query {
            Some(Query::Ping) => read_exact(&mut s, 4)?,
            Some(Query::Set) => {
                let k = String::from_utf8_lossy(&read_blob(&mut s)?).into_owned();
                let v = read_blob(&mut s)?;
                t.map.lock().insert(k, v);
                t.changed.notify_all();
                continue;
            }
            Some(Query::Get) => {
                let k = String::from_utf8_lossy(&read_blob(&mut s)?).into_owned();
                blob(t.map.lock().get(&k).map(|v| v.as_slice()).unwrap_or(&[]))
            }
            Some(Query::Add) => {
                let k = String::from_utf8_lossy(&read_blob(&mut s)?).into_owned();
                let delta = i64::from_le_bytes(read_exact(&mut s, 8)?.try_into().expect("8"));
                let mut m = t.map.lock();
                let old = m.get(&k).and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<i64>().ok()).unwrap_or(0);
                let new = old.wrapping_add(delta);
                m.insert(k, new.to_string().into_bytes());
                drop(m);
                t.changed.notify_all();
                new.to_le_bytes().to_vec()
            }
            Some(Query::Check) => {
                let keys = read_keys(&mut s)?;
                let m = t.map.lock();
                vec![if keys.iter().all(|k| m.contains_key(k)) { 0 } else { 1 }]
            }
            Some(Query::Wait) => {
                let keys = read_keys(&mut s)?;
                match wait_keys(&mut s, t, &keys, stop)? {
                    Some(r) => r,
                    None => return Ok(()),
                }
            }
            Some(Query::CancelWait) => vec![WAIT_CANCELED],
            Some(Query::GetNumKeys) => (t.map.lock().len() as i64).to_le_bytes().to_vec(),
            Some(Query::DeleteKey) => {
                let k = String::from_utf8_lossy(&read_blob(&mut s)?).into_owned();
                (t.map.lock().remove(&k).is_some() as i64).to_le_bytes().to_vec()
            }
            Some(Query::Validate) | None => return Ok(()), // unsupported: close, as torch's server does
        };
        s.write_all(&reply)?;
    }
}

/// WAIT: reply STOP_WAITING once every key exists; or, if the client sends CANCEL_WAIT
/// first, WAIT_CANCELED. None: the client went away.
fn wait_keys(s: &mut TcpStream, t: &Table, keys: &[String], stop: &AtomicBool) -> std::io::Result<Option<Vec<u8>>> {
    loop {
        {
            let mut m = t.map.lock();
            if keys.iter().all(|k| m.contains_key(k)) {
                return Ok(Some(vec![STOP_WAITING]));
            }
            t.changed.wait_for(&mut m, WAIT_POLL);
            if keys.iter().all(|k| m.contains_key(k)) {
                return Ok(Some(vec![STOP_WAITING]));
            }
        }
        if stop.load(Ordering::Acquire) {
            let _ = s.shutdown(Shutdown::Both);
            return Ok(None);
        }
        s.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        let peeked = s.peek(&mut b);
        s.set_nonblocking(false)?;
        match peeked {
            Ok(0) => return Ok(None),
            Ok(_) => {
                s.read_exact(&mut b)?;
                if b[0] != Query::CancelWait as u8 {
                    return Ok(None); // a request during a WAIT breaks the protocol
                }
                return Ok(Some(vec![WAIT_CANCELED]));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_and_server_agree() {
        let server = StoreServer::start("127.0.0.1", 0).unwrap();
        let t = Duration::from_secs(5);
        let a = TcpStore::connect("127.0.0.1", server.port(), t).unwrap();
        let b = TcpStore::connect("127.0.0.1", server.port(), t).unwrap();
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 3).unwrap(), 5);
        assert!(!a.check(&["k"]).unwrap());
        let waiter = std::thread::spawn(move || b.get("k", Duration::from_secs(5)).map(|v| (v, b)));
        std::thread::sleep(Duration::from_millis(100));
        a.set("k", b"value").unwrap();
        let (v, b) = waiter.join().unwrap().unwrap();
        assert_eq!(v, b"value");
        let e = b.get("absent", Duration::from_millis(200)).unwrap_err();
        assert!(matches!(e, Error::Timeout(_)), "{e}");
        // The connection is still in step after a cancelled wait.
        assert_eq!(b.add("n", 1).unwrap(), 6);
        assert!(a.delete_key("k").unwrap());
        assert_eq!(a.num_keys().unwrap(), 1);
        let p = PrefixStore::new(Arc::new(a), "g");
        p.set("x", b"1").unwrap();
        // SET has no reply (as in torch's protocol) and each connection has its own server
        // thread: a round trip on the same connection makes sure the server applied it
        // before the other connection looks (seen failing under load without it).
        assert_eq!(p.add("sync", 0).unwrap(), 0);
        assert!(b.check(&["g/x"]).unwrap());
    }

    #[test]
    fn unreachable_store_times_out() {
        // A port nobody listens on (bound, then closed).
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).err().unwrap();
        assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("MASTER_ADDR"), "{e}");
    }
}
