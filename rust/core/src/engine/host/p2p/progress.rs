//! Moving send/recv messages through the channels: a send's chunks into its channel, a
//! channel's chunks into the matching recv or into a holding buffer (`Unexpected`).

use std::sync::atomic::Ordering;

use super::{complete_all, Broken, P2pExec, Pending, Unexpected, UNEXPECTED_LIMIT};
use crate::engine::host::coll::copy;
use crate::engine::host::P2p;
use crate::engine::host::POISON_WRITING;
use crate::error::Error;
use crate::memory::layout::{ChannelCtrl, MsgHeader, ERROR_TEXT_BYTES};

/// Tell the sender on `ch` that the message whose first chunk is not yet acked was
/// rejected with `e` (protocol in `ChannelCtrl`: before that chunk's ack).
fn reject(ch: &ChannelCtrl, e: &Error) {
    let text = e.to_string();
    let b = &text.as_bytes()[..text.len().min(ERROR_TEXT_BYTES)];
    // SAFETY: only this channel's receiver (this thread) writes the rejection fields, and
    // the sender reads them only after it observed the increment below (Release), which
    // comes before the ack of the rejected message; the sender's previous rejection, if
    // any, was read before it sent this message.
    unsafe {
        (&mut *ch.reject_text.get())[..b.len()].copy_from_slice(b);
        *ch.reject_len.get() = b.len() as u32;
        *ch.reject_class.get() = e.class_code() as u32;
    }
    ch.rejected.0.fetch_add(1, Ordering::Release);
}

/// The rejection the receiver published on `ch` (see `reject`).
fn rejection(ch: &ChannelCtrl) -> Error {
    // SAFETY: read after an Acquire load of `rejected` saw the receiver's increment, which
    // was made after these writes; they are not rewritten before this sender's next message.
    let (class, len, text) = unsafe { (*ch.reject_class.get(), *ch.reject_len.get() as usize, *ch.reject_text.get()) };
    Error::from_class_code(class as u8, String::from_utf8_lossy(&text[..len.min(ERROR_TEXT_BYTES)]).into_owned())
}

impl P2pExec {
    fn chunks_of(len: usize, half: usize) -> usize {
        len.div_ceil(half).max(1)
    }

    fn poisoned(&self, src: usize, dst: usize) -> Option<Error> {
        let ch = self.sh.channel(src, dst);
        let code = ch.poisoned.0.load(Ordering::Acquire);
        if code == 0 || code == POISON_WRITING {
            return None; // not poisoned, or the text is not published yet: look again later
        }
        // SAFETY: the text was written before the Release store of `poisoned` that the
        // Acquire load above observed, and is never written again.
        let (len, text) = unsafe { (*ch.error_len.get() as usize, *ch.error_text.get()) };
        let len = len.min(ERROR_TEXT_BYTES);
        Some(Error::from_class_code(code as u8, String::from_utf8_lossy(&text[..len]).into_owned()))
    }

    pub(super) fn progress_send(&mut self, j: usize) -> bool {
        let me = self.sh.me;
        let half = self.sh.layout.p2p_half;
        if self.sends[j].is_empty() {
            return false;
        }
        if self.send_broken[j].is_none() {
            self.send_broken[j] = self.poisoned(me, j).map(Broken);
        }
        if let Some(b) = &self.send_broken[j] {
            complete_all(self.sends[j].drain(..), &b.error_for(&format!("send to rank {j}")));
            return true;
        }
        let ch = self.sh.channel(me, j);
        let mut progressed = false;
        while let Some(p) = self.sends[j].front_mut() {
            let buf = p.buf();
            let (tag, dtype) = p.tag_dtype();
            let total_chunks = Self::chunks_of(buf.len, half);
            while p.done < total_chunks {
                let g = self.send_next[j];
                if g.wrapping_sub(ch.acked.0.load(Ordering::Acquire)) >= 2 {
                    break;
                }
                let h = (g & 1) as usize;
                let lo = p.done * half;
                let len = half.min(buf.len - lo.min(buf.len));
                // SAFETY: half h of channel me->j (and its header) is ours until the
                // receiver acks chunk g (protocol in ChannelCtrl); `buf` is valid for its
                // len (the Python Work holds the tensor).
                unsafe {
                    ch.headers[h].get().write(MsgHeader { tag, total_bytes: buf.len as u64, dtype: dtype as u8, _pad: [0; 7] });
                    copy(self.sh.region.at(self.sh.layout.channel_half(me, j, h)), buf.ptr.add(lo), len);
                }
                ch.sent.0.store(g.wrapping_add(1), Ordering::Release);
                self.sh.ring(j);
                self.send_next[j] = g.wrapping_add(1);
                p.done += 1;
                progressed = true;
            }
            if p.done < total_chunks {
                break;
            }
            let end = *p.end.get_or_insert(self.send_next[j]);
            if (ch.acked.0.load(Ordering::Acquire).wrapping_sub(end) as i32) < 0 {
                break;
            }
            let p = self.sends[j].pop_front().expect("front exists");
            progressed = true;
            // The Acquire load of `acked` above covers the message, so a rejection of it
            // is visible here (protocol in ChannelCtrl).
            let rejects = ch.rejected.0.load(Ordering::Acquire);
            if rejects != self.rejects_seen[j] {
                self.rejects_seen[j] = rejects;
                let e = rejection(ch);
                p.work.complete(Err(Error::from_class_code(e.class_code(), format!("send to rank {j} failed: {e}"))));
                continue;
            }
            self.sh.p2p_messages.fetch_add(1, Ordering::Relaxed);
            self.sh.staged_bytes.fetch_add(buf.len as u64, Ordering::Relaxed);
            p.work.complete(Ok(()));
            progressed = true;
        }
        progressed
    }

    /// Complete recv `p` with message `msg` that rank `i` sent before the recv was posted
    /// (held aside), or with the mismatch error when its size or dtype differs.
    fn deliver_held(&self, p: Pending, i: usize, msg: &Unexpected) {
        let buf = p.buf();
        if msg.data.len() != buf.len || msg.dtype != p.tag_dtype().1 as u8 {
            let e = self.mismatch(&p, i, msg.data.len() as u64, msg.dtype);
            p.work.complete(Err(e));
        } else {
            // SAFETY: `buf` is valid for its len (kept alive by the Work), equal to the data's.
            unsafe { copy(buf.ptr, msg.data.as_ptr(), buf.len) };
            p.work.complete(Ok(()));
        }
    }

    fn mismatch(&self, p: &Pending, i: usize, total_bytes: u64, dtype_code: u8) -> Error {
        let (tag, _) = p.tag_dtype();
        let sent_dt = crate::dtype::DType::from_code(dtype_code);
        Error::Mismatch(format!(
            "rank {} posted a {}, but rank {i} sent {} {} elements (tag {tag})",
            self.sh.me,
            p.describe(),
            total_bytes / sent_dt.map_or(1, |d| d.size()) as u64,
            sent_dt.map_or("?", |d| d.name()),
        ))
    }

    /// Give pending recvs from `i` the complete held messages with their tags.
    pub(super) fn match_unexpected(&mut self, i: usize) -> bool {
        let mut progressed = false;
        let mut k = 0;
        while k < self.recvs[i].len() {
            let tag = self.recvs[i][k].tag_dtype().0;
            let Some(u) = self.unexpected[i].iter().position(|u| u.complete && u.tag == tag) else {
                k += 1;
                continue;
            };
            let msg = self.unexpected[i].remove(u).expect("index in range");
            self.unexpected_bytes[i] -= msg.total;
            let p = self.recvs[i].remove(k).expect("index in range");
            self.deliver_held(p, i, &msg);
            progressed = true;
        }
        // Then recvs from any source, oldest first.
        let mut k = 0;
        while k < self.any.len() {
            let tag = self.any[k].tag_dtype().0;
            let Some(u) = self.unexpected[i].iter().position(|u| u.complete && u.tag == tag) else {
                k += 1;
                continue;
            };
            let msg = self.unexpected[i].remove(u).expect("index in range");
            self.unexpected_bytes[i] -= msg.total;
            let p = self.any.remove(k).expect("index in range");
            set_source(&p, i);
            self.deliver_held(p, i, &msg);
            progressed = true;
        }
        progressed
    }

    pub(super) fn progress_recv(&mut self, i: usize) -> bool {
        let me = self.sh.me;
        let half = self.sh.layout.p2p_half;
        let capturing = self.unexpected[i].back().is_some_and(|u| !u.complete);
        if self.recvs[i].is_empty() && self.active[i].is_none() && !capturing && self.any.is_empty() && self.discard[i] == 0 {
            return false;
        }
        // Messages already held are delivered even if the channel has failed since.
        let mut progressed = self.match_unexpected(i);
        if self.recv_broken[i].is_none() {
            self.recv_broken[i] = self.poisoned(i, me).map(Broken);
        }
        if let Some(b) = &self.recv_broken[i] {
            if self.unexpected[i].back().is_some_and(|u| !u.complete) {
                let u = self.unexpected[i].pop_back().expect("checked"); // never completes now
                self.unexpected_bytes[i] -= u.total;
            }
            self.discard[i] = 0;
            progressed |= !self.recvs[i].is_empty() || self.active[i].is_some();
            let e = b.error_for(&format!("recv from rank {i}"));
            complete_all(self.recvs[i].drain(..), &e);
            complete_all(self.active[i].take(), &e);
            return progressed;
        }
        let sh = self.sh.clone();
        let ch = sh.channel(i, me);
        loop {
            let g = self.recv_next[i];
            if (ch.sent.0.load(Ordering::Acquire).wrapping_sub(g) as i32) <= 0 {
                break;
            }
            let h = (g & 1) as usize;
            let capturing = self.unexpected[i].back().is_some_and(|u| !u.complete);
            if self.active[i].is_none() && !capturing && self.discard[i] == 0 {
                // SAFETY: chunk g is published (Acquire load of `sent` above); the sender
                // does not touch half h until we ack it.
                let hdr = unsafe { std::ptr::read(ch.headers[h].get()) };
                // The oldest recv posted for this sender with the tag, else the oldest
                // recv from any source with it.
                let matched = match self.recvs[i].iter().position(|p| p.tag_dtype().0 == hdr.tag) {
                    Some(idx) => self.recvs[i].remove(idx),
                    None => self.any.iter().position(|p| p.tag_dtype().0 == hdr.tag).and_then(|idx| self.any.remove(idx)),
                };
                if let Some(p) = matched {
                    set_source(&p, i);
                    if hdr.total_bytes != p.buf().len as u64 || hdr.dtype != p.tag_dtype().1 as u8 {
                        // Both ends fail with the same text, and the message is skipped
                        // (acked unread below): the channel stays usable.
                        let e = self.mismatch(&p, i, hdr.total_bytes, hdr.dtype);
                        reject(ch, &e);
                        self.discard[i] = Self::chunks_of(hdr.total_bytes as usize, half);
                        p.work.complete(Err(e));
                    } else {
                        self.active[i] = Some(p);
                    }
                } else if (!self.recvs[i].is_empty() || !self.any.is_empty())
                    && self.unexpected_bytes[i] + hdr.total_bytes as usize <= UNEXPECTED_LIMIT
                {
                    // A recv for another tag (from this sender or from any) waits behind
                    // this message: hold it aside.
                    self.unexpected_bytes[i] += hdr.total_bytes as usize;
                    self.unexpected[i].push_back(Unexpected {
                        tag: hdr.tag,
                        dtype: hdr.dtype,
                        total: hdr.total_bytes as usize,
                        data: Vec::with_capacity(hdr.total_bytes as usize),
                        chunks: 0,
                        complete: false,
                    });
                } else {
                    break; // no recv for this tag yet: the message waits in the channel
                }
            }
            let src = self.sh.region.at(self.sh.layout.channel_half(i, me, h));
            let done_now = if self.discard[i] > 0 {
                self.discard[i] -= 1; // a chunk of a rejected message
                false
            } else if let Some(p) = self.active[i].as_mut() {
                let buf = p.buf();
                let lo = p.done * half;
                let len = half.min(buf.len - lo.min(buf.len));
                // SAFETY: as above; `buf` is valid for its len (kept alive by the Work).
                unsafe { copy(buf.ptr.add(lo), src, len) };
                p.done += 1;
                p.done == Self::chunks_of(buf.len, half)
            } else {
                let u = self.unexpected[i].back_mut().expect("capturing");
                let total = u.total;
                let len = half.min(total - u.data.len());
                // SAFETY: as above; the chunk holds `len` valid bytes of the message.
                u.data.extend_from_slice(unsafe { std::slice::from_raw_parts(src, len) });
                u.chunks += 1;
                u.complete = u.chunks == Self::chunks_of(total, half);
                false
            };
            ch.acked.0.store(g.wrapping_add(1), Ordering::Release);
            self.sh.ring(i);
            self.recv_next[i] = g.wrapping_add(1);
            progressed = true;
            if done_now {
                let p = self.active[i].take().expect("set above");
                p.work.complete(Ok(()));
            }
            if self.unexpected[i].back().is_some_and(|u| u.complete) {
                progressed |= self.match_unexpected(i);
            }
        }
        progressed
    }
}

/// Record the sender of a recv from any source (no-op for other operations); the Release
/// store is seen by whoever reads `source` after the Work completed.
fn set_source(p: &Pending, rank: usize) {
    if let P2p::RecvAny { source, .. } = &p.op {
        source.store(rank, Ordering::Release);
    }
}
