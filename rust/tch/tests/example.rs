//! The data-parallel example (examples/ddp.rs) under torchrun at 2 and 4 ranks: its losses
//! must equal a one-process run on the same data, step by step (float64; the only
//! difference is the order of additions in the gradient average).

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    // target/<profile>/deps/example-<hash> -> target/<profile>/examples/ddp
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("examples").join("ddp");
    assert!(p.exists(), "{} is missing: run `cargo test -p rsccl-tch`, which builds the examples", p.display());
    p
}

fn losses(out: &str) -> Vec<f64> {
    out.lines().filter_map(|l| l.strip_prefix("step ")).map(|l| l.split(" loss ").nth(1).unwrap().trim().parse().unwrap()).collect()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{cmd:?} failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn ddp_example_matches_one_process_under_torchrun() {
    let steps = "25";
    let single = losses(&run(Command::new(example()).args(["--steps", steps]).env_remove("RANK")));
    assert_eq!(single.len(), 25);
    assert!(single[24] < single[0] * 0.5, "the reference run did not learn: {single:?}");
    for n in [2, 4] {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let out = run(Command::new(python).args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            &n.to_string(),
            "--no-python",
            example().to_str().unwrap(),
            "--steps",
            steps,
        ]));
        let got = losses(&out);
        assert_eq!(got.len(), single.len(), "{n} ranks printed:\n{out}");
        for (s, (a, b)) in single.iter().zip(&got).enumerate() {
            assert!((a - b).abs() <= 1e-9 * a.abs().max(1e-12), "step {s}: one process {a}, {n} ranks {b}\n{out}");
        }
        assert!(out.contains(&format!("trained on {n} ranks (host engine)")), "{out}");
    }
}
