#!/bin/bash
# The compile caches of a GPU run (Triton's kernels, Inductor's graphs), kept under one folder so that one
# session's can seed the next one's. A fresh H100 machine's first server compiles for ~190 s (startup 247-260 s
# against 61 s for a later server on the same machine: session 40, docs/performance.md), out of a session's 30
# minutes of device time, and every fresh machine pays it again. Both caches are keyed by the kernels' and graphs'
# sources and the torch / Triton / GPU versions, so entries of changed code are compiled anew and the rest hit.
# Seeded from session 41's 6.1 MB archive (222 MB of caches), a fresh machine's first server started in 68 s
# against 286 s unseeded (docs/performance.md, thirty-fifth pass).
#
#   source benchmarks/compile_cache.sh        # exports TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (unless set)
#                                             # under $COMPILE_CACHE_DIR; seeds them from $COMPILE_CACHE (a .tar.xz
#                                             # this wrote): into a fresh folder, or into one a warm machine has
#                                             # filled since, the entries it lacks (never one compiled there), once
#                                             # per archive
#   bash benchmarks/compile_cache.sh pack F   # packs the folder into F (.tar.xz); say its size
#
# gpu_bench.sh sources it (its `cache` stage packs into $OUT/compile-cache.tar.xz), and so does gpu_ab.sh, so a
# packed base tree's gpu_bench.sh, which may predate this file, compiles into the same folder.
COMPILE_CACHE_DIR=${COMPILE_CACHE_DIR:-/tmp/gpu_bench_work/cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$COMPILE_CACHE_DIR/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$COMPILE_CACHE_DIR/inductor}

# A machine that compiled part of a run before its call ended (session 43: a clone server still compiling at the
# call's limit) keeps that in the folder; an archive packed on another machine since holds the rest, so both count.
compile_cache_seed() {
  [ -n "${COMPILE_CACHE:-}" ] || return 0
  if [ ! -f "$COMPILE_CACHE" ]; then
    echo "COMPILE_CACHE=$COMPILE_CACHE: no such file; compiling from nothing"; return 0
  fi
  local stamp
  stamp=$(cksum < "$COMPILE_CACHE" | cut -d' ' -f1)
  [ "$(cat "$COMPILE_CACHE_DIR/.seeded" 2>/dev/null)" = "$stamp" ] && return 0  # this archive is in already
  mkdir -p "$COMPILE_CACHE_DIR" && tar -xJf "$COMPILE_CACHE" --skip-old-files -C "$COMPILE_CACHE_DIR" \
    && echo "$stamp" > "$COMPILE_CACHE_DIR/.seeded" \
    && echo "compile caches seeded from $COMPILE_CACHE ($(du -sm "$COMPILE_CACHE_DIR" | cut -f1) MB)"
}

compile_cache_pack() {
  local dest=${1:?usage: compile_cache.sh pack DEST.tar.xz}
  if [ ! -d "$COMPILE_CACHE_DIR" ]; then
    echo "no compile caches in $COMPILE_CACHE_DIR to pack"; return 1
  fi
  XZ_OPT=${XZ_OPT:--T0} tar -cJf "$dest" --exclude ./.seeded -C "$COMPILE_CACHE_DIR" . || return 1  # every core
  echo "packed $(du -sm "$COMPILE_CACHE_DIR" | cut -f1) MB of compile caches into $dest ($(du -k "$dest" | cut -f1) KiB)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
  case ${1:-} in
  pack) compile_cache_pack "${2:-}";;
  *) echo "usage: source benchmarks/compile_cache.sh | bash benchmarks/compile_cache.sh pack DEST.tar.xz"; exit 2;;
  esac
else
  compile_cache_seed
fi
