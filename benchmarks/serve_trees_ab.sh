#!/usr/bin/env bash
# Interleaved serving runs of two source trees (a base checkout and this one) on the device machine: per round and
# tree, start `engram serve MODEL SERVE_ARGS` from that tree, drive it with LOADER's `engram bench serve --url` (one
# loader for both arms), save the load's JSON and the server's /engram/steps counters (when it has them), stop it.
#   benchmarks/serve_trees_ab.sh BASE_DIR LOADER_DIR ROUNDS NAME MODEL "SERVE_ARGS" -- BENCH_SERVE_ARGS...
set -u
base=$1 loader=$2 rounds=$3 name=$4 model=$5 serve_args=$6
shift 7
out=${OUT:-/tmp/engram-serve-ab}
mkdir -p "$out"
port=18123
for r in $(seq 1 "$rounds"); do
    for tree in base this; do
        dir=.
        [ "$tree" = base ] && dir=$base
        tag="$name-$tree-$r"
        (cd "$dir" && PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} exec python3 -u -m engram serve "$model" --port $port $serve_args) \
            >"$out/$tag-server.log" 2>&1 &
        pid=$!
        for _ in $(seq 1 600); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            kill -0 $pid 2>/dev/null || break
            sleep 1
        done
        (cd "$loader" && PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 -u -m engram bench serve --url "http://127.0.0.1:$port" --model "$model" \
            "$@" --out "$out/$tag.json") >"$out/$tag.log" 2>&1
        curl -sf "http://127.0.0.1:$port/engram/steps?since=999999999" >"$out/$tag-steps.json" || true
        echo "$tag: $(grep -E 'output_tokens_per_s|tpot_p50|ttft_p50' "$out/$tag.log" | tr -d ' \n')"
        kill -INT $pid; wait $pid 2>/dev/null
    done
done
