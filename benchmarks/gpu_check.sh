#!/usr/bin/env bash
# The GPU check of docs/benchmarks.md in one command, sized for a short lease (about 5 minutes on an
# H200): installs the package (the backend "remat" registers through its entry point, so a plain
# checkout on sys.path is not enough), measures the 8-layer Llama at the budgets where the estimate
# and the measured peak parted last (benchmarks/gpu.py), takes the allocator's snapshot and
# Inductor's schedule of the same plans (benchmarks/gpu_snapshot.py, which writes the compiled
# graphs for benchmarks/fx_replay.py), splits the planning of the same joint graph into its parts
# (benchmarks/planning.py: the first step's excess over PyTorch's, and whether the estimated peak
# rises as the budget falls, at PLAN_BUDGETS, default 0.1,0,0.3,0.05), and packs everything into one
# archive. Each part has its own time limit in seconds (GPU_S, SNAPSHOT_S, PLAN_S; PLAN_S=0 leaves the
# planning out).
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh [budgets]      # budgets: default 0.1,0
#
# Then, on any machine: tar xzf gpu_check.tgz; python benchmarks/fx_replay.py fx_llama_0_0_bw.py \
#     --forward fx_llama_0_0_fw.py
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/out}
budgets=${1:-0.1,0}
mkdir -p "$out/check"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
export PYTHONUNBUFFERED=1
model=(--model llama --layers 8 --hidden 2048 --vocab 32000 --batch 4 --seq 2048)
timeout "${GPU_S:-240}" python3 benchmarks/gpu.py "${model[@]}" --steps 10 --budgets "$budgets" \
    --peak-fractions "" --fit "" --deadline "${DEADLINE_S:-150}" --out "$out/check" > "$out/check/gpu.log" 2>&1
timeout "${SNAPSHOT_S:-200}" python3 benchmarks/gpu_snapshot.py "${model[@]}" --budgets "$budgets" \
    --out "$out/check" > "$out/check/snapshot.log" 2>&1
if [ "${PLAN_S:-120}" != 0 ]; then
    timeout "${PLAN_S:-120}" python3 benchmarks/planning.py --device cuda --layers 8 --hidden 2048 --intermediate 5632 \
        --heads 16 --vocab 32000 --seq 2048 --batch 4 --budgets "${PLAN_BUDGETS:-$budgets,0.3,0.05}" \
        --out "$out/check/planning.md" \
        > "$out/check/planning.log" 2>&1
fi
tar czf "$out/gpu_check.tgz" -C "$out/check" . && rm -rf "$out/check"
tar xzOf "$out/gpu_check.tgz" ./gpu_llama_cuda.md 2>/dev/null
tar tzf "$out/gpu_check.tgz"
