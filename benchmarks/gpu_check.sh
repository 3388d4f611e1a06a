#!/usr/bin/env bash
# `--device cuda` end to end, as one prepared script for a machine with an NVIDIA GPU and
# the pinned stack installed (the README's set-up command; sglang 0.5.23 needs its CUDA
# kernels, sgl-kernel, on a GPU: the CPU build's kernel stand-in raises on any call).
#
#   bash benchmarks/gpu_check.sh            # writes $OUT (default reports/gpu) and prints a summary
#
# What it checks, in order (about 5 minutes on one H100/H200 class GPU):
#   1. the tiny fixture on cuda in fp32 and bf16: PARITY, and the same verdict, first
#      divergence and predicted acceptance as the same command on cpu;
#   2. a known fault on cuda (serving without aux capture) is still caught, with its cause;
#   3. the Llama-3.1-8B-shape random draft (built here) on cuda in bf16: verdict, wall time
#      and peak host RSS (the < 3 min goal of issue 9 is for the CPU; this is the record).
# Attention on cuda: speculators' simple_flex_attention, SGLang's TorchFlexAttnBackend
# (difftest/engines/*: ATTN_IMPL and ATTENTION_BACKENDS); the report's Environment section
# names both, and the summary checks they were the ones used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-reports/gpu}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tiny=(fixtures/tiny/speculators --target fixtures/tiny/target --states fixtures/tiny/states.safetensors --chain-steps 3 -q)

"$PY" -c "import torch, transformers, sglang, speculators; assert torch.cuda.is_available(), 'no CUDA device';
print('torch', torch.__version__, torch.cuda.get_device_name(0), 'transformers', transformers.__version__,
      'sglang', sglang.__version__, 'speculators', speculators.__version__)" | tee "$OUT/versions.txt" || exit 1

for dev in cpu cuda; do
  for dt in fp32 bf16; do
    "$PY" -m difftest.cli report "${tiny[@]}" --device $dev --dtype $dt --out "$OUT/tiny-$dev-$dt" > "$OUT/tiny-$dev-$dt.txt" 2>&1
    echo "tiny $dev $dt: exit $? $(tail -1 "$OUT/tiny-$dev-$dt.txt")"
  done
done
"$PY" -m difftest.cli report "${tiny[@]}" --device cuda --dtype fp32 --serve-without-aux-capture --out "$OUT/tiny-cuda-fault" > "$OUT/tiny-cuda-fault.txt" 2>&1
echo "tiny cuda fault (aux capture off): exit $? $(tail -1 "$OUT/tiny-cuda-fault.txt")"

"$PY" -m difftest.cli build-fixtures llama3.1-8b --out /tmp/difftest-llama > "$OUT/llama-build.txt" 2>&1 || { echo "llama build failed"; tail -5 "$OUT/llama-build.txt"; }
/usr/bin/time -v "$PY" -m difftest.cli report /tmp/difftest-llama/speculators --device cuda --dtype bf16 --no-audit-config \
  --chain-steps 4 --out "$OUT/llama-cuda" -q > "$OUT/llama-cuda.txt" 2> "$OUT/llama-cuda.time"
echo "llama cuda bf16: exit $? $(tail -1 "$OUT/llama-cuda.txt")"

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def rep(name):
    p = out / name / "report.json"
    return json.loads(p.read_text()) if p.is_file() else None
ok = True
for dt in ("fp32", "bf16"):
    cpu, cuda = rep(f"tiny-cpu-{dt}"), rep(f"tiny-cuda-{dt}")
    if not (cpu and cuda):
        print(f"tiny {dt}: missing report"); ok = False; continue
    same = (cpu["verdict"], cpu["first_divergence"]) == (cuda["verdict"], cuda["first_divergence"])
    gap = abs(cpu["acceptance"]["candidate"]["mean_accept_length"] - cuda["acceptance"]["candidate"]["mean_accept_length"])
    attn = (cuda["engines"]["reference"]["details"].get("attn_implementation"), cuda["engines"]["candidate"]["details"].get("attention_backend"))
    good = same and cuda["verdict"] == "PARITY" and gap <= cuda["acceptance"]["tolerance_accept_length"] and attn == ("simple_flex_attention", "torch_flex")
    ok &= good
    print(f"tiny {dt}: cuda {cuda['verdict']} / cpu {cpu['verdict']}, accept-length gap cpu-cuda {gap:.3f}, attention {attn}: {'ok' if good else 'FAIL'}")
fault = rep("tiny-cuda-fault")
caught = bool(fault) and fault["verdict"] == "DIVERGED" and "aux_capture" in (fault.get("diagnosis") or {}).get("cause", "")
ok &= caught
print(f"fault on cuda: {fault and fault['verdict']} {fault and (fault.get('diagnosis') or {}).get('cause')}: {'ok' if caught else 'FAIL'}")
llama = rep("llama-cuda")
t = (out / "llama-cuda.time").read_text() if (out / "llama-cuda.time").is_file() else ""
wall = re.search(r"Elapsed \(wall clock\) time.*: ([\d:.]+)", t)
rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", t)
print(f"llama3.1-8b shape on cuda bf16: {llama and llama['verdict']}, wall {wall and wall.group(1)}, "
      f"peak host RSS {rss and int(rss.group(1)) / 2**20:.2f} GiB" if rss else f"llama: {llama and llama['verdict']}")
ok &= bool(llama) and llama["verdict"] == "PARITY"
print("GPU CHECK", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
PYEOF
