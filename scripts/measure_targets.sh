#!/usr/bin/env bash
# Re-measure the open targets of docs/benchmarks.md ("Where the targets stand") on a CUDA machine, one
# part per call (each fits the device machine's 10-minute command limit; minutes measured on the H200).
#
#   scripts/measure_targets.sh PART [OUTDIR]
#
# PART:
#   tests      make device-test                                                      (~4 min)
#   engine     4b-like decode/prefill, tiers gpu and host, top kernels (no HF peer: its compile alone
#              takes minutes; the peer target is met by 2x)                           (~5 min)
#   switches   4b-like tier gpu: the default against pdl off and against cublaslt on, batch 1 and 64 (~4 min)
#   host-4b    4b-like, ~33 GiB pinned per Engram layer vs HBM, batch 1 and 64         (~3 min)
#   host-8b    the same for 8b-like                                                   (~4 min)
#   exposure   the first Engram layer's wait inside replays, batch 64 and 256          (~1 min)
#   disk       disk tier (O_DIRECT) vs its bound and its latency floor, batch 1 and 64; then the batch-1
#              phases and one lookup's read latency back to back and after an idle gap   (~5 min)
#   disk-switch  batch 1, disk rows decoded inside the decode graphs (the default) against outside (~4 min)
#   disk-cache   batch 1 and 64, a 200 K-row hot-row cache in front of the disk tier, hit rates (~4 min);
#                then its batch-1 phases                                               (~5 min in all)
#   disk-cache-later-ab  batch 64, one cache-arm engine: the engine as built against later_at_first_read false (the
#                later table's lookup submitted before the first table's plan, not at its first read), as
#                disk-cache-switch-ab's batch-64 half                                   (~1 min)
#   disk-cache-late-ab  the same against late_caching false (a step's rows read cached before the next step's
#                lookups, not during them), then against both switches false           (~2.5 min)
#                (at 4489e50, where both were off by default, the B arms turned them on)
#   disk-cache-b64-bound  disk-cache's placement run at batch 64 only (the cache arm against its bound), so that more
#                rounds fit a call: REPEATS=N sets them (untimed; disk-cache, both batches, took 477 s at 20 rounds)
#   disk-cache-gaps  the same cache arm profiled: each step's period around its reads (read_cycle.py), host
#                phases and where the GPU idles, batch 1 with every row a hit and batch 64
#                (scripts/profile_decode_host.py --gpu-gaps), then batch 1 again in an engine built for 64
#                sequences (--max-num-seqs)                                             (~1.7 min)
#   disk-cache-callees  batch 64, the cache arm profiled twice (GIL switch interval 0.2 ms, the default, and
#                5 ms) with the callees of finishing a step's lookups (profile_decode_host.py --callees): where
#                the engine's thread spends the 4.5 ms it took at 1e2477c to cache the rows a step read    (~3 min)
#   disk-cache-b1  batch 1 only, the cache arm (every row a hit) and the same with background lookups off;
#                then both again with the interpreter's GIL switch interval left at 5 ms (ENGRAM_GIL_SWITCH_MS=5):
#                what the batch-1 step lost between b0e7cc7 (ratio 1.018) and 8da95b4 (1.156)       (~1.5 min)
#   disk-cache-b1-sized  batch 1 only, the cache arm in engines built for 1 sequence, then (a second run) for 64
#                (--max-num-seqs): at 0d2254e batch 1 lost 0-2 % in engines built for batch 1 and 7-12 % in those
#                built for batch 64, at 1e2477c 9 % and 2 %                                   (~1.6 min)
#   disk-cache-b64  batch 64 only, the cache arm (lookups beside the host work, the default) against the
#                same with its lookups inline (background_lookups false); then the GIL hand-off and two
#                layers' read schedules on this machine (scripts/gil_handoff.py, read_schedule.py)  (~7.5 min)
#   disk-cache-early-ids  batch 64 only, the cache arm (A) against the same with the next step's row ids sent
#                to the host after the step's background lookups are finished (B: early_host_ids false, the
#                order before 1609d27), interleaved, 6 rounds                                      (~6.5 min?)
#                (at 1e2477c both ran with a host-tier A and two B arms, which took over 330 s and was cut; at
#                e77e6d6 one switch's 10 rounds of 3 arms, ~18 s a sample, were cut in round 9: now 6 rounds)
#   disk-cache-switch-ab  batch 64, one cache-arm engine: the engine as built (both tables read together, since
#                ed4aa1c) against together_when_deep false (the first table alone), samples of 20 steps flipped in
#                turns with an A/A control, and each arm's read cycle (profile_decode_host.py --switch-ab: short
#                samples on the same disk minute; 66 s at b8dce89); then batch 1, its own prompts (a cache still
#                filling: some rows read), first_lookup_alone false (both tables always together) against as
#                built, samples of 40 steps (83 s)                                                       (~2.5 min)
#                (the parts disk-cache-together and disk-cache-together-bound, run until ed4aa1c, compared
#                reading together with the order before it; that order is now together_when_deep false here)
#
# REPEATS=N (environment) sets the rounds of the parts that run engram bench placement, over their own.
# OUTDIR (default $OUT, else bench/results) receives <date>-<what>-<commit>.{json,log}. ENGRAM_COMMIT
# names the commit when the tree is not a git checkout (a snapshot copied to the machine).
set -uo pipefail
cd "$(dirname "$0")/.."

parts="tests|engine|switches|host-4b|host-8b|exposure|disk|disk-switch|disk-cache|disk-cache-gaps"
parts+="|disk-cache-b1|disk-cache-b1-sized|disk-cache-b64|disk-cache-early-ids|disk-cache-callees"
parts+="|disk-cache-switch-ab|disk-cache-b64-bound|disk-cache-later-ab|disk-cache-late-ab"
usage="usage: scripts/measure_targets.sh $parts [OUTDIR]"
part=${1:?$usage}
out=${2:-${OUT:-bench/results}}
mkdir -p "$out"
commit=${ENGRAM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export ENGRAM_COMMIT=$commit
stamp="$(date +%Y-%m-%d)"
big='"tables_in_memory": true, "load_threads": 16, "table_rows": 131000000'
started=$(date +%s)

run() {  # run NAME COMMAND...: the command's output into NAME.log, its exit status reported
    local name=$1
    shift
    echo "+ $*" | tee "$out/$stamp-$name-$commit.log"
    "$@" >>"$out/$stamp-$name-$commit.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $(($(date +%s) - started)) s; log $out/$stamp-$name-$commit.log"
    return $rc
}

case $part in
tests)
    run device-test make device-test PYTEST_ARGS=-rfE
    ;;
engine)
    run engine-4b-like python3 -u -m engram bench engine --models 4b-like --tiers gpu,host \
        --batch-sizes 1,64,256 --kernels 6 --no-peer --out "$out/$stamp-engine-4b-like-$commit.json"
    ;;
switches)
    gpu='{"tier": "gpu", "lookup_overlap": true'
    run placement-switches-4b-like python3 -u -m engram bench placement --model 4b-like --a "$gpu}" \
        --b "$gpu, \"switches\": {\"pdl\": false}}" --b "$gpu, \"switches\": {\"cublaslt\": true}}" \
        --batch-sizes 1,64 --out "$out/$stamp-placement-switches-4b-like-$commit.json"
    ;;
host-4b | host-8b)
    model=${part#host-}-like
    run "placement-$model-big-b1-b64" python3 -u -m engram bench placement --model "$model" \
        --engram-config "{$big}" --a '{"tier": "gpu"}' --b '{"tier": "host", "lookup_overlap": true}' \
        --batch-sizes 1,64 --out "$out/$stamp-placement-$model-big-b1-b64-$commit.json"
    ;;
exposure)
    run exposure-host-b64-b256 python3 -u scripts/trace_lookup_overlap.py --tier host \
        --engram-config "{$big}" --steps 8 --batches 64,256 \
        --out "$out/$stamp-exposure-host-b64-b256-$commit.json"
    ;;
disk | disk-switch | disk-cache | disk-cache-gaps | disk-cache-b1 | disk-cache-b1-sized | disk-cache-b64 \
    | disk-cache-early-ids | disk-cache-callees | disk-cache-switch-ab | disk-cache-b64-bound | disk-cache-later-ab \
    | disk-cache-late-ab)
    cache=${ENGRAM_CACHE_DIR:-/tmp/engram-tables}
    disk='{"tier": "disk", "lookup_overlap": true, "options": {"io": "direct", "queue_depth": 64}'
    if [ "$part" = disk-cache-gaps ]; then  # the cache arm's tables (31 M rows a layer), profiled
        cfg='{"io": "direct", "queue_depth": 64, "cache_rows": 200000, "load_threads": 16, "table_rows": 31000000}'
        run gaps-disk-cache-4b-like-b1 python3 -u scripts/profile_decode_host.py --tier disk --cache-dir "$cache" \
            --engram-config "$cfg" --steps 40 --warm-cache --gpu-gaps
        run gaps-disk-cache-4b-like-b64 python3 -u scripts/profile_decode_host.py --tier disk --cache-dir "$cache" \
            --engram-config "$cfg" --batch 64 --steps 20 --gpu-gaps
        run gaps-disk-cache-4b-like-b1-seqs64 python3 -u scripts/profile_decode_host.py --tier disk \
            --cache-dir "$cache" --engram-config "$cfg" --steps 40 --warm-cache --gpu-gaps --max-num-seqs 64
        exit
    fi
    if [ "$part" = disk-cache-switch-ab ]; then  # per-step switches flipped in one engine (read_cycle.switch_ab)
        cfg='{"io": "direct", "queue_depth": 64, "cache_rows": 200000, "load_threads": 16, "table_rows": 31000000}'
        run switch-ab-disk-cache-4b-like-b64 python3 -u scripts/profile_decode_host.py --tier disk \
            --cache-dir "$cache" --engram-config "$cfg" --batch 64 --steps 20 --repeats 10 \
            --switch-ab '{"together_when_deep": false}' \
            --out "$out/$stamp-switch-ab-disk-cache-4b-like-b64-$commit.json"
        run switch-ab-disk-cache-4b-like-b1 python3 -u scripts/profile_decode_host.py --tier disk \
            --cache-dir "$cache" --engram-config "$cfg" --batch 1 --steps 40 --repeats 10 \
            --switch-ab '{"first_lookup_alone": false}' --out "$out/$stamp-switch-ab-disk-cache-4b-like-b1-$commit.json"
        exit
    fi
    if [ "$part" = disk-cache-later-ab ] || [ "$part" = disk-cache-late-ab ]; then  # host-side switches, one engine
        cfg='{"io": "direct", "queue_depth": 64, "cache_rows": 200000, "load_threads": 16, "table_rows": 31000000}'
        if [ "$part" = disk-cache-later-ab ]; then
            arms=('later-ab|{"later_at_first_read": false}')
        else
            arms=('late-ab|{"late_caching": false}'
                'late-later-ab|{"late_caching": false, "later_at_first_read": false}')
        fi
        for arm in "${arms[@]}"; do
            name=${arm%%|*}
            run "$name-disk-cache-4b-like-b64" python3 -u scripts/profile_decode_host.py --tier disk \
                --cache-dir "$cache" --engram-config "$cfg" --batch 64 --steps 20 --repeats 10 \
                --switch-ab "${arm#*|}" --out "$out/$stamp-$name-disk-cache-4b-like-b64-$commit.json"
        done
        exit
    fi
    if [ "$part" = disk-cache-callees ]; then  # where finishing a step's lookups spends its time
        cfg='{"io": "direct", "queue_depth": 64, "cache_rows": 200000, "load_threads": 16, "table_rows": 31000000}'
        callees='finish_lookups|admit_probed|\(admit\)|_insert|_write|to_device|gather_raw|_settle'
        for ms in 0.2 5; do
            run "callees-disk-cache-4b-like-b64-gil-${ms}ms" env ENGRAM_GIL_SWITCH_MS=$ms python3 -u \
                scripts/profile_decode_host.py --tier disk --cache-dir "$cache" --engram-config "$cfg" --batch 64 \
                --steps 20 --top 40 --callees "$callees"
        done
        exit
    fi
    placement() {  # placement NAME BATCHES [VAR=VALUE...] [--OPTION VALUE...] B_ARM...: A against each B; A is
        local name=$1 batches=$2 envs=() opts=() bs=() a='{"tier": "host", "lookup_overlap": true}'  # pinned host
        shift 2  # tables unless the option --a names another arm
        while [[ $1 == *=* && $1 != "{"* ]]; do envs+=("$1"); shift; done
        while [[ $1 == --* ]]; do
            if [ "$1" = --a ]; then a=$2; else opts+=("$1" "$2"); fi
            shift 2
        done
        for b in "$@"; do bs+=(--b "$b"); done
        [ -n "${REPEATS:-}" ] && opts+=(--repeats "$REPEATS")
        run "placement-$name-4b-like" env "${envs[@]}" python3 -u -m engram bench placement --model 4b-like \
            --cache-dir "$cache" --engram-config '{"load_threads": 16, "table_rows": 31000000}' \
            --a "$a" "${bs[@]}" "${opts[@]}" \
            --batch-sizes "$batches" --out "$out/$stamp-placement-$name-4b-like-$commit.json"
    }
    cached="${disk%\}}, \"cache_rows\": 200000}"
    case $part in
    disk-switch)  # batch 1, rows decoded inside the decode graphs (default) or outside
        placement disk-switch 1 "$disk}" "$disk, \"switches\": {\"disk_decode_in_graph\": false}}"
        ;;
    disk-cache-b1)
        for ms in 0.2 5; do  # 0.2: the default
            placement "disk-cache-b1-gil-${ms}ms" 1 ENGRAM_GIL_SWITCH_MS=$ms "$cached}" \
                "$cached, \"switches\": {\"background_lookups\": false}}"
        done
        ;;
    disk-cache-b64)
        placement disk-cache-b64 64 "$cached}" "$cached, \"switches\": {\"background_lookups\": false}}"
        run gil-handoff python3 -u scripts/gil_handoff.py "$(find "$cache" -name values.bin | head -1)" \
            --out "$out/$stamp-gil-handoff-$commit.json"
        run read-schedule python3 -u scripts/read_schedule.py "$(find "$cache" -name values.bin | head -1)" \
            --out "$out/$stamp-read-schedule-$commit.json"
        ;;
    disk-cache-b1-sized)
        for seqs in 1 64; do
            placement "disk-cache-b1-seqs$seqs" 1 --max-num-seqs $seqs "$cached}"
        done
        ;;
    disk-cache-early-ids)  # A: the cache arm as it is, B: the switch flipped
        placement disk-cache-early-ids 64 --repeats 6 --a "$cached}" \
            "$cached, \"switches\": {\"early_host_ids\": false}}"
        ;;
    disk-cache-b64-bound)
        placement disk-cache-b64-bound 64 "$cached}"
        ;;
    disk-cache)
        placement disk-cache 1,64 "$cached}"
        run profile-disk-cache-4b-like-b1 python3 -u scripts/profile_decode_host.py --tier disk --cache-dir "$cache" \
            --engram-config '{"io": "direct", "queue_depth": 64, "cache_rows": 200000}' --steps 40
        ;;
    disk)
        placement disk 1,64 "$disk}"
        run profile-disk-4b-like-b1 python3 -u scripts/profile_decode_host.py --tier disk --cache-dir "$cache" \
            --engram-config '{"io": "direct", "queue_depth": 64}' --steps 40
        run read-latency-gaps python3 -u scripts/read_latency.py "$(find "$cache" -name values.bin | head -1)" \
            --seconds 1 --gaps-ms 0,4 --depths 8,24,64
        ;;
    esac
    ;;
*)
    echo "unknown part '$part'; $usage" >&2
    exit 2
    ;;
esac
