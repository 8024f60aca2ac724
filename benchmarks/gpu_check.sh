#!/bin/bash
# One prepared pass over the checks that need a GPU, for a machine with one H100/H200 and no network:
#   1. tests/autoparallel/apply/test_cudagraphs.py (the CUDA-graph capture/replay test runs only there),
#   2. benchmarks/gpu_rank_check.py: rank 0 of the LLaMA-3 8B 16 x 8 plan, the hand FSDP2 + TP + SP layout and
#      the plan run as captured CUDA graphs, with the --json record autoparallel.cost_model.measured reads,
#   3. benchmarks/calibrate_device.py,
#   4. the smoke tests with CUDA visible,
#   5. with COMPILED_LAYERS=N set: the rank check's compiled ranks (the plan with compile=True, the hand layout
#      with each block under torch.compile) on N layers.
#
#   BUDGET=540 bash benchmarks/gpu_check.sh      # from anywhere; runs from the repository root
#
# BUDGET: seconds this script may take in all (default 540); each step gets what is left, capped, and the steps
# after the first run only while more than 45 s are left. Logs and the JSON record go to $OUT
# (default /tmp/gpu_check_out).
# highspy (the solver) may be missing from the GPU image: put its wheel in .whl/ (kept out of git), fetched once
# on a machine with the package index, and the script installs it into /tmp/site:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl highspy
cd "$(dirname "$0")/.." || exit 1
START=$(date +%s); DEADLINE=$((START + ${BUDGET:-540}))
left() { echo $((DEADLINE - $(date +%s))); }
# at most $1 s, at most what is left, at least 1 s (timeout 0 would mean no limit at all)
cap() { local l; l=$(left); (( l > $1 )) && l=$1; (( l < 1 )) && l=1; echo $l; }
OUT=${OUT:-/tmp/gpu_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl; echo "pip rc $?"; } > "$OUT/env.log" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
else
  echo "no wheels in .whl/: using the installed packages" > "$OUT/env.log"
fi
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  python3 -c "import highspy; print('highspy from', highspy.__file__)"; git log -1 --format='commit %h %ci' 2>/dev/null; } >> "$OUT/env.log" 2>&1
cat "$OUT/env.log"
if ! python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null; then
  echo "no CUDA device visible: these checks need one (the rank check's CPU dry mode: see benchmarks/gpu_rank_check.py)"
  exit 1
fi
echo "== CUDA-graph tests (left $(left) s)"
timeout $(cap 150) python3 -m pytest -q -s -rs -p no:cacheprovider tests/autoparallel/apply/test_cudagraphs.py 2>&1 | grep -v DEBUG | tee "$OUT/cudagraph_test.log" | tail -12
if (( $(left) > 45 )); then
  echo "== rank check, 32 layers: autoparallel, hand, cudagraphs (left $(left) s)"
  timeout $(cap 330) python3 benchmarks/gpu_rank_check.py --ranks autoparallel hand cudagraphs --json "$OUT/rank_check.json" > "$OUT/rank_check.log" 2>&1; echo "rc $?"
  grep -v Warning "$OUT/rank_check.log" | tail -32
fi
if (( $(left) > 45 )); then
  echo "== calibrate (left $(left) s)"
  timeout $(cap 90) python3 benchmarks/calibrate_device.py > "$OUT/calibrate.log" 2>&1; echo "rc $?"; tail -8 "$OUT/calibrate.log"
fi
if (( $(left) > 45 )); then
  echo "== smoke tests with CUDA visible (left $(left) s)"
  timeout $(cap 150) python3 -m pytest -q -m smoke -n 8 -p no:cacheprovider > "$OUT/smoke.log" 2>&1; echo "rc $?"; tail -3 "$OUT/smoke.log"
fi
if [[ -n "${COMPILED_LAYERS:-}" ]] && (( $(left) > 60 )); then
  # opt-in (COMPILED_LAYERS=8, say): Inductor compiles each rank's graphs first, a one-off cost per layer count
  echo "== rank check, $COMPILED_LAYERS layers: compiled, hand_compiled (left $(left) s)"
  timeout $(cap 300) python3 benchmarks/gpu_rank_check.py --layers "$COMPILED_LAYERS" --ranks compiled hand_compiled \
    --json "$OUT/rank_check_compiled.json" > "$OUT/rank_check_compiled.log" 2>&1; echo "rc $?"
  grep -v Warning "$OUT/rank_check_compiled.log" | tail -12
fi
echo "== done, $(left) s of the budget left"
