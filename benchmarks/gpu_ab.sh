#!/bin/bash
# A/B of two trees on one GPU in one device call: this checkout ("new") and a packed earlier revision ("base"),
# each through benchmarks/gpu_bench.sh with the same knobs, one after the other on the same machine, so a change's
# effect is not mixed with a machine's or a session's drift (docs/performance.md records such pairs).
#
#   bash benchmarks/gpu_ab.sh pack REV          # here: .ab/base.tgz, REV's tree (git archive; no docs, no tests)
#   bash benchmarks/gpu_ab.sh run [stages]      # on the GPU, carrying .ab: gpu_bench.sh [stages] for each variant
#
# Knobs (environment): VARIANTS (order of the runs; default "new base"; e.g. "new base new base" alternates),
# OUT (default /tmp/gpu_ab), and every gpu_bench.sh knob (LEVELS, TASKS, SETS, SIZE, SERVE_ARGS, DECODE_ARGS,
# COMPILE_CACHE, ...).
# Results: $OUT/<variant>[-<i>]/ as gpu_bench.sh leaves them (table.md, raw.tgz), $OUT/<variant>[-<i>].log its
# output; .ab/rev names the base revision. The variants share gpu_bench.sh's work folder, so the random checkpoints
# the first one writes serve both; a base from before `--text-vocab` (378e361) names its checkpoints without the
# vocabulary's suffix, so they are linked to the real-vocabulary ones already written (unless TEXT_VOCAB=small).
# Each `serve` stage starts a server: ~200 s on a machine that has compiled before, ~330 s on a fresh one, so two
# variants' serve stages may not fit one 10-minute device call: run VARIANTS=new, then VARIANTS=base on the same
# (still warm) machine.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
mode=${1:-}
shift || true
case $mode in
pack)
  rev=${1:?usage: gpu_ab.sh pack REV}
  mkdir -p .ab
  git archive "$rev" -- . ':!docs' ':!tests' | gzip > .ab/base.tgz || exit 1
  git rev-parse --short "$rev" > .ab/rev
  echo "packed $(cat .ab/rev) into .ab/base.tgz ($(du -k .ab/base.tgz | cut -f1) KiB)"
  ;;
run)
  if [ ! -f .ab/base.tgz ]; then
    echo "no .ab/base.tgz: run 'bash benchmarks/gpu_ab.sh pack REV' first, then carry .ab"; exit 2
  fi
  OUT=${OUT:-/tmp/gpu_ab}; mkdir -p "$OUT"
  source benchmarks/compile_cache.sh  # both trees compile into one cache folder, seeded from COMPILE_CACHE
  base=/tmp/gpu_ab_base; rm -rf "$base"; mkdir -p "$base"
  tar -xzf .ab/base.tgz -C "$base"
  [ -d .peer-bench ] && cp -r .peer-bench "$base/"
  echo "base: $(cat .ab/rev 2>/dev/null || echo '?'); stages: ${*:-gpu_bench.sh defaults}"
  old_names=; grep -q TEXT_VOCAB "$base/benchmarks/gpu_bench.sh" || [ "${TEXT_VOCAB:-}" = small ] || old_names=1
  declare -A seen=()
  for v in ${VARIANTS:-new base}; do
    case $v in new) dir=$ROOT;; base) dir=$base;; *) echo "unknown variant $v (new or base)"; continue;; esac
    if [ "$v" = base ] && [ -n "$old_names" ]; then
      for ck in /tmp/gpu_bench_work/ckpt-*-qwen-vocab; do  # the base's names for the checkpoints written so far
        [ -d "$ck" ] && ln -sfn "$ck" "${ck%-qwen-vocab}" && echo "base predates --text-vocab: ${ck%-qwen-vocab} -> $ck"
      done
    fi
    seen[$v]=$(( ${seen[$v]:-0} + 1 ))
    name=$v; [ "${seen[$v]}" -gt 1 ] && name=$v-${seen[$v]}
    echo "##### $name ($(date -u +%T))"
    OUT=$OUT/$name bash "$dir/benchmarks/gpu_bench.sh" "$@" 2>&1 | grep --line-buffered -v "^W[0-9]" \
      | tee "$OUT/$name.log" | grep --line-buffered "^===\|^  \(custom\|clone\)\|^|"
  done
  ;;
*)
  echo "usage: bash benchmarks/gpu_ab.sh pack REV | run [stages]"; exit 2
  ;;
esac
