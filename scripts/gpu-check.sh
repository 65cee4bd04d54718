#!/usr/bin/env bash
# The CUDA checks in one run (10 minutes or less on one H100; each part has a time limit),
# ending in one summary:
#   1. flashinfer: tests/unit/test_gpu_cuda.py's flashinfer tests (paged attention against the
#      torch backend, the engine's tokens with either backend);
#   2. tokens vs transformers on cuda (fp32 and bf16, torch and flashinfer attention);
#   3. `pdserve bench engine --device cuda` (ours vs transformers, bf16 and fp32);
#   4. `pdserve profile --device cuda --no-transport`, each step shape against the calibrated
#      roofline of the same accelerator (benchmarks/profile_vs_roofline.py: measured / roofline).
# On a machine without CUDA it prints one line and exits 0.
#
#   scripts/gpu-check.sh [--out DIR] [--cpu-dry-run]
#
# --cpu-dry-run runs every part on the CPU at a tiny size (the roofline compared as h100): it
# tests this script's plumbing, never a GPU. Exit status: 0 when no part failed (a part may be
# skipped, e.g. flashinfer when pip cannot install it), 1 otherwise.
# Environment: PDSERVE_PY (the python to use), GPU_CHECK_PIP_TIMEOUT (seconds per pip step).
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=gpu-check
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --cpu-dry-run) DRY=1; shift ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu-check.log"
: > "$LOG"
say() { echo "gpu-check: $*" | tee -a "$LOG" >&2; }

# ---- is there a GPU? -------------------------------------------------------------------------
if [ "$DRY" = 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: skipped: no CUDA device on this machine (nvidia-smi not found)"
  exit 0
fi
if [ "$DRY" = 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: skipped: no CUDA device on this machine (nvidia-smi -L lists none)"
  exit 0
fi

# ---- a python whose torch sees the device ------------------------------------------------------
PIP_T=${GPU_CHECK_PIP_TIMEOUT:-120}
has_cuda_torch() { "$1" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_pdserve() { "$1" -c 'import pdserve.cli.main' >/dev/null 2>&1; }
pick_python() {
  for cand in "${PDSERVE_PY:-}" "$ROOT/.venv/bin/python" "$ROOT/.venv-gpu/bin/python" python3; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if [ "$DRY" = 1 ] || has_cuda_torch "$cand"; then echo "$cand"; return 0; fi
  done
  return 1
}
PY=$(pick_python) || PY=""
if [ -z "$PY" ]; then
  # a bare machine: a venv that sees the system's packages (a preinstalled CUDA torch), else
  # the CUDA build of torch 2.13 from PyPI
  say "no python with a CUDA torch; making .venv-gpu"
  python3 -m venv --system-site-packages "$ROOT/.venv-gpu" >>"$LOG" 2>&1
  PY="$ROOT/.venv-gpu/bin/python"
  if ! has_cuda_torch "$PY"; then
    say "installing torch==2.13.0 (CUDA build) with pip"
    timeout "$PIP_T" "$PY" -m pip install -q --timeout 20 --retries 1 torch==2.13.0 >>"$LOG" 2>&1 \
      || say "pip could not install torch==2.13.0"
  fi
  if ! has_cuda_torch "$PY"; then
    echo "gpu-check: failed: nvidia-smi sees a GPU but no python here has a torch that can use it (see $LOG)"
    exit 1
  fi
fi
if ! has_pdserve "$PY"; then
  say "installing pdserve into $PY's environment"
  timeout "$PIP_T" "$PY" -m pip install -q --timeout 20 --retries 1 -e "$ROOT[engine,bench,dev]" >>"$LOG" 2>&1 \
    || timeout "$PIP_T" "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >>"$LOG" 2>&1 \
    || say "pip could not install pdserve"
  has_pdserve "$PY" || { echo "gpu-check: failed: pdserve does not import in $PY (see $LOG)"; exit 1; }
fi
say "python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1))"

FLASHINFER=absent
if [ "$DRY" = 0 ]; then
  if ! "$PY" -c 'import flashinfer' >/dev/null 2>&1; then
    say "installing flashinfer-python with pip (a build for this torch, if pip finds one)"
    timeout "$PIP_T" "$PY" -m pip install -q --timeout 20 --retries 1 flashinfer-python >>"$LOG" 2>&1 \
      || say "pip found no flashinfer for this torch: its tests are skipped, the rest runs"
  fi
  if "$PY" -c 'import flashinfer' >/dev/null 2>&1; then
    FLASHINFER=$("$PY" -c 'import flashinfer; print(getattr(flashinfer, "__version__", "installed"))' 2>/dev/null)
  fi
fi
say "flashinfer: $FLASHINFER"

# ---- the parts -------------------------------------------------------------------------------
DEVICE=cuda; DTYPES=bfloat16,float32; BATCHES=1,8,32; PLEN=128; GEN=64; REPEATS=3; SLOW=1
if [ "$DRY" = 1 ]; then DEVICE=cpu; DTYPES=float32; BATCHES=1,2; PLEN=16; GEN=4; REPEATS=1; SLOW=4; fi
# PDSERVE_HOME as the caller has it: its kernel builds are cached there
RESULTS="$OUT/parts.jsonl"
: > "$RESULTS"
part() {  # part NAME TIMEOUT_S CMD...: run, record status and seconds
  local name=$1 limit=$2; shift 2
  local t0 rc status
  t0=$(date +%s)
  say "part $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.out" 2>&1
  rc=$?
  case $rc in 0) status=pass ;; 124) status=fail-timeout ;; *) status=fail ;; esac
  if [ "$name" = flashinfer ] || [ "$name" = tokens ]; then
    # pytest: all selected tests skipped (exit 5: none selected) is a skip, not a pass
    if [ $rc = 5 ] || { [ $rc = 0 ] && ! grep -q " passed" "$OUT/$name.out"; }; then status=skip; fi
  fi
  printf '{"part": "%s", "status": "%s", "rc": %d, "seconds": %d, "log": "%s"}\n' \
    "$name" "$status" "$rc" $(( $(date +%s) - t0 )) "$OUT/$name.out" >> "$RESULTS"
  say "part $name: $status ($(( $(date +%s) - t0 )) s)"
}

MODEL="$OUT/bench50m"
[ -f "$MODEL/config.json" ] || "$PY" -m pdserve.cli.main model make-tiny "$MODEL" --preset bench50m >>"$LOG" 2>&1

if [ "$DRY" = 1 ]; then  # no CUDA: the module's tests all skip; run it to test the plumbing
  part flashinfer 300 "$PY" -m pytest -q -rs tests/unit/test_gpu_cuda.py -k "flashinfer and not transformers"
  part tokens 300 "$PY" -m pytest -q -rs tests/unit/test_gpu_cuda.py -k transformers
else
  part flashinfer 180 "$PY" -m pytest -q -rs tests/unit/test_gpu_cuda.py -k "flashinfer and not transformers"
  part tokens 150 "$PY" -m pytest -q -rs tests/unit/test_gpu_cuda.py -k transformers
fi
part bench_engine $((120 * SLOW)) "$PY" -m pdserve.cli.main bench engine --model "$MODEL" --device "$DEVICE" \
  --dtype "$DTYPES" --batch-sizes "$BATCHES" --prompt-len "$PLEN" --gen-len "$GEN" \
  --repeats "$REPEATS" --json "$OUT/bench_engine.json"
PROFILE_DTYPE=bfloat16; [ "$DRY" = 1 ] && PROFILE_DTYPE=float32
part profile $((150 * SLOW)) "$PY" -m pdserve.cli.main profile --model "$MODEL" --device "$DEVICE" \
  --dtype "$PROFILE_DTYPE" --threads 0 --no-transport --out "$OUT/profile.json"
HW_ARGS=(); [ "$DRY" = 1 ] && HW_ARGS=(--hardware h100)
if [ -f "$OUT/profile.json" ]; then
  part roofline 30 "$PY" -m benchmarks.profile_vs_roofline --profile "$OUT/profile.json" \
    ${HW_ARGS[@]+"${HW_ARGS[@]}"} --out "$OUT/roofline.json"
fi

# ---- one summary -----------------------------------------------------------------------------
"$PY" - "$OUT" "$FLASHINFER" "$DRY" <<'EOF'
import json, sys
from pathlib import Path
out, flashinfer, dry = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
parts = [json.loads(l) for l in (out / "parts.jsonl").read_text().splitlines() if l.strip()]
summary = {"device": "cpu (dry run: plumbing only)" if dry else "cuda", "flashinfer": flashinfer,
           "parts": {p["part"]: p["status"] for p in parts}}
try:
    import torch
    if torch.cuda.is_available():
        summary["device"] = torch.cuda.get_device_name(0)
except Exception:
    pass
for name in ("flashinfer", "tokens"):
    log = out / f"{name}.out"
    if log.exists():
        tail = [l for l in log.read_text().splitlines() if l.strip()][-1:]
        summary[f"{name}_pytest"] = tail[0] if tail else ""
try:
    be = json.loads((out / "bench_engine.json").read_text())
    summary["bench_engine"] = [
        {k: r.get(k) for k in ("dtype", "batch", "ours_prefill_tok_s", "ours_decode_tok_s",
                               "hf_prefill_tok_s", "hf_decode_tok_s")} for r in be["rows"]]
except Exception:
    pass
try:
    roof = json.loads((out / "roofline.json").read_text())
    summary["roofline"] = roof["summary"]
    summary["roofline_rows"] = [
        {"shape": r["shape"], "measured_ms": round(r["measured_ms"], 3),
         "roofline_ms": round(r["roofline_ms"], 3), "ratio": round(r["ratio"], 2)}
        for r in roof["rows"]]
except Exception:
    pass
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print("== gpu-check summary (" + summary["device"] + ")")
for p in parts:
    print(f"  {p['part']:<14}{p['status']:<14}{p['seconds']:>5} s")
if "roofline" in summary:
    s = summary["roofline"]
    print(f"  roofline {s['hardware']}: measured / roofline median {s['median_ratio']:.2f} "
          f"(min {s['min_ratio']:.2f}, max {s['max_ratio']:.2f}) over {s['shapes']} step shapes")
print(json.dumps({k: summary[k] for k in ("device", "flashinfer", "parts")} |
                 ({"roofline": summary["roofline"]} if "roofline" in summary else {})))
sys.exit(1 if any(v.startswith("fail") for v in summary["parts"].values()) else 0)
EOF
