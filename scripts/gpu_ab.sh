#!/usr/bin/env bash
# Two or more wheels side by side on one GPU machine, alternating (A B A B ..., or A B C A B
# C ...), in one call: the CPU cost of an eager call (scripts/gpu_cpu_cost.py) and the
# benchmark's rows for the sizes and collectives asked, each installed in turn into
# python3. For "did this change cost anything" and for variants of one change: the wheels
# meet the same machine, clocks and neighbours.
#
#   scripts/gpu_ab.sh WHEEL_A WHEEL_B [WHEEL_C ...] [RESULTS_DIR]     (default: $OUT, else ./gpu-results)
#
# Arguments ending in .whl are the wheels (labelled A, B, C ... in that order); one other
# argument is the results directory.
#
# Environment:
#   AB_ROUNDS     rounds of every wheel (default 2)
#   AB_BENCH      arguments for python3 -m rsccl.bench (default: small all_reduce, 2 ranks)
#   AB_CPU_COST=0 skip scripts/gpu_cpu_cost.py
#
# Writes ab.log (every run's output, labelled) to RESULTS_DIR and prints the tables last.
set -u -o pipefail
wheels=() RESULTS=
for arg in "$@"; do
    if [[ $arg == *.whl ]]; then
        wheels+=("$arg")
    elif [[ -z $RESULTS ]]; then
        RESULTS=$arg
    else
        echo "gpu_ab: more than one results directory: $RESULTS, $arg" >&2
        exit 2
    fi
done
if ((${#wheels[@]} < 2 || ${#wheels[@]} > 26)); then
    echo "gpu_ab: give 2 to 26 wheels (*.whl), got ${#wheels[@]}: ${wheels[*]:-none}" >&2
    exit 2
fi
RESULTS=${RESULTS:-${OUT:-./gpu-results}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
ROUNDS=${AB_ROUNDS:-2}
LABELS=ABCDEFGHIJKLMNOPQRSTUVWXYZ
BENCH=${AB_BENCH:---device cuda --world-sizes 2 --collectives all_reduce --min-bytes 1KiB --max-bytes 256KiB --no-pool --no-ctas-profile --no-fsdp --no-overlap}
LOG=$RESULTS/ab.log
: >"$LOG"
status=0
for ((r = 1; r <= ROUNDS; r++)); do
    for ((w = 0; w < ${#wheels[@]}; w++)); do
        wheel=${wheels[w]}
        side=${LABELS:w:1}
        echo "=== round $r, $side: $wheel ($(date -u +%H:%M:%S))" | tee -a "$LOG"
        python3 -m pip install -q --no-index --no-deps --force-reinstall "$wheel" >>"$LOG" 2>&1 || { status=2; continue; }
        if [[ ${AB_CPU_COST:-1} != 0 ]]; then
            python3 scripts/gpu_cpu_cost.py 2>&1 | tee -a "$LOG" | tail -n 12 || status=1
        fi
        # shellcheck disable=SC2086 # BENCH is a list of arguments
        python3 -m rsccl.bench $BENCH --out-dir "$RESULTS/bench_${side}_$r" 2>&1 | tee -a "$LOG" | grep -E '^\|' | tail -n 30 || status=1
    done
done
exit $status
