//! The host engine's send/recv: the pending messages, their matching by tag, and what
//! happens when one times out or a peer fails (`P2pExec`; its channel transfers are in
//! progress.rs).

mod progress;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{poison, P2pInbox, P2pJob, Shared};
use crate::collective::Buf;
use crate::engine::host::P2p;
use crate::error::Error;
use crate::sync::{futex_wait, SLICE};
use crate::work::WorkState;

/// One send or recv in progress.
struct Pending {
    op: P2p,
    deadline: Instant,
    timeout: Duration,
    work: Arc<WorkState>,
    /// Chunks moved so far.
    done: usize,
    /// Sends: the channel's chunk counter after this message's last chunk; the send is
    /// complete once the receiver has acked up to it.
    end: Option<u32>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Never leave a Work waiting forever, whatever path dropped this (a panic included).
        self.work.complete(Err(Error::Aborted("the send/recv was abandoned by the engine".into())));
    }
}

impl Pending {
    fn buf(&self) -> Buf {
        match &self.op {
            P2p::Send { buf, .. } | P2p::Recv { buf, .. } | P2p::RecvAny { buf, .. } => *buf,
        }
    }

    fn tag_dtype(&self) -> (i64, crate::dtype::DType) {
        match &self.op {
            P2p::Send { tag, dtype, .. } | P2p::Recv { tag, dtype, .. } | P2p::RecvAny { tag, dtype, .. } => (*tag, *dtype),
        }
    }

    fn started(&self) -> bool {
        self.done > 0
    }

    fn describe(&self) -> String {
        let (what, dir) = match &self.op {
            P2p::Send { peer, .. } => ("send", format!("to rank {peer}")),
            P2p::Recv { peer, .. } => ("recv", format!("from rank {peer}")),
            P2p::RecvAny { .. } => ("recv", "from any rank".to_string()),
        };
        let (tag, dtype) = self.tag_dtype();
        format!("{what} of {} {} elements {dir} (tag {tag})", self.buf().len / dtype.size(), dtype.name())
    }
}

/// Progresses every pending send and recv of this rank.
///
/// Semantics: messages from one rank to another travel in order through their channel. A
/// message goes to the oldest pending recv from that rank with the same tag (as gloo
/// matches). A send completes once the receiver has taken the whole message: into the
/// matching recv (a size or dtype objection then fails the send too), or, when no recv
/// matches it while a recv for another tag waits behind it, into a holding buffer (see
/// `Unexpected`; a later mismatch then fails only the recv). A send that the receiver
/// never takes times out.
pub(super) struct P2pExec {
    sh: Arc<Shared>,
    incoming: Arc<Mutex<P2pInbox>>,
    sends: Vec<VecDeque<Pending>>,
    recvs: Vec<VecDeque<Pending>>,
    /// The recv being filled from each source's channel (matched by tag).
    active: Vec<Option<Pending>>,
    send_next: Vec<u32>,
    recv_next: Vec<u32>,
    /// A channel direction that failed mid-message (a timeout, a dead peer) cannot be
    /// trusted again. A size or dtype mismatch does not break it (see `rejected`).
    send_broken: Vec<Option<Broken>>,
    recv_broken: Vec<Option<Broken>>,
    /// Per destination: the channel's `rejected` count this sender has seen.
    rejects_seen: Vec<u32>,
    /// Per source: chunks of a rejected message still to be acked unread.
    discard: Vec<usize>,
    /// Messages taken out of a channel before a recv with their tag was posted (see
    /// `Unexpected`), oldest first, per source; and their total size.
    unexpected: Vec<VecDeque<Unexpected>>,
    unexpected_bytes: Vec<usize>,
    /// Recvs from any source (`P2p::RecvAny`), oldest first: a message none of the
    /// recvs posted for its sender matches goes to the oldest of these with its tag.
    any: VecDeque<Pending>,
}

/// A message whose tag no posted recv matched while a recv for another tag waited behind
/// it. It is copied out of the channel (and acked, so its send completes) so that later
/// messages are not stuck behind it, as gloo, which matches by tag, would deliver them.
/// Bounded by `UNEXPECTED_LIMIT` per source; past that the channel waits.
struct Unexpected {
    tag: i64,
    dtype: u8,
    total: usize,
    data: Vec<u8>,
    chunks: usize,
    complete: bool,
}

const UNEXPECTED_LIMIT: usize = 64 << 20;

/// Why a channel direction is closed.
#[derive(Clone)]
struct Broken(Error);

impl Broken {
    /// The error of an operation (a "send to rank 3" or "recv from rank 3": `what`) that
    /// finds the channel closed. The operation whose failure closed it was told that
    /// failure already; the others are told that the channel is closed and why, so the
    /// text is not taken for their own.
    fn error_for(&self, what: &str) -> Error {
        Error::from_class_code(
            self.0.class_code(),
            format!("{what} failed: the channel was closed by an earlier failure and cannot be used again: {}", self.0),
        )
    }
}

fn complete_all(items: impl IntoIterator<Item = Pending>, e: &Error) {
    for p in items {
        p.work.complete(Err(e.clone()));
    }
}

impl P2pExec {
    pub(super) fn new(sh: Arc<Shared>, incoming: Arc<Mutex<P2pInbox>>) -> P2pExec {
        let n = sh.n;
        P2pExec {
            sh,
            incoming,
            sends: (0..n).map(|_| VecDeque::new()).collect(),
            recvs: (0..n).map(|_| VecDeque::new()).collect(),
            active: (0..n).map(|_| None).collect(),
            send_next: vec![0; n],
            recv_next: vec![0; n],
            send_broken: vec![None; n],
            recv_broken: vec![None; n],
            rejects_seen: vec![0; n],
            discard: vec![0; n],
            unexpected: (0..n).map(|_| VecDeque::new()).collect(),
            unexpected_bytes: vec![0; n],
            any: VecDeque::new(),
        }
    }

    fn pending(&self) -> bool {
        self.sends.iter().chain(self.recvs.iter()).chain(std::iter::once(&self.any)).any(|q| !q.is_empty())
            || self.active.iter().any(Option::is_some)
            || self.discard.iter().any(|&d| d > 0)
            || self.unexpected.iter().any(|q| q.back().is_some_and(|u| !u.complete))
    }

    pub(super) fn run(mut self) {
        let me = self.sh.me;
        let sh = self.sh.clone();
        let mut last_check = Instant::now();
        loop {
            let bell_word: &AtomicU32 = &sh.ctrl().doorbells[me].0;
            let bell = bell_word.load(Ordering::Acquire);
            if sh.shutdown.load(Ordering::Acquire) {
                let late: Vec<P2pJob> = {
                    let mut inbox = self.incoming.lock();
                    inbox.closed = true;
                    inbox.jobs.drain(..).collect()
                };
                // Completing runs Python callbacks: never while holding the inbox lock.
                let e = Error::destroyed_when("before this send/recv completed");
                for job in late {
                    job.work.complete(Err(e.clone()));
                }
                self.fail_everything(&e);
                return;
            }
            let new: Vec<P2pJob> = self.incoming.lock().jobs.drain(..).collect();
            for job in new {
                let peer = match &job.op {
                    P2p::Send { peer, .. } | P2p::Recv { peer, .. } => Some(*peer),
                    P2p::RecvAny { .. } => None,
                };
                let is_send = matches!(job.op, P2p::Send { .. });
                let p = Pending {
                    deadline: Instant::now() + job.timeout,
                    timeout: job.timeout,
                    op: job.op,
                    work: job.work,
                    done: 0,
                    end: None,
                };
                match peer {
                    None => self.any.push_back(p),
                    Some(peer) if is_send => self.sends[peer].push_back(p),
                    Some(peer) => self.recvs[peer].push_back(p),
                }
            }
            let mut progressed = false;
            for j in 0..sh.n {
                if j != me {
                    progressed |= self.progress_send(j);
                    progressed |= self.progress_recv(j);
                }
            }
            let pending = self.pending();
            self.publish_waits_for();
            // Deadlines and dead peers are checked at least every SLICE, also while a
            // long transfer on another channel keeps making progress.
            if pending && (!progressed || last_check.elapsed() >= SLICE) {
                last_check = Instant::now();
                self.expire();
                if let Some(e) = sh.dead_peers() {
                    for r in sh.mesh.gone() {
                        // What the peer completed before it left still counts.
                        self.progress_send(r);
                        self.progress_recv(r);
                        self.fail_peer(r, &e);
                    }
                }
            }
            if progressed {
                continue;
            }
            if pending {
                // Brief spin: the peer usually answers within microseconds.
                for _ in 0..sh.cfg.spin_count.min(4096) {
                    if bell_word.load(Ordering::Acquire) != bell {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
            if bell_word.load(Ordering::Acquire) == bell {
                futex_wait(bell_word, bell, if pending { SLICE } else { Duration::from_secs(1) });
            }
        }
    }

    /// Publish whom this rank's oldest pending send or recv waits for (see
    /// `ControlBlock::waits_for`).
    fn publish_waits_for(&self) {
        let oldest = (0..self.sh.n)
            .flat_map(|r| {
                let s = self.sends[r].front().map(|p| (p.deadline, r));
                let v = self.recvs[r].front().or(self.active[r].as_ref()).map(|p| (p.deadline, r));
                s.into_iter().chain(v)
            })
            .min();
        let word = oldest.map_or(0, |(_, r)| r as u32 + 1);
        let w = &self.sh.ctrl().waits_for[self.sh.me].0;
        if w.load(Ordering::Relaxed) != word {
            w.store(word, Ordering::Relaxed);
        }
    }

    fn fail_everything(&mut self, e: &Error) {
        complete_all(self.any.drain(..), e);
        for r in 0..self.sh.n {
            complete_all(self.sends[r].drain(..), e);
            complete_all(self.recvs[r].drain(..), e);
            complete_all(self.active[r].take(), e);
        }
    }

    fn fail_peer(&mut self, r: usize, e: &Error) {
        if self.unexpected[r].back().is_some_and(|u| !u.complete) {
            let u = self.unexpected[r].pop_back().expect("checked"); // a partial message is of no use
            self.unexpected_bytes[r] -= u.total;
        }
        complete_all(self.sends[r].drain(..), e);
        complete_all(self.recvs[r].drain(..), e);
        complete_all(self.active[r].take(), e);
        self.discard[r] = 0;
        self.send_broken[r] = Some(Broken(e.clone()));
        self.recv_broken[r] = Some(Broken(e.clone()));
    }

    /// Fail operations past their deadline. One that had moved part of its message
    /// poisons its channel, so the peer fails now rather than at its own timeout.
    fn expire(&mut self) {
        let now = Instant::now();
        let me = self.sh.me;
        while let Some(i) = self.any.iter().position(|p| now >= p.deadline) {
            let p = self.any.remove(i).expect("index in range");
            let e = Error::Timeout(format!(
                "{}: {}: Timed out after {:.1} s: no rank sent a matching message",
                self.sh.who(me),
                p.describe(),
                p.timeout.as_secs_f64()
            ));
            p.work.complete(Err(e));
        }
        for r in 0..self.sh.n {
            if r == me {
                continue;
            }
            // An operation that completed since the last look must not be failed.
            self.progress_send(r);
            self.progress_recv(r);
            let recv_note = self.channel_note(r);
            let chain = self.sh.waits_chain(r);
            let timed_out = |p: &Pending, is_send: bool| {
                let waiting = if is_send { "" } else { recv_note.as_str() };
                Error::Timeout(format!(
                    "{}: {}: Timed out after {:.1} s: {} {}{waiting}{chain}",
                    self.sh.who(me),
                    p.describe(),
                    p.timeout.as_secs_f64(),
                    self.sh.who(r),
                    if is_send { "posted no matching recv" } else { "sent nothing matching" }
                ))
            };
            let mut failed: Vec<(Pending, Error)> = Vec::new();
            let mut i = 0;
            while i < self.sends[r].len() {
                if now >= self.sends[r][i].deadline {
                    let p = self.sends[r].remove(i).expect("index in range");
                    let e = timed_out(&p, true);
                    if p.started() {
                        poison(self.sh.channel(me, r), &e);
                        self.sh.ring(r);
                        self.send_broken[r] = Some(Broken(e.clone()));
                    }
                    failed.push((p, e));
                } else {
                    i += 1;
                }
            }
            let mut i = 0;
            while i < self.recvs[r].len() {
                if now >= self.recvs[r][i].deadline {
                    let p = self.recvs[r].remove(i).expect("index in range");
                    let e = timed_out(&p, false);
                    failed.push((p, e));
                } else {
                    i += 1;
                }
            }
            if self.active[r].as_ref().is_some_and(|p| now >= p.deadline) {
                let p = self.active[r].take().expect("checked");
                let e = timed_out(&p, false);
                poison(self.sh.channel(r, me), &e);
                self.sh.ring(r);
                self.recv_broken[r] = Some(Broken(e.clone()));
                failed.push((p, e));
            }
            for (p, e) in failed {
                p.work.complete(Err(e));
            }
        }
    }

    /// For a recv timeout: what is waiting in the channel from `r`, if anything.
    fn channel_note(&self, r: usize) -> String {
        let held: Vec<String> = self.unexpected[r].iter().map(|u| u.tag.to_string()).collect();
        if !held.is_empty() {
            return format!(" (messages from rank {r} with tags [{}] arrived and wait for matching recvs)", held.join(", "));
        }
        let ch = self.sh.channel(r, self.sh.me);
        let g = self.recv_next[r];
        if (ch.sent.0.load(Ordering::Acquire).wrapping_sub(g) as i32) <= 0 {
            return String::new();
        }
        // SAFETY: chunk g is published (Acquire load above) and not rewritten until acked.
        let h = unsafe { std::ptr::read(ch.headers[(g & 1) as usize].get()) };
        let dt = crate::dtype::DType::from_code(h.dtype);
        format!(
            " (a message of {} {} elements with tag {} from rank {r} is waiting: no recv matched its tag)",
            h.total_bytes / dt.map_or(1, |d| d.size()) as u64,
            dt.map_or("?", |d| d.name()),
            h.tag
        )
    }
}
