//! Multi-process tests of rsccl-tch: real processes (this test binary, re-run as workers),
//! joined through a c10d TCPStore served by Python's torch (the proof that the Rust client
//! speaks torch's protocol) or hosted by rank 0 (the Rust server). Every collective runs on
//! random data (the seed is printed) and is compared with a float64 / exact reference that
//! each worker computes from every rank's inputs: the `case_*` functions below are the
//! entries of the Python suites' registry, tests/cases.py, with the same arithmetic.
//!
//! RSCCL_TCH_TEST_DEVICE=cuda runs the collectives scenario on CUDA tensors (see
//! scripts/tch_gpu.sh); CI runs it on CPU tensors.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rsccl_tch::{CudaDevice, Error, Options, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

const SCENARIO: &str = "RSCCL_TCH_TEST_SCENARIO";

fn seed() -> u64 {
    std::env::var("RSCCL_TCH_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 % 1_000_000)
}

/// Python's torch TCPStore on a free port (the libuv backend, torch's default, or the
/// classic one); killed on drop.
struct PyStore(Child, u16);

impl PyStore {
    fn start() -> PyStore {
        PyStore::with_backend(true)
    }

    fn with_backend(libuv: bool) -> PyStore {
        let py = format!(
            "import sys, datetime, torch.distributed as d\n\
             s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300), use_libuv={})\n\
             print(s.port, flush=True)\n\
             sys.stdin.read()\n",
            if libuv { "True" } else { "False" }
        );
        let mut child = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .args(["-c", &py])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with torch (the store server)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("python store printed {line:?}"));
        PyStore(child, port)
    }
}

impl Drop for PyStore {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Run `scenario` in `ranks` (of `world`) worker processes; returns (rank, exit ok, output).
fn run(
    scenario: &str,
    world: usize,
    ranks: &[usize],
    port: u16,
    agent_store: bool,
    seed: u64,
    extra: &[(&str, &str)],
) -> Vec<(usize, bool, String)> {
    let exe = std::env::current_exe().unwrap();
    let children: Vec<(usize, Child)> = ranks
        .iter()
        .map(|&r| {
            let mut c = Command::new(&exe);
            c.args(["worker", "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env("RSCCL_TCH_TEST_SEED", seed.to_string())
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if agent_store {
                c.env("TORCHELASTIC_USE_AGENT_STORE", "True");
            } else {
                c.env_remove("TORCHELASTIC_USE_AGENT_STORE");
            }
            for (k, v) in extra {
                c.env(k, v);
            }
            (r, c.spawn().unwrap())
        })
        .collect();
    children
        .into_iter()
        .map(|(r, c)| {
            let out = c.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            (r, out.status.success(), text)
        })
        .collect()
}

fn assert_all_ok(what: &str, seed: u64, results: &[(usize, bool, String)]) {
    let bad: Vec<_> = results.iter().filter(|(_, ok, _)| !ok).collect();
    if !bad.is_empty() {
        let text = results.iter().map(|(r, ok, t)| format!("--- rank {r} (ok: {ok}) ---\n{t}")).collect::<Vec<_>>().join("\n");
        panic!("{what} failed on ranks {:?} (seed {seed}):\n{text}", bad.iter().map(|x| x.0).collect::<Vec<_>>());
    }
}

/// Ranks of the Python-store run: 3, or RSCCL_TCH_TEST_RANKS (the GPU script sets it).
fn ranks() -> usize {
    std::env::var("RSCCL_TCH_TEST_RANKS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

#[test]
fn python_store_every_collective() {
    let store = PyStore::start();
    let s = seed();
    let n = ranks();
    println!("seed {s}, {n} ranks");
    let res = run("collectives", n, &(0..n).collect::<Vec<_>>(), store.1, true, s, &[]);
    assert_all_ok("collectives through Python's TCPStore", s, &res);
}

#[test]
fn rank0_hosted_store_every_collective_2_ranks() {
    let s = seed();
    println!("seed {s}");
    let res = run("collectives", 2, &[0, 1], free_port(), false, s, &[]);
    assert_all_ok("collectives through rank 0's store", s, &res);
}

#[test]
fn bad_arguments_fail_on_every_rank() {
    let store = PyStore::start();
    let s = seed();
    let res = run("errors", 3, &[0, 1, 2], store.1, true, s, &[]);
    assert_all_ok("argument errors", s, &res);
}

#[test]
fn dead_peer_fails_the_others() {
    let store = PyStore::start();
    let s = seed();
    let res = run("dead_peer", 3, &[0, 1, 2], store.1, true, s, &[]);
    assert_all_ok("dead peer", s, &res);
}

#[test]
fn missing_rank_times_out_at_creation() {
    // torch's classic (non-libuv) store: its WAIT / CANCEL_WAIT answer as the libuv one's.
    let store = PyStore::with_backend(false);
    let s = seed();
    // WORLD_SIZE 2, but only rank 0 starts.
    let res = run("join_timeout", 2, &[0], store.1, true, s, &[]);
    assert_all_ok("join timeout", s, &res);
}

/// The entry point of worker processes (a no-op in the test run itself).
#[test]
fn worker() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let s = seed();
    match scenario.as_str() {
        "collectives" => collectives(s),
        "errors" => errors(),
        "dead_peer" => dead_peer(),
        "join_timeout" => join_timeout(),
        other => panic!("unknown scenario {other}"),
    }
}

// -- the scenarios ---------------------------------------------------------------------------

/// A fresh copy of `x` on `dev` (collectives write in place; the reference keeps `x`).
fn on(x: &Tensor, dev: Device) -> Tensor {
    x.to_device(dev).copy()
}

fn device(pg: &ProcessGroup) -> Device {
    match std::env::var("RSCCL_TCH_TEST_DEVICE").as_deref() {
        Ok("cuda") => Device::Cuda(pg.cuda_device().expect("RSCCL_TCH_TEST_DEVICE=cuda, but the group has no CUDA engine") as usize),
        _ => Device::Cpu,
    }
}

/// Rank `r`'s input of test `tag`: the same on every rank (seeded by seed, tag, r). Floats
/// near 1 (PRODUCT stays finite), integers in -3..=3, uint8 any byte, bool 0/1.
fn input(seed: u64, tag: u64, r: usize, shape: &[i64], kind: Kind) -> Tensor {
    tch::manual_seed((seed * 1000 + tag * 17 + r as u64) as i64);
    match kind {
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => {
            (Tensor::randn(shape, (Kind::Double, Device::Cpu)) * 0.3 + 1.0).to_kind(kind)
        }
        Kind::Bool => Tensor::randint(2, shape, (Kind::Int64, Device::Cpu)).to_kind(Kind::Bool),
        Kind::Uint8 => Tensor::randint(256, shape, (Kind::Int64, Device::Cpu)).to_kind(kind),
        _ => (Tensor::randint(7, shape, (Kind::Int64, Device::Cpu)) - 3).to_kind(kind),
    }
}

/// Every rank's input of test `tag` (tests/cases.py `inputs`): x_0 .. x_{w-1}.
fn inputs(seed: u64, tag: u64, w: usize, shape: &[i64], kind: Kind) -> Vec<Tensor> {
    (0..w).map(|r| input(seed, tag, r, shape, kind)).collect()
}

/// tests/refs.py `reduce_ref`: every rank's `xs[rank]` reduced elementwise by `op`, in
/// float64 (floats) or int64 (integers), then rounded (wrapped) once to `kind`; AVG is the
/// SUM over w, the bitwise ops fold in rank order.
fn reduce_ref(xs: &[Tensor], op: ReduceOp, kind: Kind) -> Tensor {
    let float = matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16);
    let wide: Vec<Tensor> = xs.iter().map(|x| x.to_kind(if float { Kind::Double } else { Kind::Int64 })).collect();
    let s = Tensor::stack(&wide, 0);
    let k = s.kind();
    let fold = |f: fn(&Tensor, &Tensor) -> Tensor| wide[1..].iter().fold(wide[0].shallow_clone(), |a, b| f(&a, b));
    let exact = match op {
        ReduceOp::Sum => s.sum_dim_intlist(0, false, k),
        ReduceOp::Avg => s.sum_dim_intlist(0, false, k) / xs.len() as f64,
        ReduceOp::Product => s.prod_dim_int(0, false, k),
        ReduceOp::Min => s.amin(0, false),
        ReduceOp::Max => s.amax(0, false),
        ReduceOp::BAnd => fold(Tensor::bitwise_and_tensor),
        ReduceOp::BOr => fold(Tensor::bitwise_or_tensor),
        ReduceOp::BXor => fold(Tensor::bitwise_xor_tensor),
    };
    exact.to_kind(kind)
}

/// `got` (any device) against the reference: exact for integers, a relative tolerance of
/// the dtype for floating types (the engine reduces in the dtype itself).
fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let got = got.to_device(Device::Cpu);
    let (rtol, atol) = match got.kind() {
        Kind::Double => (1e-12, 1e-12),
        Kind::Float => (1e-5, 1e-5),
        Kind::Half => (4e-3, 4e-3),
        Kind::BFloat16 => (3e-2, 3e-2),
        _ => (0.0, 0.0),
    };
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let ok = if rtol == 0.0 {
        got.to_kind(Kind::Int64).equal(&want.to_kind(Kind::Int64))
    } else {
        got.to_kind(Kind::Double).allclose(&want.to_kind(Kind::Double), rtol, atol, false)
    };
    if !ok {
        let diff = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
        panic!("{what}: result differs from the reference (max abs diff {diff})");
    }
}

// -- the cases: one function per entry of tests/cases.py (the CPU and GPU suites' registry),
// each with that entry's arithmetic, for w ranks whose inputs are x_0 .. x_{w-1} (made by
// `inputs` from the test's tag), rank `me` and root `root`. Python's reduce, gather and
// scatter have no rsccl-tch method, so no case here; barrier is called between steps.

/// One worker's view of the group: the group, the tensors' device, the seed, and the tag of
/// the next test (each test's inputs are salted by its own tag).
struct Cx {
    pg: ProcessGroup,
    dev: Device,
    seed: u64,
    me: usize,
    w: usize,
    tag: u64,
}

impl Cx {
    fn next(&mut self) -> u64 {
        self.tag += 1;
        self.tag
    }

    fn inputs(&mut self, shape: &[i64], kind: Kind) -> Vec<Tensor> {
        let t = self.next();
        inputs(self.seed, t, self.w, shape, kind)
    }
}

/// tests/cases.py `all_reduce`: every rank: out = op(x_0, ..., x_{w-1}), elementwise (AVG:
/// the SUM over w).
fn case_all_reduce(cx: &mut Cx, shape: &[i64], kind: Kind, op: ReduceOp) {
    let xs = cx.inputs(shape, kind);
    let mine = on(&xs[cx.me], cx.dev);
    cx.pg.all_reduce(&mine, op).unwrap_or_else(|e| panic!("all_reduce {kind:?} {op:?}: {e}"));
    assert_close(&format!("all_reduce {kind:?} {op:?} {shape:?}"), &mine, &reduce_ref(&xs, op, kind));
}

/// tests/cases.py `broadcast`: every rank: out = x_root (here into a non-contiguous view).
fn case_broadcast(cx: &mut Cx, shape: &[i64], kind: Kind, root: usize) {
    let xs = cx.inputs(shape, kind);
    let base = on(&xs[cx.me], cx.dev);
    cx.pg.broadcast(&base.transpose(0, 1), root).unwrap();
    assert_close(&format!("broadcast from {root}"), &base, &xs[root]);
}

/// tests/cases.py `all_gather_into_tensor`: every rank: out = concat(x_0, ..., x_{w-1}),
/// w x n elements; and `all_gather` (the list form): outs[r] = x_r.
fn case_all_gather(cx: &mut Cx, shape: &[i64], kind: Kind) {
    let xs = cx.inputs(shape, kind);
    let mut cat_shape = shape.to_vec();
    cat_shape[0] *= cx.w as i64;
    let out = Tensor::zeros(cat_shape.as_slice(), (kind, cx.dev));
    cx.pg.all_gather_into_tensor(&out, &on(&xs[cx.me], cx.dev)).unwrap();
    assert_close("all_gather_into_tensor", &out, &Tensor::cat(&xs, 0));
    let outs: Vec<Tensor> = (0..cx.w).map(|_| Tensor::zeros(shape, (kind, cx.dev))).collect();
    cx.pg.all_gather(&outs, &on(&xs[cx.me], cx.dev)).unwrap();
    for (r, o) in outs.iter().enumerate() {
        assert_close(&format!("all_gather[{r}]"), o, &xs[r]);
    }
}

/// tests/cases.py `reduce_scatter_tensor`: inputs of w x n elements; rank me:
/// out = op(x_0, ..., x_{w-1})[me*n : (me+1)*n].
fn case_reduce_scatter_tensor(cx: &mut Cx, n: i64, kind: Kind, op: ReduceOp) {
    let xs = cx.inputs(&[cx.w as i64 * n], kind);
    let out = Tensor::zeros([n], (kind, cx.dev));
    cx.pg.reduce_scatter_tensor(&out, &on(&xs[cx.me], cx.dev), op).unwrap();
    assert_close("reduce_scatter_tensor", &out, &reduce_ref(&xs, op, kind).narrow(0, cx.me as i64 * n, n));
}

/// tests/cases.py `reduce_scatter` (the list form): each rank's input cut into w chunks;
/// rank me: out = op over ranks of chunk me.
fn case_reduce_scatter(cx: &mut Cx, n: i64, kind: Kind, op: ReduceOp) {
    let xs = cx.inputs(&[cx.w as i64 * n], kind);
    let out = Tensor::zeros([n], (kind, cx.dev));
    let mine: Vec<Tensor> = on(&xs[cx.me], cx.dev).chunk(cx.w as i64, 0);
    cx.pg.reduce_scatter(&out, &mine, op).unwrap();
    assert_close("reduce_scatter", &out, &reduce_ref(&xs, op, kind).narrow(0, cx.me as i64 * n, n));
}

/// tests/cases.py `all_to_all_single`, its uneven splits (`split_matrix`: here a random
/// matrix below `rows`, zeros included): rank i sends send[i][j] rows to rank j, its rows for
/// rank 0 first; rank me: out = concat over i of the send[i][me] rows of x_i that follow its
/// rows for ranks < me (`a2a_expected`).
fn case_all_to_all_single(cx: &mut Cx, rows: i64, cols: i64, kind: Kind) {
    let t = cx.next();
    let (w, me) = (cx.w, cx.me);
    tch::manual_seed((cx.seed * 1000 + t * 17 + 999) as i64);
    let m = Vec::<i64>::try_from(&Tensor::randint(rows, [w as i64 * w as i64], (Kind::Int64, Device::Cpu))).unwrap();
    let send = |i: usize, j: usize| m[i * w + j];
    let xs: Vec<Tensor> = (0..w).map(|i| input(cx.seed, t, i, &[(0..w).map(|j| send(i, j)).sum(), cols], kind)).collect();
    let in_splits: Vec<i64> = (0..w).map(|j| send(me, j)).collect();
    let out_splits: Vec<i64> = (0..w).map(|i| send(i, me)).collect();
    let out = Tensor::zeros([out_splits.iter().sum::<i64>(), cols], (kind, cx.dev));
    cx.pg.all_to_all_single(&out, &on(&xs[me], cx.dev), &out_splits, &in_splits).unwrap();
    let want: Vec<Tensor> = (0..w).map(|i| xs[i].narrow(0, (0..me).map(|j| send(i, j)).sum(), send(i, me))).collect();
    assert_close(&format!("all_to_all_single splits {m:?}"), &out, &Tensor::cat(&want, 0));
}

/// tests/cases.py `all_to_all` (the list form, sizes that differ per source and per
/// destination): rank i sends n + 2i + j elements to rank j (x_i^j); rank me: outs[i] = x_i^me.
fn case_all_to_all(cx: &mut Cx, n: i64, kind: Kind) {
    let t = cx.next();
    let (w, me, seed) = (cx.w, cx.me, cx.seed);
    let piece = |i: usize, j: usize| input(seed, t, i * 100 + j, &[n + 2 * i as i64 + j as i64], kind);
    let ins: Vec<Tensor> = (0..w).map(|j| on(&piece(me, j), cx.dev)).collect();
    let outs: Vec<Tensor> = (0..w).map(|i| Tensor::zeros([n + 2 * i as i64 + me as i64], (kind, cx.dev))).collect();
    cx.pg.all_to_all(&outs, &ins).unwrap();
    for (i, o) in outs.iter().enumerate() {
        assert_close(&format!("all_to_all from {i}"), o, &piece(i, me));
    }
}

/// tests/cases.py `send_recv`: a ring: rank me sends x_me to me + 1 and receives x_{me-1}
/// (here both directions in flight at once, asynchronously).
fn case_send_recv(cx: &mut Cx, n: i64, kind: Kind) {
    let xs = cx.inputs(&[n], kind);
    let (w, me) = (cx.w, cx.me);
    let (to, from) = ((me + 1) % w, (me + w - 1) % w);
    let got = Tensor::zeros([n], (kind, cx.dev));
    let s = cx.pg.send_async(&on(&xs[me], cx.dev), to, 7).unwrap();
    let r = cx.pg.recv_async(&got, from, 7).unwrap();
    r.wait().unwrap();
    s.wait().unwrap();
    assert_close("recv", &got, &xs[from]);
}

fn collectives(seed: u64) {
    let pg = ProcessGroup::from_env().expect("join the group");
    let (me, w) = (pg.rank(), pg.size());
    let dev = device(&pg);
    let cuda = dev != Device::Cpu;
    println!("rank {me}/{w} on {dev:?}, seed {seed}, engine {}", pg.engine());
    let mut cx = Cx { pg, dev, seed, me, w, tag: 0 };

    // all_reduce: every op on every dtype that supports it (CUDA: the kernels' dtypes and ops).
    let float_ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max];
    let int_ops = [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor];
    let mut cases: Vec<(Kind, ReduceOp)> = vec![];
    for k in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half] {
        if cuda && k == Kind::Double {
            continue;
        }
        cases.extend(float_ops.iter().map(|&o| (k, o)));
    }
    for k in [Kind::Int, Kind::Int64] {
        cases.extend(int_ops.iter().filter(|o| !cuda || !matches!(o, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)).map(|&o| (k, o)));
    }
    if !cuda {
        cases.extend([ReduceOp::Max, ReduceOp::BXor].map(|o| (Kind::Uint8, o)));
        cases.extend([ReduceOp::BOr, ReduceOp::BAnd].map(|o| (Kind::Bool, o)));
    }
    for (kind, op) in cases {
        case_all_reduce(&mut cx, &[3, 37], kind, op);
    }
    // A large all_reduce (several staging halves on the host engine), and a non-contiguous one.
    case_all_reduce(&mut cx, &[1 << 20], Kind::Float, ReduceOp::Sum);
    let xs = cx.inputs(&[16, 8], Kind::Float);
    let base = on(&xs[me], dev);
    let view = base.transpose(0, 1);
    assert!(!view.is_contiguous());
    cx.pg.all_reduce(&view, ReduceOp::Max).unwrap();
    assert_close("non-contiguous all_reduce", &base, &reduce_ref(&xs, ReduceOp::Max, Kind::Float));

    case_broadcast(&mut cx, &[5, 9], Kind::Int64, w - 1);
    case_all_gather(&mut cx, &[4, 6], Kind::BFloat16);
    case_reduce_scatter_tensor(&mut cx, 10, Kind::Float, ReduceOp::Sum);
    case_reduce_scatter(&mut cx, 7, Kind::Int64, ReduceOp::Max);
    case_all_to_all_single(&mut cx, 8, 3, Kind::Double);
    case_all_to_all(&mut cx, 1, Kind::Int);
    case_send_recv(&mut cx, 33, Kind::Float);

    // Several asynchronous collectives in flight, waited in reverse order; one dropped
    // unwaited (its tensors stay alive until it completed), then a barrier.
    let xs: Vec<Vec<Tensor>> = (0..4).map(|_| cx.inputs(&[257], Kind::Float)).collect();
    let mine: Vec<Tensor> = xs.iter().map(|x| on(&x[me], dev)).collect();
    let works: Vec<_> = mine.iter().map(|m| cx.pg.all_reduce_async(m, ReduceOp::Sum).unwrap()).collect();
    let dropped = cx.pg.all_reduce_async(&Tensor::ones([1000], (Kind::Float, dev)), ReduceOp::Sum).unwrap();
    drop(dropped);
    for work in works.into_iter().rev() {
        work.wait().unwrap();
    }
    for (k, m) in mine.iter().enumerate() {
        assert_close(&format!("async all_reduce #{k}"), m, &reduce_ref(&xs[k], ReduceOp::Sum, Kind::Float));
    }
    cx.pg.barrier().unwrap();

    // new_group of the first and last rank: members reduce among themselves.
    let sub = cx.pg.new_group(&[0, w - 1], None).unwrap();
    assert_eq!(sub.is_some(), me == 0 || me == w - 1);
    if let Some(sub) = &sub {
        let t = cx.next();
        // float64 on CPU; CUDA reductions take float32 (and float16, bfloat16, int32/64).
        let kind = if cuda { Kind::Float } else { Kind::Double };
        let xs: Vec<Tensor> = [0, w - 1].iter().map(|&r| input(seed, t, r, &[40], kind)).collect();
        let mine = on(&xs[sub.rank()], dev);
        sub.all_reduce(&mine, ReduceOp::Sum).unwrap();
        assert_close("new_group all_reduce", &mine, &reduce_ref(&xs, ReduceOp::Sum, kind));
        assert_eq!(sub.global_ranks(), &[0, w - 1]);
    }
    cx.pg.barrier().unwrap();
    let stats = cx.pg.memory_stats();
    assert_eq!(stats.engine, "host");
    if cuda {
        assert!(stats.cuda.is_some_and(|c| c.collectives > 0), "{stats:?}");
    } else {
        assert!(stats.host.collectives > 0 && stats.host.host_region_bytes > 0, "{stats:?}");
    }
    println!("rank {me}: every collective matched its reference");
}

/// The error scenarios test the CPU paths, also on a GPU machine (where CUDA errors
/// surface asynchronously: docs/cuda.md).
fn cpu_only() -> Options {
    Options::new().cuda_device(CudaDevice::None)
}

/// Bad arguments on one rank: every rank gets the error (naming that rank), nobody hangs,
/// and the group keeps working.
fn errors() {
    let pg = ProcessGroup::from_env_with(cpu_only().timeout(Duration::from_secs(60))).unwrap();
    let (me, n) = (pg.rank(), pg.size());
    let expect = |what: &str, r: rsccl_tch::Result<()>, class: fn(&Error) -> bool, text: &str| {
        let e = r.expect_err(what);
        assert!(class(&e) && e.to_string().contains(text), "{what}: rank {me} got {e:?}, expected {text:?}");
    };
    // Sizes that differ between ranks.
    let t = Tensor::ones([if me == 0 { 8 } else { 16 }], (Kind::Float, Device::Cpu));
    expect("size mismatch", pg.all_reduce(&t, ReduceOp::Sum), |e| matches!(e, Error::Mismatch(_)), "ranks disagree on all_reduce");
    // An unsupported dtype on rank 1 only.
    let t = if me == 1 { Tensor::ones([4], (Kind::ComplexFloat, Device::Cpu)) } else { Tensor::ones([4], (Kind::Float, Device::Cpu)) };
    expect("dtype", pg.all_reduce(&t, ReduceOp::Sum), |e| matches!(e, Error::InvalidType(_)), "rank 1");
    // An undefined tensor (a gradient before backward) on rank 0.
    let t = if me == 0 { Tensor::new() } else { Tensor::ones([4], (Kind::Float, Device::Cpu)) };
    expect("undefined", pg.all_reduce(&t, ReduceOp::Sum), |e| matches!(e, Error::InvalidArgument(_)), "rank 0");
    // A root outside the group.
    let t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    expect("root", pg.broadcast(&t, n), |e| matches!(e, Error::InvalidArgument(_)), "out of range");
    // An op the dtype has not (bitwise on floats), everywhere.
    expect("op", pg.all_reduce(&t, ReduceOp::BXor), |e| matches!(e, Error::InvalidType(_)), "BXOR");
    // A wrong output size on the last rank.
    let out = Tensor::zeros([if me == n - 1 { 3 } else { 4 * n as i64 }], (Kind::Float, Device::Cpu));
    expect("all_gather size", pg.all_gather_into_tensor(&out, &t), |e| matches!(e, Error::InvalidArgument(_)), &format!("rank {}", n - 1));
    // A list of the wrong length.
    expect(
        "all_gather list",
        pg.all_gather(&[t.shallow_clone()], &t),
        |e| matches!(e, Error::InvalidArgument(_)),
        "outputs for a group of",
    );
    // Splits that do not pair up.
    let inp = Tensor::ones([n as i64 * 2], (Kind::Float, Device::Cpu));
    let mut splits = vec![2i64; n];
    if me == 0 {
        splits[0] = 3;
        splits[1] = 1;
    }
    expect(
        "all_to_all splits",
        pg.all_to_all_single(&Tensor::zeros([n as i64 * 2], (Kind::Float, Device::Cpu)), &inp, &[], &splits),
        |e| matches!(e, Error::Mismatch(_)),
        "split sizes disagree",
    );
    // Local only: sending to oneself.
    expect("send to self", pg.send(&t, me, 0), |e| matches!(e, Error::InvalidArgument(_)), "does not send to itself");
    // The group still works, with correct results.
    let x = Tensor::from_slice(&[me as f64 + 1.0, 2.0]);
    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
    let total = (n * (n + 1) / 2) as f64;
    assert_eq!(Vec::<f64>::try_from(&x).unwrap(), vec![total, 2.0 * n as f64]);
    pg.barrier().unwrap();
    println!("rank {me}: every bad argument was reported on every rank");
}

/// The last rank exits without a word after the group is made: the others' collective
/// fails with PeerFailure naming it, well before the group timeout.
fn dead_peer() {
    let pg = ProcessGroup::from_env_with(cpu_only().timeout(Duration::from_secs(120))).unwrap();
    let (me, n) = (pg.rank(), pg.size());
    pg.barrier().unwrap();
    if me == n - 1 {
        std::process::exit(0);
    }
    let start = std::time::Instant::now();
    let t = Tensor::ones([64], (Kind::Float, Device::Cpu));
    let e = pg.all_reduce(&t, ReduceOp::Sum).expect_err("a collective with a dead peer");
    assert!(matches!(e, Error::PeerFailure(_)) && e.to_string().contains(&format!("rank {}", n - 1)), "rank {me}: {e:?}");
    assert!(start.elapsed() < Duration::from_secs(100), "took the whole timeout");
    // The group is unusable from now on, with an error, not a hang.
    assert!(pg.all_reduce(&t, ReduceOp::Sum).is_err());
    println!("rank {me}: {e}");
}

/// A rank that never starts: group creation times out with the Python side's message.
fn join_timeout() {
    let e = ProcessGroup::from_env_with(cpu_only().timeout(Duration::from_secs(2))).err().expect("creation without rank 1");
    assert!(matches!(e, Error::Timeout(_)) && e.to_string().contains("rank 1 did not join the group within"), "{e:?}");
    println!("{e}");
}
