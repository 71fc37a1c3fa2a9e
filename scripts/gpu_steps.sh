# Sourced by scripts/verify_gpu.sh and scripts/pending_gpu.sh (from the repository root, $OUT set): the
# peers' wheels on PYTHONPATH, the compile cache, and `step`, which runs one timed step into $OUT and notes
# a row of the table the caller prints last (print_summary, which then packs $OUT into one all.tgz).
# Peers carried as unpacked wheels (.whl/*.tar.xz, e.g. FlashAttention-3: carry [".whl"]) go to /tmp/site.
for archive in .whl/*.tar.xz; do
    [ -e "$archive" ] && mkdir -p /tmp/site && tar -xJf "$archive" -C /tmp/site && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export FACODEGEN_CACHE_DIR="${FACODEGEN_CACHE_DIR:-/tmp/facodegen-verify-cache}"
start=$(date +%s)
summary=()
step() {   # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, note its exit status, time and last line
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1     # -k: a step blocked on a hung kernel ignores SIGTERM
    local rc=$?
    summary+=("| $name | $rc | $(( $(date +%s) - t0 )) s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-100) |")
}
print_summary() {   # print_summary TITLE: the time since sourcing, then a row per step
    echo
    echo "$1: $(( $(date +%s) - start )) s, logs in $OUT"
    echo "| step | exit | time | last line |"
    echo "|---|---|---|---|"
    printf '%s\n' "${summary[@]}"
    pack_out
}
pack_out() {   # the device tool brings back at most 8 files from $OUT: everything goes into one $OUT/all.tgz
    (cd "$OUT" && find . -type f ! -name all.tgz ! -name '*.png' | tar -czf all.tgz -T - && \
        find . -mindepth 1 ! -name all.tgz -delete)
    echo "packed into $OUT/all.tgz ($(du -h "$OUT/all.tgz" | cut -f1))"
}
