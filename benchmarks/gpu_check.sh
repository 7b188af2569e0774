#!/usr/bin/env bash
# The device check of issue 14, for the day a GPU is lent: one script, under 8 minutes, ending with one
# JSON line. Run from the repository root.
#
#   benchmarks/gpu_check.sh                  on the GPU machine
#   benchmarks/gpu_check.sh --cpu            here, to test the script: every part on this CPU, small sizes
#   benchmarks/gpu_check.sh --fetch-wheels   here, with network: wheels of what the GPU machine lacks -> .whl/
#   PARTS=triton,costmodel benchmarks/gpu_check.sh   only those parts (of tests, triton, graphs, steps, costmodel):
#                                            a lent GPU's minutes on what is still open
#
# 1. What it needs: torch as a CUDA build (the machine's own; never installed by this script: a pip
#    install of torch would fetch another build), numpy, pyyaml, pytest. A missing one is installed from
#    wheels in .whl/ (the lent machine reaches no network: fetch them here with --fetch-wheels and carry
#    .whl), else from the package index.
# 2. The optimizer's tests that apply on a GPU: cost model, hardware specs, GPU cost model; the generated
#    kernels' correctness suite on the GPU (tests/test_optimizer_triton.py; not test_triton_gpu_compile.py, the
#    CPU's stand-in for the GPU's own compiler, 1-2 minutes of compiles one by one) once optimizer/codegen/triton.py
#    exists, else "triton renderer not available"; the training loops replayed as CUDA graphs
#    (tests/test_optimizer_graphs.py: kept losses, accumulation, two forwards, moved parameters).
# 3. The suite's training steps with eager, Inductor and tfsn side by side, and on the GPU Inductor's
#    and tfsn's CUDA graphs against their launches one by one (benchmarks/optimizer_vs_peers.py --device
#    cuda; gpt2_block, the target's model, first).
# 4. The cost model's predicted times against measured ones for library kernels and eager ops
#    (benchmarks/gpu_costmodel_check.py: GEMMs in fp32/tf32/bf16, softmax, LayerNorm, SDPA, conv;
#    Spearman per class, top-1 regret).
# Each part runs under its own time limit (side by side: the CPU-side tests 120 s, the Triton tests and the graphs'
# tests 200 s; the models' steps 150 s together, 60 s at most each (gpt2_block, the target's, 100 s); the cost model and
# the generated kernels' launch shapes 120 s: under 8 minutes); a part that fails or runs out is reported in the
# JSON line and the others still run. A failing test is named in the log, with the end of its report, when it
# fails (benchmarks/failures_now.py): a part its limit cuts still says what failed. With $OUT set (the lent
# machine), every part's log is kept in $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=gpu
case "${1:-}" in
  --cpu) MODE=cpu ;;
  --fetch-wheels) MODE=fetch ;;
  "") ;;
  *) echo "usage: benchmarks/gpu_check.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac
PARTS=$(echo "${PARTS:-tests,triton,graphs,steps,costmodel}" | tr -d ' ')
named=0
for p in ${PARTS//,/ }; do             # a typo would spend a lent GPU's minutes on nothing: refused at once
  case $p in tests|triton|graphs|steps|costmodel) named=$((named + 1)) ;;
    *) echo "gpu_check: PARTS names '$p', not a part; the parts: tests,triton,graphs,steps,costmodel" >&2; exit 2 ;;
  esac
done
[ $named -gt 0 ] || { echo "gpu_check: PARTS names no part; the parts: tests,triton,graphs,steps,costmodel" >&2; exit 2; }
PARTS=",$PARTS,"
part() { case "$PARTS" in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
PACKAGES="numpy pyyaml pytest"               # what tfsn's optimizer and its tests need beyond torch
MODULES="numpy yaml pytest"

if [ "$MODE" = fetch ]; then                 # the GPU machine's Python: 3.12, x86-64 manylinux
  mkdir -p .whl
  if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then   # .whl travels untracked, never committed
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  fi
  exec "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl $PACKAGES iniconfig pluggy packaging
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
note() { echo "gpu_check: $*" >&2; }

# 1. what it needs
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo '{"error": "no torch in '"$PY"': the GPU machine brings its own CUDA build; set PYTHON to it"}'; exit 1
fi
DEVICE=cpu
if [ "$MODE" = gpu ]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo '{"error": "torch sees no CUDA device; run with --cpu to test the script on a CPU"}'; exit 1
  fi
  DEVICE=cuda
fi
missing=$("$PY" - $MODULES <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  note "installing what is missing: $missing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl || exit 1
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    "$PY" -m pip install -q --target "$WORK/site" $PACKAGES || { echo '{"error": "cannot install '"$missing"'"}'; exit 1; }
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TFSN_CACHE="$WORK/cache"
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"

# 2. the tests that apply, side by side: the CPU-side ones, and the generated Triton kernels on $DEVICE
note "tests"
TESTS_LIMIT=200; [ "$MODE" = cpu ] && TESTS_LIMIT=600      # Triton's interpreter on a CPU is slow
TESTS_LIMIT=${TESTS_LIMIT_S:-$TESTS_LIMIT}                 # a shorter one: to see what a cut run reports
PIDS=""
if part tests; then
  ( timeout 120 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/tests.xml" -p benchmarks.failures_now \
    tests/test_costmodel.py tests/test_hardware.py tests/test_gpu_costmodel.py > "$WORK/tests.log" 2>&1
    echo $? > "$WORK/tests.rc" ) &
  PIDS="$PIDS $!"
fi
if part graphs; then  # the training loops of tests/test_optimizer_graphs.py on the GPU's own CUDA graphs (here: the stand-in)
  ( TFSN_TEST_DEVICE=$DEVICE timeout $TESTS_LIMIT "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/graphs.xml" \
    -p benchmarks.failures_now tests/test_optimizer_graphs.py > "$WORK/graphs.log" 2>&1; echo $? > "$WORK/graphs.rc" ) &
  PIDS="$PIDS $!"
fi
TRITON="triton renderer not available"
if ! part triton; then
  TRITON="not run (PARTS)"
elif [ -f optimizer/codegen/triton.py ] && [ -f tests/test_optimizer_triton.py ]; then
  TRITON=tests
  PARALLEL=""           # Triton compiles each kernel on the CPU: spread the tests over the cores when xdist is there
  if [ "$MODE" = gpu ] && "$PY" -c "import xdist" 2>/dev/null; then PARALLEL="-n $(nproc)"; fi
  TFSN_TEST_DEVICE=$DEVICE timeout $TESTS_LIMIT "$PY" -m pytest -q -p no:cacheprovider $PARALLEL \
    -p benchmarks.failures_now --junitxml="$WORK/triton.xml" tests/test_optimizer_triton.py > "$WORK/triton.log" 2>&1
  echo $? > "$WORK/triton.rc"
fi
wait $PIDS

# 3. training steps, eager vs Inductor vs tfsn: one model at a time, so that one slow compile costs its row only
part steps && note "training steps"
if [ "$MODE" = gpu ]; then
  MODELS="gpt2_block mlp cnn lm_head_ce"; STEPS="--size bench --rounds 3 --steps 10"; LIMIT=60; BUDGET=150
else
  MODELS="mlp"; STEPS="--size small --rounds 2 --steps 3 --threads 1"; LIMIT=300; BUDGET=300
fi
part steps || MODELS=""
STEPS_END=$((SECONDS + BUDGET))
for model in $MODELS; do
  # the target's model first, with the most time: its five peers compile cold (tfsn times 4 launch shapes a kernel)
  cap=$LIMIT; if [ "$MODE" = gpu ] && [ $model = gpt2_block ]; then cap=100; fi
  left=$((STEPS_END - SECONDS)); limit=$((left < cap ? left : cap))
  echo $limit > "$WORK/steps-$model.limit"
  if [ $limit -lt 15 ]; then echo 124 > "$WORK/steps-$model.rc"; continue; fi
  timeout $limit "$PY" benchmarks/optimizer_vs_peers.py --device $DEVICE $STEPS --only $model --first-batch --json \
    > "$WORK/steps-$model.log" 2>&1
  echo $? > "$WORK/steps-$model.rc"
done

# 4. the cost model against measured kernels
part costmodel && note "cost model vs measured"
part costmodel && timeout 120 "$PY" benchmarks/gpu_costmodel_check.py --device $DEVICE --quick --json \
  --budget-s 95 > "$WORK/costmodel.log" 2>&1      # the kernels not begun by then are said skipped: the JSON still comes

if [ -n "${OUT:-}" ]; then             # the lent machine: every log back in one file (at most 8 files return)
  for f in "$WORK"/*.log; do echo "=== $(basename "$f")"; cat "$f"; done > "$OUT/gpu_check.log"
fi

PARTS=$PARTS "$PY" - "$WORK" "$DEVICE" "$TRITON" $MODELS <<'EOF'
import json, math, os, re, statistics, sys, xml.etree.ElementTree as ET
from pathlib import Path
work, device, triton, models = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]

def tests(name):
    try:
        suite = ET.parse(work / f"{name}.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        return {**counts, "failed": failed}
    except (OSError, ET.ParseError, AttributeError):
        pass
    try:    # killed at its time limit (no report written): what failed until then, as the log named it
        log = (work / f"{name}.log").read_text()
    except OSError:
        return {"error": "no output (not run?)"}
    failed = re.findall(r"^FAILED (.+) \((?:setup|call|teardown), ", log, re.MULTILINE)   # ids may hold spaces
    done = "".join(re.findall(r"^([.FEsxX]+)(?: +\[ *\d+%\])?$", log, re.MULTILINE))
    rc = (work / f"{name}.rc").read_text().strip() if (work / f"{name}.rc").is_file() else "124"
    if rc not in ("124", "137"):    # it died before its report (a crash, as a kernel's illegal access can), not cut
        return {"error": f"pytest ended with exit status {rc} after {len(done)} tests: {tail(name)}", "failed": failed}
    return {"error": f"cut by its time limit after {len(done)} tests" if done else tail(name), "failed": failed}

def last_json(name):
    try:
        lines = (work / f"{name}.log").read_text().splitlines()
    except OSError:
        return {"error": "no output"}
    for line in reversed(lines):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": tail(name)}

def tail(name):
    try:
        text = (work / f"{name}.log").read_text().strip().splitlines()
    except OSError:
        return "no output (timed out or not run)"
    return " | ".join(text[-3:])[-500:] or "no output (timed out?)"

def steps():
    rows, errors = {}, {}
    for model in models:
        found = last_json(f"steps-{model}")
        if "results" in found:
            r = found["results"][0]
            rows[model] = {"ms": r["ms"], **{k: round(r[k], 3) for k in ("vs_eager", "vs_inductor", "vs_inductor_cudagraphs",
                                                                         "cuda_graphs_gain") if k in r},
                           **({"cuda_graph_replays": r["cuda_graph_replays"]} if "cuda_graph_replays" in r else {})}
        else:
            rc = (work / f"steps-{model}.rc").read_text().strip()
            errors[model] = f"ran out of time ({(work / f'steps-{model}.limit').read_text().strip()} s for it)" if rc in ("124", "137") else found.get("error")
    geo = {k: round(math.exp(statistics.mean(math.log(r[k]) for r in rows.values())), 3)
           for k in ("vs_eager", "vs_inductor")} if rows else {}
    return {"models": rows, "geomean": geo, **({"errors": errors} if errors else {})}

import torch
costmodel = last_json("costmodel")
parts = os.environ["PARTS"].strip(",").split(",")
ran = lambda part, value: value if part in parts else "not run (PARTS)"
result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
          "tests": ran("tests", tests("tests")), "triton": tests("triton") if triton == "tests" else triton,
          "cuda_graphs": ran("graphs", tests("graphs")), "steps": ran("steps", steps()),
          "costmodel": ran("costmodel", {k: costmodel.get(k) for k in ("spec", "spearman", "classes", "top1_regret",
                                                                       "max_top1_regret", "generated_kernels", "error")
                                         if k in costmodel})}
print(json.dumps(result))
EOF
