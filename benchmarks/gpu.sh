#!/usr/bin/env bash
# The project's GPU figures in one run on one H100 or H200: run it whenever a GPU machine is lent, step first (it
# decides the training path in at most 6 minutes), and put its tables in docs/performance.md and docs/results.md with
# the machine named (OUT_DIR/gpu.txt); copy OUT_DIR/step.json to docs/gpu/step.json.
#
#   benchmarks/gpu.sh OUT_DIR [STEP...]            # on a CUDA machine: every step but scaleup, or the steps named
#   benchmarks/gpu.sh --dry-run OUT_DIR [STEP...]  # anywhere: the same runs on the tiny model on the CPU (the suite's)
#
# Steps, in this order by default, each with a time limit so that one that hangs cannot take the others' time:
#   step     gpu_step.py: one layer's forward and backward at the 1B and 8B shapes (NeuroAda with each delta-gradient
#            candidate, peft's LoRA at equal budget, LoRA with bf16 adapters) and a whole step of a random Llama-3.2-1B
#            with its peak memory and syncs, into OUT_DIR/step.json (docs/gpu/step.json's schema) and step.md
#   specs    the CUDA specs (tests/test_cuda.py, tests/test_triton_sampled_grad.py) on the GPU, into OUT_DIR/specs.txt
#   smollm2  train_cost.py on SmolLM2-135M in bf16: step time and peak memory (max_memory_allocated) of the frozen
#            floor, NeuroAda k=1 and k=20 (k=20 also with each delta gradient: the opt-in Triton kernel, which earns a
#            default only if at least 10% faster, the gathered GEMM, CUDA's default, and torch's sampled product, the
#            CPU's), the paper code's scatter_add forward, mask-based k=20, LoRA at k=20's budget and full fine-tuning
#   profile  step_profile.py's op table of one NeuroAda k=20 step on SmolLM2 (where a GPU step's time goes), then
#            primitives.py's per-op candidates for one layer (the delta gradient's kernels among them)
#   random   the smollm2 step's variants on a random 1B Llama (docs/results.md's memory table on CUDA: put them
#            through benchmarks/memory_figures.py --reports)
#   bf16     study_confirm.py's part 3, the paper's Question 1 in bf16 (NeuroAda k=20 against mask-based k=20, five
#            test seeds, at the rate the committed fp32 sweep chose), resumed from docs/study/confirm-bf16.json into
#            OUT_DIR/confirm-bf16.json (copy it back to docs/study/)
#   scaleup  (only when named: it needs ../shared/datasets beside the checkout) study.py's scale-up, commonsense_15k
#            under the paper protocol, NeuroAda k=1 and k=20 against LoRA r=1 and r=10, for the time left, into
#            OUT_DIR/study-cuda.json (resumable: run the same study.py command with `--results THAT_FILE` again)
# OUT_DIR gets gpu.txt (the GPU and software), gpu.log (every step's messages), and each step's tables and JSON.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
out=${1:?usage: benchmarks/gpu.sh [--dry-run] OUT_DIR [step|specs|smollm2|profile|random|bf16|scaleup ...]}
shift
steps=("$@")
((${#steps[@]})) || steps=(step specs smollm2 profile random bf16)
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
log="$out/gpu.log"
variants=(floor neuroada-k1 neuroada-k20 neuroada-k20-triton neuroada-k20-dense-grad neuroada-k20-sparse-grad
  paper-scatter-k20 mask-k20 lora-budget full)
# --gen-steps 0: the time limits were sized before train_cost timed greedy generation.
if ((dry_run)); then
  device=cpu dtype=float32 options=(--steps 1 --warmup 1 --infer-steps 1 --gen-steps 0)
  declare -A model=([random]=tiny [smollm2]=tiny)
  declare -A limit=([step]=300 [specs]=300 [smollm2]=300 [profile]=300 [random]=300 [bf16]=300 [scaleup]=300)
  study=(--dry-run) bf16=(--dry-run) step_args=(--dry-run)
  primitives=(--tokens 24 --d-in 16 --d-out 40 --k 1 5 --repeats 1)
else
  device=cuda dtype=bfloat16 options=(--gen-steps 0)
  declare -A model=([random]=llama-1b-random [smollm2]=smollm2)
  declare -A limit=([step]=360 [specs]=60 [smollm2]=120 [profile]=60 [random]=150 [bf16]=60 [scaleup]=110)
  study=() bf16=(--bf16-device cuda) primitives=() step_args=()
  nvidia-smi > "$out/gpu.txt" || true
fi
python -c "import platform, torch; print(platform.platform(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" >> "$out/gpu.txt"
for step in "${steps[@]}"; do
  echo "== $step" >> "$log"
  case $step in
    step)
      timeout "${limit[$step]}" python "$here/gpu_step.py" "${step_args[@]}" --out "$out/step.json" > "$out/step.md" \
        2>> "$log" || echo "the step decision failed or ran out of time: $log" ;;
    specs)
      (cd "$here/.." && timeout "${limit[$step]}" python -m pytest -n 0 -q -p no:cacheprovider tests/test_cuda.py \
        tests/test_triton_sampled_grad.py tests/test_gpu_path.py > "$out/specs.txt" 2>&1) \
        || echo "the CUDA specs failed: $out/specs.txt" ;;
    random | smollm2)
      name=${model[$step]}
      timeout "${limit[$step]}" python "$here/train_cost.py" --model "$name" --device "$device" --dtype "$dtype" \
        --variants "${variants[@]}" --rounds 1 "${options[@]}" --json "$out/train_cost-$name.json" \
        > "$out/train_cost-$name.md" 2>> "$log" || echo "train_cost on $name failed or ran out of time: $log" ;;
    profile)
      timeout "${limit[$step]}" python "$here/step_profile.py" --model "${model[smollm2]}" --device "$device" \
        --dtype "$dtype" --variant neuroada-k20 > "$out/profile.txt" 2>> "$log" \
        && timeout "${limit[$step]}" python "$here/step_profile.py" --model "${model[smollm2]}" --device "$device" \
        --dtype "$dtype" --per-layer neuroada-k1 neuroada-k20 lora-budget >> "$out/profile.txt" 2>> "$log" \
        && timeout "${limit[$step]}" python "$here/primitives.py" --device "$device" "${primitives[@]}" \
        >> "$out/profile.txt" 2>> "$log" || echo "the step profile failed or ran out of time: $log" ;;
    bf16)
      # The fp32 sweep's file, so that the bf16 arms take its chosen rate without sweeping again, and the runs done
      # (a dry run sweeps, and starts afresh).
      work=$(mktemp -d)
      ((dry_run)) || cp "$here/../docs/study/confirm.json" "$here/../docs/study/confirm-bf16.json" "$work/"
      timeout "${limit[$step]}" python "$here/study_confirm.py" --parts bf16 --results-dir "$work" "${bf16[@]}" \
        >> "$log" 2>&1 || echo "the bf16 question stopped (time limit or error): $log"
      cp "$work/confirm-bf16.json" "$out/" 2> /dev/null || true ;;
    scaleup)
      timeout "${limit[$step]}" python "$here/study.py" --device cuda --results "$out/study-cuda.json" "${study[@]}" \
        --families neuroada lora --sizes 1 20 10 \
        >> "$log" 2>&1 || echo "the study's scale-up stopped (time limit or error): $log" ;;
    *) echo "unknown step: $step (step, specs, smollm2, profile, random, bf16 or scaleup)" >&2; exit 2 ;;
  esac
done
