#!/usr/bin/env bash
# rsccl-tch on a GPU: the multi-process collectives test on CUDA tensors, and the
# data-parallel example on the GPU, with several ranks on one GPU or one rank per GPU.
#
# The GPU machines have torch 2.11.0+cu130 and no Rust: build here, carry two binaries.
#   On the CPU machine (Rust, pip's torch 2.11.0+cu130):
#     bash scripts/tch_gpu.sh build        # -> target/tch-gpu/{collectives,ddp}, ~5 MiB
#   On the GPU machine (device tool: carry ["target/tch-gpu"]):
#     bash scripts/tch_gpu.sh run [ranks]  # ranks: default 2 per GPU on one GPU, else 1 per GPU
#
# Ranks sharing a GPU need RSCCL_ALLOW_SHARED_GPU=1 (set below; the CUDA engine refuses a
# shared GPU without it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=target/tch-gpu

torch_lib() {
    python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"
}

case "${1:-run}" in
build)
    export LIBTORCH_USE_PYTORCH=1
    # The test binary's path is in cargo's JSON messages (its name carries a hash).
    bin=$(cargo test --release -p rsccl-tch --test collectives --no-run --message-format=json 2>/dev/null |
        python3 -c "import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get('reason') == 'compiler-artifact' and m['target']['name'] == 'collectives' and m.get('executable'):
        print(m['executable'])")
    cargo build --release -p rsccl-tch --example ddp
    mkdir -p "$OUT"
    # Debug info off (symbols kept for backtraces): 50 MiB -> ~2.6 MiB.
    objcopy --strip-debug "$bin" "$OUT/collectives"
    objcopy --strip-debug target/release/examples/ddp "$OUT/ddp"
    ls -la "$OUT"
    ;;
run)
    [ -x "$OUT/collectives" ] && [ -x "$OUT/ddp" ] || { echo "no $OUT/{collectives,ddp}: run 'bash scripts/tch_gpu.sh build' on the CPU machine and carry $OUT" >&2; exit 2; }
    TL=$(torch_lib)
    # NVRTC (rsccl compiles its kernels at group creation) comes with torch's CUDA wheels.
    NV=$(python3 -c "import glob, nvidia; print(':'.join(sorted(set(glob.glob(nvidia.__path__[0] + '/*/lib')))))")
    export LD_LIBRARY_PATH="$TL:$NV${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export RSCCL_ALLOW_SHARED_GPU=1 RSCCL_TCH_TEST_DEVICE=cuda
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    ranks=${2:-$([ "$gpus" -le 1 ] && echo 2 || echo "$gpus")}
    export RSCCL_TCH_TEST_RANKS=$ranks
    echo "== $gpus GPU(s), $ranks ranks; torch lib $TL"
    # Every collective on CUDA tensors vs the float64/exact reference, through Python's
    # TCPStore ($ranks ranks) and rank 0's Rust store (2 ranks); the error scenarios run on
    # CPU tensors in groups without a CUDA engine.
    "$OUT/collectives" --test-threads=1 --nocapture
    # The example on the GPU: float32 losses at $ranks ranks vs one process.
    "$OUT/ddp" --device cuda --steps 25 > /tmp/rsccl_tch_ddp_1.txt
    python3 -m torch.distributed.run --standalone --nproc_per_node="$ranks" --no-python "$OUT/ddp" --device cuda --steps 25 > /tmp/rsccl_tch_ddp_n.txt
    python3 - /tmp/rsccl_tch_ddp_1.txt /tmp/rsccl_tch_ddp_n.txt <<'PY'
import sys
def losses(p):
    return [float(l.split(" loss ")[1]) for l in open(p) if l.startswith("step ")]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == len(b) == 25, (a, b)
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
print(f"ddp on CUDA: 25 steps, one process {a[0]:.6f} -> {a[-1]:.6f}, multi-rank {b[0]:.6f} -> {b[-1]:.6f}, worst relative difference {worst:.2e}")
assert worst < 1e-3, "losses differ"
PY
    tail -1 /tmp/rsccl_tch_ddp_n.txt
    echo "== rsccl-tch GPU checks passed"
    ;;
*)
    echo "usage: $0 build|run [ranks]" >&2
    exit 2
    ;;
esac
