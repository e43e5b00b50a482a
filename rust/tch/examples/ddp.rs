//! Data-parallel training of a small tch::nn model with rsccl-tch.
//!
//!   torchrun --nproc_per_node=4 --no-python target/release/examples/ddp --steps 30
//!   target/release/examples/ddp --steps 30          # one process: the reference
//!
//! Every rank builds the same model (rank 0's parameters are broadcast, as DDP does), takes
//! its share (rank-strided rows) of each global batch, and after backward all-reduces every
//! gradient with AVG, asynchronously (one Work per parameter, waited before the step). With
//! equal shares, the average of the ranks' mean-loss gradients is the full batch's, so the
//! losses rank 0 prints equal a one-process run on the same data (to rounding).
//! `--device cuda` trains on the group's GPU (float32: rsccl's CUDA kernels reduce
//! float32/16, bfloat16, int32/64).

use rsccl_tch::{ProcessGroup, ReduceOp, Work};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

struct Args {
    steps: usize,
    global_batch: i64,
    cuda: bool,
}

fn args() -> Args {
    let mut a = Args { steps: 30, global_batch: 64, cuda: false };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let val = || argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--steps" => a.steps = val().parse().expect("--steps N"),
            "--global-batch" => a.global_batch = val().parse().expect("--global-batch N"),
            "--device" => a.cuda = val() == "cuda",
            other => panic!("unknown argument {other}; use --steps N --global-batch N --device cpu|cuda"),
        }
        i += 2;
    }
    a
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args();
    // libtorch sees the GPUs only once libtorch_cuda is loaded (tch's link line may drop it).
    rsccl_tch::cuda::load_torch_cuda();
    // No RANK: one process, no group (the reference run).
    let pg = if std::env::var("RANK").is_ok() { Some(ProcessGroup::from_env()?) } else { None };
    let (rank, world) = pg.as_ref().map_or((0, 1), |p| (p.rank(), p.size()));
    let device = match (&pg, a.cuda) {
        (Some(p), true) => Device::Cuda(p.cuda_device().ok_or("--device cuda, but the group has no CUDA engine")? as usize),
        (None, true) => Device::Cuda(0),
        _ => Device::Cpu,
    };
    if a.cuda && !tch::Cuda::is_available() {
        return Err("--device cuda, but libtorch sees no GPU".into());
    }
    let kind = if a.cuda { Kind::Float } else { Kind::Double };
    if a.global_batch % world as i64 != 0 {
        return Err(format!("--global-batch {} is not divisible by the {world} ranks", a.global_batch).into());
    }

    // The data set: the same on every rank (a fixed seed).
    tch::manual_seed(1234);
    let n = 512;
    let x = Tensor::randn([n, 16], (Kind::Double, Device::Cpu));
    let w = Tensor::randn([16, 1], (Kind::Double, Device::Cpu));
    let y = x.matmul(&w).tanh() + x.narrow(1, 0, 1).sin() * 0.1;
    let (x, y) = (x.to_kind(kind).to_device(device), y.to_kind(kind).to_device(device));

    // The model: the same initialization everywhere, then rank 0's values broadcast.
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq().add(nn::linear(vs.root() / "l1", 16, 32, Default::default())).add_fn(|t| t.relu()).add(nn::linear(
        vs.root() / "l2",
        32,
        1,
        Default::default(),
    ));
    vs.set_kind(kind);
    vs.set_device(device);
    let params = vs.trainable_variables();
    if let Some(pg) = &pg {
        tch::no_grad(|| params.iter().try_for_each(|p| pg.broadcast(p, 0)))?;
    }
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;

    let local = a.global_batch / world as i64;
    for step in 0..a.steps {
        // This rank's rows of the global batch: start + rank, start + rank + world, ...
        let start = (step as i64 * a.global_batch) % (n - a.global_batch + 1);
        let idx = Tensor::arange_start_step(start + rank as i64, start + a.global_batch, world as i64, (Kind::Int64, device));
        assert_eq!(idx.size()[0], local);
        let (xb, yb) = (x.index_select(0, &idx), y.index_select(0, &idx));
        opt.zero_grad();
        let loss = model.forward(&xb).mse_loss(&yb, tch::Reduction::Mean);
        loss.backward();
        let report = loss.detach().copy();
        if let Some(pg) = &pg {
            // Every gradient averaged over the ranks, all in flight at once.
            let works: Vec<Work> = params.iter().map(|p| pg.all_reduce_async(&p.grad(), ReduceOp::Avg)).collect::<Result<_, _>>()?;
            works.into_iter().try_for_each(Work::wait)?;
            pg.all_reduce(&report, ReduceOp::Avg)?;
        }
        opt.step();
        if rank == 0 {
            println!("step {step} loss {:.15e}", report.to_kind(Kind::Double).double_value(&[]));
        }
    }
    if let Some(pg) = &pg {
        pg.barrier()?;
        if rank == 0 {
            println!("trained on {world} ranks ({} engine)", pg.engine());
        }
    }
    Ok(())
}
