#!/bin/bash
# The side-by-side GPU benchmark of the reference stack, in one invocation on one GPU (docs/performance.md).
#
#   bash benchmarks/gpu_bench.sh [stages]        default stages: env decode codec serve peers table
#
#   env     versions, GPU, host CPU, which of our dependencies import
#   decode  benchmarks/staged_admission_check.py first (an admission staged into the next step against one prefilled
#           after it: staged-admission-check.txt), then benchmarks/decode_bench.py: ms per frame by batch size
#           (eager / graphs / compiled + graphs) vs the HBM floor, each frame's parts alone (talker, code 0, code
#           predictor, draws: --split), the talker's pass carrying an admission's prompt rows (--prompt-rows), and
#           per-kernel profiles of eager steps
#   codec   benchmarks/codec_graph_check.py first (the graph runner's samples and states against the eager
#           runner's: codec-graph-check.txt), then
#           benchmarks/codec_graph_bench.py: codec call time per (batch, frames) bucket, eager vs CUDA graph, and
#           each graph's memory, for each of CODEC_DTYPES (float32 bfloat16): the numbers --codec-dtype and
#           --codec-graph-memory-gb need
#   serve   `ttsbench serve` on a random checkpoint written by serving/model/checkpoint.py (--ignore-eos, text
#           length policy), `ttsbench run` against it over loopback: CustomVoice (custom) and voice clone
#           (Base checkpoint, clone), short and long sets, at each of LEVELS; each level's server --request-log
#           and its first-wave / later timeline (benchmarks/request_timeline.py) go in its run directory
#   peers   the official qwen-tts and faster-qwen3-tts on the same GPU, batch 1 (.peer-bench/run_device.sh:
#           a local copy of the shared peer-bench recipe with its wheels, git-ignored, never committed)
#   table   benchmarks/gpu_table.py: one table of everything above
#   cache   benchmarks/compile_cache.sh pack: the compile caches the stages before filled, as
#           $OUT/compile-cache.tar.xz, for COMPILE_CACHE in a later session (not in raw.tgz)
#
# Knobs (environment): OUT (results; default /tmp/gpu_bench), SIZE (0.6B | 1.7B), LEVELS (1,8,32,64,128),
# TASKS (custom clone), SETS (short long), PER_STREAM (requests per stream of a level, 4; a level of 128 streams of
# short text lasts ~1.7 s on an H100 at 4, and single runs of it move by ~5%: more makes A/Bs of short text steadier),
# SERVE_ARGS (extra `ttsbench serve` options), CODEC_STUB (1: the server's codec returns silence without decoding,
# benchmarks/codec_stub: the talker's ceiling, and by difference the codec's cost), RUN_ARGS (extra `ttsbench
# run` options, e.g. --clone-mode fresh: a new voice per clone request), DECODE_ARGS,
# CODEC_DTYPES, CODEC_ARGS, PEER_STAGES (fastB official), WHEELS (folder of wheels to install first; default
# .peer-bench/whl/common; benchmarks/device_wheels.sh fills one),
# TEXT_VOCAB (tiktoken ranks of the checkpoints' text tokenizer; default: Qwen's qwen.tiktoken out of a dashscope
# wheel in WHEELS (benchmarks/device_wheels.sh), else, or with TEXT_VOCAB=small, the small trained BPE of
# the earlier passes, whose prompts are ~3x too long), PYSPY (seconds, at most, of a py-spy profile of the server
# through each serve level, threads and idle ones included, stopped when the level ends; needs a py-spy wheel in
# WHEELS (benchmarks/device_wheels.sh); the raw profile
# goes in the level's run directory as pyspy.txt and benchmarks/pyspy_summary.py prints where each thread's time
# went), COMPILE_CACHE (a compile-cache.tar.xz of an earlier run: seeds Triton's and Inductor's caches on a fresh
# machine, whose first server otherwise compiles for ~190-330 s, and adds what a warm one lacks;
# benchmarks/compile_cache.sh; pack one from the first call of a session on: the `cache` stage).
# Results: $OUT/table.md, $OUT/decode.log, and $OUT/raw.tgz (env, decode.json, kernel profiles, server logs and /health,
# runs.tgz: the run directories without audio, peer JSON, gpu-clocks.csv: nvidia-smi every 2 s through the run).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_bench}; mkdir -p "$OUT"
SIZE=${SIZE:-0.6B}
LEVELS=${LEVELS:-1,8,32,64,128}
TASKS=${TASKS:-custom clone}
PER_STREAM=${PER_STREAM:-4}
SETS=${SETS:-short long}
STAGES=${*:-env decode codec serve peers table}
WORK=/tmp/gpu_bench_work; mkdir -p "$WORK"
source benchmarks/compile_cache.sh  # Triton and Inductor compile into $WORK/cache
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)
say() { echo "=== $* ($(( $(date +%s) - T0 ))s)"; }
# the GPU's clocks, power and slowdown reasons every 2 s through the run (gpu-clocks.csv, summarised by the table):
# one lent machine of six ran every stage ~1.5x slower from its second level on (docs/performance.md, thirty-sixth
# pass), and nothing in a run's own figures told it from a slower code
clocks=
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -l 2 > "$OUT/gpu-clocks.csv" 2>&1 &
  clocks=$!
  trap 'kill $clocks 2>/dev/null' EXIT  # also when a time limit ends the run (TERM: exit, so the trap runs)
  trap 'exit 143' TERM
fi

WHEELS=${WHEELS:-.peer-bench/whl/common}
# soundfile, soxr (+ cffi, pycparser), orjson: not in the image (orjson is newest: a folder an older tree filled lacks it)
if [ -d "$WHEELS" ] && [ ! -d /tmp/site_ours/orjson ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_ours \
    "$WHEELS"/soundfile-*.whl "$WHEELS"/soxr-*.whl "$WHEELS"/cffi-*.whl "$WHEELS"/pycparser-*.whl \
    "$WHEELS"/orjson-*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}:/tmp/site_ours
PYSPY=${PYSPY:-}
if [ -n "$PYSPY" ] && [ ! -x /tmp/pyspy/bin/py-spy ]; then
  if ls "$WHEELS"/py_spy-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy "$WHEELS"/py_spy-*.whl 2>&1 | grep -v WARN
  else
    echo "PYSPY is set but $WHEELS has no py-spy wheel: no profiles"; PYSPY=
  fi
fi
TTSBENCH='import sys; from ttsbench.cli import app; sys.argv[0] = "ttsbench"; app()'
ttsbench() { python3 -c "$TTSBENCH" "$@"; }

TEXT_VOCAB=${TEXT_VOCAB:-}
dashscope=$(ls "$WHEELS"/dashscope-*.whl 2>/dev/null | head -1)
if [ "$TEXT_VOCAB" = small ]; then
  TEXT_VOCAB=
elif [ -z "$TEXT_VOCAB" ] && [ -n "$dashscope" ]; then  # Qwen's real text vocabulary: realistic prompt lengths
  TEXT_VOCAB=$WORK/qwen.tiktoken
  python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
    "$dashscope" dashscope/resources/qwen.tiktoken > "$TEXT_VOCAB"
fi

checkpoint() {  # checkpoint TYPE -> directory of a random SIZE checkpoint (written once)
  local dir=$WORK/ckpt-$SIZE-$1${TEXT_VOCAB:+-qwen-vocab}
  [ -f "$dir/config.json" ] || python3 -m serving.model.checkpoint "$dir" --size "$SIZE" --type "$1" \
    ${TEXT_VOCAB:+--text-vocab "$TEXT_VOCAB"} >&2
  echo "$dir"
}

for stage in $STAGES; do
  case $stage in
  env)
    say env
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/env.txt"
    # the host runs the server's loop, its talker thread's launches and the client: a slower one slows the levels of
    # many streams with the GPU's clocks unchanged (gpu_table.py prints this line beside the clocks)
    echo "host: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) CPUs," \
      "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)" | tee -a "$OUT/env.txt"
    echo "text vocabulary: ${TEXT_VOCAB:-the small trained BPE}" | tee -a "$OUT/env.txt"
    python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("aiohttp", "typer", "rich", "pandas", "numpy", "soundfile", "soxr", "prometheus_client",
             "transformers", "safetensors", "triton"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"  {name} MISSING ({type(exc).__name__}: {exc})")
EOF
    ;;
  decode)
    say "staged admission against prefill"
    python3 benchmarks/staged_admission_check.py --model "$(checkpoint custom_voice)" --load-format dummy \
      --noise-graph 48 2>&1 | grep -v "^W[0-9]" | tail -2 | tee "$OUT/staged-admission-check.txt"
    say decode
    python3 benchmarks/decode_bench.py --model "$(checkpoint custom_voice)" --json "$OUT/decode.json" \
      --profile "$OUT/profile.txt" --split --prompt-rows 128,256,512,1024 ${DECODE_ARGS:-} 2>&1 \
      | grep --line-buffered -v "^W[0-9]" | tee "$OUT/decode.log"
    ;;
  codec)
    say "codec graphs against eager"
    python3 benchmarks/codec_graph_check.py 2>&1 | grep -v "^W[0-9]" | tail -1 | tee "$OUT/codec-graph-check.txt"
    for dt in ${CODEC_DTYPES:-float32 bfloat16}; do
      say "codec graphs ($dt)"
      python3 benchmarks/codec_graph_bench.py --device cuda --dtype "$dt" --json "$OUT/codec-graphs-$dt.json" \
        ${CODEC_ARGS:-} 2>&1 | grep --line-buffered -v "^W[0-9]" | tee "$OUT/codec-graphs-$dt.md"
    done
    ;;
  serve)
    rm -rf "$WORK/runs"; mkdir -p "$WORK/runs"
    for task in $TASKS; do
      case $task in custom) type=custom_voice;; clone) type=base;; *) echo "unknown task $task"; continue;; esac
      ck=$(checkpoint $type)
      say "serve $task ($SIZE)"
      PYTHONPATH=${CODEC_STUB:+$ROOT/benchmarks/codec_stub:}$PYTHONPATH CODEC_STUB=${CODEC_STUB:-} \
      python3 -c "$TTSBENCH" serve --model "$ck" --load-format dummy --ignore-eos --max-batch-size 128 --max-queue 512 \
        --max-model-len 1024 --port 8091 --log-level warning --request-log "$WORK/server-requests.jsonl" \
        ${SERVE_ARGS:-} > "$OUT/serve-$task.log" 2>&1 &
      pid=$!
      for _ in $(seq 600); do
        curl -sf localhost:8091/health >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
      done
      say "server up ($task)"
      curl -s localhost:8091/health | tee "$OUT/health-$task.json"; echo  # start-up by phase, graphs and their memory
      for set_ in $SETS; do
        for c in ${LEVELS//,/ }; do
          n=$(( PER_STREAM * c ))  # 4 per stream by default: a full-load span long enough to be the steady state
          curl -s localhost:8091/metrics > "$WORK/metrics-before.txt"
          rm -f "$WORK/server-requests.jsonl"
          spy=
          if [ -n "$PYSPY" ]; then  # the server's threads through the level; SIGINT makes py-spy write its file
            /tmp/pyspy/bin/py-spy record -p $pid --threads --idle --nonblocking --rate 200 --format raw \
              --duration "$PYSPY" -o "$WORK/pyspy.txt" > "$WORK/pyspy.log" 2>&1 &
            spy=$!
          fi
          ttsbench run --url http://127.0.0.1:8091 --task $task --set $set_ --concurrency $c --num-requests $n \
            --max-new-tokens 900 --warmup 1 --no-save-audio --timeout 240 --out "$WORK/runs/$task-$set_-c$c" \
            --label "$task-$set_-c$c" ${RUN_ARGS:-} > "$WORK/run-last.log" 2>&1 || tail -5 "$WORK/run-last.log"
          python3 - "$WORK/runs/$task-$set_-c$c/summary.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][0]
except Exception as exc:
    sys.exit(f"  no summary: {exc}")
def f(key, fmt="{:.1f}"):
    return "-" if r.get(key) is None else fmt.format(r[key])
print(f"  {r['task']:6s} {r['set']:5s} c={r['concurrency']:<3d} ok {r['completed']:3d} fail {r['failed']:2d} "
      f"ttfab p50 {f('ttfab_ms_median')} p95 {f('ttfab_ms_p95')} ms  rtf p50 {f('rtf_median', '{:.3f}')}  "
      f"audio/s {f('audio_throughput')}  underrun p95 {f('underrun_s_p95', '{:.3f}')} s  "
      f"starved {r.get('starved', '-')} {r.get('starved_at_chunk') or ''} errors {r.get('errors')}")
EOF
          curl -s localhost:8091/metrics > "$WORK/metrics-after.txt"
          if [ -n "$spy" ]; then
            kill -INT $spy 2>/dev/null; wait $spy
            if [ -s "$WORK/pyspy.txt" ] && [ -d "$WORK/runs/$task-$set_-c$c" ]; then
              mv "$WORK/pyspy.txt" "$WORK/runs/$task-$set_-c$c/pyspy.txt"
              python3 benchmarks/pyspy_summary.py "$WORK/runs/$task-$set_-c$c/pyspy.txt" --under CodecRunner.decode \
                --under TalkerRunner.prefill_many
            else
              echo "  no py-spy profile: $(tail -1 "$WORK/pyspy.log")"
            fi
          fi
          [ -d "$WORK/runs/$task-$set_-c$c" ] && python3 benchmarks/engine_phases.py "$WORK/metrics-before.txt" \
            "$WORK/metrics-after.txt" --json "$WORK/runs/$task-$set_-c$c/engine_phases.json"
          if [ -d "$WORK/runs/$task-$set_-c$c" ] && [ -s "$WORK/server-requests.jsonl" ]; then
            mv "$WORK/server-requests.jsonl" "$WORK/runs/$task-$set_-c$c/server_requests.jsonl"
            # the level's warm-ups come first in the server's log (a clone level sends one per voice)
            warm=$(python3 -c 'import json, sys; print(sum(json.loads(l)["warmup"] for l in open(sys.argv[1])))' \
              "$WORK/runs/$task-$set_-c$c/requests.jsonl")
            python3 benchmarks/request_timeline.py "$WORK/runs/$task-$set_-c$c/server_requests.jsonl" \
              --concurrency $c --warmup "$warm" --json "$WORK/runs/$task-$set_-c$c/server_timeline.json"
          fi
          tar -C "$WORK" -czf "$OUT/runs.tgz" runs  # after each level: a later timeout keeps what is done
        done
      done
      curl -s localhost:8091/metrics | grep -v "^#" | grep -i "ttsbench\|serving\|frames" | head -40 >> "$OUT/serve-$task.log"
      kill $pid; wait $pid 2>/dev/null
    done
    ;;
  peers)
    say peers
    if [ -x .peer-bench/run_device.sh ] || [ -f .peer-bench/run_device.sh ]; then
      BATCHES=${BATCHES:-1} BENCH_ARGS=${BENCH_ARGS:-"--frames 125 --chunks 8 --official-reps 1 --reps 2 --decode-reps 2"} \
        LIM_FASTB=${LIM_FASTB:-150} LIM_OFFICIAL=${LIM_OFFICIAL:-150} OUT=$OUT/peers \
        bash .peer-bench/run_device.sh ${PEER_STAGES:-fastB official} 2>&1 | tail -40
      for f in "$OUT"/peers/*.json; do cp "$f" "$OUT/peer-$(basename "$f")"; done
      rm -rf "$OUT/peers"
    else
      echo "no .peer-bench/ in the checkout: copy /work/shared/peer-bench there (see its README)"
    fi
    ;;
  table)
    say table
    python3 benchmarks/gpu_table.py "$OUT" "$WORK/runs" | tee "$OUT/table.md"
    ;;
  cache)
    say cache
    bash benchmarks/compile_cache.sh pack "$OUT/compile-cache.tar.xz"
    ;;
  *) echo "unknown stage $stage";;
  esac
done
[ -n "$clocks" ] && kill $clocks 2>/dev/null  # before the archive: the file is complete
# what comes back from a lent GPU is a few files: everything raw in one archive, the table beside it
(cd "$OUT" && tar -czf raw.tgz --exclude raw.tgz --exclude table.md --exclude decode.log \
  --exclude compile-cache.tar.xz * && find . -maxdepth 1 -type f ! -name raw.tgz ! -name table.md \
  ! -name decode.log ! -name compile-cache.tar.xz -delete)
say done
