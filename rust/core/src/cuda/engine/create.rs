//! Building the engine: the GPU check, the grids every local rank agrees on, the pool, the
//! status page, streams and events, the watchdog, and the warm-up.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use parking_lot::Mutex;

use super::abi::Args;
use super::status::{HostWords, Shared};
use super::watchdog::watchdog;
use super::{CudaCall, CudaEngine};
use crate::bootstrap::LocalMesh;
use crate::collective::op::Chunks;
use crate::collective::Kind;
use crate::config::Config;
use crate::cuda::budget::{sms_of, SmShare};
use crate::cuda::decide::{
    check_peer_access, grids_that_fit, kernel, kernels_of, low_latency_grid, p2p_chunk, stage_per_block, LocalGpu, Reach,
};
use crate::cuda::driver::{check, Device, Event, Stream};
use crate::cuda::kernels::{ll_max_bytes, Kernels, Shape, MAX_BLOCKS, MAX_RANKS, POISON_OFF};
use crate::cuda::order::{EventHome, Order};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::device_heap::Heap;
use crate::memory::device_pool::SymmetricPool;

/// The grids every local rank uses, and what this rank's GPU holds of them.
pub(super) struct Grids {
    /// Blocks of every collective kernel and of every send/recv kernel.
    pub blocks: u32,
    pub p2p_blocks: u32,
    /// This rank's GPU: its SMs, and how many send/recv and collective blocks fit on one.
    pub sms: u32,
    pub p2p_per_sm: u32,
    pub collective_per_sm: u32,
}

/// The grids every local rank uses, (collective blocks, send/recv blocks): `grids_that_fit`
/// on each rank's GPU, the least of each (ranks pair their blocks one to one, and senders
/// and receivers must split messages alike), or an error on every rank alike when some GPU
/// cannot hold even one block per kernel. `sharers` is how many of the group's ranks use
/// this rank's GPU.
pub(super) fn agree_grids(
    dev: &Device,
    kernels: &Kernels,
    mesh: &LocalMesh,
    local_ranks: &[usize],
    cfg: &Config,
    sharers: u32,
    deadline: Instant,
) -> Result<Grids> {
    let n = mesh.size();
    let (sms, per_sm, coll_per_sm) = {
        let _ctx = dev.bind()?;
        let sms = dev.attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(0) as u32;
        let p2p = Kernels::min_blocks_per_sm(kernels.of_shape(|s| s == Shape::Peer))?;
        let coll = Kernels::min_blocks_per_sm(kernels.of_shape(|s| s != Shape::Peer))?;
        (sms, p2p, coll)
    };
    let (coll_fit, p2p_fit) = grids_that_fit(cfg.cuda_blocks, cfg.cuda_p2p_blocks, n, sms, per_sm, coll_per_sm, sharers);
    let mut msg = [0u8; 64];
    msg[..4].copy_from_slice(b"RSP2");
    for (k, v) in [p2p_fit, sms, per_sm, coll_per_sm, coll_fit, sharers].into_iter().enumerate() {
        msg[4 + 4 * k..8 + 4 * k].copy_from_slice(&v.to_le_bytes());
    }
    let got = mesh.all_gather(&msg, None, deadline)?;
    let word = |m: &[u8; 64], k: usize| u32::from_le_bytes(m[4 + 4 * k..8 + 4 * k].try_into().unwrap_or_default());
    let least = |k: usize| got.iter().enumerate().map(|(j, (m, _))| (j, word(m, k))).min_by_key(|&(_, f)| f).unwrap_or((0, 0));
    let ((j, p2p), (_, coll)) = (least(0), least(4));
    if p2p == 0 || coll == 0 {
        let j = if p2p == 0 { j } else { least(4).0 };
        let m = &got[j].0;
        let who = local_ranks.get(j).copied().unwrap_or(j);
        let sharing = word(m, 5);
        if sharing > 1 {
            return Err(Error::Config(format!(
                "{sharing} ranks of this group share the GPU of rank {who} ({} SMs, {} send/recv and {} collective blocks \
                 per SM): each rank's share of {} SMs cannot hold one collective kernel and {} send/recv kernels (one per \
                 local peer and direction) of even one block at once, which ranks on one GPU need to never wait on a kernel \
                 that cannot start: put fewer ranks on each GPU",
                word(m, 1),
                word(m, 2),
                word(m, 3),
                word(m, 1) / sharing,
                2 * (n - 1)
            )));
        }
        return Err(Error::Config(format!(
            "the GPU of rank {who} ({} SMs, {} send/recv and {} collective blocks per SM) cannot hold one collective \
             kernel (cuda_blocks = {}) and {} send/recv kernels (one per local peer and direction) of even one block \
             at once, which send/recv need to never wait on a kernel that cannot start: lower cuda_blocks",
            word(m, 1),
            word(m, 2),
            word(m, 3),
            cfg.cuda_blocks,
            2 * (n - 1)
        )));
    }
    if coll < cfg.cuda_blocks {
        tracing::info!(
            setting = cfg.cuda_blocks,
            effective = coll,
            "rsccl: collective kernels use {coll} blocks, not cuda_blocks = {}, so that the kernels of every rank sharing a GPU fit on it at once",
            cfg.cuda_blocks
        );
    }
    if p2p < cfg.cuda_p2p_blocks {
        tracing::info!(
            setting = cfg.cuda_p2p_blocks,
            effective = p2p,
            "rsccl: send/recv kernels use {p2p} blocks, not cuda_p2p_blocks = {}, so that all {} of them and a collective fit on the GPU at once",
            cfg.cuda_p2p_blocks,
            2 * (n - 1)
        );
    }
    Ok(Grids { blocks: coll, p2p_blocks: p2p, sms, p2p_per_sm: per_sm, collective_per_sm: coll_per_sm })
}

/// The test-only hook of `check_reach`.
pub const NO_PEER_ACCESS_ENV: &str = "RSCCL_TEST_NO_PEER_ACCESS";

/// Whether this GPU reaches the GPU at PCI `bus` (another rank's): `SameGpu` for this GPU
/// itself; `Unknown` where that GPU is not visible to this process (CUDA_VISIBLE_DEVICES).
fn reach(dev: &Device, bus: &str) -> Result<Reach> {
    Ok(match dev.peer_by_bus(bus) {
        None => Reach::Unknown,
        Some(peer) if peer == dev.dev => Reach::SameGpu,
        Some(peer) if dev.can_access_peer(peer)? => Reach::Yes,
        Some(_) => Reach::No,
    })
}

/// Whether the local ranks' GPUs can reach each other (peer access), checked before any
/// peer's memory is mapped: a PCIe machine without P2P would otherwise fail the mapping
/// with a bare driver error (cuMemSetAccess). Each rank asks its driver about every peer's
/// GPU (by the PCI bus ids in `buses`, the "RSD1" exchange: bus at 4..44, ordinal at
/// 44..48), the ranks exchange their answers ("RSD2", one `Reach` byte per local rank),
/// and every rank raises the same error naming the first pair that cannot
/// (`decide::check_peer_access`). Ranks on one GPU (allow_shared_gpu) are not asked.
///
/// Tests only: `RSCCL_TEST_NO_PEER_ACCESS=<group rank>` makes that rank answer "no" for
/// every other GPU, as a PCIe machine without P2P would (the GPU machines all have P2P).
fn check_reach(
    dev: &Device,
    mesh: &LocalMesh,
    local_ranks: &[usize],
    buses: &[([u8; 64], Option<std::os::fd::OwnedFd>)],
    deadline: Instant,
) -> Result<()> {
    let n = buses.len();
    if n < 2 {
        return Ok(());
    }
    let me = mesh.local_index();
    let bus = |m: &[u8; 64]| String::from_utf8_lossy(&m[4..44]).trim_end_matches('\0').to_string();
    let mut msg = [0u8; 64];
    msg[..4].copy_from_slice(b"RSD2");
    // A rank that cannot ask still takes part (as `Unknown`), so no peer waits for it.
    let ask = |m: &[u8; 64]| {
        let _ctx = dev.bind()?;
        reach(dev, &bus(m))
    };
    let pretend_none = std::env::var(NO_PEER_ACCESS_ENV).ok().and_then(|v| v.trim().parse::<usize>().ok()) == local_ranks.get(me).copied();
    for (j, (m, _)) in buses.iter().enumerate() {
        let r = if j == me || m[4..44] == buses[me].0[4..44] { Ok(Reach::SameGpu) } else { ask(m) };
        let r = if pretend_none { r.map(|r| if r == Reach::Yes { Reach::No } else { r }) } else { r };
        msg[4 + j] = r.unwrap_or_else(|e| {
            tracing::warn!(peer = j, error = %e, "rsccl: could not ask the driver whether this GPU reaches a local peer's");
            Reach::Unknown
        }) as u8;
    }
    let got = mesh.all_gather(&msg, None, deadline)?;
    let gpus: Vec<LocalGpu> = buses
        .iter()
        .enumerate()
        .map(|(j, (m, _))| LocalGpu {
            rank: local_ranks.get(j).copied().unwrap_or(j),
            ordinal: i32::from_le_bytes(m[44..48].try_into().unwrap_or_default()),
            bus: bus(m),
        })
        .collect();
    let reach: Vec<Vec<Reach>> = got.iter().map(|(m, _)| (0..n).map(|j| Reach::from_code(m[4 + j])).collect()).collect();
    check_peer_access(&gpus, &reach)
}

impl CudaEngine {
    /// Build the engine of local rank `mesh.local_index()` on `device`: map the pool with
    /// every local peer, load the kernels, and (if configured) run a warm-up of every
    /// kernel family. Blocks until every local rank has done the same, or the deadline.
    pub fn create(
        device: i32,
        mesh: Arc<LocalMesh>,
        local_ranks: Vec<usize>,
        cfg: &Config,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Arc<CudaEngine>> {
        let n = mesh.size();
        if n > MAX_RANKS {
            return Err(Error::Config(format!("rsccl's CUDA kernels support up to {MAX_RANKS} GPUs per host, this group has {n}")));
        }
        if cfg.cuda_blocks > MAX_BLOCKS {
            return Err(Error::Config(format!("cuda_blocks = {} is over {MAX_BLOCKS}", cfg.cuda_blocks)));
        }
        let dev = Arc::new(Device::open(device)?);
        // The GPUs of a group must be distinct unless allow_shared_gpu: two ranks on one GPU is
        // usually a set-up mistake (a missing torch.cuda.set_device). With the option, ranks
        // that share a GPU size their grids to a share of it (`grids_that_fit`).
        let bus = dev.pci_bus_id()?;
        let mut msg = [0u8; 64];
        msg[..4].copy_from_slice(b"RSD1");
        let b = bus.as_bytes();
        msg[4..4 + b.len().min(40)].copy_from_slice(&b[..b.len().min(40)]);
        msg[44..48].copy_from_slice(&dev.ordinal.to_le_bytes());
        let got = mesh.all_gather(&msg, None, deadline)?;
        if !cfg.allow_shared_gpu {
            for (j, (m, _)) in got.iter().enumerate() {
                for (k, (m2, _)) in got.iter().enumerate().skip(j + 1) {
                    if m[4..44] == m2[4..44] {
                        return Err(Error::InvalidArgument(format!(
                            "group ranks {} and {} both use the GPU at PCI {}: call torch.cuda.set_device(local_rank) \
                             before init_process_group/new_group, so each rank has its own GPU (or set allow_shared_gpu \
                             / RSCCL_ALLOW_SHARED_GPU=1 to run several ranks on one GPU, for tests and debugging)",
                            local_ranks[j],
                            local_ranks[k],
                            String::from_utf8_lossy(&m[4..44]).trim_end_matches('\0')
                        )));
                    }
                }
            }
        }
        let me = mesh.local_index();
        check_reach(&dev, &mesh, &local_ranks, &got, deadline)?;
        let sharers = got.iter().filter(|(m, _)| m[4..44] == got[me].0[4..44]).count() as u32;
        let kernels = Kernels::shared(&dev)?;
        let grids = agree_grids(&dev, &kernels, &mesh, &local_ranks, cfg, sharers, deadline)?;
        let (blocks, p2p_blocks) = (grids.blocks, grids.p2p_blocks);
        // The SMs its kernels hold, counted in the device's ledger with every other group's of
        // this process (NOTE [SM budget]); where ranks share the GPU, within this rank's share,
        // which `grids_that_fit` sized the grids for.
        let sm = SmShare::join(
            &dev,
            grids.sms,
            grids.sms / sharers.max(1),
            grids.collective_per_sm,
            sms_of(blocks, grids.collective_per_sm),
            sms_of(p2p_blocks, grids.p2p_per_sm),
        )?;
        // A block: the collectives' part (control and staging, cuda_buffer_bytes), the
        // send/recv inbox (cuda_p2p_bytes, split by the effective send/recv grid), then
        // the pool.
        let chunk = p2p_chunk(cfg.cuda_p2p_bytes, n, p2p_blocks)?;
        let inbox_off = cfg.cuda_buffer_bytes.div_ceil(4096) * 4096;
        let pool = Arc::new(SymmetricPool::create(
            dev.clone(),
            &mesh,
            inbox_off + cfg.cuda_p2p_bytes,
            cfg.cuda_pool_bytes,
            cfg.max_cuda_va_bytes,
            deadline,
        )?);
        let spb = stage_per_block(cfg.cuda_buffer_bytes, blocks);
        if spb < 4096 {
            return Err(Error::Config(format!(
                "cuda_buffer_bytes = {} leaves {spb} bytes of staging per block for {blocks} blocks (cuda_blocks = {}): \
                 raise cuda_buffer_bytes or lower cuda_blocks",
                cfg.cuda_buffer_bytes, cfg.cuda_blocks
            )));
        }
        let _ctx = dev.bind()?;
        let words = HostWords::new(&dev)?;
        // Each of these owns its handle: a failure on the way drops (releases) what was made.
        // The launch order's pool of 8 (the health check's wait takes one too).
        let free_events = (0..8).map(|_| Event::new(&dev)).collect::<Result<Vec<Event>>>()?;
        let internal = Stream::non_blocking(&dev, "cuStreamCreate")?;
        let poison_stream = Stream::non_blocking(&dev, "cuStreamCreate (abort)")?;
        // One stream per (peer, direction) for send/recv: index 2 * peer + (1 for recv).
        let p2p_streams = (0..2 * n)
            .map(|k| (k / 2 != mesh.local_index()).then(|| Stream::non_blocking(&dev, "cuStreamCreate (send/recv)")).transpose())
            .collect::<Result<Vec<Option<Stream>>>>()?;
        let copy_streams = (0..n).map(|_| Stream::non_blocking(&dev, "cuStreamCreate (copy engines)")).collect::<Result<Vec<Stream>>>()?;
        let mut peer = [0u64; MAX_RANKS];
        for (j, p) in peer.iter_mut().enumerate().take(n) {
            *p = pool.block_addr(j);
        }
        let base = Args {
            peer,
            inp: 0,
            out: 0,
            count: 0,
            stage_per_block: spb as u64,
            err_host: words.dev() + (HostWords::ERR * 4) as u64,
            abort_host: words.dev() + (HostWords::ABORT * 4) as u64,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            desc0: 0,
            desc1: 0,
            place_in: 0,
            place_out: 0,
            rank: mesh.local_index() as u32,
            world: n as u32,
            root: 0,
            flags: 0,
        };
        let heap = (pool.pool_bytes > 0).then(|| Arc::new(Heap::new(pool.clone(), device)));
        tracing::info!(
            device,
            local_ranks = n,
            va_reserved = pool.reserved_bytes(),
            mapped_own = pool.block,
            mapped_peers = pool.block * (n - 1),
            staging = pool.pool_off,
            pool = pool.pool_bytes,
            kernel_image = kernels.cubin_bytes,
            blocks,
            p2p_blocks,
            gpu_sharers = sharers,
            "rsccl: CUDA engine ready: reserved {} MiB of GPU address space, mapped {} MiB own ({} MiB staging + {} MiB pool) and {} MiB of {} peers{}",
            pool.reserved_bytes() >> 20,
            pool.block >> 20,
            pool.pool_off >> 20,
            pool.pool_bytes >> 20,
            (pool.block * (n - 1)) >> 20,
            n - 1,
            if sharers > 1 {
                format!("; {sharers} ranks share this GPU (allow_shared_gpu): {blocks} collective and {p2p_blocks} send/recv blocks per kernel, timings are not meaningful")
            } else {
                String::new()
            }
        );
        words.write(HostWords::POISON_SRC, 1 + mesh.local_index() as u32);
        // Read while the connections are up: a peer that died can no longer be asked.
        let pids: Vec<Option<u32>> = (0..n).map(|j| mesh.peer_pid(j)).collect();
        let sh = Arc::new(Shared {
            dev: dev.clone(),
            words,
            poisoned: Mutex::new(None),
            stop: AtomicBool::new(false),
            peer_poison: (0..n).filter(|&j| j != mesh.local_index()).map(|j| pool.block_addr(j) + POISON_OFF as u64).collect(),
            own_poison: pool.block_addr(mesh.local_index()) + POISON_OFF as u64,
            poison_stream,
            peers_poisoned: AtomicBool::new(false),
            own_poisoned: AtomicBool::new(false),
            local_ranks: local_ranks.clone(),
            pids,
            mesh: mesh.clone(),
            me: mesh.local_index(),
            timeout,
            teardown: cfg.cuda_error_teardown,
            ll_grid: low_latency_grid(blocks),
            armed: AtomicBool::new(false),
            telling_peers: Mutex::new(()),
        });
        // Cyclic: the order hands out events that come back to the engine (`EventHome`).
        let engine = Arc::new_cyclic(|me: &std::sync::Weak<CudaEngine>| CudaEngine {
            sh: sh.clone(),
            pool: std::mem::ManuallyDrop::new(pool),
            heap,
            inplace_min: cfg.cuda_inplace_min_bytes as u64,
            last_counts: Mutex::new([0; 4]),
            kernels: std::mem::ManuallyDrop::new(kernels),
            undrained: AtomicBool::new(false),
            internal,
            order: Mutex::new(Order::new(dev.clone(), free_events, timeout, me.clone() as std::sync::Weak<dyn EventHome>)),
            base,
            blocks,
            sm,
            gpu_sharers: sharers,
            one_shot_max: cfg.cuda_allreduce_one_shot_max_bytes,
            low_latency_max: cfg.cuda_low_latency_max_bytes.min(ll_max_bytes(n)),
            sync_on_caller: cfg.cuda_sync_stream,
            local_ranks: local_ranks.clone(),
            collectives: Default::default(),
            watchdog: Mutex::new(None),
            timeout,
            p2p_streams,
            copy_streams,
            copy_engine_min: cfg.cuda_copy_engine_min_bytes,
            ring_min: cfg.cuda_ring_min_bytes,
            inbox_off: inbox_off as u64,
            chunk: chunk as u64,
            p2p_blocks,
            p2p_bytes: cfg.cuda_p2p_bytes,
        });
        drop(_ctx);
        let wd = {
            let sh = sh.clone();
            std::thread::Builder::new()
                .name("rsccl-cuda-watchdog".into())
                .spawn(move || watchdog(sh))
                .map_err(|e| Error::os("starting the CUDA watchdog thread", e))?
        };
        *engine.watchdog.lock() = Some(wd);
        if cfg.cuda_warmup {
            engine.warm_up()?;
        }
        // From now on a failure a kernel reports ends the process (cuda_error_teardown):
        // one during creation is raised by it.
        sh.armed.store(true, std::sync::atomic::Ordering::Release);
        Ok(engine)
    }

    /// One collective of every kernel, on the internal stream, then wait: the first real
    /// collective finds the kernels resident and the signal pads in use.
    pub(super) fn warm_up(self: &Arc<Self>) -> Result<()> {
        let stream = self.internal.raw() as u64;
        let n = self.pool.nranks;
        // Zero-length calls run every barrier path without touching user memory: every
        // kind but send/recv (below) and the invalid call (the barrier's kernel), in
        // `Kind::ALL` order on every rank, a kind with chunks with an empty chunk per rank;
        // a kind with several kernels (`decide::kernels_of`: all_reduce's one-shot,
        // two-shot and low-latency ones) runs each, in that order on every rank. A new kind
        // is warmed up with no line here.
        for kind in Kind::ALL.into_iter().filter(|&k| k != Kind::Invalid && !k.is_p2p()) {
            let dtype = if kind.has_op() { DType::BF16 } else { DType::U8 };
            let chunks = kind.has_chunks().then(|| Chunks::empty(n));
            let call = CudaCall { dtype, chunks, ..CudaCall::bare(kind, 0, stream, false) };
            self.launch(&call)?;
            let picked = kernel(kind, 0, dtype.size(), n, self.one_shot_max, self.low_latency_max);
            for &k in kernels_of(kind).iter().filter(|&&k| k != picked) {
                let ev = self.launch_inner(&call, k)?;
                self.checked(ev)?;
            }
        }
        // An empty send to every peer and recv from every peer: one step each, so the
        // pairs' sequence numbers stay in step. Each is a blocking launch on the internal
        // stream, so the GPU runs them one after the other in this order on every rank;
        // that cannot deadlock because an empty send completes without its receiver (one
        // step, within the two a sender may run ahead), so every recv finds its send.
        for peer in (0..n).filter(|&p| p != self.pool.me) {
            for kind in [Kind::Send, Kind::Recv] {
                self.launch(&CudaCall { root: self.local_ranks[peer], ..CudaCall::bare(kind, 0, stream, false) })?;
            }
        }
        let _ctx = self.sh.dev.bind()?;
        self.warm_copy_engines()?;
        check(self.internal.synchronize(), "cuStreamSynchronize (warm-up)")?;
        self.health()
    }
}
