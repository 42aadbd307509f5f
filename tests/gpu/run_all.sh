#!/usr/bin/env bash
# Every GPU check of torchmn in one command, on a machine with one GPU or more (CI has none).
#
#   bash tests/gpu/run_all.sh [LOG_DIR]
#
# Prints one row per check, PASS or FAIL with its seconds, and keeps each check's output in
# LOG_DIR (a new temporary folder by default); exits 1 if any check failed. Four lanes run side by
# side (the GPU checks, the examples on CUDA, the examples on the CPU, the CPU suite), each a few
# minutes on one H200 with 16 cores. Two-rank checks take a GPU per rank where there are two; on
# one GPU the ranks share it as two NCCL hosts (NCCL_HOSTID), as NCCL refuses two ranks on one GPU
# of one host.
#
# What runs:
# - the NCCL and CUDA paths: tests/gpu/*_checks.py (collectives, optimizers, functions, pipeline,
#   parallel layers, torchmn.join, the Horovod layer, checkpoints), 2 ranks;
# - CPU tensors on this GPU machine (the default backend here is NCCL): the communicator, optimizer,
#   sharded, join, Horovod and model-parallel test files of the CPU suite, whose ranks make every
#   collective with CPU tensors through it (tests/workers/comm_checks.py's cpu_under_nccl compares
#   with gloo bit for bit and asserts the node's shared memory);
# - every example with --device cuda and with --device cpu (a CPU model on this machine);
# - ranks that would share a GPU: --device cuda refused on every rank with the fixes, --device auto
#   training on the CPU with a one-line note.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS=${1:-$(mktemp -d -t torchmn-gpu-XXXX)}
mkdir -p "$LOGS"
ROWS="$LOGS/rows"
: >"$ROWS"
PY=${PYTHON:-python3}
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPUS:-0}" -lt 1 ]; then
    echo "run_all.sh: no GPU here (nvidia-smi -L lists none); these checks need one" >&2
    exit 2
fi
if [ "$GPUS" -ge 2 ]; then SHARE=""; else SHARE='NCCL_HOSTID=h$RANK '; fi
RUN2="$PY -m torchmn run -np 2"
SMALL="--n-train 1000 --epochs 2"

# row NAME STATUS START: one line of the table, in ROWS and on the terminal.
row() {
    local line
    line=$(printf '%-4s %4ss  %s' "$2" $(( $(date +%s) - $3 )) "$1")
    echo "$line" >>"$ROWS"
    echo "$line"
}

# check NAME TIMEOUT COMMAND: PASS when COMMAND exits 0 and, with EXPECT set, its output matches
# EXPECT (an extended regular expression); its output goes to LOGS/NAME.log.
check() {
    local name=$1 limit=$2 start
    start=$(date +%s)
    if timeout "$limit" bash -c "$3" >"$LOGS/$name.log" 2>&1 \
            && { [ -z "${EXPECT:-}" ] || grep -Eq -- "$EXPECT" "$LOGS/$name.log"; }; then
        row "$name" PASS "$start"
    else
        row "$name" FAIL "$start"
    fi
}

# refused NAME TIMEOUT EXPECT COMMAND: PASS when COMMAND fails and its output matches EXPECT.
refused() {
    local name=$1 limit=$2 start
    start=$(date +%s)
    if ! timeout "$limit" bash -c "$4" >"$LOGS/$name.log" 2>&1 && grep -Eq -- "$3" "$LOGS/$name.log"; then
        row "$name" PASS "$start"
    else
        row "$name" FAIL "$start"
    fi
}

two() {  # two ranks, sharing the GPU as two NCCL hosts where there is one
    echo "$RUN2 bash -c '${SHARE}exec $PY $*'"
}

gpu_checks() {
    EXPECT="PASS parallel_layers" check nccl_checks 180 "$(two tests/gpu/nccl_checks.py)"
    EXPECT="PASS" check join_gpu_checks 150 "$(two tests/gpu/join_gpu_checks.py)"
    EXPECT="PASS sync_batch_norm" check horovod_gpu_checks 120 "$(two tests/gpu/horovod_gpu_checks.py)"
    EXPECT="PASS" check checkpoint_gpu_checks 120 "$(two tests/gpu/checkpoint_gpu_checks.py "$LOGS/ckpt")"
}

examples() {  # examples DEVICE
    local device=$1
    EXPECT="epoch +2" check "mnist_single_$device" 120 \
        "$PY examples/mnist/train_mnist_single.py $SMALL --device $device --log $LOGS/single_$device.json"
    EXPECT="epoch +2" check "mnist_$device" 120 \
        "$(two examples/mnist/train_mnist.py $SMALL --device $device --log $LOGS/mnist_$device.json)"
    EXPECT="epoch +2" check "mnist_elastic_$device" 120 \
        "$(two examples/mnist/train_mnist_elastic.py $SMALL --device $device --log $LOGS/elastic_$device.json)"
    EXPECT="validation/main/accuracy" check "mnist_ppe_$device" 120 \
        "$(two examples/mnist/train_mnist_ppe.py $SMALL --device $device --out $LOGS/ppe_$device)"
    if [ "$device" = cpu ] || [ "$GPUS" -ge 2 ]; then
        EXPECT="epoch +2" check "horovod_$device" 120 "$(two examples/horovod/pytorch_mnist.py $SMALL --device $device)"
    else  # Horovod's way pins local rank r to GPU r: one rank on one GPU
        EXPECT="epoch +2" check "horovod_$device" 120 "$PY examples/horovod/pytorch_mnist.py $SMALL --device $device"
    fi
    EXPECT="epoch +2" check "pipeline_$device" 120 "$(two examples/model_parallel/pipeline_mnist.py $SMALL --device $device)"
    EXPECT="epoch +2" check "spatial_cnn_$device" 120 "$(two examples/model_parallel/spatial_cnn.py $SMALL --device $device)"
    EXPECT="best: accuracy" check "tune_$device" 150 \
        "$(two examples/tune/tune_mnist.py --n-train 1000 --epochs 1 --n-trials 2 --device $device)"
    EXPECT="step 59 loss" check "preemptible_$device" 120 \
        "$(two examples/slurm/train_preemptible.py --steps 60 --device $device --checkpoint $LOGS/preempt_$device)"
}

shared_gpu() {  # two ranks on one GPU of one host, without NCCL_HOSTID: NCCL cannot have that
    refused shared_gpu_cuda_refused 120 "would drive GPU 0 together.*(CUDA_VISIBLE_DEVICES)" \
        "$RUN2 $PY examples/mnist/train_mnist.py $SMALL --device cuda --log $LOGS/refused.json"
    EXPECT="--device auto: training on the CPU: 2 ranks on this node would share" \
        check shared_gpu_auto_on_cpu 120 "$RUN2 $PY examples/mnist/train_mnist.py $SMALL --log $LOGS/auto.json"
}

cpu_suite() {  # the CPU suite's files on this machine's default backend (NCCL): CPU tensors throughout
    local start status=PASS pin=() n
    start=$(date +%s)
    n=$(nproc)
    # Half the cores where there are 8 or more, the other lanes keeping the rest: each job's ranks
    # size their thread budget from the cores they may use, so lanes sharing every core
    # oversubscribe them many times over.
    if [ "$n" -ge 8 ] && command -v taskset >/dev/null; then pin=(taskset -c "$((n / 2))-$((n - 1))"); fi
    # SIGINT at the limit: pytest still reports which tests failed, with their tracebacks.
    timeout -s INT 420 "${pin[@]}" $PY -m pytest -q -p no:cacheprovider -n 8 --tb=short -m "not cluster" \
        tests/test_communicator.py \
        tests/test_optimizer.py tests/test_sharded.py tests/test_join.py tests/test_horovod.py \
        tests/test_model_parallel.py tests/test_parallel_layers.py >"$LOGS/cpu_suite.log" 2>&1 || status=FAIL
    row "cpu_tensors_suite ($(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$LOGS/cpu_suite.log" | tail -1))" \
        "$status" "$start"
}

echo "torchmn GPU checks: $GPUS GPU(s), logs in $LOGS"
gpu_checks &
{ examples cuda; if [ "$GPUS" -eq 1 ]; then shared_gpu; fi; } &
examples cpu &
cpu_suite &
wait

echo
echo "summary ($GPUS GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)):"
cat "$ROWS"
! grep -q "^FAIL" "$ROWS"
