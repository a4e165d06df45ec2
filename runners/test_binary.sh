#!/usr/bin/env bash
# Prints the path of the release test binary of integration test TEST (tests/TEST.rs) built
# in the current directory's checkout (CARGO_TARGET_DIR honoured), building it if needed: the
# path from cargo itself, since deps/ may hold other commits' binaries of the same test.
# Used by runners/frozen_build.sh and runners/mix_carry.sh.
set -euo pipefail
name=${1:?test name, e.g. gpu_attention}
exe=$(cargo test --locked --release --test "$name" --no-run --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$name")
[ -n "$exe" ] || { echo "no $name test binary from cargo in $PWD" >&2; exit 1; }
echo "$exe"
