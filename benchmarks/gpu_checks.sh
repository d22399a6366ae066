#!/usr/bin/env bash
# One device session's GPU checks (H100/H200), each step under its own time limit so that the
# results of the steps that finished always come back. Run from the repository root:
#   OUT=/tmp/out bash benchmarks/gpu_checks.sh [steps...]     (default: tests compare scaled;
#   also: offload (the offload runtime's GPU tests), diagnose (benchmarks/gpu_diagnose.py), hf
#   (benchmarks/hf_inside_layer.py at --size gpu beside HF checkpointing: issue 24),
#   offload_capture / offload_measure (benchmarks/offload_gpu.py's GPU phases; its plan phase runs
#   anywhere in between, on the graphs offload_capture wrote: unpack $OUT/offload_gpu.tgz into
#   $OFFLOAD_DIR, run the plan phase, and carry that folder to the measure step; OFFLOAD_DIR may name
#   several plan folders, ':'-separated, each measured in turn (its results in the archive's
#   measured_<folder>/; OG_NETS applies to each, and a folder without a net's plans skips it)))
# The tests run in parallel (GPU_WORKERS pytest-xdist workers: the memory-fraction tests cap their own
# process's allocator), each under its own time limit (T_TEST), so that a slow test fails with its
# traceback instead of cutting the log; each failure's traceback is written to $OUT/gpu_failures.log
# as it is reported (tests/conftest.py), so a run cut by the lease still says why. Logs are
# written to $OUT as they grow; keep T_TESTS well above T_TEST.
# Uses the machine's own PyTorch (PYTHONPATH=src). Everything lands in $OUT/gpu_checks.tgz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a crash prints its Python stack
OUT=${OUT:-/tmp/gpu_out}
R=/tmp/gpu_checks; rm -rf "$R"; mkdir -p "$R" "$OUT"
steps=${*:-tests compare scaled}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, torch.cuda.get_device_name())"; } > "$R/machine.txt" 2>&1
for s in $steps; do
  case $s in
    tests)   AUTOREMAT_FAILURE_LOG="$OUT/gpu_failures.log" timeout ${T_TESTS:-280} python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -n ${GPU_WORKERS:-4} \
               --timeout ${T_TEST:-120} -rfE --tb=short --durations=20 ${GPU_TESTS:-tests} > "$OUT/gpu_tests.log" 2>&1 ;;
    offload_capture) mkdir -p "$R/offload_gpu"; timeout ${T_OCAP:-150} python3 benchmarks/offload_gpu.py capture \
               --out "$R/offload_gpu" --nets ${OG_NETS:-densenet121,unet,gpt2,resnet50} > "$OUT/offload_capture.log" 2>&1
             tar czf "$OUT/offload_gpu.tgz" -C "$R/offload_gpu" . ;;
    offload_measure) for d in ${OFFLOAD_DIR//:/ }; do  # one or more plan folders, ':'-separated
               echo "== $d" >> "$OUT/offload_measure.log"; mkdir -p "$R/measured_$(basename "$d")"
               timeout ${T_OMEAS:-200} python3 benchmarks/offload_gpu.py measure --out "$d" \
                 --nets ${OG_NETS:-densenet121,unet,gpt2,resnet50} --rounds ${OG_ROUNDS:-3} >> "$OUT/offload_measure.log" 2>&1
               cp "$d"/measured.json "$d"/OFFLOAD_GPU.md "$R/measured_$(basename "$d")"/; done ;;
    compare) timeout ${T_COMPARE:-200} python3 benchmarks/compare_gpu.py --models ${CMP_MODELS:-resnet50,gpt2} --configs pytorch,autoremat \
               --solvers ${CMP_SOLVERS:-chen,dp-approx} --budgets 0.5 --rounds 3 --no-batch --no-match --torch-regions none \
               --compiled-plans none --solver-timeout 60 --out "$R/compare" > "$R/compare.log" 2>&1 ;;
    scaled)  timeout ${T_SCALED:-60} python3 benchmarks/scaled_capture.py --device cuda --size paper --models ${SC_MODELS:-resnet50,densenet121} \
               --rounds 2 --out "$R/scaled" > "$R/scaled.log" 2>&1 ;;
    offload) timeout ${T_OFFLOAD:-90} python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/runtime/test_offload.py tests/runtime/test_offload_saved.py tests/runtime/test_offload_region_units.py > "$R/offload_tests.log" 2>&1 ;;
    hf)      timeout ${T_HF:-240} python3 benchmarks/hf_inside_layer.py --device cuda --size gpu --models ${HF_MODELS:-gpt2,llama} \
               --rounds ${HF_ROUNDS:-3} --out "$R/hf_inside_layer" > "$R/hf.log" 2>&1 ;;
    diagnose) timeout ${T_DIAG:-150} python3 benchmarks/gpu_diagnose.py --out "$R/diagnose" > "$R/diagnose.log" 2>&1 ;;
    *) echo "unknown step $s" >> "$R/machine.txt" ;;
  esac
  echo "step $s exit $?" >> "$R/machine.txt"
done
tar czf "$OUT/gpu_checks.tgz" -C "$R" .
cp "$R/machine.txt" "$OUT/"; cat "$R/machine.txt"; for f in "$R"/*.log "$OUT"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 8 "$f"; }; done
