#!/usr/bin/env bash
# One-shot GPU check of pagegate on a machine with one NVIDIA GPU and possibly nothing installed:
# prepares Python, runs the CUDA kernel tests, the kernel benchmark, the engine on CUDA against the CPU,
# a short serving run, then prints one markdown table. The whole run stays under 8 minutes.
#
#   bash bench/gpu_check.sh
#   GPU_CHECK_OUT=$OUT bash bench/gpu_check.sh       # logs and summary.md where the caller wants them
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh     # a dry run of the plumbing without a GPU (small sizes)
#
# Environment (all optional):
#   PYTHON              the interpreter to use (torch is installed for it as below when it lacks one);
#                       default: the first of python3, /opt/torch/.venv/bin/python3, .venv/bin/python whose
#                       torch sees CUDA, else python3 with torch installed as below
#   WHEELS_DIR          wheels for what that Python lacks (default .cache/wheels); installed with
#                       `pip install --no-index --find-links WHEELS_DIR --no-deps --target GPU_CHECK_SITE`
#                       until every requirement of pyproject.toml (+ pytest, triton) is met; PyPI is tried
#                       after, if it answers within a few seconds
#   GPU_CHECK_SITE      where missing packages go, put first on PYTHONPATH (default /tmp/pagegate-site)
#   GPU_CHECK_OUT       folder for the step logs and summary.md (default bench/results/gpu-check-TIME);
#                       at most 6 files, so it suits the device tool's $OUT
#   GPU_CHECK_BUDGET_S  the whole run's budget in seconds (default 450); each step also has its own
#   GPU_CHECK_DEVICE    cuda (default) or cpu (step budgets x3, whole budget 1500 s)
#   SMOLLM2             the SmolLM2 GGUF for the engine check (default .cache/models/...; skipped if missing)
#   GPU_CHECK_STEPS     the steps after setup (default "tests kernels engine serve"; "" for setup alone)
#
# Exit status: 0 when every check ran and passed; 1 when one failed or timed out; 2 when the environment
# could not be prepared (what is missing is printed). Speed goals are reported, never judged.

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

DEVICE=${GPU_CHECK_DEVICE:-cuda}
WHEELS_DIR=${WHEELS_DIR:-$ROOT/.cache/wheels}
SITE=${GPU_CHECK_SITE:-/tmp/pagegate-site}
LOGS=${GPU_CHECK_OUT:-$ROOT/bench/results/gpu-check-$(date +%Y%m%d-%H%M%S)}
SMOLLM2=${SMOLLM2:-$ROOT/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORK=$(mktemp -d /tmp/pagegate-gpu-check.XXXXXX)  # JSON, rows, the serve plot: not for LOGS

# per-step budgets in seconds; every one is also cut to what is left of BUDGET_S
# (tests: test_triton_formats.py compiles ~40 more kernel variants, one per page format and case; engine: the KV
# tiers and a LoRA batch after the models)
SETUP_S=120 TESTS_S=150 KERNELS_S=75 ENGINE_S=130 SERVE_S=80
if [[ $DEVICE == cpu ]]; then  # the dry run: Triton's interpreter and a CPU engine are slower
    BUDGET_S=${GPU_CHECK_BUDGET_S:-1500}
    SETUP_S=$((SETUP_S * 3)) TESTS_S=$((TESTS_S * 3)) KERNELS_S=$((KERNELS_S * 3))
    ENGINE_S=$((ENGINE_S * 3)) SERVE_S=$((SERVE_S * 3))
else
    BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
fi
DEADLINE=$((SECONDS + BUDGET_S))

mkdir -p "$LOGS" "$SITE"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET PAGEGATE_KERNEL_BACKEND  # the kernels must be compiled, and picked by device

ROWS=()       # the final table's rows
FAILED=0      # a correctness check failed or did not finish
declare -A TOOK  # seconds each step took

row() { ROWS+=("| $1 | $2 | $3 |"); }

# Run "$@" with a timeout that ends by the deadline given (in $SECONDS); 124 when too little is left.
until_deadline() {
    local deadline=$1 left
    shift
    left=$((deadline - SECONDS))
    ((left >= 10)) || return 124
    timeout -k 10 "$left" "$@"
}

# run_step NAME BUDGET LOG COMMAND...: the command's output goes to LOG; its tail is shown on failure.
run_step() {
    local name=$1 budget=$2 log=$3 deadline start rc
    shift 3
    deadline=$((SECONDS + budget < DEADLINE ? SECONDS + budget : DEADLINE))
    echo "== $name (at most $((deadline - SECONDS)) s)"
    start=$SECONDS
    until_deadline "$deadline" "$@" >"$log" 2>&1
    rc=$?
    TOOK[$name]=$((SECONDS - start))
    if ((rc == 124 || rc == 137)); then
        echo "   TIMEOUT after ${TOOK[$name]} s (log: $log)"
    elif ((rc != 0)); then
        echo "   exit $rc after ${TOOK[$name]} s; last lines of $log:"
        tail -n 15 "$log" | sed 's/^/   | /'
    fi
    return "$rc"
}

result_of() {  # rc -> PASS / TIMEOUT / FAIL
    case $1 in 0) echo PASS ;; 124 | 137) echo TIMEOUT ;; *) echo FAIL ;; esac
}

print_table() {
    local table=$LOGS/summary.md
    {
        echo
        echo "## pagegate GPU check ($DEVICE, $(date -u +%Y-%m-%dT%H:%MZ))"
        echo
        echo "| check | result | figures |"
        echo "|---|---|---|"
        printf '%s\n' "${ROWS[@]}"
        echo
        local steps="" name
        for name in setup tests kernels engine serve; do
            [[ -n ${TOOK[$name]:-} ]] && steps+="$name ${TOOK[$name]} s, "
        done
        echo "total $SECONDS s of a $BUDGET_S s budget (${steps%, }); logs in $LOGS"
    } | tee "$table"
}

finish() {  # finish EXIT_CODE
    print_table
    rm -rf "$WORK"
    exit "$1"
}

# -- 1. environment ----------------------------------------------------------------------------------
# Prints the requirements (pip syntax) that this Python does not meet, each after "wheel<TAB>" when
# WHEELS_DIR has a wheel that fits it, else after "index<TAB>": pyproject.toml's dependencies and build
# requirements, the extra ones named as arguments, and what the packages already put in SITE need.
MISSING_PY='
import importlib.metadata as md
import os
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

site, wheels_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
supported = set(sys_tags())
wheels = []
for file in os.listdir(wheels_dir) if os.path.isdir(wheels_dir) else []:
    try:
        name, version, _, tags = parse_wheel_filename(file)
    except ValueError:  # not a wheel
        continue
    if tags & supported:
        wheels.append((name, version))


def source(req):
    fits = any(n == canonicalize_name(req.name) and req.specifier.contains(v, prereleases=True) for n, v in wheels)
    return "wheel" if fits else "index"


with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
build = [r for r in project["build-system"]["requires"] if not r.startswith("wheel")]
queue, seen = project["project"]["dependencies"] + build + extra, set()
while queue:
    req = Requirement(queue.pop())
    name = canonicalize_name(req.name)
    if (req.marker and not req.marker.evaluate({"extra": ""})) or name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print(f"{source(req)}\t{req.name}{req.specifier}")
        continue
    if not req.specifier.contains(dist.version, prereleases=True):
        print(f"{source(req)}\t{req.name}{req.specifier}")
    elif str(dist.locate_file("")).startswith(site):
        queue.extend(dist.requires or [])
'

TORCH_PROBE='
import sys
import torch
if sys.argv[1] != "cpu" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
'

find_python() {  # sets PY to an interpreter whose torch sees the device; 1 when none does
    local candidate path candidates=(python3 /opt/torch/.venv/bin/python3 "$ROOT/.venv/bin/python")
    [[ -n ${PYTHON:-} ]] && candidates=("$PYTHON")
    for candidate in "${candidates[@]}"; do
        path=$(command -v "$candidate" 2>/dev/null) || continue
        if until_deadline "$1" "$path" -c "$TORCH_PROBE" "$DEVICE" >>"$LOGS/01-setup.log" 2>&1; then
            PY=$path
            return 0
        fi
    done
    return 1
}

pypi_answers() {
    until_deadline "$1" timeout 15 "$PY" -m pip index versions pip --timeout 5 --retries 0 >/dev/null 2>&1
}

# pip_into_site DEADLINE PIP_ARGS...: pip install --target a fresh folder, then move its entries into SITE,
# merging folders that several packages share (nvidia/): `--target SITE --upgrade` would replace them.
pip_into_site() {
    local deadline=$1 tmp rc entry
    shift
    tmp=$(mktemp -d "$SITE.XXXXXX")  # beside SITE, so mv is a rename
    until_deadline "$deadline" "$PY" -m pip install -q --no-deps --no-compile --target "$tmp" "$@" \
        >>"$LOGS/01-setup.log" 2>&1
    rc=$?
    if ((rc == 0)); then
        for entry in "$tmp"/*; do
            [[ -e $entry ]] || continue
            if [[ -d $entry && -d $SITE/${entry##*/} ]]; then
                cp -a "$entry"/. "$SITE/${entry##*/}"/
            else
                mv -f "$entry" "$SITE"/
            fi
        done
    fi
    rm -rf "$tmp"
    return "$rc"
}

# Install what MISSING_PY lists into SITE, from WHEELS_DIR where it has a fitting wheel, else from PyPI if
# it answers; in rounds, since each round's packages may need more. 1 when something stays missing.
install_missing() {
    local deadline=$1 round listed kind req log=$LOGS/01-setup.log from_wheels from_index
    shift
    for round in 1 2 3 4 5 6 7 8; do
        listed=$(until_deadline "$deadline" "$PY" -c "$MISSING_PY" "$SITE" "$WHEELS_DIR" "$@" 2>>"$log") || {
            echo "   could not list the missing requirements; last lines of $log:"
            tail -n 5 "$log" | sed 's/^/   | /'
            return 1
        }
        [[ -n $listed ]] || return 0
        from_wheels=() from_index=()
        while IFS=$'\t' read -r kind req; do
            if [[ $kind == wheel ]]; then from_wheels+=("$req"); else from_index+=("$req"); fi
        done <<<"$listed"
        echo "   round $round into $SITE: from WHEELS_DIR: ${from_wheels[*]:-none}; from PyPI: ${from_index[*]:-none}"
        if ((${#from_wheels[@]})) &&
            ! pip_into_site "$deadline" --no-index --find-links "$WHEELS_DIR" "${from_wheels[@]}"; then
            echo "   installing from $WHEELS_DIR failed; last lines of $log:"
            tail -n 5 "$log" | sed 's/^/   | /'
            return 1
        fi
        ((${#from_index[@]})) || continue
        if ! pypi_answers "$deadline"; then
            echo "   MISSING (no fitting wheel in $WHEELS_DIR, and PyPI does not answer): ${from_index[*]}"
            return 1
        fi
        if ! pip_into_site "$deadline" --timeout 10 --retries 1 "${from_index[@]}"; then
            echo "   MISSING (installing from PyPI failed): ${from_index[*]}; last lines of $log:"
            tail -n 5 "$log" | sed 's/^/   | /'
            return 1
        fi
    done
    echo "   still unmet after $round rounds: ${from_wheels[*]:-} ${from_index[*]:-}"
    return 1
}

setup_env() {
    local deadline=$((SECONDS + SETUP_S < DEADLINE ? SECONDS + SETUP_S : DEADLINE)) start=$SECONDS
    # typing_extensions: anyio 4.16 imports its `sentinel` (4.16) while asking only for >= 4.5
    local extra=("pytest>=8" "triton>=3.0" "typing_extensions>=4.16")
    echo "== setup (at most $((deadline - SECONDS)) s; log $LOGS/01-setup.log)"
    if ! find_python "$deadline"; then
        PY=$(command -v "${PYTHON:-python3}") || {
            row "environment" FAIL "no python3 on PATH"
            return 1
        }
        echo "   no Python here has torch with $DEVICE; installing torch for $PY from wheels"
        # the dry run: the pinned CPU build (an unpinned torch is a multi-GB CUDA build that needs CUDA's libraries)
        [[ $DEVICE == cpu ]] && extra+=("torch==2.13.0")
    fi
    "$PY" -m pip --version >/dev/null 2>&1 || {
        row "environment" FAIL "$PY has no pip: cannot install what is missing"
        return 1
    }
    if ! install_missing "$deadline" "${extra[@]}"; then
        row "environment" FAIL "missing packages (see above); carry their wheels in WHEELS_DIR=$WHEELS_DIR"
        return 1
    fi
    if ! until_deadline "$deadline" "$PY" -c "$TORCH_PROBE" "$DEVICE" >>"$LOGS/01-setup.log" 2>&1; then
        tail -n 3 "$LOGS/01-setup.log" | sed 's/^/   | /'
        command -v nvidia-smi >/dev/null && nvidia-smi -L | sed 's/^/   | nvidia-smi: /'
        row "environment" FAIL "torch cannot use $DEVICE with $PY"
        return 1
    fi
    # the Cython extensions (pagegate.core, the CPU kernel), built in place: nothing is installed
    if ! until_deadline "$deadline" "$PY" setup.py -q build_ext --inplace -j "$(nproc)" >>"$LOGS/01-setup.log" 2>&1 ||
        ! "$PY" -c "import pagegate.core, pagegate.kernels.cpu_paged" >>"$LOGS/01-setup.log" 2>&1; then
        echo "   building the Cython extensions failed; last lines of $LOGS/01-setup.log:"
        tail -n 15 "$LOGS/01-setup.log" | sed 's/^/   | /'
        row "environment" FAIL "building pagegate's Cython extensions failed (a C compiler and Python.h are needed)"
        return 1
    fi
    TOOK[setup]=$((SECONDS - start))
    local versions
    versions=$("$PY" - "$DEVICE" <<'EOF' 2>/dev/null
import platform, sys, torch
parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
try:
    import triton
    parts.append(f"triton {triton.__version__}")
except ImportError:
    parts.append("no triton")
if sys.argv[1] != "cpu":
    parts.insert(0, torch.cuda.get_device_name())
print(", ".join(parts))
EOF
)
    echo "   $PY: $versions"
    row "environment" PASS "$versions; extensions built (${TOOK[setup]} s)"
}

# -- 2. the CUDA kernel tests ------------------------------------------------------------------------
kernel_tests() {
    local log=$LOGS/02-tests.log rc summary
    # -o addopts: pyproject's --benchmark-disable would need pytest-benchmark, which these files do not use
    run_step tests "$TESTS_S" "$log" "$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra \
        tests/kernels/test_triton.py tests/kernels/test_triton_formats.py tests/kernels/test_triton_lora.py \
        tests/kernels/test_blocks.py tests/kernels/test_dispatch.py
    rc=$?
    summary=$(grep -E "[0-9]+ (passed|failed|error)" "$log" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
    row "kernel tests (Triton vs reference on $DEVICE, every KV page format, LoRA, blocks, dispatch)" "$(result_of "$rc")" \
        "${summary:-no pytest summary} (${TOOK[tests]} s)"
    ((rc == 0)) || FAILED=1
}

# -- 3. the kernel benchmark ------------------------------------------------------------------------
kernel_bench() {
    local log=$LOGS/03-kernels.log rc figures="" goals="goals met" line
    run_step kernels "$KERNELS_S" "$log" "$PY" bench/kernels_gpu.py --iters 20
    rc=$?
    sed 's/^/   /' "$log" | head -n 20
    if [[ $DEVICE == cpu ]]; then
        row "kernel benchmark (bench/kernels_gpu.py)" SKIP "needs CUDA"
        return
    fi
    local errors
    errors=$(grep -c "FAIL" "$log")
    row "kernel agreement in bench/kernels_gpu.py (bfloat16)" "$(result_of "$rc")" \
        "$(grep -c " ok$" "$log") ok, $errors failed (${TOOK[kernels]} s)"
    ((rc == 0)) || FAILED=1
    # "  batch   64 x context  4096: paged ... ( 81.2% of copy 4300 GB/s) ... -> paged speed 1.22x SDPA"
    local pattern='batch +([0-9]+) x context +([0-9]+):.*[( ]([0-9.]+)% of copy ([0-9]+) GB/s.*paged speed ([0-9.]+)x'
    while read -r line; do
        [[ $line =~ $pattern ]] || continue
        local m=("${BASH_REMATCH[@]}")
        figures+="${m[1]}x${m[2]}: ${m[3]}% of copy (${m[4]} GB/s), ${m[5]}x SDPA; "
        awk -v pct="${m[3]}" -v speed="${m[5]}" 'BEGIN { exit !(pct >= 70 && speed >= 1.0) }' || goals="goal missed"
    done <"$log"
    [[ -n $figures ]] || goals="no figures"
    row "decode attention speed (goal: >= 70% of copy, >= 1.0x SDPA)" "INFO: $goals" "${figures%; }"
}

# -- 4. the engine against the CPU -------------------------------------------------------------------
engine_check() {
    local rc rows=$WORK/engine-rows.md quick=()
    [[ $DEVICE == cpu ]] && quick=(--quick)
    run_step engine "$ENGINE_S" "$LOGS/04-engine.log" "$PY" bench/gpu_engine_check.py --device "$DEVICE" \
        --smollm2 "$SMOLLM2" --rows "$rows" "${quick[@]}"
    rc=$?
    sed 's/^/   /' "$LOGS/04-engine.log" | grep -v "^   *$" | tail -n 12
    if [[ -s $rows ]]; then
        mapfile -t -O "${#ROWS[@]}" ROWS <"$rows"
    fi
    if ((rc != 0)) || [[ ! -s $rows ]]; then
        row "engine check (bench/gpu_engine_check.py)" "$(result_of "$rc")" "exit $rc (${TOOK[engine]} s)"
        FAILED=1
    fi
}

# -- 5. a serving run ---------------------------------------------------------------------------------
serve_check() {
    local rc json=$WORK/serve.json load server
    if [[ $DEVICE == cpu ]]; then
        server="--device cpu --dtype float32 --num-kv-blocks 1024 --max-num-seqs 16"
        load=(--num-prompts 16 --concurrency 8 --input-len 32 --output-len 16)
    else
        server="--device cuda --num-kv-blocks 8192 --max-num-seqs 64"
        load=(--num-prompts 256 --concurrency 64 --input-len 128 --output-len 128)
    fi
    run_step serve "$SERVE_S" "$LOGS/05-serve.log" "$PY" bench/serve.py --launch \
        --server-args="$server --max-queue -1 --grpc-port 0" "${load[@]}" --out "$json"
    rc=$?
    local verdict
    verdict=$("$PY" - "$json" "$rc" <<'EOF' 2>>"$LOGS/05-serve.log"
import json, sys
path, rc = sys.argv[1], int(sys.argv[2])
try:
    report = json.load(open(path))
except OSError:
    print(f"{'TIMEOUT' if rc in (124, 137) else 'FAIL'}\tno report (serve.py exit {rc})")
    sys.exit()
s, n = report["summary"], report["config"]["num_prompts"]
ok = s["failed"] == 0 and s["completed"] == n
note = "" if rc == 0 else f"; serve.py exit {rc} after the report (plot?)"
print(f"{'PASS' if ok else 'FAIL'}\t{s['completed']}/{n} requests ok, "
      f"{report['config']['input_len']} in / {report['config']['output_len']} out, "
      f"concurrency {report['config']['concurrency']}: output {s['output_token_throughput']:,.0f} tok/s, "
      f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms / p99 {s['ttft_ms']['p99']:.0f} ms, "
      f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms{note}")
EOF
)
    [[ -n $verdict ]] || verdict=$'FAIL\tcould not read the report'
    row "serving (pagegate serve --device $DEVICE, bench/serve.py)" "${verdict%%$'\t'*}" \
        "${verdict#*$'\t'} (${TOOK[serve]} s)"
    [[ ${verdict%%$'\t'*} == PASS ]] || FAILED=1
    grep -E "output token throughput|ttft_ms|^error" "$LOGS/05-serve.log" | sed 's/^/   /'
}

trap 'echo "interrupted"; finish 1' INT TERM

setup_env || finish 2
for step in ${GPU_CHECK_STEPS-tests kernels engine serve}; do
    case $step in
        tests) kernel_tests ;;
        kernels) kernel_bench ;;
        engine) engine_check ;;
        serve) serve_check ;;
        *) echo "unknown step '$step' in GPU_CHECK_STEPS (tests kernels engine serve)" && FAILED=1 ;;
    esac
done
finish "$FAILED"
