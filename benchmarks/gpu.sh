#!/usr/bin/env bash
# The project's GPU figures in one run that fits in 8 minutes on one H100: run it whenever a GPU machine is lent,
# and put its tables in docs/performance.md with the machine named (OUT_DIR/gpu.txt).
#
#   benchmarks/gpu.sh OUT_DIR            # on a CUDA machine
#   benchmarks/gpu.sh --dry-run OUT_DIR  # anywhere: the same runs on the tiny model on the CPU (the test suite's)
#
# Writes OUT_DIR/gpu.txt (the GPU and software), and per model OUT_DIR/train_cost-MODEL.md and .json: step time and
# peak memory (max_memory_allocated) of the frozen floor, NeuroAda k=1 and k=20 (k=20 also with the opt-in Triton delta
# gradient, which earns a default only if it is at least 10% faster than the pure path), the paper code's scatter_add forward,
# mask-based k=20, LoRA at k=20's budget and full fine-tuning, in bf16 (docs/results.md's memory table on CUDA; put
# them through benchmarks/memory_figures.py --reports); then benchmarks/study.py's scale-up (commonsense_15k under the
# paper protocol, NeuroAda k=1 and k=20 against LoRA r=1 and r=10, each budget at its swept rate) for the time left,
# into OUT_DIR/study-cuda.json (resumable: run the same study.py command with `--results THAT_FILE` again to go on).
# Each step has a time limit, so one that hangs cannot take the others' time.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
out=${1:?usage: benchmarks/gpu.sh [--dry-run] OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
variants=(floor neuroada-k1 neuroada-k20 neuroada-k20-triton paper-scatter-k20 mask-k20 lora-budget full)
# --gen-steps 0: the time limits were sized before train_cost timed greedy generation.
if ((dry_run)); then
  device=cpu dtype=float32 models=(tiny) limits=(300) options=(--steps 1 --warmup 1 --infer-steps 1 --gen-steps 0)
  study=(--dry-run) study_limit=300
else
  device=cuda dtype=bfloat16 models=(llama-1b-random smollm2) limits=(240 90) options=(--gen-steps 0)
  study=() study_limit=110
  nvidia-smi > "$out/gpu.txt" || true
fi
python -c "import platform, torch; print(platform.platform(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" >> "$out/gpu.txt"
for i in "${!models[@]}"; do
  model=${models[$i]}
  timeout "${limits[$i]}" python "$here/train_cost.py" --model "$model" --device "$device" --dtype "$dtype" \
    --variants "${variants[@]}" --rounds 1 "${options[@]}" --json "$out/train_cost-$model.json" \
    > "$out/train_cost-$model.md" 2> "$out/train_cost-$model.log" || echo "train_cost on $model failed or ran out of time: $out/train_cost-$model.log"
done
timeout "$study_limit" python "$here/study.py" --device cuda --results "$out/study-cuda.json" "${study[@]}" \
  --families neuroada lora --sizes 1 20 10 \
  > "$out/study-cuda.log" 2>&1 || echo "the study's scale-up stopped (time limit or error): $out/study-cuda.log"
