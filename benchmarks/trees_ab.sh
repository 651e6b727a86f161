#!/usr/bin/env bash
# Interleaved runs of one `engram` command in two source trees (a base checkout and this one), for an A/B
# between commits on the device machine: rounds of (base, this), each run writing its JSON to
# OUT/NAME-<tree>-<round>.json; the A/A control is the spread between the base tree's own rounds.
#   benchmarks/trees_ab.sh BASE_DIR ROUNDS NAME -- ENGRAM ARGS...
set -u
base=$1 rounds=$2 name=$3
shift 4
out=${OUT:-/tmp/engram-trees-ab}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
    for tree in base this; do
        dir=.
        [ "$tree" = base ] && dir=$base
        (cd "$dir" && PYTHONPATH=. python3 -u -m engram "$@" --out "$out/$name-$tree-$r.json") \
            >"$out/$name-$tree-$r.log" 2>&1
        echo "$name $tree round $r: exit $? ($(tail -c 300 "$out/$name-$tree-$r.log" | tr '\n' ' ' | tail -c 200))"
    done
done
