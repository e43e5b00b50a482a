#!/usr/bin/env bash
# Sweep rsccl's CUDA tunables with the benchmark, in one call on a GPU machine: bus
# bandwidth of the large collectives on 4 GPUs for block counts and buffer sizes, and
# small all_reduce latency (eager and graph) on 2 GPUs for block counts. Prints each
# run's summary; full tables go to RESULTS_DIR/<config>/.
#
#   scripts/gpu_sweep.sh [RESULTS_DIR]      (default: $OUT, else ./gpu-sweep)
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
RESULTS=${1:-${OUT:-./gpu-sweep}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --force-reinstall dist/rsccl-*.whl || exit 2
world_large=$(python3 -c 'import torch; print(min(4, torch.cuda.device_count()))')

run() {  # name, bench arguments...
    local name=$1
    shift
    mkdir -p "$RESULTS/$name"
    # --no-fsdp: the FSDP2 section is not what this sweep reads, and would not fit in 150 s.
    timeout 150 python3 -m rsccl.bench --device cuda --no-fsdp --out-dir "$RESULTS/$name" "$@" >"$RESULTS/$name/log" 2>&1
    echo "== $name: $*"
    sed -n '/== summary/,$p' "$RESULTS/$name/log" | grep -vE "^(== summary|total time)"
    rm -f "$RESULTS/$name"/*.png "$RESULTS/$name"/*.csv
}

large=(--world-sizes "$world_large" --collectives all_reduce,reduce_scatter_tensor --min-bytes 64MiB --max-bytes 1GiB --no-graph)
run b64-m64 "${large[@]}" --rsccl-options cuda_blocks=64,cuda_buffer_bytes=64MiB
run b32-m64 "${large[@]}" --rsccl-options cuda_blocks=32,cuda_buffer_bytes=64MiB
run b64-m96 "${large[@]}" --rsccl-options cuda_blocks=64,cuda_buffer_bytes=96MiB
small=(--world-sizes 2 --collectives all_reduce --max-bytes 64KiB)
run small-b64 "${small[@]}" --rsccl-options cuda_blocks=64
run small-b16 "${small[@]}" --rsccl-options cuda_blocks=16
run small-b4 "${small[@]}" --rsccl-options cuda_blocks=4
